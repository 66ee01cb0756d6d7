"""Swap-search speed: one refinement iteration (best swap of every row) per backend.

Prints, per width d_in and sparsity pattern, the time per row-iteration and pairs/s (counting all
d_in^2 pairs per row, as the issue defines it) for the naive search (each row's full d_in x d_in
swap-cost matrix, then argmin), the vectorized torch backend and the compiled numba backend (on CUDA:
the torch backend and the fused triton kernel) at the Wanda warmstart, the last backend also after 10
refinement iterations ("@T10", where skipping helps less), the speed
ratio against naive, and the machine's fp32 matmul rate measured in the same run.

    python benchmarks/swap_search.py [--device cpu] [--widths 576 1536 4096] [--rows 64]
"""

from __future__ import annotations

import argparse
import platform

import torch
from common import random_layer, timed

from sparseswaps_prune.core.backends import best_swaps
from sparseswaps_prune.core.backends.terms import swap_terms
from sparseswaps_prune.core.losses import correlation
from sparseswaps_prune.core.refine import refine_mask


def naive_best_swaps(weight, keep, corr, gram):
    """Per row: the full [d, d] dL matrix, then argmin (the baseline the issue names)."""
    out = []
    for r in range(weight.shape[0]):
        remove, restore, _, _ = swap_terms(weight[r], keep[r], corr[r], torch.diagonal(gram))
        cost = remove[:, None] + restore[None, :] - 2 * weight[r, :, None] * weight[r, None, :] * gram
        flat = int(cost.argmin())
        out.append((flat // weight.shape[1], flat % weight.shape[1]))
    return out


def matmul_gflops(device: str, n: int = 2048) -> float:
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    seconds = timed(lambda: a @ b, 5)
    return 2 * n**3 / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--widths", type=int, nargs="+", default=[576, 1536, 4096])
    parser.add_argument("--rows", type=int, default=64, help="rows searched per call")
    parser.add_argument("--naive-rows", type=int, default=4, help="rows timed for the naive search")
    args = parser.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, device {args.device}"
    )
    print(f"fp32 matmul: {matmul_gflops(args.device):.0f} GFLOP/s")
    header = f"{'d_in':>5} {'pattern':>8} {'backend':>9} {'s/row-iter':>11} {'pairs/s':>9} {'vs naive':>8}"
    print(header)
    backends = ["torch", "numba"] if args.device == "cpu" else ["torch", "triton"]
    for d_in in args.widths:
        for label, nm in (("60%", None), ("2:4", (2, 4))):
            weight, gram, keep = (t.to(args.device) for t in random_layer(d_in, args.rows, label))
            corr = correlation(weight, gram, keep)
            sub = [t[: args.naive_rows] for t in (weight, keep, corr)]
            naive = timed(lambda sub=sub, gram=gram: naive_best_swaps(*sub, gram), 1) / args.naive_rows
            results = {"naive": naive}
            names = ["nm"] if nm else backends
            for name in names:
                args_ = (weight, keep, corr, gram, nm)
                seconds = timed(lambda name=name, a=args_: best_swaps(name, *a), 3)
                results[name] = seconds / args.rows
            # Mid-refinement (after 10 iterations) the lower-bound skipping prunes less: time that too.
            refined = refine_mask(weight, gram, keep, max_iters=10, nm=nm).mask
            mid = (weight, refined, correlation(weight, gram, refined), gram, nm)
            name = names[-1]
            results[f"{name}@T10"] = timed(lambda name=name, a=mid: best_swaps(name, *a), 3) / args.rows
            for name, per_row in results.items():
                print(
                    f"{d_in:>5} {label:>8} {name:>7} {per_row:>11.3e} {d_in**2 / per_row:>9.2e} {naive / per_row:>8.1f}"
                )


if __name__ == "__main__":
    main()
