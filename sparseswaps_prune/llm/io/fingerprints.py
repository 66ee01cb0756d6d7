"""What identifies a pruning run for resuming it: the settings besides the options that a checkpoint's fingerprint
records (:func:`checkpoint_settings`, both paths) and the fingerprint of a block-wise run
(:func:`blockwise_fingerprint`: the source's files hashed instead of the loaded weights, plus the output plan). The
fingerprint itself and its comparison are :mod:`~sparseswaps_prune.llm.checkpoint`'s."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from sparseswaps_prune.llm import checkpoint
from sparseswaps_prune.llm.distributed import Ranks
from sparseswaps_prune.llm.io.readers import CheckpointReader
from sparseswaps_prune.llm.io.writers import parse_size

if TYPE_CHECKING:
    from sparseswaps_prune.llm.pipeline import PruneOptions

__all__ = ["blockwise_fingerprint", "checkpoint_settings"]


def checkpoint_settings(
    keep_dense: bool, ranks: Ranks | None, *, batch_size: int, device: torch.device | str
) -> dict[str, Any]:
    """The settings besides the options that a checkpoint's fingerprint records (``checkpoint.fingerprint``'s
    ``**settings``): ``keep_dense``, the numerics of ``batch_size`` and ``device`` (``checkpoint.numerics``), and
    with ranks their number (each rank's inputs are its own)."""
    ranked = {} if ranks is None else {"world_size": ranks.world_size}
    return {"keep_dense": keep_dense} | checkpoint.numerics(batch_size, device) | ranked


def blockwise_fingerprint(
    model: nn.Module,
    reader: CheckpointReader,
    dtype: torch.dtype,
    options: PruneOptions,
    calib_tokens: torch.Tensor,
    holdout_tokens: torch.Tensor | None,
    planned: list[tuple[str, torch.dtype, tuple[int, ...]]],
    max_shard_size: int | str,
    ranks: Ranks | None,
    *,
    batch_size: int,
    device: torch.device,
) -> checkpoint.Fingerprint:
    """The :class:`~sparseswaps_prune.llm.checkpoint.Fingerprint` of a
    :func:`~sparseswaps_prune.llm.streaming.prune_checkpoint` call: the model's config, the source's weight files
    (hashed on rank 0 and broadcast), ``dtype``, ``options``, the windows, the number of ``ranks`` (None: one
    process), the numerics of ``batch_size`` and ``device``, ``max_shard_size`` and the output plan (``planned``:
    name, dtype and shape of every output tensor, in order)."""
    weights = reader.digest() if ranks is None or ranks.is_main else None
    parts = {
        "model_config": checkpoint.config_digest(model),
        "model_weights": weights if ranks is None else ranks.broadcast(weights, src=0),
        "dtype": str(dtype).removeprefix("torch."),
    }
    plan = json.dumps([[name, str(kind), list(shape)] for name, kind, shape in planned])
    settings = checkpoint_settings(False, ranks, batch_size=batch_size, device=device) | {
        "max_shard_size": parse_size(max_shard_size),
        "output_plan": hashlib.sha256(plan.encode()).hexdigest()[:16],
    }
    return checkpoint.fingerprint(model, options, calib_tokens, holdout_tokens, known_model_parts=parts, **settings)
