"""core/budgets.py: OWL's outlier ratios and block sparsities against a transcription of OWL's code."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparseswaps_prune.core.budgets import outlier_ratio, owl_sparsities


def owl_reference(block_metrics: list[list[torch.Tensor]], m: float, lam: float, sparsity: float) -> list[float]:
    """OWL's code (github.com/luuyin/OWL, lib/prune_all.py: ``check_outlier_mean`` and the first pass of
    ``prune_wanda_outlier``), transcribed: each block's Wanda metrics ``|W| * sqrt(scaler_row)`` in, the blocks'
    ``layer_sparsity_ratio = 1 - all_layer_ratio[i]`` out (before its floor of 0.01, which never applies here)."""

    def check_outlier_mean(mask, threshold):
        max_shred = torch.mean(mask) * threshold
        return float((mask > max_shred).sum().item()) / mask.numel() * 100

    all_layer_ratio = []
    for layer_wmetric in block_metrics:
        layer_wmetric = torch.cat([torch.flatten(x.cpu()) for x in layer_wmetric])
        all_layer_ratio.append(check_outlier_mean(layer_wmetric, m))
    all_layer_ratio = np.array(all_layer_ratio)
    all_layer_ratio = (all_layer_ratio - all_layer_ratio.min()) * (
        1 / (all_layer_ratio.max() - all_layer_ratio.min()) * lam * 2
    )
    all_layer_ratio = all_layer_ratio - np.mean(all_layer_ratio) + (1 - sparsity)
    return [1 - r for r in all_layer_ratio]


def random_blocks(n_blocks: int = 5, seed: int = 0) -> list[tuple[list[torch.Tensor], list[torch.Tensor], int]]:
    """Per block: float32 weights ``[d_out, d_in]`` of three layers with block-dependent heavy tails, their summed
    squared inputs ``[d_in]`` and the number of calibration samples they sum over."""
    gen = torch.Generator().manual_seed(seed)
    blocks = []
    for b in range(n_blocks):
        shapes = [(24, 16), (16, 24), (40, 16)]
        weights = [torch.randn(shape, generator=gen) * (1 + 4 * b * (torch.rand(shape, generator=gen) < 0.02)) for
                   shape in shapes]  # fmt: skip
        sq_norms = [torch.rand(d_in, generator=gen) ** 2 * 50 for _, d_in in shapes]
        blocks.append((weights, sq_norms, 10))
    return blocks


@pytest.mark.parametrize("m, lam, target", [(5.0, 0.08, 0.6), (3.0, 0.05, 0.7), (2.0, 0.2, 0.5)])
def test_matches_owls_code(m, lam, target):
    blocks = random_blocks()
    # OWL's scaler_row is the mean over the samples of the squared norms: a common factor, which changes nothing
    metrics = [
        [w.abs() * torch.sqrt((s / n).reshape(1, -1)) for w, s in zip(ws, ss, strict=True)] for ws, ss, n in blocks
    ]
    ratios = [outlier_ratio(ws, ss, m) for ws, ss, _ in blocks]
    expected = owl_reference(metrics, m, lam, target)
    assert len(set(ratios)) > 2  # the blocks differ
    assert owl_sparsities(ratios, target, lam) == pytest.approx(expected, abs=1e-12)
    sparsities = owl_sparsities(ratios, target, lam)
    assert np.mean(sparsities) == pytest.approx(target, abs=1e-12)
    assert max(sparsities) - min(sparsities) == pytest.approx(2 * lam, abs=1e-12)
    assert np.argmax(ratios) == np.argmin(sparsities) and np.argmin(ratios) == np.argmax(sparsities)


def test_outlier_ratio_counts_scores_above_m_times_the_mean_of_all_layers():
    weights = [torch.tensor([[1.0, -1.0], [1.0, 9.0]]), torch.tensor([[2.0, 0.0, 0.0]])]
    sq_norms = [torch.tensor([4.0, 1.0]), torch.tensor([1.0, 1.0, 1.0])]
    # scores [2, 1, 2, 9] and [2, 0, 0]: mean 16 / 7; above 2x the mean (4.57): only 9
    assert outlier_ratio(weights, sq_norms, 2.0) == pytest.approx(1 / 7)
    assert outlier_ratio(weights, sq_norms, 0.5) == pytest.approx(4 / 7)  # above 1.14: 2, 2, 9, 2
    assert outlier_ratio([weights[0].double()], [sq_norms[0]], 100.0) == 0.0


def test_equal_ratios_or_zero_lambda_give_the_uniform_budget():
    assert owl_sparsities([0.01, 0.01, 0.01], 0.6, 0.08) == [0.6, 0.6, 0.6]
    assert owl_sparsities([0.0, 0.02, 0.01], 0.7, 0.0) == [0.7, 0.7, 0.7]
    assert owl_sparsities([0.03], 0.5, 0.08) == [0.5]


def test_lambda_must_keep_every_sparsity_in_range():
    ratios = [0.0, 0.0, 0.0, 0.04]  # one outlier block: pruned 2 * lambda * 3/4 below the target
    assert min(owl_sparsities(ratios, 0.3, 0.199)) == pytest.approx(0.3 - 2 * 0.199 * 3 / 4)  # lambda < 0.2 fits
    with pytest.raises(ValueError, match=r"owl_lambda=0.201 .* use owl_lambda below 0.2\b"):
        owl_sparsities(ratios, 0.3, 0.201)
    with pytest.raises(ValueError, match=r"to 1.05 .* owl_lambda below 0.2\b"):  # the others: 2 * lambda / 4 above
        owl_sparsities(ratios, 0.9, 0.3)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: owl_sparsities([0.0, 0.1], 1.0, 0.08), "sparsity must be < 1"),
        (lambda: owl_sparsities([0.0, 0.1], -0.1, 0.08), "sparsity must be >= 0"),
        (lambda: owl_sparsities([0.0, 0.1], 0.6, -0.01), "owl_lambda must be >= 0"),
        (lambda: owl_sparsities([], 0.6, 0.08), "at least one block"),
        (lambda: owl_sparsities([0.0, 1.5], 0.6, 0.08), "outlier ratio must be <= 1"),
        (lambda: outlier_ratio([torch.ones(2, 3)], [torch.ones(3)], 0.0), "owl_m must be > 0"),
        (lambda: outlier_ratio([torch.ones(2, 3)], [torch.ones(2)], 5.0), r"\[d_out, d_in\] and \[d_in\]"),
        (lambda: outlier_ratio([], [], 5.0), "at least one layer"),
        (lambda: outlier_ratio([torch.full((2, 3), float("nan"))], [torch.ones(3)], 5.0), "not finite"),
    ],
)
def test_bad_input_names_the_option(call, match):
    with pytest.raises(ValueError, match=match):
        call()
