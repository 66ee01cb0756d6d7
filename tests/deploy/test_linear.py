"""SparseLinear and sparsify: outputs equal the dense layer, greedy generation unchanged, clear errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sparseswaps_prune.deploy import SparseLinear, kernels, load_sparse, save_sparse, sparsify
from sparseswaps_prune.deploy.checkpoint import read_sparse_state_dict
from sparseswaps_prune.llm.models import TINY_ARCHS
from tests.deploy.conftest import assert_bit_equal, bits, prune_model


def pruned_linear(d_in, d_out, dtype=torch.float32, bias=True, seed=0):
    torch.manual_seed(seed)
    layer = nn.Linear(d_in, d_out, bias=bias).to(dtype)
    prune_model(layer, 0.6 if d_in > 1 else 0.0, seed=seed, negative_zeros=True)
    with torch.no_grad():
        layer.weight[0] = 0.0  # a row with nothing kept
    return layer


def close(a, b, dtype=torch.float32):
    scale = b.abs().max().item() or 1.0
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16 outputs are rounded to bf16
    assert (a.float() - b.float()).abs().max().item() <= tol * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d_in, d_out", [(1, 4), (13, 7), (64, 48)])
def test_forward_matches_the_dense_layer(dtype, d_in, d_out):
    dense = pruned_linear(d_in, d_out, dtype)
    sparse = SparseLinear.from_linear(dense)
    assert sparse.nnz == int((dense.weight != 0).sum()) and 0 < sparse.sparsity < 1
    with torch.inference_mode():
        for shape in [(1, d_in), (2, 3, d_in), (5, d_in), (16, d_in)]:
            x = torch.randn(shape).to(dtype)
            reference = (x.double() @ dense.weight.double().t() + dense.bias.double()).to(dtype)
            y = sparse(x)
            assert y.dtype == dtype and y.shape == (*shape[:-1], d_out)
            close(y, reference, dtype)
    assert torch.equal(bits(sparse.weight), bits(dense.weight + 0.0))  # pruned entries come back +0.0


def test_crossover_keep_dense_and_state_dict():
    dense = pruned_linear(40, 24)
    x = torch.randn(12, 40)
    with torch.inference_mode():
        reference = dense(x)
        for layer in (
            SparseLinear.from_linear(dense, crossover=4),
            SparseLinear.from_linear(dense, crossover=11, keep_dense=True),
        ):
            assert torch.equal(layer(x), reference)  # above the crossover: the dense matmul itself
        kernel_out = SparseLinear.from_linear(dense, crossover=16)(x)
    close(kernel_out, reference)
    sparse = SparseLinear.from_linear(dense)
    state = sparse.state_dict()
    assert list(state) == ["weight", "bias"] and torch.equal(state["weight"], dense.weight + 0.0)
    other = SparseLinear.from_linear(pruned_linear(40, 24, seed=1))
    other.load_state_dict(state)
    with torch.inference_mode():
        assert torch.equal(other(x[:2]), sparse(x[:2]))
    assert torch.equal(sparse.to_linear().weight, dense.weight + 0.0)
    with pytest.raises(RuntimeError, match="size mismatch"):
        other.load_state_dict({"weight": torch.zeros(3, 3), "bias": torch.zeros(24)})


def test_errors_name_the_problem():
    sparse = SparseLinear.from_linear(pruned_linear(8, 4))
    with pytest.raises(RuntimeError, match="inference-only"):
        sparse(torch.randn(2, 8, requires_grad=True))
    with torch.no_grad(), pytest.raises(ValueError, match="expected 8"):
        sparse(torch.randn(2, 9))
    with pytest.raises(ValueError, match="cast float16"):
        SparseLinear.from_dense(torch.zeros(2, 2, dtype=torch.float16))
    with pytest.raises(ValueError, match="row_ptr does not match the bitmask"):
        SparseLinear(sparse.bitmask, sparse.row_ptr + 1, sparse.values, 8)
    with pytest.raises(ValueError, match="crossover"):
        SparseLinear.from_linear(pruned_linear(8, 4), crossover=-1)


def test_forward_follows_replaced_buffers_and_kernel():
    """The kernel's cached views of the buffers are rebuilt when a buffer, the kernel or the device changes."""
    x = torch.randn(3, 40)
    first, second = pruned_linear(40, 24, seed=0), pruned_linear(40, 24, seed=1)
    sparse = SparseLinear.from_linear(first, kernel="portable")
    with torch.inference_mode():
        before = sparse(x)
        assert torch.allclose(before, first(x), atol=1e-5)
        sparse.load_state_dict(second.state_dict())
        after = sparse(x)
        assert torch.allclose(after, second(x), atol=1e-5) and not torch.allclose(after, before)
        sparse.kernel = kernels.default_kernel()
        assert sparse(x).shape == (3, 24) and sparse._arrays.kernel == kernels.default_kernel()
        half = SparseLinear.from_linear(first).half()
        with pytest.raises(ValueError, match="only float32 and bfloat16"):
            half(x)
        on_meta = SparseLinear.from_linear(first).to("meta")
        with pytest.raises(RuntimeError, match="weights on meta"):
            on_meta(x)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_generation_is_unchanged(tiny, tmp_path, arch):
    model = tiny(arch, negative_zeros=True)
    save_sparse(model, tmp_path / "ckpt")
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 253]])
    kwargs = {"max_new_tokens": 32, "min_new_tokens": 32, "do_sample": False, "use_cache": True, "pad_token_id": 2}
    with torch.inference_mode():
        dense_ids = model.generate(ids, **kwargs)
        dense_logits = model(dense_ids).logits
    state = {k: v.clone() for k, v in model.state_dict().items()}
    _, report = sparsify(model)
    converted = [n for n, m in model.named_modules() if isinstance(m, SparseLinear)]
    assert sorted(converted) == sorted(report.converted) and len(converted) >= 6
    if model.config.tie_word_embeddings:
        assert report.skipped == {"lm_head": "weight tied to another module"}
    with torch.inference_mode():
        sparse_ids = model.generate(ids, **kwargs)
        sparse_logits = model(dense_ids[:, :8]).logits
    # the token ids are identical; the logits agree to float32 rounding (the kernel sums in another order)
    assert torch.equal(sparse_ids, dense_ids)
    close(sparse_logits, dense_logits[:, :8])
    # straight from the checkpoint to SparseLinear layers: the same modules, the same outputs
    direct = load_sparse(tmp_path / "ckpt", sparse=True)
    assert sorted(n for n, m in direct.named_modules() if isinstance(m, SparseLinear)) == sorted(converted)
    with torch.inference_mode():
        assert torch.equal(direct(dense_ids[:, :8]).logits, sparse_logits)
        assert torch.equal(direct.generate(ids, **kwargs), dense_ids)
    assert_bit_equal({k: v + 0.0 if v.is_floating_point() else v for k, v in state.items()}, model.state_dict())


def test_sparsify_skips_with_reasons_and_saves(tmp_path):
    model = nn.Sequential(pruned_linear(16, 16), nn.Linear(16, 16), pruned_linear(16, 16).half(), pruned_linear(16, 16))
    torch.nn.utils.prune.l1_unstructured(model[3], "weight", amount=0.5)
    _, report = sparsify(model, 0.5)
    assert list(report.converted) == ["0"] and report.converted["0"] >= 0.5
    assert report.skipped["1"].startswith("sparsity 0.000 < min_sparsity 0.5")
    assert "float16" in report.skipped["2"] and "prune.remove" in report.skipped["3"]
    assert 0 < report.sparse_bytes < report.dense_bytes
    torch.nn.utils.prune.remove(model[3], "weight")
    save_sparse(model, tmp_path / "ckpt")  # a sparsified model saves from its dense weights
    assert torch.equal(read_sparse_state_dict(tmp_path / "ckpt")["0.weight"], model[0].weight)
    with pytest.raises(ValueError, match="backend='gpu' must be one of"):
        sparsify(model, backend="gpu")
    with pytest.raises(ValueError, match="sparse=True builds CPU modules"):
        load_sparse(tmp_path / "ckpt", sparse=True, device="meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_semi_structured_needs_cuda():
    with pytest.raises(RuntimeError, match="needs CUDA"):
        sparsify(nn.Linear(64, 64), backend="semi-structured")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.sparse semi-structured kernels)")
def test_semi_structured_on_cuda_matches_dense():
    layers = nn.Sequential(nn.Linear(256, 128), nn.Linear(128, 128)).half().cuda()
    prune_model(layers, nm=(2, 4))
    x = torch.randn(64, 256, dtype=torch.float16, device="cuda")
    with torch.inference_mode():
        reference = layers(x)
        _, report = sparsify(layers, backend="semi-structured")
        out = layers(x)
    assert sorted(report.converted) == ["0", "1"]
    close(out.float(), reference.float(), torch.bfloat16)
