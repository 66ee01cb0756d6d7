"""Block-wise tuning of the kept weights: after a block's layers are pruned, fit its output to the dense model's.

The layer-wise stages (start, swaps, re-fit) each minimise one linear layer's output error on that layer's own
inputs. A decoder block also has non-linearities between its layers, and its inputs already carry the error of
the pruned blocks before it. :func:`tune_block` corrects both: with every mask fixed, Adam adjusts the kept
weights of the block's pruned layers so that the pruned block, fed the pruned model's inputs, reproduces the
*dense model's* output of that block (the target stream the pipeline carries alongside, see
:mod:`~sparseswaps_prune.llm.pipeline`). The objective is the relative squared error
``||block(x) - y_dense||^2 / ||y_dense||^2`` per calibration batch (one Adam step per batch, ``epochs`` passes over
the calibration windows in their order). Held-out windows, when there are any, choose the epoch: the weights
kept are those of the epoch (0: the weights before tuning) with the lowest held-out error, so tuning never makes
a block worse on tokens it did not fit.

This is the block-wise reconstruction of EBFT (Guo et al. 2024, "EBFT: Effective and Block-Wise Fine-Tuning for
Sparse LLMs") with the dense model's outputs as targets, restricted to the pruned layers' weights and early-stopped
on held-out windows; it is not part of the SparseSwaps paper. Pruned weights stay exact zeros: the gradient reaches
``weight_orig`` through the ``torch.nn.utils.prune`` mask, so pruned entries get zero gradient, and Adam without
weight decay leaves them unchanged.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from sparseswaps_prune.core.checks import check_int, check_number
from sparseswaps_prune.llm.capture import BlockInputs, call_block
from sparseswaps_prune.modules import PrunableLayer

__all__ = [
    "BLOCK_TUNE_EPOCHS", "BLOCK_TUNE_LR", "BLOCK_TUNE_SCHEDULE", "SCHEDULES", "BlockTuneReport", "check_tune",
    "step_lr", "tune_block",
]  # fmt: skip

BLOCK_TUNE_EPOCHS = 3  # the default of PruneOptions.block_tune_epochs and of sparseswaps prune --block-tune-epochs
BLOCK_TUNE_LR = 1e-3  # the default of PruneOptions.block_tune_lr and of --block-tune-lr
BLOCK_TUNE_SCHEDULE = "constant"  # the default of PruneOptions.block_tune_schedule and of --block-tune-schedule
SCHEDULES = ("constant", "cosine")


def check_tune(epochs: int, lr: float, schedule: str = BLOCK_TUNE_SCHEDULE) -> None:
    """Raise ``ValueError``/``TypeError`` naming ``block_tune_epochs`` (an int >= 0), ``block_tune_lr`` (> 0) or
    ``block_tune_schedule`` (one of :data:`SCHEDULES`)."""
    check_int(epochs, "block_tune_epochs (--block-tune-epochs; 0: no block tuning)", low=0)
    check_number(lr, "block_tune_lr (--block-tune-lr)", low=0.0)
    if lr <= 0:
        raise ValueError(f"block_tune_lr (--block-tune-lr) must be > 0, got {lr!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"block_tune_schedule (--block-tune-schedule) must be one of {SCHEDULES}, got {schedule!r}")


def step_lr(lr: float, schedule: str, step: int, steps: int) -> float:
    """Learning rate of Adam step ``step`` (0-based) of ``steps``: ``lr`` (``"constant"``), or ``lr`` decayed along
    a half cosine towards 0, ``lr * (1 + cos(pi * step / steps)) / 2`` (``"cosine"``, per step, no warm-up)."""
    if schedule == "constant":
        return lr
    return lr * 0.5 * (1.0 + math.cos(math.pi * step / steps))


@dataclass
class BlockTuneReport:
    """One tuned block: relative output errors against the dense block before and after, and the epoch kept.

    ``fit_*`` are on the calibration windows, ``holdout_*`` on the held-out windows (None without them);
    ``best_epoch`` is the epoch whose weights were kept (0: the weights before tuning).
    """

    block: int
    epochs: int
    best_epoch: int
    fit_before: float
    fit_after: float
    holdout_before: float | None
    holdout_after: float | None
    seconds: float


def _pairs(
    part: BlockInputs, target: BlockInputs, device: torch.device
) -> Iterator[tuple[torch.Tensor, dict, torch.Tensor]]:
    """``(hidden, kwargs, target hidden)`` per batch of ``part``, on ``device``."""
    for i, (hidden, kwargs) in enumerate(part.batches(device)):
        rows = slice(i * part.batch_size, i * part.batch_size + hidden.shape[0])
        yield hidden, kwargs, target.hidden_states[rows].to(device)


def relative_error(block: nn.Module, part: BlockInputs, target: BlockInputs, device: torch.device) -> float:
    """``||block(part) - target||^2 / ||target||^2`` over all windows (float64 sums), without gradients."""
    error = norm = 0.0
    with torch.no_grad():
        for hidden, kwargs, wanted in _pairs(part, target, device):
            out = call_block(block, hidden, kwargs).double()
            error += float(((out - wanted.double()) ** 2).sum())
            norm += float((wanted.double() ** 2).sum())
    return error / norm if norm > 0 else 0.0


def tune_block(
    block: nn.Module,
    layers: list[PrunableLayer],
    inputs: dict[str, BlockInputs],
    targets: dict[str, BlockInputs],
    *,
    index: int,
    epochs: int,
    lr: float,
    device: torch.device,
    schedule: str = BLOCK_TUNE_SCHEDULE,
) -> BlockTuneReport:
    """Tune the kept weights of ``layers`` (pruned, with ``weight_orig``/``weight_mask``) so that ``block`` maps
    ``inputs`` to ``targets``; modifies their ``weight_orig`` in place (pruned entries unchanged).

    Args:
        block: the decoder block, on ``device``, its ``layers`` already pruned.
        layers: the pruned layers of ``block`` whose weights are tuned (nothing else in the block changes).
        inputs: ``"fit"`` (and optionally ``"holdout"``) inputs of the block in the pruned model.
        targets: the dense block's outputs on the dense model's inputs, same keys and windows as ``inputs``.
        index: the block's index (for the report).
        epochs: passes over the calibration batches, one Adam step per batch.
        lr: Adam's (initial) learning rate.
        device: where the block runs.
        schedule: ``"constant"`` or ``"cosine"`` (:func:`step_lr`, over all ``epochs`` x batches steps).

    Returns:
        :class:`BlockTuneReport`.

    Raises:
        ValueError: a layer is not pruned (no ``weight_orig``), naming it.
    """
    start = time.perf_counter()
    for layer in layers:
        if not hasattr(layer.module, "weight_orig"):
            raise ValueError(f"layer {layer.name}: block tuning needs a pruned layer (weight_orig), found none")
    params = [layer.module.weight_orig for layer in layers]
    holdout = "holdout" in inputs

    def score(key: str) -> float:
        return relative_error(block, inputs[key], targets[key], device)

    fit_before = score("fit")
    holdout_before = best = score("holdout") if holdout else None
    best_epoch = 0
    best_weights = [param.detach().clone() for param in params] if holdout else None  # epoch 0's
    grad_modes = {param: param.requires_grad for param in block.parameters()}
    try:
        for param in block.parameters():
            param.requires_grad_(False)
        for param in params:
            param.requires_grad_(True)
        optimizer = torch.optim.Adam(params, lr=lr)
        fit = inputs["fit"]
        steps, step = epochs * fit.num_batches, 0
        for epoch in range(1, epochs + 1):
            for hidden, kwargs, wanted in _pairs(fit, targets["fit"], device):
                for group in optimizer.param_groups:
                    group["lr"] = step_lr(lr, schedule, step, steps)
                step += 1
                with torch.enable_grad():
                    out = call_block(block, hidden, kwargs).float()
                    wanted = wanted.float()
                    loss = ((out - wanted) ** 2).mean() / (wanted**2).mean().clamp_min(torch.finfo(torch.float32).tiny)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                optimizer.step()
            if holdout:
                current = score("holdout")
                if current < best:
                    best, best_epoch = current, epoch
                    best_weights = [param.detach().clone() for param in params]
            else:
                best_epoch = epoch
        if holdout:
            with torch.no_grad():
                for param, kept in zip(params, best_weights, strict=True):
                    param.copy_(kept)
    finally:
        for param, mode in grad_modes.items():
            param.requires_grad_(mode)
    return BlockTuneReport(
        block=index, epochs=epochs, best_epoch=best_epoch, fit_before=fit_before, fit_after=score("fit"),
        holdout_before=holdout_before, holdout_after=best, seconds=time.perf_counter() - start,
    )  # fmt: skip
