"""The lossless byte-plane codec of compressed sparse checkpoints: exact round trips, a smaller stream for weights,
and a clear error (never a wrong tensor) for a stream that is not what the metadata says."""

from __future__ import annotations

import zlib

import pytest
import torch

from sparseswaps_prune.deploy.codec import CODEC, compress_planes, decompress_planes
from tests.deploy.conftest import bits

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool]  # fmt: skip


def sample(dtype: torch.dtype, n: int = 777) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(n, generator=generator) > 0.5
    if not dtype.is_floating_point:
        low = 0 if dtype == torch.uint8 else -100
        return torch.randint(low, 100, (n,), generator=generator, dtype=dtype)
    x = (torch.randn(n, generator=generator) * 0.02).to(dtype)
    x[:4] = torch.tensor([float("nan"), float("inf"), -0.0, float("-inf")]).to(dtype)
    return x


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_is_bit_identical_for_every_stored_dtype(dtype):
    x = sample(dtype)
    stream = compress_planes(x.reshape(7, -1))
    assert stream.dtype == torch.uint8 and stream.dim() == 1
    back = decompress_planes(stream, dtype, x.numel(), "t")
    assert back.dtype == dtype and back.shape == (x.numel(),)
    assert torch.equal(bits(back), bits(x))
    empty = decompress_planes(compress_planes(x[:0]), dtype, 0, "t")
    assert empty.dtype == dtype and empty.numel() == 0


def test_planes_hold_each_byte_significance_together():
    x = torch.tensor([0x04030201, 0x08070605], dtype=torch.int32)
    assert list(zlib.decompress(compress_planes(x).numpy().tobytes())) == [1, 5, 2, 6, 3, 7, 4, 8]


@pytest.mark.parametrize(("dtype", "limit"), [(torch.float32, 0.95), (torch.bfloat16, 0.8)])
def test_weights_compress_below_their_bytes(dtype, limit):
    """A layer's weights span a few binades: their exponent byte compresses, unlike the weights' bytes in order."""
    x = (torch.randn(65536, generator=torch.Generator().manual_seed(1)) * 0.02).to(dtype)
    planes = compress_planes(x).numel()
    in_order = len(zlib.compress(x.view(torch.uint8).numpy().tobytes(), 6))
    assert planes < limit * x.numel() * x.element_size()
    assert planes < 0.97 * in_order


def test_a_wrong_stream_is_an_error_naming_the_tensor():
    x = sample(torch.float32)
    stream = compress_planes(x)
    with pytest.raises(ValueError, match=rf"f.bin: tensor 'w': the {CODEC} stream holds 3108 bytes .*= 3112 expected"):
        decompress_planes(stream, torch.float32, x.numel() + 1, "f.bin: tensor 'w'")
    with pytest.raises(ValueError, match="holds more than 3104 bytes"):
        decompress_planes(stream, torch.float32, x.numel() - 1, "t")
    with pytest.raises(ValueError, match="or is cut short"):
        decompress_planes(stream[:-8], torch.float32, x.numel(), "t")
    broken = stream.clone()
    broken[2:40] ^= 0x5A
    with pytest.raises(ValueError, match=rf"t: the {CODEC} stream"):
        decompress_planes(broken, torch.float32, x.numel(), "t")
    with pytest.raises(ValueError, match="must be uint8"):
        decompress_planes(stream.float(), torch.float32, x.numel(), "t")
    with pytest.raises(ValueError, match="trailing"):
        decompress_planes(torch.cat([stream, stream[:4]]), torch.float32, x.numel(), "t")
