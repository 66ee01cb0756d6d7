"""Float64 brute-force references: recompute the loss of every feasible swapped mask from scratch."""

from __future__ import annotations

import itertools

import torch

from sparseswaps_prune.core.refit import REFIT_DAMP


def row_loss(w: torch.Tensor, gram: torch.Tensor, keep: torch.Tensor) -> float:
    r = torch.where(keep, 0.0, w).double()
    return float(r @ gram.double() @ r)


def brute_best_swap(w, gram, keep, m: int | None = None):
    """(dL, u, p) of the best swap of one row by exhaustive search, ties to smallest u then p."""
    return brute_best_swap_of(row_loss, w, gram, keep, m)


def brute_refine(w, gram, keep, max_iters: int, m: int | None = None, loss=row_loss, floor=lambda w_row: 0.0):
    """Per-row greedy best-improvement loop with the brute-force search under ``loss``, applying a swap while
    its dL is below ``-floor(w_row)``; returns (mask, swaps list)."""
    keep = keep.clone()
    history = []
    for r in range(w.shape[0]):
        row_swaps = []
        for _ in range(max_iters):
            dl, u, p = brute_best_swap_of(loss, w[r], gram, keep[r], m)
            if not dl < -floor(w[r]):
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


def sparsegpt_fasterprune(W, H, sparsity, prunen=0, prunem=0, blocksize=128, percdamp=0.01):
    """Transcription of ``SparseGPT.fasterprune`` (github.com/IST-DASLab/sparsegpt, sparsegpt.py) for a
    Linear weight, without quantizer, prints or the layer: returns (pruned weight, pruned mask True = pruned).
    ``H`` is SparseGPT's Hessian (2/n times our summed Gram)."""
    W = W.clone().float()
    H = H.clone().float()
    rows, columns = W.shape
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    damp = percdamp * torch.mean(torch.diag(H))
    diag = torch.arange(columns)
    H[diag, diag] += damp
    H = torch.linalg.cholesky(H)
    H = torch.cholesky_inverse(H)
    H = torch.linalg.cholesky(H, upper=True)
    Hinv = H
    pruned = torch.zeros(rows, columns, dtype=torch.bool)
    for i1 in range(0, columns, blocksize):
        i2 = min(i1 + blocksize, columns)
        count = i2 - i1
        W1 = W[:, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        if prunen == 0:
            tmp = W1**2 / (torch.diag(Hinv1).reshape((1, -1))) ** 2
            thresh = torch.sort(tmp.flatten())[0][int(tmp.numel() * sparsity)]
            mask1 = tmp <= thresh
        else:
            mask1 = torch.zeros_like(W1) == 1
        for i in range(count):
            w = W1[:, i]
            d = Hinv1[i, i]
            if prunen != 0 and i % prunem == 0:
                tmp = W1[:, i : (i + prunem)] ** 2 / (torch.diag(Hinv1)[i : (i + prunem)].reshape((1, -1))) ** 2
                mask1.scatter_(1, i + torch.topk(tmp, prunen, dim=1, largest=False)[1], True)
            q = w.clone()
            q[mask1[:, i]] = 0
            Q1[:, i] = q
            err1 = (w - q) / d
            W1[:, i:] -= err1.unsqueeze(1).matmul(Hinv1[i, i:].unsqueeze(0))
            Err1[:, i] = err1
        W[:, i1:i2] = Q1
        pruned[:, i1:i2] = mask1
        W[:, i2:] -= Err1.matmul(Hinv[i1:i2, i2:])
    return W, pruned


def dsnot_wrapper_stats(batches):
    """Transcription of DSnoT's ``WrappedGPT.add_batch`` statistics (github.com/zyxxmu/DSnoT, lib/layerwrapper.py)
    over ``batches`` (each ``[1, seqlen, d_in]``, one calibration sequence per call as in ``prune_DSnoT``):
    returns (sum_metric_row, var, scaler_row)."""
    columns = batches[0].shape[-1]
    scaler_row = torch.zeros(columns)
    sum_metric_row = torch.zeros(columns)
    mean = torch.zeros(columns)
    var = torch.zeros(columns)
    ntokens = nsamples = 0
    for inp in batches:
        tmp = inp.shape[0]
        inp = inp.reshape((-1, inp.shape[-1])).t().type(torch.float32)
        mean_inp = torch.mean(inp, dim=1, keepdim=True)
        var_inp = torch.var(inp, dim=1, unbiased=False, keepdim=True)
        num_inp = inp.shape[1]
        var = var_inp if ntokens == 0 else (var * ntokens + var_inp * num_inp) / (ntokens + num_inp)
        mean = mean_inp if ntokens == 0 else (mean * ntokens + mean_inp * num_inp) / (ntokens + num_inp)
        ntokens += num_inp
        scaler_row *= nsamples / (nsamples + tmp)
        sum_metric_row *= nsamples / (nsamples + tmp)
        nsamples += tmp
        scaler_row += torch.norm(inp, p=2, dim=1) ** 2 / nsamples
        sum_metric_row += torch.sum(inp, dim=1) / nsamples
    return sum_metric_row, var.flatten(), scaler_row


def _return_reorder_indice(input_tensor):
    """``return_reorder_indice`` of DSnoT's lib/prune.py, verbatim."""
    positive_tensor = input_tensor.clone()
    negative_tensor = input_tensor.clone()
    positive_mask = positive_tensor > 0
    negative_mask = negative_tensor < 0
    positive_indices = torch.arange(0, input_tensor.shape[1]).to(torch.float64).repeat(input_tensor.shape[0], 1)
    negative_indices = torch.arange(0, input_tensor.shape[1]).to(torch.float64).repeat(input_tensor.shape[0], 1)
    positive_indices[~positive_mask] = float("inf")
    negative_indices[~negative_mask] = float("inf")
    positive_value, _ = torch.sort(positive_indices, dim=1)
    negative_value, _ = torch.sort(negative_indices, dim=1)
    positive_value = torch.flip(positive_value, dims=[1])
    negative_value[negative_value == float("inf")] = 0
    positive_value[positive_value == float("inf")] = 0
    return (positive_value + negative_value).to(torch.int64)


def dsnot_prune_layer(
    W,
    sum_metric_row,
    var,
    scaler_row,
    sparsity_ratio=0.5,
    prune_n=0,
    prune_m=0,
    max_cycle_time=50,
    update_threshold=0.1,
    pow_of_var_regrowing=1.0,
    without_same_sign=True,
):
    """Transcription of the per-layer body of ``prune_DSnoT`` (github.com/zyxxmu/DSnoT, lib/prune.py) with
    ``initial_method='wanda'`` and no skipped layer; ``prune_n`` weights of every ``prune_m`` are pruned.
    Returns (initial pruned mask, final pruned mask), True = pruned."""
    DSnoT_metric = W * sum_metric_row.reshape((1, -1))
    initial_metric = torch.abs(W) * torch.sqrt(scaler_row.reshape((1, -1)))
    weight_mask = torch.zeros_like(initial_metric) == 1
    rows = initial_metric.shape[0]
    if prune_n != 0:
        initial_prune_indices = torch.zeros((rows, 0), dtype=torch.int64)
        initial_res_indices = torch.zeros((rows, 0), dtype=torch.int64)
        for ii in range(initial_metric.shape[1]):
            if ii % prune_m == 0:
                tmp = initial_metric[:, ii : (ii + prune_m)].float()
                _, tmp_all_indices = torch.sort(tmp, dim=1)
                tmp_all_indices += ii
                res_prune_n = prune_m - prune_n
                tmp_indices, tmp_res_indices = torch.split(
                    tmp_all_indices, split_size_or_sections=[prune_n, res_prune_n], dim=1
                )
                initial_prune_indices = torch.cat((initial_prune_indices, tmp_indices), dim=1)
                initial_res_indices = torch.cat((initial_res_indices, tmp_res_indices), dim=1)
                weight_mask.scatter_(1, tmp_indices, True)
        initial = weight_mask.clone()
        metric_for_regrowing = DSnoT_metric.clone()
        metric_for_regrowing.scatter_(1, initial_res_indices, 0)
        reconstruction_error = torch.sum(metric_for_regrowing, dim=1, keepdim=True)
        initialize_error_sign = torch.sign(reconstruction_error)
        if pow_of_var_regrowing:
            metric_for_regrowing /= torch.pow(var.reshape((1, -1)), pow_of_var_regrowing)
        _, regrowing_indices_block = torch.sort(metric_for_regrowing, dim=1, stable=True)
        indice_indice_list_for_regrowing = torch.zeros((rows, 2), dtype=torch.long)
        indice_indice_list_for_regrowing[:, 1] = regrowing_indices_block.shape[-1] - 1
        update_num_for_regrowing = torch.ones((rows, 2), dtype=torch.long)
        update_num_for_regrowing[:, 1] = -1
        initial_metric.scatter_(1, initial_prune_indices, float("inf"))
        W_metric_max_value = torch.max(initial_metric, dim=1, keepdim=True)[0] + 1
        cycle_time = 1
        update_mask = torch.ones_like(reconstruction_error, dtype=torch.bool)
        while not (bool((~update_mask).all()) or cycle_time > max_cycle_time):
            cycle_time += 1
            indice_of_indice_indice_list_for_regrowing = (reconstruction_error > 0).int().to(torch.int64)
            indice_indice_for_regrowing = torch.gather(
                indice_indice_list_for_regrowing, 1, indice_of_indice_indice_list_for_regrowing
            )
            regrowing_indice = torch.gather(regrowing_indices_block, 1, indice_indice_for_regrowing.to(torch.int64))
            regrowing_metric = DSnoT_metric.gather(1, regrowing_indice.to(torch.int64))
            recover_block_start_indice = regrowing_indice - regrowing_indice % prune_m
            recover_block_indices = (
                torch.arange(0, prune_m).repeat(recover_block_start_indice.shape[1], 1) + recover_block_start_indice
            )
            pruning_block = torch.gather(initial_metric, 1, recover_block_indices.to(torch.int64))
            _, pruning_indice = torch.topk(pruning_block, 1, dim=1, largest=False)
            pruning_indice += recover_block_start_indice
            pruning_metric = DSnoT_metric.gather(1, pruning_indice.to(torch.int64))
            reconstruction_error_after = reconstruction_error + pruning_metric - regrowing_metric
            update_mask = (
                update_mask
                & (initialize_error_sign == torch.sign(reconstruction_error_after))
                & (abs(reconstruction_error) > update_threshold)
            )
            initial_metric.scatter_(1, pruning_indice, W_metric_max_value)
            weight_mask.scatter_(1, pruning_indice, update_mask)
            weight_mask.scatter_(1, regrowing_indice, ~update_mask)
            reconstruction_error += torch.where(update_mask, pruning_metric, torch.zeros_like(pruning_metric))
            reconstruction_error -= torch.where(update_mask, regrowing_metric, torch.zeros_like(regrowing_metric))
            indice_indice_list_for_regrowing.scatter_(
                1,
                indice_of_indice_indice_list_for_regrowing,
                indice_indice_for_regrowing
                + update_num_for_regrowing.gather(1, indice_of_indice_indice_list_for_regrowing),
            )
        return initial, weight_mask

    _, sorted_initial_indice = torch.sort(initial_metric, dim=-1, stable=True)
    sparsity_num = int(initial_metric.shape[1] * sparsity_ratio)
    res_sparsity_num = sorted_initial_indice.shape[1] - sparsity_num
    initial_prune_indices, initial_res_indices = torch.split(
        sorted_initial_indice, split_size_or_sections=[sparsity_num, res_sparsity_num], dim=1
    )
    weight_mask.scatter_(1, initial_prune_indices, True)
    initial = weight_mask.clone()
    metric_for_regrowing = DSnoT_metric.clone()
    wanda_metric = torch.abs(W) * torch.sqrt(scaler_row.reshape((1, -1)))
    metric_for_regrowing.scatter_(1, initial_res_indices, 0)
    reconstruction_error = torch.sum(metric_for_regrowing, dim=1, keepdim=True)
    initialize_error_sign = torch.sign(reconstruction_error)
    if pow_of_var_regrowing:
        metric_for_regrowing /= torch.pow(var.reshape((1, -1)), pow_of_var_regrowing)
    _, regrowing_indices_block = torch.sort(metric_for_regrowing, dim=1, stable=True)
    wanda_metric.scatter_(1, initial_prune_indices, float("inf"))
    wanda_res_indices, _ = torch.split(
        torch.sort(wanda_metric, dim=1, stable=True)[1], split_size_or_sections=[res_sparsity_num, sparsity_num], dim=1
    )
    reorder_indice_of_pruning_indice = _return_reorder_indice(torch.gather(DSnoT_metric, 1, wanda_res_indices))
    pruning_indices_block = torch.gather(wanda_res_indices, 1, reorder_indice_of_pruning_indice)
    indice_indice_list_for_regrowing = torch.zeros((rows, 2), dtype=torch.long)
    indice_indice_list_for_regrowing[:, 1] = regrowing_indices_block.shape[-1] - 1
    update_num_for_regrowing = torch.ones((rows, 2), dtype=torch.long)
    update_num_for_regrowing[:, 1] = -1
    indice_indice_list_for_pruning = torch.zeros((rows, 2), dtype=torch.long)
    indice_indice_list_for_pruning[:, 1] = pruning_indices_block.shape[-1] - 1
    update_num_for_pruning = torch.ones((rows, 2), dtype=torch.long)
    update_num_for_pruning[:, 1] = -1
    update_mask = torch.ones_like(reconstruction_error, dtype=torch.bool)
    cycle_time = 0
    while not (bool((~update_mask).all()) or cycle_time >= max_cycle_time):
        cycle_time += 1
        indice_of_indice_indice_list_for_regrowing = (reconstruction_error > 0).int().to(torch.int64)
        indice_indice_for_regrowing = torch.gather(
            indice_indice_list_for_regrowing, 1, indice_of_indice_indice_list_for_regrowing
        )
        regrowing_indice = torch.gather(regrowing_indices_block, 1, indice_indice_for_regrowing.to(torch.int64))
        regrowing_metric = DSnoT_metric.gather(1, regrowing_indice.to(torch.int64))
        indice_indice_list_for_regrowing.scatter_(
            1,
            indice_of_indice_indice_list_for_regrowing,
            indice_indice_for_regrowing
            + update_num_for_regrowing.gather(1, indice_of_indice_indice_list_for_regrowing),
        )
        indice_of_indice_indice_list_for_pruning = (reconstruction_error < 0).int().to(torch.int64)
        indice_indice_for_pruning = torch.gather(
            indice_indice_list_for_pruning, 1, indice_of_indice_indice_list_for_pruning
        )
        pruning_indice = torch.gather(pruning_indices_block, 1, indice_indice_for_pruning.to(torch.int64))
        pruning_metric = DSnoT_metric.gather(1, pruning_indice.to(torch.int64))
        indice_indice_list_for_pruning.scatter_(
            1,
            indice_of_indice_indice_list_for_pruning,
            indice_indice_for_pruning + update_num_for_pruning.gather(1, indice_of_indice_indice_list_for_pruning),
        )
        reconstruction_error_after = reconstruction_error + pruning_metric - regrowing_metric
        if without_same_sign:
            update_mask = update_mask & (abs(reconstruction_error) > update_threshold)
        else:
            update_mask = (
                update_mask
                & (abs(reconstruction_error) > update_threshold)
                & (initialize_error_sign == torch.sign(reconstruction_error_after))
            )
        weight_mask.scatter_(1, pruning_indice, update_mask)
        weight_mask.scatter_(1, regrowing_indice, ~update_mask)
        reconstruction_error += torch.where(update_mask, pruning_metric, torch.zeros_like(pruning_metric))
        reconstruction_error -= torch.where(update_mask, regrowing_metric, torch.zeros_like(regrowing_metric))
    return initial, weight_mask


# ---- re-fit objective and layer-budget moves (brute force, float64, from scratch) ----


def refit_row_objective(w: torch.Tensor, gram: torch.Tensor, keep: torch.Tensor, damp: float) -> float:
    """Damped re-fit objective of one row, ``w^T G w - b_S^T (G_SS + lambda I)^{-1} b_S``, by a dense solve."""
    g, w = gram.double(), w.double()
    lam = damp * float(torch.diagonal(g).mean())
    b = g @ w
    s = torch.nonzero(keep).flatten()
    total = float(w @ b)
    if s.numel() == 0:
        return total
    system = g[s][:, s] + lam * torch.eye(s.numel(), dtype=torch.float64)
    return total - float(b[s] @ torch.linalg.solve(system, b[s]))


def row_objective(objective: str, damp: float = REFIT_DAMP):
    """The per-row loss ``(w, gram, keep) -> float`` of ``objective`` ("mask" or "refit")."""
    if objective == "mask":
        return row_loss
    return lambda w, gram, keep: refit_row_objective(w, gram, keep, damp)


def refit_floor(w: torch.Tensor, gram: torch.Tensor) -> float:
    """The re-fit engine's acceptance floor ``ACCEPT_RTOL * w^T G w`` of one row."""
    from sparseswaps_prune.core.refit_swaps import ACCEPT_RTOL

    w = w.double()
    return ACCEPT_RTOL * float(w @ gram.double() @ w)


def brute_best_swap_of(loss, w, gram, keep, m: int | None = None):
    """(dL, u, p) of the best swap of one row under ``loss`` (exhaustive; ties to smallest u then p;
    exact-zero weights never restored)."""
    base = loss(w, gram, keep)
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
            dl = loss(w, gram, trial) - base
            if dl < best[0] - 1e-9 * max(1.0, abs(base)):
                best = (dl, u, p)
    return best


def brute_refine_refit(w, gram, keep, damp: float, max_iters: int, m: int | None = None):
    """Per-row greedy loop under the re-fit objective (accepts dL < -refit_floor); returns (mask, swaps list)."""
    return brute_refine(
        w, gram, keep, max_iters, m, loss=row_objective("refit", damp), floor=lambda w_row: refit_floor(w_row, gram)
    )


def brute_row_moves(loss, w, gram, keep):
    """Per row: best swap (dL, u, p), cheapest removal (dL, u) and best restore (dL, p), exhaustively."""
    base = loss(w, gram, keep)
    tol = 1e-9 * max(1.0, abs(base))
    swap = brute_best_swap_of(loss, w, gram, keep)
    remove, add = (float("inf"), -1), (float("inf"), -1)
    for j in range(w.numel()):
        trial = keep.clone()
        trial[j] = not keep[j]
        if keep[j]:
            dl = loss(w, gram, trial) - base
            if dl < remove[0] - tol:
                remove = (dl, j)
        elif w[j] != 0:
            dl = loss(w, gram, trial) - base
            if dl < add[0] - tol:
                add = (dl, j)
    return swap, remove, add


def brute_plan(swap, remove, add, eps: float):
    """Best combination of moves by enumerating every role assignment (idle / swap / donor / receiver per row)
    with as many donors as receivers and a pairing in which every cross move lowers the loss by more than eps.
    Minimises sum (dL + eps) over moves, then the number of moves. Returns (swaps, donors, receivers) row lists."""
    n = len(swap)
    best = (0.0, 0, ([], [], []))
    for roles in itertools.product(range(4), repeat=n):
        swaps = [i for i in range(n) if roles[i] == 1]
        donors = [i for i in range(n) if roles[i] == 2]
        receivers = [i for i in range(n) if roles[i] == 3]
        if len(donors) != len(receivers):
            continue
        if any(not swap[i] < -eps for i in swaps):
            continue
        if any(remove[i] == float("inf") for i in donors) or any(add[i] == float("inf") for i in receivers):
            continue
        if donors and not any(
            all(remove[i] + add[j] < -eps for i, j in zip(donors, perm, strict=True))
            for perm in itertools.permutations(receivers)
        ):
            continue
        value = sum(swap[i] + eps for i in swaps) + sum(
            remove[i] + add[j] + eps for i, j in zip(donors, receivers, strict=True)
        )
        moves = len(swaps) + len(donors)
        tol = 1e-12 * max(1.0, abs(best[0]))
        if value < best[0] - tol or (abs(value - best[0]) <= tol and moves < best[1]):
            best = (value, moves, (swaps, donors, receivers))
    return best[2]


def brute_layer_step(objective: str, w, gram, keep, damp: float = REFIT_DAMP, eps: float = 0.0):
    """One layer-budget iteration by brute force; returns the new mask (a copy) and the plan."""
    loss = row_objective(objective, damp)
    if objective == "refit":
        eps = eps + max(refit_floor(w[r], gram) for r in range(w.shape[0]))
    moves = [brute_row_moves(loss, w[r], gram, keep[r]) for r in range(w.shape[0])]
    swaps, donors, receivers = brute_plan(
        [m[0][0] for m in moves], [m[1][0] for m in moves], [m[2][0] for m in moves], eps
    )
    keep = keep.clone()
    for r in swaps:
        _, u, p = moves[r][0]
        keep[r, u], keep[r, p] = False, True
    for r in donors:
        keep[r, moves[r][1][1]] = False
    for r in receivers:
        keep[r, moves[r][2][1]] = True
    return keep, (swaps, donors, receivers)
