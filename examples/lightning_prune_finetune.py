"""Prune a causal LM at fit start with ``SparseSwapsPruning``, then recover perplexity with PERP + MaskLoRA.

Run: ``python examples/lightning_prune_finetune.py`` (the packaged SmolLM2-135M, minutes on CPU) or
``--tiny`` (a tiny random llama, seconds). Offline: the training windows and the evaluation text are the
built-in corpus (``pydoc_data``). A :class:`~sparseswaps_prune.finetune.CausalLMModule` wraps the model: it
attaches zero-initialised MaskLoRA adapters and freezes everything but biases, norms and adapters before
``Trainer.fit``; the callback calibrates on the first training batches and prunes every linear in the decoder
blocks at fit start; training then moves only the adapters and norms, so the pruned weights stay exactly zero.
After training the adapters are merged and the pruning made permanent; the final sparsity is exactly the
pruning's. The training windows and the evaluation text are disjoint paragraphs of the same corpus, so the
fine-tuning also adapts the model to that text: the fine-tuned perplexity can end below the dense model's.
"""

from __future__ import annotations

import argparse
import time

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from sparseswaps_prune.callbacks import SparseSwapsPruning
from sparseswaps_prune.finetune import CausalLMModule
from sparseswaps_prune.llm.data import load_calibration, load_eval_tokens
from sparseswaps_prune.llm.evaluate import perplexity
from sparseswaps_prune.llm.models import default_tokenizer, load_model, tiny_model
from sparseswaps_prune.llm.pipeline import finalize


class PerplexityProbe(pl.Callback):
    """Perplexity at train start: after the pruning callback ran at fit start, before any training step."""

    def __init__(self, evaluate) -> None:
        self.evaluate, self.value = evaluate, float("nan")
        self.times: dict[str, float] = {}

    def on_fit_start(self, trainer, pl_module):
        self.times["fit_start"] = time.perf_counter()  # after the pruning callback (listed before this one)

    def on_train_start(self, trainer, pl_module):
        self.value = self.evaluate()
        self.times["train_start"] = time.perf_counter()


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny random llama instead of SmolLM2-135M")
    parser.add_argument("--model", default=None, help="model path or hub name (default: packaged SmolLM2-135M)")
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--start", default="admm", choices=["magnitude", "wanda", "ria", "admm"])
    parser.add_argument("--max-iters", type=int, default=5, help="SparseSwaps iterations per layer")
    parser.add_argument("--calibration-batches", type=int, default=4)
    parser.add_argument("--adapter", default="masklora", choices=["masklora", "scalelora", "none"])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=20, help="fine-tuning steps after pruning")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--nsamples", type=int, default=80, help="training windows from the built-in corpus")
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--eval-windows", type=int, default=8)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    start = time.perf_counter()
    if args.tiny:
        model, tokenizer = tiny_model("llama"), default_tokenizer()
    else:
        model, tokenizer = load_model(args.model)
    windows = load_calibration("builtin", tokenizer, nsamples=args.nsamples, seqlen=args.seqlen)
    eval_tokens = load_eval_tokens("builtin", tokenizer)

    def evaluate() -> float:
        return perplexity(model, eval_tokens, args.seqlen, batch_size=4, max_windows=args.eval_windows)

    dense = evaluate()
    module = CausalLMModule(model, adapter=args.adapter, rank=args.rank, lr=args.lr)
    pruning = SparseSwapsPruning(
        sparsity=args.sparsity,
        recipe="sparseswaps-refit",  # Wanda -> SparseSwaps -> re-fit (the default: SparseSwaps masks only)
        start=args.start,
        max_iters=args.max_iters,
        calibration_batches=args.calibration_batches,
        exclude=["*lm_head"],  # the same layers the adapters are on: every linear in the decoder blocks
    )
    probe = PerplexityProbe(evaluate)
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        callbacks=[pruning, probe],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(windows, batch_size=args.batch_size, shuffle=True, generator=torch.Generator().manual_seed(0))
    fit_start = time.perf_counter()
    trainer.fit(module, loader)
    train_seconds = time.perf_counter() - probe.times["train_start"]

    names = sorted(pruning.stats)  # qualified names inside the LightningModule ("model." + model's names)
    masks = {name: module.get_submodule(name).weight_mask.bool().clone() for name in names}
    module.merge_adapters()
    finalize(model)  # prune.remove: plain weights with the zeros written in
    weights = [module.get_submodule(name).weight for name in names]
    zeros, total = sum(int((w == 0).sum()) for w in weights), sum(w.numel() for w in weights)
    exact = all(torch.equal(module.get_submodule(n).weight != 0, m) for n, m in masks.items())
    finetuned = evaluate()

    before = sum(s.loss_start for s in pruning.stats.values())
    after = sum(s.loss_final for s in pruning.stats.values())
    print(
        f"pruned {len(names)} layers in {probe.times['fit_start'] - fit_start:.0f} s; summed layer loss "
        f"{args.start} {before:.4g} -> final weights {after:.4g}"
    )
    print(
        f"PERP ({args.adapter}, rank {args.rank}): {module.n_trainable:,} trainable of {module.n_total:,} parameters "
        f"({100 * module.n_trainable / module.n_total:.2f}%), {args.steps} steps of {args.batch_size} x "
        f"{args.seqlen} tokens in {train_seconds:.0f} s"
    )
    print(f"final sparsity of the pruned layers: {zeros / total:.2%} (zeros exactly the pruning masks: {exact})")
    print(f"perplexity: dense {dense:.2f} | pruned {probe.value:.2f} | fine-tuned {finetuned:.2f}")
    print(f"total time {time.perf_counter() - start:.0f} s")
    return {"dense": dense, "pruned": probe.value, "finetuned": finetuned, "sparsity": zeros / total}


if __name__ == "__main__":
    main()
