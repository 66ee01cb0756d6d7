"""The typed spec: one default, meaningless combinations refused, round trip through JSON."""

import dataclasses
import json
import warnings

import pytest

from sparseswaps_prune.core.spec import (
    SPARSESWAPS_SPEC,
    ADMMStart,
    Budget,
    DSnoTRefine,
    KeepWeights,
    LeastSquares,
    NoRefine,
    OBSUpdate,
    PruneSpec,
    SparseGPTStart,
    SwapRefine,
    build_spec,
)
from sparseswaps_prune.recipes import RECIPES

SWAPS = RECIPES["sparseswaps-refit"].spec  # Wanda -> SparseSwaps T=10 -> least-squares re-fit
ALPS = RECIPES["alps"].spec


def test_the_default_spec_is_sparseswaps_masks_only():
    assert build_spec() == PruneSpec() == SPARSESWAPS_SPEC == RECIPES["sparseswaps"].spec
    assert SPARSESWAPS_SPEC == PruneSpec(
        budget=Budget(sparsity=0.6), start=ADMMStart(), refine=SwapRefine(max_iters=25), weights=KeepWeights()
    )
    assert SPARSESWAPS_SPEC.describe() == "60% per row: admm -> sparseswaps T=25 (mask) -> keep"
    assert not SPARSESWAPS_SPEC.updates_weights
    assert build_spec(nm=(2, 4)).budget == Budget(nm=(2, 4), scope="row")
    assert SWAPS.describe() == "60% per row: wanda -> sparseswaps T=10 (mask) -> ls (diag ridge 0.1)"
    assert SWAPS.weights == LeastSquares(solver="direct", damp=0.1, guard=False, ridge="diag")


@pytest.mark.parametrize(
    ("kwargs", "want"),
    [
        ({"max_iters": 30}, "60% per row: admm -> sparseswaps T=30 (mask) -> keep"),
        ({"start": "wanda", "eps": 1e-6}, "60% per row: wanda -> sparseswaps T=25 (mask) -> keep"),
        (
            {"objective": "refit", "weights": "ls"},
            "60% per row: admm -> sparseswaps T=25 (refit) -> ls (diag ridge 0.1)",
        ),
    ],
)
def test_swap_options_work_on_the_default_without_a_spec(kwargs, want):
    assert build_spec(**kwargs).describe() == want


def test_swap_options_on_a_spec_that_does_not_swap_name_the_fix():
    with pytest.raises(ValueError, match=r"max_iters is an option of refine='sparseswaps'.*--refine sparseswaps"):
        build_spec(ALPS, max_iters=25)
    with pytest.raises(ValueError, match=r"start 'wanda' computes none.*--recipe sparseswaps-refit"):
        build_spec(ALPS, start="wanda")


def test_renamed_options_warn_and_map_to_their_new_names():
    with pytest.warns(DeprecationWarning, match="warmstart= is renamed start="):
        assert build_spec(warmstart="ria") == build_spec(start="ria")
    with pytest.warns(DeprecationWarning, match="refit= is renamed weights="):
        assert build_spec(refit="none").weights == KeepWeights()
    with pytest.warns(DeprecationWarning) as caught:
        assert build_spec(refit="ls", holdout_guard=True).weights == LeastSquares(guard=True)
    assert [str(w.message).split(" is")[0] for w in caught] == ["refit=", "holdout_guard="]
    with warnings.catch_warnings(), pytest.raises(ValueError, match="give start= only"):
        warnings.simplefilter("ignore", DeprecationWarning)
        build_spec(warmstart="ria", start="wanda")
    with pytest.raises(TypeError, match=r"unknown option warm_start='ria'; the options are sparsity, nm"):
        build_spec(warm_start="ria")
    with pytest.raises(TypeError, match=r"base must be a PruneSpec.*RECIPES\['alps'\].spec"):
        build_spec(RECIPES["alps"])


@pytest.mark.parametrize(
    "spec",
    [
        ALPS,
        SPARSESWAPS_SPEC,
        build_spec(SWAPS, nm=(2, 4), start="sparsegpt", weights="obs", start_damp=0.05),
        build_spec(SWAPS, start="admm", scope="layer", refine="none", weights="start"),
        build_spec(SWAPS, start="alps", start_damp=0.02, weights="alps", guard=True),
        build_spec(SWAPS, start="wanda", weights="admm", damp=0.2),
        build_spec(SWAPS, refine="dsnot", weights="keep", scope="layer"),
        build_spec(SWAPS, refine="none", weights="cg", guard=False, damp=0.0),
        build_spec(SWAPS, objective="refit", max_iters=3, search_dtype="float64", backend="torch", eps=1e-6),
        build_spec(SWAPS, ridge="diag", weights="cg"),
        build_spec(SWAPS, start="admm", scope="layer", swap_scope="row", objective="refit"),
    ],
)
def test_json_round_trip(spec):
    assert PruneSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_build_spec_switches_stages_and_keeps_the_rest():
    spec = build_spec(SWAPS, nm=(2, 4))
    assert spec.budget == Budget(nm=(2, 4)) and spec.refine == SWAPS.refine
    assert build_spec(spec, sparsity=0.5).budget == Budget(sparsity=0.5)
    assert build_spec(SWAPS, weights="cg").weights == LeastSquares(solver="cg")
    assert build_spec(SWAPS, weights="obs").weights == OBSUpdate(damp=0.01, guard=False)
    assert (
        build_spec(SWAPS, weights="keep").weights == KeepWeights()
        and not build_spec(SWAPS, weights="keep").updates_weights
    )
    assert (
        build_spec(SWAPS, refine="none").refine == NoRefine()
        and build_spec(SWAPS, refine="dsnot").refine == DSnoTRefine()
    )
    assert build_spec(SWAPS, start="sparsegpt").start == SparseGPTStart()
    assert build_spec(SWAPS, max_iters=7, weights="ls").refine.max_iters == 7  # "ls" is the default: damp etc. kept


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
        build_spec(SWAPS, **kwargs)


def test_ridge_takes_its_own_default_damp_unless_given():
    assert SWAPS.weights.ridge == "diag" and SWAPS.weights.damp == 0.1
    mean = build_spec(SWAPS, ridge="mean").weights
    assert mean == LeastSquares(ridge="mean", damp=1e-3) and not mean.guard
    assert build_spec(SWAPS, ridge="mean", damp=0.05).weights.damp == 0.05
    assert build_spec(SWAPS, damp=0.05, ridge="mean").weights.damp == 0.05
    assert build_spec(build_spec(SWAPS, ridge="mean"), max_iters=3).weights.damp == 1e-3  # kept when ridge is unchanged
    assert build_spec(build_spec(SWAPS, ridge="mean"), ridge="diag").weights.damp == 0.1


def test_swap_scope_row_under_a_layer_budget():
    spec = build_spec(SWAPS, start="admm", scope="layer", swap_scope="row")
    assert spec.refine == SwapRefine(max_iters=10, scope="row") and spec.budget.scope == "layer"
    assert spec.describe() == "60% per layer: admm -> sparseswaps T=10 (mask) (within rows) -> ls (diag ridge 0.1)"
    want = PruneSpec.from_dict({**SWAPS.to_dict(), "refine": {"kind": "sparseswaps"}})  # the stage's defaults
    assert want == dataclasses.replace(SWAPS, refine=SwapRefine())


def test_recipes_are_specs_that_options_change():
    assert RECIPES["best"].spec is ALPS and RECIPES["best"].block_tune_epochs == 2  # one ALPS spec, tuned in best
    assert RECIPES["best"].finetune_steps == 20  # then fine-tuned (the job's)
    assert RECIPES["alps"].block_tune_epochs == 0 == RECIPES["alps"].finetune_steps  # as published
    assert RECIPES["paper"].spec.describe() == "60% per row: wanda -> sparseswaps T=100 (mask) -> keep"
    assert RECIPES["admm"].spec == build_spec(SWAPS, start="admm", scope="layer", refine="none", weights="start")
    assert RECIPES["alps-swaps"].spec == build_spec(
        SWAPS, start="alps", scope="layer", swap_scope="row", objective="refit", max_iters=25
    )
    assert RECIPES["alps-swaps"].spec.weights == SWAPS.weights  # the re-fit objective's own re-fit
    # masks only, from ADMM's mask: what compare_methods.py's "start=admm,weights=keep" row ran (--max-iters 25)
    assert RECIPES["sparseswaps"].spec == build_spec(SWAPS, start="admm", weights="keep", max_iters=25)
    assert RECIPES["sparseswaps"].spec.describe() == "60% per row: admm -> sparseswaps T=25 (mask) -> keep"
    seventy = build_spec(ALPS, sparsity=0.7)
    assert seventy.budget == Budget(sparsity=0.7, scope="layer") and seventy.start == ALPS.start
    # N:M fixes every row's count: a layer-wise recipe selects per row, unless a scope is asked for
    assert build_spec(RECIPES["sparsegpt"].spec, nm=(2, 4)).budget == Budget(nm=(2, 4), scope="row")
    with pytest.raises(ValueError, match="scope='layer' has no meaning"):
        build_spec(RECIPES["sparsegpt"].spec, nm=(2, 4), scope="layer")
    for name, recipe in RECIPES.items():
        assert PruneSpec.from_dict(json.loads(json.dumps(recipe.spec.to_dict()))) == recipe.spec, name
        assert recipe.updates_weights == (name not in ("sparseswaps", "paper", "wanda")), name


def test_stages_are_type_checked():
    with pytest.raises(TypeError, match="refine must be one of SwapRefine, DSnoTRefine, NoRefine"):
        PruneSpec(refine=LeastSquares())
    with pytest.raises(TypeError, match="budget must be a Budget"):
        PruneSpec(budget=0.5)
    with pytest.raises(ValueError, match="unknown weights kind"):
        PruneSpec.from_dict(ALPS.to_dict() | {"weights": {"kind": "magic"}})
