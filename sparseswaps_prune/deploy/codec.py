"""Lossless compression of a checkpoint's stored tensors: byte planes, then zlib. Pure functions, no files.

A weight's bytes compress poorly as they lie, but its bytes of one significance do not: the byte holding the sign
and the high exponent bits takes a few values (the weights of a layer span a few binades), while the low mantissa
bytes are close to random. Grouping byte ``i`` of every element together (a byte plane, lowest byte first; the
elements' little-endian bytes) before zlib lets its Huffman codes take each plane's statistics: the exponent byte
shrinks to a fraction, the mantissa bytes stay about as they are. The same idea as ZipNN (Hershcovitch et al. 2024)
and DFloat11 (Zhang et al. 2025, Huffman codes of bfloat16 exponents), with the standard library's zlib instead of a
dedicated coder, so reading needs nothing more.

``CODEC`` names the layout in a checkpoint's metadata: the stored tensor is ``uint8 [n]``, the zlib stream (RFC 1950,
its Adler-32 checksum included) of the planes one after another. Decoding checks the exact decompressed length and
stops reading one byte past it (a corrupt or hostile stream cannot expand without bound), so a wrong stream is an
error naming the tensor, never a wrong weight.
"""

from __future__ import annotations

import sys
import zlib

import numpy as np
import torch

__all__ = ["CODEC", "COMPRESS_LEVEL", "INT_OF_SIZE", "compress_planes", "decompress_planes"]

CODEC = "zlib-planes"
"""The metadata name of the layout: byte planes of the elements' little-endian bytes, one zlib stream."""

COMPRESS_LEVEL = 6
"""zlib's level. The stream uses zlib's run-length strategy (``Z_RLE``: Huffman codes plus runs of one byte): on
byte planes of weights it is smaller and several times faster than the default strategy, whose searches for repeated
strings find nothing in mantissa bytes (``zlib.decompress`` reads every strategy)."""

INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The integer dtype of each element size: a tensor viewed as it moves (or compares) its bits unchanged."""

_NUMPY = {torch.float32: np.int32, torch.float64: np.int64, torch.bfloat16: np.int16, torch.float16: np.int16}
_NUMPY |= {torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.uint8}
_NUMPY |= {torch.uint8: np.uint8, torch.bool: np.uint8}
"""Each storable dtype's integer twin of its size in numpy (the bits are moved, never converted)."""


def _planes(tensor: torch.Tensor) -> np.ndarray:
    """``uint8 [itemsize, numel]``: byte ``i`` (little-endian) of every element in row ``i``."""
    bits = tensor.detach().cpu().contiguous().reshape(-1).view(_int_dtype(tensor.dtype)).numpy()
    if sys.byteorder != "little":
        bits = bits.byteswap()
    return bits.view(np.uint8).reshape(-1, tensor.element_size()).T


def _int_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in _NUMPY:
        raise ValueError(f"the {CODEC} codec does not store {dtype}")
    return INT_OF_SIZE[dtype.itemsize]


def compress_planes(tensor: torch.Tensor, level: int = COMPRESS_LEVEL) -> torch.Tensor:
    """The :data:`CODEC` stream of ``tensor`` (any shape, a dtype of the checkpoint format; not modified) as
    ``uint8 [n]``. :func:`decompress_planes` with its dtype and element count gives it back bit for bit (1-D)."""
    encoder = zlib.compressobj(level, zlib.DEFLATED, zlib.MAX_WBITS, 9, zlib.Z_RLE)
    stream = encoder.compress(np.ascontiguousarray(_planes(tensor)).data) + encoder.flush()
    return torch.frombuffer(bytearray(stream), dtype=torch.uint8)


def decompress_planes(stream: torch.Tensor, dtype: torch.dtype, numel: int, where: str) -> torch.Tensor:
    """The 1-D ``dtype`` tensor of ``numel`` elements that :func:`compress_planes` stored in ``stream``.

    Raises:
        ValueError: ``stream`` is not ``uint8 [n]``, not a zlib stream, or does not hold exactly ``numel`` elements'
            bytes; the message starts with ``where`` (the file and tensor).
    """
    if stream.dtype != torch.uint8 or stream.dim() != 1:
        raise ValueError(f"{where}: a {CODEC} stream must be uint8 [n], got {stream.dtype} {tuple(stream.shape)}")
    size = numel * dtype.itemsize
    decoder = zlib.decompressobj()
    try:
        raw = decoder.decompress(stream.contiguous().numpy().tobytes(), size + 1)
    except zlib.error as err:
        raise ValueError(f"{where}: the {CODEC} stream is corrupt ({err}); save the checkpoint again") from None
    if len(raw) != size or not decoder.eof:
        got = f"{len(raw)} bytes" if len(raw) <= size else f"more than {size} bytes"
        raise ValueError(
            f"{where}: the {CODEC} stream holds {got} (or is cut short), {numel} x {dtype.itemsize} = {size} expected; "
            "the file is corrupt, save the checkpoint again"
        )
    if decoder.unused_data:
        raise ValueError(f"{where}: the {CODEC} stream has trailing bytes after its end; the file is corrupt")
    itemsize = dtype.itemsize
    bits = np.frombuffer(raw, dtype=np.uint8).reshape(itemsize, numel).T.copy().view(_NUMPY[dtype]).reshape(-1)
    if sys.byteorder != "little":
        bits = bits.byteswap()
    return torch.from_numpy(bits).view(_int_dtype(dtype)).view(dtype)
