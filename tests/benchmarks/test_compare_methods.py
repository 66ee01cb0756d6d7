"""benchmarks/compare_methods.py: settings as build_spec options, stage labels, and the table on a tiny model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sparseswaps_prune.core.spec import build_spec
from sparseswaps_prune.llm.experiment import Experiment
from sparseswaps_prune.llm.models import TINY_VOCAB_SIZE, tiny_model
from sparseswaps_prune.llm.pipeline import PruneOptions
from sparseswaps_prune.recipes import RECIPES

REFIT = RECIPES["sparseswaps-refit"].spec  # the settings' base: Wanda -> SparseSwaps T=10 -> least-squares re-fit
BEST = RECIPES["best"].spec  # the CLI's default recipe's layer spec: ALPS's mask and weights


@pytest.fixture(scope="module")
def compare(benchmark_script):
    return benchmark_script("compare_methods")


@pytest.fixture(scope="module")
def common(benchmark_script):
    return benchmark_script("common")


def tiny_experiment(args, **config) -> Experiment:
    """A tiny random LLaMA (default: 2 blocks, hidden 64) with random calibration, held-out and evaluation ids (one
    random stream per ``--extra-eval`` text)."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, TINY_VOCAB_SIZE, (6, 32), generator=gen)
    return Experiment(
        tiny_model("llama", **config),
        None,
        tokens[:4],
        holdout_tokens=tokens[4:],
        eval_tokens=torch.randint(0, TINY_VOCAB_SIZE, (1, 128), generator=gen),
        extra_eval_tokens={text: torch.randint(0, TINY_VOCAB_SIZE, (1, 96), generator=gen) for text in args.extra_eval},
        seqlen=32,
    )


def no_experiment(args) -> Experiment:
    raise AssertionError("finished rows must be read back without building the experiment")


def test_settings_are_build_spec_options(compare, common):
    assert compare.parse_setting("start=admm,scope=layer,refine=none,weights=start,guard=false,max_iters=5") == {
        "start": "admm",
        "scope": "layer",
        "refine": "none",
        "weights": "start",
        "guard": False,
        "max_iters": 5,
    }
    assert compare.parse_setting("") == {}  # the sparseswaps-refit spec without block tuning
    # PruneOptions()
    assert compare.parse_setting("default") == {
        "recipe": "best",
        "tune": RECIPES["best"].block_tune_epochs,
    }  # PruneOptions()
    with pytest.warns(DeprecationWarning, match="renamed 'best'"):
        assert compare.parse_setting("recipe=default") == {"recipe": "best"}  # the previous release's name
    assert compare.parse_setting("recipe=alps") == {"recipe": "alps"}
    assert compare.parse_setting("refine=dsnot,dsnot_skip=none") == {"refine": "dsnot", "dsnot_skip": None}
    for bad in ("warmstart=wanda", "sparsity=0.5", "guard=maybe", "refine", "recipe=magic"):
        with pytest.raises(SystemExit):
            compare.parse_setting(bad)
    # on top of the sparseswaps-refit spec at the pattern, T from --max-iters unless given; scope=layer dropped at N:M
    assert common.setting_spec({}, "60%", REFIT.refine.max_iters) == REFIT
    # or on top of a named recipe, its T kept; N:M selects per row
    assert common.setting_spec({"recipe": "best"}, "60%", 5) == BEST
    assert common.setting_spec({"recipe": "best"}, "2:4", 5) == build_spec(BEST, nm=(2, 4))
    assert common.setting_spec({"recipe": "alps-swaps"}, "60%", 5).refine.max_iters == 25
    assert common.setting_spec({}, "70%", 5) == build_spec(REFIT, sparsity=0.7, max_iters=5)
    published = {"start": "admm", "scope": "layer", "refine": "none", "weights": "start"}
    assert common.setting_spec(published, "2:4", 25) == build_spec(
        REFIT, nm=(2, 4), start="admm", refine="none", weights="start"
    )
    assert common.setting_spec({"refine": "dsnot", "dsnot_skip": None}, "60%", 25).refine.skip is None
    with pytest.raises(ValueError, match="dsnot_skip"):
        common.setting_spec({"dsnot_skip": None}, "60%", 25)


def test_labels_name_every_stage(compare, common):
    def label(text, pattern="60%"):
        return common.label(common.setting_spec(compare.parse_setting(text), pattern, 25))

    assert label("start=admm,scope=layer,refine=none,weights=start") == "admm/layer -> none -> start weights"
    assert label("start=admm,scope=layer,refine=none,weights=start", "2:4") == "admm -> none -> start weights"
    assert label("") == "wanda -> sparseswaps T=25 -> ls"
    assert label("ridge=mean,guard=true") == "wanda -> sparseswaps T=25 -> ls damp 0.001 ridge mean (guarded)"
    assert label("start=sparsegpt,scope=layer,refine=none,weights=obs") == "sparsegpt/layer -> none -> obs"
    assert label("refine=none,damp=0.01,guard=false") == "wanda -> none -> ls damp 0.01"
    assert label("refine=dsnot,dsnot_skip=none,weights=keep") == "wanda -> dsnot (all layers) -> keep"
    assert label("objective=refit,max_iters=5") == "wanda -> sparseswaps T=5 (refit objective) -> ls"
    assert label("start=sparsegpt,start_damp=0.05,weights=alps") == (
        "sparsegpt damp 0.05 -> sparseswaps T=25 -> alps update"
    )
    preset = [
        common.options_label(common.setting_options(compare.parse_setting(text), "60%", 25))
        for text in compare.PRESETS["admm-alps"]
    ]
    assert len(set(preset)) == len(preset)


def test_owl_settings_are_pipeline_options(compare, common, tmp_path, capsys):
    setting = compare.parse_setting("profile=owl,owl_lambda=0.05,refine=none,weights=keep")
    assert setting == {"profile": "owl", "owl_lambda": 0.05, "refine": "none", "weights": "keep"}
    options = common.setting_options(setting, "70%", 25)
    spec = build_spec(REFIT, sparsity=0.7, refine="none", weights="keep")
    assert options == PruneOptions(spec=spec, sparsity_profile="owl", owl_lambda=0.05, block_tune_epochs=0)
    assert common.options_label(options) == "wanda -> none -> keep, owl M=5 lambda=0.05"
    assert common.setting_options({}, "60%", 10) == PruneOptions(spec=REFIT, block_tune_epochs=0)
    with pytest.raises(ValueError, match="nm=\\(2, 4\\)"):
        common.setting_options(setting, "2:4", 25)
    with pytest.raises(ValueError, match="owl_lambda, profile set the pipeline's block budgets"):
        common.setting_spec(setting, "60%", 25)  # layer_specs.py prunes single layers

    args = ["--out", str(tmp_path), "--patterns", "60%", "--starts", "--refiners", "--cloze-items", "0"]
    args += ["--extra", "refine=none,weights=keep", "profile=owl,refine=none,weights=keep"]
    results = compare.main(args, make_experiment=tiny_experiment)
    uniform, owl = results["60%"]
    assert [uniform["label"], owl["label"]] == ["wanda -> none -> keep", "wanda -> none -> keep, owl M=5 lambda=0.08"]
    assert owl["options"]["sparsity_profile"] == "owl" and owl["totals"] != uniform["totals"]
    again = compare.main([*args, "--report-only"], make_experiment=no_experiment)
    assert [r["totals"] for r in again["60%"]] == [uniform["totals"], owl["totals"]]


def smaller_experiment(args) -> Experiment:
    """One block, hidden 32, MLP 48: ADMM's and ALPS's iterations stay cheap on a loaded CPU."""
    return tiny_experiment(args, num_hidden_layers=1, hidden_size=32, intermediate_size=48)


def test_admm_alps_preset_on_a_tiny_model(compare, tmp_path, capsys):
    args = ["--out", str(tmp_path), "--patterns", "60%", "--starts", "--refiners", "--preset", "admm-alps"]
    args += ["--cloze-items", "0", "--max-iters", "3", "--plot", str(tmp_path / "plot.png")]
    results = compare.main(args, make_experiment=smaller_experiment)
    printed = capsys.readouterr().out
    assert list(results) == ["60%"]
    assert [r["label"] for r in results["60%"]] == [
        "admm/layer -> none -> start weights",
        "alps/layer -> none -> start weights",
        "sparsegpt/layer -> none -> obs",
        "alps/layer -> none -> start weights -> block tune 2",
        "wanda -> sparseswaps T=3 -> ls -> block tune 3",
        "admm -> sparseswaps T=3 -> ls",
        "alps -> sparseswaps T=3 -> ls",
        "alps -> none -> ls",
    ]
    for rows in results.values():
        for row in rows:
            t = row["totals"]
            assert t["loss_final"] > 0 and t["holdout_final"] > 0 and math.isfinite(row["perplexity"])
            assert t["loss_refined"] <= t["loss_start"] * (1 + 1e-9)
            assert f"| {row['label']} | {t['loss_final']:.4g} | {t['holdout_final']:.4g} |" in printed
    published = results["60%"][0]["totals"]  # ADMM's own weights lower its mask's loss with the dense weights
    assert published["loss_final"] < published["loss_refined"]
    assert (tmp_path / "plot.png").stat().st_size > 0

    # finished rows are read back without the model, with the same table
    again = compare.main([*args, "--report-only"], make_experiment=no_experiment)
    assert [r["totals"] for r in again["60%"]] == [r["totals"] for r in results["60%"]]
    assert capsys.readouterr().out.count("| 60% |") == 8


def test_rows_of_another_spec_are_not_read(compare, tmp_path, capsys):
    args = ["--out", str(tmp_path), "--patterns", "60%", "--starts", "wanda", "--refiners", "none", "sparseswaps"]
    args += ["--cloze-items", "0", "--max-iters", "2"]
    results = compare.main(args, make_experiment=tiny_experiment)
    assert [r["label"] for r in results["60%"]] == ["wanda -> none -> keep", "wanda -> sparseswaps T=2 -> keep"]
    assert "| ppl (builtin) | ppl (stdlib-prose) |" in capsys.readouterr().out  # the default extra text's column
    for row in results["60%"]:
        assert math.isfinite(row["perplexity_extra"]["stdlib-prose"]) and row["perplexity_extra"]["stdlib-prose"] > 1
        assert row["perplexity_extra"]["stdlib-prose"] != row["perplexity"]
    none, swaps = (r["totals"] for r in results["60%"])
    assert none["n_swaps"] == 0 and none["loss_final"] == none["loss_refined"] == none["loss_start"]
    assert swaps["loss_final"] == swaps["loss_refined"] <= swaps["loss_start"]
    # a row written by an earlier version (no typed spec) at the same path is skipped by --report-only ...
    path = next(tmp_path.glob("60__wanda__none__keep.json"))
    row = json.loads(path.read_text())
    path.write_text(json.dumps({**row, "options": {"warmstart": "wanda", "refine": "none", "max_iters": 0}}))
    capsys.readouterr()
    report = compare.main([*args, "--report-only"], make_experiment=no_experiment)
    assert [r["label"] for r in report["60%"]] == ["wanda -> sparseswaps T=2 -> keep"]
    assert "not run yet (--report-only): 60% wanda -> none -> keep" in capsys.readouterr().out
    # ... and re-run otherwise
    rerun = compare.main(args, make_experiment=tiny_experiment)
    assert rerun["60%"][0]["totals"]["loss_final"] == pytest.approx(none["loss_final"])
    assert json.loads(path.read_text())["options"]["spec"]["refine"]["kind"] == "none"
    # a row that lacks an evaluation text asked for now is not read either: --report-only lists it as not run
    capsys.readouterr()
    more = ["--extra-eval", "stdlib-prose", "other", "--report-only"]
    report = compare.main([*args, *more], make_experiment=no_experiment)
    assert report == {} and "not run yet (--report-only): 60% wanda -> none -> keep; 60%" in capsys.readouterr().out


def test_block_tuning_settings_are_pipeline_options(compare, common):
    default = common.setting_options(compare.parse_setting("default"), "60%", 10)
    assert default == PruneOptions()
    assert common.options_label(default) == "alps/layer -> none -> start weights -> block tune 2"
    swaps = common.setting_options(compare.parse_setting("recipe=sparseswaps-refit,tune=3"), "60%", 25)
    assert common.options_label(swaps) == "wanda -> sparseswaps T=10 -> ls -> block tune 3"  # the recipe's T
    tuned = common.setting_options(compare.parse_setting("refine=none,tune=5,tune_lr=0.003"), "60%", 25)
    assert (tuned.block_tune_epochs, tuned.block_tune_lr) == (5, 0.003)
    assert common.options_label(tuned) == "wanda -> none -> ls -> block tune 5 lr 0.003"
    # rows written before block tuning existed were not tuned: they are read as block_tune_epochs=0
    old = PruneOptions(spec=REFIT, block_tune_epochs=0).to_dict()
    del old["block_tune_epochs"], old["block_tune_lr"]
    assert PruneOptions.from_dict(old) == common.setting_options({}, "60%", REFIT.refine.max_iters)
    with pytest.raises(ValueError, match="tune set the pipeline's"):
        common.setting_spec({"tune": 5}, "60%", 25)
