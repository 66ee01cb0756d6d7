"""Prune a Hugging Face LM inside ``Trainer.fit`` with the ``SparseSwapsPruning`` callback, then fine-tune it.

Run: ``python examples/lightning_prune.py`` (seconds on CPU). A tiny random llama is trained on a synthetic
"count upwards" token task; the callback calibrates on the first training batches and prunes every MLP
projection at fit start; training then goes on with the pruned weights held at exactly zero.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from sparseswaps_prune.callbacks import SparseSwapsPruning
from sparseswaps_prune.llm.models import tiny_model


def counting_tokens(n: int, seqlen: int, seed: int = 0) -> torch.Tensor:
    """``[n, seqlen]`` windows of consecutive token ids (mod 64, offset 100): an easy, learnable sequence."""
    start = torch.randint(0, 64, (n, 1), generator=torch.Generator().manual_seed(seed))
    return 100 + (start + torch.arange(seqlen)) % 64


class TinyLM(pl.LightningModule):
    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.model = tiny_model("llama").train()
        self.lr = lr

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits

    def lm_loss(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids).loss

    def training_step(self, batch, _idx):
        (ids,) = batch
        loss = self.lm_loss(ids)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)


class EvalLoss(pl.Callback):
    """Held-out LM loss at train start, i.e. right after the pruning callback (listed before it) ran."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids, self.after_pruning = ids, None

    def on_train_start(self, trainer, pl_module):
        self.after_pruning = held_out_loss(pl_module, self.ids)


@torch.no_grad()
def held_out_loss(lm: TinyLM, ids: torch.Tensor) -> float:
    was_training = lm.training
    lm.eval()
    loss = float(lm.lm_loss(ids.to(lm.device)))
    lm.train(was_training)
    return loss


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=30, help="training steps after pruning")
    parser.add_argument("--calibration-batches", type=int, default=4)
    parser.add_argument("--mode", default="one_shot", choices=["one_shot", "sequential"])
    parser.add_argument("--seqlen", type=int, default=32)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    lm = TinyLM()
    train = DataLoader(TensorDataset(counting_tokens(64, args.seqlen)), batch_size=8, shuffle=True)
    held_out = counting_tokens(8, args.seqlen, seed=1)
    dense = held_out_loss(lm, held_out)

    pruning = SparseSwapsPruning(
        sparsity=args.sparsity,
        include=["*.mlp.*"],
        recipe="sparseswaps-refit",  # Wanda -> SparseSwaps -> re-fit (the default: SparseSwaps masks only)
        max_iters=50,
        calibration_batches=args.calibration_batches,
        mode=args.mode,
    )
    probe = EvalLoss(held_out)
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        callbacks=[pruning, probe],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(lm, train)
    final = held_out_loss(lm, held_out)

    before = sum(s.loss_start for s in pruning.stats.values())
    after = sum(s.loss_final for s in pruning.stats.values())
    print(
        f"pruned {len(pruning.stats)} MLP layers; summed layer loss start mask {before:.4g} -> final weights "
        f"{after:.4g}"
    )
    zeros = total = 0
    for name, module in lm.named_modules():
        if hasattr(module, "weight_mask"):
            weight = module.weight_orig * module.weight_mask  # what the next forward uses
            zeros, total = zeros + int((weight == 0).sum()), total + weight.numel()
            print(f"  {name:<36} sparsity {float((weight == 0).float().mean()):.1%}")
    print(f"final MLP sparsity: {zeros / total:.1%}")
    print(
        f"LM loss: dense {dense:.3f} | after pruning {probe.after_pruning:.3f} | after {args.steps} steps {final:.3f}"
    )
    return {"dense": dense, "pruned": probe.after_pruning, "final": final, "sparsity": zeros / total}


if __name__ == "__main__":
    main()
