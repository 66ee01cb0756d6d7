"""Per-layer report: table, CSV, JSON and a plot of every stage's loss (start mask, refined mask, final weights)
on calibration and held-out tokens, per block and per layer type."""

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
from sparseswaps_prune.extras import require
from sparseswaps_prune.llm.pipeline import LayerReport

CSV_FIELDS = (
    "name",
    "block",
    "d_out",
    "d_in",
    "sparsity",
    "loss_start",
    "loss_refined",
    "loss_final",
    "reduction",
    "final_reduction",
    "holdout_start",
    "holdout_refined",
    "holdout_final",
    "updated_rows",
    "n_swaps",
    "iters",
    "seconds_mask",
    "seconds_weights",
)
STAGES = ("start", "refined", "final")


def layer_rows(layers: Sequence[LayerReport]) -> list[dict[str, Any]]:
    """One dict per layer with every :class:`LayerReport` field plus ``reduction`` and ``final_reduction``."""
    return [
        asdict(layer) | {"reduction": layer.reduction, "final_reduction": layer.final_reduction} for layer in layers
    ]


def _sum(layers: Sequence[LayerReport], name: str) -> float | None:
    values = [getattr(layer, name) for layer in layers]
    return None if not values or any(v is None for v in values) else float(sum(values))


def totals(layers: Sequence[LayerReport]) -> dict[str, float | None]:
    """Every stage's summed loss (calibration and held-out; the held-out sums are None without held-out windows),
    the relative reductions of the refined mask and of the final weights over the start mask, the mean per-layer
    reduction of refinement (the paper's "error reduction"), swaps, the last iteration any layer ran and time."""
    sums = {f"{where}_{stage}": _sum(layers, f"{where}_{stage}") for where in ("loss", "holdout") for stage in STAGES}
    start = sums["loss_start"] or 0.0
    return {
        **sums,
        "reduction": 0.0 if start <= 0 else 1.0 - sums["loss_refined"] / start,
        "final_reduction": 0.0 if start <= 0 else 1.0 - sums["loss_final"] / start,
        "mean_layer_reduction": sum(layer.reduction for layer in layers) / max(1, len(layers)),
        "n_swaps": sum(layer.n_swaps for layer in layers),
        "iters_max": max((layer.iters for layer in layers), default=0),
        "seconds": sum(layer.seconds_mask + layer.seconds_weights for layer in layers),
    }


def format_table(layers: Sequence[LayerReport]) -> str:
    """A fixed-width per-layer table (every stage's calibration loss, the final held-out loss where there is one)
    with a totals line."""
    width = max([len(layer.name) for layer in layers] + [5])
    held = any(layer.holdout_final is not None for layer in layers)
    lines = [
        f"{'layer':<{width}} {'shape':>11} {'sparsity':>8} {'loss start':>11} {'loss refined':>12} "
        f"{'loss final':>11} {'reduct.':>7}" + (f" {'held-out fin.':>13}" if held else "") + f" {'swaps':>7} {'sec':>6}"
    ]

    def row(label: str, shape: str, sparsity: str, values: dict[str, Any], reduction: float) -> str:
        held_final = values["holdout_final"]
        held_text = f" {'n/a' if held_final is None else f'{held_final:.4g}':>13}" if held else ""
        return (
            f"{label:<{width}} {shape:>11} {sparsity:>8} {values['loss_start']:>11.4g} {values['loss_refined']:>12.4g} "
            f"{values['loss_final']:>11.4g} {reduction:>7.1%}{held_text} {values['n_swaps']:>7d} "
            f"{values['seconds']:>6.1f}"
        )

    for layer in layers:
        values = asdict(layer) | {"seconds": layer.seconds_mask + layer.seconds_weights}
        lines.append(row(layer.name, f"{layer.d_out}x{layer.d_in}", f"{layer.sparsity:.1%}", values,
                         layer.final_reduction))  # fmt: skip
    t = totals(layers)
    lines.append(row("total", "", "", t, t["final_reduction"]))
    lines.append("reduct. = 1 - loss final / loss start (calibration tokens)")
    return "\n".join(lines)


def format_bench(bench: dict[str, Any]) -> str:
    """One line of the deployment figures of ``report.json``'s ``bench`` entry (the job's ``bench=True``,
    :func:`~sparseswaps_prune.deploy.bench.bench_model`): weights on disk, the model's memory and greedy decoding
    speed, dense against sparse."""
    mb = lambda n: f"{n / 2**20:.1f} MB"  # noqa: E731
    disk, decode = bench["disk"], bench["decode"]
    parts = [f"weights on disk {mb(disk['dense_bytes'])} -> {mb(disk['sparse_bytes'])} ({disk['ratio']:.3f}x)"]
    memory = bench.get("memory")  # absent where /proc/self/status is
    if memory and memory["anon_ratio"] is not None:
        dense, sparse = memory["dense"]["anon_model"], memory["sparse"]["anon_model"]
        parts.append(f"model memory (anonymous) {mb(dense)} -> {mb(sparse)} ({memory['anon_ratio']:.2f}x)")
    parts.append(
        f"greedy decoding {decode['dense_tokens_per_s']:.1f} -> {decode['sparse_tokens_per_s']:.1f} tokens/s "
        f"({decode['speedup']:.2f}x, same tokens: {'yes' if decode['same_tokens'] else 'NO'})"
    )
    parts.append(f"{bench['sparsified']['converted']} layers sparse, {bench['seconds']:.0f} s")
    return "deployment, dense -> sparse on the CPU: " + "; ".join(parts)


def write_csv(layers: Sequence[LayerReport], path: str | os.PathLike[str]) -> None:
    """Per-layer rows as CSV (columns ``CSV_FIELDS``), written atomically."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(layer_rows(layers))
    save_text(buffer.getvalue(), path)


def plot_stages(layers: Sequence[LayerReport], path: str | os.PathLike[str], title: str = "") -> None:
    """Every stage's loss, per block and per layer type, on calibration and held-out tokens (PNG, atomic).

    Left: the summed layer loss of each block for the start mask, the refined mask and the final weights
    (calibration solid, held-out dashed; log scale). Right: each layer type's mean reduction of the refined mask
    and of the final weights over the start mask (calibration and, where there are held-out windows, held-out).
    """
    require("llm", "matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_blocks, ax_kinds) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    blocks = sorted({layer.block for layer in layers})
    colors = {"start": "tab:gray", "refined": "tab:blue", "final": "tab:green"}
    for where, style in (("loss", "-"), ("holdout", "--")):
        if any(getattr(layer, f"{where}_final") is None for layer in layers):
            continue
        for stage in STAGES:
            sums = [sum(getattr(x, f"{where}_{stage}") for x in layers if x.block == b) for b in blocks]
            label = f"{stage} ({'calibration' if where == 'loss' else 'held-out'})"
            ax_blocks.plot(blocks, sums, style, marker="o", markersize=3, color=colors[stage], label=label)
    ax_blocks.set(xlabel="block", ylabel="summed layer loss", yscale="log", title=title or "layer loss by stage")
    ax_blocks.grid(alpha=0.3)
    ax_blocks.legend(fontsize=8, ncol=2)

    by_kind: dict[str, list[LayerReport]] = defaultdict(list)
    for layer in layers:
        by_kind[layer.kind].append(layer)
    kinds = list(by_kind)
    bars = []
    for where in ("loss", "holdout"):
        if any(getattr(layer, f"{where}_final") is None for layer in layers):
            continue
        for stage in ("refined", "final"):
            means = [100 * sum(_reduction(x, where, stage) for x in by_kind[k]) / len(by_kind[k]) for k in kinds]
            bars.append((f"{stage} ({'calibration' if where == 'loss' else 'held-out'})", means))
    height = 0.8 / max(1, len(bars))
    for i, (label, means) in enumerate(bars):
        ax_kinds.barh([k + i * height for k in range(len(kinds))], means, height=height, label=label)
    ax_kinds.set_yticks([k + 0.4 - height / 2 for k in range(len(kinds))], kinds)
    ax_kinds.invert_yaxis()
    ax_kinds.set(xlabel="mean reduction vs start mask (%)", title="by layer type")
    ax_kinds.grid(alpha=0.3, axis="x")
    ax_kinds.legend(fontsize=8)
    fig.tight_layout()
    suffix = Path(path).suffix.lstrip(".") or "png"
    atomic_write(path, lambda f: fig.savefig(f, format=suffix, dpi=120))
    plt.close(fig)


def _reduction(layer: LayerReport, where: str, stage: str) -> float:
    start = getattr(layer, f"{where}_start")
    return 0.0 if not start or start <= 0 else 1.0 - getattr(layer, f"{where}_{stage}") / start
