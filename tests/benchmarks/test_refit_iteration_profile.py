"""benchmarks/refit_iteration_profile.py: the profile of the state's build runs on the CPU; iterations need CUDA or
the Triton interpreter."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("triton")  # the script builds the Triton engine's state (common.triton_refit_layer)


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


@pytest.mark.parametrize("engine", ["triton", "mask"])
def test_iterations_run_in_the_triton_interpreter(benchmark_script, monkeypatch, capsys, engine):
    bench = benchmark_script("refit_iteration_profile")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(sys, "argv", ["x", "--device", "cpu", "--width", "64", "--rows", "3", "--engine", engine])
    bench.main()
    out = capsys.readouterr().out
    assert f"64 inputs, 3 rows, 60%, 3 iterations of the {engine} engine" in out
    assert "Self CPU time total" in out and "aten::" in out  # the profile's table (its top rows vary by machine)


def test_the_triton_engines_iteration_is_a_few_launches(benchmark_script, monkeypatch, capsys):
    """What an iteration of each engine asks of the device (the per-call costs on a GPU), counted on the CPU."""
    bench = benchmark_script("refit_iteration_profile")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    counts = {}
    for engine, pattern in [("triton", "60%"), ("mask", "60%"), ("triton", "2:4")]:
        argv = ["x", "--device", "cpu", "--width", "64", "--rows", "8", "--engine", engine, "--count"]
        monkeypatch.setattr(sys, "argv", [*argv, "--pattern", pattern])
        bench.main()
        counts[engine if pattern == "60%" else f"{engine} {pattern}"] = capsys.readouterr().out.splitlines()[1:]
    assert counts["triton 2:4"] == counts["triton"]  # N:M: the kept slots' ranges come from the prologue kernel too
    # the Triton engine: its moves, scan terms, scan and answer in five kernels; the product of its restores, the
    # zeroed vectors it scatters into, the figures' packing and the mask's two writes in torch; no synchronisation
    assert counts["triton"] == [
        "torch operators per iteration: 5 (index_put_ 2, zeros 1, mm 1, stack 1)",
        "Triton launches per iteration: 5 (_remove_kernel 1, _restore_kernel 1, _prologue_kernel 1, _scan_kernel 1, "
        "_best_slots_kernel 1)",
        "synchronisations per iteration: 0",
    ]

    def total(engine: str) -> int:  # torch operators and Triton launches per iteration
        return sum(int(line.split(": ")[1].split(" ")[0]) for line in counts[engine][:2])

    assert total("triton") < total("mask")  # the mask objective's figures and updates are torch operations
    monkeypatch.setattr(sys, "argv", ["x", "--device", "cpu", "--build", "--count"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "counts iterations" in capsys.readouterr().err
