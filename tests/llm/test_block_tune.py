"""Block tuning (llm/block_tune.py) on tiny random-weight models: exact zeros, the held-out choice of epoch,
the dense target stream, resume, the refusals, half precision and the fall-back to the untuned weights."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging

import pytest
import torch

from sparseswaps_prune.core.spec import SPARSESWAPS_SPEC, build_spec
from sparseswaps_prune.llm import block_tune, pipeline
from sparseswaps_prune.llm.block_tune import NOT_LOWERED, relative_error, step_lr, tune_block
from sparseswaps_prune.llm.capture import capture_block_inputs
from sparseswaps_prune.llm.job import JobConfig
from sparseswaps_prune.llm.models import tiny_model
from sparseswaps_prune.llm.pipeline import PruneOptions, finalize, prune_model
from sparseswaps_prune.modules import apply_mask, find_blocks, find_layers
from tests.llm.helpers import crash_on_call


def calib(n: int = 4, seqlen: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 3000, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def opts(epochs: int = 3, lr: float = 1e-3, **spec) -> PruneOptions:
    spec = {"weights": "ls"} | spec  # SparseSwaps with its re-fit, whatever SPARSESWAPS_SPEC's weight stage is
    return PruneOptions(
        spec=build_spec(SPARSESWAPS_SPEC, max_iters=4, **spec), block_tune_epochs=epochs, block_tune_lr=lr
    )


def pruned_block(holdout: bool = True, dtype: torch.dtype = torch.float32):
    """Block 0 of a tiny llama (in ``dtype``) with every layer's Wanda-like mask applied, its inputs and the dense
    targets."""
    model = tiny_model("llama", num_hidden_layers=1).to(dtype)
    _, blocks = find_blocks(model)
    inputs = {"fit": capture_block_inputs(model, blocks, calib(), batch_size=2)}
    if holdout:
        inputs["holdout"] = capture_block_inputs(model, blocks, calib(2, seed=1), batch_size=2)
    block = blocks[0]
    targets = {key: part.run_block(block, "cpu") for key, part in inputs.items()}
    layers = find_layers(block, prefix="model.layers.0")
    for layer in layers:
        weight = layer.dense_weight_2d()
        keep = weight.abs() >= weight.abs().median(dim=1, keepdim=True).values
        apply_mask(layer, keep)
    return block, layers, inputs, targets


def test_tuning_lowers_the_block_error_and_keeps_pruned_weights_zero():
    block, layers, inputs, targets = pruned_block()
    masks = {layer.name: layer.module.weight_mask.clone() for layer in layers}
    before = {layer.name: layer.module.weight_orig.detach().clone() for layer in layers}
    report = tune_block(block, layers, inputs, targets, index=0, epochs=5, lr=1e-3, device=torch.device("cpu"))
    assert report.holdout_after <= report.holdout_before
    assert report.best_epoch > 0 and report.fit_after < report.fit_before
    assert report.holdout_after == pytest.approx(relative_error(block, inputs["holdout"], targets["holdout"], "cpu"))
    for layer in layers:
        assert torch.equal(layer.module.weight_mask, masks[layer.name])
        orig = layer.module.weight_orig.detach()
        pruned = ~masks[layer.name].bool()
        assert torch.equal(orig[pruned], before[layer.name][pruned])  # Adam never moves a pruned entry
        assert not layer.module.weight[pruned].any()
        assert not orig.requires_grad or all(p.requires_grad for p in block.parameters())  # modes restored


def test_an_epoch_that_does_not_help_on_held_out_windows_is_not_kept():
    block, layers, inputs, targets = pruned_block()
    before = [layer.module.weight_orig.detach().clone() for layer in layers]
    report = tune_block(block, layers, inputs, targets, index=0, epochs=2, lr=10.0, device=torch.device("cpu"))
    assert report.best_epoch == 0 and report.holdout_after == report.holdout_before
    assert report.fallback == NOT_LOWERED  # the report says why the tuning was not kept
    for layer, weight in zip(layers, before, strict=True):
        assert torch.equal(layer.module.weight_orig, weight)


def test_without_held_out_windows_every_epoch_runs():
    block, layers, inputs, targets = pruned_block(holdout=False)
    report = tune_block(block, layers, inputs, targets, index=3, epochs=2, lr=1e-3, device=torch.device("cpu"))
    assert (report.block, report.best_epoch, report.holdout_before, report.holdout_after) == (3, 2, None, None)


def test_cosine_schedule_decays_the_rate_to_zero_over_all_steps():
    assert [step_lr(2e-3, "constant", t, 4) for t in range(4)] == [2e-3] * 4
    assert [step_lr(2e-3, "cosine", t, 4) for t in range(5)] == pytest.approx([2e-3, 1.7071e-3, 1e-3, 2.929e-4, 0.0],
                                                                              rel=1e-4)  # fmt: skip


def test_cosine_schedule_is_what_tuning_steps_with(monkeypatch):
    """Each Adam step runs with step_lr's rate (4 windows in batches of 2, 3 epochs: 6 steps), and the tuned
    weights differ from a constant rate's."""
    from sparseswaps_prune.llm import block_tune

    rates = []
    step = torch.optim.Adam.step

    def spy(self, *args, **kwargs):
        rates.append(self.param_groups[0]["lr"])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", spy)
    tuned = {}
    for schedule in block_tune.SCHEDULES:
        block, layers, inputs, targets = pruned_block(holdout=False)
        rates.clear()
        tune_block(block, layers, inputs, targets, index=0, epochs=3, lr=1e-3, device="cpu", schedule=schedule)
        assert rates == [step_lr(1e-3, schedule, t, 6) for t in range(6)]
        tuned[schedule] = layers[0].module.weight_orig.detach().clone()
    assert not torch.equal(tuned["constant"], tuned["cosine"])


def test_unpruned_layer_is_named():
    model = tiny_model("llama", num_hidden_layers=1)
    _, blocks = find_blocks(model)
    inputs = {"fit": capture_block_inputs(model, blocks, calib(), batch_size=2)}
    layers = find_layers(blocks[0], prefix="model.layers.0")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj"):
        tune_block(blocks[0], layers, inputs, inputs, index=0, epochs=1, lr=1e-3, device=torch.device("cpu"))


def test_pipeline_tunes_towards_the_dense_model_and_lowers_its_output_error():
    dense = tiny_model("llama", num_hidden_layers=3)
    tokens, held = calib(), calib(2, seed=1)
    plain, tuned = copy.deepcopy(dense), copy.deepcopy(dense)
    prune_model(plain, tokens, opts(epochs=0), progress=False, holdout_tokens=held)
    result = prune_model(tuned, tokens, opts(epochs=4), progress=False, holdout_tokens=held)
    finalize(plain), finalize(tuned)
    assert [t.block for t in result.block_tunes] == [0, 1, 2]
    for name, mask in result.masks.items():  # masks unchanged by tuning, zeros exact
        assert not tuned.get_submodule(name).weight[~mask].any()
    with torch.no_grad():
        want = dense(held).logits
        error = {name: float((m(held).logits - want).pow(2).sum()) for name, m in (("plain", plain), ("tuned", tuned))}
    assert error["tuned"] < error["plain"]
    # the targets are the dense model's: block 1's starting error includes what block 0 left
    assert result.block_tunes[1].holdout_before > 0


def test_interrupted_tuned_run_resumes_bit_for_bit(tmp_path):
    options, held = opts(epochs=2), None  # without held-out windows every epoch's weights are kept
    reference = tiny_model("llama", num_hidden_layers=3)
    ref = prune_model(reference, calib(), options, progress=False, holdout_tokens=held)
    finalize(reference)

    with crash_on_call(pipeline, "_prune_block", 3):
        prune_model(tiny_model("llama", num_hidden_layers=3), calib(), options, checkpoint_dir=tmp_path,
                    progress=False, holdout_tokens=held)  # fmt: skip
    assert json.loads((tmp_path / "progress.json").read_text())["next_block"] == 2
    assert (tmp_path / "inputs_fit_dense_0002.pt").is_file()
    model = tiny_model("llama", num_hidden_layers=3)
    resumed = prune_model(model, calib(), options, checkpoint_dir=tmp_path, progress=False, holdout_tokens=held)
    finalize(model)
    assert any(t.best_epoch > 0 for t in ref.block_tunes)  # the tuned weights are what the checkpoint restores
    strip = lambda tunes: [dataclasses.replace(t, seconds=0.0) for t in tunes]  # noqa: E731
    assert strip(resumed.block_tunes) == strip(ref.block_tunes)
    for (name, a), b in zip(reference.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_resume_with_other_tuning_is_refused(tmp_path):
    with crash_on_call(pipeline, "_prune_block", 1):
        prune_model(tiny_model("llama", num_hidden_layers=2), calib(), opts(epochs=2), checkpoint_dir=tmp_path,
                    progress=False)  # fmt: skip
    with crash_on_call(pipeline, "_prune_block", 2):
        prune_model(tiny_model("llama", num_hidden_layers=2), calib(), opts(epochs=2), checkpoint_dir=tmp_path,
                    progress=False)  # fmt: skip
    with pytest.raises(ValueError, match="block_tune"):
        prune_model(tiny_model("llama", num_hidden_layers=2), calib(), opts(epochs=3), checkpoint_dir=tmp_path,
                    progress=False)  # fmt: skip


@pytest.mark.parametrize(
    "epochs, lr, match",
    [(-1, 1e-3, "block_tune_epochs"), (1.5, 1e-3, "block_tune_epochs"), (2, 0.0, "block_tune_lr"),
     (2, float("nan"), "block_tune_lr"), (True, 1e-3, "block_tune_epochs")],
)  # fmt: skip
def test_bad_tuning_options_are_named(epochs, lr, match):
    with pytest.raises((TypeError, ValueError), match=match):
        PruneOptions(block_tune_epochs=epochs, block_tune_lr=lr).validate()
    with pytest.raises(ValueError, match=r"block_tune_schedule.*cosine"):
        PruneOptions(block_tune_schedule="linear").validate()


def test_options_written_before_the_schedule_existed_read_as_constant():
    data = PruneOptions(block_tune_schedule="cosine").to_dict()
    assert PruneOptions.from_dict(data).block_tune_schedule == "cosine"
    del data["block_tune_schedule"]
    assert PruneOptions.from_dict(data) == PruneOptions()


def test_tuning_with_split_windows_across_ranks_is_refused():
    config = JobConfig(prune=PruneOptions(block_tune_epochs=2, calib_shards=2), distributed=True)
    with pytest.raises(ValueError, match="--calib-shards 1"):
        config.validate()
    JobConfig(prune=PruneOptions(block_tune_epochs=0, calib_shards=2), distributed=True).validate()


# --- half precision and the fall-back to the untuned weights (issue 47, item 2) ---


def weights_of(layers) -> list[torch.Tensor]:
    return [layer.module.weight_orig.detach().clone() for layer in layers]


def test_float16_tuning_keeps_float32_adam_state_and_lowers_the_held_out_error(monkeypatch):
    """Adam in float16 rounds its eps=1e-8 to 0, so every pruned entry (zero gradient) got 0/0 = NaN and the held-out
    choice threw every epoch away; the float16 block is tuned through float32 masters (Adam's state float32 too)."""
    assert torch.tensor(1e-8, dtype=torch.float16) == 0  # the cause
    dtypes = []
    step = torch.optim.Adam.step

    def spy(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        dtypes.append({p.dtype for group in self.param_groups for p in group["params"]})
        dtypes.append({v.dtype for state in self.state.values() for k, v in state.items() if k != "step"})
        return out

    monkeypatch.setattr(torch.optim.Adam, "step", spy)
    block, layers, inputs, targets = pruned_block(dtype=torch.float16)
    before = weights_of(layers)
    report = tune_block(block, layers, inputs, targets, index=0, epochs=3, lr=1e-3, device=torch.device("cpu"))
    assert dtypes and all(d == {torch.float32} for d in dtypes)
    assert report.fallback is None and report.best_epoch > 0 and report.skipped_steps == 0
    assert report.holdout_after < report.holdout_before and report.fit_after < report.fit_before
    for layer, old in zip(layers, before, strict=True):
        orig, pruned = layer.module.weight_orig, ~layer.module.weight_mask.bool()
        assert orig.dtype == torch.float16 and torch.isfinite(orig).all()
        assert torch.equal(orig[pruned], old[pruned]) and not torch.equal(orig, old)


def test_float16_loss_scale_is_undone_and_overflowing_steps_are_skipped(monkeypatch):
    """The float16 loss scale changes nothing but which gradients underflow (the masters get unscaled gradients);
    a step whose scaled gradients overflow is skipped, and the report says so when no step was left."""
    reports = {}
    for scale in (2.0**4, 2.0**16, 2.0**60):
        monkeypatch.setattr(block_tune, "HALF_LOSS_SCALE", scale)
        block, layers, inputs, targets = pruned_block(dtype=torch.float16)
        before = weights_of(layers)
        reports[scale] = tune_block(block, layers, inputs, targets, index=0, epochs=3, lr=1e-3, device="cpu")
    assert reports[2.0**4].skipped_steps == reports[2.0**16].skipped_steps == 0
    assert reports[2.0**4].fit_after == pytest.approx(reports[2.0**16].fit_after, rel=1e-3)
    assert reports[2.0**60].skipped_steps == 6  # 2 batches x 3 epochs, each halving the scale: still too large
    assert reports[2.0**60].fallback == NOT_LOWERED + " (6 of 6 steps skipped: float16 gradients overflowed)"
    assert all(torch.equal(layer.module.weight_orig, old) for layer, old in zip(layers, before, strict=True))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_tuning_without_held_out_windows_keeps_finite_tuned_weights(dtype):
    """With --holdout 0 the last epoch is kept: in float16 its weights were NaN (and saved)."""
    block, layers, inputs, targets = pruned_block(holdout=False, dtype=dtype)
    report = tune_block(block, layers, inputs, targets, index=0, epochs=2, lr=1e-3, device=torch.device("cpu"))
    assert (report.best_epoch, report.fallback) == (2, None) and report.fit_after < report.fit_before
    assert all(torch.isfinite(layer.module.weight_orig).all() for layer in layers)


@pytest.mark.parametrize("dtype, holdout", [(torch.float32, True), (torch.float32, False), (torch.float16, True)])
def test_a_learning_rate_too_high_falls_back_to_the_untuned_weights(dtype, holdout, caplog):
    block, layers, inputs, targets = pruned_block(holdout=holdout, dtype=dtype)
    before = weights_of(layers)
    with caplog.at_level(logging.WARNING, logger=block_tune.__name__):
        report = tune_block(block, layers, inputs, targets, index=4, epochs=2, lr=1e6, device=torch.device("cpu"))
    assert report.best_epoch == 0
    assert report.fallback == "non-finite weights after epoch 1 (learning rate 1e+06 too high?)"
    assert (report.fit_after, report.holdout_after) == (report.fit_before, report.holdout_before)
    for layer, old in zip(layers, before, strict=True):
        assert torch.equal(layer.module.weight_orig, old)
    assert f"block 4: block tuning fell back to the untuned weights: {report.fallback}" in caplog.text


def test_non_finite_outputs_after_tuning_fall_back(monkeypatch, caplog):
    """Finite weights whose block outputs on the calibration windows are not finite are not kept either."""
    block, layers, inputs, targets = pruned_block(holdout=False)
    before, calls = weights_of(layers), []

    def error(*args):
        calls.append(args)
        return float("nan") if len(calls) == 2 else relative_error(*args)  # 1: before tuning, 2: after

    monkeypatch.setattr(block_tune, "relative_error", error)
    with caplog.at_level(logging.WARNING, logger=block_tune.__name__):
        report = tune_block(block, layers, inputs, targets, index=0, epochs=1, lr=1e-3, device=torch.device("cpu"))
    assert report.fallback.startswith("non-finite block outputs on the calibration windows after tuning")
    assert report.best_epoch == 0 and report.fit_after == report.fit_before
    assert all(torch.equal(layer.module.weight_orig, old) for layer, old in zip(layers, before, strict=True))
    assert "fell back" in caplog.text


def test_non_finite_targets_are_not_tuned_on(caplog):
    block, layers, inputs, targets = pruned_block()
    targets["fit"].hidden_states[0, 0, 0] = float("inf")
    before = weights_of(layers)
    with caplog.at_level(logging.WARNING, logger=block_tune.__name__):
        report = tune_block(block, layers, inputs, targets, index=0, epochs=2, lr=1e-3, device=torch.device("cpu"))
    assert report.best_epoch == 0 and "not finite before tuning" in report.fallback
    assert all(torch.equal(layer.module.weight_orig, old) for layer, old in zip(layers, before, strict=True))
    assert "fell back" in caplog.text


def test_float16_pipeline_with_every_block_tuned_leaves_finite_tuned_weights():
    """The pipeline on a float16 model without held-out windows: every block keeps its last tuned epoch, finite."""
    model = tiny_model("llama", num_hidden_layers=2).half()
    result = prune_model(model, calib(), opts(epochs=2), progress=False)
    finalize(model)
    assert [(t.best_epoch, t.fallback) for t in result.block_tunes] == [(2, None), (2, None)]
    assert all(t.fit_after < t.fit_before for t in result.block_tunes)
    for name, tensor in model.state_dict().items():
        assert torch.isfinite(tensor).all(), name


def test_pipeline_with_a_learning_rate_too_high_keeps_every_untuned_block():
    """--block-tune-lr 1e6 with every block tuned ended in an error blaming the next block's calibration activations
    ("fp16 overflow?"); now each block falls back to its untuned weights: the model of an untuned run, finite."""
    plain, tuned = tiny_model("llama", num_hidden_layers=2), tiny_model("llama", num_hidden_layers=2)
    prune_model(plain, calib(), opts(epochs=0), progress=False)
    result = prune_model(tuned, calib(), opts(epochs=2, lr=1e6), progress=False)
    finalize(plain), finalize(tuned)
    assert [t.best_epoch for t in result.block_tunes] == [0, 0]
    assert all(t.fallback.startswith("non-finite weights after epoch 1") for t in result.block_tunes)
    for (name, a), b in zip(plain.state_dict().items(), tuned.state_dict().values(), strict=True):
        assert torch.equal(a, b) and torch.isfinite(b).all(), name


def byte_tokenizer(directory) -> None:
    """Save a byte-level tokenizer (257 ids) in ``directory``: a stand-in for the packaged one, in a second."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))} | {"<eos>": 256}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<eos>").save_pretrained(directory)


def test_cli_float16_without_held_out_windows_saves_finite_tuned_weights(tmp_path):
    """`sparseswaps prune --dtype float16 --holdout 0` with block tuning saved 7 NaN tensors, exit 0."""
    from sparseswaps_prune.cli import main
    from tests.llm.helpers import saved_tensors

    model_dir, out = tmp_path / "model", tmp_path / "out"
    tiny_model("llama", hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
               vocab_size=257).save_pretrained(model_dir)  # fmt: skip
    byte_tokenizer(model_dir)
    (model_dir / "calib.txt").write_text("The quick brown fox jumps over the lazy dog. " * 20, encoding="utf-8")
    args = ["prune", "--model", str(model_dir), "--calib", str(model_dir / "calib.txt"), "--nsamples", "2",
            "--seqlen", "16", "--holdout", "0", "--dtype", "float16", "--recipe", "sparseswaps", "--max-iters", "1",
            "--backend", "torch", "--block-tune-epochs", "2", "--quiet", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    tensors = saved_tensors(out)
    assert tensors and all(t.dtype == torch.float16 for t in tensors.values())
    assert [name for name, t in tensors.items() if not torch.isfinite(t).all()] == []
    tunes = json.loads((out / "report.json").read_text())["block_tunes"]
    assert [(t["best_epoch"], t["fallback"]) for t in tunes] == [(2, None), (2, None)]
