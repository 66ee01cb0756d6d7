"""The re-fit objective's float64 state and its exact updates: the torch reference every re-fit engine is checked
against, and the pieces the engines share (kernels import no stage code: these live here, among the backends).

The math (:mod:`~sparseswaps_prune.core.refit_swaps` tells it whole): per row with kept set ``S``, ``H = (G_SS +
lambda I)^{-1}``, ``v = H b_S``, ``r = b - G v``, ``Z = H G[S, P]`` and the Schur complements ``s_p``; removing kept
``u`` changes the damped re-fit objective ``F`` by ``v_u^2 / H_uu``, restoring pruned ``p`` by ``-r_p^2 / s_p``, the
swap by ``v_u^2 / H_uu - (r_p + Z_up v_u / H_uu)^2 / (s_p + Z_up^2 / H_uu)``; a move updates the state by rank-one
terms. Slots: each row holds its kept inputs in ``K`` kept slots and its pruned inputs in ``Q`` pruned slots (vacant
slots pad rows with fewer inputs); ties are broken by input index.

:class:`RefitState` holds the state of a batch of rows; :func:`build_state` builds it (by :func:`factor_kept`, the
kept-set Cholesky shared with the least-squares re-fit of :mod:`~sparseswaps_prune.core.refit`);
:func:`scan_swaps`, :func:`remove_kept`, :func:`add_pruned`, :func:`swap_slots` are the reference scan and moves.
The engines behind the contract of :mod:`.refit_engine` (the torch reference, :mod:`.refit_numba`,
:mod:`.refit_lazy_triton`) read and build their states with these.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from sparseswaps_prune.core.backends.gram_gather import gather_gram

# Elements of the [rows, k, d_in - k] temporaries of one chunk of the pair scan (32 MiB float64 each).
SCAN_ELEMENTS = 1 << 22
# A restore is feasible only if its new pivot s exceeds this fraction of G_pp + lambda (conditioning guard).
PIVOT_RTOL = 1e-10
# A swap is applied only if it lowers F by more than eps + ACCEPT_RTOL * w^T G w (rounding floor of the state).
ACCEPT_RTOL = 1e-12
# A scan may skip a restore slot p when its bound -r_p^2 / s_p on every dF(u, p) exceeds a cost already reached by
# this relative margin (rounding guard; the evaluation error of a pair cost is a few ulps of remove_u + gain_p).
SKIP_RTOL = 1e-12


@dataclass
class RefitState:
    """Float64 state of the re-fit objective for a batch of ``R`` rows (see the module docstring).

    Attributes:
        kept: ``[R, K]`` int64 input held by each kept slot (0 where vacant).
        kept_ok: ``[R, K]`` bool, slot holds a kept input.
        pruned: ``[R, Q]`` int64 input held by each pruned slot (0 where vacant).
        pruned_ok: ``[R, Q]`` bool, slot holds a pruned input.
        inv: ``[R, K, K]`` ``H = (G_SS + lambda I)^{-1}`` (zero rows and columns at vacant slots). ``H`` is
            symmetric and read only on and above its diagonal (:func:`inv_column`; the rank-one updates round the
            two triangles differently).
        coef: ``[R, K]`` re-fitted weights ``v = H b_S``.
        resid: ``[R, Q]`` ``r_p = b_p - G[p, S] v`` (0 at vacant slots).
        schur: ``[R, Q]`` ``s_p`` (1 at vacant slots).
        z: ``[R, K, Q]`` ``Z = H G[S, P]``.
    """

    kept: torch.Tensor
    kept_ok: torch.Tensor
    pruned: torch.Tensor
    pruned_ok: torch.Tensor
    inv: torch.Tensor
    coef: torch.Tensor
    resid: torch.Tensor
    schur: torch.Tensor
    z: torch.Tensor

    def assign(self, rows: torch.Tensor, other: RefitState) -> None:
        """Overwrite rows ``rows`` with ``other`` (same slot counts), in place."""
        for f in fields(self):
            getattr(self, f.name)[rows] = getattr(other, f.name)

    def h_diagonal(self, rows: torch.Tensor) -> torch.Tensor:
        """``[n, K]`` diagonal of ``H`` of rows ``rows`` (``[n]`` int64)."""
        return torch.diagonal(self.inv, dim1=1, dim2=2)[rows]

    def z_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """``[n, K, Q]`` ``Z`` of rows ``rows`` (``[n]`` int64; a copy)."""
        return self.z[rows]

    def z_columns(self, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``[n, K, c]`` columns ``Z[:, slots[n]]`` of each row ``rows[n]`` (``slots``: ``[n, c]`` pruned slots)."""
        return self.z[rows[:, None], :, slots].transpose(1, 2)


def inv_column(state: RefitState, rows: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """``[n, K]`` column ``H[:, slot[n]]`` of each row ``rows[n]``, read on and above the diagonal: ``H[x, slot]``
    for ``x <= slot``, ``H[slot, x]`` below (``H`` is symmetric; its triangles differ by rounding)."""
    above = torch.arange(state.inv.shape[1], device=slot.device)[None, :] <= slot[:, None]
    return torch.where(above, state.inv[rows, :, slot], state.inv[rows, slot, :])


def pruned_slots(keep: torch.Tensor, n_pruned_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pruned slots of every row of ``keep`` (``[R, d]`` bool kept mask, not modified): ``[R, Q]`` int64 its pruned
    inputs ascending (0 at vacant slots) and ``[R, Q]`` bool, the slot holds a pruned input."""
    d = keep.shape[1]
    pruned = torch.sort(keep.to(torch.int8), dim=1, stable=True).indices[:, :n_pruned_slots]  # pruned first
    pruned_ok = torch.arange(n_pruned_slots, device=keep.device) < (d - keep.sum(dim=1))[:, None]
    return torch.where(pruned_ok, pruned, 0), pruned_ok


def factor_kept(
    gram64: torch.Tensor,
    keep: torch.Tensor,
    lam: float | torch.Tensor,
    n_slots: int,
    *,
    row_offset: int | torch.Tensor = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cholesky factor of every row's kept-set system ``G_SS + lambda I``, padded to ``n_slots`` slots.

    Args:
        gram64: ``[d, d]`` float64 Gram matrix; keep: ``[R, d]`` bool kept mask (neither modified).
        lam: absolute damping ``lambda`` (:func:`damping`): a float, or ``[d]`` float64 per input (the system is
            then ``G_SS + diag(lambda_S)``).
        n_slots: slot count ``K >= max_i k_i``; rows keeping fewer inputs get an identity block in the spare slots.
        row_offset: layer index of row 0 (an int), or ``[R]`` int64 layer indices, for the error message.

    Returns:
        ``slots`` ``[R, K]`` int64: each row's kept inputs ascending, then (spare slots) its first pruned inputs;
        ``valid`` ``[R, K]`` bool: the slot holds a kept input; ``factor`` ``[R, K, K]`` float64 lower Cholesky
        factor of ``G_SS + lambda I`` (identity rows and columns at spare slots).

    Raises:
        ValueError: ``G_SS + lambda I`` is not positive definite for some rows (names them; raise ``damp``).
    """
    counts = keep.sum(dim=1)
    # kept inputs first (ascending), then the pruned ones
    slots = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :n_slots]
    valid = torch.arange(n_slots, device=keep.device) < counts[:, None]
    system = gather_gram(gram64, slots, slots)
    system.diagonal(dim1=1, dim2=2).add_(lam[slots] if isinstance(lam, torch.Tensor) else lam)
    padded = counts < n_slots
    if bool(padded.any()):
        pair_valid = valid[padded, :, None] & valid[padded, None, :]
        eye = torch.eye(n_slots, dtype=torch.float64, device=keep.device)
        system[padded] = torch.where(pair_valid, system[padded], eye)
    factor, info = torch.linalg.cholesky_ex(system)
    if bool((info != 0).any()):
        bad = torch.nonzero(info).flatten()
        named = (row_offset[bad] if isinstance(row_offset, torch.Tensor) else bad + row_offset).tolist()[:5]
        shown = f"{lam:.3g}" if not isinstance(lam, torch.Tensor) else f"damp * G_jj, min {float(lam.min()):.3g}"
        raise ValueError(
            f"G_SS + lambda I is singular for rows {named} (kept inputs with no calibration signal or collinear, "
            f"lambda={shown}); use damp > 0"
        )
    return slots, valid, factor


def build_state(
    w64: torch.Tensor,
    keep: torch.Tensor,
    gram64: torch.Tensor,
    lam: float,
    n_kept_slots: int,
    n_pruned_slots: int,
    *,
    row_offset: int | torch.Tensor = 0,
    triangular_inverse: bool | None = None,
    transposed_z: bool = False,
    z_out: torch.Tensor | None = None,
) -> RefitState:
    """Re-fit state of every row from scratch, ``O(k^2 (d_in - k) + k^3)`` per row: the Cholesky factor ``L`` of
    ``G_SS + lambda I``, then ``H``, and ``v = H b_S``, ``Z = H G[S, P]`` as batched matrix products (on the CPU
    faster than triangular solves against ``L``; BENCHMARKS.md, "Re-fit-objective swaps").

    Args:
        w64: ``[R, d]`` float64 weights; keep: ``[R, d]`` bool kept mask (neither modified).
        gram64: ``[d, d]`` float64 Gram matrix; lam: absolute damping ``lambda``.
        n_kept_slots, n_pruned_slots: slot counts ``K >= max k_i`` and ``Q >= max (d - k_i)``.
        row_offset: layer index of row 0 (an int), or ``[R]`` layer indices, for error messages.
        triangular_inverse: form ``H = L^-T L^-1`` from the factor's triangular inverse (a batched triangular solve
            against ``I``, then a product) instead of by ``torch.cholesky_inverse`` (LAPACK's ``potri`` on the CPU,
            there the faster); batched Cholesky solves with many right-hand sides ran far below the float64 peak on
            CUDA (BENCHMARKS.md, "GPU"). The two agree to rounding. None: True on CUDA, False elsewhere.
        transposed_z: form ``Z^T = G[P, S] H`` (``[R, Q, K]``, a column of ``Z`` contiguous: the numba engine's
            layout) and return ``z`` as its ``[R, K, Q]`` transpose view.
        z_out: a contiguous float64 buffer the product is written into, ``[R, Q, K]`` with ``transposed_z`` (the
            returned ``z`` is its transpose view), else ``[R, K, Q]``: e.g. rows of the caller's state, which then
            need no copy of the state's largest part.

    Returns:
        A new :class:`RefitState` (float64 on ``w64``'s device, every tensor contiguous but ``z`` with
        ``transposed_z``).

    Raises:
        ValueError: ``G_SS + lambda I`` is not positive definite for some rows (names them; raise ``damp``).
    """
    dev = w64.device
    kept, kept_ok, factor = factor_kept(gram64, keep, lam, n_kept_slots, row_offset=row_offset)
    kept = torch.where(kept_ok, kept, 0)
    pruned, pruned_ok = pruned_slots(keep, n_pruned_slots)

    target = w64 @ gram64  # b = G w, G symmetric
    kept_target = torch.where(kept_ok, target.gather(1, kept), 0.0)[:, :, None]
    if triangular_inverse is None:
        triangular_inverse = dev.type == "cuda"
    if triangular_inverse:
        eye = torch.eye(n_kept_slots, dtype=torch.float64, device=dev).expand_as(factor)
        half = torch.linalg.solve_triangular(factor, eye, upper=False)  # L^-1
        inv = half.mT @ half
    else:
        inv = torch.cholesky_inverse(factor).mT  # exactly symmetric: .mT is its row-major view
    # Spare kept slots are identity rows and columns of the system (factor_kept), so H is exactly zero off the
    # diagonal there; zeroing that diagonal zeroes H's rows and columns at vacant kept slots, and with them v, Z and
    # every contribution of the (unmasked) gathered Gram entries at those slots below.
    inv.diagonal(dim1=1, dim2=2).mul_(kept_ok)
    coef = (inv @ kept_target).squeeze(2)
    if transposed_z:
        cross = gather_gram(gram64, pruned, kept)
        cross[~pruned_ok] = 0.0  # vacant pruned slots: zero Z there
        z = torch.matmul(cross, inv, out=z_out)  # Z^T = G[P, S] H
        fitted, quad = (cross @ coef[:, :, None]).squeeze(2), _product_sums(cross, z, 2)  # G[p, S] v, G[p, S] Z[:, p]
        z = z.mT
    else:
        cross = gather_gram(gram64, kept, pruned)
        cross.mT[~pruned_ok] = 0.0
        z = torch.matmul(inv, cross, out=z_out)
        fitted, quad = torch.einsum("rkq,rk->rq", cross, coef), _product_sums(cross, z, 1)  # (an einsum is slower)
    resid = torch.where(pruned_ok, target.gather(1, pruned) - fitted, 0.0)
    schur = torch.where(pruned_ok, torch.diagonal(gram64)[pruned] + lam - quad, 1.0)
    # the state is row-major like the preallocated one rows are assigned into
    return RefitState(kept, kept_ok, pruned, pruned_ok, inv.contiguous(), coef, resid, schur, z)


def _product_sums(a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
    """``(a * b).sum(dim)`` of two ``[R, ...]`` tensors, bit for bit; on the CPU row by row: there the batch's
    temporary product (0.5 GB for 16 rows at 4096 inputs) is a fresh buffer whose page faults cost more than the
    product (BENCHMARKS.md, "The Schur complements row by row on the CPU")."""
    if a.device.type != "cpu":
        return (a * b).sum(dim=dim)
    return torch.stack([(x * y).sum(dim=dim - 1) for x, y in zip(a, b, strict=True)])


def restorable(state: RefitState, w64: torch.Tensor, rows: torch.Tensor | slice = slice(None)) -> torch.Tensor:
    """``[n, Q]`` bool: pruned slots whose weight is nonzero (exact zeros are never restored)."""
    return state.pruned_ok[rows] & (w64[rows].gather(1, state.pruned[rows]) != 0)


def _tie_break(cost: torch.Tensor, key: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """Flat index of the entry of smallest ``key`` among those equal to the row minimum ``best``."""
    big = torch.iinfo(torch.long).max
    return torch.where(cost == best[:, None], key, big).argmin(dim=1)


def no_swaps(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A scan's answer for ``n`` rows without a feasible pair: ``dF = +inf``, kept and pruned slot 0."""
    slot_i = torch.zeros(n, dtype=torch.long, device=device)
    return torch.full((n,), float("inf"), dtype=torch.float64, device=device), slot_i, torch.zeros_like(slot_i)


def removal_terms(state: RefitState, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pair scan's ``[n, K]`` kept-slot terms of rows ``rows``: ``H_uu`` (1 at vacant slots), ``v_u / H_uu`` and
    ``v_u^2 / H_uu``, computed as every scan engine must to give the same costs."""
    h_safe = torch.where(state.kept_ok[rows], state.h_diagonal(rows), 1.0)
    ratio = state.coef[rows] / h_safe
    return h_safe, ratio, state.coef[rows] * ratio


def pair_costs(
    z: torch.Tensor,
    h_safe: torch.Tensor,
    ratio: torch.Tensor,
    remove: torch.Tensor,
    kept: torch.Tensor,
    kept_ok: torch.Tensor,
    schur: torch.Tensor,
    resid: torch.Tensor,
    pruned: torch.Tensor,
    pruned_ok: torch.Tensor,
    pivot_floor: torch.Tensor,
    m: int | None,
) -> torch.Tensor:
    """The pair costs ``dF(u, p) = remove_u - (r_p + Z_up ratio_u)^2 / (s_p + Z_up^2 / H_uu)`` of the entries of
    ``z`` (``+inf`` where the pair is infeasible), with the operations and order every scan engine must use.

    ``z``: ``[n, A, B]`` float64 entries of ``Z`` (not modified); the kept-slot terms (``h_safe``, ``ratio``,
    ``remove`` of :func:`removal_terms`, ``kept`` inputs, ``kept_ok``) broadcast as ``[n, A, 1]``, the pruned-slot
    terms (``schur``, ``resid``, ``pruned`` inputs, ``pruned_ok`` restorable) as ``[n, 1, B]``; ``pivot_floor``:
    ``[d]``; m: N:M block size or None. Returns a new ``[n, A, B]`` float64 tensor (two of that size allocated).
    """
    # in place over [n, A, B]: pivot = s_p + Z_up^2 / H_uu, cost = remove_u - (r_p + Z_up ratio_u)^2 / pivot
    pivot = z.square().div_(h_safe).add_(schur)
    cost = z.mul(ratio).add_(resid).square_().div_(pivot)
    ok = pivot > pivot_floor[pruned]
    ok &= kept_ok
    ok &= pruned_ok
    if m is not None:
        ok &= kept // m == pruned // m
    return cost.neg_().add_(remove).masked_fill_(~ok, float("inf"))


def scan_swaps(
    state: RefitState,
    w64: torch.Tensor,
    rows: torch.Tensor,
    pivot_floor: torch.Tensor,
    m: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Best swap of every row in ``rows``, ``O(k (d_in - k))`` per row (chunked to ``SCAN_ELEMENTS``).

    Args:
        state: the batch state (not modified); w64: ``[R, d]`` float64 weights.
        rows: ``[n]`` int64 rows of the batch to scan.
        pivot_floor: ``[d]`` smallest admissible new pivot per input, from :func:`pivot_floor`.
        m: N:M block size (``u`` and ``p`` in one block of ``m`` inputs), or None.

    Returns:
        ``dF`` ``[n]`` float64 (``+inf`` where no feasible pair), kept slot ``i`` and pruned slot ``j`` ``[n]``
        int64. Ties go to the smallest ``u`` (input index), then the smallest ``p``.
    """
    n = rows.numel()
    k_slots, q_slots = state.kept.shape[1], state.pruned.shape[1]
    d = w64.shape[1]
    best, slot_i, slot_j = no_swaps(n, w64.device)
    if n == 0 or k_slots == 0 or q_slots == 0:
        return best, slot_i, slot_j
    chunk = max(1, SCAN_ELEMENTS // (k_slots * q_slots))
    for c0 in range(0, n, chunk):
        sub = rows[c0 : c0 + chunk]
        kept, pruned = state.kept[sub], state.pruned[sub]
        kept_terms = [t[:, :, None] for t in (*removal_terms(state, sub), kept, state.kept_ok[sub])]
        restore_ok = restorable(state, w64, sub)
        pruned_terms = [t[:, None, :] for t in (state.schur[sub], state.resid[sub], pruned, restore_ok)]
        cost = pair_costs(state.z_rows(sub), *kept_terms, *pruned_terms, pivot_floor, m).flatten(1)
        low, flat = cost.min(dim=1)  # first slot on ties; the index rule is applied to tied rows only
        tied = ((cost == low[:, None]).sum(dim=1) > 1) & (low < float("inf"))
        if bool(tied.any()):
            key = (kept[tied][:, :, None] * d + pruned[tied][:, None, :]).flatten(1)
            flat[tied] = _tie_break(cost[tied], key, low[tied])
        best[c0 : c0 + chunk] = low
        slot_i[c0 : c0 + chunk] = flat // q_slots
        slot_j[c0 : c0 + chunk] = flat % q_slots
    return best, slot_i, slot_j


def _row_min(cost: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row minimum of ``cost`` ``[n, w]`` (``+inf`` when ``w == 0``) and the column of smallest ``key`` reaching it."""
    if cost.shape[1] == 0:
        n = cost.shape[0]
        return cost.new_full((n,), float("inf")), torch.zeros(n, dtype=torch.long, device=cost.device)
    low = cost.min(dim=1).values
    return low, _tie_break(cost, key, low)


def best_removals(state: RefitState, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cheapest removal per row: ``min_u v_u^2 / H_uu`` (``+inf`` if nothing is kept) and its kept slot
    (ties to the smallest ``u``)."""
    kept_ok = state.kept_ok[rows]
    h = state.h_diagonal(rows)
    coef = state.coef[rows]
    cost = torch.where(kept_ok, coef * coef / torch.where(kept_ok, h, 1.0), float("inf"))
    return _row_min(cost, state.kept[rows])


def best_additions(
    state: RefitState, w64: torch.Tensor, rows: torch.Tensor, pivot_floor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Best restore per row: ``min_p -r_p^2 / s_p`` over restorable ``p`` (``+inf`` if none) and its pruned slot
    (ties to the smallest ``p``)."""
    schur, pruned = state.schur[rows], state.pruned[rows]
    ok = restorable(state, w64, rows) & (schur > pivot_floor[pruned])
    gain = torch.where(ok, -state.resid[rows].square() / torch.where(ok, schur, 1.0), float("inf"))
    return _row_min(gain, pruned)


def add_rows(target: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    """``target[rows] += src`` in place for distinct ``rows``. On the CPU row by row: ``index_add_`` there is
    multi-threaded even for tiny updates and stalls on a busy machine; elsewhere ``index_add_``."""
    if target.device.type != "cpu":
        target.index_add_(0, rows, src)
        return
    for i, r in enumerate(rows.tolist()):
        target[r].add_(src[i])


def add_outer(target: torch.Tensor, rows: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``target[rows[n]] += a[n, :, None] * b[n, None, :]`` in place (``target`` ``[R, A, B]``, distinct ``rows``)."""
    add_rows(target, rows, a[:, :, None] * b[:, None, :])


Incoming = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def remove_kept(state: RefitState, rows: torch.Tensor, slot: torch.Tensor) -> Incoming:
    """Prune the input in kept slot ``slot[n]`` of each row ``rows[n]`` (distinct rows), in place.

    Downdates ``H``, ``v``, ``Z``, ``r``, ``s`` (``O(k (d_in - k) + k^2)`` per row) and vacates the slot. Returns the
    pruned input's new pruned-slot entries ``(u, Z[:, u], r_u, s_u)`` = ``(u, -H[:, u] / H_uu, v_u / H_uu, 1 / H_uu)``
    for :func:`place_pruned` or :func:`add_pruned`.
    """
    ar = torch.arange(rows.numel(), device=rows.device)
    h = inv_column(state, rows, slot)  # [n, K] column H[:, u]
    h_uu = h[ar, slot]
    ratio = state.coef[rows, slot] / h_uu
    z_row = state.z[rows, slot, :]  # [n, Q]
    scaled = h / -h_uu[:, None]
    add_outer(state.inv, rows, h, scaled)
    state.coef[rows] -= h * ratio[:, None]
    add_outer(state.z, rows, scaled, z_row)
    state.resid[rows] += z_row * ratio[:, None]
    state.schur[rows] += z_row * z_row / h_uu[:, None]
    state.inv[rows, slot, :] = 0.0
    state.inv[rows, :, slot] = 0.0
    state.coef[rows, slot] = 0.0
    state.z[rows, slot, :] = 0.0
    u = state.kept[rows, slot]
    state.kept[rows, slot] = 0
    state.kept_ok[rows, slot] = False
    scaled[ar, slot] = 0.0
    return u, scaled, ratio, 1.0 / h_uu


def place_pruned(state: RefitState, rows: torch.Tensor, slot: torch.Tensor, incoming: Incoming) -> None:
    """Write a just-pruned input (from :func:`remove_kept`) into vacant pruned slot ``slot`` of each row."""
    u, z_col, resid, schur = incoming
    state.z[rows, :, slot] = z_col
    state.resid[rows, slot] = resid
    state.schur[rows, slot] = schur
    state.pruned[rows, slot] = u
    state.pruned_ok[rows, slot] = True


def restore_vector(
    state: RefitState, rows: torch.Tensor, p: torch.Tensor, y: torch.Tensor, gram64: torch.Tensor
) -> torch.Tensor:
    """``[n, Q]`` restore vector ``t_q = G_pq - G[p, S] Z[:, q]`` of restoring input ``p[n]`` with column
    ``y[n] = Z[:, p]`` (``[n, K]``, zero at vacant kept slots) into each row ``rows[n]``, over the rows' current
    pruned slots (0 at vacant ones). Read off the shared Gram, ``G[p, S] Z[:, q] = y^T G[S, q]`` (``H`` is
    symmetric): ``y`` spread over the inputs, one ``[n, d] x [d, d]`` product (only the state's slots are read)."""
    gram_p, pruned = gram64[p], state.pruned[rows]  # [n, d] rows G[p, :]
    spread = torch.zeros_like(gram_p).scatter_add_(1, state.kept[rows], y)
    return (gram_p.gather(1, pruned) - (spread @ gram64).gather(1, pruned)) * state.pruned_ok[rows]


def add_pruned(
    state: RefitState,
    rows: torch.Tensor,
    slot: torch.Tensor,
    dest: torch.Tensor,
    gram64: torch.Tensor,
    incoming: Incoming | None = None,
) -> None:
    """Restore the input in pruned slot ``slot`` of each row into vacant kept slot ``dest``, in place.

    Block-inverse update of ``H`` with the pivot ``s_p`` and rank-one updates of ``v``, ``Z``, ``r``, ``s``
    (``O(k (d_in - k) + k^2)`` per row). The update's vector ``t`` is read off the shared Gram
    (:func:`restore_vector`) instead of a pass over the rows' ``Z``. With ``incoming`` (a swap) the input pruned by
    :func:`remove_kept` takes over the pruned slot; otherwise the slot is vacated.
    """
    ar = torch.arange(rows.numel(), device=rows.device)
    y = state.z[rows, :, slot]  # [n, K] Z[:, p] (zero at the vacant dest)
    pivot = state.schur[rows, slot]
    ratio = state.resid[rows, slot] / pivot  # the restored weight's re-fitted value
    p = state.pruned[rows, slot]
    if incoming is None:
        place_pruned(state, rows, slot, (torch.zeros_like(p), torch.zeros_like(y), 0.0, 1.0))
        state.pruned_ok[rows, slot] = False
    else:
        place_pruned(state, rows, slot, incoming)
    t = restore_vector(state, rows, p, y, gram64)
    y[ar, dest] = -1.0
    add_outer(state.inv, rows, y, y / pivot[:, None])
    state.coef[rows] -= y * ratio[:, None]
    add_outer(state.z, rows, y / -pivot[:, None], t)
    state.resid[rows] -= t * ratio[:, None]
    state.schur[rows] -= t * t / pivot[:, None]
    state.kept[rows, dest] = p
    state.kept_ok[rows, dest] = True


def swap_slots(
    state: RefitState,
    rows: torch.Tensor,
    slot_i: torch.Tensor,
    slot_j: torch.Tensor,
    gram64: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Swap kept slot ``slot_i`` and pruned slot ``slot_j`` of each row (prune ``u``, restore ``p``), in place.

    Returns the inputs ``(u, p)`` ``[n]``.
    """
    p = state.pruned[rows, slot_j]
    incoming = remove_kept(state, rows, slot_i)
    add_pruned(state, rows, slot_j, slot_i, gram64, incoming)
    return incoming[0], p


def grow(state: RefitState, n_kept_slots: int, n_pruned_slots: int) -> RefitState:
    """A copy of ``state`` with at least the given slot counts (new slots vacant)."""
    rows, k_old, q_old = state.z.shape
    k_new, q_new = max(k_old, n_kept_slots), max(q_old, n_pruned_slots)

    def pad(t: torch.Tensor, shape: tuple[int, ...], fill: float | bool | int = 0) -> torch.Tensor:
        out = torch.full(shape, fill, dtype=t.dtype, device=t.device)
        out[tuple(slice(0, s) for s in t.shape)] = t
        return out

    return RefitState(
        kept=pad(state.kept, (rows, k_new)),
        kept_ok=pad(state.kept_ok, (rows, k_new), False),
        pruned=pad(state.pruned, (rows, q_new)),
        pruned_ok=pad(state.pruned_ok, (rows, q_new), False),
        inv=pad(state.inv, (rows, k_new, k_new)),
        coef=pad(state.coef, (rows, k_new)),
        resid=pad(state.resid, (rows, q_new)),
        schur=pad(state.schur, (rows, q_new), 1.0),
        z=pad(state.z, (rows, k_new, q_new)),
    )


def keep_of(state: RefitState, d: int) -> torch.Tensor:
    """``[R, d]`` bool kept mask held by the state."""
    out = torch.zeros(state.kept.shape[0], d, dtype=torch.long, device=state.kept.device)
    return out.scatter_add_(1, state.kept, state.kept_ok.long()) > 0


def fitted_weights(state: RefitState, d: int) -> torch.Tensor:
    """``[R, d]`` float64 re-fitted weights ``v`` (zero off the kept set)."""
    out = torch.zeros(state.kept.shape[0], d, dtype=torch.float64, device=state.coef.device)
    return out.scatter_add_(1, state.kept, torch.where(state.kept_ok, state.coef, 0.0))


def pivot_floor(gram64: torch.Tensor, lam: float) -> torch.Tensor:
    """``[d]`` smallest admissible pivot ``s`` when restoring each input, ``PIVOT_RTOL * (G_pp + lambda)``."""
    return PIVOT_RTOL * (torch.diagonal(gram64) + lam)
