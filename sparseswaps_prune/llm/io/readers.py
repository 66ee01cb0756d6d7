"""Readers of a source checkpoint, a few tensors at a time: safetensors (one file or a sharded index) and GGUF
(de-quantized as ``from_pretrained(..., gguf_file=...)`` de-quantizes), both checked when opened, and the loading of
their tensors into a model without weights (:mod:`~sparseswaps_prune.llm.io.skeleton`).

**Checked when opened** (issue 47). A source is checked before anything is pruned or written: every safetensors
shard's header must parse (:func:`~sparseswaps_prune.llm.io.formats.read_safetensors_header`), each tensor's dtype
must be one safetensors defines, its ``data_offsets`` must span exactly ``numel * itemsize`` bytes, the tensors must
tile the data without gaps or overlaps, and the file must end where the header says (a shard cut short is found here,
not after some blocks were committed); the index must parse and name shards inside the directory; every tensor of the
model must be in the checkpoint with the config's shape, and a floating-point one stored in a floating-point dtype
(:func:`key_map`). A GGUF file must be read by ``gguf``'s reader and hold every tensor's bytes. Each failure is one
``ValueError`` line naming the file and the tensor.

Limits: safetensors checkpoints and local GGUF files only (not ``.bin``, not hub names); checkpoint names must be
the model's own parameter names (optionally without the base-model prefix), so models whose weights transformers
renames or fuses on load (some mixture-of-experts models) are refused; GGUF architectures that transformers loads
through its newer weight-conversion path (transformers 5 ``integrations.gguf``: qwen35, qwen35moe, lfm2) are refused.
Only the default model's architecture (LLaMA) is tested from a GGUF.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sparseswaps_prune.extras import require
from sparseswaps_prune.llm.io.formats import (
    DTYPE_CODES,
    FLOAT_CODES,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    read_safetensors_header,
)
from sparseswaps_prune.llm.io.skeleton import empty_model, set_tensor
from sparseswaps_prune.llm.io.sources import DEFAULT_MODEL, gguf_parsed_once, load_tokenizer, resolve_source

logger = logging.getLogger(__name__)

__all__ = [
    "CheckpointReader",
    "GGUFCheckpoint",
    "SafetensorsCheckpoint",
    "check_stored_dtype",
    "key_map",
    "load_tensors",
    "open_checkpoint",
]

# Files of the source directory that are not copied to the output: weights (rewritten) and the configs (re-saved).
_NOT_COPIED = re.compile(
    r".*\.(safetensors|bin|pt|pth|gguf|partial)|.*\.index\.json|config\.json|generation_config\.json"
)


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


class CheckpointReader:
    """The tensors of a source checkpoint that :func:`~sparseswaps_prune.llm.streaming.prune_checkpoint` reads a few
    keys at a time: what :class:`SafetensorsCheckpoint` and :class:`GGUFCheckpoint` share.

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
            self.files = {key: single for key in read_safetensors_header(single) if key != "__metadata__"}
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
            for key, info in read_safetensors_header(path).items():
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
    if target.is_floating_point() and code not in FLOAT_CODES:
        raise ValueError(
            f"{reader.files[key]}: tensor {key} is stored as {code}, but the model's {name or key} is "
            f"{str(target.dtype).removeprefix('torch.')} and needs a floating-point dtype "
            f"({', '.join(sorted(FLOAT_CODES))}); the file's header was changed or it is not this model's checkpoint"
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
    ``gguf.dequantize`` gives them; :func:`~sparseswaps_prune.llm.streaming.prune_checkpoint` casts them to the
    model's dtype, as ``from_pretrained`` does. :meth:`write_other_files` saves the GGUF's tokenizer (pad token: its
    eos), as the job saves ``load_model``'s, and :meth:`save_order` is the order ``save_pretrained`` writes a
    GGUF-loaded model in.

    Raises:
        FileNotFoundError: ``path`` is not a file.
        ValueError: transformers converts this GGUF architecture through its weight-conversion path.
        ImportError: ``gguf`` is missing, or transformers lacks its per-tensor GGUF helpers.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        require("llm", "transformers", "accelerate", "gguf")
        import gguf
        import numpy as np

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
        with gguf_parsed_once():  # the config, the name map and the tensor table from one parse of the file
            try:
                reader = gguf.GGUFReader(self.path)
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
            if _gguf_converted(architecture):
                raise ValueError(
                    f"{self.path.name}: transformers loads GGUF architecture {architecture!r} through its "
                    "weight-conversion path, which the block-wise reader does not reproduce; convert the model with "
                    "load_model(...) + save_pretrained, or prune it in memory with prune_model"
                )
            parsed = load_gguf_checkpoint(str(self.path), return_tensors=False)["config"]
            self._processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed)
            self._config = self.load_config()
            self._names = get_gguf_hf_weights_map(empty_model(self._config, torch.float32), self._processor)
        del reader  # its memory map of the whole file
        # Shapes and sources of the model's tensors: the conversion run on stand-ins of the stored shapes that hold
        # no memory (zero strides).
        self._sources: dict[str, list[str]] = {}
        self.shapes = {}
        for name, shape in elements.items():
            with np.errstate(all="ignore"):
                converted = self._convert([name], lambda _, s=shape: np.broadcast_to(np.float32(0), s), False)
            for key, (dtype, out_shape) in converted.items():
                self._sources.setdefault(key, []).append(name)
                self.shapes[key] = (DTYPE_CODES[dtype], list(out_shape))
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


def key_map(model: nn.Module, source: CheckpointReader) -> dict[str, str]:
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


def load_tensors(model: nn.Module, source: CheckpointReader, mapping: dict[str, str], names: list[str]) -> None:
    """Read ``names`` from the checkpoint into the model, cast to the model's dtype where both are floating
    point (as ``from_pretrained`` does)."""
    state = model.state_dict(keep_vars=True)
    tensors = source.read(mapping[name] for name in names)
    for name in names:
        value, target = tensors.pop(mapping[name]), state[name]
        if value.is_floating_point() and target.is_floating_point():
            value = value.to(target.dtype)
        set_tensor(model, name, value)
