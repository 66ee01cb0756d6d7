"""SparseSwaps refinement (Algorithm 1 of arXiv 2512.10922): one iteration loop for every objective and scope.

Every iteration each row offers its *figures* -- its best in-row 1-swap (prune a kept ``u``, restore a pruned
``p``) and, when rows may trade weights, its cheapest removal and its best restore -- read off a float64 *row
model*; a *planner* picks the moves; the model applies them in place (:func:`iterate`). Only rows that moved get new
figures, and the state of moved rows is rebuilt from scratch every ``resync_every`` iterations.

Row models (one per objective):

* :class:`MaskRows`, the mask objective ``L = r^T G r``, ``r = (1 - m) * w``: the keep mask and the float64
  correlation ``c = G r``, updated by ``c += w_u G[:, u] - w_p G[:, p]``. The best swap is searched in the compute
  dtype (float32 by default) on a backend (:mod:`~sparseswaps_prune.core.backends`), then its ``dL`` is re-evaluated
  in float64 (:func:`~sparseswaps_prune.core.losses.swap_delta`), so an accepted swap never raises the float64 loss.
* :class:`RefitRows`, the re-fit objective (the damped loss after re-fitting the kept weights): a float64 state and
  its exact rank-one updates behind one engine contract
  (:class:`~sparseswaps_prune.core.backends.refit_engine.RefitEngine`): the torch reference
  :class:`~sparseswaps_prune.core.backends.refit_engine.TorchRefitEngine` (``engine="torch"``, any device), the
  compiled CPU engine :class:`~sparseswaps_prune.core.backends.refit_numba.NumbaRefitState` (``engine="numba"``: the
  state with lazy low-rank updates, restore vectors from the Gram and a pair scan that skips pruned inputs by an exact
  bound), or on CUDA that lazy state with its scan and moves in Triton kernels (``engine="triton"``,
  :class:`~sparseswaps_prune.core.backends.refit_lazy_triton.TritonRefitState`).

Planners (one per scope):

* :class:`RowPlanner`, ``scope="row"`` (every row keeps its count): every live row whose best swap lowers its loss
  by more than its floor applies it; a row that does not retires (nothing in it changes any more). Rows are
  independent, so the loop runs per row batch and memory is bounded by ``row_batch``.
* :class:`LayerPlanner`, ``scope="layer"`` (only the layer's count is kept): the best combination of in-row swaps and
  cross-row moves, :func:`~sparseswaps_prune.core.layer_moves.plan_moves`, over all rows of the layer at once.

A move must lower the loss by more than ``eps`` plus the model's rounding floor: 0 for the mask objective (exact
float64 ``dL``), ``ACCEPT_RTOL * w^T G w`` for the re-fit objective (per row with the row scope; the layer's largest
with the layer scope, whose moves compare rows).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import numpy as np
import torch

from sparseswaps_prune.core import refit_swaps as rs
from sparseswaps_prune.core.backends import best_swaps, refit_engine_class, resolve_backend, resolve_refit_backend
from sparseswaps_prune.core.checks import (
    check_budget,
    check_device,
    check_gram,
    check_int,
    check_mask,
    check_number,
    check_weight,
)
from sparseswaps_prune.core.layer_moves import MovePlan, plan_moves
from sparseswaps_prune.core.losses import correlation, swap_delta, weight_losses_unchecked
from sparseswaps_prune.core.refit import REFIT_RIDGE, RIDGE_DAMPS, RIDGES, damping

OBJECTIVES = ("mask", "refit")
SWAP_ITERS = 25
"""SparseSwaps' default iteration count T (of :func:`refine_mask` and the swap stage): about 89% of the converged
loss reduction on the default model (RESULTS.md, "SparseSwaps vs Wanda")."""
RESYNC_EVERY = 32
"""Rebuild the float64 state of the rows that moved every this many iterations (default of :func:`refine_mask`)."""
SCOPES = ("row", "layer")

# Rows per batch of the mask objective when the caller gives none: bounds the [rows, d_in] working set to ~64 MiB
# per tensor (the re-fit objective bounds its state Z instead, refit_swaps.REFIT_ELEMENTS).
ROW_BATCH_ELEMENTS = 1 << 24
# objective="refit" with scope="layer" keeps every row's state (H and Z, float64) at once; refuse above this.
LAYER_STATE_BYTES = 8 << 30


@dataclass
class RefineResult:
    """Outcome of :func:`refine_mask` (tensors on the CPU unless stated otherwise).

    Attributes:
        mask: ``[d_out, d_in]`` bool refined mask (True = kept), on ``keep_mask``'s device.
        loss_before: ``[d_out]`` float64 mask loss ``r^T G r`` (original weights, pruned weights zeroed:
            ``row_losses(weight, gram, keep_mask)``) of the input mask, whatever the objective.
        loss_after: ``[d_out]`` float64 mask loss of ``mask``. With ``objective="mask"`` never above
            ``loss_before``; with ``objective="refit"`` it may rise (that search minimises the re-fit loss).
        n_swaps: ``[d_out]`` int64 number of moves each row took part in: in-row swaps, and with ``scope="layer"``
            also cross-row moves (counted once in the donor row and once in the receiver row).
        iters: number of iterations that applied at least one move (at most ``max_iters``; with
            ``scope="row"`` this is ``n_swaps.max()``).
        weight: for ``objective="refit"``, the ``[d_out, d_in]`` re-fitted weights of ``mask`` (weight's dtype and
            device, exactly zero where ``mask`` is False); None for ``objective="mask"``.
        refit_loss_before: for ``objective="refit"``, ``[d_out]`` float64 undamped loss ``(w - v)^T G (w - v)`` of
            the re-fitted weights ``v = refit_weights(weight, gram, keep_mask, damp=damp)`` of the input mask; None
            for ``objective="mask"``.
        refit_loss_after: the same for ``mask`` (its re-fitted weights are ``weight``). The search minimises the
            damped objective (``refit_objective``), so with ``damp > 0`` a row's undamped loss may in rare cases
            rise slightly.
    """

    mask: torch.Tensor
    loss_before: torch.Tensor
    loss_after: torch.Tensor
    n_swaps: torch.Tensor
    iters: int
    weight: torch.Tensor | None = None
    refit_loss_before: torch.Tensor | None = None
    refit_loss_after: torch.Tensor | None = None

    @property
    def relative_reduction(self) -> float:
        """``1 - sum(loss_after) / sum(loss_before)``, of the mask loss (0 when the input mask had no loss)."""
        before = float(self.loss_before.sum())
        return 0.0 if before <= 0 else 1.0 - float(self.loss_after.sum()) / before


@dataclass
class Figures:
    """Per-row move figures of ``N`` rows of a row model, on the CPU: float64 values (``+inf`` where a row has no
    such move) and int64 handles (the model's positions: input indices for :class:`MaskRows`, slots for
    :class:`RefitRows`).

    Attributes:
        swap_dl, swap_a, swap_b: ``[N]`` the best in-row swap's exact ``dL`` and its kept and pruned handles.
        remove, remove_a: ``[N]`` the cheapest removal's ``dL`` and its kept handle (None unless cross-row moves
            are planned).
        add, add_b: ``[N]`` the best restore's ``dL`` and its pruned handle (None likewise).
    """

    swap_dl: torch.Tensor
    swap_a: torch.Tensor
    swap_b: torch.Tensor
    remove: torch.Tensor | None = None
    remove_a: torch.Tensor | None = None
    add: torch.Tensor | None = None
    add_b: torch.Tensor | None = None

    @classmethod
    def cat(cls, parts: list[Figures]) -> Figures:
        """The figures of consecutive row chunks, concatenated."""
        if len(parts) == 1:
            return parts[0]
        return cls(*(
            None if getattr(parts[0], f.name) is None else torch.cat([getattr(p, f.name) for p in parts])
            for f in fields(cls)
        ))  # fmt: skip

    @classmethod
    def on_host(cls, values: list[torch.Tensor]) -> Figures:
        """The figures ``values`` (``[n]`` float64 values and int64 handles on any device, in field order) copied to
        the CPU in one transfer (the float64 bits travel as int64): one synchronisation per call, not one per
        field."""
        packed = torch.stack([t.view(torch.int64) if t.is_floating_point() else t for t in values]).cpu()
        return cls(*(row.view(t.dtype) for row, t in zip(packed, values, strict=True)))

    def update(self, rows: torch.Tensor, other: Figures) -> None:
        """Overwrite the figures of ``rows`` (``[n]`` int64, CPU) with ``other`` (in that order), in place."""
        for f in fields(self):
            mine = getattr(self, f.name)
            if mine is not None:
                mine[rows] = getattr(other, f.name)


Moves = tuple[torch.Tensor, ...]


class MaskRows:
    """Mask-objective row model of ``N`` rows: the keep mask and float64 ``c = G r`` (handles = input indices).

    Attributes:
        keep: ``[N, d]`` bool mask, updated in place.
        corr: ``[N, d]`` float64 ``c = G r`` of ``keep``.
        rounding: ``[N]`` float64 CPU zeros: the float64 ``dL`` is exact, no rounding floor.
        fitted_before: None (no re-fitted weights under this objective).
    """

    def __init__(
        self,
        w64: torch.Tensor,
        keep: torch.Tensor,
        gram64: torch.Tensor,
        gram_search: torch.Tensor,
        *,
        search: str,
        nm: tuple[int, int] | None,
        row_batch: int,
    ) -> None:
        """Build ``c`` from scratch.

        Args:
            w64: ``[N, d]`` float64 weights; gram64: ``[d, d]`` float64 Gram matrix (neither modified).
            keep: ``[N, d]`` bool mask (True = kept), updated in place by :meth:`apply`.
            gram_search: ``gram64`` in the search dtype (float32 or float64; not modified).
            search, nm: the swap-search backend (from ``resolve_backend``) and the N:M pattern (or None).
            row_batch: rows per rebuild of ``c`` and per search call.
        """
        self.w64, self.keep, self.gram64, self.gram_search = w64, keep, gram64, gram_search
        self.w_search = w64.to(gram_search.dtype)
        self.search, self.nm, self.row_batch = search, nm, row_batch
        self.rounding = torch.zeros(w64.shape[0], dtype=torch.float64)
        self.fitted_before = None
        self.corr = torch.empty_like(w64)
        self.resync(torch.arange(w64.shape[0], device=w64.device))

    def resync(self, rows: torch.Tensor) -> None:
        """Rebuild ``c`` of ``rows`` (``[n]`` int64) from scratch, in place."""
        for r0 in range(0, rows.numel(), self.row_batch):
            sub = rows[r0 : r0 + self.row_batch]
            self.corr[sub] = correlation(self.w64[sub], self.gram64, self.keep[sub])

    def figures(self, rows: torch.Tensor, cross: bool) -> Figures:
        """Best swap (searched, then re-evaluated in float64) of every row in ``rows`` (``[n]`` int64, ``n >= 1``);
        with ``cross`` also the cheapest removal and the best restore."""
        return Figures.cat([
            self._figures(rows[r0 : r0 + self.row_batch], cross) for r0 in range(0, rows.numel(), self.row_batch)
        ])  # fmt: skip

    def _figures(self, rows: torch.Tensor, cross: bool) -> Figures:
        w, keep, corr = self.w64[rows], self.keep[rows], self.corr[rows]
        u, p, _ = best_swaps(
            self.search, self.w_search[rows], keep, corr.to(self.gram_search.dtype), self.gram_search, self.nm
        )
        u, p = u.to(w.device), p.to(w.device)
        ar = torch.arange(rows.numel(), device=w.device)
        feasible = keep[ar, u] & ~keep[ar, p] & (w[ar, p] != 0)
        out = [torch.where(feasible, swap_delta(w, corr, u, p, self.gram64), float("inf")), u, p]
        if cross:
            own = w * w * torch.diagonal(self.gram64)
            remove = torch.where(keep, 2 * w * corr + own, float("inf"))
            add = torch.where(~keep & (w != 0), own - 2 * w * corr, float("inf"))
            out += [*remove.min(dim=1), *add.min(dim=1)]  # first index on ties: the smallest u, p
        return Figures.on_host(out)

    def apply(self, swaps: Moves, cross: Moves | None = None) -> None:
        """Apply ``swaps = (rows, u, p)`` and ``cross = (donor rows, u, receiver rows, p)``, in place."""
        rows, u, p = swaps
        self.keep[rows, u] = False
        self.keep[rows, p] = True
        self.corr[rows] += self.w64[rows, u, None] * self.gram64[u] - self.w64[rows, p, None] * self.gram64[p]
        if cross is not None:
            donors, u, receivers, p = cross
            self.keep[donors, u] = False
            self.corr[donors] += self.w64[donors, u, None] * self.gram64[u]
            self.keep[receivers, p] = True
            self.corr[receivers] -= self.w64[receivers, p, None] * self.gram64[p]

    def fitted(self) -> None:
        """No re-fitted weights under the mask objective."""
        return None


class RefitRows:
    """Re-fit-objective row model of ``N`` rows: the float64 state of one re-fit engine (the contract
    :class:`~sparseswaps_prune.core.backends.refit_engine.RefitEngine`, chosen once by name:
    :func:`~sparseswaps_prune.core.backends.refit_engine_class`); handles = slots. The engines choose the same swaps
    (the float64 argmin, ties to the smallest input indices).

    Attributes:
        keep: ``[N, d]`` bool mask, updated in place.
        state: the engine holding the float64 state of ``keep``.
        rounding: ``[N]`` float64 rounding floor of the state, ``ACCEPT_RTOL * w^T G w`` (on ``w64``'s device).
        fitted_before: ``[N, d]`` float64 re-fitted weights of the input mask.
    """

    def __init__(
        self,
        w64: torch.Tensor,
        keep: torch.Tensor,
        gram64: torch.Tensor,
        *,
        lam: float,
        m: int | None,
        row_batch: int,
        cross: bool,
        row_index: torch.Tensor | None = None,
        engine: str = "torch",
    ) -> None:
        """Build the state from scratch (Cholesky, in row batches).

        Args:
            w64: ``[N, d]`` float64 weights; gram64: ``[d, d]`` float64 Gram matrix (neither modified).
            keep: ``[N, d]`` bool mask (True = kept), updated in place by :meth:`apply`.
            lam: absolute damping ``lambda``; m: N:M block size (swaps stay in blocks of ``m``), or None.
            row_batch: rows per Cholesky rebuild.
            cross: rows will trade weights (layer scope): every row gets a spare kept and pruned slot (more are
                added when needed), and the whole state must fit in ``LAYER_STATE_BYTES``.
            row_index: ``[N]`` int64 layer indices of the rows, for error messages (default ``0 .. N - 1``).
            engine: ``"torch"`` (the reference, any device), ``"numba"`` (compiled, CPU tensors only) or
                ``"triton"`` (the lazy state's Triton kernels: CUDA tensors, or CPU ones in the Triton interpreter),
                as ``backends.resolve_refit_backend`` names them.

        Raises:
            ValueError: a singular ``G_SS + lambda I`` (names the rows), or (``cross``) a state over
                ``LAYER_STATE_BYTES``.
        """
        rows, d = keep.shape
        counts = keep.sum(dim=1)
        self.engine = refit_engine_class(engine)
        self.k_slots = self.engine.slot_count(min(d, int(counts.max()) + int(cross)), d)
        self.q_slots = self.engine.slot_count(min(d, int((d - counts).max()) + int(cross)), d)
        need = rows * (self.k_slots**2 + self.k_slots * self.q_slots) * 8
        if cross and need > LAYER_STATE_BYTES:
            raise ValueError(
                f"objective='refit' with scope='layer' keeps every row's re-fit state at once: about "
                f"{need / 2**30:.1f} GiB for this [{rows}, {d}] layer, over the {LAYER_STATE_BYTES / 2**30:.0f} GiB "
                "limit (refine.LAYER_STATE_BYTES); use scope='row' (memory bounded by row_batch) or objective='mask'"
            )
        self.w64, self.keep = w64, keep
        self.row_index = (torch.arange(rows) if row_index is None else row_index.cpu()).to(w64.device)
        self.pivot_floor = rs.pivot_floor(gram64, lam)
        self.rounding = rs.ACCEPT_RTOL * ((w64 @ gram64) * w64).sum(dim=1)
        self.state = self.engine(
            w64, keep, gram64, lam, self.k_slots, self.q_slots, m, row_offset=self.row_index, row_batch=row_batch
        )
        self.fitted_before = self.fitted()

    def resync(self, rows: torch.Tensor) -> None:
        """Rebuild the state of ``rows`` (``[n]`` int64) from scratch (Cholesky), in place."""
        self.state.build(rows, row_offset=self.row_index[rows])

    def figures(self, rows: torch.Tensor, cross: bool) -> Figures:
        """Best swap of every row in ``rows`` (``[n]`` int64); with ``cross`` also the cheapest removal and the best
        restore (handles are slots)."""
        out = list(self.state.scan(rows))
        if cross:
            out += [
                *rs.best_removals(self.state, rows),
                *rs.best_additions(self.state, self.w64, rows, self.pivot_floor),
            ]
        return Figures.on_host(out)

    def _reserve(self, donors: torch.Tensor, receivers: torch.Tensor) -> None:
        """Add vacant slots when a donor has no vacant pruned slot or a receiver no vacant kept slot."""
        d = self.w64.shape[1]
        k_full = bool((self.state.kept_ok[receivers].all(dim=1)).any())
        q_full = bool((self.state.pruned_ok[donors].all(dim=1)).any())
        if k_full or q_full:
            k_slots = min(d, self.k_slots + (max(1, self.k_slots // 16) if k_full else 0))
            q_slots = min(d, self.q_slots + (max(1, self.q_slots // 16) if q_full else 0))
            self.k_slots, self.q_slots = self.engine.slot_count(k_slots, d), self.engine.slot_count(q_slots, d)
            self.state.grow(self.k_slots, self.q_slots)

    def apply(self, swaps: Moves, cross: Moves | None = None) -> None:
        """Apply ``swaps = (rows, kept slot, pruned slot)`` and ``cross = (donor rows, kept slot, receiver rows,
        pruned slot)``, in place."""
        if cross is not None:
            self._reserve(cross[0], cross[2])
        rows, slot_i, slot_j = swaps
        u, p = self.state.swap(rows, slot_i, slot_j)
        self.keep[rows, u] = False
        self.keep[rows, p] = True
        if cross is None:
            return
        rows, slot_i, receivers, slot_j = cross
        vacant = (~self.state.pruned_ok[rows]).to(torch.int8).argmax(dim=1)
        u = self.state.remove(rows, slot_i, vacant)
        self.keep[rows, u] = False
        vacant = (~self.state.kept_ok[receivers]).to(torch.int8).argmax(dim=1)
        p = self.state.add(receivers, slot_j, vacant)
        self.keep[receivers, p] = True

    def fitted(self) -> torch.Tensor:
        """``[N, d]`` float64 re-fitted weights of the current masks (zero off the mask)."""
        return self.state.fitted()


class RowPlanner:
    """``scope="row"``: every live row whose best swap lowers its loss by more than its floor applies it; the other
    rows retire. The state of moved rows is rebuilt before the search of every ``resync_every``-th iteration."""

    cross = False
    retires = True

    def __init__(self, floor: torch.Tensor) -> None:
        """``floor``: ``[N]`` float64 CPU, the decrease each row's swap must exceed."""
        self.floor = floor

    def plan(self, figures: Figures, live: torch.Tensor) -> MovePlan:
        """Moves of one iteration from ``figures`` of the ``live`` rows (``[N]`` bool)."""
        rows = torch.nonzero(live & (figures.swap_dl < -self.floor)).flatten().numpy()
        none = np.zeros(0, dtype=np.int64)
        return MovePlan(rows, none, none)

    @staticmethod
    def rebuild_after(it: int, resync_every: int, max_iters: int) -> bool:
        """Rebuild the moved rows' state after iteration ``it``: before the search of iteration ``it + 1``."""
        return it < max_iters and (it + 1) % resync_every == 0


class LayerPlanner:
    """``scope="layer"``: :func:`~sparseswaps_prune.core.layer_moves.plan_moves` over all rows (none retire). The
    state of moved rows is rebuilt after the moves of every ``resync_every``-th iteration."""

    cross = True
    retires = False

    def __init__(self, floor: float) -> None:
        """``floor``: the decrease every move must exceed."""
        self.floor = floor

    def plan(self, figures: Figures, live: torch.Tensor) -> MovePlan:
        """Moves of one iteration from ``figures`` (every row is live)."""
        return plan_moves(figures.swap_dl.numpy(), figures.remove.numpy(), figures.add.numpy(), self.floor)

    @staticmethod
    def rebuild_after(it: int, resync_every: int, max_iters: int) -> bool:
        """Rebuild the moved rows' state after the moves of iteration ``it``."""
        return it % resync_every == 0


def iterate(
    model: MaskRows | RefitRows, planner: RowPlanner | LayerPlanner, *, max_iters: int, resync_every: int
) -> tuple[torch.Tensor, int]:
    """The refinement loop: apply ``planner``'s moves to ``model`` (updated in place) until it plans none or
    ``max_iters`` iterations.

    Returns:
        ``[N]`` int64 CPU move counts per row (a cross-row move counts once in each of its two rows) and the number of
        iterations that applied at least one move.
    """
    n_rows = model.keep.shape[0]
    device = model.keep.device
    n_moves = torch.zeros(n_rows, dtype=torch.long)
    if max_iters == 0:
        return n_moves, 0
    figures = model.figures(torch.arange(n_rows, device=device), planner.cross)
    live = torch.ones(n_rows, dtype=torch.bool)
    dirty = torch.zeros(n_rows, dtype=torch.bool)  # moved since its state was last built
    iters = 0
    for it in range(1, max_iters + 1):
        plan = planner.plan(figures, live)
        if plan.empty:
            break
        iters += 1
        changed = swaps = torch.from_numpy(plan.swap_rows)
        cross = None
        if plan.donor_rows.size:
            donors, receivers = torch.from_numpy(plan.donor_rows), torch.from_numpy(plan.receiver_rows)
            cross = _to_device([donors, figures.remove_a[donors], receivers, figures.add_b[receivers]], device)
            changed = torch.cat([swaps, donors, receivers])
        rebuild = planner.rebuild_after(it, resync_every, max_iters)
        moves = _to_device([swaps, figures.swap_a[swaps], figures.swap_b[swaps]], device)
        model.apply(moves, cross)
        n_moves[changed] += 1
        dirty[changed] = True
        if planner.retires:
            live[:] = False
            live[changed] = True
        refresh = changed
        if rebuild:
            refresh = torch.nonzero(dirty & live).flatten()
            model.resync(refresh.to(device))
            dirty[refresh] = False
        if it < max_iters:
            figures.update(refresh, model.figures(refresh.to(device), planner.cross))
    return n_moves, iters


def _to_device(handles: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, ...]:
    """``[n]`` int64 CPU tensors on ``device`` in one host-to-device copy (views of one ``[len(handles), n]``
    tensor)."""
    return torch.stack(handles).to(device).unbind(0)


def check_nm_mask(keep_mask: torch.Tensor, nm: tuple[int, int]) -> None:
    """Raise unless every block of ``m`` consecutive inputs in every row keeps exactly ``n``."""
    n, m = nm
    counts = keep_mask.reshape(keep_mask.shape[0], -1, m).sum(dim=-1)
    if not bool((counts == n).all()):
        raise ValueError(
            f"keep_mask does not follow the {n}:{m} pattern (blocks keep between {int(counts.min())} and "
            f"{int(counts.max())} weights); build it with warmstart_mask(..., nm=({n}, {m}))"
        )


def refine_mask(
    weight: torch.Tensor,
    gram: torch.Tensor,
    keep_mask: torch.Tensor,
    *,
    max_iters: int = SWAP_ITERS,
    nm: tuple[int, int] | None = None,
    eps: float = 0.0,
    row_batch: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    backend: str = "auto",
    resync_every: int = RESYNC_EVERY,
    objective: Literal["mask", "refit"] = "mask",
    damp: float | None = None,
    ridge: str = REFIT_RIDGE,
    scope: Literal["row", "layer"] = "row",
) -> RefineResult:
    """Refine a pruning mask by exact, loss-decreasing 1-swaps.

    Args:
        weight: ``[d_out, d_in]`` float tensor (not modified).
        gram: ``[d_in, d_in]`` Gram matrix ``sum_t x_t x_t^T`` of the layer inputs (not modified).
        keep_mask: ``[d_out, d_in]`` bool warmstart mask, True = kept, from any source (per-row or per-layer
            threshold, SparseGPT, ...: rows may keep different counts; not modified).
        max_iters: at most this many iterations, each applying at most one move per row (``T_max``); 0 returns
            the input mask.
        nm: ``(n, m)``: swaps stay inside blocks of ``m`` consecutive inputs; ``keep_mask`` must follow
            the pattern. Not with ``scope="layer"``.
        eps: a move is applied only if it lowers the loss by more than ``eps``; a row stops once its best
            ``dL`` is not below ``-eps``.
        row_batch: rows refined together (bounds memory); default fits ~64 MiB per ``[rows, d_in]``, and for
            ``objective="refit"`` 128 MiB per float64 ``[rows, k, d_in - k]`` (the state ``Z``; on CUDA 1/32 of the
            device's memory). With ``scope="layer"`` all rows are refined together and ``row_batch`` batches the
            searches and rebuilds.
        device: where to compute (default: the weight's device).
        dtype: search dtype of the mask objective, ``torch.float32`` (fast) or ``torch.float64``; the re-fit
            objective always runs in float64.
        backend: swap search of the mask objective: ``"auto"`` (compiled numba kernel on CPU, fused Triton kernel
            on CUDA when triton is installed, torch elsewhere), ``"torch"``, ``"numba"`` or ``"triton"``. The
            re-fit objective: ``"auto"`` and ``"numba"`` run its compiled CPU engine
            (:mod:`~sparseswaps_prune.core.backends.refit_numba`) on the CPU, ``"auto"`` (when triton is installed)
            and ``"triton"`` on CUDA its lazy state with Triton kernels
            (:mod:`~sparseswaps_prune.core.backends.refit_lazy_triton`), ``"torch"`` (and ``"auto"`` elsewhere) its
            torch reference; all choose the same swaps.
        resync_every: rebuild the float64 state (correlation vectors; for the re-fit objective ``H``, ``v``, ``Z``,
            by Cholesky) of the rows that moved from scratch every this many iterations.
        objective: ``"mask"``: minimise the loss of the mask with the original weights, ``r^T G r``.
            ``"refit"``: minimise the loss after re-fitting the kept weights, the damped objective
            ``min_v (w - v)^T G (w - v) + lambda ||v||^2`` (see ``refit_objective``); the re-fitted weights are
            returned in ``RefineResult.weight``.
        damp: re-fit damping, relative as in ``refit_weights`` (``objective="refit"`` only; 0 needs every ``G_SS``
            positive definite; None: the ridge's default, ``RIDGE_DAMPS[ridge]``: 0.1 for ``"diag"``, 1e-3 for
            ``"mean"``).
        ridge: the re-fit's ridge, as ``refit_weights``: ``"mean"``: ``lambda = damp * mean(diag G)`` (shrinking
            towards zero); ``"diag"``: least squares on ``G + damp * diag(G)`` (shrinking towards the dense weights;
            the swaps are exact on that damped Gram). Every reported loss is on ``G`` itself.
        scope: ``"row"``: every row keeps its count (swaps within rows). ``"layer"``: only the layer's total count
            is kept; moves may also prune a weight in one row and restore one in another (each iteration applies
            the best combination of moves with every row in at most one; see ``core/layer_moves.py``). With
            ``objective="refit"`` the state of all rows is held at once (``LAYER_STATE_BYTES``).

    Returns:
        :class:`RefineResult`: the refined mask (on ``keep_mask``'s device), the mask losses of the input and refined
        masks and, for ``objective="refit"``, the re-fitted weights and their losses.

    Raises:
        ValueError / TypeError: bad shapes, NaN, an empty Gram, a mask off its N:M pattern, an unknown
            ``objective`` / ``scope`` / ``backend``, ``nm`` with ``scope="layer"``, a bad number (``max_iters``,
            ``eps``, ``damp``, ``resync_every``, ``row_batch``), or (``objective="refit"``) a singular
            ``G_SS + lambda I`` (names the rows; raise ``damp``). Raised before any work is done, except the
            singular case, found while factorising.

    Example:
        >>> mask = warmstart_mask(w, "wanda", sparsity=0.6, gram=g)
        >>> res = refine_mask(w, g, mask)  # T = SWAP_ITERS = 25
        >>> res.loss_after.sum() <= res.loss_before.sum()
        True
    """
    check_weight(weight)
    d_out, d_in = weight.shape
    check_gram(gram, d_in)
    check_mask(keep_mask, weight)
    if nm is not None:
        check_budget(None, nm, d_in)
        check_nm_mask(keep_mask, nm)
    check_int(max_iters, "max_iters", low=0)
    check_number(eps, "eps", low=0)
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be 'mask' or 'refit', got {objective!r}")
    if scope not in SCOPES:
        raise ValueError(f"scope must be 'row' or 'layer', got {scope!r}")
    if scope == "layer" and nm is not None:
        raise ValueError(
            f"nm={tuple(nm)} fixes the count of every block of every row, so there is no layer budget to move; "
            "use scope='row' with nm, or scope='layer' without nm"
        )
    if ridge not in RIDGES:
        raise ValueError(f"ridge must be 'mean' or 'diag', got {ridge!r}")
    damp = RIDGE_DAMPS[ridge] if damp is None else damp
    check_number(damp, "damp", low=0)
    check_int(resync_every, "resync_every", low=1)
    if row_batch is not None:
        check_int(row_batch, "row_batch", low=1)
    compute = check_device(device) if device is not None else weight.device
    search = resolve_backend(backend, compute, nm)
    engine = resolve_refit_backend(backend, compute) if objective == "refit" else None

    gram64 = gram.detach().to(device=compute, dtype=torch.float64)
    refit = objective == "refit"
    if refit:
        # ridge "diag" is plain least squares on the damped Gram G + damp diag(G): the search runs on it, undamped
        if ridge == "diag":
            gram_fit, lam = gram64 + torch.diag(damping(gram64, damp, ridge)), 0.0
        else:
            gram_fit, lam = gram64, damping(gram64, damp, ridge)
        fitted_before = torch.zeros(d_out, d_in, dtype=torch.float64, device=compute)
        fitted = torch.zeros_like(fitted_before)
    else:
        gram_search = gram64.to(dtype)
    batch = row_batch or _default_row_batch(keep_mask, refit, spare=int(scope == "layer"), device=compute)
    mask = keep_mask.detach().clone()
    n_swaps = torch.zeros(d_out, dtype=torch.long)
    iters = 0
    # The row scope runs the loop per row batch (rows are independent); the layer scope on all rows at once. The
    # re-fit state of a batch is padded to its largest kept and pruned counts, so rows are batched in descending
    # order of their kept counts (stable: per-row masks keep their order): with per-layer masks (ADMM, ALPS,
    # --scope layer) the counts vary widely, and padding every batch to the extremes costs up to several times more.
    step = batch if scope == "row" else max(1, d_out)
    order = torch.arange(d_out)
    if refit and scope == "row":
        order = torch.sort(keep_mask.sum(dim=1).cpu(), descending=True, stable=True).indices
    for r0 in range(0, d_out, step):
        rows = order[r0 : r0 + step]
        w64 = weight[rows.to(weight.device)].detach().to(device=compute, dtype=torch.float64)
        keep = mask[rows.to(mask.device)].to(compute)
        if refit:
            m = nm[1] if nm is not None else None
            model = RefitRows(
                w64, keep, gram_fit, lam=lam, m=m, row_batch=batch, cross=scope == "layer", row_index=rows,
                engine=engine,
            )  # fmt: skip
        else:
            model = MaskRows(w64, keep, gram64, gram_search, search=search, nm=nm, row_batch=batch)
        floor = eps + model.rounding
        planner = RowPlanner(floor.cpu()) if scope == "row" else LayerPlanner(float(floor.max()))
        moves, batch_iters = iterate(model, planner, max_iters=max_iters, resync_every=resync_every)
        mask[rows.to(mask.device)] = keep.to(mask.device)
        n_swaps[rows] = moves
        iters = max(iters, batch_iters)
        if refit:
            fitted_before[rows.to(compute)] = model.fitted_before
            fitted[rows.to(compute)] = model.fitted()
    result = RefineResult(
        mask=mask,
        loss_before=_mask_losses(weight, gram64, keep_mask),
        loss_after=_mask_losses(weight, gram64, mask),
        n_swaps=n_swaps,
        iters=iters,
    )
    if refit:
        dense = weight.detach().to(compute)
        result.weight = fitted.to(device=weight.device, dtype=weight.dtype)
        result.refit_loss_before = weight_losses_unchecked(dense, fitted_before, gram64).cpu()
        result.refit_loss_after = weight_losses_unchecked(dense, fitted, gram64).cpu()
    return result


def _default_row_batch(keep_mask: torch.Tensor, refit: bool, spare: int, device: torch.device) -> int:
    """Rows per batch when the caller gives none: ``ROW_BATCH_ELEMENTS`` per ``[rows, d_in]`` for the mask objective,
    ``refit_swaps.REFIT_ELEMENTS`` per state ``Z`` ``[rows, K, Q]`` (``spare`` extra slots each) for the re-fit one
    (on CUDA ``refit_swaps.REFIT_CUDA_FRACTION`` of the device's memory, if that is more)."""
    d_out, d_in = keep_mask.shape
    if not refit:
        return max(1, ROW_BATCH_ELEMENTS // d_in)
    counts = keep_mask.sum(dim=1)
    k_max = int(counts.max()) if d_out else 0
    q_max = int((d_in - counts).max()) if d_out else 0
    elements = rs.REFIT_ELEMENTS
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        elements = max(elements, int(total * rs.REFIT_CUDA_FRACTION) // 8)
    return max(1, elements // max(1, (k_max + spare) * (q_max + spare)))


def _mask_losses(weight: torch.Tensor, gram64: torch.Tensor, keep_mask: torch.Tensor) -> torch.Tensor:
    """``[d_out]`` float64 CPU ``row_losses`` of validated inputs on ``gram64``'s device, reusing the float64 Gram."""
    weight = weight.detach().to(gram64.device)
    return weight_losses_unchecked(weight, torch.where(keep_mask.to(gram64.device), weight, 0), gram64).cpu()
