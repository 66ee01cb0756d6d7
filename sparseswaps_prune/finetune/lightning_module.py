"""A LightningModule that fine-tunes a (to be) pruned causal LM with PERP and MaskLoRA / ScaleLoRA adapters."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from sparseswaps_prune.finetune.adapters import ADAPTER_KINDS, attach_adapters, merge_adapters
from sparseswaps_prune.finetune.perp import mark_trainable
from sparseswaps_prune.modules import restore_masks

logger = logging.getLogger(__name__)

__all__ = ["LIGHTNING_ADAPTERS", "CausalLMModule"]

LIGHTNING_ADAPTERS = (*ADAPTER_KINDS, "none")
"""``adapter=`` values of :class:`CausalLMModule` (peft LoRA is not one, see its docstring)."""


def _restore_masks_pre_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_args: Any) -> None:
    """``load_state_dict`` pre-hook: re-create the pruning reparametrization of layers whose ``weight_mask`` is in
    ``state_dict`` (a module-level function, so that the module stays picklable, e.g. for ``ddp_spawn``)."""
    restore_masks(module, state_dict, prefix)


class CausalLMModule(pl.LightningModule):
    """Train a Hugging Face causal LM with PERP (biases, norms, sparsity-preserving adapters) in Lightning.

    At construction, zero-initialised adapters are attached to the selected linear layers (a no-op until
    trained) and every parameter except biases, norms and adapters is frozen. The optimizer built by
    ``configure_optimizers`` therefore already holds every parameter that will be trained, and DDP wraps a model
    whose trainable set does not change. A :class:`~sparseswaps_prune.callbacks.SparseSwapsPruning` callback can
    then prune at fit start (after the optimizer exists): MaskLoRA reads each layer's ``weight_mask`` on every
    forward, so from the first step on the update stays inside the mask, and the frozen pruned weights stay
    exactly zero. Call :meth:`merge_adapters` after training to fold the adapters into the weights.

    Loading a state dict with ``weight_orig`` / ``weight_mask`` keys re-creates the pruning reparametrization
    first, so ``CausalLMModule.load_from_checkpoint(path, model=fresh_model)`` works (Lightning's strict load would
    otherwise fail on those keys, and a non-strict one would drop them silently).

    Plain peft LoRA is not offered here: its ``lora_A`` / ``lora_B`` are ``nn.Linear`` submodules, which the
    pruning callback would find and prune. Prune first, then use
    :func:`~sparseswaps_prune.finetune.train.finetune_causal_lm` with ``adapter="lora"``.

    Batches: a tensor of token ids ``[batch, seqlen]``, a list/tuple whose first item is one (as from a
    ``TensorDataset``), or a mapping with ``input_ids`` and optionally ``attention_mask`` and ``labels``
    (default labels: the input ids; the model shifts them). The loss is the model's mean token cross-entropy,
    logged as ``train_loss`` / ``val_loss``.

    Args:
        model: the causal LM (dense, or already pruned); modified in place (adapters, ``requires_grad``; put in
            train mode at fit start).
        adapter: ``"masklora"``, ``"scalelora"`` or ``"none"`` (biases and norms only).
        rank, alpha: adapter rank and scale ``alpha / rank`` (``alpha=None``: scale 1).
        include, exclude: fnmatch patterns on the model's own module names (``"model.layers.0.mlp.up_proj"``)
            selecting the adapted layers (default: every linear in the decoder blocks); give the same layers
            as the pruning callback, whose names carry this module's ``model.`` prefix.
        lr, weight_decay: AdamW settings.
        biases, norms: also train biases / normalisation parameters.
        seed: seed of the adapters' initialisation.

    Example:
        >>> module = CausalLMModule(model, adapter="masklora", rank=8, lr=1e-3)
        >>> trainer = Trainer(max_steps=100, callbacks=[SparseSwapsPruning(sparsity=0.6, exclude=["*lm_head"])])
        >>> trainer.fit(module, train_loader)      # prunes at fit start, then trains biases, norms, adapters
        >>> module.merge_adapters()                # zeros exactly where pruning left them
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        adapter: str = "masklora",
        rank: int = 8,
        alpha: float | None = None,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
        lr: float = 2e-4,
        weight_decay: float = 0.0,
        biases: bool = True,
        norms: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if adapter == "lora":
            raise ValueError(
                "adapter='lora' (peft) adds nn.Linear submodules that SparseSwapsPruning would prune; use "
                "adapter='masklora' or 'scalelora' here, or prune first and call finetune_causal_lm(adapter='lora')"
            )
        if adapter not in LIGHTNING_ADAPTERS:
            raise ValueError(f"unknown adapter {adapter!r}; choose one of {', '.join(LIGHTNING_ADAPTERS)}")
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
            raise ValueError(f"lr must be a number > 0, got {lr!r}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module (a causal LM), got {type(model).__name__}")
        self.save_hyperparameters(ignore=["model"])
        self.model = model
        self.adapter = adapter
        self.lr, self.weight_decay = float(lr), float(weight_decay)
        self.adapted: list[str] = []
        if adapter != "none":
            self.adapted = attach_adapters(
                model, adapter, rank=rank, alpha=alpha, include=include, exclude=exclude, seed=seed
            )
        selection = mark_trainable(model, biases=biases, norms=norms, adapters=adapter != "none")
        self.n_trainable, self.n_total = selection.n_trainable, selection.n_total
        self.register_load_state_dict_pre_hook(_restore_masks_pre_hook)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
        """The wrapped model's output (``.logits`` ``[batch, seqlen, vocab]``) for ``input_ids`` ``[batch, seqlen]``."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)

    def lm_loss(self, batch: Any) -> torch.Tensor:
        """Mean token cross-entropy of a batch (see the class docstring for the batch formats)."""
        attention_mask = labels = None
        if isinstance(batch, torch.Tensor):
            ids = batch
        elif isinstance(batch, Mapping):
            ids, attention_mask, labels = batch["input_ids"], batch.get("attention_mask"), batch.get("labels")
        elif isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
            ids = batch[0]
        else:
            raise TypeError(
                f"CausalLMModule cannot read a {type(batch).__name__} batch; give token ids [batch, seqlen], "
                "a tuple (ids,), or a dict with input_ids"
            )
        return self(ids, attention_mask=attention_mask, labels=ids if labels is None else labels).loss

    def on_fit_start(self) -> None:
        # Hugging Face models load in eval mode; train like a fresh LightningModule (the pruning callback's
        # on_fit_start, which runs before this hook, calibrates in eval mode either way).
        self.model.train()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.lm_loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.lm_loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            [p for p in self.parameters() if p.requires_grad], lr=self.lr, weight_decay=self.weight_decay
        )

    def merge_adapters(self) -> list[str]:
        """Fold the adapters into the weights (zeros exactly where pruning left them) and remove them.

        Returns:
            The qualified names (inside ``self.model``) of the merged layers.
        """
        return merge_adapters(self.model)
