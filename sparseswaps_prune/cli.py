"""Command line ``sparseswaps``: argument parsing only; the work happens in the library.

sparseswaps prune [--model NAME_OR_PATH] [--sparsity 0.6 | --nm 2:4] [--max-iters T] ... --out DIR
sparseswaps eval --model DIR [--ppl builtin|wikitext|c4|PATH] [--tasks paper|boolq,rte,...]
sparseswaps report DIR
sparseswaps demo
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

from sparseswaps_prune.core.warmstart import WARMSTARTS
from sparseswaps_prune.llm.pipeline import REFINERS, REFITS

# The main job's defaults: the best combination measured within its 10-minute CPU budget (README, RESULTS.md):
# SparseSwaps T=25, then an exact least-squares re-fit that each row keeps only where it lowers its loss on
# DEFAULT_HOLDOUT held-out calibration windows.
DEFAULT_MAX_ITERS = 25
DEFAULT_HOLDOUT = 8


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps({"level": record.levelname, "logger": record.name, "message": record.getMessage()})


def _nm(text: str) -> tuple[int, int]:
    try:
        n, m = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--nm must look like 2:4, got {text!r}") from None
    return n, m


def _prune(args: argparse.Namespace) -> int:
    from sparseswaps_prune.llm.job import JobConfig, run_job, summary
    from sparseswaps_prune.llm.pipeline import PruneOptions

    least_squares = args.refit in ("ls", "cg")
    if args.holdout is None:
        args.holdout = DEFAULT_HOLDOUT if least_squares else 0
    if args.holdout_guard is None:
        args.holdout_guard = least_squares and args.holdout > 0

    options = PruneOptions(
        warmstart=args.warmstart,
        sparsity=None if args.nm else args.sparsity,
        nm=args.nm,
        max_iters=args.max_iters,
        eps=args.eps,
        include=args.include,
        exclude=args.exclude,
        scope=args.scope,
        refine=args.refine,
        objective=args.objective,
        refit=args.refit,
        damp=args.damp,
        holdout_guard=args.holdout_guard,
    )
    config = JobConfig(
        model=args.model,
        gguf_file=args.gguf_file,
        prune=options,
        calib=args.calib,
        nsamples=args.nsamples,
        seqlen=args.seqlen,
        holdout=args.holdout,
        eval=None if args.eval == "none" else args.eval,
        eval_windows=args.eval_windows,
        eval_warmstart=not args.no_eval_warmstart,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        batch_size=args.batch_size,
    )
    report = run_job(config, args.out, progress=not (args.quiet or args.json_log))
    if args.json_log:
        print(json.dumps({k: report[k] for k in ("totals", "perplexity", "seconds")}))
    elif args.quiet:
        ppl = report["perplexity"]
        print(f"{args.out}: reduction {report['totals']['reduction']:.1%}, perplexity {ppl}")
    else:
        print(summary(report))
        print(f"saved to {args.out} (load with AutoModelForCausalLM.from_pretrained({str(args.out)!r}))")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from sparseswaps_prune.llm.data import load_eval_tokens
    from sparseswaps_prune.llm.evaluate import PAPER_TASKS, perplexity, zero_shot
    from sparseswaps_prune.llm.models import load_model
    from sparseswaps_prune.llm.tasks import write_builtin_cloze_task

    model, tokenizer = load_model(args.model, gguf_file=args.gguf_file)
    results: dict[str, object] = {}
    if args.ppl != "none":
        tokens = load_eval_tokens(args.ppl, tokenizer)
        results["perplexity"] = perplexity(
            model, tokens, args.seqlen, batch_size=args.batch_size, device=args.device, max_windows=args.eval_windows
        )
    if args.tasks:
        tasks = PAPER_TASKS if args.tasks == ["paper"] else list(args.tasks)
        include_path = args.include_path
        if "builtin_cloze" in tasks:  # the offline task from the built-in corpus's evaluation part
            if include_path is not None:
                raise ValueError("builtin_cloze cannot be combined with --include-path; run them separately")
            include_path = tempfile.mkdtemp(prefix="sparseswaps_tasks_")
            tasks[tasks.index("builtin_cloze")] = write_builtin_cloze_task(include_path)
        results["zero_shot"] = zero_shot(model, tokenizer, tasks, include_path=include_path, limit=args.limit)
    if not args.quiet:
        zeros = sum(int((p == 0).sum()) for n, p in model.named_parameters() if n.endswith("proj.weight"))
        total = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight"))
        results["sparsity_of_proj_weights"] = zeros / max(1, total)
    print(json.dumps(results, indent=2))
    return 0


def _report(args: argparse.Namespace) -> int:
    from sparseswaps_prune.llm.job import summary

    path = Path(args.dir) / "report.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: {args.dir} holds no finished run (run sparseswaps prune)")
    print(summary(json.loads(path.read_text())))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from sparseswaps_prune.demo import run_demo

    result, seconds = run_demo(args.d_out, args.d_in, args.sparsity, args.max_iters, args.seed)
    before, after = float(result.loss_before.sum()), float(result.loss_after.sum())
    print(f"random layer [{args.d_out} x {args.d_in}], Wanda warmstart at {args.sparsity:.0%} per-row sparsity")
    print(f"layer loss  warmstart: {before:.6g}   SparseSwaps (T={args.max_iters}): {after:.6g}")
    print(
        f"reduction: {result.relative_reduction:.1%}   swaps: {int(result.n_swaps.sum())} "
        f"(iterations: {result.iters})   time: {seconds:.2f} s"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparseswaps", description="SparseSwaps: exact 1-swap LLM pruning")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prune", help="prune a causal LM (default: the packaged SmolLM2-135M) and save it")
    p.add_argument("--model", default=None, help="hub name or local path (default: packaged SmolLM2-135M)")
    p.add_argument("--gguf-file", default=None, help="GGUF file inside --model")
    p.add_argument("--warmstart", default="wanda", choices=WARMSTARTS)
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--sparsity", type=float, default=0.6, help="fraction pruned per row (default 0.6)")
    budget.add_argument("--nm", type=_nm, default=None, help="N:M pattern, e.g. 2:4")
    p.add_argument("--max-iters", type=int, default=DEFAULT_MAX_ITERS, help="SparseSwaps iterations T per layer")
    p.add_argument("--eps", type=float, default=0.0, help="stop a row when its best swap gains less")
    p.add_argument(
        "--scope", default="row", choices=["row", "layer"], help="budget per row, or per layer (moves across rows)"
    )
    p.add_argument("--refine", default="sparseswaps", choices=REFINERS, help="mask refinement after the warmstart")
    p.add_argument(
        "--refit",
        default="ls",
        choices=REFITS,
        help="re-fit kept weights after the masks: ls (exact per row, default), cg (iterative), obs (SparseGPT's "
        "update), none (the paper's SparseSwaps: weights kept)",
    )
    p.add_argument(
        "--objective",
        default="mask",
        choices=["mask", "refit"],
        help="swap objective: kept weights as is, or re-fitted",
    )
    p.add_argument(
        "--damp",
        type=float,
        default=None,
        help="relative dampening of the re-fit (default 1e-3; 0.01 with --refit obs, SparseGPT's)",
    )
    p.add_argument("--include", nargs="+", default=None, help="fnmatch patterns of layer names to prune")
    p.add_argument("--exclude", nargs="+", default=None, help="fnmatch patterns of layer names to skip")
    p.add_argument("--calib", default="builtin", help="builtin | c4 | wikitext | PATH")
    p.add_argument("--nsamples", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument(
        "--holdout",
        type=int,
        default=None,
        help=f"held-out calibration windows, disjoint from the calibration ones (default {DEFAULT_HOLDOUT} with "
        "--refit ls|cg, else 0)",
    )
    p.add_argument(
        "--holdout-guard",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep a row's re-fit only if it lowers its held-out loss (default: on with --refit ls|cg)",
    )
    p.add_argument("--eval", default="builtin", help="perplexity text: builtin | c4 | wikitext | PATH | none")
    p.add_argument("--eval-windows", type=int, default=32, help="at most this many eval windows")
    p.add_argument("--no-eval-warmstart", action="store_true", help="skip the warmstart model's perplexity")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--out", required=True, help="output directory (resumes if it holds an unfinished run)")
    p.add_argument("--quiet", action="store_true", help="no progress bars, one summary line")
    p.add_argument("--json-log", action="store_true", help="JSON log lines on stderr, JSON summary on stdout")
    p.set_defaults(func=_prune)

    e = sub.add_parser("eval", help="perplexity and zero-shot accuracy of a (pruned) model")
    e.add_argument("--model", default=None)
    e.add_argument("--gguf-file", default=None)
    e.add_argument("--ppl", default="builtin", help="builtin | c4 | wikitext | PATH | none")
    e.add_argument("--seqlen", type=int, default=256)
    e.add_argument("--eval-windows", type=int, default=None)
    e.add_argument(
        "--tasks",
        nargs="+",
        default=None,
        help="lm-eval task names, 'paper' (the paper's list) or builtin_cloze (offline)",
    )
    e.add_argument("--include-path", default=None, help="directory of local lm-eval task YAMLs")
    e.add_argument("--limit", type=int, default=None, help="examples per task")
    e.add_argument("--device", default="cpu")
    e.add_argument("--batch-size", type=int, default=4)
    e.add_argument("--quiet", action="store_true")
    e.set_defaults(func=_eval)

    r = sub.add_parser("report", help="print the per-layer table and perplexities of a finished run")
    r.add_argument("dir")
    r.set_defaults(func=_report)

    d = sub.add_parser("demo", help="refine the Wanda mask of a random layer and print the loss")
    d.add_argument("--d-out", type=int, default=256)
    d.add_argument("--d-in", type=int, default=512)
    d.add_argument("--sparsity", type=float, default=0.6)
    d.add_argument("--max-iters", type=int, default=100)
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = logging.StreamHandler()
    if getattr(args, "json_log", False):
        handler.setFormatter(_JsonFormatter())
    level = logging.DEBUG if args.verbose else logging.WARNING if getattr(args, "quiet", False) else logging.INFO
    logging.basicConfig(level=level, handlers=[handler], format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as err:
        print(f"sparseswaps: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
