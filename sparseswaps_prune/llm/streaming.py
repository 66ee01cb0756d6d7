"""Out-of-core block-wise pruning of a safetensors checkpoint: the whole model is never in memory.

:func:`prune_checkpoint` builds the model without weights (``accelerate.init_empty_weights``: parameters on the
``meta`` device, buffers such as the rotary frequencies real), loads the tensors that run before the first
decoder block (embeddings; every non-block tensor except an untied ``lm_head``) and block 0 from the checkpoint's
safetensors, and captures the calibration inputs of block 0 (:func:`~sparseswaps_prune.llm.capture
.capture_block_inputs`). The non-block tensors are then written out and dropped. Each decoder block in turn is
read from the shards (only its own keys), pruned by the same per-block step as :func:`~sparseswaps_prune.llm
.pipeline.prune_model` (``pipeline._process_block``), made permanent (exact zeros), written into the output shards
at its planned offsets, and dropped; its masks are not kept.

The source may also be a GGUF file (:class:`GGUFCheckpoint`, e.g. the packaged default model): each block's tensors
are de-quantized and converted on their own by transformers' GGUF loading steps, to the tensors
``from_pretrained(..., gguf_file=...)`` loads, bit for bit.

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

**Checked when opened** (issue 47). A source is checked before anything is pruned or written: every safetensors
shard's header must parse (:func:`read_safetensors_header`), each tensor's dtype must be one safetensors defines, its
``data_offsets`` must span exactly ``numel * itemsize`` bytes, the tensors must tile the data without gaps or
overlaps, and the file must end where the header says (a shard cut short is found here, not after some blocks were
committed); the index must parse and name shards inside the directory; every tensor of the model must be in the
checkpoint with the config's shape, and a floating-point one stored in a floating-point dtype. A GGUF file must be read
by ``gguf``'s reader and hold every tensor's bytes. Each failure is one ``ValueError`` line naming the file and the
tensor.

Limits: safetensors checkpoints and local GGUF files only (not ``.bin``, not hub names); checkpoint names must be
the model's own parameter names (optionally without the base-model prefix), so models whose weights transformers
renames or fuses on load (some mixture-of-experts models) are refused; GGUF architectures that transformers loads
through its newer weight-conversion path (transformers 5 ``integrations.gguf``: qwen35, qwen35moe, lfm2) are refused.
Only the default model's architecture (LLaMA) is tested from a GGUF.
"""

from __future__ import annotations

import contextlib
import copy
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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from sparseswaps_prune.atomic import fsync_dir
from sparseswaps_prune.core.checks import check_device
from sparseswaps_prune.extras import require
from sparseswaps_prune.llm import checkpoint, pipeline
from sparseswaps_prune.llm.block_tune import BlockTuneReport
from sparseswaps_prune.llm.budgets import on_device
from sparseswaps_prune.llm.distributed import Ranks
from sparseswaps_prune.llm.layers import find_blocks
from sparseswaps_prune.llm.pipeline import LayerReport, PruneOptions, PruneResult, check_layers, finalize

logger = logging.getLogger(__name__)

__all__ = [
    "CheckpointReader",
    "GGUFCheckpoint",
    "MemoryProbe",
    "SafetensorsCheckpoint",
    "ShardedWriter",
    "StreamResult",
    "check_stored_dtype",
    "open_checkpoint",
    "prune_checkpoint",
    "read_safetensors_header",
]

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
# Bytes per element of every safetensors dtype this reader accepts, and those of them that hold floating-point values
# (what a model's floating parameters may be stored in: ``from_pretrained`` casts them to the model's dtype).
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8}  # fmt: skip
_FLOAT_CODES = {code for dtype, code in _DTYPE_NAMES.items() if dtype.is_floating_point}


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
    """The JSON header of a safetensors file (tensor names -> dtype, shape, offsets), checked
    (:func:`read_safetensors_header`)."""
    return read_safetensors_header(path)


def _corrupt(path: Path, why: str) -> ValueError:
    return ValueError(f"{path} is not a valid safetensors file: {why}; re-download or re-save the model")


def read_safetensors_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON header of the safetensors file ``path`` (tensor names -> ``dtype``, ``shape``, ``data_offsets``; and
    ``__metadata__``), after checking what can be checked without reading the tensors: the header parses, each
    tensor's dtype is one safetensors defines and its offsets span ``numel * itemsize`` bytes, the tensors tile the data
    in order without gaps or overlaps, and the file ends where the last tensor does.

    Raises:
        ValueError: one line naming the file, the tensor and what is wrong (e.g. a file cut short, a dtype changed).
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _corrupt(path, f"it has {size} bytes, fewer than the 8 of its header's length")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise _corrupt(path, f"its header claims {length} bytes, but only {size - 8} follow (cut short?)")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise _corrupt(path, f"its JSON header does not parse ({err})") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "its header is not a JSON object")
    spans = []
    for key, info in header.items():
        if key == "__metadata__":
            if info is not None and not isinstance(info, dict):
                raise _corrupt(path, "its __metadata__ is not a JSON object")
            continue
        where = f"tensor {key}"
        if not isinstance(info, dict):
            raise _corrupt(path, f"{where} has no dtype, shape and data_offsets")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in _ITEMSIZE:
            raise _corrupt(path, f"{where} has dtype {dtype!r}, not one of {', '.join(_ITEMSIZE)}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):  # fmt: skip
            raise _corrupt(path, f"{where} has shape {shape!r}, not a list of sizes")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
            or offsets[0] > offsets[1]
        ):
            raise _corrupt(path, f"{where} has data_offsets {offsets!r}, not [begin, end] with begin <= end")
        expected = _ITEMSIZE[dtype]
        for d in shape:
            expected *= d
        if offsets[1] - offsets[0] != expected:
            raise _corrupt(
                path,
                f"{where} ({dtype}, shape {shape}) takes {expected} bytes, but its data_offsets {offsets} span "
                f"{offsets[1] - offsets[0]} (its dtype or shape was changed?)",
            )
        spans.append((offsets[0], offsets[1], key))
    end = 0
    for begin, stop, key in sorted(spans):
        if begin != end:
            what = "overlaps the tensor before it" if begin < end else f"leaves a gap of {begin - end} bytes before it"
            raise _corrupt(path, f"tensor {key} (data_offsets [{begin}, {stop}]) {what}")
        end = stop
    if 8 + length + end != size:
        cut = "cut short?" if 8 + length + end > size else "bytes after the last tensor"
        raise _corrupt(path, f"its header ends the tensors at byte {8 + length + end}, but the file has {size} ({cut})")
    return header


class CheckpointReader:
    """The tensors of a source checkpoint that :func:`prune_checkpoint` reads a few keys at a time: what
    :class:`SafetensorsCheckpoint` and :class:`GGUFCheckpoint` share.

    Attributes:
        directory: the directory of the weight files.
        files: tensor name -> the file holding it.
        shapes: tensor name -> ``(safetensors dtype code, shape)`` of the tensor :meth:`read` returns.
        bytes_read: bytes of the tensors :meth:`read` returned so far.
    """

    directory: Path
    files: dict[str, Path]
    shapes: dict[str, tuple[str, list[int]]]
    bytes_read: int = 0

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
        """The tensors ``keys`` (CPU)."""
        raise NotImplementedError

    def load_config(self) -> Any:
        """The model's config, as ``from_pretrained`` builds it."""
        raise NotImplementedError

    def generation_config(self, model: nn.Module) -> Any:
        """The generation config ``from_pretrained`` gives ``model`` (here: the one made from its config)."""
        return model.generation_config

    def write_other_files(self, out_dir: Path) -> list[str]:
        """Write the source's files other than weights and configs into ``out_dir``; returns their names."""
        return []

    def save_order(self, model: nn.Module, names: list[str]) -> list[str]:
        """``names`` (the output's tensors, in ``model``'s state-dict order) in the order ``save_pretrained`` takes
        them in (and splits them into shards by) for ``model`` loaded by ``from_pretrained`` from this source:
        sorted by :func:`_natural_key` (transformers 5 sorts the state dict of a model whose loading recorded
        weight conversions, even none)."""
        return sorted(names, key=_natural_key)

    def _count(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.bytes_read += sum(t.numel() * t.element_size() for t in tensors.values())
        return tensors


class SafetensorsCheckpoint(CheckpointReader):
    """The tensors of a local safetensors checkpoint (one ``model.safetensors`` or a sharded index), read a few
    keys at a time: each read opens the files it needs and closes them again, so no memory map stays resident.
    :meth:`read` returns the tensors as stored (their stored dtype); :meth:`write_other_files` copies the
    directory's non-weight files (tokenizer files, ...).
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        index = self.directory / SAFE_WEIGHTS_INDEX_NAME
        if index.is_file():
            self.files = _weight_map(index)
        elif (self.directory / SAFE_WEIGHTS_NAME).is_file():
            single = self.directory / SAFE_WEIGHTS_NAME
            self.files = {key: single for key in _read_header(single) if key != "__metadata__"}
        else:
            present = sorted(p.name for p in self.directory.iterdir()) if self.directory.is_dir() else []
            raise FileNotFoundError(
                f"{self.directory} holds neither {SAFE_WEIGHTS_INDEX_NAME} nor {SAFE_WEIGHTS_NAME} (files: "
                f"{present[:10]}); the block-wise path reads safetensors checkpoints and GGUF files only (pass a "
                "GGUF as gguf_file). Convert the model with load_model(...) + save_pretrained, or prune it in "
                "memory with prune_model"
            )
        self.shapes = {}
        for path in sorted(set(self.files.values())):
            if not path.is_file():
                raise FileNotFoundError(f"shard {path.name} named in {index.name} is missing from {self.directory}")
            for key, info in _read_header(path).items():
                if key != "__metadata__" and self.files.get(key) == path:
                    self.shapes[key] = (info["dtype"], info["shape"])
        missing = sorted(set(self.files) - set(self.shapes))
        if missing:
            raise ValueError(f"{index} names tensors that are not in their shard: {missing[:5]}")
        self.bytes_read = 0

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors ``keys`` as stored (CPU, the stored dtype).

        Raises:
            ValueError: safetensors cannot read a file (e.g. changed since it was opened), naming it."""
        from safetensors import SafetensorError, safe_open

        by_file: dict[Path, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.files[key], []).append(key)
        out = {}
        for path, names in by_file.items():
            try:
                with safe_open(str(path), framework="pt") as f:
                    for key in names:
                        out[key] = f.get_tensor(key)
            except (SafetensorError, RuntimeError) as err:
                raise ValueError(f"{path}: cannot read tensor(s) {names[:3]} ({' '.join(str(err).split())})") from err
        return self._count(out)

    def load_config(self) -> Any:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.directory, local_files_only=True)

    def generation_config(self, model: nn.Module) -> Any:
        from transformers import GenerationConfig

        if (self.directory / "generation_config.json").is_file():
            return GenerationConfig.from_pretrained(self.directory)
        return model.generation_config

    def write_other_files(self, out_dir: Path) -> list[str]:
        files = []
        for path in sorted(self.directory.iterdir()):
            if path.is_file() and not _NOT_COPIED.fullmatch(path.name) and not path.name.startswith("."):
                shutil.copy2(path, out_dir / path.name)
                files.append(path.name)
        return files


def _weight_map(index: Path) -> dict[str, Path]:
    """Tensor name -> shard path of a safetensors index, checked: it parses, and names shards inside its directory.

    Raises:
        ValueError: naming the index and what is wrong."""
    try:
        weight_map = json.loads(index.read_bytes()).get("weight_map")
    except (ValueError, AttributeError) as err:  # JSONDecodeError, UnicodeDecodeError; not a JSON object
        raise ValueError(
            f"{index} is not a valid safetensors index ({err}); re-download or re-save the model"
        ) from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index} has no weight_map object; re-download or re-save the model")
    files = {}
    for key, name in weight_map.items():
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise ValueError(f"{index} maps tensor {key} to {name!r}, not a file name in {index.parent}")
        files[key] = index.parent / name
    return files


def check_stored_dtype(reader: CheckpointReader, key: str, target: torch.Tensor, name: str | None = None) -> None:
    """Raise ``ValueError`` naming the file and the tensor if ``reader``'s tensor ``key`` is stored in a dtype that
    cannot hold the model's tensor ``target`` (``name`` in the model): a floating-point one in an integer or bool
    dtype (``from_pretrained`` would cast the integers into garbage weights; an altered header)."""
    code = reader.shapes[key][0]
    if target.is_floating_point() and code not in _FLOAT_CODES:
        raise ValueError(
            f"{reader.files[key]}: tensor {key} is stored as {code}, but the model's {name or key} is "
            f"{str(target.dtype).removeprefix('torch.')} and needs a floating-point dtype "
            f"({', '.join(sorted(_FLOAT_CODES))}); the file's header was changed or it is not this model's checkpoint"
        )


class GGUFCheckpoint(CheckpointReader):
    """The tensors of a GGUF file under the model's own names, de-quantized and converted exactly as
    ``from_pretrained(directory, gguf_file=name)`` (:func:`~sparseswaps_prune.llm.models.load_model`) gives them,
    read a few at a time.

    The file's tensor table is read once with ``gguf.GGUFReader`` (whose memory map is then dropped); each
    :meth:`read` reads only the bytes of the tensors it needs and runs transformers' own GGUF loading steps on them:
    ``gguf.dequantize``, the architecture's ``TensorProcessor`` (e.g. LLaMA's reverse permutation of the q and k
    rows) with the config ``load_gguf_checkpoint`` parses, and the GGUF -> model name map
    ``get_gguf_hf_weights_map`` makes for the model of :meth:`load_config` (that of
    ``transformers.modeling_gguf_pytorch_utils``, which ``from_pretrained`` runs for every GGUF architecture it does
    not convert through its newer weight-conversion path; those are refused). Tensors come back in float32, as
    ``gguf.dequantize`` gives them; :func:`prune_checkpoint` casts them to the model's dtype, as ``from_pretrained``
    does. :meth:`write_other_files` saves the GGUF's tokenizer (pad token: its eos), as the job saves
    ``load_model``'s, and :meth:`save_order` is the order ``save_pretrained`` writes a GGUF-loaded model in.

    Raises:
        FileNotFoundError: ``path`` is not a file.
        ValueError: transformers converts this GGUF architecture through its weight-conversion path.
        ImportError: ``gguf`` is missing, or transformers lacks its per-tensor GGUF helpers.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        require("llm", "transformers", "accelerate", "gguf")
        import numpy as np
        from gguf import GGUFReader

        try:
            from transformers.modeling_gguf_pytorch_utils import (
                TENSOR_PROCESSORS,
                TensorProcessor,
                get_gguf_hf_weights_map,
                load_gguf_checkpoint,
                read_field,
            )
        except ImportError as err:
            import transformers

            raise ImportError(
                f"reading a GGUF block by block needs transformers' per-tensor GGUF helpers "
                f"(get_gguf_hf_weights_map, TENSOR_PROCESSORS), which transformers {transformers.__version__} "
                "lacks; upgrade transformers"
            ) from err
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file {self.path} does not exist")
        self.directory = self.path.parent
        try:
            reader = GGUFReader(self.path)
            architecture = read_field(reader, "general.architecture")[0]
        except Exception as err:  # gguf's reader raises ValueError, IndexError, KeyError, ... on a damaged file
            raise ValueError(
                f"{self.path} is not a valid GGUF file ({type(err).__name__}: {' '.join(str(err).split())[:200]}); "
                "re-download the model"
            ) from err
        size = self.path.stat().st_size
        for t in reader.tensors:
            if t.data_offset + t.data.nbytes > size:
                raise ValueError(
                    f"{self.path} is not a valid GGUF file: tensor {t.name} ends at byte "
                    f"{t.data_offset + t.data.nbytes}, beyond the file's {size} (cut short?); re-download the model"
                )
        # name -> (ggml type, offset in the file, dtype and shape of the stored array as GGUFReader views it)
        self._stored = {t.name: (t.tensor_type, t.data_offset, t.data.dtype, t.data.shape) for t in reader.tensors}
        self._position = {name: index for index, name in enumerate(self._stored)}
        elements = {t.name: tuple(reversed(t.shape.tolist())) for t in reader.tensors}
        del reader  # its memory map of the whole file
        if _gguf_converted(architecture):
            raise ValueError(
                f"{self.path.name}: transformers loads GGUF architecture {architecture!r} through its "
                "weight-conversion path, which the block-wise reader does not reproduce; convert the model with "
                "load_model(...) + save_pretrained, or prune it in memory with prune_model"
            )
        parsed = load_gguf_checkpoint(str(self.path), return_tensors=False)["config"]
        self._processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed)
        self._config = self.load_config()
        self._names = get_gguf_hf_weights_map(_skeleton(self._config, torch.float32), self._processor)
        # Shapes and sources of the model's tensors: the conversion run on stand-ins of the stored shapes that hold
        # no memory (zero strides).
        self._sources: dict[str, list[str]] = {}
        self.shapes = {}
        for name, shape in elements.items():
            with np.errstate(all="ignore"):
                converted = self._convert([name], lambda _, s=shape: np.broadcast_to(np.float32(0), s), False)
            for key, (dtype, out_shape) in converted.items():
                self._sources.setdefault(key, []).append(name)
                self.shapes[key] = (_DTYPE_NAMES[dtype], list(out_shape))
        self.files = {key: self.path for key in self.shapes}
        self.bytes_read = 0

    def _convert(self, names: list[str], load: Any, materialize: bool = True) -> dict[str, Any]:
        """The tensors the GGUF tensors ``names`` (in file order) make: transformers' loop of
        ``load_gguf_checkpoint(..., return_tensors=True)`` over these only, with ``load(name)`` the de-quantized
        array; with ``materialize`` False, ``(torch dtype, shape)`` of each instead."""
        import numpy as np

        parsed: dict[str, dict[str, Any]] = {"tensors": {}}
        for name in names:
            result = self._processor.process(
                weights=load(name), name=name, tensor_key_mapping=self._names, parsed_parameters=parsed
            )
            if result.name in self._names:
                key = self._names[result.name]
                weights = result.weights
                if materialize:  # transformers copies every array; ours are private to this read, so only where needed
                    owned = weights.flags.writeable and weights.flags.c_contiguous
                    weights = torch.from_numpy(weights if owned else np.copy(weights))
                parsed["tensors"][key] = weights
        return {
            key: value if materialize else (_torch_dtype(value), tuple(value.shape))
            for key, value in parsed["tensors"].items()
        }

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors ``keys`` (CPU, float32), each equal to the one ``from_pretrained`` loads before it casts it
        to the model's dtype."""
        import numpy as np
        from gguf import dequantize

        keys = list(keys)
        names = sorted({name for key in keys for name in self._sources[key]}, key=self._position.__getitem__)
        with open(self.path, "rb", buffering=0) as f:

            def load(name: str) -> Any:
                kind, offset, dtype, shape = self._stored[name]
                data = np.empty(shape, dtype=dtype)
                view, done = memoryview(data.reshape(-1).view(np.uint8)), 0
                f.seek(offset)
                while done < len(view):
                    n = f.readinto(view[done:])
                    if not n:
                        raise EOFError(f"{self.path} ends inside tensor {name}")
                    done += n
                return dequantize(data, kind)

            tensors = self._convert(names, load)
        return self._count({key: tensors[key] for key in keys})

    def load_config(self) -> Any:
        """``AutoConfig.from_pretrained(directory, gguf_file=name)``: a copy of the one made when the file was
        opened."""
        from transformers import AutoConfig

        if getattr(self, "_config", None) is None:
            return AutoConfig.from_pretrained(self.directory, gguf_file=self.path.name, local_files_only=True)
        return copy.deepcopy(self._config)

    def save_order(self, model: nn.Module, names: list[str]) -> list[str]:
        """The order of transformers' ``revert_weight_conversion``, which ``save_pretrained`` runs on the state dict
        (here on ``meta`` stand-ins): a GGUF-loaded model records no weight conversions, so the class's default
        ones apply, and with none the state-dict order is kept.

        Raises:
            ValueError: ``save_pretrained`` would write the tensors under other names."""
        from transformers.core_model_loading import revert_weight_conversion

        state = model.state_dict(keep_vars=True)
        order = list(revert_weight_conversion(model, {name: state[name] for name in names}))
        if sorted(order) != sorted(names):
            raise ValueError(
                f"save_pretrained writes {type(model).__name__}'s weights under other names (e.g. "
                f"{sorted(set(order) - set(names))[:3]}); prune this model in memory with prune_model"
            )
        return order

    def write_other_files(self, out_dir: Path) -> list[str]:
        """The GGUF's tokenizer as ``load_model`` makes it, saved with ``save_pretrained``."""
        from sparseswaps_prune.llm.models import load_tokenizer

        saved = load_tokenizer(str(self.directory), self.path.name).save_pretrained(out_dir)
        return sorted({Path(name).name for name in saved if Path(name).is_file()})


def _gguf_converted(architecture: str) -> bool:
    """Whether ``from_pretrained`` loads this GGUF architecture through transformers' weight-conversion path
    (transformers 5: ``integrations.gguf``) rather than ``load_gguf_checkpoint``'s per-tensor loop."""
    try:
        from transformers.integrations.gguf.utils import is_gguf_arch_supported
    except ImportError:
        return False
    return bool(is_gguf_arch_supported(architecture))


def _torch_dtype(value: Any) -> torch.dtype:
    """The torch dtype of a tensor or a numpy array."""
    if isinstance(value, torch.Tensor):
        return value.dtype
    import numpy as np

    return torch.from_numpy(np.empty(0, dtype=value.dtype)).dtype


def open_checkpoint(
    source: str | os.PathLike[str] | None, gguf_file: str | None = None
) -> SafetensorsCheckpoint | GGUFCheckpoint:
    """The reader of a local checkpoint, named as :func:`~sparseswaps_prune.llm.models.load_model` names it: a
    safetensors directory; a directory and ``gguf_file``, a ``.gguf`` path, or None (or ``"smollm2-135m"``) for the
    packaged default GGUF.

    Raises:
        FileNotFoundError: a missing file or directory, or a hub name (not read block by block).
        ValueError: contradictory arguments (e.g. ``gguf_file`` with a ``.gguf`` path or the default model).
    """
    from sparseswaps_prune.llm.models import DEFAULT_MODEL, resolve_source

    name = None if source is None else os.fspath(source)
    if name is not None and gguf_file is None and name != DEFAULT_MODEL and not name.endswith(".gguf"):
        return SafetensorsCheckpoint(name)
    directory, gguf = resolve_source(name, gguf_file)
    if gguf is None or not os.path.isdir(directory):
        raise FileNotFoundError(
            f"source={name!r}, gguf_file={gguf_file!r} is not a local GGUF file; the block-wise path reads local "
            "files only (download the GGUF first)"
        )
    return GGUFCheckpoint(Path(directory) / gguf)


@dataclass
class _Slot:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    shard: int = 0
    offset: int = 0


def _file_order(slots: list[_Slot]) -> list[_Slot]:
    """``slots`` in the order safetensors' ``save_file`` lays them out in one file and lists them in its header
    (by dtype, then name), asked of safetensors itself with empty stand-ins."""
    from safetensors.torch import save

    raw = save({slot.key: torch.empty(0, dtype=slot.dtype) for slot in slots})
    (size,) = struct.unpack("<Q", raw[:8])
    by_key = {slot.key: slot for slot in slots}
    return [by_key[key] for key in json.loads(raw[8 : 8 + size]) if key != "__metadata__"]


class ShardedWriter:
    """A safetensors checkpoint whose tensors arrive one at a time, in any order.

    The shards are planned up front from ``(name, dtype, shape)`` with ``save_pretrained``'s rule (tensors in the
    given order; a shard is closed when the next tensor would take it over ``max_shard_size``; a tensor larger than
    that gets a shard of its own); within a shard the tensors are laid out and listed in the order safetensors'
    ``save_file`` uses (by dtype, then name: a shard's bytes are those ``save_pretrained`` writes). Each file is
    created with its final header, and :meth:`write` puts each tensor's bytes at its offset. :meth:`close` checks
    that every tensor was written, renames the ``.partial`` files to their final names and writes the index
    (several shards) or leaves one ``model.safetensors``.

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
        shards = [_file_order(shard) for shard in shards if shard]
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
        block_tunes: one report per tuned block (``options.block_tune_epochs``), resumed blocks' included.
    """

    layers: list[LayerReport] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    report: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    block_tunes: list[BlockTuneReport] = field(default_factory=list)


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


def _key_map(model: nn.Module, source: CheckpointReader) -> dict[str, str]:
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
            raise ValueError(
                f"{source.files[key]}: tensor {key} has shape {shape}, but the config makes {list(tensor.shape)}"
            )
        check_stored_dtype(source, key, tensor, name)
        mapping[name] = key
    unused = sorted(set(source.shapes) - set(mapping.values()))
    if unused:
        logger.warning("checkpoint tensors the model does not use are not written: %s", unused[:10])
    return mapping


def _load(model: nn.Module, source: CheckpointReader, mapping: dict[str, str], names: list[str]) -> None:
    """Read ``names`` from the checkpoint into the model, cast to the model's dtype where both are floating
    point (as ``from_pretrained`` does)."""
    state = model.state_dict(keep_vars=True)
    tensors = source.read(mapping[name] for name in names)
    for name in names:
        value, target = tensors.pop(mapping[name]), state[name]
        if value.is_floating_point() and target.is_floating_point():
            value = value.to(target.dtype)
        _set_tensor(model, name, value)


def _block_options(
    model: nn.Module,
    blocks: nn.ModuleList,
    blocks_name: str,
    reader: CheckpointReader,
    mapping: dict[str, str],
    for_capture: list[str],
    block_keys: list[list[str]],
    calib_tokens: torch.Tensor,
    options: PruneOptions,
    device: torch.device,
    batch_size: int,
    progress: bool,
) -> list[PruneOptions]:
    """:func:`~sparseswaps_prune.llm.pipeline.block_options` (OWL's budgets) of the model the skeleton ``model`` is
    read into: the tensors outside the blocks and block 0 are loaded for the capture, each block is read for its
    dense forward and dropped after, and the tensors outside the blocks are dropped at the end, so the model is
    again the empty skeleton (``blocks``, ``blocks_name``: its decoder blocks and their path)."""

    @contextlib.contextmanager
    def loaded(index: int) -> Iterator[None]:
        if index > 0:  # block 0 is loaded with the tensors the capture needs
            _load(model, reader, mapping, block_keys[index])
        try:
            with on_device(blocks[index], device):
                yield
        finally:
            blocks[index].to("meta")

    _load(model, reader, mapping, for_capture + block_keys[0])
    try:
        return pipeline.block_options(
            model, blocks, blocks_name, calib_tokens, options, device, batch_size, progress, loader=loaded
        )
    finally:
        blocks[0].to("meta")
        _drop(model, for_capture)


def _write_configs(model: nn.Module, reader: CheckpointReader, out_dir: Path, dtype: torch.dtype) -> list[str]:
    """``config.json`` and ``generation_config.json`` as ``save_pretrained`` writes them, and the source's other
    files (:meth:`CheckpointReader.write_other_files`: a copy of every other non-weight file of a safetensors
    directory, such as the tokenizer's; a GGUF's tokenizer)."""
    config = model.config
    config.dtype = str(dtype).split(".")[1]
    config.architectures = [type(model).__name__]
    config.save_pretrained(out_dir)
    files = ["config.json"]
    if model.can_generate():
        reader.generation_config(model).save_pretrained(out_dir)
        files.append("generation_config.json")
    return files + reader.write_other_files(out_dir)


def _fingerprint(
    model: nn.Module,
    reader: CheckpointReader,
    dtype: torch.dtype,
    options: PruneOptions,
    calib_tokens: torch.Tensor,
    holdout_tokens: torch.Tensor | None,
    planned: list[tuple[str, torch.dtype, tuple[int, ...]]],
    max_shard_size: int | str,
    ranks: Ranks | None,
    *,
    batch_size: int,
    device: torch.device,
) -> checkpoint.Fingerprint:
    """The :class:`~sparseswaps_prune.llm.checkpoint.Fingerprint` of a :func:`prune_checkpoint` call: the model's
    config, the source's weight files (hashed on rank 0 and broadcast), ``dtype``, ``options``, the windows, the
    number of ``ranks`` (None: one process), the numerics of ``batch_size`` and ``device``, ``max_shard_size`` and
    the output plan (``planned``: name, dtype and shape of every output tensor, in order)."""
    weights = reader.digest() if ranks is None or ranks.is_main else None
    parts = {
        "model_config": checkpoint.config_digest(model),
        "model_weights": weights if ranks is None else ranks.broadcast(weights, src=0),
        "dtype": str(dtype).removeprefix("torch."),
    }
    plan = json.dumps([[name, str(kind), list(shape)] for name, kind, shape in planned])
    settings = pipeline.checkpoint_settings(False, ranks, batch_size=batch_size, device=device) | {
        "max_shard_size": parse_size(max_shard_size),
        "output_plan": hashlib.sha256(plan.encode()).hexdigest()[:16],
    }
    return checkpoint.fingerprint(model, options, calib_tokens, holdout_tokens, known_model_parts=parts, **settings)


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
    start = time.perf_counter()
    probe = MemoryProbe()
    options.validate()
    if distributed:
        options.require_whole_windows("distributed=True (--distributed)")
    device = check_device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ranks = Ranks.current() if distributed else Ranks(0, 1)
    checkpoint_ranks = ranks if distributed else None  # as prune_model: one process records no rank
    progress = progress and ranks.is_main
    reader = open_checkpoint(source, gguf_file)
    source_dir, out = reader.directory, Path(out_dir)
    if out.exists() and out.resolve() == source_dir.resolve():
        raise ValueError(f"out_dir is the source directory {source_dir}; write the pruned model elsewhere")
    config = reader.load_config()
    dtype = _resolve_dtype(config, dtype)
    model = _skeleton(config, dtype)
    model.config.use_cache = False  # as load_model sets it (after the generation config was made)
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
    # In the order save_pretrained uses for the model from_pretrained loads from this source.
    planned = [(name, state[name].dtype, tuple(state[name].shape)) for name in reader.save_order(model, list(mapping))]
    block_options = [options] * len(blocks)
    if options.sparsity_profile != "uniform":  # OWL's pre-pass reads every block once more, before anything is written
        block_options = _block_options(model, blocks, blocks_name, reader, mapping, for_capture, block_keys,
                                       calib_tokens, options, device, batch_size, progress)  # fmt: skip

    resumed, state_dir = None, None
    if checkpoint_dir is not None:
        state_dir = Path(checkpoint_dir)
        fingerprint = _fingerprint(
            model, reader, dtype, options, calib_tokens, holdout_tokens, planned, max_shard_size, checkpoint_ranks,
            batch_size=batch_size, device=device,
        )  # fmt: skip
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
        tunes: list[BlockTuneReport] = []
        embedding_bytes = 0
        if resumed is None:
            _load(model, reader, mapping, for_capture + block_keys[0])
            inputs = pipeline.capture_shards(
                model, blocks, calib_tokens, holdout_tokens, batch_size, shards, dense=options.block_tune_epochs > 0
            )
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
                reports, block_tunes = pipeline.saved_reports(saved)
                layers.extend(reports)
                tunes.extend(block_tunes)
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
            step_ranks, step = ranks if ranks.world_size > 1 else None, PruneResult()
            _, reports, inputs = pipeline._process_block(
                blocks, blocks_name, index, inputs, block_options[index], device, step, progress, False, step_ranks,
                shards,
            )  # fmt: skip
            layers.extend(reports)
            tunes.extend(step.block_tunes)
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
                tune = step.block_tunes[0] if step.block_tunes else None
                payload = checkpoint.reports_payload(reports, tune) if ranks.is_main else None
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
                bar.set_postfix(pipeline.progress_postfix(reports))
        files = []
        if writer is not None:
            files = writer.close(total_parameters=total_parameters)
            writer_bytes = writer.bytes_written
            files += _write_configs(model, reader, out, dtype)
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
    return StreamResult(layers=layers, files=files, report=report, seconds=seconds, block_tunes=tunes)
