"""Plain LoRA through ``peft`` on a pruned model, merged back with exactly the sparsity pruning left.

A LoRA update ``B A`` is dense, so merging it into a pruned layer fills the pruned weights. And merging into a
layer still pruned through ``torch.nn.utils.prune`` is silently lost: peft adds the update to ``weight``, which
is a plain tensor recomputed as ``weight_orig * weight_mask`` on the next forward. The right order, done by
:func:`merge_lora_keep_sparsity`:

1. record each LoRA-wrapped layer's mask (``weight_mask``, or the weight's nonzeros when pruning was made
   permanent);
2. make the pruning permanent (``prune.remove``: zeros written into a plain ``weight`` parameter);
3. ``merge_and_unload()``: ``W + s * B A`` in every wrapped layer;
4. re-apply the mask: entries outside it set to exactly zero.

The merged layer then equals ``M * W + M * (s * B A)``. Unlike MaskLoRA (:mod:`.adapters`), plain LoRA trains
``B A`` without the mask, so step 4 changes the function a little; use MaskLoRA to train the update that is
kept. ``peft`` is imported inside the functions.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.utils import prune

from sparseswaps_prune.extras import require
from sparseswaps_prune.finetune.adapters import adapted_modules, select_layers

if TYPE_CHECKING:
    from peft import PeftModel

logger = logging.getLogger(__name__)

__all__ = ["add_lora", "merge_lora_keep_sparsity"]


def add_lora(
    model: nn.Module,
    *,
    rank: int = 8,
    alpha: float | None = None,
    dropout: float = 0.0,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    blocks_path: str | None = None,
) -> PeftModel:
    """Wrap the selected linear layers of a (pruned) model with peft LoRA adapters.

    Call it after pruning: peft's ``lora_A`` / ``lora_B`` are ``nn.Linear`` submodules, which pruning code
    would otherwise find and prune. Layers pruned through ``torch.nn.utils.prune`` keep their reparametrization
    (the base layer's forward pre-hook still applies the mask) until :func:`merge_lora_keep_sparsity`.

    Args:
        model: a Hugging Face causal LM; modified in place (peft replaces the selected layers by LoRA wrappers
            around them) and frozen except for the LoRA parameters.
        rank: LoRA rank ``r`` (>= 1).
        alpha: LoRA ``lora_alpha``; ``None`` means ``rank`` (scale ``alpha / r = 1``).
        dropout: LoRA dropout probability.
        include, exclude, blocks_path: which layers, see :func:`~sparseswaps_prune.finetune.adapters.select_layers`
            (default: every linear in the decoder blocks).

    Returns:
        The ``peft.PeftModel`` wrapping ``model``.

    Raises:
        ValueError: ``rank`` < 1, no layer selected, or the model has MaskLoRA / ScaleLoRA adapters.
        TypeError: ``rank`` is not an int.
    """
    require("finetune", "peft")
    from peft import LoraConfig, get_peft_model

    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"rank must be an int, got {rank!r}")
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    if adapted_modules(model):
        raise ValueError("the model already has MaskLoRA/ScaleLoRA adapters; merge_adapters(model) first")
    layers = select_layers(model, include=include, exclude=exclude, blocks_path=blocks_path)
    config = LoraConfig(
        r=rank,
        lora_alpha=rank if alpha is None else alpha,
        lora_dropout=dropout,
        target_modules=[layer.name for layer in layers],
        fan_in_fan_out=all(layer.is_transposed for layer in layers),
        bias="none",
    )
    logger.info("peft LoRA (rank %d) on %d layers", rank, len(layers))
    return get_peft_model(model, config)


@torch.no_grad()
def merge_lora_keep_sparsity(peft_model: PeftModel) -> nn.Module:
    """Merge peft LoRA adapters into a pruned model so that each layer keeps exactly its zeros.

    Records every wrapped layer's mask (its ``weight_mask``, else its weight's nonzeros), makes pruning
    permanent (``prune.remove``), calls ``peft_model.merge_and_unload()`` and sets every merged weight to
    exactly zero outside its mask. Layers without LoRA are left as they are (a layer of the base model that is
    pruned through ``torch.nn.utils.prune`` but not wrapped keeps its reparametrization).

    Args:
        peft_model: a ``peft.PeftModel`` with LoRA adapters (e.g. from :func:`add_lora`); consumed: its base
            model is modified in place and returned.

    Returns:
        The base model, without peft wrappers, whose formerly wrapped layers have plain ``weight`` parameters
        ``M * (W + s * B A)`` with ``M`` the recorded mask.

    Raises:
        TypeError: ``peft_model`` is not a ``peft.PeftModel``.
        ValueError: it has no LoRA layer.
    """
    require("finetune", "peft")
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    if not isinstance(peft_model, PeftModel):
        raise TypeError(
            f"peft_model must be a peft.PeftModel, got {type(peft_model).__name__}; wrap the model with add_lora "
            "(or peft.get_peft_model) first"
        )
    masks: list[tuple[nn.Module, torch.Tensor]] = []
    for module in peft_model.modules():
        if not isinstance(module, LoraLayer):
            continue
        base = module.get_base_layer()
        if prune.is_pruned(base) and hasattr(base, "weight_mask"):
            masks.append((base, base.weight_mask.bool().clone()))
            prune.remove(base, "weight")  # step 2: before merging, or the update is lost
        else:
            masks.append((base, base.weight.detach() != 0))
    if not masks:
        raise ValueError("peft_model has no LoRA layer to merge")
    merged = peft_model.merge_and_unload()
    for base, mask in masks:
        base.weight.masked_fill_(~mask, 0.0)
    logger.info("merged LoRA into %d layers and re-applied their masks", len(masks))
    return merged
