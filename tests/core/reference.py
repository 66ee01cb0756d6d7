"""Float64 brute-force references: recompute the loss of every feasible swapped mask from scratch."""

from __future__ import annotations

import torch


def row_loss(w: torch.Tensor, gram: torch.Tensor, keep: torch.Tensor) -> float:
    r = torch.where(keep, 0.0, w).double()
    return float(r @ gram.double() @ r)


def brute_best_swap(w, gram, keep, m: int | None = None):
    """(dL, u, p) of the best swap of one row by exhaustive search, ties to smallest u then p."""
    base = row_loss(w, gram, keep)
    best = (float("inf"), -1, -1)
    d = w.numel()
    for u in range(d):
        if not keep[u]:
            continue
        for p in range(d):
            if keep[p] or w[p] == 0 or (m is not None and u // m != p // m):
                continue
            trial = keep.clone()
            trial[u], trial[p] = False, True
            dl = row_loss(w, gram, trial) - base
            if dl < best[0] - 1e-9 * max(1.0, abs(base)):
                best = (dl, u, p)
    return best


def brute_refine(w, gram, keep, max_iters: int, m: int | None = None):
    """Per-row greedy best-improvement loop with the brute-force search; returns (mask, swaps list)."""
    keep = keep.clone()
    history = []
    for r in range(w.shape[0]):
        row_swaps = []
        for _ in range(max_iters):
            dl, u, p = brute_best_swap(w[r], gram, keep[r], m)
            if not dl < 0:
                break
            keep[r, u], keep[r, p] = False, True
            row_swaps.append((u, p))
        history.append(row_swaps)
    return keep, history


def layer_problem(d_out: int, d_in: int, seed: int = 0, dtype=torch.float64, tokens: int | None = None):
    """Random weight and a correlated Gram matrix (features with unequal scales)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = tokens or 4 * d_in
    eye = torch.eye(d_in, dtype=torch.float64)
    mixing = torch.randn(d_in, d_in, generator=gen, dtype=torch.float64) / d_in**0.5 + eye
    x = torch.randn(tokens, d_in, generator=gen, dtype=torch.float64) @ mixing
    x = x * torch.rand(d_in, generator=gen, dtype=torch.float64).add(0.2)
    weight = torch.randn(d_out, d_in, generator=gen, dtype=torch.float64)
    return weight.to(dtype), (x.T @ x).to(dtype)
