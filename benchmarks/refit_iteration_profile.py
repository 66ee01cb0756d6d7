"""Where the GPU time of a re-fit-objective iteration goes: ``torch.profiler`` over 3 iterations of the Triton
engine's row scope (``refit_triton.swap_slots`` of the rows whose best swap lowers the loss, then their scan) on
``common.random_layer`` (60%, ``--width`` inputs, ``--rows`` rows in one batch), after one warm-up iteration; prints
the operators by CUDA time. CUDA only.

    python benchmarks/refit_iteration_profile.py [--width 4096] [--rows 256]
"""

from __future__ import annotations

import argparse

import torch
from common import triton_refit_iteration, triton_refit_layer
from torch.profiler import ProfilerActivity, profile

from sparseswaps_prune.core.backends import refit_triton


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=256)
    args = parser.parse_args()
    weight, gram, _, state, floor, _ = triton_refit_layer(args.width, args.rows, "60%", "cuda")
    rows = torch.arange(args.rows, device="cuda")
    figures = refit_triton.scan_swaps(state, weight, rows, floor)

    def iteration() -> None:
        triton_refit_iteration(state, weight, gram, rows, floor, None, figures)

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
