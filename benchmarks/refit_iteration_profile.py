"""Where the time of the re-fit objective's Triton engine goes: ``torch.profiler`` over 3 iterations of its row scope
(``refit_triton.swap_slots`` of the rows whose best swap lowers the loss, then their scan), or with ``--build`` over
2 builds of the state (``refit_swaps.build_state``: the Cholesky factor, ``H``, ``v``, ``Z``), on
``common.random_layer`` (60%, ``--width`` inputs, ``--rows`` rows in one batch), after one warm-up; prints the
operators by device time. Iterations on CUDA (on the CPU only in the Triton interpreter, for testing); ``--build``
also on the CPU (``--device cpu``). ``--lazy``:
the iterations of the lazy state (``refit_lazy.LazyRefitState``: pending rank-one terms, the kernel's scan) instead.

    python benchmarks/refit_iteration_profile.py [--width 4096] [--rows 256] [--build | --lazy] [--device cuda]
"""

from __future__ import annotations

import argparse
import os

import torch
from common import triton_refit_iteration, triton_refit_layer
from torch.profiler import ProfilerActivity, profile

from sparseswaps_prune.core import refit_swaps as rs
from sparseswaps_prune.core.backends.refit_lazy import LazyRefitState
from sparseswaps_prune.core.refit import damping


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--build", action="store_true", help="profile the state's build instead of iterations")
    parser.add_argument("--lazy", action="store_true", help="iterations of the lazy state (refit_lazy)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    if args.device == "cpu" and not args.build and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("iterations run the Triton kernels: CUDA only (--build profiles on the CPU)")
    cuda = args.device == "cuda"
    weight, gram, keep, state, floor, _ = triton_refit_layer(args.width, args.rows, "60%", args.device)
    rows = torch.arange(args.rows, device=args.device)
    lam, (_, k, q) = damping(gram, 0.01), state.z.shape
    if args.build or args.lazy:
        del state  # the profiled builds, or the lazy state, need the memory
    if args.build:

        def step() -> None:
            rs.build_state(weight, keep, gram, lam, k, q)

        repeat = 2
    elif args.lazy:
        lazy = LazyRefitState(weight, keep, gram, lam, k, q, None, triton_scan=True)
        best, slot_i, slot_j = lazy.scan(rows)

        def step() -> None:
            accept = best < 0
            moved = rows[accept]
            lazy.swap(moved, slot_i[accept], slot_j[accept])
            best[accept], slot_i[accept], slot_j[accept] = lazy.scan(moved)

        repeat = 3
    else:
        from sparseswaps_prune.core.backends import refit_triton

        figures = refit_triton.scan_swaps(state, weight, rows, floor)

        def step() -> None:
            triton_refit_iteration(state, weight, gram, rows, floor, None, figures)

        repeat = 3
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step()
    sync()
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda
    with profile(activities=activities) as prof:
        for _ in range(repeat):
            step()
        sync()
    name = torch.cuda.get_device_name() if cuda else "CPU"
    what = f"{repeat} builds" if args.build else f"{repeat} iterations" + " (lazy state)" * args.lazy
    print(f"{name}, torch {torch.__version__}, {args.width} inputs, {args.rows} rows, 60%, {what}")
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    main()
