"""OWL block budgets in the pipeline (sparsity_profile="owl"): per-block sparsities, resume, refusals, the
block-wise path, gloo ranks, CLI."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict

import pytest
import torch
import torch.multiprocessing as mp
from accelerate import cpu_offload
from accelerate.utils.modeling import get_state_dict_offloaded_model
from transformers import AutoModelForCausalLM

from sparseswaps_prune.cli import build_parser, job_config
from sparseswaps_prune.core.spec import build_spec
from sparseswaps_prune.llm import owl as llm_owl
from sparseswaps_prune.llm import pipeline
from sparseswaps_prune.llm.job import JobConfig
from sparseswaps_prune.llm.models import tiny_model
from sparseswaps_prune.llm.pipeline import PruneOptions, block_options, finalize, prune_model
from sparseswaps_prune.llm.streaming import prune_checkpoint
from sparseswaps_prune.modules import find_blocks
from sparseswaps_prune.recipes import RECIPES
from tests.llm.helpers import crash_on_call, saved_tensors

N_BLOCKS = 4

REFIT = RECIPES["sparseswaps-refit"].spec  # Wanda -> SparseSwaps T=10 -> least-squares re-fit


def calib(n: int = 4, seqlen: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 3000, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def owl(lam: float = 0.08, **spec_options) -> PruneOptions:
    spec = build_spec(REFIT, **({"sparsity": 0.5, "max_iters": 3} | spec_options))
    return PruneOptions(spec=spec, sparsity_profile="owl", owl_lambda=lam)


def model() -> torch.nn.Module:
    return tiny_model("llama", num_hidden_layers=N_BLOCKS)


def timeless(report) -> dict:
    return {k: v for k, v in asdict(report).items() if not k.startswith("seconds")}


@pytest.mark.parametrize("scope", ["row", "layer"])
def test_owl_budgets_average_the_target_and_differ_across_blocks(scope):
    options = owl(scope=scope)
    dense = model()
    before = {k: v.clone() for k, v in dense.state_dict().items()}
    name, blocks = find_blocks(dense)
    sparsities = [o.spec.budget.sparsity for o in block_options(dense, blocks, name, calib(), options, "cpu", 2, False)]
    assert sum(sparsities) / N_BLOCKS == pytest.approx(0.5, abs=1e-12)
    assert max(sparsities) - min(sparsities) == pytest.approx(2 * 0.08, abs=1e-12)  # the blocks differ
    assert all(torch.equal(v, before[k]) for k, v in dense.state_dict().items())  # the pre-pass changes nothing

    result = prune_model(dense, calib(), options, batch_size=2, progress=False)
    for index, target in enumerate(sparsities):
        reports = [r for r in result.layers if r.block == index]
        assert len(reports) == 7
        for r in reports:  # each row (or layer) keeps its count of d_in - round(s * d_in) (of the layer's weights)
            assert r.sparsity == pytest.approx(target, abs=1 / (r.d_in if scope == "row" else r.d_in * r.d_out))
            assert r.sparsity == pytest.approx(1 - result.masks[r.name].float().mean().item())


def test_offloaded_model_gets_the_same_budgets():
    """A model whose weights accelerate offloads: each block is materialised for the pre-pass and written back."""

    def sparsities(dense: torch.nn.Module) -> list[float]:
        name, blocks = find_blocks(dense)
        return [o.spec.budget.sparsity for o in block_options(dense, blocks, name, calib(), owl(), "cpu", 2, False)]

    in_memory = model()
    offloaded = cpu_offload(model(), execution_device="cpu")
    assert offloaded.model.layers[0].self_attn.q_proj.weight.is_meta
    assert sparsities(offloaded) == sparsities(in_memory)
    state = get_state_dict_offloaded_model(offloaded)
    assert all(torch.equal(state[k], v) for k, v in in_memory.state_dict().items())


def test_uniform_runs_no_pre_pass_and_zero_lambda_equals_uniform(monkeypatch):
    uniform = PruneOptions(spec=build_spec(REFIT, sparsity=0.5, max_iters=3))
    flat = owl(lam=0.0)
    reference = model()
    with monkeypatch.context() as patch:
        patch.setattr(llm_owl, "capture_block_inputs", lambda *a, **k: pytest.fail("uniform ran the OWL pre-pass"))
        expected = prune_model(reference, calib(), uniform, batch_size=2, progress=False)
    finalize(reference)
    other = model()
    result = prune_model(other, calib(), flat, batch_size=2, progress=False)
    finalize(other)
    assert list(map(timeless, result.layers)) == list(map(timeless, expected.layers))
    for (name, a), b in zip(reference.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_resume_recomputes_the_same_budgets(tmp_path):
    options = owl(weights="ls")
    reference = model()
    expected = prune_model(reference, calib(), options, batch_size=2, progress=False)
    finalize(reference)

    with crash_on_call(pipeline, "_prune_block", 3):
        prune_model(model(), calib(), options, batch_size=2, checkpoint_dir=tmp_path, progress=False)
    assert json.loads((tmp_path / "progress.json").read_text())["next_block"] == 2

    fresh = model()  # a restarted process reloads the dense model
    resumed = prune_model(fresh, calib(), options, batch_size=2, checkpoint_dir=tmp_path, progress=False)
    finalize(fresh)
    assert list(map(timeless, resumed.layers)) == list(map(timeless, expected.layers))
    for (name, a), b in zip(reference.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="owl_lambda"):  # the options, OWL's included, are in the fingerprint
        prune_model(model(), calib(), owl(lam=0.05), batch_size=2, checkpoint_dir=tmp_path, progress=False)


def test_refusals_name_the_option_before_anything_is_modified(tmp_path):
    with pytest.raises(ValueError, match=r"sparsity_profile='owl' .* nm=\(2, 4\); use sparsity="):
        PruneOptions(spec=build_spec(REFIT, nm=(2, 4)), sparsity_profile="owl").validate()
    bad_options = {"sparsity_profile": "OWL", "owl_m": 0.0, "owl_lambda": -0.1}
    for (name, value), match in zip(
        bad_options.items(), ["must be one of", "must be > 0", "must be >= 0"], strict=True
    ):
        with pytest.raises(ValueError, match=f"{name} {match}"):
            PruneOptions(**{name: value}).validate()
    dense = model()
    before = {k: v.clone() for k, v in dense.state_dict().items()}
    with pytest.raises(ValueError, match=r"owl_lambda=0.3 .* use owl_lambda below"):
        prune_model(dense, calib(), owl(lam=0.3, sparsity=0.2), batch_size=2, progress=False)
    source = tmp_path / "src"
    model().save_pretrained(source)
    with pytest.raises(ValueError, match=r"owl_lambda=0.3 .* use owl_lambda below"):  # block-wise: nothing written
        prune_checkpoint(source, tmp_path / "out", calib(), owl(lam=0.3, sparsity=0.2), progress=False)
    assert not (tmp_path / "out").exists()
    assert not any(hasattr(m, "weight_mask") for m in dense.modules())
    assert all(torch.equal(v, before[k]) for k, v in dense.state_dict().items())
    JobConfig(prune=owl(), distributed=True).validate()  # OWL goes with ranks and with the block-wise path


def test_blockwise_owl_equals_in_memory_and_resumes(tmp_path):
    """The block-wise path reads each block once more for OWL's pre-pass: same budgets, same saved tensors and
    reports as the in-memory path; a call stopped after block 1 resumes to the same files."""
    options = owl(weights="ls")
    model().save_pretrained(tmp_path / "src")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "src").eval()
    expected = prune_model(reference, calib(), options, batch_size=2, progress=False)
    finalize(reference)
    reference.save_pretrained(tmp_path / "mem")

    def stream(out: str, **kwargs):
        return prune_checkpoint(tmp_path / "src", tmp_path / out, calib(), options, batch_size=2, progress=False,
                                **kwargs)  # fmt: skip

    streamed = stream("stream")
    assert list(map(timeless, streamed.layers)) == list(map(timeless, expected.layers))
    assert len({r.sparsity for r in streamed.layers if r.name.endswith("q_proj")}) == N_BLOCKS  # own budgets
    mem, out = saved_tensors(tmp_path / "mem"), saved_tensors(tmp_path / "stream")
    assert mem.keys() == out.keys() and all(torch.equal(mem[k], v) for k, v in out.items())

    with crash_on_call(pipeline, "_process_block", 3):
        stream("resumed", checkpoint_dir=tmp_path / "ckpt")
    resumed = stream("resumed", checkpoint_dir=tmp_path / "ckpt")
    assert list(map(timeless, resumed.layers)) == list(map(timeless, expected.layers))
    again = saved_tensors(tmp_path / "resumed")
    assert all(torch.equal(mem[k], v) for k, v in again.items())


def owl_shards() -> PruneOptions:
    """OWL with the windows in 2 shards, one per rank (block tuning, which needs all windows, off)."""
    return dataclasses.replace(owl(), calib_shards=2, block_tune_epochs=0)


def _owl_ranks_worker(rank: int, world_size: int, tmp: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world_size)
    try:
        options = owl_shards()
        dense = AutoModelForCausalLM.from_pretrained(f"{tmp}/src").eval()
        result = prune_model(dense, calib(), options, batch_size=2, distributed=True, progress=False)
        finalize(dense)
        streamed = prune_checkpoint(f"{tmp}/src", f"{tmp}/stream", calib(), options, batch_size=2, distributed=True,
                                    progress=False)  # fmt: skip
        out = {"state": dense.state_dict(), "layers": result.layers, "stream_layers": streamed.layers}
        torch.save(out, f"{tmp}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_with_owl_equal_one_process(tmp_path):
    """Every rank runs OWL's pre-pass on all windows (each forwards only its shard of them after): in memory and
    block-wise, the ranks end with the weights and reports of one process with the same calib_shards."""
    model().save_pretrained(tmp_path / "src")
    options = owl_shards()
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "src").eval()
    expected = prune_model(reference, calib(), options, batch_size=2, progress=False)
    finalize(reference)
    mp.spawn(_owl_ranks_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    state = reference.state_dict()
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert all(torch.equal(got["state"][k], v) for k, v in state.items())
        assert list(map(timeless, got["layers"])) == list(map(timeless, expected.layers))
        assert list(map(timeless, got["stream_layers"])) == list(map(timeless, expected.layers))
    reference.save_pretrained(tmp_path / "mem")
    mem, out = saved_tensors(tmp_path / "mem"), saved_tensors(tmp_path / "stream")
    assert mem.keys() == out.keys() and all(torch.equal(mem[k], v) for k, v in out.items())


def test_cli_flags_reach_the_job_config():
    def config(*flags: str) -> JobConfig:
        return job_config(build_parser().parse_args(["prune", "--out", "x", *flags]))

    assert config("--sparsity-profile", "uniform") == JobConfig()
    given = config("--sparsity", "0.7", "--sparsity-profile", "owl", "--owl-m", "7", "--owl-lambda", "0.1")
    assert given.prune == PruneOptions(
        spec=build_spec(RECIPES["best"].spec, sparsity=0.7), sparsity_profile="owl", owl_m=7.0, owl_lambda=0.1
    )
    assert config("--sparsity-profile", "owl").prune == PruneOptions(sparsity_profile="owl")
    assert "(OWL M=7 lambda=0.1)" in given.prune.describe()
    with pytest.raises(ValueError, match="--owl-lambda set OWL's budgets: add --sparsity-profile owl"):
        config("--owl-lambda", "0.1")
