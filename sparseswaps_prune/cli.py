"""Command line: ``sparseswaps demo``. Argument parsing only; the work happens in the library."""

from __future__ import annotations

import argparse
import logging
import sys

from sparseswaps_prune.demo import run_demo


def _demo(args: argparse.Namespace) -> int:
    result, seconds = run_demo(args.d_out, args.d_in, args.sparsity, args.max_iters, args.seed)
    before, after = float(result.loss_before.sum()), float(result.loss_after.sum())
    print(f"random layer [{args.d_out} x {args.d_in}], Wanda warmstart at {args.sparsity:.0%} per-row sparsity")
    print(f"layer loss  warmstart: {before:.6g}   SparseSwaps (T={args.max_iters}): {after:.6g}")
    print(
        f"reduction: {result.relative_reduction:.1%}   swaps: {int(result.n_swaps.sum())} "
        f"(iterations: {result.iters})   time: {seconds:.2f} s"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparseswaps", description="SparseSwaps pruning-mask refinement")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="refine the Wanda mask of a random layer and print the loss")
    demo.add_argument("--d-out", type=int, default=256)
    demo.add_argument("--d-in", type=int, default=512)
    demo.add_argument("--sparsity", type=float, default=0.6)
    demo.add_argument("--max-iters", type=int, default=100)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(message)s")
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"sparseswaps: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
