"""Every ``sparseswaps prune`` option, in every mode (in memory, ``--blockwise``, ``--distributed``), either changes
the job it runs or raises naming the option; ``--recipe X`` runs what ``PruneOptions(recipe="X")`` runs."""

from __future__ import annotations

import argparse

import pytest

from sparseswaps_prune.cli import build_parser, job_config
from sparseswaps_prune.llm.job import JobConfig, run_job
from sparseswaps_prune.llm.pipeline import PruneOptions
from sparseswaps_prune.recipes import RECIPES
from tests.llm.helpers import saved_tensors

# A value other than the default for every option that reaches the job's config (None: a flag).
VALUES: dict[str, list[str]] = {
    "recipe": ["alps"], "sparsity": ["0.5"], "nm": ["2:4"], "scope": ["row"], "sparsity_profile": ["owl"],
    "owl_m": ["4"], "owl_lambda": ["0.05"], "start": ["wanda"], "start_damp": ["0.05"], "refine": ["sparseswaps"],
    "max_iters": ["3"], "eps": ["0.1"], "objective": ["refit"], "search_dtype": ["float64"], "backend": ["torch"],
    "swap_scope": ["row"], "weights": ["ls"], "damp": ["0.2"], "ridge": ["mean"], "guard": [],
    "block_tune_epochs": ["1"], "block_tune_lr": ["0.01"], "block_tune_schedule": ["cosine"], "include": ["*mlp*"],
    "exclude": ["*q_proj"], "gram_dtype": ["float64"], "model": ["other-model"], "gguf_file": ["x.gguf"],
    "calib": ["wikitext"], "nsamples": ["16"], "seqlen": ["128"], "calib_shards": ["2"], "holdout": ["2"],
    "eval": ["none"], "eval_windows": ["8"], "no_eval_warmstart": [], "device": ["cpu:1"], "dtype": ["bfloat16"],
    "seed": ["7"], "batch_size": ["2"], "blockwise": [], "distributed": [], "row_shards": ["256"],
    "collective_timeout": ["60"], "save_format": ["sparse"], "bench": [], "finetune_steps": ["5"],
    "finetune_lr": ["0.01"], "finetune_adapter": ["scalelora"], "finetune_rank": ["4"],
}  # fmt: skip
# Options that act outside the job's config: where it writes and how it reports.
OUTSIDE_CONFIG = {"out", "overwrite", "quiet", "json_log", "help"}


def _prune_options() -> dict[str, str]:
    """dest -> the option's flag, for every option of ``sparseswaps prune``."""
    parser = build_parser()
    prune = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["prune"]
    return {a.dest: a.option_strings[0] for a in prune._actions if a.option_strings}


def test_every_option_is_classified():
    assert set(_prune_options()) == set(VALUES) | OUTSIDE_CONFIG


def _config(args: list[str]) -> JobConfig:
    config = job_config(build_parser().parse_args(["prune", "--out", "x", *args]))
    config.validate()
    return config


@pytest.mark.parametrize("mode", ["in memory", "blockwise", "distributed"])
def test_every_option_changes_the_job_or_raises(mode, saved_tiny):
    base = {"in memory": [], "blockwise": ["--blockwise", "--model", str(saved_tiny)], "distributed": ["--distributed"]}
    base_args = base[mode]
    reference = _config(base_args).to_dict()
    flags = _prune_options()
    silent = []
    for dest, value in VALUES.items():
        flag = flags[dest]
        if flag in base_args:
            continue
        if dest == "eval" and mode == "blockwise":
            value = ["builtin"]  # the mode's own default is none
        args = [*base_args, flag, *value]
        if dest == "model" and mode == "blockwise":
            args = ["--blockwise", "--model", str(saved_tiny.parent)]  # another local directory (no weights there)
        try:
            changed = _config(args).to_dict() != reference
        except (ValueError, TypeError, OSError) as err:
            named = (flag.lstrip("-").replace("-", "_"), dest, *value)  # the option, or the bad value it was given
            assert any(name in str(err).replace("-", "_") or name in str(err) for name in named), (flag, err)
            continue
        if not changed:
            silent.append(flag)
    assert silent == [], f"options that neither change the {mode} job nor raise: {silent}"


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (
            ["--block-tune-epochs", "0", "--block-tune-lr", "0.01"],
            r"block_tune_lr \(--block-tune-lr\) set block tuning",
        ),
        (["--recipe", "alps", "--block-tune-schedule", "cosine"], r"block_tune_epochs is 0 \(the alps recipe's"),
        (["--eval", "none", "--eval-windows", "8"], r"eval_windows \(--eval-windows\) set the perplexity evaluation"),
        (["--eval", "none", "--no-eval-warmstart"], r"eval_warmstart \(--no-eval-warmstart\)"),
        (["--row-shards", "256"], r"--row-shards"),
    ],
)
def test_options_without_effect_in_their_mode_raise_naming_them(args, match):
    with pytest.raises(ValueError, match=match):
        _config(args)


def test_cli_recipe_and_python_recipe_run_the_same_job_bit_for_bit(saved_tiny, tmp_path):
    settings = {"nsamples": 4, "seqlen": 32, "holdout": 1, "eval": None, "batch_size": 2}
    for name in ("alps", "sparseswaps"):
        args = ["--recipe", name, "--model", str(saved_tiny), "--nsamples", "4", "--seqlen", "32", "--holdout", "1"]
        cli = _config([*args, "--eval", "none", "--batch-size", "2"])
        python = JobConfig(model=str(saved_tiny), prune=PruneOptions(recipe=name), **settings)
        assert cli == python, name
        assert python.prune.spec == RECIPES[name].spec
        assert python.prune.block_tune_epochs == RECIPES[name].block_tune_epochs
        run_job(cli, tmp_path / f"cli-{name}", progress=False)
        run_job(python, tmp_path / f"py-{name}", progress=False)
        got, want = saved_tensors(tmp_path / f"cli-{name}"), saved_tensors(tmp_path / f"py-{name}")
        assert got.keys() == want.keys()
        assert all(got[key].equal(want[key]) for key in got), name
