"""OWL's per-block sparsity budgets of a causal LM from one dense forward (``PruneOptions.sparsity_profile="owl"``).

The calibration windows run once through the dense model, block by block (:mod:`~sparseswaps_prune.llm.capture`),
while forward hooks sum each pruned layer's squared inputs per feature (the Gram diagonal; no Gram is formed). Each
block's outlier ratio of the Wanda scores and the blocks' sparsities are then OWL's
(:mod:`sparseswaps_prune.core.budgets`). The result depends only on the dense model, the windows and the options,
so a resumed run recomputes it (before any finished block is restored) to the same budgets, and every rank of a
distributed run (each forwards all the windows) gets the budgets one process gets. The block-wise path
(:mod:`~sparseswaps_prune.llm.streaming`) reads each block from the checkpoint for its forward and drops it after.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from sparseswaps_prune.core.budgets import outlier_ratio, owl_sparsities
from sparseswaps_prune.llm.capture import capture_block_inputs
from sparseswaps_prune.llm.offload import on_device
from sparseswaps_prune.modules import find_layers, input_hooks

logger = logging.getLogger(__name__)

__all__ = ["BlockLoader", "owl_block_sparsities"]

BlockLoader = Callable[[int], contextlib.AbstractContextManager[None]]
"""``loader(index)``: a context manager inside which decoder block ``index`` has its weights on the compute device."""


@torch.no_grad()
def owl_block_sparsities(
    model: nn.Module,
    blocks: nn.ModuleList,
    blocks_name: str,
    calib_tokens: torch.Tensor,
    *,
    target: float,
    m: float,
    lam: float,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    device: torch.device | str = "cpu",
    batch_size: int = 1,
    progress: bool = False,
    loader: BlockLoader | None = None,
) -> dict[int, float]:
    """OWL's sparsity of every decoder block that has a pruned layer, from one dense forward of ``calib_tokens``.

    Args:
        model: the dense causal LM on the CPU (or dispatched by accelerate), in eval mode; its weights are not
            modified (each block visits ``device`` and returns).
        blocks, blocks_name: its decoder blocks and their dotted path
            (:func:`~sparseswaps_prune.modules.find_blocks`).
        calib_tokens: ``[n, seqlen]`` int64 calibration windows.
        target: the mean sparsity over the blocks, in ``[0, 1)``.
        m, lam: OWL's ``M`` (``owl_m``) and ``lambda`` (``owl_lambda``).
        include, exclude: fnmatch patterns of the pruned layers (as in ``PruneOptions``); blocks without one get
            no budget and are left out of OWL's statistics.
        device: compute device for each block.
        batch_size: calibration windows per forward.
        progress: show a tqdm bar.
        loader: puts each block's weights on ``device`` for its forward (default:
            :func:`~sparseswaps_prune.llm.offload.on_device`; the block-wise
            path reads the block from the checkpoint and drops it after). The capture of the first block's inputs
            runs before, with the embeddings and block 0 where ``model`` has them.

    Returns:
        ``{block index: sparsity}``: each in ``[0, 1)``, their mean ``target``.

    Raises:
        ValueError: ``lam`` puts some block's sparsity outside ``[0, 1)`` (naming the largest that fits), or bad
            ``m``, ``target`` or windows; raised before anything is modified.
    """
    device = torch.device(device)
    loader = loader or (lambda index: on_device(blocks[index], device))
    inputs = capture_block_inputs(model, blocks, calib_tokens, batch_size=batch_size)
    ratios: dict[int, float] = {}
    for index, block in enumerate(tqdm(blocks, desc="OWL pre-pass", disable=not progress, leave=False)):
        layers = find_layers(block, prefix=f"{blocks_name}.{index}", include=include, exclude=exclude)
        sq_norms = {layer.name: torch.zeros(layer.d_in, dtype=torch.float64, device=device) for layer in layers}

        def record(name: str, x: torch.Tensor, sums: dict[str, torch.Tensor] = sq_norms) -> None:
            sums[name] += x.reshape(-1, x.shape[-1]).double().square().sum(dim=0)

        with loader(index):
            with input_hooks(layers, record):
                inputs = inputs.run_block(block, device)
            if layers:
                weights = [layer.dense_weight_2d() for layer in layers]
                ratios[index] = outlier_ratio(weights, [sq_norms[layer.name] for layer in layers], m)
    sparsities = dict(zip(ratios, owl_sparsities(list(ratios.values()), target, lam), strict=True))
    logger.info(
        "OWL (M=%g, lambda=%g) block sparsities: %s",
        m,
        lam,
        ", ".join(f"{index}: {s:.3f} (outliers {ratios[index]:.2%})" for index, s in sparsities.items()),
    )
    return sparsities
