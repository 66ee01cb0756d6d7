import pytest
import torch

from sparseswaps_prune import GramAccumulator, warmstart_mask
from sparseswaps_prune.core.dsnot import DSnoTResult, dsnot_refine
from tests.core.reference import dsnot_prune_layer, dsnot_wrapper_stats

ONES = torch.ones(4)


def calibration(d_out, d_in, seed, n_samples=4, seqlen=32):
    """Weight and calibration sequences ``[1, seqlen, d_in]`` with nonzero, unequal input means and scales."""
    gen = torch.Generator().manual_seed(seed)
    offset = torch.randn(d_in, generator=gen) * 0.5
    scale = torch.rand(d_in, generator=gen) + 0.3
    batches = [torch.randn(1, seqlen, d_in, generator=gen) * scale + offset for _ in range(n_samples)]
    return torch.randn(d_out, d_in, generator=gen), batches


def refine(weight, keep, mean=ONES, var=ONES, sq_mean=ONES, **kwargs):
    return dsnot_refine(weight, keep, feature_mean=mean, feature_var=var, feature_sq_mean=sq_mean, **kwargs)


def test_feature_stats_match_definitions_and_dsnot_wrapper():
    _, batches = calibration(1, 6, seed=0, n_samples=3, seqlen=10)
    tokens = torch.cat(batches, dim=1).reshape(-1, 6).double()
    acc = GramAccumulator(6, dtype=torch.float64, track_sum=True)
    for batch in batches:
        acc.add(batch)
    mean, var, sq_mean = acc.feature_stats()
    assert mean.dtype == var.dtype == sq_mean.dtype == torch.float64
    torch.testing.assert_close(mean, tokens.mean(0))
    torch.testing.assert_close(var, tokens.var(0, unbiased=False))
    torch.testing.assert_close(sq_mean, (tokens**2).mean(0))
    # DSnoT's wrapper: sums over the calibration sequences (n_samples), per-token variance
    sum_metric_row, wrapper_var, scaler_row = dsnot_wrapper_stats(batches)
    mean_s, var_s, sq_mean_s = acc.feature_stats(n_samples=3)
    torch.testing.assert_close(mean_s, sum_metric_row.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sq_mean_s, scaler_row.double(), rtol=1e-5, atol=1e-5)
    assert torch.equal(var_s, var)
    # its variance pools per-sequence variances: equal to ours for one sequence, below it otherwise
    assert bool((wrapper_var.double() <= var + 1e-5).all())
    torch.testing.assert_close(dsnot_wrapper_stats([tokens[None].float()])[1].double(), var, rtol=1e-5, atol=1e-5)


def test_feature_stats_errors():
    with pytest.raises(ValueError, match="track_sum=True"):
        GramAccumulator(4).feature_stats()
    with pytest.raises(ValueError, match="no tokens"):
        GramAccumulator(4, track_sum=True).feature_stats()
    acc = GramAccumulator(4, track_sum=True)
    acc.add(torch.randn(3, 4))
    with pytest.raises(ValueError, match="n_samples"):
        acc.feature_stats(n_samples=0)


def test_hand_checked_regrow_order_and_stop():
    weight = torch.tensor([[-0.3, 0.6, 0.8, 3.0], [0.05, 0.02, 1.0, 1.0]])
    keep = torch.tensor([[True, False, False, True], [False, False, True, True]])
    # row 0: error 0.6 + 0.8 = 1.4 > 0 -> regrow the most positive pruned (0.8), prune the kept negative of
    # lowest Wanda score (-0.3): error 0.3; next cycle no kept negative is left -> stop. Row 1: error 0.07 <= 0.1.
    res = refine(weight, keep)
    assert isinstance(res, DSnoTResult)
    assert res.mask.tolist() == [[False, False, True, True], [False, False, True, True]]
    assert res.n_cycles == 2 and res.n_updates.tolist() == [1, 0]
    torch.testing.assert_close(res.error_before, torch.tensor([1.4, 0.07], dtype=torch.float64))
    torch.testing.assert_close(res.error_after, torch.tensor([0.3, 0.07], dtype=torch.float64))
    # variance 4 on input 2 ranks 0.8 / 4 below 0.6 / 1: input 1 is regrown instead (error 0.5)
    var = torch.tensor([1.0, 1.0, 4.0, 1.0])
    assert refine(weight, keep, var=var).mask[0].tolist() == [False, True, False, True]
    assert refine(weight, keep, var=var, pow_of_var_regrowing=0.0).mask[0].tolist() == [False, False, True, True]


def test_hand_checked_sign_check():
    weight = torch.tensor([[-0.4, 0.2, 1.5, 3.0]])
    keep = torch.tensor([[True, False, False, True]])
    # error 1.7 -> regrow 1.5, prune -0.4: error -0.2 flips sign; accepted by default (the original's
    # without_same_sign=True), then no pruned negative is left to regrow -> stop
    free = refine(weight, keep)
    assert free.mask.tolist() == [[False, False, True, True]] and free.n_updates.tolist() == [1]
    checked = refine(weight, keep, without_same_sign=False)
    assert torch.equal(checked.mask, keep) and checked.n_cycles == 1 and checked.n_updates.tolist() == [0]


def test_hand_checked_nm_prunes_within_block():
    weight = torch.tensor([[-0.3, 0.6, 0.8, 3.0]])
    keep = torch.tensor([[True, False, False, True]])
    # cycle 1: regrow 0.8, prune the block's lowest score (-0.3): error 0.3. Cycle 2: regrow 0.6, the only
    # candidate left in the block is 3.0 (regrown weights are never pruned): error 2.7, sign kept -> applied.
    # The N:M branch does not restrict pruning by sign, so |error| can grow. Cycle 3: no pruned positive left.
    res = refine(weight, keep, nm=(2, 4))
    assert res.mask.tolist() == [[False, True, True, False]]
    assert res.n_cycles == 3 and res.n_updates.tolist() == [2]
    torch.testing.assert_close(res.error_after, torch.tensor([2.7], dtype=torch.float64))


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"without_same_sign": False},
        {"update_threshold": 5.0},
        {"pow_of_var_regrowing": 0.0},
        {"pow_of_var_regrowing": 2.0, "max_cycles": 20},
    ],
)
def test_matches_original_unstructured(settings):
    weight, batches = calibration(16, 512, seed=3)
    sum_metric_row, var, scaler_row = dsnot_wrapper_stats(batches)
    original = {"max_cycle_time" if k == "max_cycles" else k: v for k, v in settings.items()}
    initial, final = dsnot_prune_layer(weight, sum_metric_row, var, scaler_row, 0.6, **original)
    res = refine(weight, ~initial, sum_metric_row, var, scaler_row, **settings)
    assert torch.equal(res.mask, ~final)
    assert torch.equal(res.mask.sum(1), (~initial).sum(1))
    assert res.n_updates.sum() > 0


@pytest.mark.parametrize(("prune_n", "prune_m"), [(2, 4), (4, 8)])
def test_matches_original_nm(prune_n, prune_m):
    weight, batches = calibration(16, 512, seed=prune_m)
    sum_metric_row, var, scaler_row = dsnot_wrapper_stats(batches)
    initial, final = dsnot_prune_layer(weight, sum_metric_row, var, scaler_row, 0.5, prune_n, prune_m)
    nm = (prune_m - prune_n, prune_m)
    res = refine(weight, ~initial, sum_metric_row, var, scaler_row, nm=nm)
    assert torch.equal(res.mask, ~final)
    assert (res.mask.reshape(16, -1, prune_m).sum(-1) == nm[0]).all()
    assert res.n_updates.sum() > 0
    # the N:M branch's pruning score is the warmstart's: passing Wanda's explicitly changes nothing
    scores = weight.abs() * scaler_row.sqrt()
    explicit = dsnot_refine(weight, ~initial, feature_mean=sum_metric_row, feature_var=var, prune_scores=scores, nm=nm)
    assert torch.equal(explicit.mask, res.mask)


@pytest.mark.parametrize("nm", [None, (1, 4), (2, 4)])
@pytest.mark.parametrize("sign", [None, False, True])
def test_counts_kept_when_candidates_run_out(nm, sign):
    # tiny rows and a zero threshold exhaust the candidate lists within 50 cycles
    for seed in range(4):
        weight, batches = calibration(8, 16, seed)
        mean, var, sq_mean = dsnot_wrapper_stats(batches)
        budget = {"nm": nm} if nm else {"sparsity": 0.5, "scope": "layer"}  # unequal row counts
        keep = warmstart_mask(weight, "magnitude", **budget)
        res = refine(weight, keep, mean, var, sq_mean, nm=nm, update_threshold=0.0, without_same_sign=sign)
        assert torch.equal(res.mask.sum(1), keep.sum(1))
        if nm:
            assert (res.mask.reshape(8, -1, nm[1]).sum(-1) == nm[0]).all()


def test_sign_check_never_increases_expected_error():
    weight, batches = calibration(32, 256, seed=7)
    mean, var, sq_mean = dsnot_wrapper_stats(batches)
    keep = warmstart_mask(weight, "wanda", sparsity=0.6, gram=torch.diag(sq_mean))
    w0, keep0 = weight.clone(), keep.clone()
    res = refine(weight, keep, mean, var, sq_mean, without_same_sign=False)
    assert torch.equal(weight, w0) and torch.equal(keep, keep0)  # inputs not modified
    assert res.n_updates.sum() > 0
    assert bool((res.error_after.abs() <= res.error_before.abs() + 1e-4).all())
    changed = res.n_updates > 0
    assert bool((res.error_after.abs()[changed] < res.error_before.abs()[changed]).all())
    assert bool((torch.sign(res.error_after) == torch.sign(res.error_before)).all())
    torch.testing.assert_close(
        res.error_after, (torch.where(res.mask, 0.0, weight.double()) @ mean.double()), rtol=0, atol=1e-9
    )
    assert torch.equal(refine(weight, keep, mean, var, sq_mean, max_cycles=0).mask, keep)


def test_bad_inputs():
    weight, keep = torch.randn(2, 4), torch.tensor([[True, False] * 2] * 2)
    with pytest.raises(TypeError, match="bool"):
        refine(weight, keep.float())
    with pytest.raises(ValueError, match="does not match"):
        refine(weight, keep[:, :2])
    with pytest.raises(ValueError, match="2:4 pattern"):
        refine(weight, torch.tensor([[True, True, True, False]] * 2), nm=(2, 4))
    with pytest.raises(ValueError, match=r"feature_mean must have shape \[d_in\]"):
        refine(weight, keep, mean=torch.ones(3))
    with pytest.raises(TypeError, match="feature_var must be a torch"):
        refine(weight, keep, var=[1.0] * 4)
    with pytest.raises(ValueError, match="feature_var must be >= 0"):
        refine(weight, keep, var=-ONES)
    with pytest.raises(ValueError, match="NaN"):
        refine(weight, keep, sq_mean=torch.full((4,), float("nan")))
    with pytest.raises(ValueError, match="exactly one of feature_sq_mean"):
        refine(weight, keep, sq_mean=None)
    with pytest.raises(ValueError, match="exactly one of feature_sq_mean"):
        refine(weight, keep, prune_scores=weight.abs())
    with pytest.raises(ValueError, match="max_cycles"):
        refine(weight, keep, max_cycles=-1)
    with pytest.raises(ValueError, match="update_threshold"):
        refine(weight, keep, update_threshold=-0.1)
    with pytest.raises(ValueError, match="pow_of_var_regrowing"):
        refine(weight, keep, pow_of_var_regrowing=float("nan"))
    with pytest.raises(TypeError, match="dtype"):
        refine(weight, keep, dtype=torch.float16)
