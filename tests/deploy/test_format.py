"""The bitmask encoding: exact round trips (signed zeros, NaN, ragged widths), N:M detection, clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparseswaps_prune.deploy.format import (
    decode_bitmask,
    encode_bitmask,
    nm_pattern,
    packed_width,
    should_encode,
    zero_fraction,
)
from tests.deploy.conftest import bits, random_mask

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 1), (3, 8), (7, 13), (16, 64), (4, 0)])
def test_round_trip_is_bit_exact(dtype, shape):
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(shape, generator=gen).to(dtype)
    if weight.numel():
        weight[torch.rand(shape, generator=gen) < 0.6] = 0.0
        weight[0] = 0.0  # a row with nothing kept
        flat = weight.view(-1)
        flat[-1] = -0.0  # a negative zero, pruned
        if flat.numel() > 2:
            flat[1] = float("nan")
            flat[2] = float("-inf")
    bitmask, values, zero_signs = encode_bitmask(weight)
    assert bitmask.dtype == torch.uint8 and bitmask.shape == (shape[0], packed_width(shape[1]))
    assert values.dtype == dtype and values.numel() == int((weight != 0).sum())
    assert (zero_signs is not None) == bool(weight.numel())
    decoded = decode_bitmask(bitmask, values, shape, dtype, zero_signs=zero_signs)
    assert torch.equal(bits(decoded), bits(weight))


def test_bit_order_is_numpy_packbits_little():
    weight = torch.zeros(2, 10)
    weight[0, 0] = 1.0  # bit 0 of byte 0
    weight[0, 9] = 2.0  # bit 1 of byte 1
    weight[1, 7] = 3.0  # bit 7 of byte 0
    bitmask, values, zero_signs = encode_bitmask(weight)
    assert bitmask.tolist() == [[1, 2], [128, 0]]
    assert values.tolist() == [1.0, 2.0, 3.0] and zero_signs is None
    kept = (weight != 0).numpy()
    assert np.array_equal(bitmask.numpy(), np.packbits(kept, axis=1, bitorder="little"))


def test_without_zero_signs_negative_zeros_decode_as_positive():
    weight = torch.tensor([[-0.0, 1.0, 0.0]])
    bitmask, values, zero_signs = encode_bitmask(weight)
    assert zero_signs.tolist() == [1]  # first pruned entry negative, second positive
    plain = decode_bitmask(bitmask, values, (1, 3), torch.float32)
    assert torch.equal(bits(plain), bits(torch.tensor([[0.0, 1.0, 0.0]])))


def test_rule_and_nm_pattern():
    gen = torch.Generator().manual_seed(0)
    keep = random_mask((8, 64), 0.0, gen, nm=(2, 4))
    assert nm_pattern(keep) == (2, 4)
    keep48 = torch.tensor([True] * 4 + [False] * 4).repeat(8, 8)  # 4:8, and 4 of the first 4: not 2:4
    assert nm_pattern(keep48) == (4, 8)
    assert nm_pattern(random_mask((8, 64), 0.3, gen)) is None
    assert nm_pattern(torch.ones(2, 6, dtype=torch.bool)) is None  # 6 columns: no 4- or 8-groups
    weight = torch.randn(10, 10)
    weight[:, :3] = 0.0
    assert zero_fraction(weight) == pytest.approx(0.3)
    assert should_encode(weight, 0.3) and not should_encode(weight, 0.31)
    assert not should_encode(weight[0], 0.0)  # 1-D
    assert not should_encode(weight.to(torch.int32), 0.0)
    assert not should_encode(torch.zeros(0, 4), 0.0)


def test_decode_errors_name_the_tensor():
    weight = torch.randn(4, 12)
    weight[:, ::2] = 0.0
    bitmask, values, _ = encode_bitmask(weight)
    with pytest.raises(ValueError, match=r"^layer\.w: 23 values for 24 set bits"):
        decode_bitmask(bitmask, values[:-1], (4, 12), torch.float32, name="layer.w")
    with pytest.raises(ValueError, match="bitmask has shape"):
        decode_bitmask(bitmask, values, (4, 20), torch.float32, name="layer.w")
    with pytest.raises(ValueError, match="values have dtype"):
        decode_bitmask(bitmask, values.double(), (4, 12), torch.float32, name="layer.w")
    with pytest.raises(ValueError, match="bitmask has dtype"):
        decode_bitmask(bitmask.to(torch.int16), values, (4, 12), torch.float32, name="layer.w")
    padded = bitmask.clone()
    padded[0, 1] |= 0x80  # column 15 of a 12-column weight
    with pytest.raises(ValueError, match="padding bits"):
        decode_bitmask(padded, torch.cat([values, values[:1]]), (4, 12), torch.float32, name="layer.w")
    with pytest.raises(ValueError, match="zero_signs have shape"):
        decode_bitmask(bitmask, values, (4, 12), torch.float32, zero_signs=torch.zeros(2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="encode_bitmask needs a 2-D"):
        encode_bitmask(torch.zeros(3))
