"""benchmarks/refit_iteration_profile.py: the profile of the state's build runs on the CPU; iterations need CUDA or
the Triton interpreter."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("triton")  # the script imports the Triton engine's slot alignment (common.triton_refit_layer)


def test_the_build_profile_runs_on_the_cpu_and_iterations_ask_for_cuda(benchmark_script, monkeypatch, capsys):
    bench = benchmark_script("refit_iteration_profile")
    monkeypatch.setattr(sys, "argv", ["x", "--build", "--device", "cpu", "--width", "64", "--rows", "3"])
    bench.main()
    out = capsys.readouterr().out
    assert "CPU, torch" in out and "64 inputs, 3 rows, 60%, 2 builds" in out and "aten::cholesky_inverse" in out
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(sys, "argv", ["x", "--device", "cpu"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "CUDA only" in capsys.readouterr().err


@pytest.mark.parametrize("lazy", [False, True])
def test_iterations_run_in_the_triton_interpreter(benchmark_script, monkeypatch, capsys, lazy):
    bench = benchmark_script("refit_iteration_profile")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(sys, "argv", ["x", "--device", "cpu", "--width", "64", "--rows", "3"] + ["--lazy"] * lazy)
    bench.main()
    out = capsys.readouterr().out
    assert "64 inputs, 3 rows, 60%, 3 iterations" + " (lazy state)" * lazy in out
    assert "Self CPU time total" in out and "aten::" in out  # the profile's table (its top rows vary by machine)
