"""Quality and time of SparseSwaps vs its warmstart on the default model, for several T.

Runs the main job (``sparseswaps prune``'s pipeline: SmolLM2-135M-Instruct, built-in corpus, Wanda
warmstart, 16 x 256 calibration tokens, 32 x 256 evaluation tokens) once per (pattern, T) and prints a
Markdown table: summed per-layer loss, relative reduction over the warmstart, mean per-layer reduction,
held-out perplexity, refinement and wall time. T = 0 is the warmstart alone.

    python benchmarks/quality_sweep.py --out /tmp/sweep [--iters 0 1 5 25 100] [--patterns 60% 2:4]
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from sparseswaps_prune.llm.job import JobConfig, run_job
from sparseswaps_prune.llm.pipeline import PruneOptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for the runs (each resumable)")
    parser.add_argument("--iters", type=int, nargs="+", default=[0, 1, 5, 25, 100])
    parser.add_argument("--patterns", nargs="+", default=["60%", "2:4"])
    parser.add_argument("--warmstart", default="wanda")
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| pattern | T | summed loss | reduction | mean layer reduction | ppl | refine s | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for pattern in args.patterns:
        nm = tuple(int(v) for v in pattern.split(":")) if ":" in pattern else None
        sparsity = None if nm else float(pattern.rstrip("%")) / 100
        for iters in args.iters:
            options = PruneOptions(warmstart=args.warmstart, sparsity=sparsity, nm=nm, max_iters=iters)
            config = JobConfig(prune=options, eval_warmstart=False)
            tag = f"{pattern.replace(':', 'of').rstrip('%')}_T{iters}"
            report = run_job(config, Path(args.out) / tag, progress=False)
            t, ppl = report["totals"], report["perplexity"]
            print(
                f"| {pattern} | {iters} | {t['loss_refined']:.4g} | {t['reduction']:.1%} | "
                f"{t['mean_layer_reduction']:.1%} | {ppl['refined']:.2f} | {t['seconds']:.0f} | "
                f"{report['seconds']['wall']:.0f} |",
                flush=True,
            )
            (Path(args.out) / f"{tag}.json").write_text(json.dumps({k: report[k] for k in ("totals", "perplexity")}))
    print(f"dense perplexity: {report['perplexity']['dense']:.3f}")


if __name__ == "__main__":
    main()
