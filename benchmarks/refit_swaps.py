"""Re-fit-objective swap speed: state construction and one iteration per row batch, against the mask-only search.

For each width d_in at ``--pattern`` (60% per row by default, or N:M; Wanda warmstart on a random correlated layer),
prints per row and per re-fit engine (the torch reference and, on the CPU, the compiled numba engine, on CUDA the
lazy state with its scan and moves in Triton kernels, ``triton``; ``same``: the engine applied the first engine's
swaps in every timed iteration): the time to
build the float64 re-fit state (Cholesky of G_SS + lambda I, H, v, r, s and Z = H G[S, P]: O(k^2 (d_in - k))) and of
one re-fit iteration (the updates of the applied swaps, then the pair scan of the swapped rows), against a
least-squares re-fit of the same mask (refit_weights) and one mask-only iteration (best_swaps on the default
backend, then the float64 c update; and ``mask rows it``: an iteration of the mask objective's row model
``refine.MaskRows``, run as the re-fit engines' are, i.e. as ``refine.iterate`` runs it, with the same per-call
costs: the like-for-like comparison), plus the state's memory per row, and the floor of this design: the Cholesky
factor ``L`` of ``G_SS + lambda I`` and the Schur complement ``s_p = G_pp + lambda - ||L^{-1} G[S, p]||^2`` of every
pruned ``p`` (one triangular solve against all of ``G[S, P]``, ``k^2 (d_in - k)`` flops), which the pair scan's
bound ``dF >= -r_p^2 / s_p`` needs before it can skip any column; and the torch state build with ``H`` formed both
ways (``build_state(triangular_inverse=...)``: ``torch.cholesky_inverse``, the CPU default, or the factor's
triangular inverse and a product, the CUDA default). ``--slot-align`` sets ``refit_lazy_triton.SLOT_ALIGN`` (the
Triton engine's slot counts are rounded up to a multiple of it; 1: the exact counts). Figures go to BENCHMARKS.md
only from a quiet machine.

    python benchmarks/refit_swaps.py [--device cpu] [--widths 576 1536 4096] [--rows 8] [--iters 8] [--threads N]
                                     [--pattern 60%|2:4] [--slot-align 16] [--engines torch triton]
"""

from __future__ import annotations

import argparse
import platform

import torch
from common import iterate_step, pattern_options, random_layer, timed

from sparseswaps_prune.core.backends import best_swaps, resolve_backend, triton_available
from sparseswaps_prune.core.backends.gram_gather import gather_gram
from sparseswaps_prune.core.losses import correlation
from sparseswaps_prune.core.refine import MaskRows, RefitRows
from sparseswaps_prune.core.refit import damping, factor_kept, refit_weights
from sparseswaps_prune.core.refit_swaps import build_state, pruned_slots

# Timed runs (after one warm-up) of the builds, the least-squares re-fit and the floor.
BUILD_REPEAT = 2


def schur_floor(weight: torch.Tensor, gram: torch.Tensor, keep: torch.Tensor, lam: float) -> torch.Tensor:
    """``[R, Q]`` Schur complements ``s_p`` of every row's pruned inputs from the Cholesky factor of its kept
    system: what any state with the scan's bound must compute (float64)."""
    counts = keep.sum(1)
    kept, kept_ok, factor = factor_kept(gram, keep, lam, int(counts.max()))
    pruned, _ = pruned_slots(keep, keep.shape[1] - int(counts.min()))
    cross = gather_gram(gram, torch.where(kept_ok, kept, 0), pruned) * kept_ok[:, :, None]  # as build_state
    half = torch.linalg.solve_triangular(factor, cross, upper=False)  # L^-1 G[S, P]
    return torch.diagonal(gram)[pruned] + lam - half.square().sum(dim=1)


def row_model_iterations(model: MaskRows | RefitRows, rows: torch.Tensor, iters: int) -> float:
    """Mean seconds of an iteration of ``model``'s row scope as ``refine.iterate`` runs it (``common.iterate_step``:
    the rows whose swap lowers the loss chosen on the host, one transfer each way), over ``iters`` iterations after
    one warm-up iteration (compilation); ``model`` is modified."""
    figures = model.figures(rows, cross=False)

    def iteration() -> None:
        iterate_step(model.apply, lambda moved: model.figures(moved, cross=False), figures, rows.device)

    return timed(iteration, repeat=iters)


def measure(
    d_in: int,
    n_rows: int,
    device: str,
    damp: float,
    search: str,
    iters: int,
    pattern: str = "60%",
    engines: list[str] | None = None,
) -> tuple[int, float, dict[str, tuple[float, float, bool]], float, float, float, tuple[float, float], float]:
    """``(k, state MiB per row, {engine: (build s/row, iteration s/row, same masks as the first engine)},
    least-squares re-fit s/row, mask-only iteration s/row, floor s/row, (torch build s/row with H by
    cholesky_inverse, by the triangular inverse), mask-objective row-model iteration s/row)`` for one width. An
    iteration is ``refine.iterate``'s (:func:`row_model_iterations`): the updates of the applied swaps plus the pair
    scan of the swapped rows (a row whose best swap does not lower ``F`` keeps its figures), averaged over ``iters``
    iterations after one warm-up iteration (the lazy engines fold their pending terms every few moves). The
    mask-only iteration is the search and the ``c`` update alone (the figures of earlier tables); the mask-objective
    row model's (``refine.MaskRows``) runs as the re-fit engines' do, with the same per-call costs. ``engines``:
    ``RefitRows`` engines (default: torch and numba on the CPU; torch and triton on CUDA). ``pattern``: ``"60%"``,
    ``"2:4"``, ... (``search`` must be ``"nm"`` for N:M)."""
    nm = pattern_options(pattern)["nm"]
    weight, gram, keep = (t.to(device) for t in random_layer(d_in, n_rows, pattern, dtype=torch.float64))
    k = int(keep.sum(1).max())
    q = d_in - k
    lam = damping(gram, damp)
    rows = torch.arange(n_rows, device=weight.device)
    # before the engines' states exist (memory: at 14336 inputs a state is 627 MiB per row)
    builds = tuple(
        timed(lambda tri=tri: build_state(weight, keep, gram, lam, k, q, triangular_inverse=tri), BUILD_REPEAT) / n_rows
        for tri in (False, True)
    )
    if engines is None:
        cpu = weight.device.type == "cpu"
        engines = ["torch", "numba"] if cpu else ["torch"] + ["triton"] * triton_available()
    figures, masks = {}, {}
    for engine in engines:

        def build(engine: str = engine) -> RefitRows:
            m = nm[1] if nm else None
            return RefitRows(weight, keep.clone(), gram, lam=lam, m=m, row_batch=n_rows, cross=False, engine=engine)

        build_s = timed(build, repeat=BUILD_REPEAT)
        model = build()
        iteration_s = row_model_iterations(model, rows, iters)
        masks[engine] = model.keep
        same = torch.equal(model.keep, masks[engines[0]])
        figures[engine] = (build_s / n_rows, iteration_s / n_rows, same)
    mask_rows = MaskRows(weight, keep.clone(), gram, gram.float(), search=search, nm=nm, row_batch=n_rows)
    mask_rows_it = row_model_iterations(mask_rows, rows, iters) / n_rows
    ls = timed(lambda: refit_weights(weight, gram, keep, damp=damp, ridge="mean"), repeat=BUILD_REPEAT)
    w32, g32 = weight.float(), gram.float()
    corr = correlation(weight, gram, keep)

    def mask_iteration() -> torch.Tensor:
        u, p, _ = best_swaps(search, w32, keep, corr.float(), g32, nm)
        u, p = u.to(weight.device), p.to(weight.device)
        return corr + weight.gather(1, u[:, None]) * gram[u] - weight.gather(1, p[:, None]) * gram[p]

    mask_it = timed(mask_iteration)
    floor = timed(lambda: schur_floor(weight, gram, keep, lam), repeat=BUILD_REPEAT)
    mib = (k * k + k * q) * 8 / 2**20
    return k, mib, figures, ls / n_rows, mask_it / n_rows, floor / n_rows, builds, mask_rows_it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--widths", type=int, nargs="+", default=[576, 1536, 4096])
    parser.add_argument("--rows", type=int, default=8, help="rows per batch")
    parser.add_argument("--damp", type=float, default=0.01)
    parser.add_argument("--iters", type=int, default=8, help="re-fit iterations averaged per engine")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--pattern", default="60%", help="e.g. 60%% or 2:4")
    parser.add_argument("--slot-align", type=int, default=None, help="refit_lazy_triton.SLOT_ALIGN (default: as is)")
    parser.add_argument("--engines", nargs="+", default=None, help="e.g. torch triton (default: all)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    align = ""
    if triton_available():
        from sparseswaps_prune.core.backends import refit_lazy_triton

        refit_lazy_triton.SLOT_ALIGN = args.slot_align or refit_lazy_triton.SLOT_ALIGN
        align = f", Triton slots aligned to {refit_lazy_triton.SLOT_ALIGN}"
    print(
        f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, device {args.device}, {args.rows} rows per batch, {args.pattern}{align}"
    )
    print(
        f"{'d_in':>5} {'k':>5} {'state MiB/row':>13} {'engine':>6} {'build s/row':>11} {'refit it s/row':>14} "
        f"{'ls re-fit s/row':>15} {'mask it s/row':>13} {'floor s/row':>11} {'same':>4} {'H potri s/row':>13} "
        f"{'H trsm s/row':>12} {'mask rows it s/row':>18}"
    )
    search = resolve_backend("auto", torch.device(args.device), pattern_options(args.pattern)["nm"])
    for d_in in args.widths:
        k, mib, figures, ls, mask_it, floor, (by_potri, by_trsm), mask_rows_it = measure(
            d_in, args.rows, args.device, args.damp, search, args.iters, args.pattern, args.engines
        )
        for engine, (build, refit_it, same) in figures.items():
            print(
                f"{d_in:>5} {k:>5} {mib:>13.1f} {engine:>6} {build:>11.3e} {refit_it:>14.3e} {ls:>15.3e} "
                f"{mask_it:>13.3e} {floor:>11.3e} {'yes' if same else 'NO':>4} {by_potri:>13.3e} {by_trsm:>12.3e} "
                f"{mask_rows_it:>18.3e}"
            )


if __name__ == "__main__":
    main()
