"""The safetensors file format as the block-wise path reads and writes it: file names, dtype codes, the size of a
tensor, and a checked reader of a file's header (:func:`read_safetensors_header`)."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DTYPE_CODES",
    "FLOAT_CODES",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "read_safetensors_header",
    "tensor_bytes",
]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

# The safetensors dtype code of each torch dtype the writer stores.
DTYPE_CODES: dict[torch.dtype, str] = {
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
        DTYPE_CODES[getattr(torch, _name)] = _code
# Bytes per element of every safetensors dtype this reader accepts, and those of them that hold floating-point values
# (what a model's floating parameters may be stored in: ``from_pretrained`` casts them to the model's dtype).
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8}  # fmt: skip
FLOAT_CODES = {code for dtype, code in DTYPE_CODES.items() if dtype.is_floating_point}


def tensor_bytes(dtype: torch.dtype, shape: Iterable[int]) -> int:
    """Bytes of a tensor of ``dtype`` and ``shape`` as safetensors stores it."""
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=dtype).element_size()


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
