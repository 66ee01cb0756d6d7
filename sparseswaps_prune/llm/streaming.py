"""Out-of-core block-wise pruning of a safetensors checkpoint: the whole model is never in memory.

:func:`prune_checkpoint` builds the model without weights (``accelerate.init_empty_weights``: parameters on the
``meta`` device, buffers such as the rotary frequencies real), loads the tensors that run before the first
decoder block (embeddings; every non-block tensor except an untied ``lm_head``) and block 0 from the checkpoint's
safetensors, and captures the calibration inputs of block 0 (:func:`~sparseswaps_prune.llm.capture
.capture_block_inputs`). The non-block tensors are then written out and dropped. Each decoder block in turn is
read from the shards (only its own keys), pruned by the same block loop and per-block step as
:func:`~sparseswaps_prune.llm.pipeline.prune_model` (:func:`~sparseswaps_prune.llm.blocks.run_blocks`,
``pipeline._process_block``), made permanent (exact zeros), written into the output shards at its planned offsets,
and dropped; its masks are not kept.

The source may also be a GGUF file (:class:`~sparseswaps_prune.llm.io.readers.GGUFCheckpoint`, e.g. the packaged
default model): each block's tensors are de-quantized and converted on their own by transformers' GGUF loading steps,
to the tensors ``from_pretrained(..., gguf_file=...)`` loads, bit for bit. The readers, the shard writer, the model
without weights, the fingerprint of a run and the memory probe are the block I/O layer, :mod:`sparseswaps_prune.llm.io`;
the source is checked when it is opened (:mod:`~sparseswaps_prune.llm.io.readers`, which also states the limits).

The output is a normal sharded checkpoint (``model-0000i-of-0000n.safetensors`` and
``model.safetensors.index.json``, or one ``model.safetensors``; ``config.json`` with ``use_cache`` false as
``load_model`` sets it, ``generation_config.json``, and the source directory's other files such as the tokenizer's,
or a GGUF's tokenizer) that ``from_pretrained`` loads. Its tensors, names and shard layout are those that
``load_model`` + ``prune_model`` + ``finalize`` + ``save_pretrained(max_shard_size=...)`` write for the same model,
dtype, data and options, bit for bit, and so are the bytes of each shard (tensors laid out in safetensors' order).
The shard layout is planned before the first block from the tensor shapes, so every tensor is written once, straight
into its place; the shard files carry a ``.partial`` suffix until the last tensor is written.

Peak host memory is about the captured inputs, the embeddings during the capture, and one block (dense, masked
and its masks) plus the compute working set; it does not grow with the number of blocks. The returned report
measures it (:class:`StreamResult`).

**Resuming** (``checkpoint_dir``). After block ``k`` is written into the ``.partial`` shards, they are fsynced and
the block is recorded in ``checkpoint_dir`` with the layout and commit protocol of
:mod:`~sparseswaps_prune.llm.checkpoint` (ranks included): ``block_{k}.pt`` holds only the block's layer reports (its
pruned weights are already in the shards and are not written twice), ``inputs_<key>_{k+1}.pt`` the next block's
captured inputs, and ``progress.json``, replaced atomically, is the commit point; its fingerprint covers the model
(config, and a hash of the source's weight files), dtype, windows, options, number of ranks, ``max_shard_size`` and
the output plan. The same call made again checks the fingerprint (:class:`~sparseswaps_prune.llm.checkpoint
.CheckpointMismatch` naming what differs, before anything is written), reopens the ``.partial`` files without
truncating them (their headers and sizes must be the planned ones), skips the capture and the non-block tensors,
restores the finished blocks' reports and continues at block ``k + 1``: the output files and the reports are those of
an uninterrupted call, byte for byte. The checkpoint's files are removed when the call succeeds.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sparseswaps_prune.extras import require
from sparseswaps_prune.llm import checkpoint, pipeline
from sparseswaps_prune.llm.block_tune import BlockTuneReport
from sparseswaps_prune.llm.blocks import BlockSink, BlockSource, run_blocks
from sparseswaps_prune.llm.capture import BlockInputs
from sparseswaps_prune.llm.distributed import Ranks
from sparseswaps_prune.llm.io.fingerprints import blockwise_fingerprint
from sparseswaps_prune.llm.io.formats import tensor_bytes
from sparseswaps_prune.llm.io.memory import MemoryProbe
from sparseswaps_prune.llm.io.readers import key_map, load_tensors, open_checkpoint
from sparseswaps_prune.llm.io.skeleton import drop_tensors, empty_model, is_param, resolve_dtype
from sparseswaps_prune.llm.io.writers import OUR_WEIGHTS, ShardedWriter, write_configs
from sparseswaps_prune.llm.offload import on_device
from sparseswaps_prune.llm.pipeline import LayerReport, PruneOptions, PruneResult, check_layers, finalize
from sparseswaps_prune.modules import PrunableLayer, find_blocks

__all__ = ["StreamResult", "prune_checkpoint"]


@dataclass
class StreamResult:
    """What :func:`prune_checkpoint` returns.

    Attributes:
        layers: one report per pruned layer, as :func:`~sparseswaps_prune.llm.pipeline.prune_model` gives.
        files: the files written into the output directory (empty on ranks other than 0).
        report: JSON-ready measurements: ``peak_rss_bytes`` (peak resident host memory of this process, since the
            call began where ``peak_rss_since`` is ``"call"``), ``start_rss_bytes``, ``peak_device_bytes`` (CUDA's
            ``max_memory_allocated``; None on the CPU), ``bytes_written``, ``bytes_read`` (tensors read from the
            source), ``block_bytes`` (the largest block's tensors as written), ``embedding_bytes`` (the non-block
            tensors loaded for the capture; 0 when resumed), ``seconds_capture`` (until the first block's inputs
            were ready: captured, or loaded from the checkpoint), ``seconds``, ``rank``, ``world_size``,
            ``first_block`` (the block this call started at: 0, or where it resumed) and ``blocks``: per block this
            call pruned, ``seconds`` (load, prune, write, record), ``rss_bytes`` after it was dropped and
            ``peak_rss_bytes`` up to then.
        seconds: wall time of the call.
        block_tunes: one report per tuned block (``options.block_tune_epochs``), resumed blocks' included.
    """

    layers: list[LayerReport] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    report: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    block_tunes: list[BlockTuneReport] = field(default_factory=list)


def prune_checkpoint(
    source: str | os.PathLike[str] | None,
    out_dir: str | os.PathLike[str],
    calib_tokens: torch.Tensor,
    options: PruneOptions,
    *,
    gguf_file: str | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    batch_size: int = 1,
    holdout_tokens: torch.Tensor | None = None,
    max_shard_size: int | str = "5GB",
    progress: bool = True,
    distributed: bool = False,
    checkpoint_dir: str | os.PathLike[str] | None = None,
) -> StreamResult:
    """Prune the causal LM saved in ``source`` block by block, reading and writing one decoder block at a time.

    Equivalent to ``load_model(source, gguf_file=gguf_file, dtype=dtype)``,
    :func:`~sparseswaps_prune.llm.pipeline.prune_model` (same
    ``options``, ``device``, ``batch_size``, ``holdout_tokens``), ``finalize`` and ``save_pretrained(out_dir,
    max_shard_size=max_shard_size)``: the saved tensors are identical bit for bit. See the module docstring for
    what is held in memory and how a run resumes.

    Args:
        source: a local directory with ``config.json`` and safetensors weights (sharded with an index, or one file);
            or a GGUF, named as ``load_model`` names it: a directory with ``gguf_file``, a path to a ``.gguf`` file,
            or None (or ``"smollm2-135m"``) for the packaged default model (:class:`GGUFCheckpoint`: its tensors are
            de-quantized one block at a time as ``from_pretrained(..., gguf_file=...)`` de-quantizes them; the
            output's ``config.json`` has ``use_cache: false`` as ``load_model`` sets it, and the GGUF's tokenizer is
            saved with it, as the job saves it).
        out_dir: where the pruned checkpoint is written (created if missing; must not be the source's directory).
            Weight files of an earlier save there are replaced.
        calib_tokens: ``[n, seqlen]`` int64 calibration windows.
        options: :class:`~sparseswaps_prune.llm.pipeline.PruneOptions`.
        gguf_file: the GGUF file's name inside the directory ``source``.
        dtype: the weights' dtype in memory and in the output (floating tensors are cast as ``from_pretrained``
            casts them); None keeps the config's ``dtype`` (float32 if it names none).
        device: compute device for each block and its pruning.
        batch_size: calibration windows per block forward.
        holdout_tokens: ``[h, seqlen]`` held-out windows (as in ``prune_model``).
        max_shard_size: the output's shard size limit (bytes, or e.g. ``"5GB"``).
        progress: show tqdm progress bars (rank 0 only).
        distributed: every rank of the initialised ``torch.distributed`` process group calls this with the same
            arguments; the layers of each block are divided across the ranks and their results broadcast, and
            rank 0 alone writes ``out_dir``; with ``options.calib_shards > 1`` each rank captures and forwards only
            its own shards' windows (as in ``prune_model``). The output is the single-process output with the same
            ``calib_shards``, bit for bit.
        checkpoint_dir: where finished blocks are recorded (created if missing; with ``distributed``, one directory
            every rank sees): a call stopped anywhere and made again with the same arguments continues after the
            last recorded block, into the ``.partial`` files it left in ``out_dir``, to the same output and layer
            reports. The source's weight files are hashed once per call (about 1 s per GB) to recognise the model.
            Its files are removed when the call succeeds.

    Returns:
        :class:`StreamResult`: layer reports (those of resumed blocks included), files written and the
        memory/time report.

    Raises:
        FileNotFoundError: ``source`` has no safetensors checkpoint, the GGUF file does not exist, or ``source`` is
            a hub name.
        ValueError: bad options or layer widths (OWL's block budgets included; all before anything is written),
            ``out_dir`` is the source's directory, the checkpoint does not match its
            config, ``gguf_file`` contradicts ``source``, or transformers converts the GGUF's architecture through
            its weight-conversion path (see :class:`GGUFCheckpoint`).
        ~sparseswaps_prune.llm.checkpoint.CheckpointMismatch: ``checkpoint_dir`` holds the checkpoint of another
            run (another model, dtype, windows, options, number of ranks, ``max_shard_size`` or output plan; the
            message names it), or the ``.partial`` files it continues are missing or altered; raised before anything
            is written.
    """
    require("llm", "transformers", "accelerate", "safetensors")
    run = dict(device=device, batch_size=batch_size, distributed=distributed, checkpoint_dir=checkpoint_dir)
    return run_blocks(_CheckpointSource(source, gguf_file, dtype), _ShardSink(Path(out_dir), max_shard_size), options,
                      calib_tokens, holdout_tokens, pipeline._process_block, progress=progress, **run)  # fmt: skip


class _CheckpointSource(BlockSource):
    """The blocks of a checkpoint, read one at a time into the model without weights
    (:class:`~sparseswaps_prune.llm.blocks.BlockSource`)."""

    def __init__(self, source: str | os.PathLike[str] | None, gguf_file: str | None, dtype: torch.dtype | None):
        self.source, self.gguf_file, self.dtype = source, gguf_file, dtype

    def open(self, options: PruneOptions, distributed: bool, checkpointed: bool) -> None:
        self.reader = open_checkpoint(self.source, self.gguf_file)
        config = self.reader.load_config()
        self.dtype = resolve_dtype(config, self.dtype)
        model = self.model = empty_model(config, self.dtype)
        model.config.use_cache = False  # as load_model sets it (after the generation config was made)
        self.total_parameters = model.num_parameters()  # now, while tied weights are still one parameter
        check_layers(model, options)
        self.blocks_name, self.blocks = find_blocks(model, options.blocks_path)
        self.mapping = key_map(model, self.reader)
        self.state = model.state_dict(keep_vars=True)
        self.block_keys = [
            [name for name in self.mapping if name.startswith(f"{self.blocks_name}.{index}.")]
            for index in range(len(self.blocks))
        ]
        in_blocks = {name for keys in self.block_keys for name in keys}
        self.outside = [name for name in self.mapping if name not in in_blocks]
        # An untied lm_head is not needed for the capture: it is copied to the output tensor by tensor.
        head_module, self.head = model.get_output_embeddings(), set()
        if head_module is not None and head_module.weight is not model.get_input_embeddings().weight:
            head_name = next(name for name, module in model.named_modules() if module is head_module)
            self.head = {f"{head_name}.{leaf}" for leaf in head_module._parameters} & set(self.outside)
        self.for_capture = [name for name in self.outside if name not in self.head]

    def block_options(
        self, options: PruneOptions, calib_tokens: torch.Tensor, device: torch.device, batch_size: int, progress: bool
    ) -> list[PruneOptions]:
        """:func:`~sparseswaps_prune.llm.pipeline.block_options` (OWL's budgets) of the model read from the
        checkpoint: the tensors outside the blocks and block 0 are loaded as for the capture, each block is read for
        its dense forward and dropped after, and the tensors outside the blocks are dropped at the end, so the model
        is again the empty skeleton (this reads every block once more, before anything is written)."""

        @contextlib.contextmanager
        def loaded(index: int) -> Iterator[None]:
            self.load(index)
            try:
                with on_device(self.blocks[index], device):
                    yield
            finally:
                self.unload(index)

        self.prepare_capture()
        try:
            return pipeline.block_options(self.model, self.blocks, self.blocks_name, calib_tokens, options, device,
                                          batch_size, progress, loader=loaded)  # fmt: skip
        finally:
            self.unload(0)
            drop_tensors(self.model, self.for_capture)

    def prepare_capture(self) -> None:
        load_tensors(self.model, self.reader, self.mapping, self.for_capture + self.block_keys[0])

    def load(self, index: int) -> None:
        if index > 0:  # block 0 is loaded with the tensors the capture needs
            load_tensors(self.model, self.reader, self.mapping, self.block_keys[index])
        unloaded = [n for n, p in self.blocks[index].named_parameters() if p.device.type == "meta"]
        if unloaded:
            raise ValueError(f"block {index} has parameters the checkpoint did not provide: {unloaded[:3]}")

    def unload(self, index: int) -> None:
        self.blocks[index].to("meta")

    def tensor_bytes(self, names: list[str]) -> int:
        """The bytes of the tensors ``names`` in the model's dtypes."""
        return sum(tensor_bytes(self.state[n].dtype, self.state[n].shape) for n in names)


class _ShardSink(BlockSink):
    """The output shards of :func:`prune_checkpoint` (:class:`~sparseswaps_prune.llm.blocks.BlockSink`): rank 0
    writes each pruned block (made permanent) at its planned offsets; a checkpoint records each block's reports only
    (:func:`~sparseswaps_prune.llm.checkpoint.commit_block`). Its result is the :class:`StreamResult`."""

    def __init__(self, out: Path, max_shard_size: int | str) -> None:
        self.start, self.probe, self.out, self.max_shard_size = time.perf_counter(), MemoryProbe(), out, max_shard_size
        self.result, self.per_block, self.writer, self.embedding_bytes = PruneResult(), [], None, 0

    def plan(self, source: _CheckpointSource, options: PruneOptions, device: torch.device, ranks: Ranks | None):
        super().plan(source, options, device, ranks)
        if self.out.exists() and self.out.resolve() == source.reader.directory.resolve():
            raise ValueError(
                f"out_dir is the source directory {source.reader.directory}; write the pruned model elsewhere"
            )
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        # In the order save_pretrained uses for the model from_pretrained loads from this source.
        names = source.reader.save_order(source.model, list(source.mapping))
        self.planned = [(name, source.state[name].dtype, tuple(source.state[name].shape)) for name in names]

    def fingerprint(self, calib: torch.Tensor, holdout: torch.Tensor | None, batch_size: int) -> checkpoint.Fingerprint:
        source = self.source
        return blockwise_fingerprint(
            source.model, source.reader, source.dtype, self.options, calib, holdout, self.planned,
            self.max_shard_size, self.ranks, batch_size=batch_size, device=self.device,
        )  # fmt: skip

    def open(self, record: tuple[Path, checkpoint.Fingerprint] | None, resumed: checkpoint.Resumed | None) -> None:
        """Open the shards on rank 0; resuming, the non-block tensors (written before block 0) and the finished
        blocks are in the ``.partial`` files, and a failure to reopen them is every rank's ``CheckpointMismatch``."""
        super().open(record, resumed)
        self.first_block, ranks, error = 0 if resumed is None else resumed.next_block, self.ranks, None
        if ranks is None or ranks.is_main:
            keys = self.source.block_keys
            done = None if resumed is None else self.source.outside + [n for k in keys[: self.first_block] for n in k]
            try:
                self.writer = ShardedWriter(self.out, self.planned, self.max_shard_size, written=done)
            except (OSError, ValueError) as err:
                if resumed is None:
                    raise
                state = record[0]
                error = (
                    f"the checkpoint in {state} records blocks 0-{self.first_block - 1} as written into the .partial "
                    f"files in {self.out}, but {err}; to start over, delete {state}"
                )
        if resumed is not None:
            error = error if ranks is None else ranks.broadcast(error, src=0)
            if error is not None:
                raise checkpoint.CheckpointMismatch(error)

    def begin(self, resumed: checkpoint.Resumed | None) -> None:
        """Write the non-block tensors after the capture, then drop them; resumed, collect the finished blocks'
        reports."""
        self.seconds_capture = time.perf_counter() - self.start
        for _, saved in [] if resumed is None else resumed.blocks():
            reports, tunes = pipeline.saved_reports(saved)
            self.result.layers.extend(reports)
            self.result.block_tunes.extend(tunes)
        if resumed is not None:
            return
        source, model = self.source, self.source.model
        self.embedding_bytes = source.tensor_bytes(source.for_capture)
        if self.writer is not None:
            for name in source.for_capture:
                self.writer.write(name, model.get_parameter(name) if is_param(model, name) else model.get_buffer(name))
            for name in source.head:  # never loaded into the model: copied tensor by tensor
                tensor = source.reader.read([source.mapping[name]])[source.mapping[name]]
                dtype = source.state[name].dtype
                self.writer.write(name, tensor.to(dtype) if tensor.is_floating_point() else tensor)
        drop_tensors(model, source.for_capture)

    def block(self, index: int) -> PruneResult:
        self.begin_block = time.perf_counter()
        return PruneResult()  # a fresh result per block: its masks are dropped with the block

    def write(self, index: int, layers: list[PrunableLayer], reports: list[LayerReport], step: PruneResult) -> None:
        self.result.layers.extend(reports)
        self.result.block_tunes.extend(step.block_tunes)
        block = self.source.blocks[index]
        finalize(block)
        if self.writer is not None:
            block_state, prefix = block.state_dict(), f"{self.source.blocks_name}.{index}."
            for name in self.source.block_keys[index]:
                self.writer.write(name, block_state[name[len(prefix) :]])

    def commit(
        self, index: int, inputs: dict[str, BlockInputs], layers: list[PrunableLayer], reports: list[LayerReport],
        step: PruneResult,
    ) -> None:  # fmt: skip
        if self.record is not None:  # the block's weights are in the shards: its block file holds its reports only
            if self.writer is not None:
                self.writer.sync()
            tune, ranks = step.block_tunes[0] if step.block_tunes else None, self.ranks
            payload = checkpoint.reports_payload(reports, tune) if ranks is None or ranks.is_main else None
            checkpoint.commit_block(*self.record, index, inputs, payload, ranks)
        seconds = time.perf_counter() - self.begin_block
        self.per_block.append(
            {"block": index, "seconds": seconds, "rss_bytes": self.probe.rss(), "peak_rss_bytes": self.probe.peak()}
        )

    def close(self) -> None:
        self.files = []
        if self.writer is not None:
            self.files = self.writer.close(total_parameters=self.source.total_parameters)
            self.files += write_configs(self.source.model, self.source.reader, self.out, self.source.dtype)
        if self.ranks is not None:
            self.ranks.barrier()

    def abort(self) -> None:
        if self.writer is not None and self.record is not None:
            self.writer.release()  # the .partial files hold the recorded blocks: the next call continues them
        elif self.writer is not None:
            self.writer.abort()

    def finish(self) -> StreamResult:
        ranks = self.ranks
        if self.record is not None and (ranks is None or ranks.is_main):
            checkpoint.remove_checkpoint(self.record[0])
        bytes_written = 0
        if self.writer is not None:
            extra = [name for name in self.files if not OUR_WEIGHTS.fullmatch(name)]
            bytes_written = self.writer.bytes_written + sum((self.out / name).stat().st_size for name in extra)
        seconds, device, source = time.perf_counter() - self.start, self.device, self.source
        report = {
            "peak_rss_bytes": self.probe.peak(),
            "peak_rss_since": self.probe.since,
            "start_rss_bytes": self.probe.start,
            "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            "bytes_written": bytes_written,
            "bytes_read": source.reader.bytes_read,
            "block_bytes": max(source.tensor_bytes(keys) for keys in source.block_keys),
            "embedding_bytes": self.embedding_bytes,
            "seconds_capture": self.seconds_capture,
            "seconds": seconds,
            "rank": 0 if ranks is None else ranks.rank,
            "world_size": 1 if ranks is None else ranks.world_size,
            "first_block": self.first_block,
            "blocks": self.per_block,
        }
        result = self.result
        return StreamResult(result.layers, self.files, report, seconds, result.block_tunes)
