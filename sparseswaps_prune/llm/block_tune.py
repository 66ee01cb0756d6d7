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
a block worse on tokens it did not fit; when no epoch lowers it the report says so
(:attr:`BlockTuneReport.fallback`).

Half precision: a float16 or bfloat16 block is tuned through float32 master copies of its tuned weights (Adam's
state in float32 too; the forward and backward run in the block's dtype, the masters are cast into it after every
step). Float16 also scales the loss (dynamically, from ``2**16``, halved at every step whose gradients overflow,
which is skipped) so that small gradients do not flush to zero. Adam in float16 itself would round its ``eps=1e-8``
to 0 and divide 0 by 0 at every pruned entry.

Nothing non-finite is kept: tuning stops at the first epoch whose weights (or held-out outputs) are not finite, and
a block whose tuned weights or outputs on the calibration or held-out windows are not all finite falls back to its
untuned weights, with a warning and the reason in :attr:`BlockTuneReport.fallback` (e.g. a learning rate too high).

This is the block-wise reconstruction of EBFT (Guo et al. 2024, "EBFT: Effective and Block-Wise Fine-Tuning for
Sparse LLMs") with the dense model's outputs as targets, restricted to the pruned layers' weights and early-stopped
on held-out windows; it is not part of the SparseSwaps paper. Pruned weights stay exact zeros: the gradient reaches
``weight_orig`` through the ``torch.nn.utils.prune`` mask, so pruned entries get zero gradient, and Adam without
weight decay leaves them unchanged.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from sparseswaps_prune.core.checks import check_int, check_positive
from sparseswaps_prune.llm.capture import BlockInputs, call_block
from sparseswaps_prune.modules import PrunableLayer

__all__ = [
    "BLOCK_TUNE_LR", "BLOCK_TUNE_SCHEDULE", "NOT_LOWERED", "SCHEDULES", "BlockTuneReport",
    "check_tune", "step_lr", "tune_block",
]  # fmt: skip

logger = logging.getLogger(__name__)

BLOCK_TUNE_LR = 1e-3  # the default of PruneOptions.block_tune_lr and of --block-tune-lr
BLOCK_TUNE_SCHEDULE = "constant"  # the default of PruneOptions.block_tune_schedule and of --block-tune-schedule
SCHEDULES = ("constant", "cosine")
HALF_LOSS_SCALE = 2.0**16  # float16 blocks: the initial loss scale (torch.amp.GradScaler's)
NOT_LOWERED = "tuning did not lower the held-out error"  # BlockTuneReport.fallback when no epoch helped


def check_tune(epochs: int, lr: float, schedule: str = BLOCK_TUNE_SCHEDULE) -> None:
    """Raise ``ValueError``/``TypeError`` naming ``block_tune_epochs`` (an int >= 0), ``block_tune_lr`` (> 0) or
    ``block_tune_schedule`` (one of :data:`SCHEDULES`)."""
    check_int(epochs, "block_tune_epochs (--block-tune-epochs; 0: no block tuning)", low=0)
    check_positive(lr, "block_tune_lr (--block-tune-lr)")
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
    ``best_epoch`` is the epoch whose weights were kept (0: the weights before tuning). ``fallback`` says why the
    block kept its untuned weights (``best_epoch`` 0), None when it keeps tuned ones: :data:`NOT_LOWERED` (no epoch
    lowered the held-out error), or a numerical failure, e.g. ``"non-finite weights after epoch 1 (learning rate
    1e+06 too high?)"`` (then also logged as a warning). ``skipped_steps``: float16 Adam steps skipped because the
    scaled gradients overflowed (each halves the loss scale). Reports written before these fields read as None, 0.
    """

    block: int
    epochs: int
    best_epoch: int
    fit_before: float
    fit_after: float
    holdout_before: float | None
    holdout_after: float | None
    seconds: float
    fallback: str | None = None
    skipped_steps: int = 0


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


def _all_finite(tensors: list[torch.Tensor | None]) -> bool:
    """Whether every tensor is finite (None entries count as finite)."""
    return all(t is None or bool(torch.isfinite(t).all()) for t in tensors)


def _copy(params: list[torch.Tensor], weights: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for param, weight in zip(params, weights, strict=True):
            param.copy_(weight)


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
    ``inputs`` to ``targets``; modifies their ``weight_orig`` in place (pruned entries unchanged). Half-precision
    weights are tuned through float32 masters; weights or block outputs that are not finite fall back to the
    untuned weights (see the module docstring), so what is left in ``layers`` is always finite.

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
        :class:`BlockTuneReport` (its ``fallback`` says why the untuned weights were kept, if they were).

    Raises:
        ValueError: a layer is not pruned (no ``weight_orig``), naming it.
    """
    start = time.perf_counter()
    for layer in layers:
        if not hasattr(layer.module, "weight_orig"):
            raise ValueError(f"layer {layer.name}: block tuning needs a pruned layer (weight_orig), found none")
    params = [layer.module.weight_orig for layer in layers]

    def score(key: str) -> float:
        return relative_error(block, inputs[key], targets[key], device)

    fit_before = score("fit")
    holdout_before = score("holdout") if "holdout" in inputs else None
    untuned = [param.detach().clone() for param in params]
    skipped = 0
    high = f"(learning rate {lr:g} too high?)"
    if not (math.isfinite(fit_before) and (holdout_before is None or math.isfinite(holdout_before))):
        reason = "the block's outputs or the dense targets are not finite before tuning (fp16 overflow?); not tuned"
    else:
        best_epoch, best, best_weights, reason, skipped = _run_epochs(
            block, params, inputs, targets, score, holdout_before, epochs=epochs, lr=lr, device=device,
            schedule=schedule,
        )  # fmt: skip
        if reason is None and holdout_before is not None and best_epoch == 0:
            steps = epochs * inputs["fit"].num_batches
            skips = f" ({skipped} of {steps} steps skipped: float16 gradients overflowed)" if skipped else ""
            reason = NOT_LOWERED + skips
    if reason is None:
        if best_weights is not None:
            _copy(params, best_weights)
        fit_after = score("fit")
        if not (math.isfinite(fit_after) and _all_finite(params)):
            reason = f"non-finite block outputs on the calibration windows after tuning {high}"
    if reason is not None:
        _copy(params, untuned)
        best_epoch, best, fit_after = 0, holdout_before, fit_before
        if not reason.startswith(NOT_LOWERED):
            logger.warning("block %d: block tuning fell back to the untuned weights: %s", index, reason)
    return BlockTuneReport(
        block=index, epochs=epochs, best_epoch=best_epoch, fit_before=fit_before, fit_after=fit_after,
        holdout_before=holdout_before, holdout_after=best, seconds=time.perf_counter() - start, fallback=reason,
        skipped_steps=skipped,
    )  # fmt: skip


def _run_epochs(
    block: nn.Module,
    params: list[torch.Tensor],
    inputs: dict[str, BlockInputs],
    targets: dict[str, BlockInputs],
    score: Callable[[str], float],
    holdout_before: float | None,
    *,
    epochs: int,
    lr: float,
    device: torch.device,
    schedule: str,
) -> tuple[int, float | None, list[torch.Tensor] | None, str | None, int]:
    """Adam on ``params`` (float32 masters for half-precision ones, the loss scaled for float16) for ``epochs``
    passes over the calibration batches. Returns ``(best epoch, its held-out error, its weights (None: the current
    ones), why it stopped (None: it ran every epoch), float16 steps skipped)``; the caller restores the untuned
    weights when it stopped."""
    high = f"(learning rate {lr:g} too high?)"
    half = any(param.dtype in (torch.float16, torch.bfloat16) for param in params)
    fp16 = any(param.dtype == torch.float16 for param in params)
    scale = HALF_LOSS_SCALE if fp16 else 1.0
    best_epoch, best, best_weights, skipped = 0, holdout_before, None, 0
    grad_modes = {param: param.requires_grad for param in block.parameters()}
    try:
        for param in block.parameters():
            param.requires_grad_(False)
        for param in params:
            param.requires_grad_(True)
        masters = [param.detach().to(torch.float32, copy=True) for param in params] if half else params
        optimizer = torch.optim.Adam(masters, lr=lr)
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
                    for param in params:
                        param.grad = None
                    (loss * scale).backward()
                if half:
                    grads = [param.grad for param in params]
                    if not _all_finite(grads):  # skip the step (float16: the scaled gradients overflowed)
                        skipped += 1
                        if fp16:
                            scale /= 2
                        continue
                    for master, grad in zip(masters, grads, strict=True):
                        master.grad = None if grad is None else grad.float() / scale
                optimizer.step()
                if half:
                    _copy(params, masters)
            if not (_all_finite(params) and _all_finite(masters)):
                return 0, holdout_before, None, f"non-finite weights after epoch {epoch} {high}", skipped
            if holdout_before is not None:
                current = score("holdout")
                if not math.isfinite(current):
                    why = f"non-finite block outputs on the held-out windows after epoch {epoch} {high}"
                    return 0, holdout_before, None, why, skipped
                if current < best:
                    best, best_epoch = current, epoch
                    best_weights = [param.detach().clone() for param in params]
            else:
                best_epoch = epoch
        return best_epoch, best, best_weights, None, skipped
    finally:
        for param, mode in grad_modes.items():
            param.requires_grad_(mode)
