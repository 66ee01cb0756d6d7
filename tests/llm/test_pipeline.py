"""The sequential block-wise pipeline and the main job on tiny random-weight models."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from sparseswaps_prune.core.spec import DSnoTRefine, PruneSpec, build_spec
from sparseswaps_prune.llm import pipeline
from sparseswaps_prune.llm.blocks import progress_postfix
from sparseswaps_prune.llm.job import JobConfig, run_job, summary
from sparseswaps_prune.llm.models import TINY_ARCHS, tiny_model
from sparseswaps_prune.llm.pipeline import (
    LayerReport,
    PruneOptions,
    finalize,
    masks_swapped,
    prune_model,
)
from sparseswaps_prune.modules import PrunableLayer
from sparseswaps_prune.recipes import RECIPES
from tests.llm.helpers import crash_on_call

REFIT = RECIPES["sparseswaps-refit"].spec  # Wanda -> SparseSwaps T=10 -> least-squares re-fit


def opts(include=None, exclude=None, **spec_options) -> PruneOptions:
    """Pipeline options with the default spec changed by ``spec_options`` (``build_spec``'s names)."""
    return PruneOptions(spec=build_spec(REFIT, **spec_options), include=include, exclude=exclude)


def calib(n: int = 4, seqlen: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 3000, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def weights_2d(model: nn.Module, names) -> dict[str, torch.Tensor]:
    modules = dict(model.named_modules())
    return {n: PrunableLayer(n, modules[n]).weight_2d() for n in names}


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_every_architecture_prunes_saves_and_reloads(arch, tmp_path):
    model = tiny_model(arch)
    result = prune_model(model, calib(), opts(sparsity=0.5, max_iters=5), progress=False)
    assert result.layers and all(abs(r.sparsity - 0.5) < 0.02 for r in result.layers)
    assert all(r.loss_refined <= r.loss_start + 1e-9 for r in result.layers)
    assert not any("lm_head" in r.name or "embed" in r.name for r in result.layers)
    finalize(model)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    weights = weights_2d(reloaded, [r.name for r in result.layers])
    for name, mask in result.masks.items():
        assert not weights[name][~mask].any(), name
        assert weights[name][mask].count_nonzero() == mask.sum()
    logits = reloaded(calib(1, 8)).logits
    assert torch.isfinite(logits).all()


def test_progress_postfix_reports_the_refined_and_the_final_reduction():
    def layer(start: float, refined: float, final: float) -> LayerReport:
        return LayerReport("l", 0, 2, 4, 0.5, start, refined, final, n_swaps=0, iters=0, seconds_mask=0.0)

    layers = [layer(4.0, 4.0, 1.0), layer(2.0, 1.0, 1.0)]  # an unrefined layer (ALPS's) and a refined one
    assert progress_postfix(layers) == {"refined": "25.0%", "final": "62.5%"}


def test_nm_pipeline_keeps_pattern():
    model = tiny_model("qwen2")
    result = prune_model(model, calib(), opts(nm=(2, 4), max_iters=5), progress=False)
    for mask in result.masks.values():
        assert (mask.reshape(mask.shape[0], -1, 4).sum(-1) == 2).all()


def test_masks_swapped_restores_refined_masks():
    model = tiny_model("llama")
    result = prune_model(model, calib(), opts(max_iters=10), progress=False)
    x = calib(1, 8)
    refined = model(x).logits
    with masks_swapped(model, result.warmstart_masks):
        warm = model(x).logits
    assert not torch.allclose(refined, warm)
    assert torch.equal(model(x).logits, refined)


@pytest.mark.parametrize("weights", ["keep", "ls"])
def test_resume_after_interruption_gives_identical_weights(tmp_path, weights):
    options = opts(max_iters=8, weights=weights)
    held = calib(2, seed=1)
    reference = tiny_model("llama", num_hidden_layers=3)
    ref_result = prune_model(reference, calib(), options, progress=False, holdout_tokens=held, keep_dense=True)
    finalize(reference)

    model = tiny_model("llama", num_hidden_layers=3)
    with crash_on_call(pipeline, "_prune_block", 2):
        prune_model(
            model, calib(), options, checkpoint_dir=tmp_path, progress=False, holdout_tokens=held, keep_dense=True
        )
    assert json.loads((tmp_path / "progress.json").read_text())["next_block"] == 1

    fresh = tiny_model("llama", num_hidden_layers=3)  # a restarted process reloads the dense model
    resumed = prune_model(
        fresh, calib(), options, checkpoint_dir=tmp_path, progress=False, holdout_tokens=held, keep_dense=True
    )
    finalize(fresh)
    timeless = lambda r: {k: v for k, v in asdict(r).items() if not k.startswith("seconds")}  # noqa: E731
    assert len(resumed.layers) == 21 and list(map(timeless, resumed.layers)) == list(map(timeless, ref_result.layers))
    assert resumed.dense_weights.keys() == ref_result.dense_weights.keys()
    assert all(torch.equal(resumed.dense_weights[n], w) for n, w in ref_result.dense_weights.items())
    for (name, a), b in zip(reference.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name

    with pytest.raises(ValueError, match="other options"):
        prune_model(
            tiny_model("llama", num_hidden_layers=3),
            calib(),
            opts(max_iters=3),
            checkpoint_dir=tmp_path,
            progress=False,
        )


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_refit_and_holdout_losses(arch):
    model = tiny_model(arch)
    dense = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = calib(1, 8)
    options = opts(max_iters=4, weights="ls", guard=False)
    result = prune_model(model, calib(6), options, progress=False, holdout_tokens=calib(3, seed=1), keep_dense=True)
    for r in result.layers:
        assert r.updated_rows == 1.0 and r.loss_final <= r.loss_refined * (1 + 1e-6) + 1e-9
        assert None not in (r.holdout_start, r.holdout_refined, r.holdout_final) and r.seconds_weights > 0
    modules = dict(model.named_modules())
    for name, mask in result.masks.items():
        layer = PrunableLayer(name, modules[name])
        assert not layer.weight_2d()[~mask].any()
        assert not torch.equal(layer.dense_weight_2d()[mask], result.dense_weights[name][mask])
    pruned = model(x).logits
    with masks_swapped(model, result.warmstart_masks, result.dense_weights):
        warm = model(x).logits
        for name, mask in result.warmstart_masks.items():
            layer = PrunableLayer(name, modules[name])
            assert torch.equal(layer.weight_2d(), result.dense_weights[name] * mask)
    assert torch.equal(model(x).logits, pruned) and not torch.allclose(warm, pruned)
    finalize(model)
    for n, p in model.named_parameters():
        if not any(n.startswith(name) for name in result.masks):
            assert torch.equal(p, dense[n]), n


@pytest.mark.parametrize(
    "setting",
    [
        {"start": "sparsegpt", "scope": "layer", "refine": "none", "weights": "obs"},  # SparseGPT as published
        {"start": "sparsegpt", "refine": "sparseswaps", "max_iters": 3, "weights": "keep"},
        {"start": "wanda", "refine": "dsnot", "weights": "keep"},
        {"start": "wanda", "refine": "dsnot", "nm": (2, 4), "dsnot_skip": None, "weights": "keep"},
        {"start": "ria", "refine": "none", "weights": "cg"},
        {"start": "wanda", "objective": "refit", "weights": "ls", "max_iters": 3},
        {"start": "sparsegpt", "scope": "layer", "objective": "refit", "weights": "ls", "max_iters": 3},
        {"start": "wanda", "scope": "layer", "max_iters": 3, "weights": "keep"},
    ],
)
def test_baselines_through_the_pipeline(setting):
    model = tiny_model("llama")
    setting = dict(setting)
    spec = build_spec(REFIT, **{k: v for k, v in setting.items() if k != "dsnot_skip"})
    if "dsnot_skip" in setting:
        spec = PruneSpec(budget=spec.budget, start=spec.start, refine=DSnoTRefine(skip=None), weights=spec.weights)
    result = prune_model(model, calib(), PruneOptions(spec=spec), progress=False)
    modules = dict(model.named_modules())
    for r in result.layers:
        mask = result.masks[r.name]
        if setting.get("scope") == "layer":
            assert abs(r.sparsity - 0.6) < 1e-3 and len(set(mask.sum(1).tolist())) > 1
            assert r.n_swaps > 0 or setting.get("refine") == "none"
        elif setting.get("nm"):
            assert (mask.reshape(mask.shape[0], -1, 4).sum(-1) == 2).all()
        else:
            assert len(set(mask.sum(1).tolist())) == 1
        mask_objective = setting.get("refine") != "dsnot" and setting.get("objective") != "refit"
        assert r.loss_refined <= r.loss_start * (1 + 1e-9) or not mask_objective
        if setting.get("refine") == "dsnot" and ".mlp." in r.name and "dsnot_skip" not in setting:
            assert r.n_swaps == 0 and torch.equal(mask, result.warmstart_masks[r.name])  # the original's default
        if setting["weights"] != "keep":
            assert r.loss_final < r.loss_refined
            layer = PrunableLayer(r.name, modules[r.name])
            assert not layer.weight_2d()[~mask].any()


def test_holdout_guard_keeps_only_rows_whose_refit_generalises():
    model = tiny_model("llama")
    options = opts(max_iters=2, weights="ls", damp=0.0001, guard=True)
    result = prune_model(model, calib(3), options, progress=False, holdout_tokens=calib(3, seed=1))
    assert all(r.holdout_final <= r.holdout_refined * (1 + 1e-9) for r in result.layers)
    assert any(r.updated_rows < 1 for r in result.layers) and all(0 <= r.updated_rows <= 1 for r in result.layers)
    with pytest.raises(ValueError, match="guard is an option of a weight update"):
        build_spec(REFIT, weights="keep", guard=True)


def test_layer_without_calibration_tokens_is_named():
    model = tiny_model("llama")
    model.model.layers[0].self_attn.unused_proj = nn.Linear(64, 64)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.unused_proj.*no calibration tokens"):
        prune_model(model, calib(), opts(max_iters=2), progress=False)


def test_include_exclude_patterns():
    model = tiny_model("llama")
    result = prune_model(model, calib(), opts(max_iters=2, include=["*.mlp.*"], exclude=["*down_proj"]), progress=False)
    assert sorted({r.kind for r in result.layers}) == ["gate_proj", "up_proj"]


def test_job_writes_complete_outputs_and_is_idempotent(saved_tiny, tmp_path):
    config = JobConfig(
        model=str(saved_tiny), prune=opts(max_iters=5, guard=True), nsamples=4, seqlen=32, eval_windows=4,
        batch_size=2, holdout=2,
    )  # fmt: skip
    out = tmp_path / "out"
    report = run_job(config, out, progress=False)
    for name in ("report.json", "report.csv", "report.png", "config_sparseswaps.json", "config.json"):
        assert (out / name).exists(), name
    assert not (out / ".sparseswaps_state").exists()
    assert set(report["perplexity"]) == {"dense", "warmstart", "refined", "finetuned"}  # the best recipe fine-tunes
    assert all(v > 1 for v in report["perplexity"].values())
    t = report["totals"]
    assert t["loss_refined"] <= t["loss_start"] and t["loss_final"] <= t["loss_refined"]
    assert t["holdout_final"] <= t["holdout_refined"] * (1 + 1e-9)  # guarded
    assert {"name", "d_out", "d_in", "sparsity", "loss_start", "loss_refined", "loss_final", "holdout_final",
            "n_swaps", "seconds_mask"} <= set(report["layers"][0])  # fmt: skip
    assert (out / "report.csv").read_text().splitlines()[0].split(",")[5:8] == [
        "loss_start", "loss_refined", "loss_final"
    ]  # fmt: skip
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    q = reloaded.model.layers[0].self_attn.q_proj.weight
    assert abs(float((q == 0).float().mean()) - 0.6) < 0.02
    assert "perplexity" in summary(report) and "-> refined mask" in summary(report)
    unrefined = {**report, "config": {**report["config"], "prune": PruneOptions().to_dict()}}  # the default: none
    assert "-> refined mask" not in summary(unrefined) and "start mask" in summary(unrefined)
    assert [t["block"] for t in report["block_tunes"]] == [0, 1]  # the default tunes every block
    assert all(t["holdout_after"] <= t["holdout_before"] for t in report["block_tunes"])
    assert "block tuning (2 blocks)" in summary(report)
    older = {key: value for key, value in report.items() if key != "numerics"}  # written before numerics were
    assert "computed with" in summary(report) and "computed with" not in summary(older)
    assert run_job(config, out, progress=False) == json.loads((out / "report.json").read_text())
    other = JobConfig(model=str(saved_tiny), prune=opts(max_iters=1), nsamples=4, seqlen=32)
    with pytest.raises(ValueError, match="another --out"):
        run_job(other, out, progress=False)


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"model": "/no/such/model-dir"}, (FileNotFoundError, ValueError, OSError), "no/such"),
        ({"prune": PruneOptions(gram_dtype="float16")}, ValueError, "gram_dtype"),
        ({"seqlen": 100000}, ValueError, "context"),
        ({"calib": "EMPTY"}, ValueError, "empty|no text|tokens"),
        ({"nsamples": 0}, ValueError, "nsamples"),
    ],
)
def test_job_bad_input_writes_nothing_complete(saved_tiny, tmp_path, overrides, error, match):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    fields = {"model": str(saved_tiny), "nsamples": 2, "seqlen": 16, "eval_windows": 2} | overrides
    if fields.get("calib") == "EMPTY":
        fields["calib"] = str(empty)
    out = tmp_path / "out"
    with pytest.raises(error, match=match):
        run_job(JobConfig(**fields), out, progress=False)
    assert not (out / "report.json").exists() and not (out / "config.json").exists()


@pytest.mark.slow
def test_default_model_end_to_end(tmp_path):
    """The real SmolLM2-135M through the main job with small settings (about a minute on 2 CPU cores)."""
    options = opts(max_iters=3, include=["model.layers.0.*", "model.layers.29.mlp.*"])
    config = JobConfig(prune=options, nsamples=2, seqlen=64, eval_windows=4, batch_size=2)
    report = run_job(config, tmp_path / "out", progress=False)
    ppl = report["perplexity"]
    assert 1 < ppl["dense"] < ppl["refined"] < ppl["warmstart"] * 1.5
    assert len(report["layers"]) == 10
    assert report["totals"]["loss_final"] < report["totals"]["loss_refined"] < report["totals"]["loss_start"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    down = reloaded.model.layers[29].mlp.down_proj.weight
    assert abs(float((down == 0).float().mean()) - 0.6) < 0.01
    assert float((reloaded.model.layers[5].mlp.down_proj.weight == 0).float().mean()) < 0.01


def test_finished_blocks_leave_no_masked_weight_on_the_compute_device(monkeypatch):
    moved = []
    original = pipeline._to_cpu

    def spy(block, layers):
        for layer in layers:
            layer.module.weight = layer.module.weight.to("meta")  # stands in for a tensor left on the GPU
        original(block, layers)
        moved.extend(layer.module.weight.device.type for layer in layers)

    monkeypatch.setattr(pipeline, "_to_cpu", spy)
    prune_model(tiny_model("llama"), calib(), opts(max_iters=1), progress=False)
    assert moved and set(moved) == {"cpu"}
