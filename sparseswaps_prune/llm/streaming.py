"""Out-of-core block-wise pruning of a safetensors checkpoint: the whole model is never in memory.

:func:`prune_checkpoint` builds the model without weights (``accelerate.init_empty_weights``: parameters on the
``meta`` device, buffers such as the rotary frequencies real), loads the tensors that run before the first
decoder block (embeddings; every non-block tensor except an untied ``lm_head``) and block 0 from the checkpoint's
safetensors, and captures the calibration inputs of block 0 (:func:`~sparseswaps_prune.llm.capture
.capture_block_inputs`). The non-block tensors are then written out and dropped. Each decoder block in turn is
read from the shards (only its own keys), pruned by the same per-block step as :func:`~sparseswaps_prune.llm
.pipeline.prune_model` (``pipeline._process_block``), made permanent (exact zeros), written into the output shards
at its planned offsets, and dropped; its masks are not kept.

The output is a normal sharded checkpoint (``model-0000i-of-0000n.safetensors`` and
``model.safetensors.index.json``, or one ``model.safetensors``; ``config.json``, ``generation_config.json``, and the
source directory's other files such as the tokenizer's) that ``from_pretrained`` loads. Its tensors, names and
shard layout are those that ``prune_model`` + ``finalize`` + ``save_pretrained(max_shard_size=...)`` write for the
same model, dtype, data and options, bit for bit. The shard layout is planned before the first block from the
tensor shapes, so every tensor is written once, straight into its place; the shard files carry a ``.partial``
suffix until the last tensor is written.

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

Limits: safetensors checkpoints only (not ``.bin`` or GGUF); checkpoint names must be the model's own parameter
names (optionally without the base-model prefix), so models whose weights transformers renames or fuses on load
(some mixture-of-experts models) are refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import resource
import shutil
import struct
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from sparseswaps_prune.atomic import fsync_dir
from sparseswaps_prune.core.checks import check_device
from sparseswaps_prune.extras import require
from sparseswaps_prune.llm import checkpoint, pipeline
from sparseswaps_prune.llm.distributed import Ranks
from sparseswaps_prune.llm.layers import find_blocks
from sparseswaps_prune.llm.pipeline import LayerReport, PruneOptions, PruneResult, check_layers, finalize

logger = logging.getLogger(__name__)

__all__ = ["MemoryProbe", "SafetensorsCheckpoint", "ShardedWriter", "StreamResult", "prune_checkpoint"]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
# Files of the source directory that are not copied to the output: weights (rewritten) and the configs (re-saved).
_NOT_COPIED = re.compile(
    r".*\.(safetensors|bin|pt|pth|gguf|partial)|.*\.index\.json|config\.json|generation_config\.json"
)
_OUR_WEIGHTS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")

_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _DTYPE_NAMES[getattr(torch, _name)] = _code
_SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}


def parse_size(size: int | str) -> int:
    """Bytes of ``size``: an int, or a string such as ``"5GB"`` (units TB, GB, MB, KB: powers of 1000, as
    ``save_pretrained``'s ``max_shard_size``)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, str) and size.strip()[-2:].upper() in _SIZE_UNITS:
        try:
            value = float(size.strip()[:-2])
        except ValueError:
            value = -1.0
        if value > 0:
            return int(value * _SIZE_UNITS[size.strip()[-2:].upper()])
    raise ValueError(f"max_shard_size={size!r}; expected a positive int (bytes) or a size such as '5GB' or '500MB'")


def _tensor_bytes(dtype: torch.dtype, shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=dtype).element_size()


def _natural_key(name: str) -> list[tuple]:
    """Sort key of tensor names: parts split on dots, numbers numerically (``layers.2`` before ``layers.10``)."""
    parts: list[tuple] = []
    for part in name.split("."):
        text = part.rstrip("0123456789")
        digits = part[len(text) :]
        if not text:
            parts.append((0, int(part)))
        else:
            parts.append((1, text, int(digits)) if digits else (1, text))
    return parts


def _read_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (tensor names -> dtype, shape, offsets)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


class SafetensorsCheckpoint:
    """The tensors of a local safetensors checkpoint (one ``model.safetensors`` or a sharded index), read a few
    keys at a time: each read opens the files it needs and closes them again, so no memory map stays resident.

    Attributes:
        directory: the checkpoint directory.
        files: tensor name -> the file holding it.
        shapes: tensor name -> ``(safetensors dtype code, shape)``.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        index = self.directory / SAFE_WEIGHTS_INDEX_NAME
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {key: self.directory / name for key, name in weight_map.items()}
        elif (self.directory / SAFE_WEIGHTS_NAME).is_file():
            single = self.directory / SAFE_WEIGHTS_NAME
            self.files = {key: single for key in _read_header(single) if key != "__metadata__"}
        else:
            present = sorted(p.name for p in self.directory.iterdir()) if self.directory.is_dir() else []
            raise FileNotFoundError(
                f"{self.directory} holds neither {SAFE_WEIGHTS_INDEX_NAME} nor {SAFE_WEIGHTS_NAME} (files: "
                f"{present[:10]}); the block-wise path reads safetensors checkpoints only. Convert the model with "
                "load_model(...) + save_pretrained, or prune it in memory with prune_model"
            )
        self.shapes: dict[str, tuple[str, list[int]]] = {}
        for path in sorted(set(self.files.values())):
            if not path.is_file():
                raise FileNotFoundError(f"shard {path.name} named in {index.name} is missing from {self.directory}")
            for key, info in _read_header(path).items():
                if key != "__metadata__" and self.files.get(key) == path:
                    self.shapes[key] = (info["dtype"], info["shape"])
        missing = sorted(set(self.files) - set(self.shapes))
        if missing:
            raise ValueError(f"{index.name} names tensors that are not in their shard: {missing[:5]}")
        self.bytes_read = 0

    def digest(self) -> str:
        """Hash (sha256, 16 hex digits) of the weight files: their names, sizes and bytes, read in 16 MiB chunks
        (about 1 s per GB; nothing is kept in memory and :attr:`bytes_read` does not count it)."""
        h = hashlib.sha256()
        buffer = bytearray(16 << 20)
        view = memoryview(buffer)
        for path in sorted(set(self.files.values())):
            h.update(f"{path.name}:{path.stat().st_size};".encode())
            with open(path, "rb", buffering=0) as f:
                while n := f.readinto(buffer):
                    h.update(view[:n])
        return h.hexdigest()[:16]

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors ``keys`` as stored (CPU, the stored dtype)."""
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.files[key], []).append(key)
        out = {}
        for path, names in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for key in names:
                    out[key] = f.get_tensor(key)
                    self.bytes_read += out[key].numel() * out[key].element_size()
        return out


@dataclass
class _Slot:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    shard: int = 0
    offset: int = 0


class ShardedWriter:
    """A safetensors checkpoint whose tensors arrive one at a time, in any order.

    The shards are planned up front from ``(name, dtype, shape)`` with ``save_pretrained``'s rule (tensors in the
    given order; a shard is closed when the next tensor would take it over ``max_shard_size``; a tensor larger than
    that gets a shard of its own), each file is created with its final header, and :meth:`write` puts each tensor's
    bytes at its offset. :meth:`close` checks that every tensor was written, renames the ``.partial`` files to
    their final names and writes the index (several shards) or leaves one ``model.safetensors``.

    With ``written`` the files of an interrupted write with the same plan are reopened as they are (nothing is
    truncated or rewritten) and ``written`` names the tensors already in them (made durable by :meth:`sync`); a
    shard already renamed to its final name (an interrupted :meth:`close`) is accepted when every tensor is
    written.

    Raises:
        TypeError: a dtype safetensors cannot store.
        FileNotFoundError, ValueError: with ``written``, a shard file is missing or does not hold the planned header
            and size, or ``written`` names a tensor that is not planned (nothing is modified).
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
        max_shard_size: int | str,
        *,
        written: Iterable[str] | None = None,
    ) -> None:
        if sys.byteorder != "little":
            raise RuntimeError("safetensors files are little-endian; this writer needs a little-endian machine")
        self.out_dir = Path(out_dir)
        limit = parse_size(max_shard_size)
        slots = [_Slot(key, dtype, tuple(shape), _tensor_bytes(dtype, shape)) for key, dtype, shape in tensors]
        for slot in slots:
            if slot.dtype not in _DTYPE_NAMES:
                raise TypeError(f"{slot.key}: dtype {slot.dtype} cannot be written to safetensors")
        shards: list[list[_Slot]] = []
        current: list[_Slot] = []
        size = 0
        for slot in slots:  # huggingface_hub's split_state_dict_into_shards, as save_pretrained uses it
            if slot.nbytes > limit:
                shards.append([slot])
                continue
            if size + slot.nbytes > limit:
                shards.append(current)
                current, size = [], 0
            current.append(slot)
            size += slot.nbytes
        if current:
            shards.append(current)
        shards = [shard for shard in shards if shard]
        n = len(shards)
        self.names = [SAFE_WEIGHTS_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.slots: dict[str, _Slot] = {}
        self.written: set[str] = set(written or ())
        self.bytes_written = 0
        self.total_size = sum(slot.nbytes for slot in slots)
        self._fds: list[int] = []
        self._paths: list[Path] = []
        self._data_start: list[int] = []
        unknown = sorted(self.written - {slot.key for slot in slots})
        self._complete = not unknown and len(self.written) == len(slots)
        if unknown:
            raise ValueError(f"written names tensors that are not planned: {unknown[:3]}")
        if written is None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        try:
            for index, shard in enumerate(shards):
                header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
                offset = 0
                for slot in shard:
                    slot.shard, slot.offset = index, offset
                    header[slot.key] = {
                        "dtype": _DTYPE_NAMES[slot.dtype],
                        "shape": list(slot.shape),
                        "data_offsets": [offset, offset + slot.nbytes],
                    }
                    offset += slot.nbytes
                    self.slots[slot.key] = slot
                raw = json.dumps(header, separators=(",", ":")).encode()
                raw += b" " * (-len(raw) % 8)
                head, size = struct.pack("<Q", len(raw)) + raw, 8 + len(raw) + offset
                if written is None:
                    path = self._partial(index)
                    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
                    self._fds.append(fd)
                    self._pwrite(fd, head, 0)
                    os.ftruncate(fd, size)
                else:
                    path = self._existing(index, head, size)
                    self._fds.append(os.open(path, os.O_WRONLY))
                self._paths.append(path)
                self._data_start.append(len(head))
        except BaseException:
            if written is None:
                self.abort()
            else:
                self.release()
            raise

    def _partial(self, index: int) -> Path:
        return self.out_dir / f"{self.names[index]}.partial"

    def _existing(self, index: int, head: bytes, size: int) -> Path:
        """The file of shard ``index`` that an interrupted write left (see the class docstring), checked against
        its planned ``head`` (length prefix and header) and ``size`` in bytes."""
        candidates = [self._partial(index)]
        if self._complete:
            candidates.append(self.out_dir / self.names[index])
        path = next((p for p in candidates if p.is_file()), None)
        if path is None:
            raise FileNotFoundError(f"shard {candidates[0]} is missing")
        with open(path, "rb") as f:
            found = f.read(len(head))
        if found != head or path.stat().st_size != size:
            raise ValueError(f"{path} does not hold the planned shard (its header or size differs)")
        return path

    def _pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n
            self.bytes_written += n

    @property
    def keys(self) -> list[str]:
        """The names of the planned tensors."""
        return list(self.slots)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` (its planned dtype and shape) into its place."""
        slot = self.slots.get(key)
        if slot is None:
            raise KeyError(f"{key} is not one of the planned tensors")
        if tensor.dtype != slot.dtype or tuple(tensor.shape) != slot.shape:
            raise ValueError(f"{key}: got {tensor.dtype} {tuple(tensor.shape)}, planned {slot.dtype} {slot.shape}")
        if key in self.written:
            raise ValueError(f"{key} was already written")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        self._pwrite(self._fds[slot.shard], data, self._data_start[slot.shard] + slot.offset)
        self.written.add(key)

    def sync(self) -> None:
        """Make every tensor written so far durable: ``fsync`` of each shard file and of the directory."""
        for fd in self._fds:
            os.fsync(fd)
        fsync_dir(self.out_dir)

    def close(self, total_parameters: int | None = None) -> list[str]:
        """Finish the checkpoint; returns the file names written (shards, then the index if any).

        Raises:
            ValueError: some planned tensors were never written (the ``.partial`` files are removed).
        """
        missing = [key for key in self.slots if key not in self.written]
        if missing:
            self.abort()
            raise ValueError(f"{len(missing)} planned tensors were never written, e.g. {missing[:3]}")
        for fd in self._fds:
            os.fsync(fd)
            os.close(fd)
        self._fds = []
        for path, name in zip(self._paths, self.names, strict=True):
            if path.name != name:
                os.replace(path, self.out_dir / name)
        files = list(self.names)
        if len(self.names) > 1:
            metadata = {"total_size": self.total_size}
            if total_parameters is not None:
                metadata = {"total_parameters": total_parameters, **metadata}
            index = {"metadata": metadata, "weight_map": {key: self.names[s.shard] for key, s in self.slots.items()}}
            raw = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
            (self.out_dir / SAFE_WEIGHTS_INDEX_NAME).write_bytes(raw)
            self.bytes_written += len(raw)
            files.append(SAFE_WEIGHTS_INDEX_NAME)
        for path in self.out_dir.iterdir():  # weights of an earlier save into the same directory
            if _OUR_WEIGHTS.fullmatch(path.name) and path.name not in files:
                path.unlink()
        return files

    def release(self) -> None:
        """Close the files and keep them (what was written stays, e.g. for a resume that reopens them)."""
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def abort(self) -> None:
        """Close and remove the ``.partial`` files."""
        self.release()
        for index in range(len(self.names)):
            self._partial(index).unlink(missing_ok=True)


def _status_bytes(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class MemoryProbe:
    """Resident host memory of this process: now, and its peak since the probe was made.

    On Linux the peak (``VmHWM``) is reset when the probe is made (``/proc/self/clear_refs``), so it covers only
    what follows; where that fails the peak is the process's lifetime peak (``getrusage``), and :attr:`since`
    says ``"process"``.
    """

    def __init__(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.since = "call" if _status_bytes("VmHWM") is not None else "process"
        except OSError:
            self.since = "process"
        self.start = self.rss()

    @staticmethod
    def rss() -> int:
        """Resident set size now, in bytes."""
        now = _status_bytes("VmRSS")
        if now is not None:
            return now
        try:
            import psutil

            return int(psutil.Process().memory_info().rss)
        except ImportError:
            return MemoryProbe.peak()

    @staticmethod
    def peak() -> int:
        """Peak resident set size in bytes (since the last reset, see the class docstring)."""
        peak = _status_bytes("VmHWM")
        if peak is not None:
            return peak
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return maxrss if sys.platform == "darwin" else maxrss * 1024


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
    """

    layers: list[LayerReport] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    report: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace parameter or buffer ``name`` of ``model`` by ``value`` (a parameter stays a parameter)."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf in module._parameters:
        old = module._parameters[leaf]
        module._parameters[leaf] = nn.Parameter(value, requires_grad=old.requires_grad)
    elif leaf in module._buffers:
        module._buffers[leaf] = value
    else:
        raise KeyError(f"{name} is neither a parameter nor a buffer of {type(model).__name__}")


def _drop(model: nn.Module, names: Iterable[str]) -> None:
    """Put ``names`` back on the meta device (frees their memory)."""
    for name in names:
        tensor = model.get_parameter(name) if _is_param(model, name) else model.get_buffer(name)
        _set_tensor(model, name, torch.empty_like(tensor, device="meta"))


def _is_param(model: nn.Module, name: str) -> bool:
    module_name, _, leaf = name.rpartition(".")
    return leaf in model.get_submodule(module_name)._parameters


def _resolve_dtype(config: Any, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype such as torch.bfloat16, got {dtype!r}")
        return dtype
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    return stored if isinstance(stored, torch.dtype) and stored.is_floating_point else torch.float32


def _skeleton(config: Any, dtype: torch.dtype) -> nn.Module:
    """The causal LM of ``config`` with its parameters on ``meta`` (buffers real), tied, in eval mode."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()
    model.eval()
    return model


def _key_map(model: nn.Module, source: SafetensorsCheckpoint) -> dict[str, str]:
    """Model state-dict name -> checkpoint name, for every tensor the output holds (the checkpoint's tensors, in the
    model's state-dict order; a tied copy the checkpoint leaves out is left out too).

    Raises:
        ValueError: a tensor of the model is missing from the checkpoint, or its shape differs.
    """
    prefix = getattr(model, "base_model_prefix", "") or ""
    state = model.state_dict(keep_vars=True)
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    by_id: dict[int, list[str]] = {}
    for name, tensor in state.items():
        by_id.setdefault(id(tensor), []).append(name)
    mapping: dict[str, str] = {}
    for name, tensor in state.items():
        candidates = [name]
        if prefix and name.startswith(prefix + "."):
            candidates.append(name[len(prefix) + 1 :])
        key = next((c for c in candidates if c in source.shapes), None)
        if key is None:
            aliases = [other for other in by_id[id(tensor)] if other != name]
            if name in tied or any(a in source.shapes or a in mapping for a in aliases):
                continue  # a tied copy: saved once, under the other name
            raise ValueError(
                f"{name} is not in the checkpoint {source.directory} (it has e.g. {sorted(source.shapes)[:3]}); "
                "the block-wise path needs a checkpoint with the model's own tensor names (transformers renames or "
                "fuses some models' weights on load); prune such a model in memory with prune_model"
            )
        shape = source.shapes[key][1]
        if list(tensor.shape) != list(shape):
            raise ValueError(f"{key}: the checkpoint holds shape {shape}, the config makes {list(tensor.shape)}")
        mapping[name] = key
    unused = sorted(set(source.shapes) - set(mapping.values()))
    if unused:
        logger.warning("checkpoint tensors the model does not use are not written: %s", unused[:10])
    return mapping


def _load(model: nn.Module, source: SafetensorsCheckpoint, mapping: dict[str, str], names: list[str]) -> None:
    """Read ``names`` from the checkpoint into the model, cast to the model's dtype where both are floating
    point (as ``from_pretrained`` does)."""
    state = model.state_dict(keep_vars=True)
    tensors = source.read(mapping[name] for name in names)
    for name in names:
        value, target = tensors.pop(mapping[name]), state[name]
        if value.is_floating_point() and target.is_floating_point():
            value = value.to(target.dtype)
        _set_tensor(model, name, value)


def _write_configs(model: nn.Module, source_dir: Path, out_dir: Path, dtype: torch.dtype) -> list[str]:
    """``config.json`` and ``generation_config.json`` as ``save_pretrained`` writes them, and a copy of every
    other non-weight file of ``source_dir`` (tokenizer files, ...)."""
    config = model.config
    config.dtype = str(dtype).split(".")[1]
    config.architectures = [type(model).__name__]
    config.save_pretrained(out_dir)
    files = ["config.json"]
    if model.can_generate():
        from transformers import GenerationConfig

        generation = (
            GenerationConfig.from_pretrained(source_dir)
            if (source_dir / "generation_config.json").is_file()
            else model.generation_config
        )
        generation.save_pretrained(out_dir)
        files.append("generation_config.json")
    for path in sorted(source_dir.iterdir()):
        if path.is_file() and not _NOT_COPIED.fullmatch(path.name) and not path.name.startswith("."):
            shutil.copy2(path, out_dir / path.name)
            files.append(path.name)
    return files


def _fingerprint(
    model: nn.Module,
    reader: SafetensorsCheckpoint,
    dtype: torch.dtype,
    options: PruneOptions,
    calib_tokens: torch.Tensor,
    holdout_tokens: torch.Tensor | None,
    planned: list[tuple[str, torch.dtype, tuple[int, ...]]],
    max_shard_size: int | str,
    ranks: Ranks | None,
) -> checkpoint.Fingerprint:
    """The :class:`~sparseswaps_prune.llm.checkpoint.Fingerprint` of a :func:`prune_checkpoint` call: the model's
    config, the source's weight files (hashed on rank 0 and broadcast), ``dtype``, ``options``, the windows, the
    number of ``ranks`` (None: one process), ``max_shard_size`` and the output plan (``planned``: name, dtype and
    shape of every output tensor, in order)."""
    weights = reader.digest() if ranks is None or ranks.is_main else None
    parts = {
        "model_config": checkpoint.config_digest(model),
        "model_weights": weights if ranks is None else ranks.broadcast(weights, src=0),
        "dtype": str(dtype).removeprefix("torch."),
    }
    plan = json.dumps([[name, str(kind), list(shape)] for name, kind, shape in planned])
    settings = pipeline.checkpoint_settings(False, ranks) | {
        "max_shard_size": parse_size(max_shard_size),
        "output_plan": hashlib.sha256(plan.encode()).hexdigest()[:16],
    }
    return checkpoint.fingerprint(model, options, calib_tokens, holdout_tokens, known_model_parts=parts, **settings)


def prune_checkpoint(
    source: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    calib_tokens: torch.Tensor,
    options: PruneOptions,
    *,
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

    Equivalent to ``load_model(source, dtype=dtype)``, :func:`~sparseswaps_prune.llm.pipeline.prune_model` (same
    ``options``, ``device``, ``batch_size``, ``holdout_tokens``), ``finalize`` and ``save_pretrained(out_dir,
    max_shard_size=max_shard_size)``: the saved tensors are identical bit for bit. See the module docstring for
    what is held in memory and how a run resumes.

    Args:
        source: a local directory with ``config.json`` and safetensors weights (sharded with an index, or one file).
        out_dir: where the pruned checkpoint is written (created if missing; must not be ``source``). Weight files of
            an earlier save there are replaced.
        calib_tokens: ``[n, seqlen]`` int64 calibration windows.
        options: :class:`~sparseswaps_prune.llm.pipeline.PruneOptions`.
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
        FileNotFoundError: ``source`` has no safetensors checkpoint.
        ValueError: bad options or layer widths, or ``options.sparsity_profile="owl"`` (not supported here yet; all
            before anything is written), ``out_dir`` is ``source``, or the checkpoint does not match its config.
        ~sparseswaps_prune.llm.checkpoint.CheckpointMismatch: ``checkpoint_dir`` holds the checkpoint of another
            run (another model, dtype, windows, options, number of ranks, ``max_shard_size`` or output plan; the
            message names it), or the ``.partial`` files it continues are missing or altered; raised before anything
            is written.
    """
    require("llm", "transformers", "accelerate", "safetensors")
    from transformers import AutoConfig

    start = time.perf_counter()
    probe = MemoryProbe()
    options.validate()
    options.require_uniform("the block-wise streaming path (prune_checkpoint, --blockwise)")
    device = check_device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ranks = Ranks.current() if distributed else Ranks(0, 1)
    checkpoint_ranks = ranks if distributed else None  # as prune_model: one process records no rank
    progress = progress and ranks.is_main
    source_dir, out = Path(source), Path(out_dir)
    if out.exists() and source_dir.exists() and out.resolve() == source_dir.resolve():
        raise ValueError(f"out_dir is the source directory {source_dir}; write the pruned model elsewhere")
    reader = SafetensorsCheckpoint(source_dir)
    config = AutoConfig.from_pretrained(source_dir, local_files_only=True)
    dtype = _resolve_dtype(config, dtype)
    model = _skeleton(config, dtype)
    total_parameters = model.num_parameters()  # now, while tied weights are still one parameter
    check_layers(model, options)
    shards = pipeline.window_shards(options, calib_tokens, holdout_tokens, batch_size, ranks)
    blocks_name, blocks = find_blocks(model, options.blocks_path)
    mapping = _key_map(model, reader)
    state = model.state_dict(keep_vars=True)
    block_keys = [
        [name for name in mapping if name.startswith(f"{blocks_name}.{index}.")] for index in range(len(blocks))
    ]
    in_blocks = {name for keys in block_keys for name in keys}
    outside = [name for name in mapping if name not in in_blocks]
    # An untied lm_head is not needed for the capture: it is copied to the output tensor by tensor.
    head_module, head = model.get_output_embeddings(), set()
    if head_module is not None and head_module.weight is not model.get_input_embeddings().weight:
        head_name = next(name for name, module in model.named_modules() if module is head_module)
        head = {f"{head_name}.{leaf}" for leaf in head_module._parameters} & set(outside)
    for_capture = [name for name in outside if name not in head]
    # In the order save_pretrained uses for a model loaded by from_pretrained (transformers 5 sorts the names).
    planned = [(name, state[name].dtype, tuple(state[name].shape)) for name in sorted(mapping, key=_natural_key)]

    resumed, state_dir = None, None
    if checkpoint_dir is not None:
        state_dir = Path(checkpoint_dir)
        fingerprint = _fingerprint(
            model, reader, dtype, options, calib_tokens, holdout_tokens, planned, max_shard_size, checkpoint_ranks
        )
        resumed = checkpoint.load(state_dir, fingerprint, checkpoint_ranks)
    first_block = 0 if resumed is None else resumed.next_block
    writer, error = None, None
    if ranks.is_main:
        # Resuming: the non-block tensors (written before block 0) and the finished blocks are in the .partial files.
        done = None if resumed is None else outside + [name for keys in block_keys[:first_block] for name in keys]
        try:
            writer = ShardedWriter(out, planned, max_shard_size, written=done)
        except (OSError, ValueError) as err:
            if resumed is None:
                raise
            error = (
                f"the checkpoint in {state_dir} records blocks 0-{first_block - 1} as written into the .partial "
                f"files in {out}, but {err}; to start over, delete {state_dir}"
            )
    if resumed is not None:
        error = ranks.broadcast(error, src=0)
        if error is not None:
            raise checkpoint.CheckpointMismatch(error)
    try:
        layers: list[LayerReport] = []
        embedding_bytes = 0
        if resumed is None:
            _load(model, reader, mapping, for_capture + block_keys[0])
            inputs = pipeline.capture_shards(model, blocks, calib_tokens, holdout_tokens, batch_size, shards)
            seconds_capture = time.perf_counter() - start
            embedding_bytes = sum(_tensor_bytes(state[n].dtype, state[n].shape) for n in for_capture)
            if writer is not None:
                for name in for_capture:
                    writer.write(name, model.get_parameter(name) if _is_param(model, name) else model.get_buffer(name))
                for name in head:  # never loaded into the model: copied tensor by tensor
                    tensor = reader.read([mapping[name]])[mapping[name]]
                    writer.write(name, tensor.to(state[name].dtype) if tensor.is_floating_point() else tensor)
            _drop(model, for_capture)
        else:  # the block forwards need no non-block tensor: the captured inputs hold the positions and masks
            inputs = resumed.inputs
            seconds_capture = time.perf_counter() - start
            for _, saved in resumed.blocks():
                layers.extend(LayerReport(**report) for report in saved["reports"])
        per_block = []
        bar = tqdm(
            range(first_block, len(blocks)), desc="blocks", disable=not progress, initial=first_block, total=len(blocks)
        )
        for index in bar:
            begin = time.perf_counter()
            if index > 0:  # block 0 was loaded with the embeddings (a resumed run starts at block 1 or later)
                _load(model, reader, mapping, block_keys[index])
            unloaded = [n for n, p in blocks[index].named_parameters() if p.device.type == "meta"]
            if unloaded:
                raise ValueError(f"block {index} has parameters the checkpoint did not provide: {unloaded[:3]}")
            # A fresh result per block: its masks are dropped with the block.
            step_ranks = ranks if ranks.world_size > 1 else None
            _, reports, inputs = pipeline._process_block(
                blocks, blocks_name, index, inputs, options, device, PruneResult(), progress, False, step_ranks, shards
            )
            layers.extend(reports)
            finalize(blocks[index])
            if writer is not None:
                block_state = blocks[index].state_dict()
                for name in block_keys[index]:
                    writer.write(name, block_state[name[len(f"{blocks_name}.{index}.") :]])
                del block_state
            blocks[index].to("meta")
            if state_dir is not None:  # the block's weights are in the shards: its block file holds its reports only
                if writer is not None:
                    writer.sync()
                payload = {"reports": [asdict(r) for r in reports]} if ranks.is_main else None
                checkpoint.commit_block(state_dir, fingerprint, index, inputs, payload, checkpoint_ranks)
            per_block.append(
                {
                    "block": index,
                    "seconds": time.perf_counter() - begin,
                    "rss_bytes": probe.rss(),
                    "peak_rss_bytes": probe.peak(),
                }
            )
            if reports:
                bar.set_postfix(reduction=f"{sum(r.reduction for r in reports) / len(reports):.1%}")
        files = []
        if writer is not None:
            files = writer.close(total_parameters=total_parameters)
            writer_bytes = writer.bytes_written
            files += _write_configs(model, source_dir, out, dtype)
        ranks.barrier()
    except BaseException:
        if writer is not None and state_dir is not None:
            writer.release()  # the .partial files hold the recorded blocks: the next call continues them
        elif writer is not None:
            writer.abort()
        raise
    if state_dir is not None and ranks.is_main:
        checkpoint.remove_checkpoint(state_dir)
    bytes_written = 0
    if writer is not None:
        extra = [name for name in files if not _OUR_WEIGHTS.fullmatch(name)]
        bytes_written = writer_bytes + sum((out / name).stat().st_size for name in extra)
    seconds = time.perf_counter() - start
    report = {
        "peak_rss_bytes": probe.peak(),
        "peak_rss_since": probe.since,
        "start_rss_bytes": probe.start,
        "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "bytes_written": bytes_written,
        "bytes_read": reader.bytes_read,
        "block_bytes": max(sum(_tensor_bytes(state[n].dtype, state[n].shape) for n in keys) for keys in block_keys),
        "embedding_bytes": embedding_bytes,
        "seconds_capture": seconds_capture,
        "seconds": seconds,
        "rank": ranks.rank,
        "world_size": ranks.world_size,
        "first_block": first_block,
        "blocks": per_block,
    }
    return StreamResult(layers=layers, files=files, report=report, seconds=seconds)
