"""Sparse checkpoints: a pruned model's weights as bitmask + kept values in one safetensors file.

We write our own documented format rather than a library's: compressed-tensors (the maintained library behind
llm-compressor's checkpoints) still names its ``sparse-bitmask`` and ``sparse-24-bitmask`` formats in its configs
but, as of its 0.20 releases, marks them "legacy" and no longer ships their compressors, and llm-compressor dropped
its sparse save formats; it is also not a dependency of this package. The per-weight layout below is the one of
that legacy bitmask format (``numpy.packbits(..., bitorder="little")`` rows, values in row-major order), without its
config entries, so a reader of one is a small step from a reader of the other.

Directory layout (self-contained: ``load_sparse(dir)`` needs nothing else):

* ``model.sparse.safetensors`` (:data:`SPARSE_FILE`): every tensor of the model's state dict, once. A 2-D
  floating-point tensor with at least ``min_sparsity`` (default 0.3) of its entries zero
  (:func:`~sparseswaps_prune.deploy.format.should_encode`) is stored as ``<name>.bitmask`` (``uint8
  [rows, ceil(cols / 8)]``, little-endian bit order) and ``<name>.values`` (the kept entries, row-major, in the
  weight's dtype), plus ``<name>.zero_signs`` when some pruned entries are ``-0.0`` (their sign bits): see
  :mod:`sparseswaps_prune.deploy.format`. Every other tensor is stored as it is under
  ``<name>``. A tensor sharing its storage with an earlier one (tied embeddings) is stored once and recorded as an
  alias. The header's ``__metadata__`` holds one entry, :data:`METADATA_KEY`, a JSON object::

      {"format": "sparseswaps-sparse", "format_version": 1, "bit_order": "little", "min_sparsity": 0.3,
       "model_class": "LlamaForCausalLM", "dtype": "float32",
       "tensors": {"<name>": {"shape": [..], "dtype": "bfloat16", "encoding": "bitmask" | "dense" | "alias",
                              "sparsity": 0.6, "nm": [2, 4] | null, "zero_signs": false, "alias_of": "<name>",
                              "codec": "zlib-planes", "values_numel": 123}}}

  ``nm`` is the N:M pattern along the rows of the tensor as stored (a GPT-2 ``Conv1D`` stores ``[d_in, d_out]``).
  ``codec`` (``compress=True``; ``format_version`` 2, which readers before it refuse): the entry's floating-point
  data (a bitmask entry's ``values``, a dense floating tensor) is stored losslessly compressed,
  :mod:`~sparseswaps_prune.deploy.codec`'s byte planes under zlib, as ``uint8 [n]`` under the same name;
  ``values_numel`` gives a compressed bitmask entry's count of values. Smaller files (the packaged SmolLM2 at 60%:
  BENCHMARKS.md), slower to write and read; a file without ``codec`` is ``format_version`` 1, as before.

* ``config.json`` (and ``generation_config.json``) of a transformers model, its ``architectures`` naming the model
  class as ``save_pretrained`` writes it, and the tokenizer files when a tokenizer is given.

Getting a transformers model back: :func:`load_sparse` decodes every tensor (checked against the metadata), then
calls ``<model_class>.from_pretrained(None, config=AutoConfig.from_pretrained(dir), state_dict=..., dtype=...)`` and
checks that every tensor came out bit for bit. To pass other ``from_pretrained`` options, give them to
:func:`load_sparse`, or call ``from_pretrained`` yourself with ``state_dict=read_sparse_state_dict(dir)``.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sparseswaps_prune.atomic import fsync_dir
from sparseswaps_prune.deploy.codec import CODEC, INT_OF_SIZE, compress_planes, decompress_planes
from sparseswaps_prune.deploy.format import (
    DEFAULT_MIN_SPARSITY,
    check_bitmask,
    decode_bitmask,
    encode_bitmask,
    kept_mask,
    nm_pattern,
    should_encode,
    zero_fraction,
)

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "METADATA_KEY",
    "SPARSE_FILE",
    "TOKENIZER_FILES",
    "SparseSaveReport",
    "encode_state_dict",
    "is_sparse_checkpoint",
    "load_sparse",
    "read_sparse_state_dict",
    "save_sparse",
    "write_sparse_files",
]

SPARSE_FILE = "model.sparse.safetensors"
"""File name of the weights in a sparse checkpoint directory."""

FORMAT_NAME = "sparseswaps-sparse"
FORMAT_VERSION = 2
"""The newest format version this module reads: 2 when some tensor is compressed (``codec``), else 1 (written as 1
then, so that earlier readers load it)."""
METADATA_KEY = "sparseswaps_sparse"
"""Key of the JSON metadata entry in the safetensors header."""

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
"""Tokenizer files copied from a directory given as ``tokenizer=``."""

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}
_DTYPES |= {str(d).removeprefix("torch."): d for d in (torch.int64, torch.int32, torch.int16, torch.int8)}
_DTYPES |= {"uint8": torch.uint8, "bool": torch.bool}
_ENCODINGS = ("dense", "bitmask", "alias")


@dataclass
class SparseSaveReport:
    """What :func:`save_sparse` / :func:`write_sparse_files` wrote.

    Attributes:
        path: the directory.
        encoded: name -> sparsity (fraction of zero entries) of each tensor stored as bitmask + values.
        file_bytes: size of :data:`SPARSE_FILE` on disk.
        dense_bytes: bytes of the same tensors stored densely (each shared tensor once), in their own dtypes.
    """

    path: Path
    encoded: dict[str, float] = field(default_factory=dict)
    file_bytes: int = 0
    dense_bytes: int = 0

    @property
    def ratio(self) -> float:
        """``file_bytes / dense_bytes`` (the safetensors header included)."""
        return self.file_bytes / self.dense_bytes if self.dense_bytes else 1.0


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _storage_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    return (
        tensor.device,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tensor.stride(),
        tensor.dtype,
    )


def encode_state_dict(
    state_dict: Mapping[str, torch.Tensor], min_sparsity: float = DEFAULT_MIN_SPARSITY, compress: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Encode a state dict into the tensors and the per-tensor metadata of a sparse checkpoint.

    Args:
        state_dict: name -> tensor (any device); not modified.
        min_sparsity: the least fraction of zero entries for a 2-D floating tensor to be bitmask-encoded.
        compress: store the floating-point data (kept values, dense floating tensors) losslessly compressed
            (the entry's ``codec``, see the module docstring).

    Returns:
        ``(tensors, entries)``: the CPU tensors to write (``<name>``, or ``<name>.bitmask`` and ``<name>.values``)
        and name -> metadata entry (``shape``, ``dtype``, ``encoding``, and ``sparsity``/``nm``/``alias_of``).

    Raises:
        ValueError: ``min_sparsity`` outside ``[0, 1]``; a name that collides with another's stored name; a
            ``torch.nn.utils.prune`` re-parametrisation (``weight_orig``/``weight_mask``) still in place; a tensor
            of a dtype the format does not store.
    """
    if not isinstance(min_sparsity, (int, float)) or not 0.0 <= min_sparsity <= 1.0:
        raise ValueError(f"min_sparsity must be a number in [0, 1], got {min_sparsity!r}")
    if not isinstance(compress, bool):
        raise TypeError(f"compress must be True or False, got {compress!r}")
    leftover = [name for name in state_dict if name.endswith(("weight_orig", "weight_mask"))]
    if leftover:
        raise ValueError(
            f"the model still holds torch.nn.utils.prune re-parametrisations ({leftover[:3]}...); make the masks "
            "permanent first (torch.nn.utils.prune.remove(module, 'weight') on each pruned module)"
        )
    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, Any] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"state dict entry {name!r} is a {type(tensor).__name__}, not a tensor")
        if _dtype_name(tensor.dtype) not in _DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}, which the sparse format does not store")
        entry: dict[str, Any] = {"shape": list(tensor.shape), "dtype": _dtype_name(tensor.dtype)}
        key = _storage_key(tensor)
        if tensor.numel() > 0 and key in seen:
            entries[name] = entry | {"encoding": "alias", "alias_of": seen[key]}
            continue
        seen.setdefault(key, name)
        if should_encode(tensor, min_sparsity):
            bitmask, values, zero_signs = encode_bitmask(tensor)
            stored = {f"{name}.bitmask": bitmask, f"{name}.values": values}
            if zero_signs is not None:
                stored[f"{name}.zero_signs"] = zero_signs
            nm = nm_pattern(kept_mask(tensor.detach().cpu()))
            entry |= {
                "encoding": "bitmask",
                "sparsity": zero_fraction(tensor),
                "nm": list(nm) if nm else None,
                "zero_signs": zero_signs is not None,
            }
            if compress:
                stored[f"{name}.values"] = compress_planes(values)
                entry |= {"codec": CODEC, "values_numel": values.numel()}
        else:
            stored = {name: tensor.detach().cpu().contiguous()}
            entry |= {"encoding": "dense"}
            if compress and tensor.dtype.is_floating_point:
                stored[name] = compress_planes(stored[name])
                entry |= {"codec": CODEC}
        for stored_name, value in stored.items():
            if stored_name in tensors or (stored_name in state_dict and stored_name != name):
                raise ValueError(
                    f"tensor {name!r} would be stored as {stored_name!r}, which another tensor of the state dict "
                    "already uses; rename one of them"
                )
            tensors[stored_name] = value
        entries[name] = entry
    return tensors, entries


def _model_dtype(model: torch.nn.Module) -> torch.dtype | None:
    for param in model.parameters():
        if param.dtype.is_floating_point:
            return param.dtype
    return None


def _save_tokenizer(tokenizer: Any, directory: Path) -> None:
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(directory)
        return
    if not isinstance(tokenizer, (str, os.PathLike)) or not Path(tokenizer).is_dir():
        raise TypeError(
            f"tokenizer must be a tokenizer object (with save_pretrained) or a directory holding tokenizer files, "
            f"got {tokenizer!r}"
        )
    found = [name for name in TOKENIZER_FILES if (Path(tokenizer) / name).is_file()]
    if not found:
        raise ValueError(f"tokenizer directory {str(tokenizer)!r} holds none of the tokenizer files {TOKENIZER_FILES}")
    for name in found:
        shutil.copyfile(Path(tokenizer) / name, directory / name)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def write_sparse_files(
    model: torch.nn.Module,
    directory: str | os.PathLike[str],
    *,
    tokenizer: Any = None,
    min_sparsity: float = DEFAULT_MIN_SPARSITY,
    compress: bool = False,
) -> SparseSaveReport:
    """Write a sparse checkpoint's files into an existing directory, replacing files of the same names.

    Not atomic on its own: :func:`save_sparse` calls it on a temporary directory and renames that; the pruning job
    calls it on its staging directory.

    Args:
        model: the model (a transformers ``PreTrainedModel`` to write ``config.json``; any ``nn.Module`` otherwise,
            whose weights then load back only through :func:`read_sparse_state_dict`); not modified.
        directory: an existing directory.
        tokenizer: None, a tokenizer object (``save_pretrained`` is called), or a directory whose tokenizer files
            (:data:`TOKENIZER_FILES`) are copied.
        min_sparsity, compress: see :func:`encode_state_dict`.

    Returns:
        A :class:`SparseSaveReport`.

    Raises:
        ValueError, TypeError: see :func:`encode_state_dict`; a bad ``tokenizer``.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    tensors, entries = encode_state_dict(model.state_dict(), min_sparsity, compress)
    dtype = _model_dtype(model)
    metadata = {
        "format": FORMAT_NAME,
        "format_version": 2 if any("codec" in entry for entry in entries.values()) else 1,
        "bit_order": "little",
        "min_sparsity": min_sparsity,
        "model_class": type(model).__name__,
        "dtype": _dtype_name(dtype) if dtype is not None else None,
        "tensors": entries,
    }
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config = copy.deepcopy(config)
        config.architectures = [type(model).__name__]  # as save_pretrained records it (the model is not modified)
        config.save_pretrained(directory)
        generation = getattr(model, "generation_config", None)
        if generation is not None and hasattr(generation, "save_pretrained"):
            generation.save_pretrained(directory)
    if tokenizer is not None:
        _save_tokenizer(tokenizer, directory)
    path = directory / SPARSE_FILE
    save_file(tensors, str(path), metadata={METADATA_KEY: json.dumps(metadata)})
    _fsync_file(path)
    dense_bytes = 0
    for entry in entries.values():
        if entry["encoding"] != "alias":
            numel = 1
            for size in entry["shape"]:
                numel *= size
            dense_bytes += numel * _DTYPES[entry["dtype"]].itemsize
    encoded = {name: e["sparsity"] for name, e in entries.items() if e["encoding"] == "bitmask"}
    return SparseSaveReport(directory, encoded, path.stat().st_size, dense_bytes)


def is_sparse_checkpoint(directory: str | os.PathLike[str]) -> bool:
    """True when ``directory`` holds a :data:`SPARSE_FILE` whose header carries this format's metadata."""
    path = Path(directory) / SPARSE_FILE
    if not path.is_file():
        return False
    try:
        return _read_metadata(path).get("format") == FORMAT_NAME
    except ValueError:
        return False


def save_sparse(
    model: torch.nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    tokenizer: Any = None,
    min_sparsity: float = DEFAULT_MIN_SPARSITY,
    compress: bool = False,
) -> SparseSaveReport:
    """Save ``model`` as a self-contained sparse checkpoint directory, atomically.

    The files are written into a temporary directory next to ``out_dir``, fsynced, then renamed onto ``out_dir``:
    a failure leaves ``out_dir`` as it was. Replacing an earlier sparse save renames it aside first and removes it
    after the new one is in place (a crash between the two renames leaves both, as ``.<name>.*`` directories).

    Args:
        model: see :func:`write_sparse_files`. Modules swapped to :class:`~sparseswaps_prune.deploy.SparseLinear`
            are saved from their dense ``weight``.
        out_dir: the checkpoint directory: new, empty, or an earlier sparse save (which is replaced).
        tokenizer: see :func:`write_sparse_files`.
        min_sparsity, compress: see :func:`encode_state_dict` (``compress=True``: the kept values and the dense
            floating tensors losslessly compressed, a smaller file that is slower to write and read).

    Returns:
        A :class:`SparseSaveReport` (with ``path = out_dir``).

    Raises:
        FileExistsError: ``out_dir`` is a file, or a non-empty directory that is not a sparse save.
        ValueError, TypeError: see :func:`write_sparse_files`.

    Example:
        >>> report = save_sparse(model, "pruned-sparse", tokenizer=tokenizer)  # doctest: +SKIP
        >>> model = load_sparse("pruned-sparse")  # doctest: +SKIP
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"out_dir {str(out)!r} is a file; pass a directory path")
    replacing = out.is_dir() and any(out.iterdir())
    if replacing and not is_sparse_checkpoint(out):
        raise FileExistsError(
            f"out_dir {str(out)!r} is a non-empty directory that is not a sparse checkpoint (no {SPARSE_FILE} with "
            "its metadata); choose a new or empty directory, or remove it first"
        )
    parent = out.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        report = write_sparse_files(model, tmp, tokenizer=tokenizer, min_sparsity=min_sparsity, compress=compress)
        fsync_dir(tmp)
        if replacing:
            old = tmp.with_suffix(".old")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            if out.is_dir():
                out.rmdir()  # empty: renaming onto it is not portable
            os.replace(tmp, out)
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    report.path = out
    return report


def _read_metadata(path: Path) -> dict[str, Any]:
    """The format metadata of a sparse safetensors file; ``ValueError`` naming ``path`` if unreadable."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
    except Exception as err:  # safetensors raises its own SafetensorError (and OSError for I/O)
        raise ValueError(
            f"{path}: not a readable safetensors file ({err}); the file is truncated or corrupt, save it again"
        ) from err
    if METADATA_KEY not in header:
        raise ValueError(f"{path}: no {METADATA_KEY!r} metadata in the header; not a sparse checkpoint of this format")
    try:
        metadata = json.loads(header[METADATA_KEY])
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: the {METADATA_KEY!r} metadata is not valid JSON ({err})") from err
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT_NAME:
        raise ValueError(f"{path}: the {METADATA_KEY!r} metadata does not describe a {FORMAT_NAME!r} checkpoint")
    return metadata


def _parse_entry(path: Path, name: str, entry: Any) -> tuple[tuple[int, ...], torch.dtype, str]:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: metadata entry is not an object")
    shape, dtype, encoding = entry.get("shape"), entry.get("dtype"), entry.get("encoding")
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise ValueError(f"{where}: metadata shape {shape!r} is not a list of sizes")
    if dtype not in _DTYPES:
        raise ValueError(f"{where}: metadata dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    if encoding not in _ENCODINGS:
        raise ValueError(f"{where}: metadata encoding {encoding!r} is not one of {list(_ENCODINGS)}")
    if encoding == "bitmask" and len(shape) != 2:
        raise ValueError(f"{where}: a bitmask-encoded tensor must be 2-D, metadata shape is {shape}")
    codec = entry.get("codec")
    if codec is not None and (codec != CODEC or encoding == "alias"):
        raise ValueError(f"{where}: metadata codec {codec!r} is not {CODEC!r} on a dense or bitmask entry")
    numel = entry.get("values_numel")
    if codec is not None and encoding == "bitmask" and not (isinstance(numel, int) and numel >= 0):
        raise ValueError(f"{where}: a compressed bitmask entry needs values_numel, a count, got {numel!r}")
    return tuple(shape), _DTYPES[dtype], encoding


def read_sparse_state_dict(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Read and decode a sparse checkpoint into a dense state dict, checking every tensor first.

    Args:
        path: a sparse checkpoint directory, or its :data:`SPARSE_FILE`.

    Returns:
        name -> dense CPU tensor, in the saved order, bit for bit the saved model's; aliases (tied weights) are the
        same tensor object as their target.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is truncated or not a safetensors file, its metadata is missing or malformed, of a
            newer format version, or a tensor is missing, extra, or of the wrong dtype/shape/length; the message
            names the file and the tensor. Nothing is returned unless every tensor decodes.
    """
    return _read_checkpoint(Path(path), keep_encoded=frozenset())  # type: ignore[return-value]


def _read_checkpoint(
    path: Path, keep_encoded: frozenset[str] | set[str]
) -> dict[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
    """:func:`read_sparse_state_dict`, except that the bitmask-encoded tensors named in ``keep_encoded`` are checked
    but not decoded: they come back as ``(bitmask, values)``."""
    from safetensors import safe_open

    if path.is_dir():
        path = path / SPARSE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no sparse checkpoint file {str(path)!r}")
    metadata = _read_metadata(path)
    version = metadata.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ValueError(
            f"{path}: format_version {version!r} is not supported (this reader knows up to {FORMAT_VERSION}); "
            "upgrade sparseswaps-prune"
        )
    if metadata.get("bit_order") != "little":
        raise ValueError(f"{path}: bit_order {metadata.get('bit_order')!r} is not supported (only 'little')")
    entries = metadata.get("tensors")
    if not isinstance(entries, dict):
        raise ValueError(f"{path}: the metadata has no 'tensors' object")
    out: dict[str, torch.Tensor] = {}
    expected: set[str] = set()
    try:
        with safe_open(str(path), framework="pt") as f:
            stored = set(f.keys())

            def get(name: str, stored_name: str) -> torch.Tensor:
                if stored_name not in stored:
                    raise ValueError(f"{path}: tensor {name!r}: {stored_name!r} is missing from the file")
                try:
                    return f.get_tensor(stored_name)
                except Exception as err:
                    raise ValueError(f"{path}: tensor {name!r}: cannot read {stored_name!r} ({err})") from err

            for name, entry in entries.items():
                shape, dtype, encoding = _parse_entry(path, name, entry)
                if encoding == "alias":
                    continue
                codec = entry.get("codec")
                if encoding == "dense":
                    expected.add(name)
                    tensor = get(name, name)
                    if codec is not None:
                        numel = math.prod(shape)
                        tensor = decompress_planes(tensor, dtype, numel, f"{path}: tensor {name!r}").reshape(shape)
                    if tensor.dtype != dtype or tuple(tensor.shape) != shape:
                        raise ValueError(
                            f"{path}: tensor {name!r}: stored as {tensor.dtype} {tuple(tensor.shape)}, metadata says "
                            f"{dtype} {shape}"
                        )
                    out[name] = tensor
                else:
                    parts = ["bitmask", "values"] + (["zero_signs"] if entry.get("zero_signs") else [])
                    expected |= {f"{name}.{part}" for part in parts}
                    got = {part: get(name, f"{name}.{part}") for part in parts}
                    if codec is not None:
                        where = f"{path}: tensor {name!r} values"
                        got["values"] = decompress_planes(got["values"], dtype, entry["values_numel"], where)
                    args = (
                        got["bitmask"],
                        got["values"],
                        shape,
                        dtype,
                        f"{path}: tensor {name!r}",
                        got.get("zero_signs"),
                    )
                    if name in keep_encoded:
                        check_bitmask(*args)
                        out[name] = (got["bitmask"], got["values"])
                    else:
                        out[name] = decode_bitmask(*args)
    except ValueError:
        raise
    except Exception as err:
        raise ValueError(f"{path}: cannot be read ({err}); the file is truncated or corrupt") from err
    extra = sorted(stored - expected)
    if extra:
        raise ValueError(f"{path}: tensors {extra[:5]} are in the file but not in its metadata (a corrupt header)")
    result: dict[str, torch.Tensor] = {}
    for name, entry in entries.items():
        shape, dtype, encoding = _parse_entry(path, name, entry)
        if encoding != "alias":
            result[name] = out[name]
            continue
        target = entry.get("alias_of")
        if target not in out:
            raise ValueError(f"{path}: tensor {name!r}: alias_of {target!r} names no stored tensor")
        if isinstance(out[target], tuple) or tuple(out[target].shape) != shape or out[target].dtype != dtype:
            raise ValueError(f"{path}: tensor {name!r}: alias of {target!r} with another shape or dtype")
        result[name] = out[target]
    return result


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` reinterpreted as integers of its size (so that NaNs and signed zeros compare by their bits)."""
    if tensor.dtype == torch.bool or tensor.element_size() not in INT_OF_SIZE:
        return tensor
    return tensor.contiguous().view(INT_OF_SIZE[tensor.element_size()])


def load_sparse(
    path: str | os.PathLike[str],
    *,
    sparse: bool = False,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    **from_pretrained_kwargs: Any,
):
    """Load a sparse checkpoint as a transformers model: dense weights bit for bit the saved ones, or, with
    ``sparse=True``, :class:`~sparseswaps_prune.deploy.SparseLinear` layers built straight from the stored bitmasks.

    Every tensor is checked (and, for dense weights, decoded) before the model is built: nothing half-loaded.

    * ``sparse=False``: ``<model_class>.from_pretrained(None, config=..., state_dict=..., dtype=<saved dtype>)``
      builds the model, and every parameter and buffer is compared bit for bit with the decoded tensors.
    * ``sparse=True``: the model is built without initialising its weights, each bitmask-encoded float32/bfloat16
      ``nn.Linear`` weight becomes a ``SparseLinear`` (no dense copy of it ever exists, so the memory peaks at the
      sparse model's; a GPT-2 ``Conv1D`` is decoded first, one layer at a time), and the other tensors are
      assigned. Equivalent to ``sparsify(load_sparse(path),
      min_sparsity)`` for the layers the checkpoint encoded, without the dense peak.

    Args:
        path: the checkpoint directory.
        sparse: build ``SparseLinear`` layers (CPU inference) instead of dense weights.
        dtype: None for the saved dtype (every tensor bit for bit the saved one); another floating dtype casts the
            weights as ``from_pretrained(dense_save, dtype=dtype)`` casts a dense save of the same model (the tensors
            are then checked against the saved ones cast the same way). Not with ``sparse=True``.
        device: where to move the model (``"cpu"`` for ``sparse=True``).
        **from_pretrained_kwargs: more options for ``from_pretrained`` (or ``_from_config`` with ``sparse=True``),
            e.g. ``attn_implementation="eager"``; not ``config``, ``state_dict`` or ``torch_dtype``.

    Returns:
        The model, in eval mode. Its tokenizer, when saved, loads with ``AutoTokenizer.from_pretrained(path)``.

    Raises:
        FileNotFoundError: no checkpoint file, or no ``config.json`` (a checkpoint of a plain ``nn.Module``: use
            :func:`read_sparse_state_dict` and ``load_state_dict``).
        ValueError: see :func:`read_sparse_state_dict`; an unknown model class; a model whose parameters do not
            match the checkpoint's tensors; ``sparse=True`` with a device other than the CPU or with a ``dtype``
            other than the saved one.
        TypeError: a reserved keyword in ``from_pretrained_kwargs``; a ``dtype`` that is not a floating dtype.
    """
    from sparseswaps_prune.extras import require

    reserved = sorted({"config", "state_dict", "torch_dtype"} & set(from_pretrained_kwargs))
    if reserved:
        raise TypeError(f"load_sparse sets {reserved} itself; leave them out of its keyword arguments")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be None or a floating torch.dtype such as torch.float32, got {dtype!r}")
    if sparse and torch.device(device).type != "cpu":
        raise ValueError(f"sparse=True builds CPU modules (SparseLinear), got device={device!r}; use device='cpu'")
    directory = Path(path)
    metadata = _read_metadata(directory / SPARSE_FILE) if (directory / SPARSE_FILE).is_file() else None
    if metadata is None or not sparse:
        state = read_sparse_state_dict(directory)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(
            f"{directory} has no config.json (a checkpoint of a plain nn.Module); build the module yourself and call "
            "module.load_state_dict(read_sparse_state_dict(path))"
        )
    require("llm", "transformers")
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory)
    class_name = metadata.get("model_class")
    cls = getattr(transformers, class_name, None) if isinstance(class_name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        try:
            cls = AutoModelForCausalLM._model_mapping[type(config)]
        except KeyError as err:
            raise ValueError(
                f"{directory}: model class {class_name!r} is not a transformers model class and the config "
                f"({type(config).__name__}) has no causal-LM class; call read_sparse_state_dict and build it yourself"
            ) from err
    saved_dtype = _DTYPES.get(metadata.get("dtype") or "", None)
    cast = dtype is not None and dtype != saved_dtype
    if sparse:
        if cast:
            raise ValueError(
                f"sparse=True keeps the saved dtype ({saved_dtype}), got dtype={dtype}; drop dtype, or load densely"
            )
        return _build_sparse(directory, metadata, cls, config, saved_dtype, from_pretrained_kwargs)
    model = cls.from_pretrained(
        None, config=config, state_dict=state, dtype=dtype if cast else saved_dtype, **from_pretrained_kwargs
    )
    loaded = model.state_dict()
    missing, extra = sorted(set(state) - set(loaded)), sorted(set(loaded) - set(state))
    if missing or extra:
        raise ValueError(
            f"{directory}: {cls.__name__} does not match the checkpoint: tensors {missing[:5]} are not in the model "
            f"and model tensors {extra[:5]} are not in the checkpoint"
        )
    for name, tensor in state.items():
        got = loaded[name]
        if cast and tensor.is_floating_point() and got.is_floating_point():
            tensor = tensor.to(got.dtype)  # as from_pretrained casts it
        if got.dtype != tensor.dtype or got.shape != tensor.shape or not torch.equal(_bits(got.cpu()), _bits(tensor)):
            raise ValueError(
                f"{directory}: tensor {name!r} changed while {cls.__name__}.from_pretrained built the model "
                f"({tensor.dtype} -> {got.dtype}); load it with read_sparse_state_dict and load_state_dict(assign=True)"
            )
    return model.to(device)


def _build_sparse(directory: Path, metadata: dict[str, Any], cls: type, config: Any, dtype: Any, kwargs: dict):
    """``load_sparse(sparse=True)``: the model without initialised weights, SparseLinear layers from the stored
    bitmasks, the other tensors assigned."""
    from torch import nn
    from transformers.initialization import no_init_weights

    from sparseswaps_prune.deploy.linear import SparseLinear
    from sparseswaps_prune.modules import is_transposed

    with no_init_weights():
        model = cls._from_config(config, dtype=dtype, **kwargs)
    entries = metadata.get("tensors") if isinstance(metadata.get("tensors"), dict) else {}
    linears = {f"{name}.weight" for name, module in model.named_modules() if type(module) is nn.Linear}
    keep = {
        name
        for name, entry in entries.items()
        if name in linears and isinstance(entry, dict) and entry.get("encoding") == "bitmask"
        and entry.get("dtype") in ("float32", "bfloat16")
    }  # fmt: skip
    conv1d = {  # GPT-2 Conv1D stores [d_in, d_out]: decoded, then encoded by rows of its transpose
        f"{name}.weight"
        for name, module in model.named_modules()
        if is_transposed(module) and entries.get(f"{name}.weight", {}).get("encoding") == "bitmask"
        and entries[f"{name}.weight"].get("dtype") in ("float32", "bfloat16")
    }  # fmt: skip
    state = _read_checkpoint(directory / SPARSE_FILE, keep_encoded=keep)
    swaps = {}
    for name in sorted(keep | conv1d):
        prefix = name.removesuffix(".weight")
        bias = state.get(f"{prefix}.bias")
        if name in keep:
            bitmask, values = state[name]
            swaps[prefix] = SparseLinear.from_bitmask(bitmask, values, model.get_submodule(prefix).in_features, bias)
        else:
            swaps[prefix] = SparseLinear.from_dense(state[name], bias, transposed=True)
    rest = {
        name: tensor
        for name, tensor in state.items()
        if name.removesuffix(".weight").removesuffix(".bias") not in swaps or not name.endswith((".weight", ".bias"))
    }
    for prefix, sparse in swaps.items():
        parent, _, child = prefix.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, sparse)
    result = model.load_state_dict(rest, strict=False, assign=True)
    missing = sorted(set(result.missing_keys) - keep - conv1d)
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{directory}: {cls.__name__} does not match the checkpoint: model tensors {missing[:5]} are not in the "
            f"checkpoint and tensors {result.unexpected_keys[:5]} are not in the model"
        )
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()
