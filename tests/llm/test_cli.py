"""The ``sparseswaps`` command on a tiny saved model."""

from __future__ import annotations

import json

import pytest

from sparseswaps_prune.cli import main


def test_prune_report_eval(saved_tiny, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["prune", "--model", str(saved_tiny), "--nm", "2:4", "--max-iters", "3", "--nsamples", "2",
            "--seqlen", "32", "--eval-windows", "2", "--out", str(out), "--json-log"]  # fmt: skip
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["totals"]["loss_refined"] <= summary["totals"]["loss_warmstart"]
    config = json.loads((out / "config_sparseswaps.json").read_text())
    assert config["prune"]["nm"] == [2, 4]
    # the main job's defaults: swaps, then a re-fit guarded by 8 held-out windows
    assert config["prune"]["refit"] == "ls" and config["prune"]["holdout_guard"] and config["holdout"] == 8
    assert summary["totals"]["loss_refit"] <= summary["totals"]["loss_refined"]
    assert main(["report", str(out)]) == 0
    assert "perplexity: dense" in capsys.readouterr().out
    args = ["eval", "--model", str(out), "--seqlen", "32", "--eval-windows", "2", "--tasks", "builtin_cloze"]
    assert main([*args, "--limit", "4"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert 0 <= result["zero_shot"]["sparseswaps_builtin_cloze"] <= 1
    assert result["perplexity"] > 1 and result["sparsity_of_proj_weights"] == pytest.approx(0.5, abs=0.01)


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "holds no finished run" in capsys.readouterr().err
    assert main(["prune", "--sparsity", "1.5", "--out", str(tmp_path / "x")]) == 2
    assert "[0, 1)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["prune", "--nm", "2-4", "--out", str(tmp_path / "y")])


def test_refit_none_is_the_papers_method_without_held_out_windows(saved_tiny, tmp_path, capsys):
    out = tmp_path / "paper"
    args = ["prune", "--model", str(saved_tiny), "--nsamples", "2", "--seqlen", "32", "--eval-windows", "2",
            "--max-iters", "2", "--refit", "none", "--out", str(out), "--json-log"]  # fmt: skip
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["totals"]["loss_refit"] is None and summary["totals"]["holdout_refined"] is None
    config = json.loads((out / "config_sparseswaps.json").read_text())
    assert config["holdout"] == 0 and not config["prune"]["holdout_guard"]
    assert main([*args[:-3], "--holdout-guard", "--out", str(tmp_path / "bad")]) == 2  # guard without a re-fit
    assert "holdout_guard" in capsys.readouterr().err


def test_prune_with_refit_and_holdout(saved_tiny, tmp_path, capsys):
    out = tmp_path / "refit"
    args = ["prune", "--model", str(saved_tiny), "--nsamples", "3", "--holdout", "2", "--refit", "ls",
            "--refine", "none", "--seqlen", "32", "--eval-windows", "2", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "re-fitted weights: summed layer loss" in printed and "held-out layer loss" in printed
    report = json.loads((out / "report.json").read_text())
    t = report["totals"]
    assert t["n_swaps"] == 0 and t["loss_refit"] <= t["loss_refined"] and t["holdout_refit"] is not None
    assert report["config"]["holdout"] == 2 and report["perplexity"]["warmstart"] > 1


@pytest.mark.parametrize(
    "flags",
    [
        ["--warmstart", "sparsegpt", "--scope", "layer", "--refine", "none", "--refit", "obs"],
        ["--refine", "dsnot", "--refit", "none"],
        ["--refine", "none", "--no-holdout-guard"],
    ],
)
def test_prune_baselines_from_the_cli(saved_tiny, tmp_path, capsys, flags):
    out = tmp_path / "baseline"
    args = ["prune", "--model", str(saved_tiny), "--nsamples", "2", "--seqlen", "32", "--eval-windows", "2",
            "--out", str(out), "--quiet", *flags]  # fmt: skip
    assert main(args) == 0
    config = json.loads((out / "config_sparseswaps.json").read_text())
    assert config["prune"]["refine"] == flags[flags.index("--refine") + 1]
    if "obs" in flags:  # SparseGPT as published: no held-out windows, no guard unless asked for
        assert config["prune"]["refit"] == "obs" and not config["prune"]["holdout_guard"] and config["holdout"] == 0
    assert json.loads((out / "report.json").read_text())["perplexity"]["refined"] > 1
