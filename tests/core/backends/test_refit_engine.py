"""The re-fit engine contract: one name per engine, one class per name, every engine with the contract's members,
and the torch reference engine against the state functions it wraps."""

import inspect

import pytest
import torch

from sparseswaps_prune import warmstart_mask
from sparseswaps_prune.core.backends import (
    REFIT_ENGINES,
    refit_engine_class,
    resolve_refit_backend,
    triton_available,
)
from sparseswaps_prune.core.backends import refit_state as st
from sparseswaps_prune.core.backends.refit_engine import RefitEngine, TorchRefitEngine
from sparseswaps_prune.core.refit import damping
from tests.core.reference import layer_problem


def test_resolve_refit_backend(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_refit_backend("auto", cpu) == "numba"
    assert resolve_refit_backend("numba", cpu) == "numba"
    assert resolve_refit_backend("torch", cpu) == "torch"
    # auto on CUDA: the Triton engine where triton is installed (only the device's type is read: no GPU needed)
    assert resolve_refit_backend("auto", torch.device("cuda")) == ("triton" if triton_available() else "torch")
    assert resolve_refit_backend("torch", torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match="runs on the CPU only"):
        resolve_refit_backend("numba", torch.device("cuda"))
    with pytest.raises(ValueError, match="unknown swap-search backend 'lazy'"):
        resolve_refit_backend("lazy", cpu)
    if triton_available():  # backend="triton": the Triton engine (off CUDA only in the interpreter)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert resolve_refit_backend("triton", cpu) == "triton"
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            resolve_refit_backend("triton", cpu)
    else:
        with pytest.raises(ValueError, match="pip install triton"):
            resolve_refit_backend("triton", cpu)


def test_every_engine_name_has_a_class_with_the_contracts_members():
    members = {name for name, _ in inspect.getmembers(RefitEngine, inspect.isfunction)} - {"__init__"}
    assert {"slot_count", "build", "h_diagonal", "scan", "swap", "remove", "add", "grow", "fitted"} <= members
    names = [name for name in REFIT_ENGINES if name != "triton" or triton_available()]
    for name in names:
        engine = refit_engine_class(name)
        assert not inspect.isabstract(engine), name
        missing = [m for m in members if not callable(getattr(engine, m, None))]
        assert missing == [], (name, missing)
    assert refit_engine_class("torch") is TorchRefitEngine
    with pytest.raises(ValueError, match="unknown re-fit engine 'lazy'"):
        refit_engine_class("lazy")


@pytest.mark.parametrize("row_batch", [None, 2])
def test_the_torch_engine_is_the_state_functions(row_batch):
    """The reference engine builds (in row batches or at once) the state ``build_state`` builds, and its moves are
    ``swap_slots``, ``remove_kept`` + ``place_pruned`` and ``add_pruned``, bit for bit."""
    weight, gram = layer_problem(5, 24, seed=2)
    weight, gram = weight.double(), gram.double()
    keep = warmstart_mask(weight, "wanda", gram=gram, sparsity=0.5)
    lam = damping(gram, 0.01)
    k, q = 14, 14  # a spare slot of each kind
    engine = TorchRefitEngine(weight, keep, gram, lam, k, q, None, row_offset=torch.arange(5), row_batch=row_batch)
    want = st.build_state(weight, keep, gram, lam, k, q)
    for r0 in range(0, 5, row_batch or 5):  # each row batch built alone (a batch's products round as a batch)
        sub = torch.arange(r0, min(5, r0 + (row_batch or 5)))
        want.assign(sub, st.build_state(weight[sub], keep[sub], gram, lam, k, q))
    rows, floor = torch.tensor([4, 1, 2]), st.pivot_floor(gram, lam)

    def same() -> bool:
        return all(torch.equal(getattr(engine, f), getattr(want, f)) for f in vars(want))

    assert same()
    scan = engine.scan(rows)
    assert all(torch.equal(a, b) for a, b in zip(scan, st.scan_swaps(want, weight, rows, floor), strict=True))
    _, slot_i, slot_j = scan
    assert torch.equal(torch.stack(engine.swap(rows, slot_i, slot_j)),
                       torch.stack(st.swap_slots(want, rows, slot_i, slot_j, gram)))  # fmt: skip
    vacant_j = (~want.pruned_ok[rows]).to(torch.int8).argmax(dim=1)
    incoming = st.remove_kept(want, rows, slot_i)
    st.place_pruned(want, rows, vacant_j, incoming)
    assert torch.equal(engine.remove(rows, slot_i, vacant_j), incoming[0]) and same()
    vacant_i = (~want.kept_ok[rows]).to(torch.int8).argmax(dim=1)
    p = want.pruned[rows, slot_j]
    st.add_pruned(want, rows, slot_j, vacant_i, gram)
    assert torch.equal(engine.add(rows, slot_j, vacant_i), p) and same()
    engine.grow(k + 2, q)
    assert engine.kept.shape == (5, k + 2) and engine.z.shape == (5, k + 2, q)
    assert torch.equal(engine.fitted(), st.fitted_weights(want, 24))
    # every row singular: named by their layer indices (row_offset: of row 0), from each row batch's build
    with pytest.raises(ValueError, match=r"singular for rows \[3, 4, 5, 6, 7\]" if row_batch is None else r"\[3, 4\]"):
        TorchRefitEngine(weight, keep, torch.zeros_like(gram), 0.0, k, q, None, row_offset=3, row_batch=row_batch)
