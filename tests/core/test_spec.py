"""The typed spec: one default, meaningless combinations refused, round trip through JSON."""

import json

import pytest

from sparseswaps_prune.core.spec import (
    DEFAULT_SPEC,
    Budget,
    DSnoTRefine,
    KeepWeights,
    LeastSquares,
    NoRefine,
    OBSUpdate,
    PruneSpec,
    ScoreStart,
    SparseGPTStart,
    SwapRefine,
    build_spec,
)


def test_default_spec():
    assert DEFAULT_SPEC == PruneSpec(
        budget=Budget(sparsity=0.6), start=ScoreStart("wanda"), refine=SwapRefine(max_iters=10), weights=LeastSquares()
    )
    assert DEFAULT_SPEC.describe() == "60% per row: wanda -> sparseswaps T=10 (mask) -> ls (diag ridge 0.1)"
    assert build_spec() == DEFAULT_SPEC
    assert DEFAULT_SPEC.weights == LeastSquares(solver="direct", damp=0.1, guard=False, ridge="diag")


@pytest.mark.parametrize(
    "spec",
    [
        DEFAULT_SPEC,
        build_spec(nm=(2, 4), start="sparsegpt", weights="obs", start_damp=0.05),
        build_spec(start="admm", scope="layer", refine="none", weights="start"),
        build_spec(start="alps", start_damp=0.02, weights="alps", guard=True),
        build_spec(start="wanda", weights="admm", damp=0.2),
        build_spec(refine="dsnot", weights="keep", scope="layer"),
        build_spec(refine="none", weights="cg", guard=False, damp=0.0),
        build_spec(objective="refit", max_iters=3, search_dtype="float64", backend="torch", eps=1e-6),
        build_spec(ridge="diag", weights="cg"),
        build_spec(start="admm", scope="layer", swap_scope="row", objective="refit"),
    ],
)
def test_json_round_trip(spec):
    assert PruneSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_build_spec_switches_stages_and_keeps_the_rest():
    spec = build_spec(nm=(2, 4))
    assert spec.budget == Budget(nm=(2, 4)) and spec.refine == DEFAULT_SPEC.refine
    assert build_spec(spec, sparsity=0.5).budget == Budget(sparsity=0.5)
    assert build_spec(weights="cg").weights == LeastSquares(solver="cg")
    assert build_spec(weights="obs").weights == OBSUpdate(damp=0.01, guard=False)
    assert build_spec(weights="keep").weights == KeepWeights() and not build_spec(weights="keep").updates_weights
    assert build_spec(refine="none").refine == NoRefine() and build_spec(refine="dsnot").refine == DSnoTRefine()
    assert build_spec(start="sparsegpt").start == SparseGPTStart()
    assert build_spec(max_iters=7, weights="ls").refine.max_iters == 7  # "ls" is the default: damp etc. kept


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sparsity": 0.5, "nm": (2, 4)}, ValueError, "not both"),
        ({"sparsity": 1.0}, ValueError, r"\[0, 1\)"),
        ({"sparsity": float("nan")}, TypeError, "sparsity"),
        ({"nm": (2, 4), "scope": "layer"}, ValueError, "scope='layer' has no meaning"),
        ({"scope": "global"}, ValueError, "scope must be one of"),
        ({"start": "random"}, ValueError, "start must be one of"),
        ({"start_damp": 0.1}, ValueError, "start_damp is an option of start='sparsegpt', 'admm' or 'alps'"),
        ({"weights": "start"}, ValueError, "start 'wanda' computes none"),
        ({"start": "admm", "weights": "start"}, ValueError, "use refine='none'"),
        ({"start": "admm", "refine": "none", "weights": "start", "damp": 0.1}, ValueError, "use start_damp"),
        ({"refine": "dsnot", "max_iters": 3}, ValueError, "max_iters is an option of refine='sparseswaps'"),
        ({"refine": "none", "objective": "refit"}, ValueError, "objective is an option of refine='sparseswaps'"),
        ({"max_iters": 2.5}, TypeError, "max_iters must be an int"),
        ({"max_iters": -1}, ValueError, "max_iters must be an int >= 0"),
        ({"eps": -1.0}, ValueError, "eps must be >= 0"),
        ({"weights": "keep", "damp": 0.1}, ValueError, "damp is an option of a weight update"),
        ({"weights": "keep", "objective": "refit"}, ValueError, "LeastSquares"),
        ({"weights": "cg", "objective": "refit"}, ValueError, "LeastSquares"),
        ({"weights": "obs", "objective": "refit"}, ValueError, "LeastSquares"),
        ({"damp": float("inf")}, ValueError, "damp must be a finite number"),
        ({"damp": -1e-3}, ValueError, "damp must be >= 0"),
        ({"guard": 1}, TypeError, "guard must be a bool"),
        ({"start": "sparsegpt", "nm": (2, 3)}, ValueError, "multiple of m=3"),
        ({"ridge": "l2"}, ValueError, "ridge must be one of mean, diag"),
        ({"weights": "obs", "ridge": "diag"}, ValueError, "ridge is an option of weights='ls' or 'cg'"),
        ({"weights": "keep", "ridge": "mean"}, ValueError, "ridge is an option of weights='ls' or 'cg'"),
        ({"swap_scope": "layer"}, ValueError, "swap scope must be one of row; got 'layer'"),
        ({"refine": "dsnot", "swap_scope": "row"}, ValueError, "swap_scope is an option of refine='sparseswaps'"),
    ],
)
def test_meaningless_or_bad_options_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        build_spec(**kwargs)


def test_ridge_takes_its_own_default_damp_unless_given():
    assert DEFAULT_SPEC.weights.ridge == "diag" and DEFAULT_SPEC.weights.damp == 0.1
    mean = build_spec(ridge="mean").weights
    assert mean == LeastSquares(ridge="mean", damp=1e-3) and not mean.guard
    assert build_spec(ridge="mean", damp=0.05).weights.damp == 0.05
    assert build_spec(damp=0.05, ridge="mean").weights.damp == 0.05
    assert build_spec(build_spec(ridge="mean"), max_iters=3).weights.damp == 1e-3  # kept when ridge is unchanged
    assert build_spec(build_spec(ridge="mean"), ridge="diag").weights.damp == 0.1


def test_swap_scope_row_under_a_layer_budget():
    spec = build_spec(start="admm", scope="layer", swap_scope="row")
    assert spec.refine == SwapRefine(scope="row") and spec.budget.scope == "layer"
    assert spec.describe() == "60% per layer: admm -> sparseswaps T=10 (mask) (within rows) -> ls (diag ridge 0.1)"
    assert PruneSpec.from_dict({**DEFAULT_SPEC.to_dict(), "refine": {"kind": "sparseswaps"}}) == DEFAULT_SPEC


def test_recipes_are_specs_that_options_change():
    from sparseswaps_prune import RECIPES

    assert RECIPES["default"] is DEFAULT_SPEC
    assert RECIPES["paper"].describe() == "60% per row: wanda -> sparseswaps T=100 (mask) -> keep"
    assert RECIPES["admm"] == build_spec(start="admm", scope="layer", refine="none", weights="start")
    assert RECIPES["alps-swaps"] == build_spec(
        start="alps", scope="layer", swap_scope="row", objective="refit", max_iters=25
    )
    assert RECIPES["alps-swaps"].weights == DEFAULT_SPEC.weights  # the re-fit objective's own re-fit
    seventy = build_spec(RECIPES["alps"], sparsity=0.7)
    assert seventy.budget == Budget(sparsity=0.7, scope="layer") and seventy.start == RECIPES["alps"].start
    # N:M fixes every row's count: a layer-wise recipe selects per row, unless a scope is asked for
    assert build_spec(RECIPES["sparsegpt"], nm=(2, 4)).budget == Budget(nm=(2, 4), scope="row")
    with pytest.raises(ValueError, match="scope='layer' has no meaning"):
        build_spec(RECIPES["sparsegpt"], nm=(2, 4), scope="layer")
    for name, spec in RECIPES.items():
        assert PruneSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec, name


def test_stages_are_type_checked():
    with pytest.raises(TypeError, match="refine must be one of SwapRefine, DSnoTRefine, NoRefine"):
        PruneSpec(refine=LeastSquares())
    with pytest.raises(TypeError, match="budget must be a Budget"):
        PruneSpec(budget=0.5)
    with pytest.raises(ValueError, match="unknown weights kind"):
        PruneSpec.from_dict(DEFAULT_SPEC.to_dict() | {"weights": {"kind": "magic"}})
