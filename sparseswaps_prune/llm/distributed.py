"""Dividing the work of a decoder block across ``torch.distributed`` ranks: its layers (whole, or by rows), and its
calibration windows.

**Layers.** Every rank runs the same block-wise pipeline on the same model: each prunes only its units of the block's
work plan (:func:`plan_work`; by default whole layers, largest estimated cost ``d_out * d_in^2`` first to the least
loaded rank), and then receives the others' results by broadcast, in layer order, so that every
rank holds identical weights after each block. The per-layer results do not depend on one another within a block
(every Gram is accumulated on the dense block before any layer is masked).

**Row shards** (``PruneOptions.row_shards=n``, 0 by default: off). Whole layers balance badly: a LLaMA block has 7
layers and its ``down_proj`` alone costs over half of the block, so 8 ranks wait for one. When the spec treats every
output row on its own (:attr:`~sparseswaps_prune.core.spec.PruneSpec.row_separable`: a per-row or N:M budget, a
magnitude or Wanda start, any refinement within rows, kept or least-squares weights), :func:`plan_work` also cuts layers
into contiguous row shards of at least ``n`` rows, filling the ranks to an even estimated load (rows cost ``d_in^2``
each; the planned load of a LLaMA-3.1-8B block is within 1% of the mean on 2 to 16 ranks with shards of 32 to 256 rows,
and within 13% with 512). Each rank runs ``prune_layer`` on its rows (``weight[start:stop]``, the layer's Grams), the
shards' outcomes are broadcast in row order, and every rank assembles the layer
(:meth:`~sparseswaps_prune.core.layer.LayerOutcome.cat`: per-row masks, weights and losses concatenated, so the reported
totals are the same ``sum`` over the same per-row vector as in one process; ``iters`` is the largest shard's, every row
stage counting the iterations of its busiest row; the seconds are summed over the shards). Every rank holds the same
result.

It equals one process's bit for bit only if the BLAS rounds each row of a product such as ``W[rows] @ G`` the same
whatever the number of rows. MKL (the CPU wheels') does not at every width: it multiplies a few rows by other kernels
than many. Measured on this build (float64 ``[M, K] @ [K, K]``, rows of slices of ``s`` rows against the whole): equal
at ``K = 576`` and ``768`` for every ``s >= 2``; at ``K = 1000, 1536, 2048, 3072, 4096`` they differ in the last bits
for ``s`` up to 64 to 256 (depending on ``K`` and the thread count), and at 2 threads ``K = 4096`` also ``s = 512``
against ``M = 1024``; a one-row product (matrix-vector) almost always differs. The tiny test models
(``tests/llm/test_distributed.py``) and a SmolLM2 ``down_proj`` cut in halves are equal bit for bit. Where rounding
differs, row shards differ from one process in the last bits of losses and re-fitted weights, and rarely in a near-tied
swap; hence row shards are off by default, and a few hundred rows (:data:`MIN_SHARD_ROWS`) is a sensible ``n``.
cuBLAS also picks kernels by shape (not measured here).

**Calibration windows** (``PruneOptions.calib_shards``, :class:`WindowShards`). The calibration windows, and the
held-out windows apart, are split into ``calib_shards`` contiguous shards of whole batches. Each shard's partial
Grams are accumulated on their own, and a block's Gram is the sum of the partials in shard order,
``((P_0 + P_1) + P_2) + ...`` (:func:`sum_shard_grams`). With ranks, each rank owns a contiguous run of whole shards:
it captures and forwards only its own windows (and passes only their outputs on to the next block), and the partials
are combined in shard order on every rank by a sequential loop of broadcasts from each shard's owner (one received
Gram at a time). With the default ``calib_shards=1`` nothing is split: every rank captures and forwards every window
and computes the Grams itself, exactly as one process does.

Float sums depend on their order, so the order is fixed by ``calib_shards`` and not by the number of ranks: one
process with ``S`` shards and ``W`` ranks with the same ``S`` shards give the same Grams, masks, weights and reports
bit for bit, provided each rank's arithmetic is that of the single process (same device type, same number of CPU
threads). A different ``S`` sums in another order, so its results differ from ``S=1`` in the last bits.

Works with any backend that supports ``broadcast`` and ``broadcast_object_list`` (``gloo`` on the CPU, ``nccl`` on
GPUs, where the current CUDA device must be set per rank and the compute device must be that GPU).

**A stalled rank** (issue 47). :func:`init_from_env` gives the process group a timeout for collective operations
(``--collective-timeout``, :data:`DEFAULT_COLLECTIVE_TIMEOUT` seconds; gloo's own default is 30 minutes): a rank that
waits longer than that for the others fails. Every collective operation of :class:`Ranks` first records, in the
group's rendezvous store, how many this rank has entered; when one times out, the rank reads the others' counts and
raises :class:`CollectiveTimeout` (a ``TimeoutError``: one line from the CLI, exit 2) naming the ranks that did not
reach it and the option to raise. The store is read with a bounded wait: under ``torchrun`` its agent serves it; where
rank 0 serves it and is the rank that stopped, the message says so. With NCCL, torch's watchdog ends the process at the
timeout instead (its log names the operation).
"""

from __future__ import annotations

import datetime
import math
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sparseswaps_prune.core.gram import GramAccumulator
from sparseswaps_prune.modules import PrunableLayer

__all__ = [
    "DEFAULT_COLLECTIVE_TIMEOUT",
    "MIN_SHARD_ROWS",
    "CollectiveTimeout",
    "Ranks",
    "WindowShards",
    "WorkUnit",
    "init_from_env",
    "match_numba_threads",
    "plan_work",
    "sum_shard_grams",
]

# What torchrun (torch.distributed.run) sets for every process it launches.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_COLLECTIVE_TIMEOUT = 600.0
"""Seconds a rank waits for the others in one collective operation before the run fails (``--collective-timeout``;
torch's default for NCCL; gloo's is 1800). A rank waits about as long as the slowest rank's share of one block, and
the other ranks wait while rank 0 alone measures the perplexity and saves the model: raise it where one of these
takes longer than this."""
MAX_COLLECTIVE_TIMEOUT = 7 * 24 * 3600.0
# Per process: the collective operations entered through Ranks (default group), and the timeout init_from_env set.
_COLLECTIVES: dict[str, Any] = {"count": 0, "timeout": None}
_STORE_KEY = "sparseswaps/collectives/rank{}"


class CollectiveTimeout(TimeoutError):
    """A collective operation got no answer within the process group's timeout; the message names the ranks that
    did not reach it and ``--collective-timeout``."""


def check_collective_timeout(timeout: Any) -> float:
    """``timeout`` as float seconds. Raises ``ValueError``/``TypeError`` naming ``--collective-timeout``."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"collective_timeout (--collective-timeout) must be a number of seconds, got {timeout!r}")
    if not (0 < timeout <= MAX_COLLECTIVE_TIMEOUT) or math.isnan(timeout):
        raise ValueError(
            f"collective_timeout (--collective-timeout) must be in (0, {MAX_COLLECTIVE_TIMEOUT:g}] seconds, got "
            f"{timeout!r}"
        )
    return float(timeout)


def init_from_env(device: str | torch.device = "cpu", timeout: float = DEFAULT_COLLECTIVE_TIMEOUT) -> Ranks:
    """Initialise the default process group of a process launched by ``torchrun``: NCCL when ``device`` is a CUDA
    device (each process on GPU ``LOCAL_RANK``, made the current device, so ``"cuda"`` means it), gloo otherwise,
    with ``timeout`` seconds for each collective operation (a rank that waits longer fails the run with
    :class:`CollectiveTimeout`, see the module docstring). A group already initialised is used as it is (with its
    own timeout). On the CPU the numba swap search is limited to torch's thread count (``OMP_NUM_THREADS``, which
    torchrun sets to 1 by default): numba would otherwise take every core in every rank.

    Raises:
        ValueError: the process was not launched by torchrun (names the command), or a bad ``timeout``.
    """
    timeout = check_collective_timeout(timeout)
    if dist.is_available() and dist.is_initialized():
        return Ranks.current()
    missing = [name for name in TORCHRUN_ENV if name not in os.environ]
    if missing or not dist.is_available():
        raise ValueError(
            f"distributed runs are launched by torchrun, which sets {', '.join(TORCHRUN_ENV)} ({', '.join(missing)} "
            "missing here): run `torchrun --nproc-per-node N -m sparseswaps_prune.cli prune --distributed ...`, or "
            "drop --distributed"
        )
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        match_numba_threads()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout))
    _COLLECTIVES["timeout"] = timeout
    return Ranks.current()


def _store() -> Any:
    """The default group's rendezvous store, or None."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # a private helper: absent or failing in another torch, or no group
        return None


def _mark(rank: int) -> int:
    """Count a collective operation this rank enters and record the count in the store; returns it."""
    _COLLECTIVES["count"] += 1
    store = _store()
    if store is not None:
        try:
            store.set(_STORE_KEY.format(rank), str(_COLLECTIVES["count"]))
        except Exception:  # the store is only for the message; the collective itself will tell
            pass
    return _COLLECTIVES["count"]


def _counts(world_size: int, wait: float) -> dict[int, int | None] | None:
    """Each rank's count of collective operations entered, as the store holds them (None: never), read in a thread
    for at most ``wait`` seconds; None if the store does not answer (its server may be the stopped rank)."""
    store, found = _store(), {}

    def read() -> None:
        for r in range(world_size):
            key = _STORE_KEY.format(r)
            found[r] = int(store.get(key)) if store.check([key]) else None

    if store is None:
        return None
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(wait)
    return None if thread.is_alive() or len(found) < world_size else found


def _timed_out(ranks: Ranks, number: int, what: str, err: BaseException) -> CollectiveTimeout:
    """The error of collective operation ``number`` (``what``) timing out on this rank, naming who did not reach it."""
    timeout = _COLLECTIVES["timeout"]
    if timeout is None:
        store = _store()
        timeout = getattr(getattr(store, "timeout", None), "total_seconds", lambda: None)()
    limit = "the process group's timeout" if timeout is None else f"the collective timeout of {timeout:g} s"
    counts = _counts(ranks.world_size, 3.0) if ranks.group is None else None  # a store that answers does at once
    if ranks.group is not None:
        who = "which rank did not answer is not recorded for a process group other than the default one"
    elif counts is None:
        who = "which rank did not answer is unknown (the rendezvous store does not answer either"
        who += (
            ": rank 0 serves it unless torchrun's agent does, so rank 0 is likely the one stopped)"
            if ranks.rank
            else ")"
        )
    else:
        behind = [r for r, n in sorted(counts.items()) if r != ranks.rank and (n is None or n < number)]
        if behind:
            last = ", ".join(f"rank {r} at #{counts[r] or 0}" for r in behind)
            who = f"rank{'s' if len(behind) > 1 else ''} {', '.join(map(str, behind))} did not reach it ({last})"
        else:
            who = "every rank reached it (a network problem?)"
    return CollectiveTimeout(
        f"rank {ranks.rank}: {what} (collective operation #{number}) got no answer within {limit}: {who}. A rank "
        "that is stopped, hung or far slower than the others fails the run; re-run the same command to resume from "
        "the last finished block. If a rank needs longer between two collective operations (a large layer on the "
        f"CPU), raise --collective-timeout (collective_timeout{'' if timeout is None else f', now {timeout:g} s'}). "
        f"({' '.join(str(err).split())[:200]})"
    )


def _is_timeout(err: BaseException) -> bool:
    text = str(err).lower()
    return "timed out" in text or "timeout" in text


def match_numba_threads() -> int:
    """Limit numba's threads (the CPU swap search) to ``torch.get_num_threads()`` and return the count: several
    processes on one machine then share its cores as their torch threads do."""
    import numba

    threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(threads)
    return threads


# The default fewest rows of a row shard (plan_work; PruneOptions.row_shards=n sets it): smaller pieces are hardly
# worth a broadcast, and MKL multiplies a few rows by other kernels than many (a one-row product by matrix-vector),
# which round differently (see the module docstring).
MIN_SHARD_ROWS = 256


@dataclass(frozen=True)
class WorkUnit:
    """Rows ``start:stop`` of ``layers[layer]`` of a block, pruned by ``rank``."""

    layer: int
    start: int
    stop: int
    rank: int


def plan_work(
    layers: Sequence[PrunableLayer],
    world_size: int,
    split: Sequence[bool] | None = None,
    min_rows: int = MIN_SHARD_ROWS,
) -> list[WorkUnit]:
    """Divide the layers of a block among ``world_size`` ranks, whole or (where ``split[j]``) by contiguous row shards.

    The estimated cost of a row is ``d_in^2`` (a layer's swap search, re-fit and losses scale with ``d_out *
    d_in^2``). Whole layers go first, largest first, each to the least loaded rank (ties to the lowest rank); without
    ``split`` that is the whole plan. Then the splittable layers, in layer order, fill the
    ranks in rank order up to the water level ``T``, the least load that leaves room for all of them above the whole
    layers' loads (``ceil(total / world_size)`` when all layers may be split; McNaughton's wrap-around rule, in whole
    rows): a shard has at least ``min_rows`` rows, a rank with room for fewer is passed over, and rows left once every
    rank is full (rounding, or ``min_rows`` above the room left) go, ``min_rows`` or more at a time, to the least loaded
    rank.

    Deterministic, in integers: every rank computes the same plan from the layer shapes alone.

    Args:
        layers: the block's layers (``d_out``, ``d_in``).
        world_size: the number of ranks.
        split: per layer, whether its rows may be divided (None: no layer is).
        min_rows: the fewest rows of a shard (a layer with fewer than ``2 * min_rows`` rows stays whole).

    Returns:
        The units in layer order, and within a layer in row order; together they cover every row once.

    Raises:
        ValueError: ``world_size`` or ``min_rows`` below 1, or ``split`` not one flag per layer.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if min_rows < 1:
        raise ValueError(f"min_rows must be at least 1, got {min_rows}")
    split = [False] * len(layers) if split is None else list(split)
    if len(split) != len(layers):
        raise ValueError(f"split has {len(split)} flags for {len(layers)} layers")
    row_cost = [layer.d_in**2 for layer in layers]
    cost = [layer.d_out * c for layer, c in zip(layers, row_cost, strict=True)]
    load = [0] * world_size
    units: list[WorkUnit] = []
    for j in sorted((j for j in range(len(layers)) if not split[j]), key=lambda j: (-cost[j], j)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        units.append(WorkUnit(j, 0, layers[j].d_out, rank))
        load[rank] += cost[j]
    target = _water_level(load, sum(c for c, s in zip(cost, split, strict=True) if s))
    rank = 0
    for j in (j for j in range(len(layers)) if split[j]):
        start, d_out = 0, layers[j].d_out

        def room(r: int, j: int = j) -> int:  # the rows rank r can take before reaching the target (rounded)
            return (target - load[r] + row_cost[j] // 2) // row_cost[j]

        while start < d_out:
            left = d_out - start
            while rank < world_size and room(rank) < min(min_rows, left):
                rank += 1  # full, or room for less than a shard
            if rank < world_size:
                owner, rows = rank, min(left, room(rank))
            else:  # every rank is full (rounding, or min_rows above the room left): shards to the least loaded
                owner = min(range(world_size), key=lambda r: (load[r], r))
                rows = min(left, max(min_rows, room(owner)))
            if left - rows < min_rows:  # no shard below min_rows: take the rest, or leave min_rows, whichever is closer
                rows = left if left - rows <= rows - (left - min_rows) or left < 2 * min_rows else left - min_rows
            units.append(WorkUnit(j, start, start + rows, owner))
            load[owner] += rows * row_cost[j]
            start += rows
    return sorted(units, key=lambda u: (u.layer, u.start))


def _water_level(load: list[int], extra: int) -> int:
    """The least level ``T`` (an int) with ``sum(max(0, T - l) for l in load) >= extra``: filling the ranks up to it
    places ``extra`` more work with the smallest largest load."""
    low = sorted(load)
    for k in range(1, len(low) + 1):
        level = -(-(extra + sum(low[:k])) // k)
        if k == len(low) or level <= low[k]:
            return level
    raise AssertionError("unreachable")


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

    def _collective(self, what: str, call: Any) -> Any:
        """``call()``, a collective operation every rank makes, counted (in the store: :func:`_mark`); a timeout
        becomes :class:`CollectiveTimeout` naming the ranks that did not reach it."""
        number = _mark(self.rank) if self.group is None else 0
        try:
            return call()
        except RuntimeError as err:  # gloo: "Timed out waiting ... for recv operation to complete"
            if not _is_timeout(err):
                raise
            raise _timed_out(self, number, what, err) from err

    def broadcast(self, obj: Any, src: int) -> Any:
        """``obj`` from rank ``src`` on every rank (pickled; tensors keep their bits).

        Raises:
            CollectiveTimeout: some rank did not take part within the group's timeout (named)."""
        if self.world_size == 1:
            return obj
        box = [obj if self.rank == src else None]
        root = src if self.group is None else dist.get_global_rank(self.group, src)
        self._collective(f"a broadcast from rank {src}", lambda: dist.broadcast_object_list(box, root, self.group))
        return box[0]

    def broadcast_tensor(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Overwrite ``tensor`` (contiguous, same shape, dtype and device type on every rank) in place with rank
        ``src``'s bits; returns it.

        Raises:
            CollectiveTimeout: as :meth:`broadcast`."""
        if self.world_size > 1:
            root = src if self.group is None else dist.get_global_rank(self.group, src)
            self._collective(f"a tensor broadcast from rank {src}", lambda: dist.broadcast(tensor, root, self.group))
        return tensor

    def barrier(self) -> None:
        """Wait until every rank gets here.

        Raises:
            CollectiveTimeout: as :meth:`broadcast`."""
        if self.world_size > 1:
            self._collective("a barrier", lambda: dist.barrier(group=self.group))


@dataclass(frozen=True)
class WindowShards:
    """The split of ``n_windows`` windows (batches of ``batch_size``) into ``n_shards`` contiguous shards of whole
    batches, and of the shards among ``world_size`` ranks; every rank computes the same split.

    Shard ``s`` is batches ``starts[s]:starts[s + 1]`` with ``starts[s] = s * num_batches // n_shards`` (as equal as
    whole batches allow; only the last batch may be short, as without shards). With one shard every rank holds it
    (nothing is split); with more, shard ``s`` belongs to rank ``s * world_size // n_shards``, so each rank owns a
    contiguous run of at least one shard.

    Attributes:
        n_windows, batch_size: the windows and the batch size they are forwarded in.
        n_shards: ``PruneOptions.calib_shards``.
        world_size, rank: this process's place (1 and 0 without ranks).
        what: the windows' name in error messages (``"calibration"``, ``"held-out"``).

    Raises:
        ValueError: ``n_shards`` is not a positive int, there are fewer batches than shards, or more than one shard
            but fewer shards than ranks; the message names ``calib_shards`` and the fix.
    """

    n_windows: int
    batch_size: int
    n_shards: int = 1
    world_size: int = 1
    rank: int = 0
    what: str = "calibration"

    def __post_init__(self) -> None:
        if isinstance(self.n_shards, bool) or not isinstance(self.n_shards, int) or self.n_shards < 1:
            raise ValueError(f"calib_shards must be a positive int, got {self.n_shards!r}")
        if self.num_batches < self.n_shards:
            raise ValueError(
                f"calib_shards={self.n_shards} splits the {self.what} windows into shards of whole batches, but "
                f"{self.n_windows} windows in batches of {self.batch_size} make only {self.num_batches} batches; use "
                f"calib_shards <= {self.num_batches}, more {self.what} windows or a smaller batch size"
            )
        if 1 < self.n_shards < self.world_size:
            raise ValueError(
                f"calib_shards={self.n_shards} is fewer than the {self.world_size} ranks, and every rank must own a "
                f"whole shard; use calib_shards >= {self.world_size} (ideally a multiple of it), or calib_shards=1 "
                "(every rank forwards every window)"
            )

    @property
    def num_batches(self) -> int:
        """Batches of all shards together, ``ceil(n_windows / batch_size)``."""
        return -(-self.n_windows // self.batch_size)

    @property
    def starts(self) -> list[int]:
        """``n_shards + 1`` batch indices: shard ``s`` is batches ``starts[s]:starts[s + 1]``."""
        return [s * self.num_batches // self.n_shards for s in range(self.n_shards + 1)]

    @property
    def owners(self) -> list[int | None]:
        """The rank that owns each shard (None: one shard, held by every rank)."""
        if self.n_shards == 1:
            return [None]
        return [s * self.world_size // self.n_shards for s in range(self.n_shards)]

    @property
    def own(self) -> list[int]:
        """The shards this rank holds, in order (contiguous)."""
        return [s for s, owner in enumerate(self.owners) if owner is None or owner == self.rank]

    @property
    def rows(self) -> slice:
        """The windows (rows of ``[n_windows, seqlen]``) this rank holds."""
        own, starts = self.own, self.starts
        return slice(starts[own[0]] * self.batch_size, min(starts[own[-1] + 1] * self.batch_size, self.n_windows))

    def local_batches(self, shard: int) -> range:
        """The batches of ``shard`` (one this rank owns) among this rank's own batches."""
        starts, first = self.starts, self.starts[self.own[0]]
        return range(starts[shard] - first, starts[shard + 1] - first)


def sum_shard_grams(
    partials: dict[int, dict[str, GramAccumulator]],
    shards: WindowShards,
    ranks: Ranks | None,
    device: torch.device,
) -> dict[str, GramAccumulator]:
    """The sum of every shard's partial Grams in shard order, ``((P_0 + P_1) + P_2) + ...``: the same bits on every
    rank and with any number of ranks.

    With ranks and more than one shard, the shards are taken in order and each is broadcast from its owner (its
    counts first, then each Gram and feature sum as a tensor, one at a time), so a rank holds its own partials,
    the running sums and one received tensor.

    Args:
        partials: ``partials[s][name]``, for each shard ``s`` this rank owns, the accumulator of each distinct
            layer input ``name`` (the same names on every rank). Consumed: the first shard's accumulators become the
            sums and are modified in place.
        shards: the split (:class:`WindowShards`) the partials were accumulated on.
        ranks: the process group, or None for one process.
        device: where received Grams are put (the compute device; for ``nccl`` the rank's GPU).

    Returns:
        ``{name: GramAccumulator}`` holding the sums (Gram, feature sum, token and sequence counts).
    """
    total: dict[str, GramAccumulator] | None = None
    exchange = ranks is not None and ranks.world_size > 1 and shards.n_shards > 1
    for shard, owner in enumerate(shards.owners):
        partial = partials.pop(shard, None)
        if exchange:
            partial = _broadcast_partial(partial, owner, ranks, device)
        if total is None:
            total = partial
        else:
            for name, acc in total.items():
                acc.merge(partial[name])
        del partial
    return total


def _broadcast_partial(
    partial: dict[str, GramAccumulator] | None, src: int, ranks: Ranks, device: torch.device
) -> dict[str, GramAccumulator]:
    """Rank ``src``'s accumulators on every rank: the counts by one object broadcast, then the tensors one by one
    (exact copies). On the other ranks, the accumulators are new and their tensors on ``device``."""
    mine = ranks.rank == src
    meta = None
    if mine:
        meta = {
            name: (acc.d_in, acc.dtype, acc.track_sum, acc.n_tokens, acc.n_sequences, acc.gram is not None)
            for name, acc in partial.items()
        }
    meta = ranks.broadcast(meta, src=src)
    out = {}
    for name, (d_in, dtype, track_sum, n_tokens, n_sequences, has_gram) in meta.items():
        acc = partial[name] if mine else GramAccumulator(d_in, dtype=dtype, track_sum=track_sum)
        if has_gram:
            if not mine:
                acc.gram = torch.empty(d_in, d_in, dtype=dtype, device=device)
                acc.feature_sum = torch.empty(d_in, dtype=dtype, device=device) if track_sum else None
            ranks.broadcast_tensor(acc.gram, src)
            if track_sum:
                ranks.broadcast_tensor(acc.feature_sum, src)
        acc.n_tokens, acc.n_sequences = n_tokens, n_sequences
        out[name] = acc
    return out
