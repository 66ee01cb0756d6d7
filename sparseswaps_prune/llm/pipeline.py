"""Sequential block-wise pruning of a causal LM (as Wanda / SparseGPT, with SparseSwaps refinement).

For each decoder block: run the captured block inputs through it while forward hooks accumulate one Gram
per distinct layer input, compute every layer's warmstart mask and refine it, apply the masks (standard
``torch.nn.utils.prune`` reparametrization), then run the pruned block to get the next block's inputs.
With ``checkpoint_dir`` every finished block leaves what is needed to continue on disk
(:mod:`~sparseswaps_prune.llm.checkpoint`), and a restarted call with the same model, data and options continues
from there and gives the same masks and weights. :func:`prune_model` runs the block loop of
:mod:`~sparseswaps_prune.llm.blocks` over the loaded model; this module holds the per-block step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.utils import prune
from tqdm.auto import tqdm

from sparseswaps_prune.core.budgets import OWL_LAMBDA, OWL_M, PROFILES, check_owl_m
from sparseswaps_prune.core.checks import check_budget, check_keeps_some, check_number, check_unused
from sparseswaps_prune.core.gram import GramAccumulator
from sparseswaps_prune.core.layer import LayerOutcome, prune_layer
from sparseswaps_prune.core.spec import Budget, DSnoTRefine, PruneSpec
from sparseswaps_prune.llm import block_tune, checkpoint, offload
from sparseswaps_prune.llm.block_tune import BlockTuneReport, check_tune, tune_block
from sparseswaps_prune.llm.blocks import BlockRun, BlockSink, BlockSource, run_blocks
from sparseswaps_prune.llm.capture import BlockInputs
from sparseswaps_prune.llm.checkpoint import STREAMS, dense_key
from sparseswaps_prune.llm.distributed import WindowShards, plan_work, sum_shard_grams
from sparseswaps_prune.llm.io.fingerprints import checkpoint_settings
from sparseswaps_prune.llm.layers import group_by_input
from sparseswaps_prune.llm.owl import BlockLoader, owl_block_sparsities
from sparseswaps_prune.modules import (
    PrunableLayer,
    apply_mask,
    check_finite_layers,
    find_blocks,
    find_layers,
    input_hooks,
    replace_weight_mask,
)
from sparseswaps_prune.recipes import RECIPES, recipe_name

logger = logging.getLogger(__name__)


_TUNE_OPTIONS = {
    "block_tune_lr": ("block-tune-lr", block_tune.BLOCK_TUNE_LR),
    "block_tune_schedule": ("block-tune-schedule", block_tune.BLOCK_TUNE_SCHEDULE),
}
"""Block tuning's options besides its epochs: name -> (CLI flag, default)."""


@dataclass
class PruneOptions:
    """What the pipeline prunes and how. Every field is recorded in the run's config.

    Attributes:
        recipe: a name in :data:`~sparseswaps_prune.recipes.RECIPES` (default ``"best"``: ALPS's solution, then block
            tuning), the same table as ``sparseswaps prune --recipe``: ``PruneOptions(recipe="alps")`` runs what
            ``--recipe alps`` runs. It gives ``spec`` and ``block_tune_epochs`` where they are None.
        spec: how each layer is pruned (:class:`~sparseswaps_prune.core.spec.PruneSpec`; None: the recipe's).
        include, exclude: fnmatch patterns on fully qualified layer names (default: every linear in
            every decoder block; ``lm_head`` and embeddings are outside the blocks and never pruned).
        gram_dtype: ``"float32"`` or ``"float64"`` Gram accumulation.
        blocks_path: dotted path of the decoder-block list when auto-detection fails.
        calib_shards: split the calibration windows (and, apart, the held-out windows) into this many contiguous
            shards of whole batches, accumulate each shard's Grams on its own and sum them in shard order
            (:mod:`~sparseswaps_prune.llm.distributed`). With ``distributed=True`` each rank owns whole shards and
            captures and forwards only their windows; results are bit for bit those of one process with the same
            ``calib_shards``, whatever the number of ranks. 1 (the default) sums all windows in one Gram, as always.
        row_shards: 0 (the default): every rank prunes whole layers. ``n >= 1``: with ``distributed=True``, also
            divide the rows of layers among the ranks, in contiguous row shards of at least ``n`` rows planned by
            estimated cost (:func:`~sparseswaps_prune.llm.distributed.plan_work`; e.g. 256,
            :data:`~sparseswaps_prune.llm.distributed.MIN_SHARD_ROWS`), where the spec treats rows apart
            (:attr:`~sparseswaps_prune.core.spec.PruneSpec.row_separable`; other specs prune whole layers). Every
            rank ends with the same weights; they equal one process's bit for bit only where the BLAS rounds each
            row's products independently of how many rows are multiplied together, which MKL does not do at every
            width (:mod:`~sparseswaps_prune.llm.distributed`). No effect without ranks.
        sparsity_profile: ``"uniform"`` (every block at the spec's sparsity) or ``"owl"``: OWL's non-uniform block
            budgets (:mod:`sparseswaps_prune.core.budgets`), from one dense forward of the calibration windows before
            the first block (:mod:`~sparseswaps_prune.llm.owl`): blocks whose Wanda scores have more outliers are
            pruned less, the mean over blocks is the spec's sparsity. Needs a ``sparsity`` budget (per row or per
            layer, not N:M); not supported with ``distributed=True`` or the block-wise streaming path in this version.
        owl_m: OWL's outlier threshold ``M`` (> 0; scores above ``M`` times the block's mean are outliers).
        owl_lambda: OWL's ``lambda`` (>= 0): the block sparsities span at most ``2 * lambda``.
        block_tune_epochs: (None: the recipe's) after each block's layers are pruned, tune their kept weights for
            this many epochs so that the pruned block reproduces the dense model's output of that block
            (:func:`~sparseswaps_prune.llm.block_tune.tune_block`; the epoch with the lowest error on the held-out
            windows is kept, 0 included); 0: no block tuning. The pipeline then carries the dense model's block inputs
            beside the pruned model's (twice the captured inputs in memory and in checkpoints). With
            ``distributed=True`` every rank tunes the block on all windows (``calib_shards=1`` only) and keeps rank 0's
            weights; those equal one process's only where the ranks' backward passes round as one process does (the
            same number of threads per process).
        block_tune_lr: Adam's learning rate for block tuning (> 0).
        block_tune_schedule: its learning-rate schedule, ``"constant"`` or ``"cosine"`` (decayed to 0 over all steps).
    """

    recipe: str | None = None
    spec: PruneSpec | None = None
    include: list[str] | None = None
    exclude: list[str] | None = None
    gram_dtype: str = "float32"
    blocks_path: str | None = None
    calib_shards: int = 1
    row_shards: int = 0
    sparsity_profile: str = "uniform"
    owl_m: float = OWL_M
    owl_lambda: float = OWL_LAMBDA
    block_tune_epochs: int | None = None
    block_tune_lr: float = block_tune.BLOCK_TUNE_LR
    block_tune_schedule: str = block_tune.BLOCK_TUNE_SCHEDULE

    def __post_init__(self) -> None:
        self.recipe = recipe_name(self.recipe)
        recipe = RECIPES[self.recipe]
        if self.spec is None:
            self.spec = recipe.spec
        if self.block_tune_epochs is None:
            self.block_tune_epochs = recipe.block_tune_epochs

    def validate(self) -> None:
        """Raise ``ValueError``/``TypeError`` naming the bad option."""
        if not isinstance(self.spec, PruneSpec):
            raise TypeError(f"spec must be a PruneSpec (see build_spec), got {type(self.spec).__name__}")
        if self.gram_dtype not in ("float32", "float64"):
            raise ValueError(f"gram_dtype must be 'float32' or 'float64', got {self.gram_dtype!r}")
        if isinstance(self.calib_shards, bool) or not isinstance(self.calib_shards, int) or self.calib_shards < 1:
            raise ValueError(f"calib_shards must be a positive int (1: no split), got {self.calib_shards!r}")
        if isinstance(self.row_shards, bool) or not isinstance(self.row_shards, int) or self.row_shards < 0:
            raise ValueError(
                f"row_shards must be an int >= 0 (0: whole layers; n: row shards of at least n rows, e.g. 256), got "
                f"{self.row_shards!r}"
            )
        if self.sparsity_profile not in PROFILES:
            raise ValueError(f"sparsity_profile must be one of {PROFILES}, got {self.sparsity_profile!r}")
        check_owl_m(self.owl_m)
        check_number(self.owl_lambda, "owl_lambda", low=0.0)
        check_tune(self.block_tune_epochs, self.block_tune_lr, self.block_tune_schedule)
        if self.block_tune_epochs == 0:
            check_unused(
                self, _TUNE_OPTIONS, owner="block tuning", fix="give --block-tune-epochs N, or drop them",
                off=f"block_tune_epochs is 0 (the {self.recipe} recipe's, or --block-tune-epochs 0)",
            )  # fmt: skip
        if self.sparsity_profile == "owl" and self.spec.budget.nm is not None:
            raise ValueError(
                f"sparsity_profile='owl' gives each block its own sparsity, but the budget is "
                f"nm={self.spec.budget.nm}; use sparsity= (--sparsity), or sparsity_profile='uniform' with N:M"
            )

    def require_whole_windows(self, what: str) -> None:
        """Raise ``ValueError`` if block tuning is on with ``calib_shards > 1`` under ``what``: tuning steps through
        every calibration batch in order, which a rank holding only its own shards cannot do."""
        if self.block_tune_epochs and self.calib_shards > 1:
            raise ValueError(
                f"block_tune_epochs={self.block_tune_epochs} (--block-tune-epochs) needs every calibration window on "
                f"every rank, but calib_shards={self.calib_shards} splits them under {what}; use calib_shards=1 "
                "(--calib-shards 1), or block_tune_epochs=0 (--block-tune-epochs 0)"
            )

    def describe(self) -> str:
        """The spec's description (:meth:`~sparseswaps_prune.core.spec.PruneSpec.describe`) and a non-uniform
        profile, after the recipe's name, e.g. ``sparseswaps-refit: 60% per row (OWL M=5 lambda=0.08): wanda -> ...``
        (``(changed)`` after the name when options changed the recipe's spec or tuning)."""
        recipe = RECIPES[self.recipe]
        changed = (self.spec, self.block_tune_epochs) != (recipe.spec, recipe.block_tune_epochs)
        text = self.spec.describe()
        if self.block_tune_epochs:
            text += f" -> block tune {self.block_tune_epochs} epochs lr {self.block_tune_lr:g}"
            text += "" if self.block_tune_schedule == block_tune.BLOCK_TUNE_SCHEDULE else f" {self.block_tune_schedule}"
        if self.sparsity_profile != "uniform":
            head, sep, tail = text.partition(":")
            text = f"{head} (OWL M={self.owl_m:g} lambda={self.owl_lambda:g}){sep}{tail}"
        return f"{self.recipe}{' (changed)' if changed else ''}: {text}"

    def to_dict(self) -> dict:
        """JSON-ready dict (``from_dict`` inverts it)."""
        return asdict(self) | {"spec": self.spec.to_dict()}

    @classmethod
    def from_dict(cls, data: dict) -> PruneOptions:
        """Inverse of :meth:`to_dict`; a dict written before block tuning existed had none (``block_tune_epochs``
        0), whatever the current default, and one written before its schedule existed a constant learning rate."""
        data = {"block_tune_epochs": 0, "block_tune_schedule": block_tune.BLOCK_TUNE_SCHEDULE} | dict(data)
        return cls(spec=PruneSpec.from_dict(data.pop("spec")), **data)


@dataclass
class LayerReport:
    """One pruned layer: shapes, achieved sparsity, every stage's loss (summed over rows), swaps and time.

    ``loss_start`` (the start mask), ``loss_refined`` (the refined mask), both with the original weights, and
    ``loss_final`` (the final weights: equal to ``loss_refined`` when the weights are kept) are measured on the
    calibration Gram; ``holdout_*`` are the same losses on the held-out calibration Gram (None without one), scaled
    by (calibration tokens / held-out tokens) so that both are sums over the same number of tokens.
    ``updated_rows`` is the fraction of rows that keep the weight update (below 1 only with the held-out guard;
    None when the weights are kept).
    """

    name: str
    block: int
    d_out: int
    d_in: int
    sparsity: float
    loss_start: float
    loss_refined: float
    loss_final: float
    n_swaps: int
    iters: int
    seconds_mask: float
    seconds_weights: float = 0.0
    holdout_start: float | None = None
    holdout_refined: float | None = None
    holdout_final: float | None = None
    updated_rows: float | None = None

    @classmethod
    def from_outcome(
        cls, name: str, block: int, outcome: LayerOutcome, holdout_scale: float | None = None
    ) -> LayerReport:
        """The report of one :func:`~sparseswaps_prune.core.layer.prune_layer` outcome; ``holdout_scale``
        (calibration tokens / held-out tokens) scales the held-out sums."""
        d_out, d_in = outcome.keep_mask.shape
        report = cls(
            name=name,
            block=block,
            d_out=d_out,
            d_in=d_in,
            sparsity=1.0 - float(outcome.keep_mask.float().mean()),
            loss_start=float(outcome.loss.start.sum()),
            loss_refined=float(outcome.loss.refined.sum()),
            loss_final=float(outcome.loss.final.sum()),
            n_swaps=int(outcome.n_swaps.sum()),
            iters=outcome.iters,
            seconds_mask=outcome.seconds_mask,
            seconds_weights=outcome.seconds_weights,
            updated_rows=outcome.updated_rows,
        )
        if outcome.holdout is not None:
            report.holdout_start = holdout_scale * float(outcome.holdout.start.sum())
            report.holdout_refined = holdout_scale * float(outcome.holdout.refined.sum())
            report.holdout_final = holdout_scale * float(outcome.holdout.final.sum())
        return report

    @property
    def kind(self) -> str:
        """The layer's own name within its block, e.g. ``q_proj``."""
        return self.name.rsplit(".", 1)[-1]

    @property
    def reduction(self) -> float:
        """Relative loss reduction of refinement over the start mask (both with the original weights)."""
        return 0.0 if self.loss_start <= 0 else 1.0 - self.loss_refined / self.loss_start

    @property
    def final_reduction(self) -> float:
        """Relative loss reduction of the final weights over the start mask."""
        return 0.0 if self.loss_start <= 0 else 1.0 - self.loss_final / self.loss_start


@dataclass
class PruneResult:
    """What :func:`prune_model` returns: per-layer reports and both mask sets (``[d_out, d_in]`` bool, CPU).

    ``dense_weights`` holds the original ``[d_out, d_in]`` weights (CPU) of layers whose weights were
    re-fitted, when :func:`prune_model` was asked to keep them (e.g. to evaluate the warmstart masks).
    ``block_tunes`` has one report per tuned block (``PruneOptions.block_tune_epochs``).
    """

    layers: list[LayerReport] = field(default_factory=list)
    masks: dict[str, torch.Tensor] = field(default_factory=dict)
    warmstart_masks: dict[str, torch.Tensor] = field(default_factory=dict)
    dense_weights: dict[str, torch.Tensor] = field(default_factory=dict)
    block_tunes: list[BlockTuneReport] = field(default_factory=list)
    seconds: float = 0.0


def _to_cpu(block: nn.Module, layers: list[PrunableLayer]) -> None:
    """Move ``block`` back to the CPU, masked weights included: ``Module.to`` moves ``weight_orig`` and
    ``weight_mask`` but not the plain ``weight`` attribute that the pruning hook computes, which would
    otherwise stay on the compute device for every finished block."""
    block.to("cpu")
    for layer in layers:
        if hasattr(layer.module, "weight_mask"):
            replace_weight_mask(layer.module, layer.module.weight_mask)


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
    distributed: bool = False,
) -> PruneResult:
    """Prune every linear layer of every decoder block of ``model``, block by block.

    Args:
        model: a Hugging Face causal LM in eval mode, on the CPU (each block is moved to ``device`` while it
            is pruned, then back). Modified in place: pruned layers get ``weight_orig``/``weight_mask``
            (call :func:`finalize` to make them permanent). A model with accelerate hooks (loaded with a
            ``device_map``, CPU or disk offload included, or through ``cpu_offload``/``disk_offload``) works too: each
            of its blocks is materialised on ``device`` and its pruned weights, made permanent there, go back where
            accelerate keeps them (:mod:`~sparseswaps_prune.llm.offload`).
        calib_tokens: ``[n, seqlen]`` int64 calibration windows.
        options: :class:`PruneOptions`. With ``sparsity_profile="owl"`` the calibration windows first run once
            through the dense model to give each block its budget (:func:`block_options`); a resumed run does that
            again, before restoring its finished blocks, and gets the same budgets, as does every rank of a
            ``distributed`` run (each forwards all the windows for it).
        device: compute device for blocks and refinement.
        batch_size: calibration windows per block forward.
        checkpoint_dir: where finished blocks are recorded for resuming (created if missing); one made with
            another model, dtype, calibration data or options raises
            :class:`~sparseswaps_prune.llm.checkpoint.CheckpointMismatch` (a ``ValueError``) naming what differs.
        progress: show tqdm progress bars.
        holdout_tokens: ``[h, seqlen]`` int64 held-out calibration windows (not the evaluation text): they
            follow the pruned model block by block like ``calib_tokens`` and give every layer a second Gram on
            which its losses are reported (``LayerReport.holdout_*``); they never influence the masks.
        keep_dense: keep the original weights of re-fitted layers in ``PruneResult.dense_weights``.
        distributed: every rank of the initialised ``torch.distributed`` process group calls this with the same
            model and data; the layers of each block are divided across the ranks and their results broadcast
            (:mod:`~sparseswaps_prune.llm.distributed`), so every rank ends with the same weights and result as
            one process would. With ``options.calib_shards > 1`` the windows are divided too: each rank captures
            and forwards only its own shards' windows, and the shards' Grams are summed in shard order on every
            rank. Progress is shown on rank 0 only. With ``checkpoint_dir`` (one directory all ranks see) each rank
            records its own inputs and rank 0 the blocks (:mod:`~sparseswaps_prune.llm.checkpoint`); a run stopped
            anywhere resumes with the same number of ranks to the same result. With ``options.row_shards`` the rows
            of layers are divided too (see :class:`PruneOptions`).

    Returns:
        :class:`PruneResult` (reports for every layer, including those of resumed blocks).

    Raises:
        ValueError: bad options or layer widths, ``options.calib_shards`` that does not fit the windows or the
            ranks, or ``checkpoint_dir`` or ``distributed`` with a model whose weights accelerate offloads (naming
            the fix; all before anything is modified);
            :class:`~sparseswaps_prune.llm.checkpoint.CheckpointMismatch` for a checkpoint of another run (another
            model, data, options or number of ranks).
    """
    run = dict(device=device, batch_size=batch_size, distributed=distributed, checkpoint_dir=checkpoint_dir)
    return run_blocks(_ModelSource(model), _ResultSink(keep_dense), options, calib_tokens, holdout_tokens,
                      _process_block, progress=progress, **run)  # fmt: skip


class _ModelSource(BlockSource):
    """The blocks of a loaded model: in memory, or where accelerate keeps them (``_process_block`` onloads them)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def open(self, options: PruneOptions, distributed: bool, checkpointed: bool) -> None:
        check_layers(self.model, options)
        self.blocks_name, self.blocks = find_blocks(self.model, options.blocks_path)
        offload.check_prunable(self.model, self.blocks, checkpoint=checkpointed, distributed=distributed)

    def block_options(
        self, options: PruneOptions, calib_tokens: torch.Tensor, device: torch.device, batch_size: int, progress: bool
    ) -> list[PruneOptions]:
        return block_options(self.model, self.blocks, self.blocks_name, calib_tokens, options, device, batch_size,
                             progress)  # fmt: skip


class _ResultSink(BlockSink):
    """The masks and reports in a :class:`PruneResult`, the model pruned in place; a checkpoint records each block's
    masks and weights (:func:`~sparseswaps_prune.llm.checkpoint.save_block`)."""

    def __init__(self, keep_dense: bool) -> None:
        self.keep_dense, self.result, self.start = keep_dense, PruneResult(), time.perf_counter()

    def fingerprint(self, calib: torch.Tensor, holdout: torch.Tensor | None, batch_size: int) -> checkpoint.Fingerprint:
        settings = checkpoint_settings(self.keep_dense, self.ranks, batch_size=batch_size, device=self.device)
        return checkpoint.fingerprint(self.source.model, self.options, calib, holdout, **settings)

    def begin(self, resumed: checkpoint.Resumed | None) -> None:
        """Re-apply the masks (and re-fitted weights) of a checkpoint's finished blocks and collect their results."""
        for index, saved in [] if resumed is None else resumed.blocks():
            prefix, options = f"{self.source.blocks_name}.{index}", self.options
            for layer in find_layers(
                self.source.blocks[index], prefix=prefix, include=options.include, exclude=options.exclude
            ):
                apply_mask(layer, saved["masks"][layer.name], saved["weights"].get(layer.name))
            self.result.masks.update(saved["masks"])
            self.result.warmstart_masks.update(saved["warmstart"])
            if self.keep_dense:
                self.result.dense_weights.update(saved["dense"])
            reports, tunes = saved_reports(saved)
            self.result.layers.extend(reports)
            self.result.block_tunes.extend(tunes)

    def block(self, index: int) -> PruneResult:
        return self.result

    def write(self, index: int, layers: list[PrunableLayer], reports: list[LayerReport], step: PruneResult) -> None:
        self.result.layers.extend(reports)

    def commit(
        self, index: int, inputs: dict[str, BlockInputs], layers: list[PrunableLayer], reports: list[LayerReport],
        step: PruneResult,
    ) -> None:  # fmt: skip
        if self.record is not None:
            checkpoint.save_block(*self.record, index, inputs, layers, self.result, reports, self.ranks)

    def finish(self) -> PruneResult:
        self.result.seconds = time.perf_counter() - self.start
        return self.result


def check_layers(model: nn.Module, options: PruneOptions) -> list[PrunableLayer]:
    """The layers :func:`prune_model` would prune, after checking that there is at least one and that the budget
    fits each (N:M's ``m`` divides its width; a sparsity keeps at least one weight per row, or per layer): the
    checks that need no calibration data, so that a run can fail before it computes or writes anything.

    Raises:
        ValueError: ``include``/``exclude`` leave no layer, or a layer's width does not fit the budget (naming it).
    """
    options.validate()
    blocks_name, blocks = find_blocks(model, options.blocks_path)
    layers = [
        layer
        for index, block in enumerate(blocks)
        for layer in find_layers(block, prefix=f"{blocks_name}.{index}", include=options.include,
                                 exclude=options.exclude)
    ]  # fmt: skip
    if not layers:
        names = [layer.name for layer in find_layers(blocks[0], prefix=f"{blocks_name}.0")] if len(blocks) else []
        raise ValueError(
            f"no linear layer of the decoder blocks matches include={options.include} exclude={options.exclude}, so "
            f"nothing would be pruned; patterns match full names such as {', '.join(names[:3]) or '(none)'} "
            f"(fnmatch, e.g. '*.mlp.*'); lm_head and the embeddings are never pruned"
        )
    for pattern in options.include or []:
        if not any(fnmatchcase(layer.name, pattern) for layer in layers):
            logger.warning("include pattern %r matches no layer that is pruned", pattern)
    _check_fits(layers, options.spec.budget)
    return layers


def _check_fits(layers: list[PrunableLayer], budget: Budget) -> None:
    """Raise ``ValueError`` naming the first of ``layers`` whose width does not fit ``budget``."""
    for layer in layers:
        try:
            check_budget(budget.sparsity, budget.nm, layer.d_in)
            if budget.scope == "row":
                check_keeps_some(budget.sparsity, layer.d_in, "each row")
            else:
                check_keeps_some(budget.sparsity, layer.d_out * layer.d_in, "the layer")
        except ValueError as err:
            raise ValueError(f"layer {layer.name}: {err}") from None


def block_options(
    model: nn.Module,
    blocks: nn.ModuleList,
    blocks_name: str,
    calib_tokens: torch.Tensor,
    options: PruneOptions,
    device: torch.device | str,
    batch_size: int,
    progress: bool,
    loader: BlockLoader | None = None,
) -> list[PruneOptions]:
    """The options each of ``blocks`` is pruned with: ``options`` itself everywhere with the uniform profile; with
    ``sparsity_profile="owl"``, ``options`` whose spec's budget has the block's OWL sparsity
    (:func:`~sparseswaps_prune.llm.owl.owl_block_sparsities`: one dense forward of ``calib_tokens`` through
    ``model``, whose weights are not modified; ``loader`` as there), after checking that every layer's width fits its
    block's budget.

    Raises:
        ValueError: ``owl_lambda`` puts a block's sparsity outside ``[0, 1)``, or a block's sparsity keeps no weight
            of a row or layer (naming it); before anything is modified.
    """
    if options.sparsity_profile == "uniform":
        return [options] * len(blocks)
    sparsities = owl_block_sparsities(
        model, blocks, blocks_name, calib_tokens, target=options.spec.budget.sparsity, m=options.owl_m,
        lam=options.owl_lambda, include=options.include, exclude=options.exclude, device=device,
        batch_size=batch_size, progress=progress, loader=loader,
    )  # fmt: skip
    per_block = []
    for index, block in enumerate(blocks):
        if index not in sparsities:  # no layer to prune
            per_block.append(options)
            continue
        budget = dataclasses.replace(options.spec.budget, sparsity=sparsities[index])
        layers = find_layers(block, prefix=f"{blocks_name}.{index}", include=options.include, exclude=options.exclude)
        _check_fits(layers, budget)
        per_block.append(dataclasses.replace(options, spec=dataclasses.replace(options.spec, budget=budget)))
    return per_block


def _process_block(
    run: BlockRun,
    index: int,
    inputs: dict[str, BlockInputs],
    options: PruneOptions,
    result: PruneResult,
) -> tuple[list[PrunableLayer], list[LayerReport], dict[str, BlockInputs]]:
    """One step of the block loop (also the out-of-core path's, :mod:`~sparseswaps_prune.llm.streaming`): move
    block ``index`` of ``run.blocks`` to ``run.device``, prune its layers with ``options`` into ``result``, run it to
    get the next block's inputs and move it back to the CPU. A block with accelerate hooks (a ``device_map``) is
    materialised on the device instead, and its pruned weights, made permanent, go back where the hooks keep them: the
    offload storage or the block's own device (:func:`~sparseswaps_prune.llm.offload.onloaded`). ``inputs`` hold this
    rank's windows of ``run.shards``. Returns the block's layers, their reports and the next block's inputs (this
    rank's windows only).

    With ``options.block_tune_epochs``, ``inputs`` also hold the dense model's inputs of the block (``dense_key``):
    the dense block's outputs on them are the targets of :func:`~sparseswaps_prune.llm.block_tune.tune_block`, which
    runs after the layers are pruned (its report goes to ``result.block_tunes``), and the next dense inputs."""
    device, ranks = run.device, run.ranks
    dispatched = offload.is_dispatched(run.blocks[index])
    block = run.blocks[index] if dispatched else run.blocks[index].to(device)
    with offload.onloaded(block, device) if dispatched else contextlib.nullcontext():
        prefix = f"{run.blocks_name}.{index}"
        layers = find_layers(block, prefix=prefix, include=options.include, exclude=options.exclude)
        streams = {key: inputs[key] for key in STREAMS if key in inputs}
        targets = {key: inputs[dense_key(key)].run_block(block, device) for key in streams if dense_key(key) in inputs}
        reports = _prune_block(run, index, block, layers, streams, options, result)
        if targets and layers:
            tuned = tune_block(
                block, layers, streams, targets, index=index, epochs=options.block_tune_epochs,
                lr=options.block_tune_lr, device=device, schedule=options.block_tune_schedule,
            )  # fmt: skip
            if ranks is not None:  # every rank tuned on all windows; rank 0's weights are the ones every rank keeps
                tuned, weights = ranks.broadcast(
                    (tuned, [layer.module.weight_orig.detach().cpu() for layer in layers]) if ranks.is_main else None,
                    src=0,
                )
                with torch.no_grad():
                    for layer, weight in zip(layers, weights, strict=True):
                        layer.module.weight_orig.copy_(weight)
            result.block_tunes.append(tuned)
        check_finite_layers(layers, index)
        inputs = {key: part.run_block(block, device) for key, part in streams.items()}
        inputs |= {dense_key(key): target for key, target in targets.items()}
    if not dispatched:
        _to_cpu(run.blocks[index], layers)
    return layers, reports, inputs


def _prune_block(
    run: BlockRun,
    index: int,
    block: nn.Module,
    layers: list[PrunableLayer],
    inputs: dict[str, BlockInputs],
    options: PruneOptions,
    result: PruneResult,
) -> list[LayerReport]:
    """Accumulate the Grams of ``block`` (the ``index``-th; one Gram per distinct input and token set; with several
    ``run.shards``, one partial per shard, summed in shard order across the ranks), then prune every layer (with
    ``run.ranks``: each rank prunes its units of :func:`~sparseswaps_prune.llm.distributed.plan_work`, whole layers
    or, with ``options.row_shards`` and a row-separable spec, row shards; then every unit is broadcast from its rank
    and each layer's shards are assembled in row order, :meth:`~sparseswaps_prune.core.layer.LayerOutcome.cat`)."""
    if not layers:
        return []
    device, ranks, shards = run.device, run.ranks, run.shards
    if shards is None:
        shards = {key: WindowShards(part.num_samples, part.batch_size) for key, part in inputs.items()}
    hidden, kwargs = next(inputs["fit"].batches(device))
    groups = group_by_input(block, layers, hidden, **kwargs)
    grams: dict[str, dict[str, GramAccumulator]] = {}
    dtype, track_sum = getattr(torch, options.gram_dtype), isinstance(options.spec.refine, DSnoTRefine)
    for key, part in inputs.items():
        partials = {}
        for shard in shards[key].own:
            accumulators = {
                group[0].name: GramAccumulator(group[0].d_in, dtype=dtype, track_sum=track_sum and key == "fit")
                for group in groups
            }
            with input_hooks(groups, lambda name, x, accs=accumulators: accs[name].add(x)):
                part.select(shards[key].local_batches(shard)).feed_block(block, device)
            partials[shard] = accumulators
        accumulators = sum_shard_grams(partials, shards[key], ranks, device)
        grams[key] = {layer.name: accumulators[group[0].name] for group in groups for layer in group}
    n_windows = shards["fit"].n_windows

    def prune_rows(layer: PrunableLayer, start: int, stop: int) -> LayerOutcome:
        """The outcome of rows ``start:stop`` of ``layer`` (all of them: the layer's), its tensors on the CPU."""
        fit, holdout = grams["fit"][layer.name], grams.get("holdout", {}).get(layer.name)
        if any(acc is not None and (acc.n_tokens == 0 or acc.gram is None) for acc in (fit, holdout)):
            raise ValueError(
                f"layer {layer.name}: saw no calibration tokens (its forward hook never fired); check that the "
                "block uses it, or exclude it with --exclude"
            )
        outcome = prune_layer(
            layer.dense_weight_2d().float()[start:stop],
            fit.gram,
            options.spec,
            holdout_gram=None if holdout is None else holdout.gram,
            feature_stats=fit.feature_stats(n_samples=n_windows) if track_sum else None,
            name=layer.name,
            device=device,
        )
        return dataclasses.replace(
            outcome,
            keep_mask=outcome.keep_mask.cpu(),
            start_mask=outcome.start_mask.cpu(),
            weight=None if outcome.weight is None else outcome.weight.cpu(),
        )

    # Without ranks one unit per layer; with ranks each rank first prunes its own units (whole layers or row shards,
    # in parallel with the others), then all receive every unit in layer and row order and assemble the layers.
    units = [(j, 0, layer.d_out, None) for j, layer in enumerate(layers)]
    if ranks is not None:
        split = [options.row_shards > 0 and options.spec.row_separable] * len(layers)
        plan = plan_work(layers, ranks.world_size, split, min_rows=max(1, options.row_shards))
        units = [(u.layer, u.start, u.stop, u.rank) for u in plan]
    mine = -1 if ranks is None else ranks.rank
    own = {i: prune_rows(layers[j], start, stop) for i, (j, start, stop, rank) in enumerate(units) if rank == mine}
    reports = []
    for j, layer in enumerate(tqdm(layers, desc=f"block {index}", leave=False, disable=not run.progress)):
        parts = [
            prune_rows(layer, start, stop) if rank is None else ranks.broadcast(own.pop(i, None), src=rank)
            for i, (unit_layer, start, stop, rank) in enumerate(units)
            if unit_layer == j
        ]
        outcome = LayerOutcome.cat(parts)
        fit, holdout = grams["fit"][layer.name], grams.get("holdout", {}).get(layer.name)
        if run.keep_dense and (outcome.weight is not None or options.block_tune_epochs):  # tuning changes every weight
            result.dense_weights[layer.name] = layer.dense_weight_2d().cpu().clone()
        result.masks[layer.name] = outcome.keep_mask
        result.warmstart_masks[layer.name] = outcome.start_mask
        apply_mask(layer, outcome.keep_mask, outcome.weight)
        scale = None if holdout is None else fit.n_tokens / holdout.n_tokens
        reports.append(LayerReport.from_outcome(layer.name, index, outcome, scale))
    return reports


def saved_reports(saved: dict[str, Any]) -> tuple[list[LayerReport], list[BlockTuneReport]]:
    """The layer reports of a checkpoint's block file (:func:`~sparseswaps_prune.llm.checkpoint.reports_payload`)
    and its block tuning report as a list (empty: not tuned; block files written before tuning have no entry)."""
    tune = saved.get("tune")
    return [LayerReport(**r) for r in saved["reports"]], [] if tune is None else [BlockTuneReport(**tune)]


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
            replace_weight_mask(layer.module, mask)


def finalize(model: nn.Module) -> None:
    """Make every pruning reparametrization permanent (``prune.remove``): zeros are written into the
    weights and ``weight_orig``/``weight_mask`` disappear, so ``save_pretrained`` stores plain tensors."""
    for module in model.modules():
        if prune.is_pruned(module) and hasattr(module, "weight_mask"):
            prune.remove(module, "weight")
