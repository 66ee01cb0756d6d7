"""The lazy re-fit state: the state of :mod:`~sparseswaps_prune.core.backends.refit_state` with ``H`` and ``Z`` kept as
a base plus pending rank-one terms, so that a move no longer streams the ``[K, K]`` and ``[K, Q]`` matrices.

Every move changes ``H`` and ``Z`` by rank-one terms that share their left vectors, ``H += c a a^T`` and
``Z += a b^T``. Each row keeps its pending terms (at most ``factor_slots``) next to a base:
``H = H0 + sum_k c_k a_k a_k^T``, ``Z = Z0 + sum_k a_k b_k^T``. A move reads one column of ``H`` and one row and
one column of ``Z`` through the terms (``O((K + Q) r)`` per row), and the terms are folded into ``H0`` and ``Z0``
by one batched matrix product when a row would overflow (:meth:`LazyRefitState.fold`: every ``factor_slots / 2``
swaps). The diagonal of ``H``, ``v``, ``r`` and ``s`` are kept exactly (eagerly). A restore's vector
``t_q = G_pq - G[p, S] Z[:, q]`` is read off the shared Gram, ``sum_{s in S} y_s G[s, :]`` with ``y = Z[:, p]``
(one matrix product for all rows of a call).

:class:`LazyRefitState` holds the state (build, fold, grow, the reads); two engines of the contract of
:mod:`.refit_engine` add its scan and moves: :class:`~sparseswaps_prune.core.backends.refit_numba.NumbaRefitState`
(compiled, CPU) and :class:`~sparseswaps_prune.core.backends.refit_lazy_triton.TritonRefitState` (Triton kernels,
CUDA). The costs are not bit-identical to the torch reference's (the state rounds in a different order); the engines
choose the same swaps, as the tests check.

Layout: ``zt`` ``[R, Q, K]`` is ``Z0`` transposed (a column of ``Z`` is contiguous).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from sparseswaps_prune.core.backends import refit_state as st

# Pending rank-one terms per row before they are folded into H0 and Z0 (two per swap): 32 swaps, so runs of up to
# 32 iterations never fold. A fold costs about K Q multiply-adds per term; a pending term costs K per column the
# scan visits (a few per row and iteration) and K + Q per move, so folding early does not pay. Memory: 8 F (K + Q)
# bytes per row, F / K of the state's (4-28% at 60% of 4096-576 inputs).
FACTOR_SLOTS = 64

# Elements of the [rows, Q, K] temporaries of one build chunk: 32 MiB float64 each on the CPU; on CUDA 2 GiB
# (BUILD_ELEMENTS_CUDA), since batched Cholesky factors and products of a few rows leave the GPU idle (one row per
# chunk at 4096 inputs built 3.2x slower than the eager engine's whole-batch build: BENCHMARKS.md, "GPU").
BUILD_ELEMENTS = 1 << 22
BUILD_ELEMENTS_CUDA = 1 << 28


def _as_slice(rows: torch.Tensor) -> torch.Tensor | slice:
    """``rows`` (``[n]`` int64) as a slice when they are consecutive and ascending, else as they are."""
    n = rows.numel()
    if n and int(rows[-1]) - int(rows[0]) == n - 1 and bool((rows.diff() == 1).all()):
        return slice(int(rows[0]), int(rows[0]) + n)
    return rows


class LazyRefitState(ABC):
    """Float64 re-fit state of ``R`` rows with ``H`` and ``Z`` as a base plus pending rank-one terms (tensors on
    ``w64``'s device, modified in place by the moves); a subclass adds the scan and the moves (:meth:`scan`,
    :meth:`swap`, :meth:`remove`, :meth:`add` of the engine contract, :class:`~.refit_engine.RefitEngine`).

    The attributes of :class:`~.refit_state.RefitState` with the same meaning -- ``kept``,
    ``kept_ok``, ``pruned``, ``pruned_ok``, ``coef`` (``v``), ``resid`` (``r``), ``schur`` (``s``) -- plus the lazy
    form of ``H`` and ``Z``: ``inv`` ``[R, K, K]`` base ``H0``, ``hdiag`` ``[R, K]`` the exact diagonal of ``H``,
    ``zt`` ``[R, Q, K]`` base ``Z0`` transposed, and the pending terms ``fa`` ``[R, F, K]``, ``fc`` ``[R, F]``,
    ``fb`` ``[R, F, Q]``, ``rank`` ``[R]`` (``H = H0 + sum_k fc_k fa_k fa_k^T``, ``Z = Z0 + sum_k fa_k fb_k^T`` over
    ``k < rank``; entries past ``rank`` are zero). It reads as a ``RefitState`` through :meth:`h_diagonal`,
    :meth:`z_rows` and :meth:`z_columns` (``refit_state.best_removals`` and the reference scan read it so).

    Args: as :class:`~.refit_engine.RefitEngine`'s (every tensor on ``w64``'s device; ``row_batch`` is not read: the
    build is chunked by elements, :data:`BUILD_ELEMENTS`), and ``factor_slots``: pending terms per row before a fold
    (even, >= 2; default ``FACTOR_SLOTS``).

    Every row is built on construction (:meth:`build`).

    Raises:
        ValueError: a bad ``factor_slots``, or a singular ``G_SS + lambda I`` (names the rows).
    """

    def __init__(
        self,
        w64: torch.Tensor,
        keep: torch.Tensor,
        gram64: torch.Tensor,
        lam: float,
        k_slots: int,
        q_slots: int,
        m: int | None,
        *,
        row_offset: int | torch.Tensor = 0,
        row_batch: int | None = None,
        factor_slots: int | None = None,
    ) -> None:
        factor_slots = factor_slots or FACTOR_SLOTS
        if factor_slots < 2 or factor_slots % 2:
            raise ValueError(f"factor_slots must be an even number >= 2, got {factor_slots}")
        self.w64, self.keep = w64.contiguous(), keep
        self.gram64 = gram64.contiguous()
        self.lam, self.m, self.factor_slots = lam, m, factor_slots
        self.floor = st.pivot_floor(self.gram64, lam).contiguous()
        rows, dev = w64.shape[0], w64.device
        long, f64 = {"dtype": torch.long, "device": dev}, {"dtype": torch.float64, "device": dev}
        # every row is built below: no need to zero what the build writes (the zeroing pass costs as much as a copy)
        self.kept = torch.empty(rows, k_slots, **long)
        self.kept_ok = torch.empty(rows, k_slots, dtype=torch.bool, device=dev)
        self.pruned = torch.empty(rows, q_slots, **long)
        self.pruned_ok = torch.empty(rows, q_slots, dtype=torch.bool, device=dev)
        self.inv = torch.empty(rows, k_slots, k_slots, **f64)
        self.hdiag = torch.empty(rows, k_slots, **f64)
        self.coef = torch.empty(rows, k_slots, **f64)
        self.resid = torch.empty(rows, q_slots, **f64)
        self.schur = torch.empty(rows, q_slots, **f64)
        self.zt = torch.empty(rows, q_slots, k_slots, **f64)
        self.fa = torch.zeros(rows, factor_slots, k_slots, **f64)
        self.fc = torch.zeros(rows, factor_slots, **f64)
        self.fb = torch.zeros(rows, factor_slots, q_slots, **f64)
        self.rank = torch.zeros(rows, **long)
        self.max_rank = 0  # a bound on rank.max() kept on the host (no device sync per move), >= every rank
        self.build(torch.arange(rows, device=dev), row_offset=row_offset)

    @staticmethod
    def slot_count(n_slots: int, d: int) -> int:
        """``n_slots``: the exact count (an engine whose kernels want aligned counts rounds up)."""
        return n_slots

    @property
    def slots(self) -> tuple[int, int]:
        """``(K, Q)``."""
        return self.kept.shape[1], self.pruned.shape[1]

    def build(self, rows: torch.Tensor, *, row_offset: int | torch.Tensor = 0) -> None:
        """Rebuild rows ``rows`` (``[n]`` int64) from ``keep`` from scratch, in place, by
        :func:`~sparseswaps_prune.core.backends.refit_state.build_state` (Cholesky of ``G_SS + lambda I``,
        ``H0 = (G_SS + lambda I)^{-1}``, ``v``, ``Z0 = H0 G[S, P]``, ``r``, ``s``); no pending terms.
        ``row_offset``: layer indices of ``rows`` (tensor) or of row 0 (int), for the singular-system error.

        Raises:
            ValueError: ``G_SS + lambda I`` is not positive definite for some rows (names them; raise ``damp``).
        """
        k_slots, q_slots = self.slots
        elements = BUILD_ELEMENTS_CUDA if self.w64.device.type == "cuda" else BUILD_ELEMENTS
        chunk = max(1, elements // max(1, k_slots * q_slots))
        names = rows + row_offset if isinstance(row_offset, int) else row_offset
        for c0 in range(0, rows.numel(), chunk):
            sub = rows[c0 : c0 + chunk]
            batch = names[c0 : c0 + chunk]
            into = _as_slice(sub)  # consecutive rows: Z^T built in place, plain copies instead of indexed writes
            fresh = st.build_state(
                self.w64[sub], self.keep[sub], self.gram64, self.lam, k_slots, q_slots, row_offset=batch,
                transposed_z=True, z_out=self.zt[into] if isinstance(into, slice) else None,
            )  # fmt: skip
            for name in ("kept", "kept_ok", "pruned", "pruned_ok", "inv", "coef", "resid", "schur"):
                getattr(self, name)[into] = getattr(fresh, name)
            self.hdiag[into] = torch.diagonal(fresh.inv, dim1=1, dim2=2)
            if not isinstance(into, slice):
                self.zt[into] = fresh.z.mT
            if bool(self.rank[into].any()):  # pending terms to clear (entries past a row's rank are zero)
                self.fa[into], self.fc[into], self.fb[into], self.rank[into] = 0.0, 0.0, 0.0, 0

    # -- reads, as a RefitState -------------------------------------------------------------------------------------

    def h_diagonal(self, rows: torch.Tensor) -> torch.Tensor:
        """``[n, K]`` diagonal of ``H`` of rows ``rows`` (kept exactly)."""
        return self.hdiag[rows]

    def _terms(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``fa``, ``fc``, ``fb`` of rows ``rows`` up to the rank bound ``max_rank`` (the rest are zero)."""
        r = self.max_rank
        return self.fa[rows, :r], self.fc[rows, :r], self.fb[rows, :r]

    def z_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """``[n, K, Q]`` ``Z`` of rows ``rows``, the base plus the pending terms (a new tensor)."""
        fa, _, fb = self._terms(rows)
        return torch.baddbmm(self.zt[rows], fb.mT, fa).mT

    def z_columns(self, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``[n, K, c]`` columns ``Z[:, slots[n]]`` of each row ``rows[n]`` (``slots``: ``[n, c]`` pruned slots)."""
        fb = self.fb[rows[:, None], : self.max_rank, slots]  # [n, c, r]
        return torch.baddbmm(self.zt[rows[:, None], slots], fb, self._terms(rows)[0]).mT

    # -- the engine's scan and moves --------------------------------------------------------------------------------

    @abstractmethod
    def scan(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Best swap of every row in ``rows`` (``[n]`` int64): ``dF`` ``[n]`` float64 (``+inf`` where no feasible
        pair), kept slot and pruned slot ``[n]`` int64; as :func:`~.refit_state.scan_swaps`."""

    @abstractmethod
    def swap(self, rows: torch.Tensor, slot_i: torch.Tensor, slot_j: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Swap kept slot ``slot_i`` and pruned slot ``slot_j`` of each (distinct) row (``[n]`` int64 each), in
        place; returns the inputs ``(u, p)`` (as :func:`~.refit_state.swap_slots`)."""

    @abstractmethod
    def remove(self, rows: torch.Tensor, slot_i: torch.Tensor, vacant_j: torch.Tensor) -> torch.Tensor:
        """Prune kept slot ``slot_i`` of each row into its vacant pruned slot ``vacant_j``; returns the inputs."""

    @abstractmethod
    def add(self, rows: torch.Tensor, slot_j: torch.Tensor, vacant_i: torch.Tensor) -> torch.Tensor:
        """Restore pruned slot ``slot_j`` of each row into its vacant kept slot ``vacant_i`` (the pruned slot
        becomes vacant); returns the inputs."""

    # -- the pending terms and the slots ----------------------------------------------------------------------------

    def fold(self, rows: torch.Tensor) -> None:
        """Fold the pending terms of ``rows`` into ``H0`` and ``Z0`` (one batched product; all rows at once when
        most have terms pending), in place."""
        rows = rows[self.rank[rows] > 0]
        if rows.numel() == 0:
            return
        if 2 * rows.numel() > self.rank.numel():  # all rows in one batched product (zero terms add nothing)
            k = int(self.rank.max())
            fa = self.fa[:, :k]
            self.zt.baddbmm_(self.fb[:, :k].transpose(1, 2), fa)
            self.inv.baddbmm_(fa.transpose(1, 2), fa * self.fc[:, :k, None])
            rows = torch.arange(self.rank.numel(), device=rows.device)
        else:
            for r in rows.tolist():
                k = int(self.rank[r])
                fa = self.fa[r, :k]
                self.zt[r].addmm_(self.fb[r, :k].T, fa)
                self.inv[r].addmm_(fa.T, fa * self.fc[r, :k, None])
        self.fa[rows], self.fc[rows], self.fb[rows], self.rank[rows] = 0.0, 0.0, 0.0, 0
        if rows.numel() == self.rank.numel():
            self.max_rank = 0

    def grow(self, k_slots: int, q_slots: int) -> None:
        """Enlarge to at least ``k_slots`` kept and ``q_slots`` pruned slots (new slots vacant), in place."""
        k_old, q_old = self.slots
        k_new, q_new = max(k_old, k_slots), max(q_old, q_slots)
        if (k_new, q_new) == (k_old, q_old):
            return

        def pad(t: torch.Tensor, dims: dict[int, int], fill: float = 0) -> torch.Tensor:
            shape = [dims.get(i, s) for i, s in enumerate(t.shape)]
            out = torch.full(shape, fill, dtype=t.dtype, device=t.device)
            out[tuple(slice(0, s) for s in t.shape)] = t
            return out

        k, q = {1: k_new}, {1: q_new}
        self.kept, self.kept_ok, self.coef, self.hdiag = (pad(t, k) for t in (self.kept, self.kept_ok, self.coef,
                                                                              self.hdiag))  # fmt: skip
        self.pruned, self.pruned_ok, self.resid = (pad(t, q) for t in (self.pruned, self.pruned_ok, self.resid))
        self.schur = pad(self.schur, q, 1.0)
        self.inv = pad(self.inv, {1: k_new, 2: k_new})
        self.zt = pad(self.zt, {1: q_new, 2: k_new})
        self.fa = pad(self.fa, {2: k_new})
        self.fb = pad(self.fb, {2: q_new})

    def fitted(self) -> torch.Tensor:
        """``[R, d]`` float64 re-fitted weights ``v`` (zero off the kept set)."""
        out = torch.zeros(self.w64.shape, dtype=torch.float64, device=self.w64.device)
        return out.scatter_add_(1, self.kept, torch.where(self.kept_ok, self.coef, 0.0))
