"""Masks-only pruning methods after the package's own short fine-tune, at equal steps, on the default model.

For every ``--settings`` setting the packaged SmolLM2-135M-Instruct (GGUF) is pruned from its dense weights at
``--pattern`` (:class:`~sparseswaps_prune.llm.experiment.Experiment`, the sequential pipeline; the same options,
calibration windows and evaluation tokens as ``compare_methods.py``, so the pruned model and its perplexities are
that script's row for the setting at the same ``--nsamples``, ``--seqlen``, ``--holdout``, ``--max-iters`` and
``--eval-windows``), its held-out perplexity is measured, then it is fine-tuned with PERP
(:func:`~sparseswaps_prune.finetune.train.finetune_causal_lm`: ``--adapter`` adapters of rank ``--rank`` on every
linear of the decoder blocks, biases and norms trained, AdamW at ``--lr``, ``--steps`` steps of ``--batch-size``
windows, seed 0, adapters merged; on the device the model lives on, the CPU), the same windows in the same order
for every setting, and measured again.
After the merge every pruned layer's zeros must still be exactly the pruning mask's (the weights' zeros right after
pruning): the row records that as ``mask kept``, checked on the model's weights.

Tokens, all from the model's tokenizer:

* calibration (pruning): the first ``--nsamples`` (64) windows of ``--seqlen`` (256) tokens of
  ``load_calibration("builtin", tokenizer, nsamples, seqlen, seed=0, holdout=holdout)``: seeded uniform random
  offsets in the tokenized calibration part of the built-in corpus (``builtin_text("calib")``, Python's
  ``pydoc_data.topics``, every unique paragraph but each fifth); the ``--holdout`` (8) windows after them, disjoint
  from every calibration window, give the layer losses on held-out tokens only (they are never trained on);
* training (fine-tune): those same ``nsamples`` calibration windows, each cut into ``seqlen / --train-seqlen``
  consecutive windows of ``--train-seqlen`` (128) tokens (window ``i``'s first 128 tokens, then its next 128,
  then window ``i + 1``'s); each step takes ``--batch-size`` of them in a permutation seeded with 0 (reshuffled
  when used up). No token of the evaluation texts and none of the held-out windows is trained on;
* evaluation (perplexity): ``load_eval_tokens("builtin")``, the evaluation part of the built-in corpus (each fifth
  unique paragraph, ``builtin_text("eval")``), and of each ``--extra-eval`` text (default ``stdlib-prose``: IDLE's
  manual and Python's history and license, text the built-in corpus does not hold), each scored on its first
  ``--eval-windows`` (32) windows of ``seqlen`` tokens; the same tokens before and after the fine-tune.

    python benchmarks/prune_finetune.py --out /tmp/prune_finetune --pattern 60% \\
        --settings "start=wanda,refine=none,weights=keep" "start=ria,weights=keep" "start=admm,weights=keep" \\
        --max-iters 25 --nsamples 64 --steps 20 --batch-size 4 --train-seqlen 128 --adapter masklora --rank 16 \\
        --lr 1e-3

(the defaults: Wanda's mask alone, RIA's mask + SparseSwaps T=25, and ADMM's mask + SparseSwaps T=25, which is the
namesake default ``PruneSpec()``, all masks only). Settings are
``compare_methods.py --extra`` settings, on top of the same ``sparseswaps-refit`` recipe (T=``--max-iters`` unless a
setting gives ``max_iters`` or a recipe); ``--pattern`` is one of its patterns (``60%``, ``70%``, ``2:4``).

Resume: each setting's row is saved as JSON in ``--out`` (atomically) once it has been pruned, fine-tuned and
measured. A saved row is re-used, without loading the model, only if it was made at the same pattern with the same
``PruneOptions`` (fields added since take their defaults) and the same run settings (fine-tune: adapter, rank, lr,
steps, batch size, training window length, seed; data: ``--nsamples``, ``--seqlen``, ``--holdout``,
``--eval-windows``, the evaluation texts); otherwise the setting is run again and its row replaced. The dense
perplexities (``dense.json``) are re-used when the evaluation settings match.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
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
from torch import nn

from sparseswaps_prune.atomic import save_json
from sparseswaps_prune.finetune.adapters import ADAPTER_KINDS
from sparseswaps_prune.finetune.train import check_token_windows, finetune_causal_lm
from sparseswaps_prune.llm.experiment import Experiment
from sparseswaps_prune.llm.pipeline import PruneOptions, check_layers

FINETUNE_SEED = 0
"""Seed of the adapters' initialisation and of the training windows' order: the same for every setting."""

DEFAULT_SETTINGS = ["start=wanda,refine=none,weights=keep", "start=ria,weights=keep", "start=admm,weights=keep"]
"""Wanda's mask alone, RIA's mask + SparseSwaps, ADMM's mask + SparseSwaps (at ``--max-iters 25``: ``PruneSpec()``,
the ``sparseswaps`` recipe)."""


def training_windows(calib_tokens: torch.Tensor, train_seqlen: int) -> torch.Tensor:
    """The fine-tune's windows: the ``[n, seqlen]`` calibration windows cut into ``[n * seqlen / train_seqlen,
    train_seqlen]``, in order (window 0's first ``train_seqlen`` tokens, its next ones, ..., then window 1's);
    ``train_seqlen`` divides ``seqlen`` (:func:`check_args`)."""
    return check_token_windows(calib_tokens.reshape(-1, train_seqlen))


def pruning_masks(model: nn.Module, options: PruneOptions) -> dict[str, torch.Tensor]:
    """``{layer name: [d_out, d_in] bool, True = kept}``: the nonzeros of every layer ``options`` prunes
    (:func:`~sparseswaps_prune.llm.pipeline.check_layers`), of a model pruned with the pruning made permanent."""
    return {layer.name: layer.weight_2d() != 0 for layer in check_layers(model, options)}


def mask_kept(model: nn.Module, options: PruneOptions, masks: dict[str, torch.Tensor]) -> bool:
    """True if the zeros of every layer ``options`` prunes are exactly where ``masks`` (:func:`pruning_masks` of
    the model right after pruning) has False: no pruned weight became nonzero and no kept one zero."""
    now = pruning_masks(model, options)
    return now.keys() == masks.keys() and all(torch.equal(now[name], masks[name]) for name in masks)


def finetune_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What the fine-tune of every row depends on (saved with the row; a row is re-used only if they match)."""
    return {
        "adapter": args.adapter,
        "rank": args.rank,
        "lr": args.lr,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "train_seqlen": args.train_seqlen,
        "seed": FINETUNE_SEED,
    }


def data_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The calibration and evaluation data of every row (saved with it; a row is re-used only if they match)."""
    return {
        "nsamples": args.nsamples,
        "seqlen": args.seqlen,
        "holdout": args.holdout,
        "eval_windows": args.eval_windows,
        "eval_texts": ["builtin", *args.extra_eval],
    }


def load_row(path: Path, pattern: str, options: PruneOptions, config: dict[str, Any]) -> dict[str, Any] | None:
    """The row saved at ``path`` if it was made at ``pattern`` with ``options`` and ``config`` (the fine-tune and
    data settings), else None (missing, or made otherwise)."""
    if not path.exists():
        return None
    row = json.loads(path.read_text())
    try:
        saved = PruneOptions.from_dict(row["options"])
    except (KeyError, TypeError, ValueError):
        return None
    return row if (row.get("pattern"), saved, row.get("config")) == (pattern, options, config) else None


def finetune(exp: Experiment, options: PruneOptions, args: argparse.Namespace) -> dict[str, Any]:
    """Fine-tune the experiment's pruned model (PERP, adapters merged) on the calibration windows cut into
    ``--train-seqlen`` tokens, check its masks, measure it; returns the fine-tune's part of a row."""
    model = exp.model
    masks = pruning_masks(model, options)
    trainable = {name: p.requires_grad for name, p in model.named_parameters()}
    start = time.perf_counter()
    result = finetune_causal_lm(
        model,
        training_windows(exp.calib_tokens, args.train_seqlen),
        steps=args.steps,
        lr=args.lr,
        batch_size=args.batch_size,
        adapter=args.adapter,
        rank=args.rank,
        merge=True,
        seed=FINETUNE_SEED,
        progress=False,
    )
    seconds = time.perf_counter() - start
    for name, p in model.named_parameters():  # as loaded: the next setting prunes the model compare_methods prunes
        p.requires_grad_(trainable[name])
    measured = exp.evaluate()
    return {
        "perplexity": measured["perplexity"],
        "perplexity_extra": measured["perplexity_extra"],
        "mask_kept": mask_kept(model, options, masks),
        "losses": result.losses,
        "seconds": seconds,
    }


def format_row(pattern: str, row: dict[str, Any], extra_eval: list[str]) -> str:
    """One Markdown row: pattern, method, perplexity on each text pruned, then fine-tuned, mask kept, prune s,
    fine-tune s."""

    def ppl(part: dict[str, Any]) -> str:
        values = (part["perplexity"], *(part["perplexity_extra"][text] for text in extra_eval))
        return " | ".join("n/a" if value is None else f"{value:.2f}" for value in values)

    pruned, tuned = row["pruned"], row["finetuned"]
    return (
        f"| {pattern} | {row['label']} | {ppl(pruned)} | {ppl(tuned)} | {'yes' if tuned['mask_kept'] else 'no'} | "
        f"{pruned['seconds_prune']:.0f} | {tuned['seconds']:.0f} |"
    )


def check_args(args: argparse.Namespace) -> list[PruneOptions]:
    """The options of every setting at ``--pattern``, after checking every option (before anything is loaded)."""
    for name in ("steps", "batch_size", "rank", "nsamples"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise SystemExit(f"--lr must be a positive number, got {args.lr}")
    if args.train_seqlen < 2 or args.seqlen % args.train_seqlen:
        raise SystemExit(
            f"--train-seqlen {args.train_seqlen} must be at least 2 and divide --seqlen {args.seqlen} (the training "
            "windows are the calibration windows cut into equal parts); e.g. --train-seqlen 128 with --seqlen 256"
        )
    windows = args.nsamples * (args.seqlen // args.train_seqlen)
    if args.batch_size > windows:
        raise SystemExit(
            f"--batch-size {args.batch_size} exceeds the {windows} training windows ({args.nsamples} calibration "
            f"windows of {args.seqlen} tokens cut into {args.train_seqlen}); use a smaller --batch-size"
        )
    runs: list[PruneOptions] = []
    for text in args.settings:
        try:
            options = setting_options(parse_setting(text), args.pattern, args.max_iters)
        except (TypeError, ValueError) as err:
            raise SystemExit(f"setting {text!r} at {args.pattern}: {err}") from None
        if options not in runs:
            runs.append(options)
    return runs


def main(
    argv: list[str] | None = None, make_experiment: Callable[[argparse.Namespace], Experiment] = default_experiment
) -> list[dict[str, Any]]:
    """Run (or read back) every setting's row and print the table; returns the rows (each with its ``"label"``).
    ``make_experiment(args)`` builds the experiment on first use (tests pass a tiny model)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for per-setting JSON rows (resumable)")
    parser.add_argument("--pattern", default="60%", help="sparsity pattern: 60%%, 70%%, 2:4, ...")
    parser.add_argument(
        "--settings", nargs="+", default=DEFAULT_SETTINGS, help="compare_methods.py --extra settings, e.g. start=alps"
    )
    parser.add_argument(
        "--max-iters", type=int, default=25, help=f"SparseSwaps T unless a setting gives max_iters or a recipe (on "
        f"top of the {SETTING_BASE} recipe, as compare_methods.py; default 25, the namesake default's)"
    )  # fmt: skip
    add_experiment_args(parser)
    parser.add_argument("--steps", type=int, default=20, help="fine-tune optimizer steps")
    parser.add_argument("--batch-size", type=int, default=4, help="training windows per step")
    parser.add_argument("--train-seqlen", type=int, default=128, help="tokens per training window (divides --seqlen)")
    parser.add_argument("--adapter", choices=ADAPTER_KINDS, default="masklora", help="PERP adapter")
    parser.add_argument("--rank", type=int, default=16, help="adapter rank")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    args = parser.parse_args(argv)
    runs = check_args(args)
    config = {"finetune": finetune_settings(args), "data": data_settings(args)}

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    exp = functools.cache(lambda: make_experiment(args))  # built on first use: finished rows need no model

    print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    dense_file = out / "dense.json"
    dense = json.loads(dense_file.read_text()) if dense_file.exists() else None
    if dense is None or dense.get("data") != config["data"]:
        dense = {**exp().evaluate(), "data": config["data"]}
        save_json(dense, dense_file)
    ppl = ", ".join(
        f"{text} {'n/a' if value is None else f'{value:.3f}'}"
        for text, value in (("builtin", dense["perplexity"]), *dense["perplexity_extra"].items())
    )
    print(f"dense: perplexity {ppl}")
    tune = config["finetune"]
    print(
        f"fine-tune: {tune['adapter']} rank {tune['rank']}, {tune['steps']} steps x {tune['batch_size']} windows of "
        f"{tune['train_seqlen']} tokens (the {args.nsamples} calibration windows cut), lr {tune['lr']:g}, seed "
        f"{tune['seed']}, merged"
    )
    texts = ("builtin", *args.extra_eval)
    columns = [f"ppl ({text}) pruned" for text in texts] + [f"ppl ({text}) fine-tuned" for text in texts]
    print(f"| pattern | method | {' | '.join(columns)} | mask kept | prune s | fine-tune s |")
    print("|---|---|" + "---|" * (len(columns) + 3))
    rows = []
    for options in runs:
        path = row_path(out, args.pattern, options)
        row = load_row(path, args.pattern, options, config)
        if row is None:
            pruned = exp().run(options)
            row = {
                "pattern": args.pattern,
                "label": options_label(options),
                "options": options.to_dict(),
                "config": config,
                "pruned": pruned,
                "finetuned": finetune(exp(), options, args),
            }
            save_json(row, path)
        print(format_row(args.pattern, row, args.extra_eval), flush=True)
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
