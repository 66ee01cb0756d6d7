"""Prune a Hugging Face causal LM with the library pipeline (calibrate, prune block by block, evaluate, save).

Run: ``python examples/prune_hf_model.py`` prunes a tiny random-weight llama (saved to a temporary directory)
in seconds; ``--model default`` prunes the packaged SmolLM2-135M (minutes on CPU); ``--model PATH`` any local
``save_pretrained`` directory or ``.gguf`` file. Same as the ``sparseswaps prune`` command line: the default
recipe ``best`` (ALPS's mask and weights, block tuning, then a short PERP fine-tune), or ``--recipe sparseswaps``
(ADMM's mask, then exact 1-swaps, masks only) with ``--start`` and ``--max-iters``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from sparseswaps_prune.core.spec import build_spec
from sparseswaps_prune.llm.job import JobConfig, run_job, summary
from sparseswaps_prune.llm.pipeline import PruneOptions
from sparseswaps_prune.recipes import RECIPES


def save_tiny_llama(path: Path) -> Path:
    """A tiny random llama with the packaged SmolLM2 tokenizer, written with ``save_pretrained``."""
    from sparseswaps_prune.llm.models import default_tokenizer, tiny_model

    tiny_model("llama").save_pretrained(path)
    default_tokenizer().save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="'tiny' (default), 'default' (SmolLM2-135M) or a path")
    parser.add_argument("--out", default=None, help="output directory (default: a temporary one)")
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--nm", default=None, help="N:M pattern such as 2:4 instead of --sparsity")
    parser.add_argument("--recipe", default="best", choices=tuple(RECIPES))
    parser.add_argument("--start", default=None, choices=["magnitude", "wanda", "ria", "sparsegpt", "admm"])
    parser.add_argument("--max-iters", type=int, default=None, help="SparseSwaps T (with --recipe sparseswaps)")
    parser.add_argument("--nsamples", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=64)
    parser.add_argument("--eval-windows", type=int, default=4)
    args = parser.parse_args(argv)

    nm = tuple(int(v) for v in args.nm.split(":")) if args.nm else None
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "tiny":
            model = str(save_tiny_llama(Path(tmp) / "tiny-llama"))
        else:
            model = None if args.model == "default" else args.model
        config = JobConfig(
            model=model,
            prune=PruneOptions(
                recipe=args.recipe,
                spec=build_spec(
                    RECIPES[args.recipe].spec,
                    start=args.start,
                    sparsity=None if nm else args.sparsity,
                    nm=nm,
                    max_iters=args.max_iters,
                ),
            ),
            nsamples=args.nsamples,
            seqlen=args.seqlen,
            eval_windows=args.eval_windows,
            batch_size=2,
        )
        out = Path(args.out) if args.out else Path(tmp) / "pruned"
        report = run_job(config, out, progress=False)
        print(summary(report))
        print(f"pruned model written to {out}" + (" (temporary; pass --out to keep it)" if not args.out else ""))
    return report


if __name__ == "__main__":
    main()
