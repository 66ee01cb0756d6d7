"""The fused Triton swap search. Without a GPU the kernel runs in the Triton interpreter on CPU tensors
(``TRITON_INTERPRET=1``, set in tests/conftest.py before anything imports triton: Triton reads it when
triton is first imported); with CUDA the same tests run the compiled kernel."""

import pytest
import torch  # does not import triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytest.importorskip("triton")

from sparseswaps_prune import refine_mask, warmstart_mask  # noqa: E402
from sparseswaps_prune.core.backends import best_swaps, resolve_backend  # noqa: E402
from sparseswaps_prune.core.backends.torch_search import best_swaps_torch  # noqa: E402
from sparseswaps_prune.core.backends.triton_search import best_swaps_triton  # noqa: E402
from sparseswaps_prune.core.losses import correlation  # noqa: E402
from tests.core.reference import layer_problem  # noqa: E402


def _problem(d_out, d_in, sparsity, seed, dtype=torch.float64, device=DEVICE):
    weight, gram = layer_problem(d_out, d_in, seed)
    keep = warmstart_mask(weight, "magnitude", sparsity=sparsity)
    if d_out > 3:
        keep[0] = True  # all kept: nothing to restore (dL = inf)
        keep[1] = False  # nothing kept: nothing to remove (dL = inf)
        weight[2, ~keep[2]] = 0.0  # every pruned weight an exact zero: never restored (dL = inf)
        weight[3, 1::3] = 0.0  # some exact zeros, kept and pruned
    corr = correlation(weight, gram, keep)
    return (*(t.to(device=device, dtype=dtype) for t in (weight, corr, gram)), keep.to(device))


def _assert_same(got, ref, atol):
    (u, p, dl), (ref_u, ref_p, ref_dl) = got, ref
    assert u.dtype == p.dtype == torch.long and dl.dtype == ref_dl.dtype
    finite = torch.isfinite(ref_dl)
    assert torch.equal(torch.isfinite(dl), finite)
    assert torch.equal(u[finite], ref_u[finite]) and torch.equal(p[finite], ref_p[finite])
    torch.testing.assert_close(dl[finite], ref_dl[finite], rtol=0, atol=atol)


@pytest.mark.parametrize(
    ("d_out", "d_in", "sparsity", "seed"),
    [(6, 16, 0.5, 0), (40, 64, 0.6, 1), (17, 37, 0.3, 2), (5, 20, 0.9, 3), (23, 50, 0.1, 4)],
)
def test_float64_equals_torch_backend(d_out, d_in, sparsity, seed):
    weight, corr, gram, keep = _problem(d_out, d_in, sparsity, seed)
    ref = best_swaps_torch(weight, keep, corr, gram)
    got = best_swaps_triton(weight, keep, corr, gram)
    _assert_same(got, ref, atol=1e-12)
    assert torch.equal(got[2], ref[2])  # same operations in the same order: bit-identical
    if d_out > 3:
        assert not torch.isfinite(got[2][:3]).any()
    # infeasible rows follow the reference's convention u = p = 0
    assert torch.equal(got[0][~torch.isfinite(got[2])], ref[0][~torch.isfinite(ref[2])])
    assert torch.equal(got[1][~torch.isfinite(got[2])], ref[1][~torch.isfinite(ref[2])])


@pytest.mark.parametrize("u_splits", [2, 3, 100])
def test_u_splits_reduce_to_the_same_answer(u_splits):
    weight, corr, gram, keep = _problem(19, 64, 0.5, 5)
    _assert_same(
        best_swaps_triton(weight, keep, corr, gram, u_splits=u_splits), best_swaps_torch(weight, keep, corr, gram), 0
    )


def test_ties_go_to_smallest_u_then_p():
    # identical features and equal weights: every (u, p) pair has the same dL
    d = 24
    weight = torch.ones(3, d, dtype=torch.float64, device=DEVICE)
    weight[:, ::2] = 2.0
    gram = torch.ones(d, d, dtype=torch.float64, device=DEVICE)
    keep = torch.zeros(3, d, dtype=torch.bool, device=DEVICE)
    keep[:, d // 2 :] = True
    keep[1, 3] = True
    keep[2] = ~keep[2]
    corr = correlation(weight, gram, keep)
    ref = best_swaps_torch(weight, keep, corr, gram)
    for u_splits in (1, 2):
        got = best_swaps_triton(weight, keep, corr, gram, u_splits=u_splits)
        _assert_same(got, ref, atol=0)


def test_float32_matches_torch_backend():
    weight, corr, gram, keep = _problem(21, 48, 0.5, 6, dtype=torch.float32)
    ref = best_swaps_torch(weight, keep, corr, gram)
    got = best_swaps_triton(weight, keep, corr, gram)
    _assert_same(got, ref, atol=0)
    assert got[2].dtype == torch.float32


def test_dispatch_and_refine_mask_equal_torch():
    weight, gram = layer_problem(9, 32, seed=8)
    keep = warmstart_mask(weight, "magnitude", sparsity=0.6)
    args = [t.to(DEVICE) for t in (weight, keep, correlation(weight, gram, keep), gram)]
    _assert_same(best_swaps("triton", *args), best_swaps_torch(*args), 0)
    ref = refine_mask(weight, gram, keep, max_iters=30, dtype=torch.float64, backend="torch", device=DEVICE)
    res = refine_mask(weight, gram, keep, max_iters=30, dtype=torch.float64, backend="triton", device=DEVICE)
    assert torch.equal(res.mask, ref.mask)
    assert torch.equal(res.n_swaps, ref.n_swaps)
    assert res.n_swaps.sum() > 0


def test_resolve_backend(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("auto", cpu, None) in ("numba", "torch")  # never triton on the CPU
    assert resolve_backend("triton", cpu, None) == "triton"  # allowed in the interpreter
    assert resolve_backend("triton", cpu, (2, 4)) == "nm"
    monkeypatch.delenv("TRITON_INTERPRET")
    assert resolve_backend("auto", cpu, None) in ("numba", "torch")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        resolve_backend("triton", cpu, None)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        refine_mask(torch.ones(2, 4), torch.eye(4), torch.ones(2, 4, dtype=torch.bool), backend="triton")


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("d_out", "d_in"), [(70, 300), (128, 1024)])
def test_cuda_equals_torch_backend(dtype, d_out, d_in):
    weight, corr, gram, keep = _problem(d_out, d_in, 0.6, 9, dtype=dtype)
    ref = best_swaps_torch(weight, keep, corr, gram)
    _assert_same(best_swaps_triton(weight, keep, corr, gram), ref, atol=0)
    _assert_same(best_swaps_triton(weight, keep, corr, gram, u_splits=1), ref, atol=0)
    assert resolve_backend("auto", torch.device("cuda"), None) == "triton"
    w64, g64 = (t.double() for t in (weight, gram))
    ref_mask = refine_mask(w64, g64, keep, max_iters=20, dtype=dtype, backend="torch").mask
    assert torch.equal(refine_mask(w64, g64, keep, max_iters=20, dtype=dtype, backend="triton").mask, ref_mask)
