"""benchmarks/prune_time_ab.py: one block of the default model prints the line the A/B reads."""

from __future__ import annotations

import re

import pytest


def test_one_block_with_a_checkpoint(benchmark_script, capsys):
    bench = benchmark_script("prune_time_ab")
    with pytest.raises(SystemExit, match="MODE must be"):
        bench.main(["1", "fast"])
    bench.main(["1", "default", "ckpt"])
    line = capsys.readouterr().out
    found = re.search(r"K=1 mode=default ckpt=True prune_model ([0-9.]+) s, final ([0-9.e+]+)", line)
    assert found, line
    assert float(found.group(1)) > 0 and float(found.group(2)) > 0
