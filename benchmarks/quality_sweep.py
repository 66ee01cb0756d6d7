"""T sweep: quality and time of SparseSwaps masks against their start mask on the default model.

Prunes the packaged SmolLM2-135M-Instruct from its dense weights once per (pattern, T) with the main job's
setting (built-in corpus, Wanda start, 16 x 256 calibration tokens, 32 x 256 evaluation tokens, sequential
block-wise) and SparseSwaps masks only, the kept weights as they are (``build_spec(SPARSESWAPS_SPEC,
start=--start, sparsity/nm=pattern, max_iters=T, weights="keep")``), and prints a Markdown table:
summed per-layer loss of the refined mask, relative reduction over the start mask, mean per-layer reduction (the
paper's "error reduction"), held-out perplexity, swaps, the last iteration any layer ran ("last iteration"; below T
means every row converged) and time (the layers' pruning time, ``totals()["seconds"]``).
T = 0 is the start mask alone. Rows are saved as JSON in ``--out`` as they finish (an interrupted sweep
continues), and ``--plot`` draws reduction and perplexity against T like the paper's ablation figure.

    python benchmarks/quality_sweep.py --out /tmp/sweep [--iters 0 1 2 5 10 25 50 100] [--patterns 60% 2:4]
        [--start wanda] [--plot sweep.png] [--report-only]

A large ``--iters`` value (e.g. 1000) runs until no row has an improving swap ("until converged").

Rows saved by earlier versions (``PruneOptions(warmstart=...)``, the same masks-only measurement) are read and
printed as they are: the totals this table prints kept their names.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import time
from pathlib import Path

import torch
from common import pattern_options

from sparseswaps_prune.atomic import atomic_write, save_json
from sparseswaps_prune.core.spec import SCORES, SPARSESWAPS_SPEC, build_spec
from sparseswaps_prune.llm.data import load_calibration, load_eval_tokens
from sparseswaps_prune.llm.experiment import Experiment
from sparseswaps_prune.llm.models import load_model
from sparseswaps_prune.llm.pipeline import PruneOptions


def plot(rows: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_red, ax_ppl) = plt.subplots(1, 2, figsize=(10, 4))
    for pattern, runs in rows.items():
        iters = [max(r["iters"], 0.5) for r in runs]  # T = 0 drawn at 0.5 on the log axis
        ax_red.plot(iters, [100 * r["totals"]["mean_layer_reduction"] for r in runs], "o-", label=pattern)
        ax_ppl.plot(iters, [r["perplexity"] for r in runs], "o-", label=pattern)
    ax_red.set(xscale="log", xlabel="T (0 drawn at 0.5)", ylabel="mean per-layer error reduction (%)")
    ax_ppl.set(xscale="log", xlabel="T (0 drawn at 0.5)", ylabel="held-out perplexity")
    for ax in (ax_red, ax_ppl):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("SparseSwaps from Wanda on SmolLM2-135M-Instruct")
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120))
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for per-run JSON rows (resumable)")
    parser.add_argument("--iters", type=int, nargs="+", default=[0, 1, 2, 5, 10, 25, 50, 100])
    parser.add_argument("--patterns", nargs="+", default=["60%", "2:4"])
    parser.add_argument("--start", default="wanda", choices=SCORES, help="start mask scores (default wanda)")
    parser.add_argument("--nsamples", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--eval-windows", type=int, default=32)
    parser.add_argument("--plot", default=None, help="PNG path for the reduction / perplexity plot")
    parser.add_argument("--report-only", action="store_true", help="print (and plot) finished rows, run nothing")
    args = parser.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    @functools.cache  # built on first use: printing finished rows needs no model
    def exp() -> Experiment:
        model, tokenizer = load_model()
        calib = load_calibration("builtin", tokenizer, args.nsamples, args.seqlen, seed=0)
        eval_tokens = load_eval_tokens("builtin", tokenizer)
        return Experiment(
            model, tokenizer, calib, eval_tokens=eval_tokens, seqlen=args.seqlen, eval_windows=args.eval_windows
        )

    print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| pattern | T | summed loss | reduction | mean layer reduction | ppl | swaps | last iteration | pruning s |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows: dict[str, list[dict]] = {}
    for pattern in args.patterns:
        for iters in args.iters:
            path = out / f"{pattern.replace(':', 'of').rstrip('%')}_T{iters}.json"
            if not path.exists():
                if args.report_only:
                    continue
                start = time.perf_counter()
                spec = build_spec(
                    SPARSESWAPS_SPEC, start=args.start, max_iters=iters, weights="keep", **pattern_options(pattern)
                )
                row = exp().run(PruneOptions(spec=spec))
                save_json({**row, "iters": iters, "seconds_wall": time.perf_counter() - start}, path)
            row = json.loads(path.read_text())
            if isinstance(row["perplexity"], dict):  # rows written by run_job before the Experiment harness
                row["perplexity"] = row["perplexity"]["refined"]
            row["iters"] = iters
            rows.setdefault(pattern, []).append(row)
            t = row["totals"]
            print(
                f"| {pattern} | {iters} | {t['loss_refined']:.4g} | {t['reduction']:.1%} | "
                f"{t['mean_layer_reduction']:.1%} | {row['perplexity']:.2f} | {t['n_swaps']} | "
                f"{t.get('iters_max', 'n/a')} | {t['seconds']:.0f} |",
                flush=True,
            )
    if args.plot:
        plot(rows, Path(args.plot))
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
