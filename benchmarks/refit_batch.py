"""Time of the direct least-squares re-fit by how many kept-set systems are solved at once, on real SmolLM2 layers.

``refit_weights(solver="direct")`` gathers, factorizes and solves the ``[rows, k, k]`` kept-set systems in row
batches of about ``SYSTEM_ELEMENTS`` elements. This script captures the calibration Gram of every linear layer of
``--blocks`` from the dense packaged SmolLM2-135M-Instruct (``--nsamples`` x ``--seqlen`` built-in calibration
tokens, as the main job), takes the Wanda mask at ``--sparsity`` per row and re-fits each layer as the default spec
does (ridge ``G + 0.1 diag(G)``) with every ``--elements`` batch size (powers of two), alternating the sizes
``--repeats`` times and keeping each size's fastest run. It prints the seconds per layer kind and in total, and
checks that every size gives bit-identical weights (each row's system is solved alone).

    python benchmarks/refit_batch.py [--blocks 0 15 29] [--elements 25 21] [--repeats 3]
"""

from __future__ import annotations

import argparse
import platform
import time
from collections import defaultdict

import torch
from common import capture_grams

from sparseswaps_prune.core import refit
from sparseswaps_prune.core.warmstart import warmstart_mask


def time_batches(
    weight: torch.Tensor, gram: torch.Tensor, keep: torch.Tensor, exponents: list[int], repeats: int
) -> tuple[dict[int, float], bool]:
    """Fastest seconds of the default re-fit (``ridge="diag"``) of one layer for each ``2**e`` elements per batch
    (the sizes alternate ``repeats`` times), and whether all sizes gave the same weights bit for bit.

    ``weight`` ``[d_out, d_in]``, ``gram`` ``[d_in, d_in]``, ``keep`` ``[d_out, d_in]`` bool (none modified).
    ``refit.SYSTEM_ELEMENTS`` is restored on return."""
    saved = refit.SYSTEM_ELEMENTS
    seconds: dict[int, float] = {e: float("inf") for e in exponents}
    outputs: dict[int, torch.Tensor] = {}
    try:
        for _ in range(repeats):
            for e in exponents:
                refit.SYSTEM_ELEMENTS = 1 << e
                start = time.perf_counter()
                outputs[e] = refit.refit_weights(weight, gram, keep, ridge="diag")
                seconds[e] = min(seconds[e], time.perf_counter() - start)
    finally:
        refit.SYSTEM_ELEMENTS = saved
    first = outputs[exponents[0]]
    return seconds, all(torch.equal(first, out) for out in outputs.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, nargs="+", default=[0, 15, 29])
    parser.add_argument("--elements", type=int, nargs="+", default=[25, 21], help="log2 of elements per batch")
    parser.add_argument("--sparsity", type=float, default=0.6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nsamples", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=256)
    args = parser.parse_args()
    machine = platform.processor() or platform.machine()
    print(f"machine: {machine}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    weights, grams = capture_grams(args.blocks, args.nsamples, args.nsamples, 0, args.seqlen)
    by_kind: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    identical = True
    for name, weight in weights.items():
        gram = grams[name]["small"].gram
        keep = warmstart_mask(weight.double(), "wanda", gram=gram, sparsity=args.sparsity)
        seconds, same = time_batches(weight, gram, keep, args.elements, args.repeats)
        identical &= same
        kind = f"{name.rsplit('.', 1)[-1]} ({weight.shape[0]} x {weight.shape[1]})"
        for e, s in seconds.items():
            by_kind[kind][e] += s
    print(f"\nblocks {args.blocks}, Wanda {args.sparsity:.0%} per row, ridge diag 0.1; fastest of {args.repeats}")
    print("| layer | " + " | ".join(f"2^{e} elements s" for e in args.elements) + " |")
    print("|---|" + "---|" * len(args.elements))
    for kind, res in [*by_kind.items(), ("total", {e: sum(r[e] for r in by_kind.values()) for e in args.elements})]:
        print(f"| {kind} | " + " | ".join(f"{res[e]:.2f}" for e in args.elements) + " |")
    print(f"identical weights for every batch size: {identical}")


if __name__ == "__main__":
    main()
