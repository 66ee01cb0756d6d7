"""Interleaved A/B of the CPU sparse kernel: torch's dense ``nn.Linear``, this tree's avx2 kernel, and the kernels of
other versions of ``sparseswaps_prune/deploy/kernels.py``, one thread, float32.

    git show REV:sparseswaps_prune/deploy/kernels.py > /tmp/kernels_old.py
    python benchmarks/sparse_kernel_ab.py --baseline /tmp/kernels_old.py      # 4096x14336 and 14336x4096 (minutes)
    python benchmarks/sparse_kernel_ab.py --quick                            # small shapes (seconds; for the tests)
    python benchmarks/sparse_kernel_ab.py --baseline /tmp/kernels_old.py --shapes 576x576 1536x576 576x1536
        # the default model's block linears, the layers greedy decoding runs (a row's fixed cost counts there)

Each ``--baseline`` file is imported as a module of its own and called through its ``run_spmm`` on the same
bitmask, row pointers and values (the storage format is shared). Per shape, sparsity and batch, every function is
called ``--repeats`` times, interleaved (dense, current, baselines, dense, ...), and the table prints the median in
milliseconds of wall time and of the calling thread's CPU time (on a shared machine a waiting call adds wall time,
not CPU time) and the speedup ``dense / kernel`` in CPU time. Each weight keeps a random ``1 - sparsity`` of every
row (the pattern, not the values, sets the speed); outputs are checked against a float64 matmul.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # before torch and numba start their thread pools

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numba
import numpy as np
import torch
from common import import_file, parse_shape
from torch import nn

from sparseswaps_prune.deploy import kernels
from sparseswaps_prune.deploy.bench import machine_line
from sparseswaps_prune.deploy.linear import SparseLinear

FULL = {"shapes": [(4096, 14336), (14336, 4096)], "sparsities": [0.6, 0.7], "batches": [1, 2, 4, 8], "repeats": 21}
QUICK = {"shapes": [(64, 300)], "sparsities": [0.7], "batches": [1, 3], "repeats": 3}


def load_kernels(path: str) -> ModuleType:
    """The kernels module in file ``path``, imported under a name of its own (``kernels_<stem>``)."""
    return import_file(path, f"kernels_{Path(path).stem}")


def random_sparse(d_out: int, d_in: int, sparsity: float, gen: torch.Generator) -> torch.Tensor:
    """A float32 ``[d_out, d_in]`` weight keeping ``round(d_in * (1 - sparsity))`` random entries of every row."""
    keep = torch.rand(d_out, d_in, generator=gen).argsort(dim=1) < round(d_in * (1 - sparsity))
    return torch.randn(d_out, d_in, generator=gen) * keep


def interleaved_medians(fns: list[Callable[[], object]], repeats: int) -> list[tuple[float, float]]:
    """``(wall, thread CPU)`` median seconds of ``repeats`` calls of each of ``fns`` after one warm-up call each,
    the calls interleaved (``f0, f1, ..., f0, ...``)."""
    wall: list[list[float]] = [[] for _ in fns]
    cpu: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(repeats):
        for fn, w, c in zip(fns, wall, cpu, strict=True):
            start_wall, start_cpu = time.perf_counter(), time.thread_time()
            fn()
            c.append(time.thread_time() - start_cpu)
            w.append(time.perf_counter() - start_wall)
    return [(statistics.median(w), statistics.median(c)) for w, c in zip(wall, cpu, strict=True)]


def run(setting: dict, baselines: list[str]) -> None:
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    kernel = kernels.default_kernel()
    modules = [("current", kernels)] + [(Path(p).stem, load_kernels(p)) for p in baselines]
    print("machine:", machine_line())
    print(f"kernel: {kernel}; median ms per call, wall / thread CPU; speedup = dense / kernel (CPU)")
    header = f"{'shape':>11} {'sparsity':>8} {'batch':>5} {'dense':>15}"
    print(header + "".join(f" {name[:15]:>15} {'x':>5}" for name, _ in modules))
    gen = torch.Generator().manual_seed(0)
    for d_out, d_in in setting["shapes"]:
        for sparsity in setting["sparsities"]:
            weight = random_sparse(d_out, d_in, sparsity, gen)
            dense = nn.Linear(d_in, d_out, bias=False)
            dense.weight.data = weight
            encoded = SparseLinear.from_dense(weight)
            arrays = (encoded.bitmask.numpy(), encoded.row_ptr.numpy(), encoded.values.numpy())
            for batch in setting["batches"]:
                x = torch.randn(batch, d_in, generator=gen)
                xs = kernels.pad_inputs(x.numpy(), arrays[0].shape[1])
                calls = [lambda: dense(x)]  # noqa: B023
                calls += [lambda m=module: m.run_spmm(kernel, 1, *arrays, xs) for _, module in modules]  # noqa: B023
                with torch.inference_mode():
                    reference = (x.double() @ weight.double().t()).numpy()
                    for call in calls[1:]:
                        error = np.abs(call() - reference).max() / max(np.abs(reference).max(), 1e-30)
                        if error > 1e-5:
                            raise RuntimeError(f"a kernel is off by {error:.1e} (relative) at batch {batch}")
                    times = interleaved_medians(calls, setting["repeats"])
                cells = [f"{w * 1e3:7.3f}/{c * 1e3:<7.3f}" for w, c in times]
                speedups = [f"{times[0][1] / c:5.2f}" for _, c in times[1:]]
                line = f"{d_out:>5}x{d_in:<5} {sparsity:>8.0%} {batch:>5} {cells[0]:>15}"
                print(line + "".join(f" {cell:>15} {s}" for cell, s in zip(cells[1:], speedups, strict=True)))
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", action="append", default=[], help="another kernels.py to time (repeatable)")
    parser.add_argument("--quick", action="store_true", help="small shapes, few repeats")
    parser.add_argument("--repeats", type=int, default=None, help="calls per function (default 21, 3 with --quick)")
    parser.add_argument("--shapes", nargs="+", default=None, help="weight shapes OUTxIN instead of the default ones")
    args = parser.parse_args(argv)
    for path in args.baseline:
        if not Path(path).is_file():
            raise SystemExit(f"--baseline {path!r}: no such file (write one with `git show REV:path > FILE`)")
    setting = dict(QUICK if args.quick else FULL)
    if args.repeats is not None:
        if args.repeats < 1:
            raise SystemExit(f"--repeats must be at least 1, got {args.repeats}")
        setting["repeats"] = args.repeats
    if args.shapes:
        setting["shapes"] = [parse_shape(text) for text in args.shapes]
    run(setting, args.baseline)


if __name__ == "__main__":
    main()
