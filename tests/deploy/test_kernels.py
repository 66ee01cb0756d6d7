"""The CPU kernels against a float64 dense reference: empty rows, one input, ragged tails, batches, both dtypes."""

from __future__ import annotations

import ctypes
import mmap
import sys

import numba
import numpy as np
import pytest
import torch

from sparseswaps_prune.deploy import kernels
from sparseswaps_prune.deploy.linear import SparseLinear

AVAILABLE = ["portable"] + (["avx2"] if kernels.default_kernel() == "avx2" else [])
SHAPES = [(5, 1), (3, 8), (7, 13), (33, 100), (64, 64), (10, 255)]


def encoded(weight):
    """(bitmask, row_ptr, values) numpy arrays of a float32/bf16 weight, through SparseLinear.from_dense."""
    layer = SparseLinear.from_dense(weight)
    values = layer.values
    values = values.view(torch.int16).numpy().view(np.uint16) if values.dtype == torch.bfloat16 else values.numpy()
    return layer.bitmask.numpy(), layer.row_ptr.numpy(), values


def random_weight(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(shape, generator=gen) * (torch.rand(shape, generator=gen) > 0.6)
    weight[0] = 0.0  # a row with nothing kept
    return weight.to(dtype)


def check(out, x, weight):
    ref = x.double() @ weight.double().t()
    scale = max(1.0, ref.abs().max().item())
    assert out.dtype == np.float32 and out.shape == tuple(ref.shape)
    assert np.abs(out - ref.numpy()).max() <= 1e-5 * scale


@pytest.mark.parametrize("kernel", AVAILABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_dense(kernel, dtype, shape):
    weight = random_weight(shape, dtype, seed=shape[0] * 1000 + shape[1])
    bitmask, row_ptr, values = encoded(weight)
    for batch in (1, 2, 3, 4, 5, 8, 16):
        x = torch.randn(batch, shape[1], generator=torch.Generator().manual_seed(batch))
        check(kernels.spmm(bitmask, row_ptr, values, x.numpy(), kernel=kernel), x, weight)


@pytest.mark.parametrize("kernel", AVAILABLE)
def test_parallel_path_and_empty_weights(kernel, monkeypatch):
    monkeypatch.setattr(kernels, "PARALLEL_MIN_WORK", 0)
    previous = numba.get_num_threads()
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    try:
        weight = random_weight((37, 70), torch.float32, seed=3)
        bitmask, row_ptr, values = encoded(weight)
        x = torch.randn(6, 70)
        check(kernels.spmm(bitmask, row_ptr, values, x.numpy(), kernel=kernel), x, weight)
        zero = torch.zeros(4, 9)
        check(kernels.spmm(*encoded(zero), x[:, :9].numpy(), kernel=kernel), x[:, :9], zero)
    finally:
        numba.set_num_threads(previous)


def test_densify_is_exact_and_inputs_are_checked(monkeypatch):
    weight = random_weight((9, 21), torch.bfloat16, seed=5)
    bitmask, row_ptr, values = encoded(weight)
    dense = kernels.densify(bitmask, row_ptr, values, 21)
    assert np.array_equal(dense.view(np.int16), (weight + 0.0).view(torch.int16).numpy())  # -0.0 comes back +0.0
    x = np.zeros((1, 21), np.float32)
    with pytest.raises(ValueError, match="kernel='sse' must be one of"):
        kernels.spmm(bitmask, row_ptr, values, x, kernel="sse")
    with pytest.raises(ValueError, match="8 entries of padding"):
        kernels.spmm(bitmask, row_ptr, values[:-8], x)
    with pytest.raises(ValueError, match=r"x must be \[batch, cols <= 24\]"):
        kernels.spmm(bitmask, row_ptr, values, np.zeros((1, 25), np.float32))
    monkeypatch.setenv("SPARSESWAPS_SPARSE_KERNEL", "portable")
    kernels.default_kernel.cache_clear()
    try:
        assert kernels.default_kernel() == "portable"
        monkeypatch.setenv("SPARSESWAPS_SPARSE_KERNEL", "gpu")
        kernels.default_kernel.cache_clear()
        with pytest.raises(ValueError, match="SPARSESWAPS_SPARSE_KERNEL='gpu'"):
            kernels.default_kernel()
    finally:
        monkeypatch.delenv("SPARSESWAPS_SPARSE_KERNEL")
        kernels.default_kernel.cache_clear()


def guarded(values, at_end):
    """A copy of ``values`` in anonymous memory between two inaccessible pages, starting right after the first one
    (or, ``at_end``, ending right before the second one): a read outside the array faults."""
    page = mmap.PAGESIZE
    pages = -(-values.nbytes // page)
    buf = mmap.mmap(-1, (pages + 2) * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    for start in (base, base + (pages + 1) * page):
        assert libc.mprotect(ctypes.c_void_p(start), ctypes.c_size_t(page), 0) == 0  # PROT_NONE
    offset = page + (pages * page - values.nbytes if at_end else 0)
    copy = np.frombuffer(buf, dtype=values.dtype, count=values.size, offset=offset)
    copy[:] = values
    return copy


@pytest.mark.skipif(sys.platform != "linux", reason="mprotect through libc")
@pytest.mark.parametrize("kernel", AVAILABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("at_end", [False, True])
def test_kernel_reads_only_inside_values(kernel, dtype, at_end):
    # rows starting within the first 8 values (the avx2 kernel's window reaches back up to 8 values), and the last
    # row's values ending at the array's 8 padding entries
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(6, 77, generator=gen) * (torch.rand(6, 77, generator=gen) > 0.5)
    weight[0] = 0.0
    weight[1] = 0.0
    weight[2, 3:] = 0.0  # rows 1-3 start at values 0, 0 and at most 3
    weight = weight.to(dtype)
    bitmask, row_ptr, values = encoded(weight)
    values = guarded(values, at_end)
    for batch in (1, 2, 4, 7):
        x = torch.randn(batch, 77, generator=gen)
        check(kernels.spmm(bitmask, row_ptr, values, x.numpy(), kernel=kernel), x, weight)


@pytest.mark.parametrize("kernel", AVAILABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_mask_byte(kernel, dtype):
    # row 1 holds the mask bytes 0..255 in order, row 2 in reverse (each byte after each other pattern of popcounts)
    bits = torch.arange(256).unsqueeze(1).bitwise_right_shift(torch.arange(8)).bitwise_and(1).bool().reshape(-1)
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(3, 2048, generator=gen) * torch.stack([bits, bits, bits.reshape(256, 8).flip(0).reshape(-1)])
    weight = weight.to(dtype)
    bitmask, row_ptr, values = encoded(weight)
    assert bitmask[1].tolist() == list(range(256))
    for batch in (1, 2, 4):
        x = torch.randn(batch, 2048, generator=gen)
        check(kernels.spmm(bitmask, row_ptr, values, x.numpy(), kernel=kernel), x, weight)
