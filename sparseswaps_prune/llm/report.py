"""Per-layer report: table, CSV, JSON and a plot of the error reduction per layer type and block."""

from __future__ import annotations

import csv
import io
import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sparseswaps_prune.atomic import atomic_write, save_text
from sparseswaps_prune.llm.pipeline import LayerReport

CSV_FIELDS = (
    "name",
    "block",
    "d_out",
    "d_in",
    "sparsity",
    "loss_warmstart",
    "loss_refined",
    "reduction",
    "n_swaps",
    "iters",
    "seconds",
    "loss_refit",
    "seconds_refit",
    "holdout_warmstart",
    "holdout_refined",
    "holdout_refit",
    "refit_rows",
)


def layer_rows(layers: Sequence[LayerReport]) -> list[dict[str, Any]]:
    """One dict per layer with every :class:`LayerReport` field plus ``reduction``."""
    return [asdict(layer) | {"reduction": layer.reduction} for layer in layers]


def _sum(layers: Sequence[LayerReport], name: str) -> float | None:
    values = [getattr(layer, name) for layer in layers]
    return None if not values or any(v is None for v in values) else float(sum(values))


def totals(layers: Sequence[LayerReport]) -> dict[str, float | None]:
    """Summed losses, overall relative reduction, mean per-layer reduction, swaps and time; the re-fit and
    held-out sums are None where a layer lacks them."""
    before = sum(layer.loss_warmstart for layer in layers)
    after = sum(layer.loss_refined for layer in layers)
    return {
        "loss_warmstart": before,
        "loss_refined": after,
        "reduction": 0.0 if before <= 0 else 1.0 - after / before,
        "mean_layer_reduction": sum(layer.reduction for layer in layers) / max(1, len(layers)),
        "n_swaps": sum(layer.n_swaps for layer in layers),
        "iters_max": max((layer.iters for layer in layers), default=0),
        "seconds": sum(layer.seconds + layer.seconds_refit for layer in layers),
        "loss_final": sum(layer.loss_final for layer in layers),
        **{name: _sum(layers, name) for name in CSV_FIELDS[-6:-1] if name != "seconds_refit"},
    }


def format_table(layers: Sequence[LayerReport]) -> str:
    """A fixed-width per-layer table with a totals line."""
    width = max([len(layer.name) for layer in layers] + [5])
    lines = [
        f"{'layer':<{width}} {'shape':>11} {'sparsity':>8} {'loss warm':>11} {'loss swap':>11} "
        f"{'reduct.':>7} {'swaps':>7} {'sec':>6}"
    ]
    for layer in layers:
        shape = f"{layer.d_out}x{layer.d_in}"
        lines.append(
            f"{layer.name:<{width}} {shape:>11} {layer.sparsity:>8.1%} {layer.loss_warmstart:>11.4g} "
            f"{layer.loss_refined:>11.4g} {layer.reduction:>7.1%} {layer.n_swaps:>7d} {layer.seconds:>6.1f}"
        )
    t = totals(layers)
    lines.append(
        f"{'total':<{width}} {'':>11} {'':>8} {t['loss_warmstart']:>11.4g} {t['loss_refined']:>11.4g} "
        f"{t['reduction']:>7.1%} {t['n_swaps']:>7d} {t['seconds']:>6.1f}"
    )
    return "\n".join(lines)


def write_csv(layers: Sequence[LayerReport], path: str | os.PathLike[str]) -> None:
    """Per-layer rows as CSV (columns ``CSV_FIELDS``), written atomically."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(layer_rows(layers))
    save_text(buffer.getvalue(), path)


def plot_reduction(layers: Sequence[LayerReport], path: str | os.PathLike[str], title: str = "") -> None:
    """Per-layer relative error reduction over the warmstart: one line per layer type across blocks,
    plus a bar of each type's mean (PNG, written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_kind: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for layer in layers:
        by_kind[layer.kind].append((layer.block, 100 * layer.reduction))
    fig, (ax_blocks, ax_mean) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [3, 1]})
    for kind, points in by_kind.items():
        blocks, values = zip(*sorted(points), strict=True)
        ax_blocks.plot(blocks, values, marker="o", markersize=3, label=kind)
    ax_blocks.set(xlabel="block", ylabel="error reduction vs warmstart (%)", title=title or "per-layer reduction")
    ax_blocks.grid(alpha=0.3)
    ax_blocks.legend(fontsize=8, ncol=2)
    kinds = list(by_kind)
    means = [sum(v for _, v in by_kind[k]) / len(by_kind[k]) for k in kinds]
    ax_mean.barh(kinds, means, color="tab:blue")
    ax_mean.invert_yaxis()
    ax_mean.set(xlabel="mean reduction (%)", title="by layer type")
    ax_mean.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    suffix = Path(path).suffix.lstrip(".") or "png"
    atomic_write(path, lambda f: fig.savefig(f, format=suffix, dpi=120))
    plt.close(fig)
