"""Sequential block-wise pruning of a causal LM (as Wanda / SparseGPT, with SparseSwaps refinement).

For each decoder block: run the captured block inputs through it while forward hooks accumulate one Gram
per distinct layer input, compute every layer's warmstart mask and refine it, apply the masks (standard
``torch.nn.utils.prune`` reparametrization), then run the pruned block to get the next block's inputs.
With ``checkpoint_dir`` every finished block leaves what is needed to continue on disk, and a restarted
call with the same options continues from there and gives the same masks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import prune
from tqdm.auto import tqdm

from sparseswaps_prune.atomic import save_json, save_torch
from sparseswaps_prune.core.checks import check_budget
from sparseswaps_prune.core.gram import GramAccumulator
from sparseswaps_prune.core.swaps import refine_mask
from sparseswaps_prune.core.warmstart import WARMSTARTS, warmstart_mask
from sparseswaps_prune.llm.capture import BlockInputs, capture_block_inputs
from sparseswaps_prune.llm.layers import PrunableLayer, find_blocks, find_layers, group_by_input, input_hooks

logger = logging.getLogger(__name__)


@dataclass
class PruneOptions:
    """What to prune and how. Every field is recorded in the run's config.

    Attributes:
        warmstart: ``"magnitude"``, ``"wanda"`` or ``"ria"``.
        sparsity: fraction of each row pruned, in ``[0, 1)``; exclusive with ``nm``.
        nm: ``(n, m)`` semi-structured pattern, e.g. ``(2, 4)``.
        max_iters: SparseSwaps iterations ``T_max`` per layer (0: warmstart only).
        eps: a row stops once its best swap gains less than ``eps``.
        include, exclude: fnmatch patterns on fully qualified layer names (default: every linear in
            every decoder block; ``lm_head`` and embeddings are outside the blocks and never pruned).
        gram_dtype: ``"float32"`` or ``"float64"`` Gram accumulation.
        search_dtype: ``"float32"`` or ``"float64"`` swap search.
        blocks_path: dotted path of the decoder-block list when auto-detection fails.
    """

    warmstart: str = "wanda"
    sparsity: float | None = 0.6
    nm: tuple[int, int] | None = None
    max_iters: int = 100
    eps: float = 0.0
    include: list[str] | None = None
    exclude: list[str] | None = None
    gram_dtype: str = "float32"
    search_dtype: str = "float32"
    blocks_path: str | None = None

    def validate(self) -> None:
        """Raise ``ValueError``/``TypeError`` naming the bad option."""
        if self.warmstart not in WARMSTARTS:
            raise ValueError(f"unknown warmstart {self.warmstart!r}; choose one of {', '.join(WARMSTARTS)}")
        if self.nm is not None:
            self.nm = tuple(self.nm)
        check_budget(self.sparsity, self.nm, self.nm[1] if self.nm else 1)
        if isinstance(self.max_iters, bool) or not isinstance(self.max_iters, int) or self.max_iters < 0:
            raise ValueError(f"max_iters must be an int >= 0, got {self.max_iters!r}")
        for name in ("gram_dtype", "search_dtype"):
            if getattr(self, name) not in ("float32", "float64"):
                raise ValueError(f"{name} must be 'float32' or 'float64', got {getattr(self, name)!r}")


@dataclass
class LayerReport:
    """One pruned layer: shapes, achieved sparsity, losses (summed over rows, float64), swaps and time."""

    name: str
    block: int
    d_out: int
    d_in: int
    sparsity: float
    loss_warmstart: float
    loss_refined: float
    n_swaps: int
    iters: int
    seconds: float

    @property
    def kind(self) -> str:
        """The layer's own name within its block, e.g. ``q_proj``."""
        return self.name.rsplit(".", 1)[-1]

    @property
    def reduction(self) -> float:
        """Relative loss reduction of refinement over the warmstart."""
        return 0.0 if self.loss_warmstart <= 0 else 1.0 - self.loss_refined / self.loss_warmstart


@dataclass
class PruneResult:
    """What :func:`prune_model` returns: per-layer reports and both mask sets (``[d_out, d_in]`` bool, CPU)."""

    layers: list[LayerReport] = field(default_factory=list)
    masks: dict[str, torch.Tensor] = field(default_factory=dict)
    warmstart_masks: dict[str, torch.Tensor] = field(default_factory=dict)
    seconds: float = 0.0


def _fingerprint(options: PruneOptions, calib_tokens: torch.Tensor, n_blocks: int) -> str:
    """Hash of everything that determines the masks: options, calibration tokens, model depth."""
    h = hashlib.sha256(json.dumps(asdict(options), sort_keys=True).encode())
    h.update(calib_tokens.to(torch.int64).numpy().tobytes())
    h.update(str(n_blocks).encode())
    return h.hexdigest()[:16]


def _replace_weight_mask(module: nn.Module, mask: torch.Tensor) -> None:
    """Overwrite a pruned module's ``weight_mask`` (parameter layout) and recompute its masked weight."""
    module.weight_mask.copy_(mask)
    module.weight = module.weight_orig * module.weight_mask


def apply_mask(layer: PrunableLayer, mask_2d: torch.Tensor) -> None:
    """Set ``layer``'s pruning mask (``[d_out, d_in]`` bool) through ``torch.nn.utils.prune``, in place.

    A layer pruned before gets its ``weight_mask`` buffer replaced rather than combined."""
    mask = layer.to_param_layout(mask_2d).to(device=layer.module.weight.device, dtype=layer.module.weight.dtype)
    if prune.is_pruned(layer.module) and hasattr(layer.module, "weight_mask"):
        _replace_weight_mask(layer.module, mask)
    else:
        prune.custom_from_mask(layer.module, "weight", mask.contiguous())


def _dense_weight_2d(layer: PrunableLayer) -> torch.Tensor:
    weight = getattr(layer.module, "weight_orig", layer.module.weight).detach()
    return weight.t() if layer.is_transposed else weight


def prune_model(
    model: nn.Module,
    calib_tokens: torch.Tensor,
    options: PruneOptions,
    *,
    device: torch.device | str = "cpu",
    batch_size: int = 1,
    checkpoint_dir: str | Path | None = None,
    progress: bool = True,
) -> PruneResult:
    """Prune every linear layer of every decoder block of ``model``, block by block.

    Args:
        model: a Hugging Face causal LM in eval mode, on the CPU (each block is moved to ``device`` while it
            is pruned, then back). Modified in place: pruned layers get ``weight_orig``/``weight_mask``
            (call :func:`finalize` to make them permanent).
        calib_tokens: ``[n, seqlen]`` int64 calibration windows.
        options: :class:`PruneOptions`.
        device: compute device for blocks and refinement.
        batch_size: calibration windows per block forward.
        checkpoint_dir: where finished blocks are recorded for resuming (created if missing).
        progress: show tqdm progress bars.

    Returns:
        :class:`PruneResult` (reports for every layer, including those of resumed blocks).
    """
    options.validate()
    start = time.perf_counter()
    blocks_name, blocks = find_blocks(model, options.blocks_path)
    device = torch.device(device)
    fingerprint = _fingerprint(options, calib_tokens, len(blocks))
    state = Path(checkpoint_dir) if checkpoint_dir is not None else None
    result, first_block, inputs = PruneResult(), 0, None
    if state is not None and (state / "progress.json").exists():
        first_block, inputs = _resume(state, fingerprint, model, blocks, blocks_name, options, result)
    if inputs is None:
        inputs = capture_block_inputs(model, blocks, calib_tokens, batch_size=batch_size)
    bar = tqdm(
        range(first_block, len(blocks)), desc="blocks", disable=not progress, initial=first_block, total=len(blocks)
    )
    for index in bar:
        block = blocks[index].to(device)
        layers = find_layers(block, prefix=f"{blocks_name}.{index}", include=options.include, exclude=options.exclude)
        reports = _prune_block(block, layers, inputs, options, device, result, index, progress)
        inputs = inputs.run_block(block, device)
        blocks[index].to("cpu")
        result.layers.extend(reports)
        if state is not None:
            _checkpoint(state, fingerprint, index, inputs, layers, result, reports)
        if reports:
            bar.set_postfix(reduction=f"{sum(r.reduction for r in reports) / len(reports):.1%}")
    result.seconds = time.perf_counter() - start
    return result


def _prune_block(
    block: nn.Module,
    layers: list[PrunableLayer],
    inputs: BlockInputs,
    options: PruneOptions,
    device: torch.device,
    result: PruneResult,
    index: int,
    progress: bool,
) -> list[LayerReport]:
    """Accumulate the block's Grams, then warmstart + refine + apply every layer's mask."""
    if not layers:
        return []
    hidden, kwargs = next(inputs.batches(device))
    groups = group_by_input(block, layers, hidden, **kwargs)
    accumulators = {
        group[0].name: GramAccumulator(group[0].d_in, dtype=getattr(torch, options.gram_dtype)) for group in groups
    }
    with input_hooks(groups, lambda key, x: accumulators[key].add(x)):
        inputs.feed_block(block, device)
    gram_of = {layer.name: accumulators[group[0].name] for group in groups for layer in group}
    reports = []
    for layer in tqdm(layers, desc=f"block {index}", leave=False, disable=not progress):
        reports.append(_prune_layer(layer, gram_of[layer.name], options, device, result, index))
    return reports


def _prune_layer(
    layer: PrunableLayer,
    acc: GramAccumulator,
    options: PruneOptions,
    device: torch.device,
    result: PruneResult,
    index: int,
) -> LayerReport:
    """Warmstart, refine and apply one layer's mask; errors name the layer."""
    start = time.perf_counter()
    weight = _dense_weight_2d(layer).float()
    try:
        if acc.n_tokens == 0 or acc.gram is None:
            raise ValueError(
                "saw no calibration tokens (its forward hook never fired); check that the block uses it, "
                "or exclude it with --exclude"
            )
        keep = warmstart_mask(weight, options.warmstart, sparsity=options.sparsity, nm=options.nm, gram=acc.gram)
        refined = refine_mask(
            weight,
            acc.gram,
            keep,
            max_iters=options.max_iters,
            nm=options.nm,
            eps=options.eps,
            device=device,
            dtype=getattr(torch, options.search_dtype),
        )
    except (ValueError, TypeError) as err:
        raise type(err)(f"layer {layer.name}: {err}") from None
    apply_mask(layer, refined.mask)
    result.masks[layer.name] = refined.mask.cpu()
    result.warmstart_masks[layer.name] = keep.cpu()
    return LayerReport(
        name=layer.name,
        block=index,
        d_out=layer.d_out,
        d_in=layer.d_in,
        sparsity=1.0 - float(refined.mask.float().mean()),
        loss_warmstart=float(refined.loss_before.sum()),
        loss_refined=float(refined.loss_after.sum()),
        n_swaps=int(refined.n_swaps.sum()),
        iters=refined.iters,
        seconds=time.perf_counter() - start,
    )


def _checkpoint(
    state: Path,
    fingerprint: str,
    index: int,
    inputs: BlockInputs,
    layers: list[PrunableLayer],
    result: PruneResult,
    reports: list[LayerReport],
) -> None:
    """Record block ``index`` as finished: its masks, the next block's inputs, then the progress marker."""
    names = [layer.name for layer in layers]
    save_torch(
        {
            "masks": {n: result.masks[n] for n in names},
            "warmstart": {n: result.warmstart_masks[n] for n in names},
            "reports": [asdict(r) for r in reports],
        },
        state / f"block_{index:04d}.pt",
    )
    inputs.save(state / "inputs.pt")
    save_json({"fingerprint": fingerprint, "next_block": index + 1}, state / "progress.json")


def _resume(
    state: Path,
    fingerprint: str,
    model: nn.Module,
    blocks: nn.ModuleList,
    blocks_name: str,
    options: PruneOptions,
    result: PruneResult,
) -> tuple[int, BlockInputs]:
    """Re-apply the masks of finished blocks and load the next block's inputs."""
    progress = json.loads((state / "progress.json").read_text())
    if progress.get("fingerprint") != fingerprint:
        raise ValueError(
            f"the checkpoint in {state} was made with different options, calibration data or model; use a new "
            f"output directory or delete {state} to start over"
        )
    next_block = int(progress["next_block"])
    for index in range(next_block):
        saved = torch.load(state / f"block_{index:04d}.pt", weights_only=True)
        layers = find_layers(
            blocks[index], prefix=f"{blocks_name}.{index}", include=options.include, exclude=options.exclude
        )
        for layer in layers:
            apply_mask(layer, saved["masks"][layer.name])
        result.masks.update(saved["masks"])
        result.warmstart_masks.update(saved["warmstart"])
        result.layers.extend(LayerReport(**r) for r in saved["reports"])
    logger.info("resuming at block %d of %d from %s", next_block, len(blocks), state)
    return next_block, BlockInputs.load(state / "inputs.pt")


@contextlib.contextmanager
def masks_swapped(model: nn.Module, masks: dict[str, torch.Tensor]) -> Iterator[None]:
    """Temporarily use other masks (e.g. the warmstart's) on a pruned model; restores the current ones."""
    modules = dict(model.named_modules())
    saved = {}
    try:
        for name, mask in masks.items():
            layer = PrunableLayer(name, modules[name])
            saved[name] = layer.module.weight_mask.clone()
            apply_mask(layer, mask)
        yield
    finally:
        for name, mask in saved.items():
            _replace_weight_mask(modules[name], mask)


def finalize(model: nn.Module) -> None:
    """Make every pruning reparametrization permanent (``prune.remove``): zeros are written into the
    weights and ``weight_orig``/``weight_mask`` disappear, so ``save_pretrained`` stores plain tensors."""
    for module in model.modules():
        if prune.is_pruned(module) and hasattr(module, "weight_mask"):
            prune.remove(module, "weight")
