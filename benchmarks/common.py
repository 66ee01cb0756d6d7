"""Helpers shared by the benchmark scripts (``import common``: a script's own directory is on ``sys.path``).

No benchmark imports another benchmark; what more than one of them needs lives here.
"""

from __future__ import annotations

from typing import Any

import torch

from sparseswaps_prune.core.gram import GramAccumulator
from sparseswaps_prune.llm.data import load_calibration
from sparseswaps_prune.llm.layers import find_blocks
from sparseswaps_prune.llm.models import load_model
from sparseswaps_prune.modules import find_layers, input_hooks

Grams = dict[str, dict[str, GramAccumulator]]  # layer name -> {"small", "large", "holdout"}


def pattern_options(pattern: str) -> dict[str, Any]:
    """``"60%"`` -> ``{"sparsity": 0.6, "nm": None}``; ``"2:4"`` -> ``{"sparsity": None, "nm": (2, 4)}``."""
    if ":" in pattern:
        n, m = (int(v) for v in pattern.split(":"))
        return {"sparsity": None, "nm": (n, m)}
    return {"sparsity": float(pattern.rstrip("%")) / 100, "nm": None}


def capture_grams(blocks: list[int], small: int, large: int, holdout: int, seqlen: int) -> tuple[dict, Grams]:
    """Dense weights ``{name: [d_out, d_in]}`` and three Grams of every linear layer of ``blocks`` of the default
    model, from one dense forward over built-in calibration windows: ``"small"`` (the first ``small`` windows),
    ``"large"`` (all ``large`` windows, the small ones included) and ``"holdout"`` (``holdout`` windows whose
    tokens lie outside every calibration window)."""
    model, tokenizer = load_model()
    windows = load_calibration("builtin", tokenizer, large, seqlen, seed=0, holdout=holdout)
    prefix, block_list = find_blocks(model)
    layers = [layer for b in blocks for layer in find_layers(block_list[b], prefix=f"{prefix}.{b}")]
    grams: Grams = {
        layer.name: {part: GramAccumulator(layer.d_in, dtype=torch.float64) for part in ("small", "large", "holdout")}
        for layer in layers
    }
    part = "small"

    def record(name: str, x: torch.Tensor) -> None:
        grams[name][part].add(x)
        if part == "small":
            grams[name]["large"].add(x)

    with torch.no_grad(), input_hooks(layers, record):
        for i, window in enumerate(windows):
            part = "small" if i < small else "large" if i < large else "holdout"
            model(window[None])
    weights = {layer.name: layer.weight_2d().detach().clone() for layer in layers}
    return weights, grams
