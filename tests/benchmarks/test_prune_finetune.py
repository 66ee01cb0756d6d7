"""benchmarks/prune_finetune.py: pruned, then PERP fine-tuned rows on a tiny model; the mask check; resuming."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from sparseswaps_prune.llm.experiment import Experiment
from tests.benchmarks.test_compare_methods import no_experiment, tiny_experiment

SETTINGS = ["start=wanda,refine=none,weights=keep", "weights=keep"]
LABELS = ["wanda -> none -> keep", "wanda -> sparseswaps T=2 -> keep"]
# the tiny experiment's calibration is [4, 32]: --nsamples and --seqlen say so (they are recorded with the rows)
TINY = ["--pattern", "60%", "--settings", *SETTINGS, "--max-iters", "2", "--nsamples", "4", "--seqlen", "32"]
TINY += ["--steps", "2", "--batch-size", "2", "--train-seqlen", "16", "--rank", "4", "--lr", "1e-2"]


@pytest.fixture(scope="module")
def script(benchmark_script):
    return benchmark_script("prune_finetune")


def table(printed: str) -> list[list[str]]:
    """The cells of the printed table's ``| 60% |`` rows."""
    return [
        [c.strip() for c in line.strip("|").split("|")] for line in printed.splitlines() if line.startswith("| 60%")
    ]


def test_rows_are_pruned_then_finetuned_and_resumed(script, tmp_path, capsys, monkeypatch):
    trained_on = []
    finetune = script.finetune_causal_lm

    def recording(model, windows, **kwargs):
        trained_on.append(windows.clone())
        return finetune(model, windows, **kwargs)

    monkeypatch.setattr(script, "finetune_causal_lm", recording)
    built = []

    def experiment(args):
        built.append(tiny_experiment(args))
        return built[-1]

    args = ["--out", str(tmp_path), *TINY]
    rows = script.main(args, make_experiment=experiment)
    printed = capsys.readouterr().out
    assert [row["label"] for row in rows] == LABELS
    assert "dense: perplexity builtin " in printed and ", stdlib-prose " in printed
    assert "| ppl (builtin) pruned | ppl (stdlib-prose) pruned | ppl (builtin) fine-tuned |" in printed
    cells = table(printed)
    assert [c[1] for c in cells] == LABELS
    for row, line in zip(rows, cells, strict=True):
        pruned, tuned = (float(v) for v in line[2:4]), (float(v) for v in line[4:6])
        for before, after in zip(pruned, tuned, strict=True):
            assert math.isfinite(before) and math.isfinite(after) and before > 1 and after > 1
            assert after != before  # the fine-tune changed the model
        assert line[6] == "yes" and row["finetuned"]["mask_kept"] is True
        assert len(row["finetuned"]["losses"]) == 2
        assert row["finetuned"]["perplexity"] == pytest.approx(float(line[4]), abs=0.005)
    # trained on the calibration windows cut into 16 tokens, the same for both settings, never the evaluation text
    calib = built[0].calib_tokens
    assert len(trained_on) == 2
    for windows in trained_on:
        assert torch.equal(windows, calib.reshape(8, 16))

    # a second run reads the rows back: no model is built, so nothing is pruned
    again = script.main(args, make_experiment=no_experiment)
    assert again == rows
    assert table(capsys.readouterr().out) == cells

    # other fine-tune settings: every setting is pruned and fine-tuned again, and its row replaced
    pruned = []
    run = Experiment.run

    def counting(self, options):
        pruned.append(options)
        return run(self, options)

    monkeypatch.setattr(Experiment, "run", counting)
    more = script.main([*args[:-1], "3e-2"], make_experiment=experiment)  # --lr 3e-2
    assert len(pruned) == 2 and [row["label"] for row in more] == LABELS
    assert [row["pruned"]["perplexity"] for row in more] == pytest.approx([row["pruned"]["perplexity"] for row in rows])
    assert [row["finetuned"]["perplexity"] for row in more] != [row["finetuned"]["perplexity"] for row in rows]
    saved = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("60__*.json"))]
    assert sorted(row["config"]["finetune"]["lr"] for row in saved) == [3e-2, 3e-2]


def test_mask_kept_is_read_from_the_weights(script, benchmark_script):
    common = benchmark_script("common")
    exp = tiny_experiment(argparse.Namespace(extra_eval=[]))
    options = common.setting_options(common.parse_setting(SETTINGS[0]), "60%", 2)
    exp.run(options)
    masks = script.pruning_masks(exp.model, options)
    assert len(masks) == 14  # 2 blocks x 7 linears
    assert all(mask.float().mean().item() == pytest.approx(0.4, abs=0.02) for mask in masks.values())
    assert script.mask_kept(exp.model, options, masks)
    layer = next(layer for layer in script.check_layers(exp.model, options))
    weight, mask = layer.weight_2d(), masks[layer.name]
    row, col = (~mask).nonzero()[0].tolist()
    weight[row, col] = 0.5  # a pruned weight grows back
    assert not script.mask_kept(exp.model, options, masks)
    weight[row, col] = 0.0
    assert script.mask_kept(exp.model, options, masks)
    row, col = mask.nonzero()[0].tolist()
    weight[row, col] = 0.0  # a kept weight is zeroed
    assert not script.mask_kept(exp.model, options, masks)


def test_bad_options_stop_before_the_model_is_built(script, tmp_path):
    args = ["--out", str(tmp_path), *TINY]
    with pytest.raises(SystemExit, match="--train-seqlen 24 must be at least 2 and divide --seqlen 32"):
        script.main([*args, "--train-seqlen", "24"], make_experiment=no_experiment)
    with pytest.raises(SystemExit, match="--batch-size 9 exceeds the 8 training windows"):
        script.main([*args, "--batch-size", "9"], make_experiment=no_experiment)
    with pytest.raises(SystemExit, match="--lr must be a positive number"):
        script.main([*args, "--lr", "0"], make_experiment=no_experiment)
    with pytest.raises(SystemExit, match="setting 'start=magic'"):
        script.main([*args, "--settings", "start=magic"], make_experiment=no_experiment)
    assert not (tmp_path / "dense.json").exists()
