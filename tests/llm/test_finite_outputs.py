"""Nothing non-finite is saved: a pruned block whose weights are not finite stops the run naming the block and layer."""

from __future__ import annotations

import pytest
import torch

from sparseswaps_prune.llm import pipeline
from sparseswaps_prune.llm.data import load_calibration
from sparseswaps_prune.llm.models import tiny_model
from sparseswaps_prune.llm.pipeline import PruneOptions, prune_model
from sparseswaps_prune.modules import check_finite_layers, find_layers


def test_check_finite_layers_names_the_block_layer_rows_and_the_float16_fix():
    model = tiny_model("llama", seed=0).half()
    layers = find_layers(model.model.layers[1], prefix="model.layers.1")
    check_finite_layers(layers, 1)  # finite: nothing raised
    with torch.no_grad():
        layers[2].module.weight[[0, 5]] = torch.tensor(70000.0).half()  # beyond float16's range: inf
    with pytest.raises(ValueError, match=rf"block 1, layer {layers[2].name}: .* 2 rows .*float16 holds at most 65504"):
        check_finite_layers(layers, 1)


def test_a_block_whose_pruned_weights_overflow_stops_before_the_next_block(tiny_tokenizer, monkeypatch):
    model = tiny_model("llama", seed=0)
    calib = load_calibration("builtin", tiny_tokenizer, nsamples=2, seqlen=16)
    original = pipeline.apply_mask

    def overflowing(layer, keep_mask, weight=None):  # a weight update that overflows when written
        original(layer, keep_mask, weight)
        with torch.no_grad():
            layer.module.weight_orig[0, 0] = float("inf")

    monkeypatch.setattr(pipeline, "apply_mask", overflowing)
    with pytest.raises(ValueError, match=r"block 0, layer model\.layers\.0\..*not finite in 1 rows"):
        prune_model(model, calib, PruneOptions(recipe="wanda"), progress=False)
