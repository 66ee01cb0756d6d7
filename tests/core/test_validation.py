import sys
from collections import Counter

import pytest
import torch

from sparseswaps_prune import build_spec, prune_layer, refine_mask, row_losses, warmstart_mask
from sparseswaps_prune.core.checks import (
    check_bool,
    check_choice,
    check_gram,
    check_int,
    check_positive,
    check_str,
    check_weight,
)
from sparseswaps_prune.core.spec import SPARSESWAPS_SPEC
from tests.core.reference import layer_problem

W, G = layer_problem(4, 8, seed=0, dtype=torch.float32)
K = warmstart_mask(W, "magnitude", sparsity=0.5)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"weight": torch.randn(2, 3, 4)}, ValueError, "2-D"),
        ({"weight": torch.ones(4, 8, dtype=torch.long)}, TypeError, "floating"),
        ({"gram": torch.eye(7)}, ValueError, r"\[8, 8\]"),
        ({"weight": W.clone().index_fill_(1, torch.tensor([2]), float("nan"))}, ValueError, "NaN"),
        ({"gram": G.clone().fill_diagonal_(float("inf"))}, ValueError, "NaN or Inf"),
        ({"gram": torch.zeros(8, 8)}, ValueError, "no calibration tokens"),
        ({"keep_mask": K.float()}, TypeError, "bool"),
        ({"keep_mask": K[:, :4]}, ValueError, "shape"),
        ({"max_iters": -1}, ValueError, "max_iters"),
        ({"nm": (2, 3)}, ValueError, "does not divide"),
        ({"nm": (2, 4)}, ValueError, "2:4 pattern"),
        ({"backend": "cuda-magic"}, ValueError, "backend"),
        ({"dtype": torch.float16}, TypeError, "dtype"),
    ],
)
def test_refine_rejects_bad_input(kwargs, error, match):
    args = {"weight": W, "gram": G, "keep_mask": K} | kwargs
    kw = {k: v for k, v in args.items() if k not in ("weight", "gram", "keep_mask")}
    with pytest.raises(error, match=match):
        refine_mask(args["weight"], args["gram"], args["keep_mask"], **kw)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sparsity": 1.0}, ValueError, r"\[0, 1\)"),
        ({"sparsity": -0.1}, ValueError, r"\[0, 1\)"),
        ({"sparsity": float("nan")}, TypeError, "sparsity"),
        ({"sparsity": 0.5, "nm": (2, 4)}, ValueError, "exactly one"),
        ({}, ValueError, "exactly one"),
        ({"nm": (5, 4)}, ValueError, "1 <= n <= m"),
        ({"nm": (0, 4)}, ValueError, "n must be at least 1"),
        ({"nm": (1, 3)}, ValueError, "does not divide"),
        ({"nm": "2:4"}, TypeError, "pair of ints"),
    ],
)
def test_warmstart_rejects_bad_budget(kwargs, error, match):
    with pytest.raises(error, match=match):
        warmstart_mask(W, "magnitude", **kwargs)


def test_unknown_warmstart_and_scope():
    with pytest.raises(ValueError, match="magnitude, wanda, ria"):
        warmstart_mask(W, "sparsegpt-ish", sparsity=0.5)
    with pytest.raises(ValueError, match="scope"):
        warmstart_mask(W, "magnitude", sparsity=0.5, scope="global")


def test_row_losses_checks_mask():
    with pytest.raises(ValueError, match="shape"):
        row_losses(W, G, K.T)


@pytest.mark.parametrize(
    ("gram", "match"),
    [
        (G.clone().fill_diagonal_(-1.0), "negative diagonal"),
        (G + torch.triu(torch.ones(8, 8), 1) * float(G.diagonal().max()), "not symmetric"),
        (G + (torch.ones(8, 8) - torch.eye(8)) * 2 * float(G.diagonal().max()), r"\|G_ij\| > sqrt\(G_ii G_jj\)"),
        (torch.empty(8, 8, device="meta"), "meta"),
    ],
)
def test_non_gram_matrices_are_refused_before_any_work(gram, match):
    """A non-symmetric or indefinite "Gram" would make losses rise or go negative (and the numba kernel's
    Cauchy-Schwarz skip invalid): refused by every entry point."""
    with pytest.raises(ValueError, match=match):
        refine_mask(W, gram, K)
    with pytest.raises(ValueError, match=match):
        warmstart_mask(W, "wanda", sparsity=0.5, gram=gram)


def test_float32_gram_of_real_inputs_passes():
    x = torch.randn(4096, 64) * torch.logspace(-3, 3, 64)  # wide dynamic range, float32 rounding
    x[:, 1] = x[:, 0]  # collinear inputs: |G_01| = sqrt(G_00 G_11) up to rounding
    check_gram(x.T @ x, 64)


def test_empty_and_meta_weights_and_near_one_sparsity():
    with pytest.raises(ValueError, match="nothing to prune"):
        check_weight(torch.zeros(4, 0))
    with pytest.raises(ValueError, match="meta tensor"):
        check_weight(torch.empty(4, 8, device="meta"))
    with pytest.raises(ValueError, match=r"keeps none of the 64 weights of each row.*below 0\.992188"):
        prune_layer(torch.randn(4, 64), torch.eye(64), build_spec(SPARSESWAPS_SPEC, sparsity=0.995))
    assert (
        prune_layer(torch.randn(4, 64), torch.eye(64), build_spec(SPARSESWAPS_SPEC, sparsity=0.99))
        .keep_mask.sum(1)
        .eq(1)
        .all()
    )


def test_nm_keeping_no_weight_is_refused_by_every_entry_point():
    """Issue 47, item 3: ``nm=(0, m)`` pruned every weight (an all-zero model, exit 0); it is refused like
    ``sparsity`` near 1, by the spec and by every function that takes a budget, naming ``nm``."""
    from sparseswaps_prune.core.alps import alps_prune
    from sparseswaps_prune.core.sparsegpt import sparsegpt_prune

    match = r"nm=\(0, 4\) keeps none of every 4 weights.*n must be at least 1"
    with pytest.raises(ValueError, match=match):
        build_spec(SPARSESWAPS_SPEC, nm=(0, 4))
    with pytest.raises(ValueError, match=match):
        warmstart_mask(W, "magnitude", nm=(0, 4))
    with pytest.raises(ValueError, match=match):
        alps_prune(W, G, nm=(0, 4))
    with pytest.raises(ValueError, match=match):
        sparsegpt_prune(W, G, nm=(0, 4))
    with pytest.raises(ValueError, match=match):
        refine_mask(W, G, K, nm=(0, 4))
    # n = m keeps every weight (as sparsity 0 does): accepted
    assert warmstart_mask(W, "magnitude", nm=(4, 4)).all()


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: check_int(0, "nsamples", low=1), ValueError, r"^nsamples must be a positive int, got 0$"),
        (lambda: check_int(2.5, "max_iters", low=0), TypeError, r"^max_iters must be an int >= 0, got 2.5$"),
        (lambda: check_int(True, "seed", low=0), TypeError, r"^seed must be an int >= 0, got True$"),
        (lambda: check_int(2**64, "seed", low=0, below=2**64), ValueError, r"an int in \[0, 2\*\*64\), got"),
        (lambda: check_int(-1, "seed", low=0, below=10), ValueError, r"^seed must be an int in \[0, 10\), got -1$"),
        (lambda: check_int(0, "eval_windows", low=1, none_ok=True), ValueError, "a positive int or None, got 0"),
        (lambda: check_int("3", "n"), TypeError, r"^n must be an int, got '3'$"),
        (lambda: check_choice("fp8", "dtype", ("float32", "bfloat16")), ValueError, "one of float32, bfloat16; got"),
        (lambda: check_bool(1, "blockwise"), TypeError, r"^blockwise must be a bool, got 1$"),
        (lambda: check_str(None, "calib"), TypeError, r"^calib must be a str, got None$"),
        (lambda: check_str(3, "eval", none_ok=True), TypeError, r"^eval must be a str or None, got 3$"),
        (lambda: check_positive(0.0, "lr"), ValueError, r"^lr must be > 0, got 0.0$"),
        (
            lambda: check_positive(-1, "rho", note="the penalty"),
            ValueError,
            r"^rho must be > 0 \(the penalty\), got -1$",
        ),
        (lambda: check_positive(float("inf"), "lr"), ValueError, r"^lr must be a finite number, got inf$"),
        (lambda: check_positive(True, "lr"), TypeError, r"^lr must be a number, got True$"),
    ],
)
def test_the_shared_checkers_name_the_option_and_what_it_accepts(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_the_shared_checkers_return_what_they_accept():
    assert check_int(2**64 - 1, "seed", low=0, below=2**64) == 2**64 - 1
    assert check_int(None, "eval_windows", low=1, none_ok=True) is None
    assert check_choice("row", "scope", ("row", "layer")) == "row"
    assert check_positive(3, "lr") == 3.0 and isinstance(check_positive(3, "lr"), float)
    assert check_bool(False, "guard") is False and check_str(None, "eval", none_ok=True) is None


def test_prune_layer_validates_the_tensors_once():
    """Issue 46, item 6: the weight and the Grams (a Gram check reads all of G) are checked once at prune_layer's
    boundary; the score start, the selection and the losses trust them."""
    calls: Counter = Counter()

    def count(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.endswith("core/checks.py"):
            calls[frame.f_code.co_name] += 1

    spec = build_spec(SPARSESWAPS_SPEC, sparsity=0.5, refine="none", start="ria")
    sys.setprofile(count)
    try:
        prune_layer(W, G, spec, holdout_gram=G)
    finally:
        sys.setprofile(None)
    assert calls["check_gram"] == 2  # the calibration and the held-out Gram
    assert calls["check_weight"] == 1 and calls["check_budget"] == 1
