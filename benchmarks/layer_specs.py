"""Quick screening of per-layer settings on real SmolLM2 layers: held-out layer loss of whole layers, no model run.

One forward pass of the dense packaged SmolLM2-135M-Instruct over built-in calibration windows gives, for every
linear layer of ``--blocks``, the Gram of ``--nsamples`` calibration windows and of ``--holdout`` held-out windows
(tokens outside every calibration window). Then every setting (``build_spec`` options as in
``compare_methods.py --extra``: ``default``, ``start=admm,scope=layer,refine=none,weights=start``,
``start=admm,objective=refit``, ...) prunes every one of those layers from its dense weights with
:func:`~sparseswaps_prune.core.layer.prune_layer` on the calibration Gram, and the script prints one Markdown row per
setting: the final weights' loss per token summed over the layers on the calibration and on the held-out Gram, the
held-out loss against the first setting, and the layers' pruning time.

Inputs come from the dense model (one-shot, not the sequential pipeline), so every setting sees the same Grams and a
setting is scored in minutes instead of the whole-model ``compare_methods.py`` run; it ranks settings by the
quantity perplexity follows, but only the whole-model run measures perplexity. Rows are saved as JSON in ``--out`` as
they finish (resumable; a row is re-used only if its spec, blocks and calibration match).

    python benchmarks/layer_specs.py --out /tmp/layer_specs --blocks 0 15 29 --patterns 60%
        --settings default "start=admm,scope=layer,refine=none,weights=start" "start=admm,objective=refit"
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import time
from pathlib import Path
from typing import Any

import torch
from common import capture_grams, label, layer_setting, setting_spec

from sparseswaps_prune.atomic import save_json
from sparseswaps_prune.core.gram import GramAccumulator
from sparseswaps_prune.core.layer import prune_layer
from sparseswaps_prune.core.spec import PruneSpec


def score_setting(
    spec: PruneSpec, weights: dict[str, torch.Tensor], grams: dict[str, dict[str, GramAccumulator]]
) -> dict[str, Any]:
    """Prune every layer of ``weights`` with ``spec`` on its ``"small"`` Gram: per-layer and summed per-token losses
    of the final weights on the calibration (``"calib"``) and held-out (``"holdout"``) Grams, and seconds."""
    layers = {}
    for name, weight in weights.items():
        fit, held = grams[name]["small"], grams[name]["holdout"]
        started = time.perf_counter()
        out = prune_layer(weight, fit.gram, spec, holdout_gram=held.gram, name=name)
        layers[name] = {
            "calib": float(out.loss.final.sum()) / fit.n_tokens,
            "holdout": float(out.holdout.final.sum()) / held.n_tokens,
            "seconds": time.perf_counter() - started,
        }
    totals = {key: sum(layer[key] for layer in layers.values()) for key in ("calib", "holdout", "seconds")}
    return {"spec": spec.to_dict(), "layers": layers, "totals": totals}


def main(argv: list[str] | None = None, grams_of=capture_grams) -> dict[str, list[dict[str, Any]]]:
    """Score (or read back) every setting at every pattern and print the tables; returns ``{pattern: [row, ...]}``.
    ``grams_of(blocks, small, large, holdout, seqlen)`` is :func:`common.capture_grams` (tests pass a tiny one)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for per-setting JSON rows (resumable)")
    parser.add_argument("--blocks", type=int, nargs="+", default=[0, 15, 29])
    parser.add_argument("--patterns", nargs="+", default=["60%"])
    parser.add_argument("--settings", nargs="+", default=["default"], help="build_spec options, e.g. start=admm")
    parser.add_argument("--max-iters", type=int, default=25, help="SparseSwaps T unless a setting gives max_iters")
    parser.add_argument("--nsamples", type=int, default=16, help="calibration windows")
    parser.add_argument("--holdout", type=int, default=8, help="held-out windows")
    parser.add_argument("--seqlen", type=int, default=256)
    args = parser.parse_args(argv)

    runs = []  # every setting is checked at every pattern before anything runs
    for pattern in args.patterns:
        for text in args.settings:
            try:
                runs.append((pattern, setting_spec(layer_setting(text), pattern, args.max_iters)))
            except (TypeError, ValueError) as err:
                raise SystemExit(f"setting {text!r} at {pattern}: {err}") from None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = {"blocks": args.blocks, "nsamples": args.nsamples, "holdout": args.holdout, "seqlen": args.seqlen}
    captured = None
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    results: dict[str, list[dict[str, Any]]] = {}
    for pattern, spec in runs:
        name = label(spec)
        path = out / f"{re.sub(r'[^A-Za-z0-9_.=+-]+', '_', f'{pattern}__{name}').strip('_')}.json"
        row = json.loads(path.read_text()) if path.exists() else None
        if row is None or row["spec"] != spec.to_dict() or row["data"] != data:
            if captured is None:
                captured = grams_of(args.blocks, args.nsamples, args.nsamples, args.holdout, args.seqlen)
            row = score_setting(spec, *captured) | {"data": data, "label": name}
            save_json(row, path)
        results.setdefault(pattern, []).append(row)
    for pattern, rows in results.items():
        base = rows[0]["totals"]["holdout"]
        print(
            f"\n{pattern}: blocks {args.blocks}, {len(rows[0]['layers'])} layers, fit on {args.nsamples} x "
            f"{args.seqlen} tokens, held out {args.holdout} x {args.seqlen}; losses per token summed over layers"
        )
        print("| setting | final loss (calib) | final loss (held-out) | held-out vs first | layer s |")
        print("|---|---|---|---|---|")
        for row in rows:
            t = row["totals"]
            change = 100 * (t["holdout"] / base - 1)
            print(f"| {row['label']} | {t['calib']:.4g} | {t['holdout']:.4g} | {change:+.1f}% | {t['seconds']:.1f} |")
    return results


if __name__ == "__main__":
    main()
