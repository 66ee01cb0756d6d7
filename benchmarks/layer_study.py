"""Layer-level study of re-fitting on real SmolLM2 layers: damping, calibration size, re-fit-objective swaps.

Runs one forward pass of the dense packaged SmolLM2-135M-Instruct over calibration windows of the built-in
corpus and accumulates, for every linear layer of the chosen blocks, three Grams of its input: the first
``--small`` windows, all ``--large`` windows (the small set plus more), and ``--holdout`` held-out windows
whose tokens lie outside every calibration window. Inputs come from the dense model (one-shot, not the
sequential pipeline), so every method sees the same Grams. Then, per layer, on a deterministic subset of
``--rows`` evenly spaced rows (rows are independent for every per-row method, so a row subset compares them
without bias), every method is fitted on the small and on the large Gram:

* ``wanda``: the warmstart mask, weights as they are;
* ``wanda + refit (damp d)``: exact per-row least squares on the Wanda mask, for every ``--damps`` value;
* ``swaps T=t``: SparseSwaps (mask objective) from Wanda, and ``swaps T=t + refit``;
* ``refit-objective T=t``: swaps judged by the loss after re-fitting (``refine_mask(objective="refit")``);
  both re-fit with ``--refit-damp``;
* ``sparsegpt``: SparseGPT as published (per-layer selection, OBS updates) on the whole layer, scored on the
  same rows (its rows keep unequal counts).

For each it prints the summed per-token layer loss on the Grams it was fitted on and on the held-out Gram
(``loss / tokens``, so both calibration sizes compare), its change against Wanda on held-out tokens, and its
time. The JSON of every (pattern, calibration size) group is written to ``--out`` as it finishes (resumable).

    python benchmarks/layer_study.py --out /tmp/layer_study [--blocks 0 10 20 29] [--rows 64]
        [--patterns 60% 2:4] [--small 16] [--large 64] [--holdout 16] [--iters 5 25] [--damps 0.001 0.01 0.1]
        [--refit-damp 0.01]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import capture_grams, pattern_options

from sparseswaps_prune.atomic import save_json
from sparseswaps_prune.core.gram import GramAccumulator
from sparseswaps_prune.core.losses import weight_losses
from sparseswaps_prune.core.refine import refine_mask
from sparseswaps_prune.core.refit import refit_weights
from sparseswaps_prune.core.sparsegpt import sparsegpt_prune
from sparseswaps_prune.core.warmstart import warmstart_mask


def study_layer(
    weight: torch.Tensor,
    fit: GramAccumulator,
    held: GramAccumulator,
    rows: torch.Tensor,
    pattern: dict,
    iters: list[int],
    damps: list[float],
    refit_damp: float = 0.01,
) -> dict[str, dict[str, float]]:
    """``{method: {"fit", "holdout", "seconds"}}`` for one layer: per-token losses summed over ``rows``."""
    gram, gram_held = fit.gram, held.gram
    sub = weight[rows].double()
    results: dict[str, dict[str, float]] = {}

    def score(name: str, make: Callable[[], torch.Tensor], extra_seconds: float = 0.0) -> None:
        start = time.perf_counter()
        pruned = make()
        seconds = time.perf_counter() - start + extra_seconds
        results[name] = {
            "fit": float(weight_losses(sub, pruned, gram).sum()) / fit.n_tokens,
            "holdout": float(weight_losses(sub, pruned, gram_held).sum()) / held.n_tokens,
            "seconds": seconds,
        }

    keep = warmstart_mask(sub, "wanda", gram=gram, **pattern)
    score("wanda", lambda: torch.where(keep, sub, 0.0))
    for damp in damps:
        score(
            f"wanda + refit (damp {damp:g})", lambda damp=damp: refit_weights(sub, gram, keep, damp=damp, ridge="mean")
        )
    for t in iters:
        start = time.perf_counter()
        mask = refine_mask(sub, gram, keep, max_iters=t, nm=pattern["nm"]).mask
        seconds = time.perf_counter() - start
        score(f"swaps T={t}", lambda mask=mask: torch.where(mask, sub, 0.0), seconds)
        score(
            f"swaps T={t} + refit",
            lambda mask=mask: refit_weights(sub, gram, mask, damp=refit_damp, ridge="mean"),
            seconds,
        )
        score(
            f"refit-objective T={t}",
            lambda t=t: (
                refine_mask(
                    sub, gram, keep, max_iters=t, nm=pattern["nm"], objective="refit", damp=refit_damp, ridge="mean"
                ).weight
            ),
        )
    score(
        "sparsegpt (published)",
        lambda: sparsegpt_prune(weight, gram.float(), **pattern).weight[rows].double(),
    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for the JSON of every group (resumable)")
    parser.add_argument("--blocks", type=int, nargs="+", default=[0, 10, 20, 29])
    parser.add_argument("--rows", type=int, default=64, help="evenly spaced rows per layer")
    parser.add_argument("--patterns", nargs="+", default=["60%", "2:4"])
    parser.add_argument("--small", type=int, default=16, help="calibration windows of the small fit set")
    parser.add_argument("--large", type=int, default=64, help="calibration windows of the large fit set")
    parser.add_argument("--holdout", type=int, default=16, help="held-out windows")
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--iters", type=int, nargs="+", default=[5, 25])
    parser.add_argument("--damps", type=float, nargs="+", default=[0.001, 0.01, 0.1])
    parser.add_argument("--refit-damp", type=float, default=0.01, help="damping of the swaps + re-fit rows")
    args = parser.parse_args()
    if not 0 < args.small <= args.large:
        raise SystemExit("--small must be in [1, --large]")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    weights, grams = capture_grams(args.blocks, args.small, args.large, args.holdout, args.seqlen)
    for pattern_text in args.patterns:
        pattern = pattern_options(pattern_text)
        for size in ("small", "large"):
            path = out / f"{pattern_text.replace(':', 'of').rstrip('%')}__{size}.json"
            if not path.exists():
                group: dict[str, dict[str, dict[str, float]]] = {}
                for name, weight in weights.items():
                    rows = torch.linspace(0, weight.shape[0] - 1, min(args.rows, weight.shape[0])).round().long()
                    group[name] = study_layer(
                        weight,
                        grams[name][size],
                        grams[name]["holdout"],
                        rows,
                        pattern,
                        args.iters,
                        args.damps,
                        args.refit_damp,
                    )
                    print(f"  {pattern_text} {size}: {name} done", flush=True)
                save_json(group, path)
            report(pattern_text, size, args, json.loads(path.read_text()))


def report(pattern: str, size: str, args: argparse.Namespace, group: dict) -> None:
    """Markdown table of one group: per-token losses summed over layers, change vs Wanda on held-out tokens."""
    windows = args.small if size == "small" else args.large
    methods = list(next(iter(group.values())))
    keys = ("fit", "holdout", "seconds")
    total = {m: {k: sum(layer[m][k] for layer in group.values()) for k in keys} for m in methods}
    base = total["wanda"]["holdout"]
    print(f"\n{pattern}, fit on {windows} x {args.seqlen} tokens, {len(group)} layers, {args.rows} rows each")
    print("| method | fit loss / token | held-out loss / token | held-out vs wanda | seconds |")
    print("|---|---|---|---|---|")
    for m in methods:
        t = total[m]
        change = 100 * (t["holdout"] / base - 1)
        print(f"| {m} | {t['fit']:.4g} | {t['holdout']:.4g} | {change:+.1f}% | {t['seconds']:.1f} |")


if __name__ == "__main__":
    main()
