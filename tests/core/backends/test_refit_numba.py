"""The compiled CPU re-fit engine (``refit_numba.NumbaRefitState``, the lazy state of ``refit_lazy``) against the torch
reference (``refit_engine.TorchRefitEngine``)."""

import pytest
import torch

from sparseswaps_prune import refine_mask, warmstart_mask
from sparseswaps_prune.core.backends import refit_engine_class, refit_lazy
from sparseswaps_prune.core.backends.refit_numba import NumbaRefitState


@pytest.mark.parametrize("scope,nm", [("row", None), ("row", (2, 4)), ("layer", None)])
@pytest.mark.parametrize("factor_slots", [2, 16])
def test_the_numba_engine_chooses_the_torch_engines_swaps(monkeypatch, scope, nm, factor_slots):
    """The lazy state (low-rank terms folded every ``factor_slots / 2`` moves, compiled, with its bound-pruned scan)
    and the torch reference apply the same swaps, iteration by iteration, and give the same re-fitted weights."""
    monkeypatch.setattr(refit_lazy, "FACTOR_SLOTS", factor_slots)
    gen = torch.Generator().manual_seed(7)
    d_in = 32
    x = torch.randn(96, d_in, generator=gen, dtype=torch.float64) @ (
        torch.eye(d_in, dtype=torch.float64) + torch.randn(d_in, d_in, generator=gen, dtype=torch.float64) / 4
    )
    gram = x.T @ x
    weight = torch.randn(6, d_in, generator=gen, dtype=torch.float64)
    keep = warmstart_mask(weight, "magnitude", nm=nm) if nm else warmstart_mask(weight, "magnitude", sparsity=0.6)
    options = {"max_iters": 40, "nm": nm, "objective": "refit", "damp": 0.01, "scope": scope}
    reference = refine_mask(weight, gram, keep, backend="torch", **options)
    run = refine_mask(weight, gram, keep, backend="numba", **options)
    assert torch.equal(reference.mask, run.mask)
    assert reference.n_swaps.tolist() == run.n_swaps.tolist()
    assert int(run.n_swaps.sum()) > 0
    assert torch.allclose(reference.loss_after, run.loss_after, rtol=1e-9)
    torch.testing.assert_close(reference.weight, run.weight, rtol=1e-9, atol=1e-12)


def test_the_numba_engine_rejects_bad_arguments():
    assert refit_engine_class("numba") is NumbaRefitState
    weight = torch.randn(2, 8, dtype=torch.float64)
    gram, keep = weight.T @ weight + torch.eye(8, dtype=torch.float64), weight.abs() > 0.5
    with pytest.raises(ValueError, match="factor_slots must be an even number"):
        NumbaRefitState(weight, keep, gram, 0.1, 8, 8, None, factor_slots=3)
    with pytest.raises(ValueError, match="runs on the CPU; got tensors on meta"):
        NumbaRefitState(weight.to("meta"), keep, gram, 0.1, 8, 8, None)
    with pytest.raises(TypeError, match="abstract"):  # the lazy state without an engine's scan and moves
        refit_lazy.LazyRefitState(weight, keep, gram, 0.1, 8, 8, None)
