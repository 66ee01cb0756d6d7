"""``sparseswaps prune --finetune-steps N``: PERP after pruning in the main job; the zeros stay, the perplexity is
measured before and after, a resumed run ends with the same weights, and its options are refused where they mean
nothing."""

from __future__ import annotations

import json

import pytest
import torch

from sparseswaps_prune.cli import build_parser, job_config, main
from sparseswaps_prune.llm import job as job_module
from sparseswaps_prune.llm.job import JobConfig, run_job
from sparseswaps_prune.llm.pipeline import PruneOptions
from tests.llm.helpers import saved_tensors

SETTINGS = {"nsamples": 4, "seqlen": 32, "holdout": 1, "eval_windows": 2, "batch_size": 2}


def _config(model, **changes) -> JobConfig:
    return JobConfig(model=str(model), prune=PruneOptions(recipe="wanda"), **(SETTINGS | changes))


def _pruned(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t == 0 for name, t in tensors.items() if name.endswith("proj.weight")}


def test_the_job_fine_tunes_after_pruning_and_keeps_the_zeros(saved_tiny, tmp_path, capsys):
    plain = run_job(_config(saved_tiny), tmp_path / "plain", progress=False)
    args = ["prune", "--model", str(saved_tiny), "--recipe", "wanda", "--nsamples", "4", "--seqlen", "32",
            "--holdout", "1", "--eval-windows", "2", "--batch-size", "2", "--finetune-steps", "3", "--finetune-lr",
            "0.01", "--out", str(tmp_path / "tuned")]  # fmt: skip
    config = job_config(build_parser().parse_args(args))
    assert config == _config(saved_tiny, finetune_steps=3, finetune_lr=0.01)
    assert main([*args, "--quiet"]) == 0
    capsys.readouterr()
    report = json.loads((tmp_path / "tuned" / "report.json").read_text())
    assert report["perplexity"]["refined"] == plain["perplexity"]["refined"]  # the same pruning, measured first
    assert report["perplexity"]["finetuned"] < report["perplexity"]["refined"]
    tune = report["finetune"]
    assert tune["steps"] == 3 and len(tune["losses"]) == 3 and tune["window"] == 16 and tune["seconds"] > 0
    before, after = saved_tensors(tmp_path / "plain"), saved_tensors(tmp_path / "tuned")
    zeros_before, zeros_after = _pruned(before), _pruned(after)
    assert zeros_before.keys() == zeros_after.keys() and zeros_before
    for name, zeros in zeros_before.items():  # PERP merged: the pruned weights are still exactly zero, and no other
        assert torch.equal(zeros_after[name], zeros), name
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert any(name.endswith("proj.weight") for name in changed) and any("norm" in name for name in changed)
    assert main(["report", str(tmp_path / "tuned")]) == 0
    out = capsys.readouterr().out
    assert "| fine-tuned " in out and "fine-tune (PERP): 3 steps of 4 x 16 tokens" in out


def test_a_run_stopped_in_the_fine_tune_resumes_to_the_same_weights(saved_tiny, tmp_path, monkeypatch):
    config = _config(saved_tiny, finetune_steps=2, eval=None, eval_windows=32)
    run_job(config, tmp_path / "once", progress=False)
    real = job_module.finetune_causal_lm

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(job_module, "finetune_causal_lm", stop)
    with pytest.raises(KeyboardInterrupt):
        run_job(config, tmp_path / "twice", progress=False)
    assert not (tmp_path / "twice" / "report.json").exists()
    monkeypatch.setattr(job_module, "finetune_causal_lm", real)
    run_job(config, tmp_path / "twice", progress=False)
    once, twice = saved_tensors(tmp_path / "once"), saved_tensors(tmp_path / "twice")
    assert once.keys() == twice.keys() and all(torch.equal(once[k], twice[k]) for k in once)


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        (
            {"finetune_lr": 0.01},
            ValueError,
            r"finetune_lr \(--finetune-lr\) set the fine-tune after pruning, but "
            r"finetune_steps is 0",
        ),
        ({"finetune_rank": 4, "finetune_adapter": "lora"}, ValueError, r"finetune_adapter .*finetune_rank"),
        ({"finetune_steps": -1}, ValueError, "finetune_steps"),
        (
            {"finetune_steps": 2, "finetune_lr": float("nan")},
            ValueError,
            r"finetune_lr \(--finetune-lr\) must be a finite number",
        ),
        ({"finetune_steps": 2, "finetune_lr": 0}, ValueError, r"finetune_lr \(--finetune-lr\) must be > 0"),
        ({"finetune_steps": 2, "finetune_adapter": "dora"}, ValueError, "finetune_adapter"),
        ({"finetune_steps": 2, "finetune_rank": 0}, ValueError, "finetune_rank"),
        ({"finetune_steps": 2, "blockwise": True, "eval": None, "eval_windows": 32}, ValueError, "never holds"),
    ],
)
def test_fine_tune_options_are_checked_before_anything_runs(saved_tiny, changes, error, match):
    with pytest.raises(error, match=match):
        _config(saved_tiny, **changes).validate()
