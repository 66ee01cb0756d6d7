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
from sparseswaps_prune.core.dsnot import dsnot_refine
from sparseswaps_prune.core.gram import GramAccumulator
from sparseswaps_prune.core.losses import row_losses, weight_losses
from sparseswaps_prune.core.refit import REFIT_DAMP, refit_weights
from sparseswaps_prune.core.sparsegpt import SPARSEGPT_DAMP, sparsegpt_prune
from sparseswaps_prune.core.swaps import refine_mask
from sparseswaps_prune.core.warmstart import WARMSTARTS, warmstart_mask
from sparseswaps_prune.llm.capture import BlockInputs, capture_block_inputs
from sparseswaps_prune.llm.layers import PrunableLayer, find_blocks, find_layers, group_by_input, input_hooks

logger = logging.getLogger(__name__)


REFINERS = ("sparseswaps", "dsnot", "none")
REFITS = ("none", "ls", "cg", "obs")


@dataclass
class PruneOptions:
    """What to prune and how. Every field is recorded in the run's config.

    Attributes:
        warmstart: ``"magnitude"``, ``"wanda"``, ``"ria"`` or ``"sparsegpt"`` (SparseGPT's mask only).
        sparsity: fraction of each row pruned, in ``[0, 1)``; exclusive with ``nm``.
        nm: ``(n, m)`` semi-structured pattern, e.g. ``(2, 4)``.
        max_iters: SparseSwaps iterations ``T_max`` per layer (0: warmstart only).
        objective: what SparseSwaps minimises: ``"mask"`` (the loss with the kept weights as they are) or
            ``"refit"`` (the loss after re-fitting the kept weights; needs ``refit`` other than ``"none"``).
        eps: a row stops once its best swap gains less than ``eps``.
        include, exclude: fnmatch patterns on fully qualified layer names (default: every linear in
            every decoder block; ``lm_head`` and embeddings are outside the blocks and never pruned).
        scope: budget, ``"row"`` (the same count in every row) or ``"layer"`` (one count per layer: the
            warmstart selects per layer and SparseSwaps also moves weights between rows).
        refine: ``"sparseswaps"`` (1-swap refinement, ``max_iters`` iterations), ``"dsnot"`` (DSnoT, max 50
            cycles, update threshold 0.1) or ``"none"``.
        dsnot_skip: DSnoT leaves layers whose name contains ``.<dsnot_skip>.`` at their warmstart mask; the
            original's default is ``"mlp"`` (attention projections only); None refines every layer.
        refit: ``"none"`` (kept weights unchanged) or ``"ls"``: after the mask is final, every row's kept
            weights are re-fitted by exact least squares on the calibration Gram (``refit_weights``); the
            re-fitted weights land in ``weight_orig``; ``"cg"``: the same problem solved by batched conjugate
            gradients sharing ``G`` across rows (for wide layers, where per-row factorizations are slow);
            ``"obs"``: SparseGPT's OBS weight update on the final mask (``warmstart="sparsegpt"`` with
            ``scope="layer"``, ``refine="none"`` and ``refit="obs"`` is SparseGPT as published).
        damp: relative ridge dampening of the re-fit, ``lambda = damp * mean(diag G)``; None (default): 0.01
            for ``refit="obs"`` (SparseGPT's own dampening), ``REFIT_DAMP`` (1e-3) otherwise. See
            :attr:`resolved_damp`.
        holdout_guard: with held-out windows, keep a row's re-fitted weights only where they lower that row's
            loss on the held-out Gram compared with its kept weights as they are (re-fitting on few tokens can
            overfit); the other rows keep their original kept weights.
        gram_dtype: ``"float32"`` or ``"float64"`` Gram accumulation.
        search_dtype: ``"float32"`` or ``"float64"`` swap search.
        blocks_path: dotted path of the decoder-block list when auto-detection fails.
    """

    warmstart: str = "wanda"
    sparsity: float | None = 0.6
    nm: tuple[int, int] | None = None
    max_iters: int = 100
    objective: str = "mask"
    eps: float = 0.0
    include: list[str] | None = None
    exclude: list[str] | None = None
    scope: str = "row"
    refine: str = "sparseswaps"
    dsnot_skip: str | None = "mlp"
    refit: str = "none"
    damp: float | None = None
    holdout_guard: bool = False
    gram_dtype: str = "float32"
    search_dtype: str = "float32"
    blocks_path: str | None = None

    @property
    def resolved_damp(self) -> float:
        """``damp``, or its default: 0.01 for ``refit="obs"`` (SparseGPT's), ``REFIT_DAMP`` otherwise."""
        if self.damp is not None:
            return self.damp
        return SPARSEGPT_DAMP if self.refit == "obs" else REFIT_DAMP

    def validate(self) -> None:
        """Raise ``ValueError``/``TypeError`` naming the bad option."""
        if self.warmstart not in WARMSTARTS:
            raise ValueError(f"unknown warmstart {self.warmstart!r}; choose one of {', '.join(WARMSTARTS)}")
        if self.nm is not None:
            self.nm = tuple(self.nm)
        check_budget(self.sparsity, self.nm, self.nm[1] if self.nm else 1)
        if isinstance(self.max_iters, bool) or not isinstance(self.max_iters, int) or self.max_iters < 0:
            raise ValueError(f"max_iters must be an int >= 0, got {self.max_iters!r}")
        for name, choices in (("scope", ("row", "layer")), ("refine", REFINERS), ("refit", REFITS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}; got {getattr(self, name)!r}")
        if self.objective not in ("mask", "refit"):
            raise ValueError(f"objective must be 'mask' or 'refit', got {self.objective!r}")
        if self.objective == "refit" and self.refit == "none":
            raise ValueError("objective='refit' chooses masks for re-fitted weights: also set refit='ls' (--refit ls)")
        if self.scope == "layer" and self.nm is not None:
            raise ValueError("scope='layer' has no meaning with nm (N:M fixes every block's count); use scope='row'")
        if self.holdout_guard and self.refit == "none":
            raise ValueError("holdout_guard decides which rows keep their re-fit: also set refit (e.g. refit='ls')")
        if self.damp is not None and not (isinstance(self.damp, (int, float)) and self.damp >= 0):
            raise ValueError(f"damp must be a number >= 0 or None, got {self.damp!r}")
        for name in ("gram_dtype", "search_dtype"):
            if getattr(self, name) not in ("float32", "float64"):
                raise ValueError(f"{name} must be 'float32' or 'float64', got {getattr(self, name)!r}")


@dataclass
class LayerReport:
    """One pruned layer: shapes, achieved sparsity, losses (summed over rows, float64), swaps and time.

    ``loss_*`` are measured on the calibration Gram: ``loss_warmstart`` and ``loss_refined`` with the kept
    weights as they are (the mask-only loss), ``loss_refit`` with the re-fitted weights (None without
    re-fit; ``refit_rows`` is the fraction of rows whose re-fit was kept, below 1 only with
    ``holdout_guard``). ``holdout_*`` are the same losses on the held-out calibration Gram (None without one), scaled
    by (calibration tokens / held-out tokens) so that both are sums over the same number of tokens.
    """

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
    loss_refit: float | None = None
    seconds_refit: float = 0.0
    holdout_warmstart: float | None = None
    holdout_refined: float | None = None
    holdout_refit: float | None = None
    refit_rows: float | None = None

    @property
    def loss_final(self) -> float:
        """Calibration loss of the weights the layer ends with."""
        return self.loss_refined if self.loss_refit is None else self.loss_refit

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
    """What :func:`prune_model` returns: per-layer reports and both mask sets (``[d_out, d_in]`` bool, CPU).

    ``dense_weights`` holds the original ``[d_out, d_in]`` weights (CPU) of layers whose weights were
    re-fitted, when :func:`prune_model` was asked to keep them (e.g. to evaluate the warmstart masks).
    """

    layers: list[LayerReport] = field(default_factory=list)
    masks: dict[str, torch.Tensor] = field(default_factory=dict)
    warmstart_masks: dict[str, torch.Tensor] = field(default_factory=dict)
    dense_weights: dict[str, torch.Tensor] = field(default_factory=dict)
    seconds: float = 0.0


def _fingerprint(options: PruneOptions, token_sets: list[torch.Tensor | None], n_blocks: int) -> str:
    """Hash of everything that determines the masks: options, calibration tokens, model depth."""
    h = hashlib.sha256(json.dumps(asdict(options), sort_keys=True).encode())
    for tokens in token_sets:
        h.update(b"-" if tokens is None else tokens.to(torch.int64).numpy().tobytes())
    h.update(str(n_blocks).encode())
    return h.hexdigest()[:16]


def _replace_weight_mask(module: nn.Module, mask: torch.Tensor) -> None:
    """Overwrite a pruned module's ``weight_mask`` (parameter layout) and recompute its masked weight."""
    module.weight_mask.copy_(mask)
    module.weight = module.weight_orig * module.weight_mask


def _to_cpu(block: nn.Module, layers: list[PrunableLayer]) -> None:
    """Move ``block`` back to the CPU, masked weights included: ``Module.to`` moves ``weight_orig`` and
    ``weight_mask`` but not the plain ``weight`` attribute that the pruning hook computes, which would
    otherwise stay on the compute device for every finished block."""
    block.to("cpu")
    for layer in layers:
        if hasattr(layer.module, "weight_mask"):
            _replace_weight_mask(layer.module, layer.module.weight_mask)


def apply_mask(layer: PrunableLayer, mask_2d: torch.Tensor, weight_2d: torch.Tensor | None = None) -> None:
    """Set ``layer``'s pruning mask (``[d_out, d_in]`` bool) through ``torch.nn.utils.prune``, in place.

    A layer pruned before gets its ``weight_mask`` buffer replaced rather than combined. ``weight_2d``
    (``[d_out, d_in]``, e.g. re-fitted weights) replaces the dense weights in ``weight_orig``."""
    module = layer.module
    mask = layer.to_param_layout(mask_2d).to(device=module.weight.device, dtype=module.weight.dtype)
    if not (prune.is_pruned(module) and hasattr(module, "weight_mask")):
        prune.custom_from_mask(module, "weight", mask.contiguous())
    if weight_2d is not None:
        with torch.no_grad():
            module.weight_orig.copy_(layer.to_param_layout(weight_2d))
    _replace_weight_mask(module, mask)


def prune_model(
    model: nn.Module,
    calib_tokens: torch.Tensor,
    options: PruneOptions,
    *,
    device: torch.device | str = "cpu",
    batch_size: int = 1,
    checkpoint_dir: str | Path | None = None,
    progress: bool = True,
    holdout_tokens: torch.Tensor | None = None,
    keep_dense: bool = False,
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
        holdout_tokens: ``[h, seqlen]`` int64 held-out calibration windows (not the evaluation text): they
            follow the pruned model block by block like ``calib_tokens`` and give every layer a second Gram on
            which its losses are reported (``LayerReport.holdout_*``); they never influence the masks.
        keep_dense: keep the original weights of re-fitted layers in ``PruneResult.dense_weights``.

    Returns:
        :class:`PruneResult` (reports for every layer, including those of resumed blocks).
    """
    options.validate()
    start = time.perf_counter()
    blocks_name, blocks = find_blocks(model, options.blocks_path)
    device = torch.device(device)
    fingerprint = _fingerprint(options, [calib_tokens, holdout_tokens], len(blocks))
    state = Path(checkpoint_dir) if checkpoint_dir is not None else None
    result, first_block, inputs = PruneResult(), 0, None
    if state is not None and (state / "progress.json").exists():
        first_block, inputs = _resume(state, fingerprint, model, blocks, blocks_name, options, result, keep_dense)
    if inputs is None:
        inputs = {"fit": capture_block_inputs(model, blocks, calib_tokens, batch_size=batch_size)}
        if holdout_tokens is not None:
            inputs["holdout"] = capture_block_inputs(model, blocks, holdout_tokens, batch_size=batch_size)
    bar = tqdm(
        range(first_block, len(blocks)), desc="blocks", disable=not progress, initial=first_block, total=len(blocks)
    )
    for index in bar:
        block = blocks[index].to(device)
        layers = find_layers(block, prefix=f"{blocks_name}.{index}", include=options.include, exclude=options.exclude)
        reports = _prune_block(block, layers, inputs, options, device, result, index, progress, keep_dense)
        inputs = {key: part.run_block(block, device) for key, part in inputs.items()}
        _to_cpu(blocks[index], layers)
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
    inputs: dict[str, BlockInputs],
    options: PruneOptions,
    device: torch.device,
    result: PruneResult,
    index: int,
    progress: bool,
    keep_dense: bool,
) -> list[LayerReport]:
    """Accumulate the block's Grams (one per distinct input and token set), then prune every layer."""
    if not layers:
        return []
    hidden, kwargs = next(inputs["fit"].batches(device))
    groups = group_by_input(block, layers, hidden, **kwargs)
    grams: dict[str, dict[str, GramAccumulator]] = {}
    dtype, track_sum = getattr(torch, options.gram_dtype), options.refine == "dsnot"
    for key, part in inputs.items():
        accumulators = {
            group[0].name: GramAccumulator(group[0].d_in, dtype=dtype, track_sum=track_sum and key == "fit")
            for group in groups
        }
        with input_hooks(groups, lambda name, x, accs=accumulators: accs[name].add(x)):
            part.feed_block(block, device)
        grams[key] = {layer.name: accumulators[group[0].name] for group in groups for layer in group}
    reports = []
    for layer in tqdm(layers, desc=f"block {index}", leave=False, disable=not progress):
        holdout = grams["holdout"][layer.name] if "holdout" in grams else None
        fit = grams["fit"][layer.name]
        report, refit = _prune_layer(layer, fit, holdout, options, device, result, index, inputs["fit"].num_samples)
        if keep_dense and refit is not None:
            result.dense_weights[layer.name] = layer.dense_weight_2d().cpu().clone()
        apply_mask(layer, result.masks[layer.name], refit)
        reports.append(report)
    return reports


def _no_tokens(acc: GramAccumulator | None) -> bool:
    return acc is not None and (acc.n_tokens == 0 or acc.gram is None)


def _prune_layer(
    layer: PrunableLayer,
    acc: GramAccumulator,
    holdout: GramAccumulator | None,
    options: PruneOptions,
    device: torch.device,
    result: PruneResult,
    index: int,
    n_windows: int,
) -> tuple[LayerReport, torch.Tensor | None]:
    """Warmstart, refine and (optionally) re-fit one layer; errors name the layer.

    Records the masks in ``result`` and returns the report and the re-fitted ``[d_out, d_in]`` weights (None
    without re-fit); the caller applies them."""
    start = time.perf_counter()
    weight = layer.dense_weight_2d().float()
    try:
        if _no_tokens(acc) or _no_tokens(holdout):
            raise ValueError(
                "saw no calibration tokens (its forward hook never fired); check that the block uses it, "
                "or exclude it with --exclude"
            )
        keep = warmstart_mask(
            weight, options.warmstart, sparsity=options.sparsity, nm=options.nm, gram=acc.gram, scope=options.scope
        )
        searched_weight = None
        if options.refine == "sparseswaps":
            refined = refine_mask(
                weight,
                acc.gram,
                keep,
                max_iters=options.max_iters,
                nm=options.nm,
                eps=options.eps,
                device=device,
                dtype=getattr(torch, options.search_dtype),
                objective=options.objective,
                damp=options.resolved_damp,
                scope=options.scope,
            )
            mask, loss_warm, loss_refined = refined.mask, refined.loss_before, refined.loss_after
            n_swaps, iters, searched_weight = int(refined.n_swaps.sum()), refined.iters, refined.weight
        else:
            mask, n_swaps, iters = keep, 0, 0
            if options.refine == "dsnot" and not (options.dsnot_skip and f".{options.dsnot_skip}." in layer.name):
                mean, var, sq_mean = acc.feature_stats(n_samples=n_windows)
                dsnot = dsnot_refine(
                    weight, keep, feature_mean=mean, feature_var=var, feature_sq_mean=sq_mean, nm=options.nm
                )
                mask, n_swaps, iters = dsnot.mask, int(dsnot.n_updates.sum()), dsnot.n_cycles
        if options.refine != "sparseswaps" or options.objective == "refit":
            # the report's loss_warmstart / loss_refined are mask-only losses
            loss_warm = row_losses(weight, acc.gram, keep)
            loss_refined = loss_warm if mask is keep else row_losses(weight, acc.gram, mask)
        seconds = time.perf_counter() - start
        refit = None
        if options.refit == "obs":
            refit = sparsegpt_prune(weight.to(device), acc.gram, keep_mask=mask.to(device), damp=options.resolved_damp)
            refit = refit.weight.cpu()
        elif searched_weight is not None:
            refit = searched_weight.cpu()  # the re-fit objective's search already holds the exact re-fit
        elif options.refit != "none":
            solver = "cg" if options.refit == "cg" else "direct"
            refit = refit_weights(
                weight.to(device), acc.gram.to(device), mask.to(device), damp=options.resolved_damp, solver=solver
            ).cpu()
    except (ValueError, TypeError) as err:
        raise type(err)(f"layer {layer.name}: {err}") from None
    result.masks[layer.name] = mask.cpu()
    result.warmstart_masks[layer.name] = keep.cpu()
    report = LayerReport(
        name=layer.name,
        block=index,
        d_out=layer.d_out,
        d_in=layer.d_in,
        sparsity=1.0 - float(mask.float().mean()),
        loss_warmstart=float(loss_warm.sum()),
        loss_refined=float(loss_refined.sum()),
        n_swaps=n_swaps,
        iters=iters,
        seconds=seconds,
    )
    if holdout is not None:
        scale = acc.n_tokens / holdout.n_tokens  # held-out sums on the calibration token count's scale
        held_refined = row_losses(weight, holdout.gram, mask.cpu())
        report.holdout_warmstart = scale * float(row_losses(weight, holdout.gram, keep.cpu()).sum())
        report.holdout_refined = scale * float(held_refined.sum())
        if refit is not None:
            held_refit = weight_losses(weight, refit, holdout.gram)
            if options.holdout_guard:
                better = held_refit < held_refined
                refit = torch.where(better[:, None], refit, torch.where(mask.cpu(), weight, 0.0))
                held_refit = torch.where(better, held_refit, held_refined)
                report.refit_rows = float(better.double().mean())
            report.holdout_refit = scale * float(held_refit.sum())
    if refit is not None:
        report.refit_rows = 1.0 if report.refit_rows is None else report.refit_rows
        report.loss_refit = float(weight_losses(weight, refit, acc.gram).sum())
        report.seconds_refit = time.perf_counter() - start - seconds
    return report, refit


def _checkpoint(
    state: Path,
    fingerprint: str,
    index: int,
    inputs: dict[str, BlockInputs],
    layers: list[PrunableLayer],
    result: PruneResult,
    reports: list[LayerReport],
) -> None:
    """Record block ``index`` as finished: its masks (and re-fitted weights), the next block's inputs, then
    the progress marker."""
    names = [layer.name for layer in layers]
    by_name = {layer.name: layer for layer in layers}
    refitted = {r.name: by_name[r.name].dense_weight_2d().cpu() for r in reports if r.loss_refit is not None}
    save_torch(
        {
            "masks": {n: result.masks[n] for n in names},
            "warmstart": {n: result.warmstart_masks[n] for n in names},
            "weights": refitted,
            "dense": {n: result.dense_weights[n] for n in names if n in result.dense_weights},
            "reports": [asdict(r) for r in reports],
        },
        state / f"block_{index:04d}.pt",
    )
    for key, part in inputs.items():
        part.save(state / f"inputs_{key}.pt")
    save_json({"fingerprint": fingerprint, "next_block": index + 1, "inputs": sorted(inputs)}, state / "progress.json")


def _resume(
    state: Path,
    fingerprint: str,
    model: nn.Module,
    blocks: nn.ModuleList,
    blocks_name: str,
    options: PruneOptions,
    result: PruneResult,
    keep_dense: bool,
) -> tuple[int, dict[str, BlockInputs]]:
    """Re-apply the masks (and re-fitted weights) of finished blocks and load the next block's inputs."""
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
            apply_mask(layer, saved["masks"][layer.name], saved["weights"].get(layer.name))
        result.masks.update(saved["masks"])
        result.warmstart_masks.update(saved["warmstart"])
        if keep_dense:
            result.dense_weights.update(saved["dense"])
        result.layers.extend(LayerReport(**r) for r in saved["reports"])
    logger.info("resuming at block %d of %d from %s", next_block, len(blocks), state)
    return next_block, {key: BlockInputs.load(state / f"inputs_{key}.pt") for key in progress["inputs"]}


@contextlib.contextmanager
def masks_swapped(
    model: nn.Module, masks: dict[str, torch.Tensor], weights: dict[str, torch.Tensor] | None = None
) -> Iterator[None]:
    """Temporarily use other masks (e.g. the warmstart's) on a pruned model, and other ``[d_out, d_in]``
    weights where ``weights`` has them (e.g. ``PruneResult.dense_weights``); restores the current ones."""
    modules = dict(model.named_modules())
    weights = weights or {}
    saved = {}
    try:
        for name, mask in masks.items():
            layer = PrunableLayer(name, modules[name])
            saved[name] = (layer, layer.module.weight_mask.clone(), layer.dense_weight_2d().clone())
            apply_mask(layer, mask, weights.get(name))
        yield
    finally:
        for layer, mask, weight in saved.values():
            with torch.no_grad():
                layer.module.weight_orig.copy_(layer.to_param_layout(weight))
            _replace_weight_mask(layer.module, mask)


def finalize(model: nn.Module) -> None:
    """Make every pruning reparametrization permanent (``prune.remove``): zeros are written into the
    weights and ``weight_orig``/``weight_mask`` disappear, so ``save_pretrained`` stores plain tensors."""
    for module in model.modules():
        if prune.is_pruned(module) and hasattr(module, "weight_mask"):
            prune.remove(module, "weight")
