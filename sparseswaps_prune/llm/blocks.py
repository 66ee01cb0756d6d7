"""The one block loop of every pruning run: :func:`run_blocks` prunes the decoder blocks of a :class:`BlockSource`
one after the other into a :class:`BlockSink`.

In memory (:func:`~sparseswaps_prune.llm.pipeline.prune_model`, an accelerate-offloaded model included) the source
is the loaded model and the sink keeps the masks in the run's result; block-wise from a checkpoint
(:func:`~sparseswaps_prune.llm.streaming.prune_checkpoint`, safetensors or GGUF) the source reads each block's tensors
and the sink writes the pruned block into the output shards. Both run the same steps in the same order: check the
options, open the source and plan the sink, split the windows among the ranks, OWL's block budgets (on the dense
model, before a checkpoint's finished blocks are restored), the checkpoint's fingerprint and resume point, the
capture of the first block's inputs (or the checkpoint's), then per block the per-block step
(``pipeline._process_block``), the sink's write and the checkpoint's record. ``ranks`` is a
:class:`~sparseswaps_prune.llm.distributed.Ranks` for a ``distributed`` run and None for one process, everywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from tqdm.auto import tqdm

from sparseswaps_prune.core.checks import check_device
from sparseswaps_prune.llm import checkpoint
from sparseswaps_prune.llm.capture import BlockInputs, capture_block_inputs
from sparseswaps_prune.llm.checkpoint import dense_key
from sparseswaps_prune.llm.distributed import Ranks, WindowShards

if TYPE_CHECKING:
    from sparseswaps_prune.llm.pipeline import LayerReport, PruneOptions
    from sparseswaps_prune.modules import PrunableLayer

logger = logging.getLogger(__name__)

__all__ = ["BlockRun", "BlockSink", "BlockSource", "capture_shards", "progress_postfix", "run_blocks", "window_shards"]


@dataclass
class BlockRun:
    """What every block of one run shares: the decoder ``blocks`` and their dotted path ``blocks_name``, the compute
    ``device``, whether progress bars show (``progress``) and the original weights are kept (``keep_dense``), the
    ``ranks`` the layers are divided among (None: one process) and the split of the windows into ``shards`` (None:
    one shard, all windows)."""

    blocks: nn.ModuleList
    blocks_name: str
    device: torch.device
    progress: bool = False
    keep_dense: bool = False
    ranks: Ranks | None = None
    shards: dict[str, WindowShards] | None = None


class BlockSource:
    """Where :func:`run_blocks` reads the blocks. ``open(options, distributed, checkpointed)`` builds the model and
    checks that ``options`` can prune it (``checkpointed``: with a checkpoint directory), setting ``model``,
    ``blocks`` and ``blocks_name``; ``block_options(options, calib_tokens, device, batch_size, progress)`` gives OWL's
    per-block options of the dense model (:func:`~sparseswaps_prune.llm.pipeline.block_options`). The hooks below do
    nothing, as for a model whose blocks are in memory."""

    model: nn.Module
    blocks: nn.ModuleList
    blocks_name: str

    def prepare_capture(self) -> None:
        """Make the model ready to capture the first block's inputs."""

    def load(self, index: int) -> None:
        """Make block ``index``'s weights available to the per-block step (which moves the block to the device)."""

    def unload(self, index: int) -> None:
        """Release block ``index`` once the sink wrote it."""


class BlockSink:
    """Where :func:`run_blocks` puts the pruned blocks. ``fingerprint(calib_tokens, holdout_tokens, batch_size)`` is
    the run's checkpoint fingerprint; ``block(index)`` the result (:class:`~sparseswaps_prune.llm.pipeline
    .PruneResult`) the per-block step writes block ``index`` into; ``write(index, layers, reports, result)`` takes
    the pruned block, ``commit(index, inputs, layers, reports, result)`` records it in the checkpoint (if any) with
    the next block's ``inputs``; ``finish()`` is what :func:`run_blocks` returns. The hooks below keep the run's
    settings or do nothing, as for a model pruned in place. ``keep_dense``: the per-block step keeps the original
    weights of re-fitted layers in the result."""

    keep_dense: bool = False

    def plan(self, source: BlockSource, options: PruneOptions, device: torch.device, ranks: Ranks | None) -> None:
        """Plan the output of the opened ``source`` (checks it, writes nothing)."""
        self.source, self.options, self.device, self.ranks = source, options, device, ranks

    def open(self, record: tuple[Path, checkpoint.Fingerprint] | None, resumed: checkpoint.Resumed | None) -> None:
        """Open the output, continuing the finished blocks of ``resumed``; ``record``: the checkpoint's directory and
        fingerprint (None: no checkpoint)."""
        self.record = record

    def begin(self, resumed: checkpoint.Resumed | None) -> None:
        """The first block's inputs are ready: captured now (``resumed`` None), or the checkpoint's, whose finished
        blocks the result takes."""

    def close(self) -> None:
        """Every block is written: complete the output."""

    def abort(self) -> None:
        """The run failed: leave the output for a later call to continue, or remove it."""


def run_blocks(
    source: BlockSource,
    sink: BlockSink,
    options: PruneOptions,
    calib_tokens: torch.Tensor,
    holdout_tokens: torch.Tensor | None,
    step: Callable[..., tuple[list[PrunableLayer], list[LayerReport], dict[str, BlockInputs]]],
    *,
    device: torch.device | str,
    batch_size: int,
    distributed: bool,
    checkpoint_dir: str | Path | None,
    progress: bool,
) -> Any:
    """Prune every decoder block of ``source`` into ``sink``; returns ``sink.finish()``.

    ``step`` is the per-block step, ``pipeline._process_block`` (its callers pass it, looked up when they are
    called); the other arguments are those of :func:`~sparseswaps_prune.llm.pipeline.prune_model`. A ``distributed``
    run's ranks are those of the current process group (:meth:`~sparseswaps_prune.llm.distributed.Ranks.current`),
    None for one process; ``progress`` shows on rank 0 only.

    Raises:
        ValueError: bad options, layer widths or window shards (naming the fix; before anything is modified);
            :class:`~sparseswaps_prune.llm.checkpoint.CheckpointMismatch` for a checkpoint of another run.
    """
    options.validate()
    if distributed:
        options.require_whole_windows("distributed=True (--distributed)")
    state = None if checkpoint_dir is None else Path(checkpoint_dir)
    source.open(options, distributed, checkpointed=state is not None)
    device = check_device(device)
    ranks = Ranks.current() if distributed else None
    sink.plan(source, options, device, ranks)
    blocks, blocks_name = source.blocks, source.blocks_name
    if ranks is not None and options.row_shards and not options.spec.row_separable:
        logger.warning("row_shards=%d prunes whole layers: %s", options.row_shards, options.spec.row_obstacle)
    shards = window_shards(options, calib_tokens, holdout_tokens, batch_size, ranks)
    progress = progress and (ranks is None or ranks.is_main)
    # before a checkpoint's finished blocks are restored: OWL's budgets are those of the dense model
    per_block = [options] * len(blocks)
    if options.sparsity_profile != "uniform":
        per_block = source.block_options(options, calib_tokens, device, batch_size, progress)
    record = None if state is None else (state, sink.fingerprint(calib_tokens, holdout_tokens, batch_size))
    resumed = None if record is None else checkpoint.load(*record, ranks)
    first_block = 0 if resumed is None else resumed.next_block
    sink.open(record, resumed)
    try:
        if resumed is None:
            source.prepare_capture()
            dense = options.block_tune_epochs > 0
            inputs = capture_shards(source.model, blocks, calib_tokens, holdout_tokens, batch_size, shards, dense)
        else:  # the block forwards need no non-block tensor: the captured inputs hold the positions and masks
            inputs = resumed.inputs
        sink.begin(resumed)
        run = BlockRun(blocks, blocks_name, device, progress, sink.keep_dense, ranks, shards)
        bar = tqdm(
            range(first_block, len(blocks)), desc="blocks", disable=not progress, initial=first_block, total=len(blocks)
        )
        for index in bar:
            result = sink.block(index)
            source.load(index)
            layers, reports, inputs = step(run, index, inputs, per_block[index], result)
            sink.write(index, layers, reports, result)
            source.unload(index)
            sink.commit(index, inputs, layers, reports, result)
            if reports:
                bar.set_postfix(progress_postfix(reports))
        sink.close()
    except BaseException:
        sink.abort()
        raise
    return sink.finish()


def progress_postfix(layers: list[LayerReport]) -> dict[str, str]:
    """A block's progress-bar postfix: the mean per-layer loss reduction of the refined mask (``refined``) and of the
    final weights (``final``) over the start mask, e.g. ``{"refined": "0.0%", "final": "61.2%"}``."""
    n = max(1, len(layers))
    return {
        "refined": f"{sum(layer.reduction for layer in layers) / n:.1%}",
        "final": f"{sum(layer.final_reduction for layer in layers) / n:.1%}",
    }


def window_shards(
    options: PruneOptions,
    calib_tokens: torch.Tensor,
    holdout_tokens: torch.Tensor | None,
    batch_size: int,
    ranks: Ranks | None,
) -> dict[str, WindowShards]:
    """The split of the calibration (``"fit"``) and held-out (``"holdout"``) windows into ``options.calib_shards``
    shards and among ``ranks`` (:class:`~sparseswaps_prune.llm.distributed.WindowShards`).

    Raises:
        ValueError: ``calib_shards`` does not fit the windows, the batch size or the ranks (naming the fix).
    """
    world_size, rank = (1, 0) if ranks is None else (ranks.world_size, ranks.rank)
    tokens = {"fit": (calib_tokens, "calibration"), "holdout": (holdout_tokens, "held-out")}
    return {
        key: WindowShards(int(ids.shape[0]), batch_size, options.calib_shards, world_size, rank, what)
        for key, (ids, what) in tokens.items()
        if ids is not None
    }


def capture_shards(
    model: nn.Module,
    blocks: nn.ModuleList,
    calib_tokens: torch.Tensor,
    holdout_tokens: torch.Tensor | None,
    batch_size: int,
    shards: dict[str, WindowShards],
    dense: bool = False,
) -> dict[str, BlockInputs]:
    """Capture the inputs of block 0 for this rank's windows only (``shards[key].rows`` of ``[n, seqlen]`` tokens;
    all of them with one shard). Each batch is captured on its own, so the rows are those a capture of all windows
    would give. With ``dense`` (block tuning) the same inputs also start the dense model's streams, under
    :func:`~sparseswaps_prune.llm.checkpoint.dense_key` (``"fit_dense"``, ``"holdout_dense"``)."""
    tokens = {"fit": calib_tokens, "holdout": holdout_tokens}
    inputs = {
        key: capture_block_inputs(model, blocks, tokens[key][split.rows], batch_size=batch_size)
        for key, split in shards.items()
    }
    return inputs | ({dense_key(key): part for key, part in inputs.items()} if dense else {})
