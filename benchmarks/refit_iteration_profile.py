"""Where the GPU time of a re-fit-objective iteration goes: ``torch.profiler`` over 3 iterations of the Triton
engine's row scope (``refit_triton.swap_slots`` of the rows whose best swap lowers the loss, then their scan) on
``common.random_layer`` (60%, ``--width`` inputs, ``--rows`` rows in one batch), after one warm-up iteration; prints
the operators by CUDA time. CUDA only.

    python benchmarks/refit_iteration_profile.py [--width 4096] [--rows 256]
"""

from __future__ import annotations

import argparse

import torch
from common import random_layer
from torch.profiler import ProfilerActivity, profile

from sparseswaps_prune.core import refit_swaps as rs
from sparseswaps_prune.core.backends import refit_triton
from sparseswaps_prune.core.refit import damping


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=256)
    args = parser.parse_args()
    weight, gram, keep = (t.cuda() for t in random_layer(args.width, args.rows, "60%", dtype=torch.float64))
    counts = (int(keep.sum(1).max()), args.width - int(keep.sum(1).min()))
    k, q = (refit_triton.aligned_slots(n, args.width) for n in counts)  # the slot counts the engine uses
    lam = damping(gram, 0.01)
    state = rs.build_state(weight, keep, gram, lam, k, q)
    floor = rs.pivot_floor(gram, lam)
    rows = torch.arange(args.rows, device="cuda")
    best, slot_i, slot_j = refit_triton.scan_swaps(state, weight, rows, floor)

    def iteration() -> None:
        accept = best < 0
        moved = rows[accept]
        refit_triton.swap_slots(state, moved, slot_i[accept], slot_j[accept], gram)
        dl, i, j = refit_triton.scan_swaps(state, weight, moved, floor)
        best[accept], slot_i[accept], slot_j[accept] = dl, i, j

    iteration()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            iteration()
        torch.cuda.synchronize()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.width} inputs, {args.rows} rows, 60%")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    main()
