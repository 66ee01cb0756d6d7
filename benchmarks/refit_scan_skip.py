"""How much of the re-fit pair scan the bound lets the Triton engine skip, on the real layers of the default model.

For every linear layer of ``--blocks`` of the packaged SmolLM2-135M-Instruct (Grams from ``--nsamples`` built-in
calibration windows) with a Wanda mask of ``--pattern``: the re-fit state of every row (torch engine, the default
row batches), then :func:`~sparseswaps_prune.core.backends.refit_lazy_triton.columns_to_scan` (the pruned slots whose
pairs the Triton scan evaluates; the others cannot win or tie by ``dF(u, p) >= -r_p^2 / s_p``), at the start
(every row) and after ``--iters`` iterations of the library's row-scope loop (the rows whose best swap still lowers
the loss past the rounding floor, which the loop would go on scanning). Printed per layer kind and over all layers:
the rows counted, the mean restorable and evaluated slots per row and, for the scan's tile shape (``SCAN_TILE``),
the share of the tiles of pruned slots that hold an evaluated slot and the share of the ``[BLOCK_K, BLOCK_Q]``
tiles of ``Z`` whose pair costs the kernel evaluates (the same share without N:M; with N:M only the kept slots of
the tile's blocks, ``kept_slot_ranges``): the share of the pair arithmetic the kernel still does. Also the mean
restorable slots per row whose bound does not exceed the row's best swap, with the row's ``s_p`` (``s_p bound``:
what the numba engine visits) and with the layer-wide ``sigma_p <= s_p`` of ``common.shared_schur_bound``
(``shared bound``: what a state without every row's ``s_p`` would have to visit). CPU (the torch state; no kernel runs).

    python benchmarks/refit_scan_skip.py [--blocks 0 15 29] [--pattern 60%] [--iters 10] [--nsamples 16]
"""

from __future__ import annotations

import argparse
import platform
from collections import defaultdict

import torch
from common import add_layer_run_args, bound_visits, capture_grams, pattern_options, shared_schur_bound

from sparseswaps_prune.core import refine
from sparseswaps_prune.core import refit_swaps as rs
from sparseswaps_prune.core.backends.refit_lazy_triton import SCAN_TILE, columns_to_scan, kept_slot_ranges
from sparseswaps_prune.core.refine import RefitRows, RowPlanner, _default_row_batch
from sparseswaps_prune.core.refit import damping
from sparseswaps_prune.core.spec import SwapRefine
from sparseswaps_prune.core.warmstart import warmstart_mask

# (BLOCK_K, BLOCK_Q) of the scan (a swap's update of Z is a separate pass that evaluates no pair)
TILES = {"scan": SCAN_TILE[:2]}


def skip_counts(model: RefitRows, rows: torch.Tensor, shared: torch.Tensor) -> dict[str, float]:
    """Rows, restorable slots, evaluated slots and, per tile shape of :data:`TILES`, the tiles of pruned slots and
    those with an evaluated slot, and the ``[BLOCK_K, BLOCK_Q]`` tiles of ``Z`` and those the kernel evaluates
    (with N:M only the kept slots of :func:`kept_slot_ranges`), summed over ``rows`` (``[n]`` int64) of ``model``;
    and the restorable slots whose bound ``-r_p^2 / shared_p`` (``shared``: ``common.shared_schur_bound``) does not
    exceed the row's best swap (``"shared"``: the columns a scan would visit with that bound), against those whose
    bound ``-r_p^2 / s_p`` does not (``"exact"``: the numba engine's visits)."""
    state = model.state
    restorable = rs.restorable(state, model.w64, rows)
    terms = rs.removal_terms(state, rows)
    need = columns_to_scan(state, rows, terms, restorable, model.pivot_floor, state.m)
    best = rs.scan_swaps(state, model.w64, rows, model.pivot_floor, state.m)[0]
    exact, loose = state.schur[rows], shared[state.pruned[rows]]
    out = {"rows": rows.numel(), "restorable": int(restorable.sum()), "evaluated": int(need.sum()),
           "exact": int(bound_visits(state, model.w64, rows, best, exact).sum()),
           "shared": int(bound_visits(state, model.w64, rows, best, loose).sum())}  # fmt: skip
    k_slots = state.z.shape[1]
    for name, (block_k, block_q) in TILES.items():
        pad = -need.shape[1] % block_q
        tiles = torch.nn.functional.pad(need, (0, pad)).view(need.shape[0], -1, block_q).any(dim=2)
        out[f"{name}_tiles"] = tiles.numel()
        out[f"{name}_hit"] = int(tiles.sum())
        if state.m:
            args = (state.kept[rows], state.kept_ok[rows], state.pruned[rows], need, state.m, block_q)
            k_lo, k_hi = kept_slot_ranges(*args)
        else:
            k_lo, k_hi = torch.zeros_like(tiles, dtype=torch.long), torch.full_like(tiles, k_slots, dtype=torch.long)
        if name == "scan":  # the kernel's loop over [k_lo, k_hi) in steps of BLOCK_K
            k_tiles = (k_hi - k_lo).clamp(min=0).add(block_k - 1).div(block_k, rounding_mode="floor")
        else:  # the K tiles of the update that meet [k_lo, k_hi)
            k_tiles = torch.where(k_hi > k_lo, (k_hi - 1).div(block_k, rounding_mode="floor") - k_lo // block_k + 1, 0)
        out[f"{name}_pairs"] = tiles.numel() * -(-k_slots // block_k)
        out[f"{name}_pairs_hit"] = int(torch.where(tiles, k_tiles, 0).sum())
    return out


def measure(weight: torch.Tensor, gram: torch.Tensor, pattern: str, iters: int, damp: float) -> dict[str, dict]:
    """:func:`skip_counts` of one layer at the start and after ``iters`` iterations, over its default row batches."""
    options = pattern_options(pattern)
    nm = options["nm"]
    w64, gram64 = weight.double(), gram.double()
    keep = warmstart_mask(weight, "wanda", sparsity=options["sparsity"], nm=nm, gram=gram64)
    lam = damping(gram64, damp)
    shared = shared_schur_bound(gram64, lam)
    out: dict[str, dict] = {"start": defaultdict(float), "after": defaultdict(float)}
    batch = _default_row_batch(keep, True, spare=0, device=torch.device("cpu"))
    for r0 in range(0, keep.shape[0], batch):
        sub = slice(r0, r0 + batch)
        model = RefitRows(w64[sub], keep[sub].clone(), gram64, lam=lam, m=nm[1] if nm else None, row_batch=batch,
                          cross=False, engine="torch")  # fmt: skip
        rows = torch.arange(model.keep.shape[0])
        for key, value in skip_counts(model, rows, shared).items():
            out["start"][key] += value
        refine.iterate(model, RowPlanner(model.rounding.cpu()), max_iters=iters, resync_every=SwapRefine().resync_every)
        # the rows whose best swap still lowers the loss past the floor: those the loop would go on scanning
        working = rows[model.figures(rows, cross=False).swap_dl < -model.rounding.cpu()]
        for key, value in skip_counts(model, working, shared).items():
            out["after"][key] += value
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_layer_run_args(parser, blocks=[0, 15, 29])
    args = parser.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}; blocks {args.blocks}, "
        f"{args.pattern}, after {args.iters} iterations"
    )
    weights, grams = capture_grams(args.blocks, args.nsamples, args.nsamples, 0, args.seqlen)
    kinds: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for name, weight in weights.items():
        for when, counts in measure(weight, grams[name]["small"].gram, args.pattern, args.iters, args.damp).items():
            for kind in (name.rsplit(".", 1)[-1], "all layers"):
                for key, value in counts.items():
                    kinds[(kind, when)][key] += value
    shapes = {name: f"{block_k}x{block_q}" for name, (block_k, block_q) in TILES.items()}
    columns = " ".join(f"{'slot tiles ' + shapes[name]:>16} {'Z tiles ' + shapes[name]:>14}" for name in TILES)
    print(f"{'layers':>12} {'when':>5} {'rows':>6} {'restorable/row':>14} {'evaluated/row':>13} {'s_p bound':>9} "
          f"{'shared bound':>12} {columns}")  # fmt: skip
    for (kind, when), c in sorted(kinds.items(), key=lambda item: (item[0][0] == "all layers", item[0][1] == "after")):
        n = max(c["rows"], 1)
        shares = " ".join(
            f"{c[name + '_hit'] / max(c[name + '_tiles'], 1):>16.2%} "
            f"{c[name + '_pairs_hit'] / max(c[name + '_pairs'], 1):>14.2%}"
            for name in TILES
        )
        counts = (f"{int(c['rows']):>6} {c['restorable'] / n:>14.1f} {c['evaluated'] / n:>13.2f} "
                  f"{c['exact'] / n:>9.2f} {c['shared'] / n:>12.2f}")  # fmt: skip
        print(f"{kind:>12} {when:>5} {counts} {shares}")


if __name__ == "__main__":
    main()
