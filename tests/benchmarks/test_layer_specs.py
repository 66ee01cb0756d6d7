"""benchmarks/layer_specs.py: settings scored on whole layers from fixed Grams, resumable, table printed."""

from __future__ import annotations

import pytest
import torch

from sparseswaps_prune.core.gram import GramAccumulator
from sparseswaps_prune.core.layer import prune_layer
from sparseswaps_prune.recipes import RECIPES


@pytest.fixture(scope="module")
def layer_specs(benchmark_script):
    return benchmark_script("layer_specs")


def tiny_grams(blocks, small, large, holdout, seqlen):
    """Two random layers with correlated inputs: weights and ``{"small", "holdout"}`` Grams."""
    gen = torch.Generator().manual_seed(sum(blocks))
    weights, grams = {}, {}
    for i, (d_out, d_in) in enumerate([(12, 24), (8, 16)]):
        mix = torch.randn(d_in, d_in, generator=gen)
        parts = {}
        for part, windows in (("small", small), ("holdout", holdout)):
            acc = GramAccumulator(d_in, dtype=torch.float64)
            acc.add(torch.randn(windows * seqlen, d_in, generator=gen) @ mix)
            parts[part] = acc
        weights[f"blocks.{i}.proj"] = torch.randn(d_out, d_in, generator=gen)
        grams[f"blocks.{i}.proj"] = parts
    return weights, grams


def no_grams(*args):
    raise AssertionError("finished rows must be read back without capturing Grams")


def test_rows_score_prune_layer_and_resume(layer_specs, tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--blocks", "1", "--nsamples", "3", "--holdout", "2", "--seqlen", "8",
            "--max-iters", "4", "--settings", "default", "start=admm,scope=layer,refine=none,weights=start",
            "refine=none,weights=keep"]  # fmt: skip
    rows = layer_specs.main(argv, grams_of=tiny_grams)["60%"]
    assert [row["label"] for row in rows] == [
        "alps/layer -> none -> start weights",
        "admm/layer -> none -> start weights",
        "wanda -> none -> keep",
    ]
    weights, grams = tiny_grams([1], 3, 3, 2, 8)
    # the default row (recipe best) is prune_layer's loss of the final weights, per token
    for name, weight in weights.items():
        small, holdout = grams[name]["small"].gram, grams[name]["holdout"].gram
        out = prune_layer(weight, small, RECIPES["best"].spec, holdout_gram=holdout)
        assert rows[0]["layers"][name]["calib"] == pytest.approx(float(out.loss.final.sum()) / 24)
        assert rows[0]["layers"][name]["holdout"] == pytest.approx(float(out.holdout.final.sum()) / 16)
    # compensation lowers the calibration loss below Wanda's mask alone
    assert rows[0]["totals"]["calib"] < rows[2]["totals"]["calib"]
    assert rows[1]["totals"]["calib"] < rows[2]["totals"]["calib"]
    table = capsys.readouterr().out
    assert "| admm/layer -> none -> start weights |" in table and "+0.0%" in table

    again = layer_specs.main(argv, grams_of=no_grams)["60%"]
    assert [row["totals"] for row in again] == [row["totals"] for row in rows]
    with pytest.raises(AssertionError, match="read back"):  # other blocks: another row, re-scored
        layer_specs.main([*argv[:3], "2", *argv[4:]], grams_of=no_grams)


def test_bad_setting_names_it_before_any_work(layer_specs, tmp_path):
    with pytest.raises(SystemExit, match="unknown option 'sparsty'"):
        layer_specs.main(["--out", str(tmp_path), "--settings", "sparsty=0.5"], grams_of=no_grams)
    with pytest.raises(SystemExit, match="start=admm,objective=refit,weights=keep"):
        layer_specs.main(["--out", str(tmp_path), "--settings", "start=admm,objective=refit,weights=keep"],
                         grams_of=no_grams)  # fmt: skip
