"""Re-fit-objective swaps against mask-only swaps on every linear layer of the default model (CPU, real layers).

One dense forward of the packaged SmolLM2-135M-Instruct over ``--nsamples`` built-in calibration windows gives the
Gram of every linear layer of ``--blocks`` (all 30 by default). Every layer gets a Wanda mask of ``--pattern`` and is
refined, row batch by row batch as :func:`~sparseswaps_prune.core.refine.refine_mask` batches it by default, for
``--iters`` iterations (each: every row's best swap, then the applied swaps' state updates) under both objectives:
the re-fit objective on the compiled CPU engine (``engine="numba"``, what ``backend="auto"`` runs on the CPU) and
the mask objective on the default search backend. Printed per layer kind and summed over the model: seconds to
build the re-fit state, seconds of the ``--iters`` re-fit iterations, of the same number of mask-only iterations,
and of a least-squares re-fit of the Wanda mask (``refit_weights``), with the ratios the issue's targets name
(re-fit iteration / mask-only iteration; state build / least-squares re-fit). The iterations are the library's
loop (:func:`~sparseswaps_prune.core.refine.iterate` with the row scope's planner and its rounding floor, as
``refine_mask`` runs them): a row whose best swap no longer lowers its loss retires, and only moved rows are
scanned again. Also the floor of a state without every row's ``s_p`` (``lazy s``, ``lazy/ls``; the layer-wide bound
``sigma_p <= s_p`` instead, ``common.lazy_build``) and the columns per row its first scan would visit
(``visits/row``).

    python benchmarks/refit_model_iteration.py [--blocks 0 1 ...] [--pattern 60%] [--iters 10] [--nsamples 16]
"""

from __future__ import annotations

import argparse
import platform
import time
from collections import defaultdict

import torch
from common import (
    add_layer_run_args,
    bound_visits,
    capture_grams,
    lazy_build,
    pattern_options,
    shared_schur_bound,
)

from sparseswaps_prune.core import refine
from sparseswaps_prune.core.backends import resolve_backend
from sparseswaps_prune.core.refine import MaskRows, RefitRows, RowPlanner, _default_row_batch
from sparseswaps_prune.core.refit import damping, refit_weights
from sparseswaps_prune.core.spec import SwapRefine
from sparseswaps_prune.core.warmstart import warmstart_mask

CPU = torch.device("cpu")


def iterate(model: MaskRows | RefitRows, iters: int) -> float:
    """Seconds of up to ``iters`` iterations of ``model`` in the library's row-scope loop."""
    started = time.perf_counter()
    refine.iterate(model, RowPlanner(model.rounding.cpu()), max_iters=iters, resync_every=SwapRefine().resync_every)
    return time.perf_counter() - started


def measure(weight: torch.Tensor, gram: torch.Tensor, pattern: str, iters: int, damp: float) -> dict[str, float]:
    """Seconds of one layer: re-fit state build, ``iters`` re-fit iterations, ``iters`` mask-only iterations and a
    least-squares re-fit, over its default row batches; and the floor of a state without every row's ``s_p``
    (``lazy``: ``common.shared_schur_bound`` once, then ``common.lazy_build`` of each row batch with as many columns
    as its row that visits the most, ``visits`` summed over rows: ``common.bound_visits`` with it at the start)."""
    options = pattern_options(pattern)
    nm = options["nm"]
    w64, gram64 = weight.double(), gram.double()
    keep = warmstart_mask(weight, "wanda", sparsity=options["sparsity"], nm=nm, gram=gram64)
    lam = damping(gram64, damp)
    out = defaultdict(float)
    started = time.perf_counter()
    shared = shared_schur_bound(gram64, lam)
    out["lazy"] = time.perf_counter() - started
    batch = _default_row_batch(keep, True, spare=0, device=CPU)
    for r0 in range(0, keep.shape[0], batch):
        sub = slice(r0, r0 + batch)
        started = time.perf_counter()
        model = RefitRows(w64[sub], keep[sub].clone(), gram64, lam=lam, m=nm[1] if nm else None, row_batch=batch,
                          cross=False, engine="numba")  # fmt: skip
        out["build"] += time.perf_counter() - started
        rows = torch.arange(model.keep.shape[0])
        best = model.figures(rows, cross=False).swap_dl
        visits = bound_visits(model.state, w64[sub], rows, best, shared[model.state.pruned[rows]])
        out["visits"] += float(visits.sum())
        started = time.perf_counter()
        lazy_build(w64[sub], keep[sub], gram64, lam, shared, int(visits.max()))
        out["lazy"] += time.perf_counter() - started
        out["refit"] += iterate(model, iters)
        del model
    search = resolve_backend("auto", CPU, nm)
    mask = MaskRows(w64, keep.clone(), gram64, gram64.float(), search=search, nm=nm,
                    row_batch=_default_row_batch(keep, False, spare=0, device=CPU))  # fmt: skip
    out["mask"] = iterate(mask, iters)
    started = time.perf_counter()
    refit_weights(weight, gram64, keep, damp=damp, ridge="mean")
    out["ls"] = time.perf_counter() - started
    return dict(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_layer_run_args(parser, blocks=list(range(30)))
    args = parser.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; {len(args.blocks)} blocks, {args.pattern}, {args.iters} iterations"
    )
    weights, grams = capture_grams(args.blocks, args.nsamples, args.nsamples, 0, args.seqlen)
    # compile the kernels on a small layer first, so no layer's figures include compilation
    first = next(iter(weights))
    measure(weights[first][:4], grams[first]["small"].gram, args.pattern, 2, args.damp)
    kinds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for name, weight in weights.items():
        figures = measure(weight, grams[name]["small"].gram, args.pattern, args.iters, args.damp)
        for key, value in figures.items():
            kinds[name.rsplit(".", 1)[-1]][key] += value
        kinds[name.rsplit(".", 1)[-1]]["rows"] += weight.shape[0]
    keys = ("build", "ls", "refit", "mask", "lazy", "visits", "rows")
    kinds["all layers"] = {key: sum(s[key] for s in kinds.values()) for key in keys}
    print(f"{'layers':>12} {'build s':>9} {'ls re-fit s':>11} {'build/ls':>8} {'refit its s':>11} "
          f"{'mask its s':>10} {'refit/mask':>10} {'lazy s':>8} {'lazy/ls':>7} {'visits/row':>10}")  # fmt: skip
    for kind, s in kinds.items():
        print(
            f"{kind:>12} {s['build']:>9.2f} {s['ls']:>11.2f} {s['build'] / s['ls']:>8.2f} {s['refit']:>11.2f} "
            f"{s['mask']:>10.2f} {s['refit'] / s['mask']:>10.2f} {s['lazy']:>8.2f} {s['lazy'] / s['ls']:>7.2f} "
            f"{s['visits'] / s['rows']:>10.1f}"
        )


if __name__ == "__main__":
    main()
