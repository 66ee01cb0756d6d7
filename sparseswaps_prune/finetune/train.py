"""PERP fine-tuning of a pruned Hugging Face causal LM in plain PyTorch (no Lightning)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from sparseswaps_prune.core.checks import check_int, check_positive
from sparseswaps_prune.finetune.adapters import ADAPTER_KINDS, attach_adapters, merge_adapters, select_layers
from sparseswaps_prune.finetune.peft_glue import add_lora, merge_lora_keep_sparsity
from sparseswaps_prune.finetune.perp import mark_trainable

logger = logging.getLogger(__name__)

__all__ = ["ADAPTERS", "FinetuneResult", "check_token_windows", "finetune_causal_lm"]

ADAPTERS = (*ADAPTER_KINDS, "lora", "none")
"""``adapter=`` values of :func:`finetune_causal_lm`: MaskLoRA, ScaleLoRA, peft LoRA, or biases/norms only."""


@dataclass
class FinetuneResult:
    """What :func:`finetune_causal_lm` did.

    Attributes:
        model: the fine-tuned model: the input model itself (modified in place), or, for ``adapter="lora"``
            with ``merge=False``, the ``peft.PeftModel`` wrapping it.
        losses: the training loss of every step (mean token cross-entropy of the batch).
        adapter: the adapter kind used.
        adapted: qualified names of the layers that got adapters.
        n_trainable: trained scalars.
        n_total: all scalars of the model.
        seconds: wall time of the training loop.
    """

    model: nn.Module
    losses: list[float] = field(default_factory=list)
    adapter: str = "masklora"
    adapted: list[str] = field(default_factory=list)
    n_trainable: int = 0
    n_total: int = 0
    seconds: float = 0.0


def check_token_windows(token_windows: torch.Tensor) -> torch.Tensor:
    """Validate training windows: an integer tensor ``[N, seqlen]`` with ``N >= 1`` and ``seqlen >= 2``.

    Returns:
        The windows as int64 (a copy only when the dtype differs).

    Raises:
        TypeError: not an integer tensor.
        ValueError: wrong number of dimensions or too small.
    """
    if not isinstance(token_windows, torch.Tensor) or token_windows.is_floating_point() or token_windows.is_complex():
        raise TypeError(
            f"token_windows must be an integer torch.Tensor [N, seqlen], got {type(token_windows).__name__} "
            f"{getattr(token_windows, 'dtype', '')}; use load_calibration(...) windows"
        )
    if token_windows.dim() != 2 or token_windows.shape[0] < 1 or token_windows.shape[1] < 2:
        raise ValueError(
            f"token_windows must have shape [N >= 1, seqlen >= 2], got {list(token_windows.shape)}; "
            "use tokens.view(-1, seqlen)"
        )
    return token_windows.long()


def finetune_causal_lm(
    model: nn.Module,
    token_windows: torch.Tensor,
    *,
    steps: int = 100,
    lr: float = 2e-4,
    batch_size: int = 4,
    adapter: str = "masklora",
    rank: int = 8,
    alpha: float | None = None,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    biases: bool = True,
    norms: bool = True,
    weight_decay: float = 0.0,
    max_grad_norm: float | None = 1.0,
    merge: bool = True,
    seed: int = 0,
    progress: bool = True,
) -> FinetuneResult:
    """Fine-tune a pruned causal LM with PERP: train biases, norms and adapters; every weight stays frozen.

    The adapters (``adapter=``) go on the selected linear layers (default: every linear in the decoder blocks):
    ``"masklora"`` / ``"scalelora"`` (:func:`~sparseswaps_prune.finetune.adapters.attach_adapters`, the update
    never leaves the mask), ``"lora"`` (plain peft LoRA, merged by
    :func:`~sparseswaps_prune.finetune.peft_glue.merge_lora_keep_sparsity`) or ``"none"`` (biases and norms
    only). Each step draws ``batch_size`` windows (a seeded permutation, reshuffled every epoch), computes the
    causal-LM loss ``model(input_ids=ids, labels=ids).loss`` and takes an AdamW step on the trainable
    parameters. The model runs on its own device (batches are moved there); its train/eval mode is restored.

    With ``merge=True`` (default) the adapters are folded into the weights at the end: every layer's zeros are
    then exactly those pruning left, and the model has no adapter parameters or hooks. Layers pruned through
    ``torch.nn.utils.prune`` keep their reparametrization for MaskLoRA / ScaleLoRA (the update lands in
    ``weight_orig``); peft LoRA makes the wrapped layers' pruning permanent. ``requires_grad`` of the model's
    parameters is left as training set it (only the PERP parameters trainable).

    Args:
        model: a Hugging Face causal LM (pruned or not); modified in place.
        token_windows: int64 ``[N, seqlen]`` training windows (e.g. from ``load_calibration``).
        steps: optimizer steps (>= 1).
        lr: AdamW learning rate.
        batch_size: windows per step (>= 1; at most ``N`` are used).
        adapter: one of :data:`ADAPTERS`.
        rank, alpha: adapter rank and scale ``alpha / rank`` (``alpha=None``: scale 1).
        include, exclude: fnmatch patterns selecting the adapted layers (see ``select_layers``).
        biases, norms: also train biases / normalisation parameters.
        weight_decay: AdamW weight decay.
        max_grad_norm: clip the gradient norm to this (``None``: no clipping).
        merge: fold the adapters into the weights at the end.
        seed: seed of the adapter initialisation and of the window order.
        progress: show a tqdm progress bar.

    Returns:
        A :class:`FinetuneResult` with the per-step losses.

    Raises:
        TypeError / ValueError: a bad argument (before the model is modified).
    """
    windows = check_token_windows(token_windows)
    if adapter not in ADAPTERS:
        raise ValueError(f"unknown adapter {adapter!r}; choose one of {', '.join(ADAPTERS)}")
    check_int(steps, "steps", low=1)
    check_int(batch_size, "batch_size", low=1)
    check_positive(lr, "lr")
    if max_grad_norm is not None:
        check_positive(max_grad_norm, "max_grad_norm")

    if adapter == "none" and not (biases or norms):
        raise ValueError("adapter='none' with biases=False and norms=False trains nothing; enable one of them")

    adapted: list[str] = []
    target = model
    if adapter in ADAPTER_KINDS:
        adapted = attach_adapters(model, adapter, rank=rank, alpha=alpha, include=include, exclude=exclude, seed=seed)
    elif adapter == "lora":
        adapted = [layer.name for layer in select_layers(model, include=include, exclude=exclude)]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            target = add_lora(model, rank=rank, alpha=alpha, include=include, exclude=exclude)
    selection = mark_trainable(target, biases=biases, norms=norms, adapters=adapter != "none")
    optimizer = torch.optim.AdamW(selection.parameters, lr=lr, weight_decay=weight_decay)
    device = next(target.parameters()).device

    generator = torch.Generator().manual_seed(seed)
    batch_size = min(batch_size, windows.shape[0])
    order = torch.randperm(windows.shape[0], generator=generator)
    position = 0
    losses: list[float] = []
    was_training = model.training  # the input model's; a fresh PeftModel wrapper is in train mode
    target.train()
    start = time.perf_counter()
    try:
        bar = tqdm(range(steps), desc=f"PERP ({adapter})", disable=not progress, leave=False)
        for _ in bar:
            if position + batch_size > len(order):
                order, position = torch.randperm(windows.shape[0], generator=generator), 0
            ids = windows[order[position : position + batch_size]].to(device)
            position += batch_size
            loss = target(input_ids=ids, labels=ids, use_cache=False).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(selection.parameters, max_grad_norm)
            optimizer.step()
            losses.append(float(loss.detach()))
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
    finally:
        target.train(was_training)
        model.train(was_training)
    seconds = time.perf_counter() - start
    logger.info("PERP (%s): %d steps, loss %.4f -> %.4f in %.1f s", adapter, steps, losses[0], losses[-1], seconds)

    if merge and adapter in ADAPTER_KINDS:
        merge_adapters(model)
    elif merge and adapter == "lora":
        target = merge_lora_keep_sparsity(target)
    return FinetuneResult(
        model=target,
        losses=losses,
        adapter=adapter,
        adapted=adapted,
        n_trainable=selection.n_trainable,
        n_total=selection.n_total,
        seconds=seconds,
    )
