"""benchmarks/refit_row_batch.py: the re-fit objective's row batches give the same mask; the table is well formed."""

from __future__ import annotations

import sys

import torch


def test_every_row_batch_gives_the_same_mask(benchmark_script, monkeypatch, capsys):
    bench = benchmark_script("refit_row_batch")
    weight, gram, keep = bench.random_layer(48, 10)
    batch, seconds, peak, mask = bench.run(weight, gram, keep, 3, iters=4)
    assert batch == 3 and seconds > 0 and peak is None  # no peak memory off CUDA
    assert mask.shape == keep.shape and not torch.equal(mask, keep)  # swaps were made
    monkeypatch.setattr(sys, "argv", ["x", "--width", "48", "--rows", "10", "--row-batches", "3", "10", "--iters", "4"])
    bench.main()
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[2:-1]]
    assert [r[0] for r in rows] == ["10*", "3", "10"] and all(r[-1] == "yes" for r in rows)
