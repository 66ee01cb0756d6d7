"""Dividing the layers of a decoder block across ``torch.distributed`` ranks.

Every rank runs the same block-wise pipeline on the same model and the same calibration data: each computes
the block's Grams and next inputs itself (so they are bit for bit those of a single process), prunes only the
layers assigned to it, and then receives the others' results by broadcast, in layer order, so that every rank
holds identical weights after each block. The per-layer results do not depend on one another within a block
(every Gram is accumulated on the dense block before any layer is masked), so the outcome equals the
single-process one bit for bit, provided each rank's arithmetic is that of the single process (same device
type, same number of CPU threads).

Works with any backend that supports ``broadcast_object_list`` (``gloo`` on the CPU, ``nccl`` on GPUs, where
the current CUDA device must be set per rank). Calibration windows are not split across ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from sparseswaps_prune.modules import PrunableLayer

__all__ = ["Ranks", "assign_layers"]


def assign_layers(layers: Sequence[PrunableLayer], world_size: int) -> list[int]:
    """The rank that prunes each layer: largest estimated cost first, each to the least loaded rank (ties to the
    lowest rank). The cost of a layer is ``d_out * d_in^2`` (its swap search and losses scale with it).

    Deterministic: every rank computes the same assignment from the layer shapes alone.

    Returns:
        ``owners[j]`` is the rank of ``layers[j]``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    order = sorted(range(len(layers)), key=lambda j: (-layers[j].d_out * layers[j].d_in ** 2, j))
    load = [0] * world_size
    owners = [0] * len(layers)
    for j in order:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[j] = rank
        load[rank] += layers[j].d_out * layers[j].d_in ** 2
    return owners


@dataclass(frozen=True)
class Ranks:
    """This process's place in the default (or a given) process group.

    Attributes:
        rank, world_size: as ``torch.distributed`` reports them for ``group``.
        group: the process group (None: the default group).
    """

    rank: int
    world_size: int
    group: Any = None

    @classmethod
    def current(cls, group: Any = None) -> Ranks:
        """The ranks of the initialised process group.

        Raises:
            RuntimeError: ``torch.distributed`` is unavailable or no process group is initialised.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "distributed=True needs an initialised torch.distributed process group: launch with torchrun (or "
                "torch.multiprocessing) and call torch.distributed.init_process_group first"
            )
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    @property
    def is_main(self) -> bool:
        """True on rank 0 (the rank that writes outputs and shows progress)."""
        return self.rank == 0

    def broadcast(self, obj: Any, src: int) -> Any:
        """``obj`` from rank ``src`` on every rank (pickled; tensors keep their bits)."""
        if self.world_size == 1:
            return obj
        box = [obj if self.rank == src else None]
        root = src if self.group is None else dist.get_global_rank(self.group, src)
        dist.broadcast_object_list(box, src=root, group=self.group)
        return box[0]

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        if self.world_size > 1:
            dist.barrier(group=self.group)
