"""OWL block budgets in the pipeline (sparsity_profile="owl"): per-block sparsities, resume, refusals, CLI."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch
from accelerate import cpu_offload
from accelerate.utils.modeling import get_state_dict_offloaded_model

from sparseswaps_prune.cli import build_parser, job_config
from sparseswaps_prune.core.spec import build_spec
from sparseswaps_prune.llm import budgets, pipeline
from sparseswaps_prune.llm.job import JobConfig
from sparseswaps_prune.llm.layers import find_blocks
from sparseswaps_prune.llm.models import tiny_model
from sparseswaps_prune.llm.pipeline import PruneOptions, block_options, finalize, prune_model
from sparseswaps_prune.llm.streaming import prune_checkpoint
from tests.llm.helpers import crash_on_call

N_BLOCKS = 4


def calib(n: int = 4, seqlen: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 3000, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def owl(lam: float = 0.08, **spec_options) -> PruneOptions:
    spec = build_spec(**({"sparsity": 0.5, "max_iters": 3} | spec_options))
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
    uniform = PruneOptions(spec=build_spec(sparsity=0.5, max_iters=3))
    flat = owl(lam=0.0)
    reference = model()
    with monkeypatch.context() as patch:
        patch.setattr(budgets, "capture_block_inputs", lambda *a, **k: pytest.fail("uniform ran the OWL pre-pass"))
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
        PruneOptions(spec=build_spec(nm=(2, 4)), sparsity_profile="owl").validate()
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
    with pytest.raises(ValueError, match="not supported with distributed=True"):
        prune_model(dense, calib(), owl(), distributed=True, progress=False)
    with pytest.raises(ValueError, match="not supported with the block-wise streaming path"):
        prune_checkpoint(tmp_path, tmp_path / "out", calib(), owl())
    assert not any(hasattr(m, "weight_mask") for m in dense.modules())
    assert all(torch.equal(v, before[k]) for k, v in dense.state_dict().items())
    for setting in ("blockwise", "distributed"):
        with pytest.raises(ValueError, match=f"not supported with {setting}=True"):
            JobConfig(prune=owl(), **{setting: True}).validate()


def test_cli_flags_reach_the_job_config():
    def config(*flags: str) -> JobConfig:
        return job_config(build_parser().parse_args(["prune", "--out", "x", *flags]))

    assert config("--sparsity-profile", "uniform") == JobConfig()
    given = config("--sparsity", "0.7", "--sparsity-profile", "owl", "--owl-m", "7", "--owl-lambda", "0.1")
    assert given.prune == PruneOptions(spec=build_spec(sparsity=0.7), sparsity_profile="owl", owl_m=7.0, owl_lambda=0.1)
    assert config("--sparsity-profile", "owl").prune == PruneOptions(sparsity_profile="owl")
    assert "(OWL M=7 lambda=0.1)" in given.prune.describe()
    with pytest.raises(ValueError, match="--owl-lambda set OWL's budgets: add --sparsity-profile owl"):
        config("--owl-lambda", "0.1")
