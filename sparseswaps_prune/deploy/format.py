"""The bitmask encoding of a sparse 2-D weight: pure tensor functions, no files, no modules.

A ``[rows, cols]`` weight is stored as two tensors, plus a third when it holds negative zeros:

* ``bitmask``: ``uint8 [rows, ceil(cols / 8)]``, row-major, one bit per weight, set where the weight is *kept*
  (``!= 0``; a NaN is kept). Bits are packed little-endian within a byte: column ``c`` of row ``r`` is bit ``c % 8``
  (value ``1 << (c % 8)``) of ``bitmask[r, c // 8]``, i.e. ``numpy.packbits(kept, axis=1, bitorder="little")``
  (the layout of compressed-tensors' legacy ``sparse-bitmask`` format). The padding bits of a row's last byte are 0.
* ``values``: the kept weights, 1-D, in row-major order, in the weight's own dtype (bit for bit).
* ``zero_signs`` (only when some pruned entry is ``-0.0``, as ``weight * mask`` and ``torch.nn.utils.prune`` leave
  for negative weights): the sign bits of the pruned entries, in row-major order over the pruned entries only,
  packed the same way (``uint8 [ceil(n_pruned / 8)]``). It costs ``sparsity`` bits per weight, so that decoding gives
  back every bit of the weight; without it the pruned entries decode as ``+0.0``.

A weight qualifies for the encoding (:func:`should_encode`) when it is a 2-D floating-point tensor with at least
``min_sparsity`` of its entries equal to zero (``+0.0`` or ``-0.0``); :data:`DEFAULT_MIN_SPARSITY` is 0.3, below which
the 1-bit-per-weight mask buys little (at sparsity ``s`` the encoding takes ``1/16 + (1 - s)`` of the dense bf16 bytes
and ``1/32 + (1 - s)`` of the fp32 ones, plus ``s/16`` or ``s/32`` for zero signs).

N:M patterns use the same encoding: a bitmask costs 1 bit per weight, while values plus in-group ``uint8`` indices
cost ``8 N / M`` bits per weight (4 at 2:4), so the bitmask is the smaller one; :func:`nm_pattern` records which
N:M pattern a mask satisfies, for readers (and :func:`~sparseswaps_prune.deploy.linear.sparsify`'s semi-structured
backend) that want it.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = [
    "DEFAULT_MIN_SPARSITY",
    "ENCODABLE_DTYPES",
    "NM_PATTERNS",
    "check_bitmask",
    "decode_bitmask",
    "encode_bitmask",
    "kept_mask",
    "nm_pattern",
    "packed_width",
    "row_counts",
    "should_encode",
    "zero_fraction",
]

DEFAULT_MIN_SPARSITY = 0.3
"""Least fraction of bit-for-bit zero entries for a 2-D weight to be stored as bitmask + values."""

NM_PATTERNS = ((2, 4), (4, 8))
"""N:M patterns :func:`nm_pattern` recognises, tried in this order."""

ENCODABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""Weight dtypes the bitmask encoding accepts."""


def packed_width(cols: int) -> int:
    """Bytes of one bitmask row of a weight with ``cols`` columns: ``ceil(cols / 8)``."""
    return (cols + 7) // 8


def kept_mask(weight: torch.Tensor) -> torch.Tensor:
    """Where ``weight`` is kept: ``weight != 0`` (``+0.0`` and ``-0.0`` are pruned, a NaN is kept).

    Args:
        weight: a floating-point tensor, on any device.

    Returns:
        A bool tensor shaped like ``weight``, on its device.
    """
    return weight != 0


def zero_fraction(weight: torch.Tensor) -> float:
    """Fraction of the entries of ``weight`` equal to zero (``+0.0`` or ``-0.0``; 0.0 for an empty tensor)."""
    if weight.numel() == 0:
        return 0.0
    return 1.0 - kept_mask(weight).sum().item() / weight.numel()


def should_encode(tensor: torch.Tensor, min_sparsity: float = DEFAULT_MIN_SPARSITY) -> bool:
    """The encoding rule: a non-empty 2-D tensor of a dtype in :data:`ENCODABLE_DTYPES` with at least
    ``min_sparsity`` of its entries equal to zero.

    Args:
        tensor: any tensor (e.g. an entry of a state dict).
        min_sparsity: threshold in ``[0, 1]``.

    Returns:
        True when ``tensor`` is to be stored as bitmask + values.
    """
    return (
        tensor.dim() == 2
        and tensor.dtype in ENCODABLE_DTYPES
        and tensor.numel() > 0
        and zero_fraction(tensor) >= min_sparsity
    )


def encode_bitmask(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Encode a 2-D weight as ``(bitmask, values, zero_signs)`` (see the module docstring for the layout).

    Args:
        weight: ``[rows, cols]`` tensor of a dtype in :data:`ENCODABLE_DTYPES`; not modified.

    Returns:
        ``(bitmask, values, zero_signs)``: ``uint8 [rows, ceil(cols / 8)]``, the kept values ``[n_kept]`` in
        ``weight.dtype``, and ``uint8 [ceil(n_pruned / 8)]`` sign bits of the pruned entries or None when none of
        them is ``-0.0``; new contiguous CPU tensors.

    Raises:
        ValueError: ``weight`` is not 2-D or not of an encodable dtype.
    """
    if weight.dim() != 2 or weight.dtype not in ENCODABLE_DTYPES:
        raise ValueError(
            f"encode_bitmask needs a 2-D tensor of dtype {[str(d) for d in ENCODABLE_DTYPES]}, got shape "
            f"{tuple(weight.shape)} and dtype {weight.dtype}"
        )
    weight = weight.detach().cpu().contiguous()
    kept = kept_mask(weight)
    bitmask = torch.from_numpy(np.packbits(kept.numpy(), axis=1, bitorder="little"))
    if bitmask.shape[1] == 0:  # packbits of a [rows, 0] array keeps no column
        bitmask = torch.zeros(weight.shape[0], 0, dtype=torch.uint8)
    signs = torch.signbit(weight[~kept])
    zero_signs = torch.from_numpy(np.packbits(signs.numpy(), bitorder="little")) if bool(signs.any()) else None
    return bitmask, weight[kept].contiguous(), zero_signs


def _check(condition: bool, what: str, name: str) -> None:
    if not condition:
        raise ValueError(f"{name}: {what}")


_POPCOUNT = torch.tensor([bin(byte).count("1") for byte in range(256)], dtype=torch.int64)


def row_counts(bitmask: torch.Tensor) -> torch.Tensor:
    """Set bits per row of a uint8 ``[rows, nbytes]`` bitmask, int64 ``[rows]`` (on the CPU)."""
    bitmask = bitmask.cpu()
    counts = torch.zeros(bitmask.shape[0], dtype=torch.int64)
    for start in range(0, bitmask.shape[1], 256):  # bounded temporaries: rows x 256 int64 at a time
        counts += _POPCOUNT[bitmask[:, start : start + 256].long()].sum(dim=1)
    return counts


def check_bitmask(
    bitmask: torch.Tensor,
    values: torch.Tensor,
    shape: tuple[int, int],
    dtype: torch.dtype,
    name: str = "tensor",
    zero_signs: torch.Tensor | None = None,
) -> int:
    """Check that ``bitmask``, ``values`` and ``zero_signs`` encode a weight of ``shape`` and ``dtype``, without
    decoding it.

    Args:
        bitmask: ``uint8 [rows, ceil(cols / 8)]``.
        values: 1-D kept values of ``dtype``, one per set bit.
        shape: ``(rows, cols)`` of the weight.
        dtype: the weight's dtype.
        name: the tensor's name, for error messages.
        zero_signs: ``uint8 [ceil(n_pruned / 8)]`` sign bits of the pruned entries, or None (all ``+0.0``).

    Returns:
        The number of kept entries.

    Raises:
        ValueError: a bitmask of another dtype or shape, padding bits set, values of another dtype or rank, as many
            values as set bits not matching, or zero signs of another dtype or length; the message starts with
            ``name``.
    """
    rows, cols = shape
    width = packed_width(cols)
    _check(bitmask.dtype == torch.uint8, f"bitmask has dtype {bitmask.dtype}, expected torch.uint8", name)
    _check(
        tuple(bitmask.shape) == (rows, width),
        f"bitmask has shape {tuple(bitmask.shape)}, expected {(rows, width)} for a weight of shape {(rows, cols)}",
        name,
    )
    _check(values.dtype == dtype, f"values have dtype {values.dtype}, expected {dtype}", name)
    _check(values.dim() == 1, f"values have shape {tuple(values.shape)}, expected a 1-D tensor", name)
    packed = bitmask.cpu().numpy()
    if cols % 8 and rows:
        _check(not (packed[:, -1] >> (cols % 8)).any(), f"bitmask has padding bits set past column {cols}", name)
    count = int(row_counts(bitmask).sum())
    _check(
        values.numel() == count,
        f"{values.numel()} values for {count} set bits in the bitmask (a truncated or mismatched tensor)",
        name,
    )
    if zero_signs is not None:
        pruned = rows * cols - count
        _check(zero_signs.dtype == torch.uint8, f"zero_signs have dtype {zero_signs.dtype}, expected torch.uint8", name)
        _check(
            tuple(zero_signs.shape) == ((pruned + 7) // 8,),
            f"zero_signs have shape {tuple(zero_signs.shape)}, expected {((pruned + 7) // 8,)} for {pruned} pruned "
            "entries",
            name,
        )
        if pruned % 8:
            _check(not int(zero_signs[-1]) >> (pruned % 8), "zero_signs have padding bits set", name)
    return count


def decode_bitmask(
    bitmask: torch.Tensor,
    values: torch.Tensor,
    shape: tuple[int, int],
    dtype: torch.dtype,
    name: str = "tensor",
    zero_signs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rebuild the dense weight from its ``bitmask``, ``values`` and ``zero_signs``, after :func:`check_bitmask`.

    Args:
        bitmask, values, shape, dtype, name, zero_signs: see :func:`check_bitmask`.

    Returns:
        The dense ``[rows, cols]`` CPU tensor of ``dtype``, bit for bit the encoded weight.

    Raises:
        ValueError: see :func:`check_bitmask`.
    """
    count = check_bitmask(bitmask, values, shape, dtype, name, zero_signs)
    rows, cols = shape
    bits = np.unpackbits(bitmask.cpu().numpy(), axis=1, bitorder="little")
    kept = torch.from_numpy(bits[:, :cols].astype(bool))
    dense = torch.zeros(rows, cols, dtype=dtype)
    dense[kept] = values.cpu()
    if zero_signs is not None:
        pruned = rows * cols - count
        signs = np.unpackbits(zero_signs.cpu().numpy(), bitorder="little")[:pruned]
        fill = torch.zeros(pruned, dtype=dtype)
        fill[torch.from_numpy(signs.astype(bool))] = -0.0
        dense[~kept] = fill
    return dense


def nm_pattern(kept: torch.Tensor) -> tuple[int, int] | None:
    """The first N:M pattern of :data:`NM_PATTERNS` that a kept-mask satisfies along its rows.

    Args:
        kept: bool ``[rows, cols]`` (True = kept).

    Returns:
        ``(n, m)`` when every group of ``m`` consecutive columns of every row keeps at most ``n``, else None (also
        when ``cols`` is not a multiple of ``m``).
    """
    rows, cols = kept.shape
    for n, m in NM_PATTERNS:
        if cols % m == 0 and cols > 0 and bool((kept.reshape(rows, cols // m, m).sum(dim=2) <= n).all()):
            return n, m
    return None
