"""What the re-fit objective's row batch costs and holds: ``refine_mask(objective="refit")`` as the library runs it
(the engine ``backend="auto"`` picks, 10 iterations of the row scope, 60% Wanda mask) on ``common.random_layer``
(``--width`` inputs, ``--rows`` rows), once with the default row batch (``refine._default_row_batch``: on CUDA
``refit_swaps.REFIT_CUDA_FRACTION`` of the device's memory for ``Z``) and once with each ``--row-batches``. Prints
per batch size the seconds for the layer, the seconds per row, and on CUDA the peak of allocated memory
(``torch.cuda.max_memory_allocated``), to choose the fraction: larger batches share the iteration's fixed cost,
and the build's temporaries (``G[S, P]``, the factor, ``H``) come on top of the state. Checks that every batch size
gives the same mask.

    python benchmarks/refit_row_batch.py --device cuda --width 14336 --rows 64 --row-batches 16 32
"""

from __future__ import annotations

import argparse
import time

import torch
from common import cuda_sync, random_layer

from sparseswaps_prune.core import refine


def run(weight: torch.Tensor, gram: torch.Tensor, keep: torch.Tensor, row_batch: int | None, iters: int):
    """``(rows per batch, seconds, peak GiB or None, mask)`` of one ``refine_mask`` call (inputs not modified)."""
    cuda = weight.device.type == "cuda"
    batch = min(keep.shape[0], row_batch or refine._default_row_batch(keep, True, 0, weight.device))
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    cuda_sync()
    start = time.perf_counter()
    result = refine.refine_mask(
        weight, gram, keep, objective="refit", max_iters=iters, row_batch=row_batch, ridge="mean"
    )
    cuda_sync()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return batch, seconds, peak, result.mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=256, help="rows of the layer")
    parser.add_argument("--row-batches", type=int, nargs="*", default=[], help="explicit batch sizes to compare")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    weight, gram, keep = (t.to(args.device) for t in random_layer(args.width, args.rows))
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}, {args.width} inputs, {args.rows} rows, 60%, {args.iters} iterations")
    print(f"{'row batch':>9} {'seconds':>8} {'s/row':>10} {'peak GiB':>8} {'same':>4}")
    refine.refine_mask(weight[:2], gram, keep[:2], objective="refit", max_iters=2)  # compilation, not timed
    masks = []
    for row_batch in [None, *args.row_batches]:
        batch, seconds, peak, mask = run(weight, gram, keep, row_batch, args.iters)
        masks.append(mask)
        label = f"{batch}{'*' if row_batch is None else ''}"
        shown = "-" if peak is None else f"{peak:.1f}"
        same = "yes" if torch.equal(mask, masks[0]) else "NO"
        print(f"{label:>9} {seconds:>8.2f} {seconds / args.rows:>10.3e} {shown:>8} {same:>4}")
    print("(* the default row batch)")


if __name__ == "__main__":
    main()
