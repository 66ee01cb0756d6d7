"""Per-row submatrices of a shared Gram matrix, ``G[rows[r, a], cols[r, b]]`` for every row ``r``: the kept systems
``G_SS`` of the least-squares re-fit and the cross terms ``G[S, P]`` of the re-fit objective's state.

On the CPU a parallel numba loop copies them one row of ``G`` at a time (the row's column gathers stay in cache),
where torch's advanced indexing computes every element's offset from two broadcast index tensors: the
least-squares re-fit takes 11-22% less and the state build 6-10% (BENCHMARKS.md, "Gathering the Gram's
submatrices"). Elsewhere advanced indexing. The entries are copies, identical either way.
"""

from __future__ import annotations

import numba as nb
import torch


@nb.njit(parallel=True, cache=True)
def _gather(gram, rows, cols, out):  # pragma: no cover - compiled
    for r in nb.prange(rows.shape[0]):
        for a in range(rows.shape[1]):
            source = gram[rows[r, a]]
            for b in range(cols.shape[1]):
                out[r, a, b] = source[cols[r, b]]


def gather_gram(gram: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``[R, A, B]`` ``gram[rows[r, a], cols[r, b]]``, as ``gram[rows[:, :, None], cols[:, None, :]]``.

    Args:
        gram: ``[d, d]`` float tensor; rows: ``[R, A]`` and cols: ``[R, B]`` int64 indices in ``[0, d)`` (not
            checked on the CPU: the callers build them from masks). Nothing is modified.

    Returns:
        A new tensor in ``gram``'s dtype, on its device.
    """
    if gram.device.type != "cpu" or gram.requires_grad:
        return gram[rows[:, :, None], cols[:, None, :]]
    out = torch.empty(rows.shape[0], rows.shape[1], cols.shape[1], dtype=gram.dtype)
    _gather(gram.contiguous().numpy(), rows.contiguous().numpy(), cols.contiguous().numpy(), out.numpy())
    return out
