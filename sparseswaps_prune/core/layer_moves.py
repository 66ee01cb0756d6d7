"""The layer-scope planner: which moves of one iteration to apply when only the layer's kept count is conserved.

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
count is conserved; rows' counts drift. The iteration loop and the row models that supply the figures are in
:mod:`~sparseswaps_prune.core.refine`.

The combination is optimal: with ``b_i = min(0, swap_i + eps)``, ``delta_i = remove_i + eps/2 - b_i`` and
``rho_i = add_i + eps/2 - b_i``, an iteration minimises ``sum_D delta + sum_R rho`` over disjoint donor and receiver
sets of equal size ``n`` (the total ``sum (dL + eps)`` over its moves, relative to every row taking its own best
swap). This value ``F(n)`` is convex in ``n`` (a min-cost flow with capacities ``n``); for given ``n`` the donors
precede the receivers in the order of ``remove - add`` (an exchange argument), so ``F(n)`` is the best split of that
order into a prefix giving its ``n`` smallest ``delta`` and a suffix giving its ``n`` smallest ``rho``
(``O(N log n)`` with a heap), and the smallest minimiser ``n`` is found by bisection. With that smallest ``n``,
pairing the donors' removals ascending with the receivers' restores descending makes every pair improving.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba as nb
import numpy as np


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
