"""Comparison matrix on the default model: starts x refinements x sparsity patterns (and extra settings).

For every pattern, every ``--starts x --refiners`` pair (masks only by default: ``--weights keep``) and every
``--extra`` or ``--preset`` setting, the packaged SmolLM2-135M-Instruct is pruned from its dense weights with the
sequential pipeline (:class:`~sparseswaps_prune.llm.experiment.Experiment`) on the same built-in calibration
windows, and the script prints one Markdown row: the summed final per-layer loss (of the weights each layer ends
with) on the calibration Gram and on held-out calibration windows (``totals()["loss_final"]`` and
``["holdout_final"]``), held-out perplexity on the evaluation part of the built-in corpus, zero-shot accuracy on the
local ``builtin_cloze`` task, the layers' pruning time (``totals()["seconds"]``) and the whole ``prune_model`` wall
time. Rows are saved as JSON in ``--out`` as they finish, so an interrupted run continues where it stopped.

    python benchmarks/compare_methods.py --out /tmp/compare [--patterns 50% 60% 70% 2:4]
        [--starts magnitude wanda ria sparsegpt] [--refiners none dsnot sparseswaps] [--weights keep]
        [--max-iters 10] [--extra "start=sparsegpt,scope=layer,refine=none,weights=obs" ...]
        [--preset admm-alps] [--report-only] [--plot compare.png]

Finished rows are read back without loading the model, so re-running with the same arguments prints the
table (and draws the plot) at once.

Settings. A matrix row is ``build_spec(start=S, refine=R, weights=--weights)`` at the pattern (T=``--max-iters``
for SparseSwaps). An ``--extra`` setting is a comma-separated list of
:func:`~sparseswaps_prune.core.spec.build_spec` options applied on top of the ``sparseswaps-refit`` recipe's spec
at the pattern (Wanda start, SparseSwaps T=``--max-iters`` under the mask objective,
least-squares re-fit with ADMM's ridge ``G + 0.1 diag(G)``), or on top of the recipe ``recipe=NAME`` names: ``start``,
``start_damp``, ``scope``, ``refine``, ``max_iters``, ``eps``, ``objective``, ``search_dtype``, ``backend``,
``weights``, ``damp``, ``ridge``, ``guard`` (``true``/``false``), plus ``dsnot_skip`` (``DSnoTRefine.skip``; ``none``:
refine every layer). ``default`` is the ``best`` recipe with its block tuning (what ``sparseswaps prune`` runs); an
empty string is the ``sparseswaps-refit`` spec untuned. The budget comes from
``--patterns``; ``scope=layer`` is dropped at N:M patterns (N:M fixes every row's count, so layer-wise methods
select per row there). Examples: ``start=admm,scope=layer,refine=none,weights=start`` (ADMM as published),
``start=sparsegpt,scope=layer,refine=none,weights=obs`` (SparseGPT as published), ``refine=none`` (Wanda +
re-fit), ``weights=keep`` (SparseSwaps masks only). Each row is labelled by its stages, e.g.
``admm/layer -> none -> start weights`` or ``wanda -> sparseswaps T=25 -> ls``; a stage option that
differs from that stage's default is named in the label (``ls damp 0.001 ridge mean (guarded)``,
``sparsegpt damp 0.05``).

Block budgets. ``profile=owl`` (with ``owl_m``, ``owl_lambda``; ``PruneOptions.sparsity_profile``, ``owl_m``,
``owl_lambda``) prunes each block at OWL's sparsity, the pattern's on average (sparsity patterns only); the label
ends in ``, owl M=5 lambda=0.08``. OWL against the uniform default at 60% and 70%:

    python benchmarks/compare_methods.py --out /tmp/owl --patterns 60% 70% --starts --refiners \
        --extra default profile=owl "refine=none,weights=keep" "profile=owl,refine=none,weights=keep"

(the default spec, and Wanda alone, each with uniform and OWL budgets).

ADMM and ALPS against SparseGPT and the default (``--preset admm-alps``, the settings of :data:`PRESETS`): ADMM,
ALPS and SparseGPT as published (layer-wise selection, their own weights), the current default, and ADMM's and
ALPS's masks as the start of SparseSwaps + re-fit, and ALPS's mask with the re-fit alone:

    python benchmarks/compare_methods.py --out /tmp/admm_alps --patterns 60% 2:4 --starts --refiners --preset admm-alps

(``--starts --refiners`` with no values: no matrix rows.) The same with explicit settings:
``--extra "start=admm,scope=layer,refine=none,weights=start" "start=alps,scope=layer,refine=none,weights=start"
"start=sparsegpt,scope=layer,refine=none,weights=obs" default start=admm start=alps "start=alps,refine=none"``.

Saved rows are re-used only if the options they record (``row["options"]``, a ``PruneOptions``; fields added since
take their defaults) equal the setting's: rows written before the typed spec (issue 16: ``PruneOptions(warmstart=...,
refit=...)``, labels joined by ``+``) or with other stage defaults are never read; they are re-run (and with
``--report-only`` skipped with a note).
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import (
    SETTING_BASE,
    add_experiment_args,
    default_experiment,
    options_label,
    parse_setting,
    row_path,
    setting_options,
)

from sparseswaps_prune.atomic import atomic_write, save_json
from sparseswaps_prune.core.spec import (
    REFINES,
    STARTS,
    WEIGHTS,
)
from sparseswaps_prune.llm.experiment import Experiment
from sparseswaps_prune.llm.pipeline import PruneOptions
from sparseswaps_prune.recipes import RECIPES

PRESETS: dict[str, list[str]] = {
    "admm-alps": [
        "start=admm,scope=layer,refine=none,weights=start",  # ADMM as published (Boza 2024)
        "start=alps,scope=layer,refine=none,weights=start",  # ALPS as published (Meng et al. 2024)
        "start=sparsegpt,scope=layer,refine=none,weights=obs",  # SparseGPT as published
        "default",  # the current default: alps/layer -> none -> start weights -> block tune 2
        "tune=3",  # SparseSwaps' own spec, tuned 3 epochs: wanda -> sparseswaps -> ls -> block tune 3
        "start=admm",  # admm -> sparseswaps T=10 (mask objective) -> ls
        "start=alps",  # alps -> sparseswaps T=10 -> ls
        "start=alps,refine=none",  # alps -> none -> ls
    ],
}


def load_row(path: Path, options: PruneOptions | None, extra_eval: list[str]) -> dict[str, Any] | None:
    """The row saved at ``path`` if it was pruned with ``options`` (None: the dense row) and holds the perplexity
    on every ``extra_eval`` text, else None (missing, other options, or a text not measured; fields added to
    ``PruneOptions`` since the row was written take their defaults)."""
    if not path.exists():
        return None
    row = json.loads(path.read_text())
    if not set(extra_eval) <= set(row.get("perplexity_extra", {})):
        return None
    if options is None:
        return row
    try:
        saved = PruneOptions.from_dict(row["options"])
    except (KeyError, TypeError, ValueError):
        return None
    return row if saved == options else None


def format_row(pattern: str, name: str, row: dict[str, Any], extra_eval: list[str]) -> str:
    """One Markdown row: final layer loss (calibration, held-out), perplexity on the built-in evaluation text and
    on each ``extra_eval`` text, cloze accuracy, layer s, prune s."""
    t, acc = row["totals"], row["zero_shot"]
    held = "n/a" if t["holdout_final"] is None else f"{t['holdout_final']:.4g}"
    ppl = " | ".join(
        "n/a" if value is None else f"{value:.2f}"
        for value in (row["perplexity"], *(row["perplexity_extra"][name] for name in extra_eval))
    )
    accuracy = "n/a" if not acc else f"{100 * next(iter(acc.values())):.1f}%"
    return (
        f"| {pattern} | {name} | {t['loss_final']:.4g} | {held} | {ppl} | {accuracy} | {t['seconds']:.0f} | "
        f"{row['seconds_prune']:.0f} |"
    )


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
    return default_experiment(args, args.cloze_items)


def settings_of(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """``(source text, setting)`` of every matrix row, ``--extra`` and ``--preset`` setting, in table order."""
    texts = [f"start={s},refine={r},weights={args.weights}" for s in args.starts for r in args.refiners]
    for name in args.preset:
        texts += PRESETS[name]
    texts += args.extra
    return [(text, parse_setting(text)) for text in texts]


def main(
    argv: list[str] | None = None, make_experiment: Callable[[argparse.Namespace], Experiment] = build_experiment
) -> dict[str, list[dict[str, Any]]]:
    """Run (or read back) every row and print the table; returns ``{pattern: [row, ...]}`` with each row's
    ``"label"``. ``make_experiment(args)`` builds the experiment on first use (tests pass a tiny model)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for per-setting JSON rows (resumable)")
    parser.add_argument("--patterns", nargs="+", default=["50%", "60%", "70%", "2:4"])
    parser.add_argument("--starts", nargs="*", choices=STARTS, default=["magnitude", "wanda", "ria", "sparsegpt"])
    parser.add_argument("--refiners", nargs="*", choices=REFINES, default=["none", "dsnot", "sparseswaps"])
    parser.add_argument("--weights", choices=WEIGHTS, default="keep", help="weight stage of the matrix rows")
    parser.add_argument("--extra", nargs="*", default=[], help="extra settings: build_spec options, e.g. start=admm")
    parser.add_argument("--preset", nargs="*", choices=tuple(PRESETS), default=[], help="named lists of settings")
    parser.add_argument(
        "--max-iters",
        type=int,
        default=RECIPES[SETTING_BASE].spec.refine.max_iters,
        help="SparseSwaps T unless a setting gives max_iters or a recipe (default "
        f"{RECIPES[SETTING_BASE].spec.refine.max_iters}, the {SETTING_BASE} recipe's)",
    )
    add_experiment_args(parser)
    parser.add_argument("--cloze-items", type=int, default=100, help="builtin_cloze items (0: no zero-shot)")
    parser.add_argument("--report-only", action="store_true", help="print (and plot) finished rows, run nothing")
    parser.add_argument("--plot", default=None, help="PNG path: perplexity of every row, one panel per pattern")
    args = parser.parse_args(argv)

    # every setting is checked at every pattern before anything runs
    runs: list[tuple[str, PruneOptions]] = []
    for pattern in args.patterns:
        for text, setting in settings_of(args):
            try:
                options = setting_options(setting, pattern, args.max_iters)
            except (TypeError, ValueError) as err:
                raise SystemExit(f"setting {text!r} at {pattern}: {err}") from None
            if (pattern, options) not in runs:
                runs.append((pattern, options))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    exp = functools.cache(lambda: make_experiment(args))  # built on first use: finished rows need no model

    print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    dense_file = out / "dense.json"
    dense = load_row(dense_file, None, args.extra_eval)
    if dense is None and not args.report_only:
        dense = exp().evaluate()
        save_json(dense, dense_file)
    if dense is not None:
        ppl = ", ".join(
            f"{text} {'n/a' if value is None else f'{value:.3f}'}"
            for text, value in (("builtin", dense["perplexity"]), *dense["perplexity_extra"].items())
        )
        print(f"dense: perplexity {ppl}, zero-shot {dense['zero_shot']}")
    texts = " | ".join(f"ppl ({text})" for text in ("builtin", *args.extra_eval))
    print(
        f"| pattern | method | final layer loss (calib) | final layer loss (held-out) | {texts} | cloze acc | layer s "
        "| prune s |"
    )
    print("|---|---|---|---|---|---|" + "---|" * (len(args.extra_eval) + 2))
    results: dict[str, list[dict[str, Any]]] = {}
    missing = []
    for pattern, options in runs:
        name, path = options_label(options), row_path(out, pattern, options)
        row = load_row(path, options, args.extra_eval)
        if row is None:
            if args.report_only:
                missing.append(f"{pattern} {name}")
                continue
            start = time.perf_counter()
            row = exp().run(options)
            row["seconds_wall"] = time.perf_counter() - start
            save_json(row, path)
        print(format_row(pattern, name, row, args.extra_eval), flush=True)
        results.setdefault(pattern, []).append({**row, "label": name})
    if missing:
        print(f"not run yet (--report-only): {'; '.join(missing)}")
    if args.plot and dense is not None:
        plotted = {p: [(r["label"], r["perplexity"]) for r in rows] for p, rows in results.items()}
        plot(plotted, dense["perplexity"], Path(args.plot))
    return results


if __name__ == "__main__":
    main()
