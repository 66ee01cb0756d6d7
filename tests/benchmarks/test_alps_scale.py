"""benchmarks/alps_scale.py: ALPS's time and memory per layer shape, measured and extrapolated."""

from __future__ import annotations

import sys

import pytest
import torch


def test_llm_like_layer_is_a_positive_definite_gram(benchmark_script):
    bench = benchmark_script("alps_scale")
    weight, gram = bench.llm_like_layer(8, 40)
    assert weight.shape == (8, 40) and gram.shape == (40, 40)
    torch.testing.assert_close(gram, gram.T)
    assert float(torch.linalg.eigvalsh(gram.double()).min()) > 0  # 160 tokens, 40 features: full rank


def test_capped_calls_run_exactly_the_cap(benchmark_script, monkeypatch):
    bench = benchmark_script("alps_scale")

    class Probe:  # a resident set of 1.5 GB before the call and a peak of 4 GB during it
        start = 1_500_000_000

        def peak(self) -> int:
            return 4_000_000_000

    monkeypatch.setattr(bench, "MemoryProbe", Probe)
    weight, gram = bench.llm_like_layer(12, 48)
    seconds, iters, peak = bench.measured_call(weight, gram, 0.6, 6)
    assert iters == 6 and seconds > 0
    assert peak == pytest.approx(2.5)  # GB (1e9 bytes) above the resident set before the call


def test_main_prints_measured_and_extrapolated_rows(benchmark_script, monkeypatch, capsys):
    bench = benchmark_script("alps_scale")
    monkeypatch.setattr(sys, "argv", ["alps_scale.py", "--shapes", "12x48", "24x48", "--full", "12x48"])
    bench.main()
    out = capsys.readouterr().out
    assert "EXTRAPOLATED" in out and "at 300 it" in out
    table = out.split("EXTRAPOLATED")[1].splitlines()
    full_row = next(line for line in table if line.strip().startswith("12x48"))
    capped_row = next(line for line in table if line.strip().startswith("24x48"))
    assert full_row.split()[6].isdigit()  # the measured full run's iteration count
    assert capped_row.split()[5:7] == ["-", "-"]
    assert "one LLaMA-3.1-8B block" not in out  # only printed when every 8B shape ran


def test_iteration_caps_must_end_on_a_penalty_update(benchmark_script, monkeypatch):
    bench = benchmark_script("alps_scale")
    monkeypatch.setattr(sys, "argv", ["alps_scale.py", "--shapes", "12x48", "--iters", "3", "5"])
    with pytest.raises(SystemExit):
        bench.main()
