"""benchmarks/prune_time_ab.py: one block of the default model prints the line the A/B reads, from the run."""

from __future__ import annotations

import re

import pytest
import torch

from sparseswaps_prune.llm.models import tiny_model


def test_one_block_with_a_checkpoint(benchmark_script, capsys, default_lm, monkeypatch):
    from sparseswaps_prune.recipes import RECIPES

    bench = benchmark_script("prune_time_ab")

    def load_model(name, dtype):  # a tiny llama (the default model's block takes 80-130 s) and the real tokenizer
        assert name is None and dtype == torch.float32
        return tiny_model("llama"), default_lm[1]  # the session's tokenizer

    runs = []

    def prune_model(*args, **kwargs):  # the pipeline's, recording what it ran and returned
        runs.append((args[2], kwargs, prune(*args, **kwargs)))
        return runs[-1][2]

    prune = bench.pipeline.prune_model
    monkeypatch.setattr(bench, "load_model", load_model)
    monkeypatch.setattr(bench.pipeline, "prune_model", prune_model)
    with pytest.raises(SystemExit, match="MODE must be"):
        bench.main(["1", "fast"])
    bench.main(["1", "default", "ckpt"])
    line = capsys.readouterr().out
    found = re.search(r"K=1 mode=default ckpt=True prune_model ([0-9.]+) s, final ([0-9.e+]+)", line)
    assert found, line
    ((options, kwargs, result),) = runs
    assert options.spec == RECIPES["best"].spec and options.include == ["model.layers.0.*"]
    assert kwargs["checkpoint_dir"] is not None and kwargs["keep_dense"]
    assert len(result.layers) == 7 and all(layer.name.startswith("model.layers.0.") for layer in result.layers)
    final = sum(layer.loss_final for layer in result.layers)
    assert found.group(2) == f"{final:.6e}"  # the printed loss is the pruned block's
    assert final < sum(layer.loss_start for layer in result.layers)  # ALPS's weights beat its mask's
