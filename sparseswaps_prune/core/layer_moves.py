"""A layer budget instead of a row budget: moves that prune a weight in one row and restore one in another.

Rows are independent, so pruning kept ``u`` in row ``i`` and restoring pruned ``p`` in row ``j != i`` changes the
layer loss by exactly ``remove_i(u) + add_j(p)``:

* mask-only objective (``L = r^T G r``, ``c = G r``): ``remove(u) = 2 w_u c_u + w_u^2 G_uu``,
  ``add(p) = -2 w_p c_p + w_p^2 G_pp``;
* re-fit objective (:mod:`~sparseswaps_prune.core.refit_swaps`): ``remove(u) = v_u^2 / H_uu``,
  ``add(p) = -r_p^2 / s_p``.

Each iteration every row offers its best in-row swap (``swap_i``), its cheapest removal (``remove_i``) and its best
restore (``add_i``); :func:`plan_moves` then picks the best combination of moves in which every row takes part in
at most one move (so each move's figure is exact) and every move lowers the loss by more than ``eps``: in-row swaps,
and cross-row moves pairing a donor row (one removal) with a receiver row (one restore). The layer's total kept
count is conserved; rows' counts drift. A row's figures depend on that row only, so they are recomputed only for
rows that moved (or were re-synchronised).

The combination is optimal: with ``b_i = min(0, swap_i + eps)``, ``delta_i = remove_i + eps/2 - b_i`` and
``rho_i = add_i + eps/2 - b_i``, an iteration minimises ``sum_D delta + sum_R rho`` over disjoint donor and receiver
sets of equal size ``n`` (the total ``sum (dL + eps)`` over its moves, relative to every row taking its own best
swap). This value ``F(n)`` is convex in ``n`` (a min-cost flow with capacities ``n``); for given ``n`` the donors
precede the receivers in the order of ``remove - add`` (an exchange argument), so ``F(n)`` is the best split of that
order into a prefix giving its ``n`` smallest ``delta`` and a suffix giving its ``n`` smallest ``rho``
(``O(N log n)`` with a heap), and the smallest minimiser ``n`` is found by bisection. With that smallest ``n``,
pairing the donors' removals ascending with the receivers' restores descending makes every pair improving.

Memory: the mask objective keeps ``c`` ``[d_out, d_in]`` float64 for all rows (the swap search runs in row batches).
The re-fit objective keeps every row's ``H`` and ``Z`` at once, ``8 * d_out * (k^2 + k (d_in - k))`` bytes, refused
above ``LAYER_STATE_BYTES``; there ``eps`` is raised by ``ACCEPT_RTOL * max_i w_i^T G w_i`` (the rounding floor of
the float64 state, on the layer's scale since moves compare rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba as nb
import numpy as np
import torch

from sparseswaps_prune.core import refit_swaps as rs
from sparseswaps_prune.core.backends import best_swaps
from sparseswaps_prune.core.losses import correlation

# objective="refit" with scope="layer" keeps every row's state (H and Z, float64) at once; refuse above this.
LAYER_STATE_BYTES = 8 << 30


@nb.njit(cache=True)
def _smallest_sums(values, n):  # pragma: no cover - compiled
    """``out[m]`` = sum of the ``n`` smallest finite entries of ``values[:m]``, ``m = 0..len(values)`` (``inf``
    while fewer than ``n`` are finite), with a max-heap of the current ``n`` smallest."""
    size_m = values.shape[0]
    out = np.empty(size_m + 1)
    out[0] = 0.0 if n == 0 else np.inf
    heap = np.empty(max(n, 1))
    size, total = 0, 0.0
    for m in range(size_m):
        x = values[m]
        if n > 0 and x < np.inf:
            if size < n:
                pos = size
                heap[pos] = x
                size += 1
                total += x
                while pos > 0:
                    parent = (pos - 1) // 2
                    if heap[parent] >= heap[pos]:
                        break
                    heap[parent], heap[pos] = heap[pos], heap[parent]
                    pos = parent
            elif x < heap[0]:
                total += x - heap[0]
                heap[0] = x
                pos = 0
                while True:
                    left, right, top = 2 * pos + 1, 2 * pos + 2, pos
                    if left < size and heap[left] > heap[top]:
                        top = left
                    if right < size and heap[right] > heap[top]:
                        top = right
                    if top == pos:
                        break
                    heap[top], heap[pos] = heap[pos], heap[top]
                    pos = top
        out[m + 1] = total if size == n else np.inf
    return out


def _best_split(delta: np.ndarray, rho: np.ndarray, n: int) -> tuple[float, int]:
    """``F(n)`` and its split: min over ``m`` of (``n`` smallest ``delta[:m]``) + (``n`` smallest ``rho[m:]``)."""
    if n == 0:
        return 0.0, 0
    total = _smallest_sums(delta, n) + _smallest_sums(rho[::-1].copy(), n)[::-1]
    m = int(np.argmin(total))  # first (smallest) split on ties
    return float(total[m]), m


def _smallest(values: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
    """The ``n`` rows of smallest ``values`` (ties to the smaller row)."""
    return rows[np.lexsort((rows, values))[:n]]


@dataclass
class MovePlan:
    """Moves of one iteration (``[n]`` int64 row indices; the three sets are disjoint).

    Attributes:
        swap_rows: rows applying their best in-row swap.
        donor_rows: rows pruning their cheapest kept weight.
        receiver_rows: rows restoring their best pruned weight (as many as donors).
    """

    swap_rows: np.ndarray
    donor_rows: np.ndarray
    receiver_rows: np.ndarray

    @property
    def empty(self) -> bool:
        return self.swap_rows.size + self.donor_rows.size == 0


def plan_moves(swap_dl: np.ndarray, remove: np.ndarray, add: np.ndarray, eps: float = 0.0) -> MovePlan:
    """Best combination of moves for one iteration (see the module docstring), ``O(N log^2 N)`` for ``N`` rows.

    Args:
        swap_dl: ``[N]`` float64 best in-row swap per row (``+inf`` if none).
        remove: ``[N]`` float64 cheapest removal per row (``+inf`` if nothing is kept).
        add: ``[N]`` float64 best restore per row (``+inf`` if nothing can be restored).
        eps: every move must lower the loss by more than ``eps`` (>= 0).

    Returns:
        :class:`MovePlan` minimising ``sum over moves (dL + eps)``, with the fewest cross-row moves among optima.
        Each row is in at most one move and ``len(donor_rows) == len(receiver_rows)``.
    """
    swap_dl, remove, add = (np.asarray(a, dtype=np.float64) for a in (swap_dl, remove, add))
    base = np.minimum(0.0, swap_dl + eps)
    delta = remove + eps / 2 - base
    rho = add + eps / 2 - base
    rows = np.nonzero(np.isfinite(remove) | np.isfinite(add))[0]
    with np.errstate(invalid="ignore"):
        order = rows[np.lexsort((rows, remove[rows] - add[rows]))]  # by remove - add, ties to the smaller row
    delta_o, rho_o = delta[order], rho[order]
    lo = 0
    hi = min(int(np.isfinite(delta_o).sum()), int(np.isfinite(rho_o).sum()), order.size // 2)
    cache: dict[int, float] = {}

    def value(n: int) -> float:
        if n not in cache:
            cache[n] = _best_split(delta_o, rho_o, n)[0]
        return cache[n]

    while lo < hi:  # smallest n with F(n + 1) >= F(n): F is convex
        mid = (lo + hi) // 2
        if value(mid + 1) < value(mid):
            lo = mid + 1
        else:
            hi = mid
    donors = receivers = np.zeros(0, dtype=np.int64)
    if lo > 0:
        _, split = _best_split(delta_o, rho_o, lo)
        donors = _smallest(delta_o[:split], order[:split], lo)
        receivers = _smallest(rho_o[split:], order[split:], lo)
        # pair the cheapest removals with the smallest gains: every pair improves (rounding guard drops the rest)
        donors = donors[np.lexsort((donors, remove[donors]))]
        receivers = receivers[np.lexsort((receivers, -add[receivers]))]
        legal = remove[donors] + add[receivers] < -eps
        donors, receivers = np.sort(donors[legal]), np.sort(receivers[legal])
    busy = np.zeros(swap_dl.shape[0], dtype=bool)
    busy[donors] = busy[receivers] = True
    swaps = np.nonzero(~busy & (swap_dl < -eps))[0]
    return MovePlan(swaps.astype(np.int64), donors.astype(np.int64), receivers.astype(np.int64))


@dataclass
class Figures:
    """Per-row move figures (CPU float64 values, int64 handles; handles are model-specific positions)."""

    swap_dl: torch.Tensor
    swap_a: torch.Tensor
    swap_b: torch.Tensor
    remove: torch.Tensor
    remove_a: torch.Tensor
    add: torch.Tensor
    add_b: torch.Tensor

    def update(self, rows: torch.Tensor, other: Figures) -> None:
        """Overwrite the figures of ``rows`` with ``other`` (in the order of ``rows``), in place."""
        for name in self.__dataclass_fields__:
            getattr(self, name)[rows] = getattr(other, name).cpu()


class MaskRows:
    """Mask-only objective for all rows of a layer: keep mask and float64 ``c = G r`` (handles = input indices)."""

    def __init__(
        self,
        w64: torch.Tensor,
        gram64: torch.Tensor,
        keep: torch.Tensor,
        *,
        dtype: torch.dtype,
        search: str,
        row_batch: int,
    ) -> None:
        """``w64`` ``[N, d]`` float64, ``gram64`` ``[d, d]`` float64 (not modified); ``keep`` ``[N, d]`` bool is
        updated in place by :meth:`apply`; ``dtype``, ``search``: the swap search's dtype and backend."""
        self.w64, self.gram64, self.keep = w64, gram64, keep
        self.w_search, self.gram_search = w64.to(dtype), gram64.to(dtype)
        self.search, self.row_batch = search, row_batch
        self.diag = torch.diagonal(gram64)
        self.corr = torch.empty_like(w64)
        self.resync(torch.arange(w64.shape[0], device=w64.device))

    def resync(self, rows: torch.Tensor) -> None:
        """Rebuild ``c`` of ``rows`` from scratch."""
        for r0 in range(0, rows.numel(), self.row_batch):
            sub = rows[r0 : r0 + self.row_batch]
            self.corr[sub] = correlation(self.w64[sub], self.gram64, self.keep[sub])

    def figures(self, rows: torch.Tensor) -> Figures:
        """Best swap (float64 re-evaluated), cheapest removal and best restore of every row in ``rows``."""
        if rows.numel() == 0:
            return _no_figures()
        parts = [self._figures(rows[r0 : r0 + self.row_batch]) for r0 in range(0, rows.numel(), self.row_batch)]
        return Figures(*(torch.cat([getattr(p, f) for p in parts]) for f in Figures.__dataclass_fields__))

    def _figures(self, rows: torch.Tensor) -> Figures:
        w, keep, corr = self.w64[rows], self.keep[rows], self.corr[rows]
        u, p, _ = best_swaps(
            self.search, self.w_search[rows], keep, corr.to(self.gram_search.dtype), self.gram_search, None
        )
        u, p = u.to(w.device), p.to(w.device)
        ar = torch.arange(rows.numel(), device=w.device)
        w_u, w_p, c_u, c_p = w[ar, u], w[ar, p], corr[ar, u], corr[ar, p]
        exact = (
            2 * w_u * c_u
            + w_u * w_u * self.diag[u]
            - 2 * w_p * c_p
            + w_p * w_p * self.diag[p]
            - 2 * w_u * w_p * self.gram64[u, p]
        )
        feasible = keep[ar, u] & ~keep[ar, p] & (w_p != 0)
        own = w * w * self.diag
        remove = torch.where(keep, 2 * w * corr + own, float("inf"))
        add = torch.where(~keep & (w != 0), own - 2 * w * corr, float("inf"))
        rem_low, rem_u = remove.min(dim=1)  # first index on ties: the smallest u
        add_low, add_p = add.min(dim=1)
        out = (torch.where(feasible, exact, float("inf")), u, p, rem_low, rem_u, add_low, add_p)
        return Figures(*(t.cpu() for t in out))

    def apply(
        self, swaps: tuple[torch.Tensor, ...], donors: tuple[torch.Tensor, ...], receivers: tuple[torch.Tensor, ...]
    ) -> None:
        """Apply ``(rows, u, p)`` swaps, ``(rows, u)`` removals and ``(rows, p)`` restores, in place."""
        rows, u, p = swaps
        self.keep[rows, u] = False
        self.keep[rows, p] = True
        self.corr[rows] += self.w64[rows, u, None] * self.gram64[u] - self.w64[rows, p, None] * self.gram64[p]
        rows, u = donors
        self.keep[rows, u] = False
        self.corr[rows] += self.w64[rows, u, None] * self.gram64[u]
        rows, p = receivers
        self.keep[rows, p] = True
        self.corr[rows] -= self.w64[rows, p, None] * self.gram64[p]

    def result(self) -> tuple[torch.Tensor, None]:
        """The refined ``[N, d]`` mask (and no re-fitted weights)."""
        return self.keep, None


class RefitRows:
    """Re-fit objective for all rows of a layer: one :class:`~sparseswaps_prune.core.refit_swaps.RefitState`
    (handles = slots); slots are added when a receiver row is full."""

    def __init__(
        self, w64: torch.Tensor, gram64: torch.Tensor, keep: torch.Tensor, *, lam: float, row_batch: int
    ) -> None:
        """As :class:`MaskRows`; ``lam``: absolute damping; ``row_batch``: rows per Cholesky rebuild.
        Raises ValueError when the state would exceed ``LAYER_STATE_BYTES``."""
        rows, d = keep.shape
        counts = keep.sum(dim=1)
        self.k_slots = min(d, int(counts.max()) + 1)
        self.q_slots = min(d, int((d - counts).max()) + 1)
        need = rows * (self.k_slots**2 + self.k_slots * self.q_slots) * 8
        if need > LAYER_STATE_BYTES:
            raise ValueError(
                f"objective='refit' with scope='layer' keeps every row's re-fit state at once: about "
                f"{need / 2**30:.1f} GiB for this [{rows}, {d}] layer, over the {LAYER_STATE_BYTES / 2**30:.0f} GiB "
                "limit (layer_moves.LAYER_STATE_BYTES); use scope='row' (memory bounded by row_batch) or "
                "objective='mask'"
            )
        self.w64, self.gram64, self.keep, self.lam, self.row_batch = w64, gram64, keep, lam, row_batch
        self.pivot_floor = rs.pivot_floor(gram64, lam)
        self.state = _empty_state(rows, self.k_slots, self.q_slots, w64.device)
        self.resync(torch.arange(rows, device=w64.device))
        self.fitted_before = rs.fitted_weights(self.state, d)

    def resync(self, rows: torch.Tensor) -> None:
        """Rebuild the state of ``rows`` from scratch (Cholesky), in row batches."""
        for r0 in range(0, rows.numel(), self.row_batch):
            sub = rows[r0 : r0 + self.row_batch]
            fresh = rs.build_state(
                self.w64[sub], self.keep[sub], self.gram64, self.lam, self.k_slots, self.q_slots, row_offset=sub
            )
            self.state.assign(sub, fresh)

    def figures(self, rows: torch.Tensor) -> Figures:
        """Best swap, cheapest removal and best restore of every row in ``rows`` (handles are slots)."""
        swap_dl, slot_i, slot_j = rs.scan_swaps(self.state, self.w64, rows, self.pivot_floor)
        remove, remove_i = rs.best_removals(self.state, rows)
        add, add_j = rs.best_additions(self.state, self.w64, rows, self.pivot_floor)
        return Figures(*(t.cpu() for t in (swap_dl, slot_i, slot_j, remove, remove_i, add, add_j)))

    def _reserve(self, donors: torch.Tensor, receivers: torch.Tensor) -> None:
        """Add vacant slots when a donor has no vacant pruned slot or a receiver no vacant kept slot."""
        d = self.w64.shape[1]
        k_full = bool((self.state.kept_ok[receivers].all(dim=1)).any()) if receivers.numel() else False
        q_full = bool((self.state.pruned_ok[donors].all(dim=1)).any()) if donors.numel() else False
        if k_full or q_full:
            self.k_slots = min(d, self.k_slots + (max(1, self.k_slots // 16) if k_full else 0))
            self.q_slots = min(d, self.q_slots + (max(1, self.q_slots // 16) if q_full else 0))
            self.state = rs.grow(self.state, self.k_slots, self.q_slots)

    def apply(
        self, swaps: tuple[torch.Tensor, ...], donors: tuple[torch.Tensor, ...], receivers: tuple[torch.Tensor, ...]
    ) -> None:
        """Apply ``(rows, i, j)`` swaps, ``(rows, i)`` removals and ``(rows, j)`` restores (slots), in place."""
        self._reserve(donors[0], receivers[0])
        rows, slot_i, slot_j = swaps
        u, p = rs.swap_slots(self.state, rows, slot_i, slot_j, self.gram64)
        self.keep[rows, u] = False
        self.keep[rows, p] = True
        rows, slot_i = donors
        vacant = (~self.state.pruned_ok[rows]).to(torch.int8).argmax(dim=1)
        incoming = rs.remove_kept(self.state, rows, slot_i)
        rs.place_pruned(self.state, rows, vacant, incoming)
        self.keep[rows, incoming[0]] = False
        rows, slot_j = receivers
        p = self.state.pruned[rows, slot_j]
        vacant = (~self.state.kept_ok[rows]).to(torch.int8).argmax(dim=1)
        rs.add_pruned(self.state, rows, slot_j, vacant, self.gram64)
        self.keep[rows, p] = True

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The refined ``[N, d]`` mask and its re-fitted weights (float64, zero off the mask)."""
        return self.keep, rs.fitted_weights(self.state, self.w64.shape[1])


def _no_figures() -> Figures:
    empty = torch.zeros(0, dtype=torch.float64)
    index = torch.zeros(0, dtype=torch.long)
    return Figures(empty, index, index, empty, index, empty, index)


def _empty_state(rows: int, k_slots: int, q_slots: int, device: torch.device) -> rs.RefitState:
    """An all-vacant state (filled by :meth:`RefitRows.resync`)."""
    f64 = {"dtype": torch.float64, "device": device}
    return rs.RefitState(
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


def refine_layer(
    model: MaskRows | RefitRows, *, max_iters: int, eps: float, resync_every: int
) -> tuple[torch.Tensor, int]:
    """Layer-budget iteration loop on ``model`` (updated in place) until no move improves or ``max_iters``.

    Returns the per-row move counts ``[N]`` int64 (a cross-row move counts once in each of its two rows) and the
    number of iterations that applied at least one move.
    """
    n_rows = model.w64.shape[0]
    device = model.w64.device
    all_rows = torch.arange(n_rows, device=device)
    figures = model.figures(all_rows)
    n_moves = torch.zeros(n_rows, dtype=torch.long)
    dirty = torch.zeros(n_rows, dtype=torch.bool)
    iters = 0
    for it in range(1, max_iters + 1):
        plan = plan_moves(figures.swap_dl.numpy(), figures.remove.numpy(), figures.add.numpy(), eps)
        if plan.empty:
            break
        iters += 1
        swap_rows, donors, receivers = (
            torch.from_numpy(r) for r in (plan.swap_rows, plan.donor_rows, plan.receiver_rows)
        )
        model.apply(
            (swap_rows.to(device), figures.swap_a[swap_rows].to(device), figures.swap_b[swap_rows].to(device)),
            (donors.to(device), figures.remove_a[donors].to(device)),
            (receivers.to(device), figures.add_b[receivers].to(device)),
        )
        changed = torch.cat([swap_rows, donors, receivers])
        n_moves[changed] += 1
        dirty[changed] = True
        if it % resync_every == 0:
            refresh = torch.nonzero(dirty).flatten()
            model.resync(refresh.to(device))
            dirty[:] = False
        else:
            refresh = changed
        figures.update(refresh, model.figures(refresh.to(device)))
    return n_moves, iters
