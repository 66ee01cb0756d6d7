"""The ``sparseswaps`` command on a tiny saved model."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from sparseswaps_prune.callbacks import SparseSwapsPruning
from sparseswaps_prune.cli import build_parser, job_config, main
from sparseswaps_prune.core.spec import SPARSESWAPS_SPEC, OBSUpdate, build_spec
from sparseswaps_prune.llm.job import JobConfig
from sparseswaps_prune.llm.pipeline import PruneOptions
from sparseswaps_prune.prune import SparseSwapsMethod
from sparseswaps_prune.recipes import BLOCK_TUNE_EPOCHS, RECIPES

BEST = RECIPES["best"].spec  # the CLI's default recipe's layer spec: ALPS's mask and weights
REFIT = RECIPES["sparseswaps-refit"].spec  # Wanda -> SparseSwaps T=10 -> least-squares re-fit


def test_prune_report_eval(saved_tiny, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["prune", "--model", str(saved_tiny), "--nm", "2:4", "--nsamples", "2",
            "--seqlen", "32", "--eval-windows", "2", "--out", str(out), "--json-log"]  # fmt: skip
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["totals"]["n_swaps"] == 0  # the default recipe does not refine ALPS's mask
    config = json.loads((out / "config_sparseswaps.json").read_text())
    assert config["prune"]["spec"]["budget"]["nm"] == [2, 4]
    # the main job's defaults: ALPS's mask and weights, 2 epochs of block tuning, then 20 PERP steps; 8 held-out
    # windows for the report
    spec = config["prune"]["spec"]
    assert spec["start"]["kind"] == "alps" and spec["refine"] == {"kind": "none"}
    assert spec["weights"] == {"kind": "start", "guard": False} and config["prune"]["block_tune_epochs"] == 2
    assert config["finetune_steps"] == 20 and config["holdout"] == 8
    assert summary["totals"]["loss_final"] < summary["totals"]["loss_refined"]  # ALPS's weights beat the mask's
    assert summary["totals"]["holdout_final"] is not None
    report = json.loads((out / "report.json").read_text())  # what the result's bits depend on besides the options
    assert report["finetune"]["steps"] == 20 and len(report["finetune"]["losses"]) == 20
    assert report["perplexity"]["finetuned"] != report["perplexity"]["refined"]
    assert report["numerics"] == {
        "batch_size": config["batch_size"],
        "device": "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_threads": torch.get_num_threads(),
    }
    assert main(["report", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "perplexity: dense" in printed and "summed layer loss (held-out)" in printed
    assert (
        f"computed with: batch size {config['batch_size']}, cpu ({torch.get_num_threads()} threads), torch" in printed
    )
    args = ["eval", "--model", str(out), "--seqlen", "32", "--eval-windows", "2", "--tasks", "builtin_cloze"]
    assert main([*args, "--limit", "4"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert 0 <= result["zero_shot"]["sparseswaps_builtin_cloze"] <= 1
    assert result["perplexity"] > 1 and result["sparsity_of_proj_weights"] == pytest.approx(0.5, abs=0.01)


def test_cli_and_python_defaults_build_the_same_job():
    """``sparseswaps prune --out x`` and the README's ``run_job(JobConfig(), out)`` run the same method."""
    assert job_config(build_parser().parse_args(["prune", "--out", "x"])) == JobConfig()
    assert JobConfig().prune.spec == BEST and PruneOptions().spec == BEST and PruneOptions().recipe == "best"
    # the namesake entry points default to SparseSwaps masks only; recipe="best" runs the CLI's layer spec
    assert SparseSwapsMethod(0.6, grams=[torch.eye(2)], tensors=[]).spec == SPARSESWAPS_SPEC
    assert SparseSwapsMethod(0.6, grams=[torch.eye(2)], tensors=[], recipe="best").spec == BEST
    assert SparseSwapsPruning().spec == SPARSESWAPS_SPEC and SparseSwapsPruning(recipe="best").spec == BEST
    swaps = ["prune", "--out", "x", "--recipe", "sparseswaps-refit"]
    given = job_config(build_parser().parse_args([*swaps, "--weights", "keep", "--max-iters", "7"]))
    assert given.prune.spec == build_spec(REFIT, weights="keep", max_iters=7)
    assert given.prune.block_tune_epochs == BLOCK_TUNE_EPOCHS  # SparseSwaps' re-fit recipe tunes 3 epochs
    ridge = job_config(build_parser().parse_args([*swaps, "--ridge", "diag"]))
    assert ridge.prune.spec == build_spec(REFIT, ridge="diag") and ridge.prune.spec.weights.damp == 0.1
    recipe = job_config(build_parser().parse_args(["prune", "--out", "x", "--recipe", "alps", "--sparsity", "0.7"]))
    assert recipe.prune.spec == build_spec(RECIPES["alps"].spec, sparsity=0.7)
    assert recipe.prune.block_tune_epochs == 0  # a published recipe runs as published
    namesake = job_config(build_parser().parse_args(["prune", "--out", "x", "--recipe", "sparseswaps"]))
    assert (
        namesake.prune.spec
        == PruneOptions(recipe="sparseswaps").spec
        == SparseSwapsPruning(recipe="sparseswaps").spec
        == SPARSESWAPS_SPEC
    )
    assert namesake.prune.spec.start.name == "admm" and not namesake.prune.spec.updates_weights
    ria = job_config(build_parser().parse_args(["prune", "--out", "x", "--recipe", "sparseswaps", "--start", "ria"]))
    assert ria.prune.spec == build_spec(SPARSESWAPS_SPEC, start="ria") == SparseSwapsPruning(start="ria").spec
    tuned = job_config(
        build_parser().parse_args(["prune", "--out", "x", "--recipe", "alps", "--block-tune-epochs", "2"])
    )
    assert tuned.prune.block_tune_epochs == 2
    assert (
        job_config(build_parser().parse_args(["prune", "--out", "x", "--recipe", "alps-swaps"])).prune.block_tune_epochs
        == BLOCK_TUNE_EPOCHS
    )
    shards = job_config(build_parser().parse_args(["prune", "--out", "x", "--calib-shards", "4"]))
    assert shards == JobConfig(prune=PruneOptions(calib_shards=4))
    rows = job_config(build_parser().parse_args(["prune", "--out", "x", "--distributed", "--row-shards", "256"]))
    assert rows == JobConfig(prune=PruneOptions(row_shards=256), distributed=True)
    tune = job_config(build_parser().parse_args(["prune", "--out", "x", "--block-tune-epochs", "3", "--block-tune-lr",
                                                 "0.002"]))  # fmt: skip
    assert tune == JobConfig(prune=PruneOptions(block_tune_epochs=3, block_tune_lr=0.002))
    cosine = job_config(build_parser().parse_args(["prune", "--out", "x", "--block-tune-schedule", "cosine"]))
    assert cosine == JobConfig(prune=PruneOptions(block_tune_schedule="cosine"))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["prune", "--out", "x", "--block-tune-schedule", "linear"])
    assert PruneOptions().block_tune_epochs == 2 and BLOCK_TUNE_EPOCHS == 3  # block tuning is part of the default
    assert JobConfig().finetune_steps == 20 and JobConfig(prune=PruneOptions(recipe="alps")).finetune_steps == 0
    assert JobConfig(blockwise=True).finetune_steps == 0  # the recipe's fine-tune needs the whole model
    assert JobConfig.from_dict(JobConfig().to_dict()) == JobConfig()
    older = {k: v for k, v in JobConfig().to_dict().items() if not k.startswith("finetune")}  # before the fine-tune
    assert JobConfig.from_dict(older).finetune_steps == 0
    steps = job_config(build_parser().parse_args(["prune", "--out", "x", "--recipe", "alps", "--finetune-steps", "5"]))
    assert steps == JobConfig(prune=PruneOptions(recipe="alps"), finetune_steps=5)
    assert job_config(build_parser().parse_args(["prune", "--out", "x", "--finetune-steps", "0"])).finetune_steps == 0
    assert main(["prune", "--block-tune-epochs", "-1", "--out", "x"]) == 2


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "holds no finished run" in capsys.readouterr().err
    assert main(["prune", "--sparsity", "1.5", "--out", str(tmp_path / "x")]) == 2
    assert "[0, 1)" in capsys.readouterr().err
    # options that mean nothing for the chosen stage are refused, naming the option
    assert main(["prune", "--refine", "dsnot", "--max-iters", "5", "--out", str(tmp_path / "x")]) == 2
    assert "max_iters" in capsys.readouterr().err
    assert main(["prune", "--weights", "keep", "--guard", "--out", str(tmp_path / "x")]) == 2
    assert "guard" in capsys.readouterr().err
    swaps = ["prune", "--recipe", "sparseswaps-refit"]
    assert main([*swaps, "--objective", "refit", "--weights", "cg", "--out", str(tmp_path / "x")]) == 2
    assert "LeastSquares(solver='direct')" in capsys.readouterr().err
    # the SparseSwaps options on the default (ALPS's solution) name the fix
    assert main(["prune", "--max-iters", "25", "--out", str(tmp_path / "x")]) == 2
    assert "--refine sparseswaps" in capsys.readouterr().err
    assert main(["prune", "--start", "wanda", "--out", str(tmp_path / "x")]) == 2
    assert "--recipe sparseswaps-refit" in capsys.readouterr().err
    assert main(["prune", "--calib-shards", "0", "--out", str(tmp_path / "x")]) == 2
    assert "calib_shards must be a positive int" in capsys.readouterr().err
    assert main(["prune", "--nsamples", "4", "--calib-shards", "2", "--out", str(tmp_path / "x")]) == 2
    assert "calib_shards=2" in capsys.readouterr().err  # 4 windows in batches of 4 make one batch
    assert main(["prune", "--row-shards", "-1", "--out", str(tmp_path / "x")]) == 2
    assert "row_shards must be an int >= 0" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    with pytest.raises(SystemExit):
        main(["prune", "--nm", "2-4", "--out", str(tmp_path / "y")])


def test_weights_keep_is_the_papers_method(saved_tiny, tmp_path, capsys):
    out = tmp_path / "paper"
    args = ["prune", "--model", str(saved_tiny), "--nsamples", "2", "--seqlen", "32", "--eval-windows", "2",
            "--recipe", "sparseswaps-refit", "--max-iters", "2", "--weights", "keep", "--holdout", "0",
            "--out", str(out), "--json-log"]  # fmt: skip
    assert main(args) == 0
    t = json.loads(capsys.readouterr().out)["totals"]
    assert t["loss_final"] == t["loss_refined"] and t["holdout_refined"] is None
    config = json.loads((out / "config_sparseswaps.json").read_text())
    assert config["holdout"] == 0 and config["prune"]["spec"]["weights"] == {"kind": "keep"}


def test_prune_with_refit_and_holdout(saved_tiny, tmp_path, capsys):
    out = tmp_path / "refit"
    args = ["prune", "--model", str(saved_tiny), "--nsamples", "3", "--holdout", "2", "--weights", "ls",
            "--refine", "none", "--seqlen", "32", "--eval-windows", "2", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "final weights" in printed and "summed layer loss (held-out)" in printed
    report = json.loads((out / "report.json").read_text())
    t = report["totals"]
    assert t["n_swaps"] == 0 and t["loss_final"] <= t["loss_refined"] and t["holdout_final"] is not None
    assert report["config"]["holdout"] == 2 and report["perplexity"]["warmstart"] > 1


@pytest.mark.parametrize(
    "flags",
    [
        ["--start", "sparsegpt", "--scope", "layer", "--refine", "none", "--weights", "obs", "--holdout", "0"],
        ["--recipe", "sparseswaps-refit", "--refine", "dsnot", "--weights", "keep"],
        ["--refine", "none", "--no-guard"],
    ],
)
def test_prune_baselines_from_the_cli(saved_tiny, tmp_path, capsys, flags):
    out = tmp_path / "baseline"
    args = ["prune", "--model", str(saved_tiny), "--nsamples", "2", "--seqlen", "32", "--eval-windows", "2",
            "--out", str(out), "--quiet", *flags]  # fmt: skip
    assert main(args) == 0
    config = json.loads((out / "config_sparseswaps.json").read_text())
    spec = PruneOptions.from_dict(config["prune"]).spec
    assert spec.refine.name == flags[flags.index("--refine") + 1]
    if "obs" in flags:  # SparseGPT as published: no held-out windows, no guard unless asked for
        assert spec.weights == OBSUpdate() and config["holdout"] == 0
    assert json.loads((out / "report.json").read_text())["perplexity"]["refined"] > 1


def test_recipe_alps_swaps_from_the_cli(saved_tiny, tmp_path, capsys):
    """The alps-swaps recipe end to end: ALPS's layer-wise mask, swaps within rows under the re-fit objective."""
    out = tmp_path / "best"
    args = ["prune", "--model", str(saved_tiny), "--nsamples", "2", "--seqlen", "32", "--eval-windows", "2",
            "--recipe", "alps-swaps", "--max-iters", "3", "--out", str(out), "--json-log"]  # fmt: skip
    assert main(args) == 0
    totals = json.loads(capsys.readouterr().out)["totals"]
    assert totals["n_swaps"] > 0 and totals["loss_final"] < totals["loss_start"]
    report = json.loads((out / "report.json").read_text())
    spec = PruneOptions.from_dict(report["config"]["prune"]).spec
    assert spec == build_spec(RECIPES["alps-swaps"].spec, max_iters=3)
    rows = [layer for layer in report["layers"] if layer["name"].endswith("q_proj")]
    assert rows and all(layer["sparsity"] == pytest.approx(0.6, abs=0.01) for layer in rows)  # the layer's budget
