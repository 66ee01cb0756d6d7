"""benchmarks/prune_time_ab.py: one block of the default model prints the line the A/B reads."""

from __future__ import annotations

import copy
import re

import pytest
import torch


def test_one_block_with_a_checkpoint(benchmark_script, capsys, default_lm, monkeypatch):
    bench = benchmark_script("prune_time_ab")

    def load_model(name, dtype):  # the session's copy of the default model (loading it again takes 15-50 s)
        assert name is None and dtype == default_lm[0].dtype == torch.float32
        return copy.deepcopy(default_lm[0]), default_lm[1]

    monkeypatch.setattr(bench, "load_model", load_model)
    with pytest.raises(SystemExit, match="MODE must be"):
        bench.main(["1", "fast"])
    bench.main(["1", "default", "ckpt"])
    line = capsys.readouterr().out
    found = re.search(r"K=1 mode=default ckpt=True prune_model ([0-9.]+) s, final ([0-9.e+]+)", line)
    assert found, line
    assert float(found.group(1)) > 0 and float(found.group(2)) > 0
