"""One re-fit-objective iteration of the Triton engine two ways, on ``common.random_layer`` (60%, every row
swapping): ``fused``, the swap's update of ``Z`` and the scan of the swapped rows in one pass
(``refit_triton.swap_and_scan``, one program per tile of ``Z``, tiles ``(BLOCK_K, BLOCK_Q, num_warps)`` 8 x 512 x 8
and 4 x 512 x 4); ``split``, the update alone (``rescan=False``) and then the scan alone (``scan_swaps``, which reads
only the tiles the bound leaves). Seconds per row (``common.timed``: one warm-up, mean of 5), each mode twice,
alternating. CUDA only. It compares the engine of the commit that adds it (the next commit keeps only ``split``).

    python benchmarks/refit_iteration_passes.py
"""

import torch
from common import random_layer, timed

from sparseswaps_prune.core import refit_swaps as rs
from sparseswaps_prune.core.backends import refit_triton as rt
from sparseswaps_prune.core.refit import damping


def iteration_seconds(mode: str, state: rs.RefitState, w, g, floor, rows) -> float:
    """Mean seconds of an iteration of ``mode`` on a copy of ``state``, every row whose best swap lowers the loss."""
    s = rs.RefitState(*(t.clone() for t in vars(state).values()))
    best, si, sj = rt.scan_swaps(s, w, rows, floor)

    def it() -> None:
        a = best < 0
        r = rows[a]
        if mode == "fused":
            _, (dl, i, j) = rt.swap_and_scan(s, w, r, si[a], sj[a], g, floor)
        else:
            rt.swap_and_scan(s, w, r, si[a], sj[a], g, floor, rescan=False)
            dl, i, j = rt.scan_swaps(s, w, r, floor)
        best[a], si[a], sj[a] = dl, i, j

    return timed(it, 5)


def main() -> None:
    for d, n in ((4096, 256), (14336, 32)):
        w, g, keep = (t.cuda() for t in random_layer(d, n, "60%", dtype=torch.float64))
        k, q = int(keep.sum(1).max()), d - int(keep.sum(1).min())
        lam = damping(g, 0.01)
        state = rs.build_state(w, keep, g, lam, k, q)
        floor = rs.pivot_floor(g, lam)
        rows = torch.arange(n, device="cuda")
        for mode in ("fused", "split", "fused", "split"):
            for tile in ((8, 512, 8), (4, 512, 4)):
                rt.SWAP_SCAN_TILE = tile
                seconds = iteration_seconds(mode, state, w, g, floor, rows)
                print(d, n, mode, tile, f"{seconds / n:.3e} s/row", flush=True)


if __name__ == "__main__":
    main()
