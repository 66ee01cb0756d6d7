"""Comparison matrix on the default model: warmstarts x refinements x sparsity patterns (and extra settings).

For every pattern and every ``warmstart x refine`` pair (plus any ``--extra`` setting), the packaged
SmolLM2-135M-Instruct is pruned from its dense weights with the sequential pipeline on the same built-in
calibration windows, and the script prints one Markdown row: summed per-layer loss on the calibration Gram
(of the final weights) and on held-out calibration windows, held-out perplexity on the evaluation part of the
built-in corpus, zero-shot accuracy on the local ``builtin_cloze`` task, and time. Rows are saved as JSON in
``--out`` as they finish, so an interrupted run continues where it stopped.

    python benchmarks/compare_methods.py --out /tmp/compare [--patterns 50% 60% 70% 2:4]
        [--warmstarts magnitude wanda ria sparsegpt] [--refiners none dsnot sparseswaps] [--max-iters 25]
        [--extra "warmstart=sparsegpt,scope=layer,refine=none,refit=obs"] [--plot compare.png]

Finished rows are read back without loading the model, so re-running with the same arguments prints the
table (and draws the plot) at once.

An ``--extra`` setting is a comma-separated list of ``PruneOptions`` fields (``warmstart``, ``refine``,
``refit``, ``objective``, ``scope``, ``max_iters``, ``damp``) applied on top of the pattern's defaults.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import tempfile
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from sparseswaps_prune.atomic import atomic_write, save_json
from sparseswaps_prune.llm.data import load_calibration, load_eval_tokens
from sparseswaps_prune.llm.experiment import Experiment
from sparseswaps_prune.llm.models import load_model
from sparseswaps_prune.llm.pipeline import PruneOptions
from sparseswaps_prune.llm.tasks import write_builtin_cloze_task

_FIELD_TYPES = {f.name: f.type for f in fields(PruneOptions)}
# Rows re-fitted with damp 0.01 (the re-fit default before 2026-11-23, and SparseGPT's) carry no damp in their label.
LEGACY_DAMP = 0.01


def pattern_options(pattern: str) -> dict[str, Any]:
    """``"60%"`` -> ``{"sparsity": 0.6, "nm": None}``; ``"2:4"`` -> ``{"sparsity": None, "nm": (2, 4)}``."""
    if ":" in pattern:
        n, m = (int(v) for v in pattern.split(":"))
        return {"sparsity": None, "nm": (n, m)}
    return {"sparsity": float(pattern.rstrip("%")) / 100, "nm": None}


def parse_setting(text: str) -> dict[str, Any]:
    """``"warmstart=sparsegpt,refine=none,max_iters=5"`` -> a dict of ``PruneOptions`` fields."""
    setting: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in _FIELD_TYPES:
            raise SystemExit(f"unknown PruneOptions field {key!r} in --extra {text!r}")
        if key == "max_iters":
            setting[key] = int(value)
        elif key in ("damp", "eps"):
            setting[key] = float(value)
        elif key == "holdout_guard":
            setting[key] = value.lower() in ("1", "true", "yes")
        else:
            setting[key] = None if value == "none" and key == "dsnot_skip" else value
    return setting


def label(setting: dict[str, Any]) -> str:
    parts = [setting["warmstart"] + ("/layer" if setting.get("scope") == "layer" else "")]
    refine = setting.get("refine", "sparseswaps")
    if refine != "none":
        parts.append(refine + (f" T={setting['max_iters']}" if refine == "sparseswaps" else ""))
        if refine == "dsnot" and setting.get("dsnot_skip", "mlp") is None:
            parts[-1] += " (all layers)"
        if setting.get("objective", "mask") != "mask":
            parts[-1] += f" ({setting['objective']} objective)"
    if setting.get("refit", "none") != "none":
        damp = PruneOptions(refit=setting["refit"], damp=setting.get("damp")).resolved_damp
        parts.append(
            f"refit {setting['refit']}"
            + (f" damp {damp:g}" if damp != LEGACY_DAMP else "")
            + (" (held-out guard)" if setting.get("holdout_guard") else "")
        )
    return " + ".join(parts)


def plot(rows: dict[str, list[tuple[str, float]]], dense: float, path: Path) -> None:
    """One horizontal bar panel per pattern: held-out perplexity of every method (log axis), dense as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heights = [len(r) + 1.5 for r in rows.values()]
    fig, axes = plt.subplots(
        len(rows), 1, figsize=(10, 0.3 * sum(heights) + 1), squeeze=False, gridspec_kw={"height_ratios": heights}
    )
    for ax, (pattern, runs) in zip(axes[:, 0], rows.items(), strict=True):
        names, ppl = zip(*runs, strict=True)
        ax.barh(range(len(runs)), ppl, color=["tab:orange" if "sparseswaps" in n else "tab:gray" for n in names])
        for i, value in enumerate(ppl):
            ax.text(value, i, f" {value:.1f}", va="center", fontsize=7)
        ax.set_yticks(range(len(runs)), names, fontsize=8)
        ax.invert_yaxis()
        ax.axvline(dense, color="k", linestyle="--", label=f"dense {dense:.1f}")
        ax.set(xscale="log", xlabel="held-out perplexity (log)", title=pattern)
        ax.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct, built-in corpus (lower is better)")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / fig.get_figheight()))  # leave 0.4 inch for the suptitle
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)


def build_experiment(args: argparse.Namespace) -> Experiment:
    """The default model with the built-in calibration, held-out, evaluation and cloze data of ``args``."""
    model, tokenizer = load_model()
    windows = load_calibration("builtin", tokenizer, args.nsamples, args.seqlen, seed=0, holdout=args.holdout)
    task_dir = tempfile.mkdtemp(prefix="sparseswaps_tasks_")
    tasks = [write_builtin_cloze_task(task_dir, n_items=args.cloze_items)] if args.cloze_items else None
    return Experiment(
        model,
        tokenizer,
        windows[: args.nsamples],
        holdout_tokens=windows[args.nsamples :] if args.holdout else None,
        eval_tokens=load_eval_tokens("builtin", tokenizer),
        seqlen=args.seqlen,
        eval_windows=args.eval_windows,
        tasks=tasks,
        include_path=task_dir if tasks else None,
        device=args.device,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for per-setting JSON rows (resumable)")
    parser.add_argument("--patterns", nargs="+", default=["50%", "60%", "70%", "2:4"])
    parser.add_argument("--warmstarts", nargs="*", default=["magnitude", "wanda", "ria", "sparsegpt"])
    parser.add_argument("--refiners", nargs="*", default=["none", "dsnot", "sparseswaps"])
    parser.add_argument("--extra", nargs="*", default=[], help="extra settings, e.g. warmstart=sparsegpt,refit=obs")
    parser.add_argument("--max-iters", type=int, default=25)
    parser.add_argument("--nsamples", type=int, default=16)
    parser.add_argument("--holdout", type=int, default=8, help="held-out calibration windows")
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--eval-windows", type=int, default=32)
    parser.add_argument("--cloze-items", type=int, default=100, help="builtin_cloze items (0: no zero-shot)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--report-only", action="store_true", help="print (and plot) finished rows, run nothing")
    parser.add_argument("--plot", default=None, help="PNG path: perplexity of every row, one panel per pattern")
    args = parser.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    exp = functools.cache(lambda: build_experiment(args))  # built on first use: finished rows need no model

    print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    dense_file = out / "dense.json"
    if not dense_file.exists():
        save_json(exp().evaluate(), dense_file)
    dense = json.loads(dense_file.read_text())
    print(f"dense: perplexity {dense['perplexity']:.3f}, zero-shot {dense['zero_shot']}")
    print("| pattern | method | layer loss (calib) | layer loss (held-out) | ppl | zero-shot acc | prune s |")
    print("|---|---|---|---|---|---|---|")
    settings = [
        {"warmstart": w, "refine": r, "max_iters": args.max_iters if r == "sparseswaps" else 0}
        for w in args.warmstarts
        for r in args.refiners
    ] + [{"warmstart": "wanda", "max_iters": args.max_iters, **parse_setting(text)} for text in args.extra]
    plotted: dict[str, list[tuple[str, float]]] = {}
    for pattern in args.patterns:
        for setting in settings:
            name = f"{pattern.replace(':', 'of').rstrip('%')}__{label(setting)}".replace(" ", "_").replace("/", "-")
            path = out / f"{name}.json"
            if not path.exists():
                if args.report_only:
                    continue
                start = time.perf_counter()
                row = exp().run(PruneOptions(**pattern_options(pattern), **setting))
                row["seconds_wall"] = time.perf_counter() - start
                save_json(row, path)
            row = json.loads(path.read_text())
            t, acc = row["totals"], row["zero_shot"]
            held = "n/a" if t["holdout_refined"] is None else f"{t.get('holdout_refit') or t['holdout_refined']:.4g}"
            accuracy = "n/a" if not acc else f"{100 * next(iter(acc.values())):.1f}%"
            print(
                f"| {pattern} | {label(setting)} | {t['loss_final']:.4g} | {held} | {row['perplexity']:.2f} | "
                f"{accuracy} | {row['seconds_prune']:.0f} |",
                flush=True,
            )
            plotted.setdefault(pattern, []).append((label(setting), row["perplexity"]))
    if args.plot:
        plot(plotted, dense["perplexity"], Path(args.plot))


if __name__ == "__main__":
    main()
