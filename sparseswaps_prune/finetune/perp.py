"""PERP (Zimmer et al., arXiv 2312.15230): retrain only a few parameters of a pruned model.

After pruning, training biases, normalisation parameters and low-rank adapters recovers most of the lost
quality while every pruned weight stays frozen (and so exactly zero). :func:`mark_trainable` picks those
parameters, sets ``requires_grad`` accordingly and says how many there are.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field

from torch import nn

from sparseswaps_prune.finetune.adapters import adapted_modules
from sparseswaps_prune.modules import linear_types

logger = logging.getLogger(__name__)

__all__ = ["TrainableSelection", "mark_trainable", "parameter_groups"]


@dataclass
class TrainableSelection:
    """What :func:`mark_trainable` left trainable.

    Attributes:
        names: qualified names of the trainable parameters (as in ``model.named_parameters()``).
        parameters: the trainable parameters, in the same order (pass them to the optimizer).
        groups: ``{"bias" | "norm" | "adapter": names}``, which category each trainable parameter is in.
        n_trainable: number of trainable scalars.
        n_total: number of scalars of all (distinct) parameters.
    """

    names: list[str]
    parameters: list[nn.Parameter]
    groups: dict[str, list[str]] = field(default_factory=dict)
    n_trainable: int = 0
    n_total: int = 0

    @property
    def fraction(self) -> float:
        """``n_trainable / n_total`` (0 for a model without parameters)."""
        return self.n_trainable / self.n_total if self.n_total else 0.0


def _is_norm(module: nn.Module) -> bool:
    """A normalisation layer: a module whose own ``weight`` is 1-D (LayerNorm, RMSNorm, transformers'
    LlamaRMSNorm, GPT-2's ``ln_*``, BatchNorm, GroupNorm); linear and embedding layers never are."""
    weight = module._parameters.get("weight")
    weight_modules = (*linear_types(), nn.Embedding, nn.EmbeddingBag)
    return weight is not None and weight.dim() == 1 and not isinstance(module, weight_modules)


def _peft_adapter_params(model: nn.Module) -> dict[int, str]:
    """``id(param) -> "adapter"`` for every peft LoRA parameter (``lora_A``, ``lora_B``, ...) of ``model``."""
    if "peft" not in sys.modules:  # a model cannot hold peft layers unless peft was imported
        return {}
    from peft.tuners.tuners_utils import BaseTunerLayer

    ids = {}
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            for attr in module.adapter_layer_names:
                part = getattr(module, attr, None)
                if isinstance(part, nn.Module):
                    ids.update({id(p): "adapter" for p in part.parameters()})
                elif isinstance(part, nn.ParameterDict):
                    ids.update({id(p): "adapter" for p in part.values()})
    return ids


def parameter_groups(model: nn.Module) -> dict[str, str]:
    """The PERP category of each parameter of ``model``: ``"adapter"``, ``"norm"``, ``"bias"`` or ``"other"``.

    * adapter: ``adapter_A`` / ``adapter_B`` of layers with a MaskLoRA / ScaleLoRA adapter, and the parameters
      of peft adapter layers (``lora_A``, ``lora_B``, ...);
    * norm: the parameters of normalisation layers (a module whose own ``weight`` is 1-D), biases included;
    * bias: every other parameter named ``bias``;
    * other: everything else (linear and embedding weights, ``weight_orig`` of pruned layers, ...).

    Args:
        model: the model; not modified.

    Returns:
        ``{qualified parameter name: category}`` for every distinct parameter (tied weights once).
    """
    by_id = _peft_adapter_params(model)
    for _, module in adapted_modules(model):
        by_id[id(module.adapter_A)] = by_id[id(module.adapter_B)] = "adapter"
    for module in model.modules():
        if _is_norm(module):
            for p in module._parameters.values():
                if p is not None:
                    by_id.setdefault(id(p), "norm")
        bias = module._parameters.get("bias")
        if bias is not None:
            by_id.setdefault(id(bias), "bias")
    return {name: by_id.get(id(p), "other") for name, p in model.named_parameters()}


def mark_trainable(
    model: nn.Module, *, biases: bool = True, norms: bool = True, adapters: bool = True
) -> TrainableSelection:
    """Freeze every parameter of ``model`` except the chosen PERP categories (see :func:`parameter_groups`).

    Sets ``requires_grad`` in place: ``True`` for biases, normalisation parameters and adapters (each as
    chosen), ``False`` for everything else, in particular every (pruned) weight, so training cannot move a
    pruned weight away from zero.

    Args:
        model: the model; ``requires_grad`` of its parameters is modified.
        biases: train parameters named ``bias`` (outside normalisation layers).
        norms: train normalisation layers' parameters.
        adapters: train MaskLoRA / ScaleLoRA / peft LoRA parameters.

    Returns:
        A :class:`TrainableSelection` (names, parameters and counts).

    Raises:
        TypeError: a flag is not a bool.
        ValueError: nothing would be trainable (the model is then left unchanged).
    """
    flags = {"bias": biases, "norm": norms, "adapter": adapters}
    for arg, value in (("biases", biases), ("norms", norms), ("adapters", adapters)):
        if not isinstance(value, bool):
            raise TypeError(f"{arg} must be a bool, got {value!r}")
    groups = parameter_groups(model)
    params = dict(model.named_parameters())
    selection = TrainableSelection(names=[], parameters=[], groups={k: [] for k in flags})
    for name, category in groups.items():
        param = params[name]
        selection.n_total += param.numel()
        if flags.get(category, False):
            selection.names.append(name)
            selection.parameters.append(param)
            selection.groups[category].append(name)
            selection.n_trainable += param.numel()
    if not selection.parameters:
        raise ValueError(
            f"nothing to train in {type(model).__name__} with biases={biases} norms={norms} adapters={adapters}; "
            "attach adapters (attach_adapters) or enable biases / norms"
        )
    trainable = {id(p) for p in selection.parameters}
    for param in params.values():
        param.requires_grad_(id(param) in trainable)
    logger.info(
        "PERP: %d trainable parameters (%.3f%% of %d): %d biases, %d norms, %d adapter tensors",
        selection.n_trainable, 100 * selection.fraction, selection.n_total,
        len(selection.groups["bias"]), len(selection.groups["norm"]), len(selection.groups["adapter"]),
    )  # fmt: skip
    return selection
