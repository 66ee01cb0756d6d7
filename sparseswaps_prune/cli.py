"""Command line ``sparseswaps``: argument parsing only; the work happens in the library.

sparseswaps prune [--model NAME_OR_PATH] [--sparsity 0.6 | --nm 2:4] [--max-iters T] ... --out DIR
sparseswaps eval --model DIR [--ppl builtin|wikitext|c4|PATH] [--tasks paper|boolq,rte,...]
sparseswaps report DIR
sparseswaps bench DIR [--threads N] [--new-tokens 32] [--json-out FILE]
sparseswaps demo
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from sparseswaps_prune.core.budgets import OWL_LAMBDA, OWL_M, PROFILES
from sparseswaps_prune.core.spec import (
    OBJECTIVES,
    REFINES,
    SCOPES,
    SEARCH_BACKENDS,
    SPARSESWAPS_SPEC,
    STARTS,
    WEIGHTS,
    LeastSquares,
    build_spec,
)
from sparseswaps_prune.finetune.train import ADAPTERS
from sparseswaps_prune.llm.block_tune import BLOCK_TUNE_LR, BLOCK_TUNE_SCHEDULE, SCHEDULES
from sparseswaps_prune.recipes import DEFAULT_RECIPE, RECIPES, RENAMED_RECIPES, get_recipe, recipe_name

if TYPE_CHECKING:
    from sparseswaps_prune.llm.job import JobConfig


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps({"level": record.levelname, "logger": record.name, "message": record.getMessage()})


def _nm(text: str) -> tuple[int, int]:
    try:
        n, m = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--nm must look like 2:4, got {text!r}") from None
    return n, m


def job_config(args: argparse.Namespace) -> JobConfig:
    """The :class:`~sparseswaps_prune.llm.job.JobConfig` that ``sparseswaps prune`` runs for parsed ``args``: the
    recipe (:data:`~sparseswaps_prune.recipes.RECIPES`, ``--recipe``, default ``best``) with the given options
    changed (:func:`~sparseswaps_prune.core.spec.build_spec`), everything else the ``JobConfig`` defaults; with no
    option but ``--recipe X`` it equals ``JobConfig(prune=PruneOptions(recipe="X"))``."""
    from sparseswaps_prune.llm.job import JobConfig
    from sparseswaps_prune.llm.pipeline import PruneOptions

    name = recipe_name(args.recipe)
    spec = build_spec(
        get_recipe(name).spec, sparsity=args.sparsity, nm=args.nm, scope=args.scope, start=args.start,
        start_damp=args.start_damp, refine=args.refine, max_iters=args.max_iters, eps=args.eps,
        objective=args.objective, search_dtype=args.search_dtype, backend=args.backend, swap_scope=args.swap_scope,
        weights=args.weights, damp=args.damp, guard=args.guard, ridge=args.ridge,
    )  # fmt: skip
    profile = {name: getattr(args, name) for name in _PROFILE_FIELDS if getattr(args, name) is not None}
    if args.sparsity_profile != "owl" and profile.keys() - {"sparsity_profile"}:
        given = ", ".join(f"--{name.replace('_', '-')}" for name in profile if name != "sparsity_profile")
        raise ValueError(f"{given} set OWL's budgets: add --sparsity-profile owl, or drop them")
    tune = {field: getattr(args, field) for field in _TUNE_FIELDS if getattr(args, field) is not None}
    options = PruneOptions(
        recipe=name, spec=spec, include=args.include, exclude=args.exclude, gram_dtype=args.gram_dtype,
        calib_shards=args.calib_shards, row_shards=args.row_shards, **profile, **tune,
    )  # fmt: skip
    given = {name: getattr(args, name) for name in _JOB_FIELDS if getattr(args, name) is not None}
    config = JobConfig(prune=options, **given)
    if args.eval == "none" or (args.blockwise and args.eval is None):  # block-wise runs do not evaluate
        config.eval = None
    config.eval_warmstart = not args.no_eval_warmstart
    return config


_PROFILE_FIELDS = ("sparsity_profile", "owl_m", "owl_lambda")
_TUNE_FIELDS = ("block_tune_epochs", "block_tune_lr", "block_tune_schedule")
_JOB_FIELDS = (
    "model", "gguf_file", "calib", "nsamples", "seqlen", "holdout", "eval", "eval_windows", "device", "dtype", "seed",
    "batch_size", "blockwise", "distributed", "collective_timeout", "save_format", "bench", "finetune_steps",
    "finetune_lr", "finetune_adapter", "finetune_rank",
)  # fmt: skip


def _prune(args: argparse.Namespace) -> int:
    from sparseswaps_prune.llm.job import run_job

    config = job_config(args)
    if args.blockwise and args.eval is None:
        message = "--blockwise does not evaluate perplexity: run `sparseswaps eval --model OUT` afterwards"
        logging.getLogger(__name__).warning(message)
    if config.distributed:
        return _prune_distributed(config, args)
    report = run_job(config, args.out, progress=not (args.quiet or args.json_log), overwrite=args.overwrite)
    _print_report(report, args)
    return 0


def _prune_distributed(config: JobConfig, args: argparse.Namespace) -> int:
    """``--distributed``: this process is one rank launched by torchrun; rank 0 prints the report."""
    import torch.distributed as dist

    from sparseswaps_prune.llm.distributed import init_from_env
    from sparseswaps_prune.llm.job import run_job

    config.validate()  # bad options fail before the process group waits for its peers
    ranks = init_from_env(config.device, timeout=config.collective_timeout)
    try:
        report = run_job(config, args.out, progress=not (args.quiet or args.json_log), overwrite=args.overwrite)
        ranks.barrier()  # every rank has received the report before any tears the group down
    finally:
        dist.destroy_process_group()
    if ranks.is_main:
        _print_report(report, args)
    return 0


def _print_report(report: dict, args: argparse.Namespace) -> None:
    from sparseswaps_prune.llm.job import summary

    if args.json_log:
        print(json.dumps({k: report[k] for k in ("totals", "perplexity", "seconds", "bench") if k in report}))
    elif args.quiet:
        ppl = report["perplexity"]
        print(
            f"{args.out}: final layer loss {report['totals']['final_reduction']:.1%} below the start, perplexity {ppl}"
        )
    else:
        print(summary(report))
        sparse = report["config"].get("save_format", "dense") != "dense"
        loader = "sparseswaps_prune.deploy.load_sparse" if sparse else "AutoModelForCausalLM.from_pretrained"
        print(f"saved to {args.out} (load with {loader}({str(args.out)!r}))")


def _eval(args: argparse.Namespace) -> int:
    from sparseswaps_prune.core.checks import check_device
    from sparseswaps_prune.llm.data import check_source, load_eval_tokens
    from sparseswaps_prune.llm.evaluate import PAPER_TASKS, perplexity, zero_shot
    from sparseswaps_prune.llm.models import load_model
    from sparseswaps_prune.llm.tasks import write_builtin_cloze_task

    check_device(args.device, "--device")
    if args.ppl != "none":
        check_source(args.ppl, "perplexity")
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


def _bench(args: argparse.Namespace) -> int:
    from sparseswaps_prune.atomic import save_json
    from sparseswaps_prune.deploy.bench import bench_model_dir

    result = bench_model_dir(
        args.dir, new_tokens=args.new_tokens, repeats=args.repeats, threads=args.threads,
        min_sparsity=args.min_sparsity, memory=not args.no_memory,
    )  # fmt: skip
    if args.json_out:
        save_json(result, args.json_out)
    print(json.dumps(result, indent=2))
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


def _add_prune_options(p: argparse.ArgumentParser) -> None:
    """``sparseswaps prune``'s options, grouped by stage; spec options default to None (= the recipe's value; the
    help shows the default recipe's) so that only the given ones change the recipe."""
    from sparseswaps_prune.llm.job import DEFAULT_HOLDOUT, SAVE_FORMATS, JobConfig

    recipe = get_recipe(DEFAULT_RECIPE)
    spec, swaps = recipe.spec, SPARSESWAPS_SPEC.refine  # the SparseSwaps options' defaults: the stage's own
    p.add_argument(
        "--recipe", choices=(*RECIPES, *RENAMED_RECIPES), metavar="{" + ",".join(RECIPES) + "}",
        help=f"the named method the options below change (default {DEFAULT_RECIPE}; the defaults shown below are "
        "its): " + "; ".join(f"{name}: {r.summary}" for name, r in RECIPES.items()),
    )  # fmt: skip
    budget = p.add_argument_group("budget")
    pattern = budget.add_mutually_exclusive_group()
    pattern.add_argument("--sparsity", type=float, help=f"fraction pruned (default {spec.budget.sparsity})")
    pattern.add_argument("--nm", type=_nm, help="N:M pattern instead of --sparsity, e.g. 2:4")
    budget.add_argument("--scope", choices=SCOPES, help=f"budget per row or per layer (default {spec.budget.scope})")
    budget.add_argument(
        "--sparsity-profile", choices=PROFILES,
        help="the same --sparsity in every block, or OWL's (Yin et al. 2023): blocks whose Wanda scores have more "
        "outliers pruned less, the mean over blocks --sparsity (one extra dense forward; not with --nm) (default "
        "uniform)",
    )  # fmt: skip
    budget.add_argument(
        "--owl-m", type=float, help=f"OWL: scores above M times the block's mean are outliers (default {OWL_M:g})"
    )
    budget.add_argument(
        "--owl-lambda", type=float,
        help=f"OWL: the block sparsities span at most 2 * lambda around --sparsity (default {OWL_LAMBDA:g})",
    )  # fmt: skip

    start = p.add_argument_group("start (the mask refinement starts from)")
    start.add_argument("--start", choices=STARTS, help=f"start mask (default {spec.start.name})")
    start.add_argument(
        "--start-damp",
        type=float,
        help="the start's own ridge for --start sparsegpt|admm|alps (defaults 0.01, 0.1, 0.01: the originals')",
    )

    refine = p.add_argument_group("refine (the mask; the SparseSwaps defaults are the stage's own)")
    refine.add_argument("--refine", choices=REFINES, help=f"mask refinement (default {spec.refine.name})")
    refine.add_argument("--max-iters", type=int, help=f"SparseSwaps iterations T per layer (default {swaps.max_iters})")
    refine.add_argument("--eps", type=float, help=f"SparseSwaps: minimum gain of a swap (default {swaps.eps})")
    refine.add_argument(
        "--objective",
        choices=OBJECTIVES,
        help=f"SparseSwaps: judge swaps with the kept weights as they are, or re-fitted (refit needs --weights ls) "
        f"(default {swaps.objective})",
    )
    refine.add_argument(
        "--search-dtype", choices=("float32", "float64"), help="SparseSwaps search dtype (default float32)"
    )
    refine.add_argument("--backend", choices=SEARCH_BACKENDS, help="SparseSwaps search backend (default auto)")
    refine.add_argument(
        "--swap-scope", choices=("row",),
        help="SparseSwaps: swap within rows also under --scope layer, every row keeping the start's count "
        "(default: the budget's scope)",
    )  # fmt: skip

    weights = p.add_argument_group("weights (the final kept weights)")
    weights.add_argument(
        "--weights",
        choices=WEIGHTS,
        help=f"keep (the paper's SparseSwaps), ls (exact least-squares re-fit), cg (the same by conjugate gradients), "
        f"obs, admm, alps (SparseGPT's, ADMM's, ALPS's update on the final mask), start (the weights --start "
        f"sparsegpt|admm|alps computed, with --refine none) (default {spec.weights.name})",
    )
    weights.add_argument(
        "--damp",
        type=float,
        help="relative ridge of the weight update (defaults: 0.1 for ls/cg, 1e-3 for ls/cg with --ridge mean, 0.01 "
        "for obs/alps, 0.1 for admm)",
    )
    weights.add_argument(
        "--ridge",
        choices=("mean", "diag"),
        help="ls/cg: mean = ridge damp*mean(diag G) towards zero; diag = least squares on G + damp*diag(G), "
        f"towards the dense weights (the problem ADMM's update solves) (default {LeastSquares().ridge})",
    )
    weights.add_argument(
        "--guard",
        action=argparse.BooleanOptionalAction,
        help="keep a row's weight update only where it lowers its held-out loss (default off; with --ridge mean it "
        "pays: the weakly damped re-fit over-fits some rows)",
    )

    tune = p.add_argument_group("block tuning (after each block's layers are pruned)")
    tune.add_argument(
        "--block-tune-epochs", type=int,
        help="tune the kept weights of each pruned block for this many epochs so that it reproduces the dense "
        "model's block output, keeping the epoch with the lowest held-out error (0: off; doubles the captured "
        f"inputs) (default: the recipe's; {DEFAULT_RECIPE}: {recipe.block_tune_epochs})",
    )  # fmt: skip
    tune.add_argument("--block-tune-lr", type=float, help=f"Adam's learning rate (default {BLOCK_TUNE_LR:g})")
    tune.add_argument(
        "--block-tune-schedule", choices=SCHEDULES,
        help=f"learning-rate schedule; cosine decays it to 0 over all steps (default {BLOCK_TUNE_SCHEDULE})",
    )  # fmt: skip

    finetune = p.add_argument_group("fine-tune (after pruning, the whole model)")
    finetune.add_argument(
        "--finetune-steps", type=int,
        help="PERP steps after pruning: adapters on every block linear, biases and norms trained on the calibration "
        "windows cut in halves (4 per step), adapters merged so the zeros stay; perplexity measured before and after "
        f"(0: none; not with --blockwise) (default: the recipe's; {DEFAULT_RECIPE}: {recipe.finetune_steps})",
    )  # fmt: skip
    finetune.add_argument("--finetune-lr", type=float, help=f"AdamW learning rate (default {JobConfig.finetune_lr:g})")
    finetune.add_argument(
        "--finetune-adapter", choices=ADAPTERS, help=f"adapter (default {JobConfig.finetune_adapter})"
    )  # fmt: skip
    finetune.add_argument("--finetune-rank", type=int, help=f"adapter rank (default {JobConfig.finetune_rank})")

    layers = p.add_argument_group("layers")
    layers.add_argument("--include", nargs="+", help="fnmatch patterns of layer names to prune (default: all)")
    layers.add_argument("--exclude", nargs="+", help="fnmatch patterns of layer names to skip")
    layers.add_argument("--gram-dtype", choices=("float32", "float64"), default="float32", help="(default float32)")

    data = p.add_argument_group("model and data")
    data.add_argument("--model", help="hub name or local path (default: packaged SmolLM2-135M-Instruct)")
    data.add_argument("--gguf-file", help="GGUF file inside --model")
    data.add_argument(
        "--calib", help="calibration text: builtin | stdlib-prose | c4 | wikitext | PATH (default builtin)"
    )
    data.add_argument("--nsamples", type=int, help=f"calibration windows (default {JobConfig.nsamples})")
    data.add_argument("--seqlen", type=int, help=f"tokens per window (default {JobConfig.seqlen})")
    data.add_argument(
        "--calib-shards", type=int, default=1,
        help="split the calibration (and held-out) windows into this many contiguous shards of whole batches whose "
        "Grams are summed in shard order; the unit of work of distributed ranks (default 1: one Gram)",
    )  # fmt: skip
    data.add_argument(
        "--holdout",
        type=int,
        help=f"held-out calibration windows for --guard and the report (default {DEFAULT_HOLDOUT})",
    )
    data.add_argument(
        "--eval", help="perplexity text: builtin | stdlib-prose | c4 | wikitext | PATH | none (default builtin)"
    )
    data.add_argument(
        "--eval-windows", type=int, help=f"at most this many evaluation windows (default {JobConfig.eval_windows})"
    )
    data.add_argument("--no-eval-warmstart", action="store_true", help="skip the start mask's perplexity")

    run = p.add_argument_group("run")
    run.add_argument("--device", help="compute device (default cpu)")
    run.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="model dtype (default float32)")
    run.add_argument("--seed", type=int, help="calibration sampling seed, 0 to 2**64 - 1 (default 0)")
    run.add_argument("--batch-size", type=int, help="windows per forward (default 4)")
    run.add_argument(
        "--blockwise",
        action="store_true",
        default=None,
        help="read, prune and write one decoder block at a time from a local safetensors or GGUF --model (the "
        "packaged default included; never the whole model in memory; no evaluation; an interrupted run resumes "
        "with the same command)",
    )
    run.add_argument(
        "--distributed", action="store_true", default=None,
        help="this process is one rank launched by torchrun (torchrun --nproc-per-node N -m sparseswaps_prune.cli "
        "prune --distributed ...): gloo on the CPU, NCCL on GPUs (one per rank); layers, and with --calib-shards "
        "the calibration windows, are divided across the ranks; rank 0 evaluates and writes; combines with --blockwise",
    )  # fmt: skip
    run.add_argument(
        "--collective-timeout", type=float, default=None, metavar="SECONDS",
        help="with --distributed, how long a rank waits for the others in one collective operation before the run "
        "fails naming the ranks that did not answer (default 600; raise it if one rank's share of a block, or rank "
        "0's perplexity evaluation or save, takes longer)",
    )  # fmt: skip
    run.add_argument(
        "--row-shards", type=int, default=0,
        help="with --distributed, also divide the rows of layers among the ranks in shards of at least this many rows "
        "where the spec treats rows apart (e.g. 256); the last bits may then differ from one process (default 0: "
        "whole layers)",
    )  # fmt: skip
    run.add_argument(
        "--out", required=True,
        help="output directory (resumes if it holds an unfinished run); never the --model directory, and one holding "
        "files no run wrote (e.g. another model) only with --overwrite",
    )  # fmt: skip
    run.add_argument(
        "--overwrite", action="store_true",
        help="replace the model (or finished run) that --out holds: the run's files replace those of the same names "
        "and the old weight files go; other files stay (never the --model directory itself)",
    )  # fmt: skip
    run.add_argument(
        "--save-format", choices=SAVE_FORMATS,
        help="dense: save_pretrained, zeros stored (default); sparse: a bitmask and the kept values per pruned linear, "
        "the pruned linears in 0.43x (fp32) / 0.46x (bf16) of their dense bytes at 60%% (load with "
        "sparseswaps_prune.deploy.load_sparse; not with --blockwise); sparse-compressed: the same with the kept "
        "values and dense tensors losslessly compressed (smaller, slower to save and load)",
    )  # fmt: skip
    run.add_argument(
        "--bench", action="store_true", default=None,
        help="after saving, measure the pruned model dense against sparse on the CPU, as `sparseswaps bench` does "
        "(weights on disk, resident memory, greedy-decoding tokens/s) into report.json's bench entry and the summary "
        "(a temporary dense and sparse save, a few short generations; not with --blockwise)",
    )  # fmt: skip
    run.add_argument("--quiet", action="store_true", help="no progress bars, one summary line")
    run.add_argument("--json-log", action="store_true", help="JSON log lines on stderr, JSON summary on stdout")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparseswaps", description="SparseSwaps: exact 1-swap LLM pruning")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "prune",
        help="prune a causal LM (default: the packaged SmolLM2-135M) and save it",
        description=f"Prune every linear layer of every decoder block, block by block. Default recipe: "
        f"{DEFAULT_RECIPE} ({get_recipe(DEFAULT_RECIPE).summary}).",
    )
    _add_prune_options(p)
    p.set_defaults(func=_prune)

    e = sub.add_parser("eval", help="perplexity and zero-shot accuracy of a (pruned) model")
    e.add_argument(
        "--model", default=None,
        help="hub name, local path (save_pretrained's, or a sparse checkpoint: --save-format sparse) or .gguf "
        "(default: packaged SmolLM2-135M-Instruct)",
    )  # fmt: skip
    e.add_argument("--gguf-file", default=None)
    e.add_argument("--ppl", default="builtin", help="builtin | stdlib-prose | c4 | wikitext | PATH | none")
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

    b = sub.add_parser(
        "bench",
        help="size on disk, resident memory and tokens/s of a saved pruned model, dense vs sparse (JSON)",
        description="Compare a saved pruned model run dense and sparsified (sparseswaps_prune.deploy): weights on "
        "disk, resident memory of a fresh process, greedy decoding tokens per second; prints JSON.",
    )
    b.add_argument("dir", help="the model directory (save_pretrained or deploy.save_sparse)")
    b.add_argument("--new-tokens", type=int, default=32, help="tokens generated per run (default 32)")
    b.add_argument("--repeats", type=int, default=3, help="timed runs per variant, median (default 3)")
    b.add_argument("--threads", type=int, default=None, help="torch and numba threads (default: torch's)")
    b.add_argument("--min-sparsity", type=float, default=0.3, help="least fraction of zeros to go sparse (0.3)")
    b.add_argument("--no-memory", action="store_true", help="skip the resident-memory subprocesses")
    b.add_argument("--json-out", default=None, help="also write the JSON to this file")
    b.set_defaults(func=_bench)

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
    except (ValueError, TypeError, OSError, ImportError) as err:
        if args.verbose:
            logging.getLogger(__name__).debug("traceback of the error below", exc_info=True)
        print(f"sparseswaps: error: {_one_line(err, args)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        resume = " (re-run the same command to resume)" if args.command == "prune" else ""
        print(f"sparseswaps: interrupted{resume}", file=sys.stderr)
        return 130


def _one_line(err: BaseException, args: argparse.Namespace) -> str:
    """``err`` as one line; for a full disk or an unwritable output, what to do."""
    text = " ".join(str(err).split()) or type(err).__name__
    if isinstance(err, OSError) and args.command == "prune":
        if err.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            text += "; free some space (or choose another --out), then re-run the same command to resume"
        elif err.errno in (errno.EACCES, errno.EPERM, errno.EROFS) and "--out" not in text:
            text += "; make the output directory writable or choose another --out"
    return text


if __name__ == "__main__":
    sys.exit(main())
