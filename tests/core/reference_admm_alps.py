"""Test oracles: near-verbatim transcriptions of the original ADMM and ALPS pruners (torch, CPU, small).

* ``admm_fasterprune``: ``AdmmPruner.fasterprune`` from github.com/fmfi-compbio/admm-pruning, ``lib/admm.py``,
  commit 80392084a939dff5b15a160fb46499b478905506 (Boza 2024). ``self.XX`` (the summed ``X^T X``) and
  ``self.layer.weight`` become arguments; prints and the layer write-back are dropped; the new weight and the
  final mask are returned.
* ``alps_admm``: ``ALPS_prune.ALPS_admm`` and ``ALPS_prune.cg_batch`` from github.com/mazumder-lab/ALPS,
  ``alps.py``, commit 8af9e6b5c8b1b06a028bde6065e5c38829df3a19 (Meng et al. 2024). ``self.XtX`` (the summed
  ``X^T X``) and the weight become arguments, ``'cuda:0'`` becomes the inputs' device, the diagnostics that
  never change the result (``Res0``, ``Btest``, ``errorc``, timings) are dropped; returns the new weight and
  the number of ADMM iterations run.

Code of both is kept as in the originals (including their quirks) so the tests compare against them.
"""

from __future__ import annotations

import numpy as np
import torch


def admm_fasterprune(weight, XX, sparsity, prune_n=0, prune_m=0, percdamp=0.1, iterative_prune=15, iters=20,
                     per_out=False):  # fmt: skip
    """Returns ``(new weight [d_out, d_in], keep mask [d_out, d_in])``."""
    XX = XX.clone().float()
    norm = torch.diag(XX).sqrt() + 1e-8
    XX = XX / norm
    XX = (XX.T / norm).T
    W = (weight.float().detach() * norm).T

    rho0 = percdamp * torch.diag(XX).mean()
    diag = torch.arange(XX.shape[0], device=XX.device)
    XX[diag, diag] += rho0

    if iterative_prune == 0:
        if prune_n != 0:
            WT = W.T.reshape((W.shape[1] * W.shape[0] // 4, 4)).abs()
            mask = torch.zeros_like(WT)
            sort_inds = WT.sort(dim=1)[1]
            mask[torch.arange(WT.shape[0]), sort_inds[:, 2]] = 1
            mask[torch.arange(WT.shape[0]), sort_inds[:, 3]] = 1
            mask = mask.reshape(W.T.shape).T
            mask = mask.bool()  # (added: the original multiplies by the float mask)
        elif per_out:
            thres = (W).abs().sort(dim=0)[0][int(W.shape[0] * sparsity)]
            mask = (W).abs() >= thres.unsqueeze(0)
            del thres
        else:
            topk = torch.topk(W.abs().flatten(), k=int(W.numel() * sparsity), largest=False)
            mask = torch.ones(W.numel(), dtype=torch.bool, device=W.device)
            mask[topk.indices] = 0
            mask = mask.reshape(W.shape)
            del topk

    if iters == 0:
        Z = (W) * mask
        out = Z.T / norm
        return out.reshape(weight.shape).to(weight.dtype), mask.T

    rho = 1

    XY = XX.matmul(W)
    XX[diag, diag] += rho
    XXinv = torch.inverse(XX)
    del XX
    U = torch.zeros_like(W)

    for itt in range(iters):
        if iterative_prune > 0 and itt < iterative_prune:
            if prune_n != 0:
                sparsity = 0.5
                cur_sparsity = sparsity - sparsity * (1 - (itt + 1) / iterative_prune) ** 3
                WT = (W + U).T.reshape((W.shape[1] * W.shape[0] // 4, 4)).abs()
                mask = torch.zeros(WT.shape, dtype=torch.bool)
                sort_inds = WT.sort(dim=1)[1]
                mask[torch.arange(WT.shape[0]), sort_inds[:, 2]] = 1
                mask[torch.arange(WT.shape[0]), sort_inds[:, 3]] = 1
                mask = mask.reshape(W.T.shape).T

                Z2 = (W + U).abs()
                Z2[mask] = torch.inf
                thres = Z2.flatten().kthvalue(int(W.numel() * cur_sparsity) + 1)[0]
                mask = Z2 >= thres
                del thres

            else:
                cur_sparsity = sparsity - sparsity * (1 - (itt + 1) / iterative_prune) ** 3
                if per_out:
                    thres = (W + U).abs().sort(dim=0)[0][int(W.shape[0] * cur_sparsity)]
                    mask = (W + U).abs() >= thres.unsqueeze(0)
                    del thres
                else:
                    topk = torch.topk((W + U).abs().flatten(), k=int(W.numel() * sparsity), largest=False)
                    mask = torch.ones(W.numel(), dtype=torch.bool, device=W.device)
                    mask[topk.indices] = 0
                    mask = mask.reshape(W.shape)
                    del topk

        Z = (W + U) * mask

        U = U + (W - Z)

        W = XXinv.matmul(XY + rho * (Z - U))

    Z = (W + U) * mask
    out = Z.T / norm
    return out.reshape(weight.shape).to(weight.dtype), mask.T


def admm_fixed_mask(weight, XX, keep_mask, percdamp=0.1, iters=20):
    """``fasterprune`` with ``iterative_prune=0`` and its magnitude mask replaced by ``keep_mask`` (the
    paper's weight update for a given mask); returns the new weight."""
    XX = XX.clone().float()
    norm = torch.diag(XX).sqrt() + 1e-8
    XX = XX / norm
    XX = (XX.T / norm).T
    W = (weight.float().detach() * norm).T
    rho0 = percdamp * torch.diag(XX).mean()
    diag = torch.arange(XX.shape[0], device=XX.device)
    XX[diag, diag] += rho0
    mask = keep_mask.T
    rho = 1
    XY = XX.matmul(W)
    XX[diag, diag] += rho
    XXinv = torch.inverse(XX)
    U = torch.zeros_like(W)
    for _itt in range(iters):
        Z = (W + U) * mask
        U = U + (W - Z)
        W = XXinv.matmul(XY + rho * (Z - U))
    Z = (W + U) * mask
    out = Z.T / norm
    return out.reshape(weight.shape).to(weight.dtype)


def alps_admm(weight, XtX, sp, nm_n=0, nm_m=0, rho=0.1, max_iter=300, update_iter=3, switch_iter=30):
    """Returns ``(new weight [d_out, d_in], ADMM iterations run)``."""
    dev = weight.device
    W = weight.data.clone()
    W = W.float()
    XtX = XtX.clone().float()

    # ridge term
    damp1 = 0.01 * torch.mean(torch.diag(XtX)).item()
    diag = torch.arange(XtX.shape[0], device=XtX.device)
    XtX[diag, diag] += damp1

    # normalization
    X_norm = torch.diag(XtX).sqrt() + 1e-8
    XtX = XtX / X_norm
    XtX = (XtX.T / X_norm).T

    YtX = torch.zeros_like(W)
    YtX = torch.matmul(W * X_norm, XtX)

    # initialization
    B = (W * X_norm).t().clone()
    W = None
    B_orig = B.clone()
    V = torch.zeros_like(B)
    D = torch.zeros_like(B)
    D_suppp = torch.zeros_like(B)
    D_supp = torch.zeros_like(B)

    totp, num_cout = B.shape
    L, Q = torch.linalg.eigh(XtX.double())
    XTX_inv = (Q @ ((1 / (L + (rho))) * Q).T).float()

    init_rho = False
    fix_supp = False
    D_fix = torch.zeros_like(D)

    params = B.shape[0] * B.shape[1]
    k_spar = int(np.round((1 - sp) * params))

    if nm_n == 0:
        D = B.clone().reshape(-1)
        _, loss_idx = torch.topk(-(D**2), totp * num_cout - k_spar)
        D[loss_idx] = 0
        D_suppp = (D == 0).to(torch.float)
        D = D.reshape(totp, num_cout)
    else:
        new_dim = totp * num_cout / nm_m
        new_dim = int(new_dim)
        k_spar = totp * num_cout * nm_n / nm_m

        D = B.clone().t().reshape((new_dim, nm_m))
        _, loss_idx = torch.topk(-(D**2), nm_m - nm_n, dim=1)
        D = D.scatter(src=torch.zeros((new_dim, nm_m - nm_n)).to(dev), dim=1, index=loss_idx)
        D_suppp = (D == 0).to(torch.float)
        D = D.reshape(num_cout, totp).t()

    D_init = D.clone()
    i_admm = -1  # (added: so that max_iter=0 returns 0 iterations)
    for i_admm in range(max_iter):
        B = XTX_inv @ (YtX.T - V + rho * D)

        if fix_supp:
            D = ((V + rho * B) / rho) * D_fix
        elif nm_n == 0:
            D = ((V + rho * B) / rho).reshape(-1)
            _, loss_idx = torch.topk(-(D**2), totp * num_cout - k_spar)
            D[loss_idx] = 0
            D = D.reshape(totp, num_cout)
        else:
            D = ((V + rho * B) / rho).t().reshape((new_dim, nm_m))
            _, loss_idx = torch.topk(-(D**2), nm_m - nm_n, dim=1)
            D = D.scatter(src=torch.zeros((new_dim, nm_m - nm_n)).to(dev), dim=1, index=loss_idx)
            D_supp = (D == 0).to(torch.float)
            D = D.reshape(num_cout, totp).t()

        V = V + rho * (B - D)

        if (i_admm + 1) % update_iter == 0:
            if nm_n == 0:
                D_supp = (D.reshape(-1) == 0).to(torch.float)
            supp_change = torch.sum((D_supp - D_suppp) ** 2)

            if not fix_supp:
                if supp_change / k_spar > 0.1:
                    init_rho = True
                    rho *= 1.3
                elif supp_change / k_spar > 0.005:
                    init_rho = True
                    rho *= 1.2
                elif supp_change > 0.5:
                    if init_rho:
                        rho *= 1.1
                    else:
                        rho /= 5
                        B = B_orig.clone().to(dev)
                        D = D_init.clone().to(dev)
                        V = torch.zeros_like(B).to(dev)
                else:
                    if init_rho:
                        break
                    else:
                        rho /= 5

            D_suppp = (D_supp).clone()
            if rho > 1e6:
                rho = 1e6

            XTX_inv = (Q @ ((1 / (L + (rho))) * Q).T).float().to(dev)

            if i_admm >= switch_iter and supp_change / k_spar < 0.0003:
                break

    if nm_n == 0:
        B = B.reshape(-1)
        _, loss_idx = torch.topk(-(B**2), totp * num_cout - k_spar)
        B[loss_idx] = 0
        B = B.reshape(totp, num_cout)
    else:
        B = B.t().reshape((new_dim, nm_m))
        _, loss_idx = torch.topk(-(B**2), nm_m - nm_n, dim=1)
        B = B.scatter(src=torch.zeros((new_dim, nm_m - nm_n)).to(dev), dim=1, index=loss_idx)
        B = B.reshape(num_cout, totp).t()

    V = None
    D = None

    B = cg_batch(XtX, YtX.T, (B != 0).to(torch.float), M_bmm=None, X0=B, rtol=1e-4, atol=0.0, maxiter=10)

    return (B.t() / X_norm).reshape(weight.shape).to(weight.dtype), i_admm + 1


def cg_batch(A, B, A_supp, M_bmm=None, X0=None, rtol=1e-3, atol=0.0, maxiter=None):
    """``ALPS_prune.cg_batch`` (itself modified from github.com/sbarratt/torch_cg), without ``verbose``."""
    n, m = B.shape

    if M_bmm is None:
        M_bmm = lambda x: x  # noqa: E731
    if X0 is None:
        X0 = M_bmm(B)
    if maxiter is None:
        maxiter = 5 * n

    assert B.shape == (n, m)
    assert X0.shape == (n, m)
    assert rtol > 0 or atol > 0
    assert isinstance(maxiter, int)

    X_k = X0

    R_k = B - A @ X_k
    R_k = R_k * A_supp

    Z_k = M_bmm(R_k)

    P_k = torch.zeros_like(Z_k)

    P_k1 = P_k
    R_k1 = R_k
    R_k2 = R_k
    X_k1 = X0
    Z_k1 = Z_k
    Z_k2 = Z_k

    B_norm = torch.norm(B, dim=1)
    stopping_matrix = torch.max(rtol * B_norm, atol * torch.ones_like(B_norm))

    for k in range(1, maxiter + 1):
        Z_k = M_bmm(R_k)

        if k == 1:
            P_k = Z_k
            R_k1 = R_k
            X_k1 = X_k
            Z_k1 = Z_k
        else:
            R_k2 = R_k1
            Z_k2 = Z_k1
            P_k1 = P_k
            R_k1 = R_k
            Z_k1 = Z_k
            X_k1 = X_k
            denominator = (R_k2 * Z_k2).sum(0)
            denominator[denominator == 0] = 1e-8
            beta = (R_k1 * Z_k1).sum(0) / denominator
            P_k = Z_k1 + beta.unsqueeze(0) * P_k1

        denominator = (P_k * (A @ P_k)).sum(0)
        denominator[denominator == 0] = 1e-8
        alpha = (R_k1 * Z_k1).sum(0) / denominator
        X_k = X_k1 + alpha.unsqueeze(0) * P_k
        R_k = R_k1 - alpha.unsqueeze(0) * (A @ P_k)
        R_k = R_k * A_supp

        residual_norm = torch.norm(A @ X_k - B, dim=1)

        if (residual_norm <= stopping_matrix).all():
            break

    return X_k


def admm_per_out_within(weight, XX, sparsity, prior, percdamp=0.1, iterative_prune=15, iters=20):
    """Oracle for iterative pruning (ours; the original prunes dense layers): ``admm_fasterprune``'s ``per_out``
    loop in float64, each output row selecting within ``prior`` (kept = True) by its own threshold on the
    ``(W + U)`` magnitudes of the weights the prior keeps: ``floor(kept * cur_sparsity)`` of them pruned per step,
    ``round(kept * sparsity)`` at the last (the project's count rule). Returns ``(weight, keep mask)``."""
    XX = XX.clone().double()
    norm = torch.diag(XX).sqrt() + 1e-8
    XX = XX / norm
    XX = (XX.T / norm).T
    W = (weight.double() * prior * norm).T
    diag = torch.arange(XX.shape[0])
    XX[diag, diag] += percdamp * torch.diag(XX).mean()
    XY = XX.matmul(W)
    XX[diag, diag] += 1
    XXinv = torch.inverse(XX)
    U = torch.zeros_like(W)
    prior_t = prior.T
    kept = prior.sum(1).tolist()

    def within(values, cur, last):
        mask = torch.zeros_like(prior_t)
        for j in range(values.shape[1]):  # one output row at a time
            pruned = round(kept[j] * sparsity) if last else min(int(kept[j] * cur), round(kept[j] * sparsity))
            inside = values[prior_t[:, j], j]
            thres = inside.sort()[0][pruned] if pruned < len(inside) else float("inf")
            mask[:, j] = prior_t[:, j] & (values[:, j] >= thres)
        return mask

    mask = None
    for itt in range(iters):
        if itt < iterative_prune:
            cur = sparsity - sparsity * (1 - (itt + 1) / iterative_prune) ** 3
            mask = within((W + U).abs(), cur, itt + 1 == iterative_prune)
        Z = (W + U) * mask
        U = U + (W - Z)
        W = XXinv.matmul(XY + 1 * (Z - U))
    return ((W + U) * mask).T / norm, mask.T
