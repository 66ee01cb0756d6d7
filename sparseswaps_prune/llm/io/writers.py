"""The writer of the block-wise path's output: a sharded safetensors checkpoint whose tensors arrive one at a time
(:class:`ShardedWriter`, resumable), and the configs and other files saved beside it (:func:`write_configs`)."""

from __future__ import annotations

import json
import os
import re
import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sparseswaps_prune.atomic import fsync_dir
from sparseswaps_prune.llm.io.formats import DTYPE_CODES, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, tensor_bytes
from sparseswaps_prune.llm.io.readers import CheckpointReader

__all__ = ["OUR_WEIGHTS", "ShardedWriter", "parse_size", "write_configs"]

OUR_WEIGHTS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")
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
        slots = [_Slot(key, dtype, tuple(shape), tensor_bytes(dtype, shape)) for key, dtype, shape in tensors]
        for slot in slots:
            if slot.dtype not in DTYPE_CODES:
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
                        "dtype": DTYPE_CODES[slot.dtype],
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
            if OUR_WEIGHTS.fullmatch(path.name) and path.name not in files:
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


def write_configs(model: nn.Module, reader: CheckpointReader, out_dir: Path, dtype: torch.dtype) -> list[str]:
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
