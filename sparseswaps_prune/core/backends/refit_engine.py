"""The re-fit objective's engine contract, :class:`RefitEngine`, and its torch reference, :class:`TorchRefitEngine`.

An engine holds the float64 re-fit state of ``R`` rows (:mod:`.refit_state`) and moves it in place: it builds rows
from their masks, scans each row for its best swap (the float64 argmin of ``dF``, ties to the smallest input
indices), applies swaps and, across rows, removals and restores, grows its slot counts, and reads off the re-fitted
weights. :class:`~sparseswaps_prune.core.refine.RefitRows` drives any engine through this contract; the engines
choose the same swaps (the tests check every engine against :class:`TorchRefitEngine`).

Engines: :class:`TorchRefitEngine` (the reference, any device), the compiled CPU engine
:class:`~sparseswaps_prune.core.backends.refit_numba.NumbaRefitState` and the CUDA engine
:class:`~sparseswaps_prune.core.backends.refit_lazy_triton.TritonRefitState` (both the lazy state of
:mod:`.refit_lazy`); :func:`~sparseswaps_prune.core.backends.refit_engine_class` maps an engine name to its class.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Protocol

import torch

from sparseswaps_prune.core.backends import refit_state as st


class RefitEngine(Protocol):
    """What :class:`~sparseswaps_prune.core.refine.RefitRows` needs of a re-fit engine (rows and slots ``[n]`` int64
    on the state's device; ``rows`` distinct).

    Attributes (read, never written, by the caller; as :class:`~.refit_state.RefitState`'s): ``kept``, ``kept_ok``
    ``[R, K]``, ``pruned``, ``pruned_ok`` ``[R, Q]``, ``coef`` ``[R, K]``, ``resid``, ``schur`` ``[R, Q]``.
    """

    kept: torch.Tensor
    kept_ok: torch.Tensor
    pruned: torch.Tensor
    pruned_ok: torch.Tensor
    coef: torch.Tensor
    resid: torch.Tensor
    schur: torch.Tensor

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
    ) -> None:
        """Build every row from scratch.

        Args:
            w64: ``[R, d]`` float64 weights; gram64: ``[d, d]`` float64 Gram (neither modified); keep: ``[R, d]``
                bool mask the rows are built from (read by :meth:`build`; not modified).
            lam: absolute damping; k_slots, q_slots: slot counts (from :meth:`slot_count`); m: N:M block size or
                None.
            row_offset: layer indices of the rows (``[R]`` int64) or of row 0, for the singular-system error.
            row_batch: rows built together at most, where the engine builds by row batches (the torch reference;
                the lazy engines bound their build chunks by elements, ``refit_lazy.BUILD_ELEMENTS``).

        Raises:
            ValueError: a singular ``G_SS + lambda I`` (names the rows), or tensors the engine cannot run on.
        """

    @staticmethod
    def slot_count(n_slots: int, d: int) -> int:
        """The slot count the engine uses for ``n_slots`` needed slots of ``d`` inputs (``n_slots <= result <= d``;
        the Triton engine rounds up for aligned loads)."""

    def build(self, rows: torch.Tensor, *, row_offset: int | torch.Tensor = 0) -> None:
        """Rebuild ``rows`` from the mask ``keep`` from scratch, in place (``row_offset``: their layer indices)."""

    def h_diagonal(self, rows: torch.Tensor) -> torch.Tensor:
        """``[n, K]`` diagonal of ``H`` of ``rows``."""

    def scan(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Best swap of every row in ``rows``: ``dF`` ``[n]`` float64 (``+inf`` where no feasible pair), kept slot
        and pruned slot ``[n]`` int64, as :func:`~.refit_state.scan_swaps`."""

    def swap(self, rows: torch.Tensor, slot_i: torch.Tensor, slot_j: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Swap kept slot ``slot_i`` and pruned slot ``slot_j`` of each row; returns the inputs ``(u, p)``."""

    def remove(self, rows: torch.Tensor, slot_i: torch.Tensor, vacant_j: torch.Tensor) -> torch.Tensor:
        """Prune kept slot ``slot_i`` of each row into its vacant pruned slot ``vacant_j``; returns the inputs."""

    def add(self, rows: torch.Tensor, slot_j: torch.Tensor, vacant_i: torch.Tensor) -> torch.Tensor:
        """Restore pruned slot ``slot_j`` of each row into its vacant kept slot ``vacant_i`` (the pruned slot becomes
        vacant); returns the inputs."""

    def grow(self, k_slots: int, q_slots: int) -> None:
        """Enlarge to at least ``k_slots`` kept and ``q_slots`` pruned slots (new slots vacant), in place."""

    def fitted(self) -> torch.Tensor:
        """``[R, d]`` float64 re-fitted weights ``v`` (zero off the kept set)."""


class TorchRefitEngine(st.RefitState):
    """The reference engine (any device): a :class:`~.refit_state.RefitState` moved by the exact rank-one updates of
    :mod:`.refit_state` (its scan :func:`~.refit_state.scan_swaps`). Arguments: as :class:`RefitEngine`'s; the rows
    are built in batches of ``row_batch`` (default: all at once) into one preallocated state.

    Raises:
        ValueError: a singular ``G_SS + lambda I`` (names the rows).
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
    ) -> None:
        rows = w64.shape[0]
        self.w64, self.keep, self.gram64, self.lam, self.m = w64, keep, gram64, lam, m
        self.row_batch = row_batch or max(1, rows)
        self.floor = st.pivot_floor(gram64, lam)
        if rows > self.row_batch:  # fill a preallocated (contiguous) state, row batch by row batch
            self._take(_empty_state(rows, k_slots, q_slots, w64.device))
            self.build(torch.arange(rows, device=w64.device), row_offset=row_offset)
        else:  # one row batch: build it in one go
            self._take(st.build_state(w64, keep, gram64, lam, k_slots, q_slots, row_offset=row_offset))

    def _take(self, state: st.RefitState) -> None:
        """Hold ``state``'s tensors (no copy)."""
        for f in fields(st.RefitState):
            setattr(self, f.name, getattr(state, f.name))

    @staticmethod
    def slot_count(n_slots: int, d: int) -> int:
        """``n_slots``: the exact count."""
        return n_slots

    def build(self, rows: torch.Tensor, *, row_offset: int | torch.Tensor = 0) -> None:
        """Rebuild ``rows`` from scratch (Cholesky), in row batches, in place (``row_offset``: the layer indices of
        ``rows``, or of row 0)."""
        names = rows + row_offset if isinstance(row_offset, int) else row_offset
        k_slots, q_slots = self.kept.shape[1], self.pruned.shape[1]
        for r0 in range(0, rows.numel(), self.row_batch):
            sub = rows[r0 : r0 + self.row_batch]
            fresh = st.build_state(
                self.w64[sub], self.keep[sub], self.gram64, self.lam, k_slots, q_slots,
                row_offset=names[r0 : r0 + self.row_batch],
            )  # fmt: skip
            self.assign(sub, fresh)

    def scan(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`~.refit_state.scan_swaps` of ``rows``."""
        return st.scan_swaps(self, self.w64, rows, self.floor, self.m)

    def swap(self, rows: torch.Tensor, slot_i: torch.Tensor, slot_j: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`~.refit_state.swap_slots`; returns the inputs ``(u, p)``."""
        return st.swap_slots(self, rows, slot_i, slot_j, self.gram64)

    def remove(self, rows: torch.Tensor, slot_i: torch.Tensor, vacant_j: torch.Tensor) -> torch.Tensor:
        """:func:`~.refit_state.remove_kept` into the vacant pruned slots; returns the inputs."""
        incoming = st.remove_kept(self, rows, slot_i)
        st.place_pruned(self, rows, vacant_j, incoming)
        return incoming[0]

    def add(self, rows: torch.Tensor, slot_j: torch.Tensor, vacant_i: torch.Tensor) -> torch.Tensor:
        """:func:`~.refit_state.add_pruned` into the vacant kept slots; returns the inputs."""
        p = self.pruned[rows, slot_j]
        st.add_pruned(self, rows, slot_j, vacant_i, self.gram64)
        return p

    def grow(self, k_slots: int, q_slots: int) -> None:
        """:func:`~.refit_state.grow`, in place."""
        self._take(st.grow(self, k_slots, q_slots))

    def fitted(self) -> torch.Tensor:
        """:func:`~.refit_state.fitted_weights`."""
        return st.fitted_weights(self, self.w64.shape[1])


def _empty_state(rows: int, k_slots: int, q_slots: int, device: torch.device) -> st.RefitState:
    """An all-vacant state (filled by :meth:`TorchRefitEngine.build`)."""
    f64 = {"dtype": torch.float64, "device": device}
    return st.RefitState(
        kept=torch.zeros(rows, k_slots, dtype=torch.long, device=device),
        kept_ok=torch.zeros(rows, k_slots, dtype=torch.bool, device=device),
        pruned=torch.zeros(rows, q_slots, dtype=torch.long, device=device),
        pruned_ok=torch.zeros(rows, q_slots, dtype=torch.bool, device=device),
        inv=torch.zeros(rows, k_slots, k_slots, **f64),
        coef=torch.zeros(rows, k_slots, **f64),
        resid=torch.zeros(rows, q_slots, **f64),
        schur=torch.ones(rows, q_slots, **f64),
        z=torch.zeros(rows, k_slots, q_slots, **f64),
    )
