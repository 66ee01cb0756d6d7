"""Fine-tuning after pruning that keeps the sparsity: PERP, MaskLoRA / ScaleLoRA, peft LoRA, Lightning.

* :mod:`.adapters`: MaskLoRA (``W + s (B A) * M``) and ScaleLoRA (``W * (1 + s B A)``) on linear layers,
  :func:`attach_adapters` / :func:`merge_adapters`.
* :mod:`.perp`: :func:`mark_trainable` freezes everything but biases, norms and adapters.
* :mod:`.peft_glue`: plain LoRA through ``peft`` and :func:`merge_lora_keep_sparsity`.
* :mod:`.train`: :func:`finetune_causal_lm`, the plain-PyTorch loop on a Hugging Face causal LM.
* :mod:`.lightning_module`: :class:`CausalLMModule`, the same through Lightning (imported on first use).
"""

from __future__ import annotations

from typing import Any

from sparseswaps_prune.extras import require
from sparseswaps_prune.finetune.adapters import (
    ADAPTER_KINDS,
    AdapterHook,
    adapted_modules,
    adapter_delta,
    adapter_mask,
    attach_adapters,
    effective_weight,
    merge_adapters,
    select_layers,
)
from sparseswaps_prune.finetune.peft_glue import add_lora, merge_lora_keep_sparsity
from sparseswaps_prune.finetune.perp import TrainableSelection, mark_trainable, parameter_groups
from sparseswaps_prune.finetune.train import ADAPTERS, FinetuneResult, finetune_causal_lm

__all__ = [
    "ADAPTERS",
    "ADAPTER_KINDS",
    "AdapterHook",
    "CausalLMModule",
    "FinetuneResult",
    "TrainableSelection",
    "adapted_modules",
    "adapter_delta",
    "adapter_mask",
    "add_lora",
    "attach_adapters",
    "effective_weight",
    "finetune_causal_lm",
    "mark_trainable",
    "merge_adapters",
    "merge_lora_keep_sparsity",
    "parameter_groups",
    "select_layers",
]


def __getattr__(name: str) -> Any:
    if name == "CausalLMModule":  # imports lightning, so only on first use
        require("lightning", "lightning")
        from sparseswaps_prune.finetune.lightning_module import CausalLMModule

        return CausalLMModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
