"""Launch shapes of the Triton re-fit engine's pair scan: for each tile ``(BLOCK_K, BLOCK_Q, num_warps)``
(``refit_lazy_triton.SCAN_TILE``) and each count of programs aimed for per streaming multiprocessor
(``refit_lazy_triton.SCAN_PROGRAMS_PER_SM``), seconds per row and the bytes of ``Z`` per second (all of ``Z``, though
the scan skips the tiles :func:`refit_lazy_triton.columns_to_scan` leaves out, so a rate over the bandwidth is
possible), on ``common.random_layer`` (random correlated Gram, Wanda mask of ``--pattern``, 60% by default or N:M)
and the engine's freshly built state (``refit_lazy_triton.TritonRefitState``, no pending terms). Every scan is
checked against the torch reference (``refit_state.scan_swaps`` of the same state): ``same`` says its costs and
slots are bit-identical. CUDA (``--device cpu`` only under ``TRITON_INTERPRET=1``, to check the script at small
widths).

    python benchmarks/refit_scan_tiles.py [--widths 4096 14336] [--rows 64 8] [--tiles 16x32x4 ...] [--per-sm 4 16]
                                          [--pattern 60%|2:4]
"""

from __future__ import annotations

import argparse

import torch
from common import timed, triton_refit_layer

from sparseswaps_prune.core import refit_swaps as rs
from sparseswaps_prune.core.backends import refit_lazy_triton

SCAN_TILES = ["4x256x4", "2x512x4", "4x128x4", "8x64x4", "16x64x4", "32x64x8", "16x32x4", "8x128x8"]


def sweep(
    d_in: int, n_rows: int, device: str, tiles: list[str], per_sm: list[int], repeat: int, pattern: str = "60%"
) -> tuple[int, list]:
    """``(bytes of Z, [(scan tile, programs per SM, scan seconds for all rows, same as the reference)])`` at one
    width."""
    weight, _, keep, state, floor, m = triton_refit_layer(d_in, n_rows, pattern, device)
    rows = torch.arange(n_rows, device=device)
    reference = rs.scan_swaps(state, weight, rows, floor, m)
    needed = refit_lazy_triton.columns_to_scan(
        state, rows, rs.removal_terms(state, rows), rs.restorable(state, weight, rows), floor, m
    )
    mean_needed = float(needed.sum(1).float().mean())
    q = d_in - int(keep.sum(1).min())  # the pruned inputs (the state has vacant slots beyond them)
    print(f"{d_in:>5} {n_rows:>4} slots the scan evaluates (columns_to_scan): {mean_needed:.1f} of {q} per row")

    def scan() -> tuple[torch.Tensor, ...]:
        return refit_lazy_triton.scan_swaps(state, rows)

    default = (refit_lazy_triton.SCAN_TILE, refit_lazy_triton.SCAN_PROGRAMS_PER_SM)
    scans = []
    try:
        for tile in tiles:
            for programs in per_sm:
                refit_lazy_triton.SCAN_TILE = tuple(int(x) for x in tile.split("x"))
                refit_lazy_triton.SCAN_PROGRAMS_PER_SM = programs
                same = all(torch.equal(a, b) for a, b in zip(scan(), reference, strict=True))
                scans.append((tile, programs, timed(scan, repeat), same))
    finally:
        refit_lazy_triton.SCAN_TILE, refit_lazy_triton.SCAN_PROGRAMS_PER_SM = default
    return state.zt.numel() * 8, scans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", type=int, nargs="+", default=[4096, 14336])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 8], help="rows per width (one per width)")
    parser.add_argument("--tiles", nargs="+", default=SCAN_TILES, help="scan alone: BLOCK_KxBLOCK_Qxnum_warps")
    parser.add_argument("--per-sm", type=int, nargs="+", default=[4, 8, 16, 32], help="scan programs per SM")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--pattern", default="60%", help="e.g. 60%% or 2:4")
    args = parser.parse_args()
    if len(args.rows) != len(args.widths):
        raise ValueError(f"--rows needs one count per width ({len(args.widths)}), got {len(args.rows)}")
    name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(
        f"device: {name}, torch {torch.__version__}, defaults: scan tile {refit_lazy_triton.SCAN_TILE}, "
        f"{refit_lazy_triton.SCAN_PROGRAMS_PER_SM} programs per SM; {args.pattern}"
    )
    results = []
    for d_in, n_rows in zip(args.widths, args.rows, strict=True):
        z_bytes, scans = sweep(d_in, n_rows, args.device, args.tiles, args.per_sm, args.repeat, args.pattern)
        results.append((d_in, n_rows, z_bytes, scans))
    print(f"{'d_in':>5} {'rows':>4} {'scan tile':>10} {'per SM':>6} {'scan s/row':>10} {'Z GB/s':>7} {'same':>4}")
    for d_in, n_rows, z_bytes, scans in results:
        for tile, programs, seconds, same in scans:
            flag, rate = "yes" if same else "NO", z_bytes / seconds / 1e9
            print(f"{d_in:>5} {n_rows:>4} {tile:>10} {programs:>6} {seconds / n_rows:>10.3e} {rate:>7.0f} {flag:>4}")


if __name__ == "__main__":
    main()
