"""Tests for sparseswaps_prune.llm.layers, and for block and layer discovery (sparseswaps_prune.modules.find_blocks,
find_layers) on real architectures, on tiny random-weight models built from configs (no download). The
model-independent parts are in tests/test_modules.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import PreTrainedModel

from sparseswaps_prune.llm.layers import group_by_input
from sparseswaps_prune.llm.models import TINY_ARCHS, tiny_model
from sparseswaps_prune.modules import find_blocks, find_layers, input_hooks

_LLAMA_LIKE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_EXPECTED = {
    "llama": (
        "model.layers",
        [f"self_attn.{n}" for n in _LLAMA_LIKE[:4]] + [f"mlp.{n}" for n in _LLAMA_LIKE[4:]],
    ),
    "opt": (
        "model.decoder.layers",
        ["self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj", "self_attn.out_proj", "fc1", "fc2"],
    ),
    "gpt2": ("transformer.h", ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]),
}
for _arch in ("qwen2", "mistral", "gemma2"):
    _EXPECTED[_arch] = _EXPECTED["llama"]


def tiny(arch: str) -> PreTrainedModel:
    """A seeded 2-block random-weight model of ``arch`` (hidden 64, MLP 128) with eager attention."""
    model = tiny_model(arch)
    model.config._attn_implementation = "eager"
    return model


def _block_call(model: PreTrainedModel, blocks: nn.ModuleList) -> tuple[tuple, dict]:
    """The (args, kwargs) with which ``model`` calls its first block on a small random batch."""
    recorded = {}

    def grab(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        recorded["call"] = (args, kwargs)

    handle = blocks[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model(torch.randint(0, 512, (2, 8)), use_cache=False)
    finally:
        handle.remove()
    return recorded["call"]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_find_blocks_and_layers(arch: str) -> None:
    model = tiny(arch)
    expected_path, expected_names = _EXPECTED[arch]
    path, blocks = find_blocks(model)
    assert path == expected_path
    assert blocks is model.get_submodule(expected_path)
    assert len(blocks) == 2
    for i, block in enumerate(blocks):
        layers = find_layers(block, prefix=f"{path}.{i}")
        assert [layer.name for layer in layers] == [f"{path}.{i}.{n}" for n in expected_names]
        for layer in layers:
            assert layer.module is model.get_submodule(layer.name)
            assert layer.weight_2d().shape == (layer.d_out, layer.d_in)


def test_gpt2_conv1d_dims() -> None:
    _, blocks = find_blocks(tiny("gpt2"))
    dims = [(layer.d_in, layer.d_out, layer.is_transposed) for layer in find_layers(blocks[0], prefix="")]
    assert dims == [(64, 192, True), (64, 64, True), (64, 128, True), (128, 64, True)]


def test_llama_dims() -> None:
    _, blocks = find_blocks(tiny("llama"))
    dims = {layer.name: (layer.d_in, layer.d_out) for layer in find_layers(blocks[0], prefix="")}
    assert dims["self_attn.q_proj"] == (64, 64)
    assert dims["self_attn.k_proj"] == (64, 32)  # 2 kv heads of 16
    assert dims["mlp.gate_proj"] == (64, 128)
    assert dims["mlp.down_proj"] == (128, 64)
    assert not find_layers(blocks[0], prefix="")[0].is_transposed


def test_find_blocks_override_and_errors() -> None:
    model = tiny("llama")
    path, blocks = find_blocks(model, blocks_path="model.layers")
    assert path == "model.layers" and blocks is model.model.layers
    with pytest.raises(ValueError, match=r"blocks_path='model\.nope'"):
        find_blocks(model, blocks_path="model.nope")
    with pytest.raises(TypeError, match=r"not an nn\.ModuleList"):
        find_blocks(model, blocks_path="model.norm")
    with pytest.raises(ValueError, match="blocks_path="):
        find_blocks(nn.Sequential(nn.Linear(2, 2)))


def test_find_blocks_skips_nested_lists() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(8))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mixed = nn.ModuleList([nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)])  # not homogeneous
            self.layers = nn.ModuleList(Block() for _ in range(3))

    path, blocks = find_blocks(Model())
    assert path == "layers" and len(blocks) == 3


@pytest.mark.parametrize("arch", ["llama", "gemma2", "opt"])
def test_group_by_input_shared_inputs(arch: str) -> None:
    model = tiny(arch)
    path, blocks = find_blocks(model)
    layers = find_layers(blocks[0], prefix=f"{path}.0")
    args, kwargs = _block_call(model, blocks)
    groups = group_by_input(blocks[0], layers, *args, **kwargs)
    short = [[layer.name.rsplit(".", 1)[1] for layer in group] for group in groups]
    if arch == "opt":
        assert short == [["k_proj", "v_proj", "q_proj"], ["out_proj"], ["fc1"], ["fc2"]]
    else:
        assert short == [["q_proj", "k_proj", "v_proj"], ["o_proj"], ["gate_proj", "up_proj"], ["down_proj"]]
    assert all(not layer.module._forward_pre_hooks for layer in layers)


def test_group_by_input_gpt2_and_uncalled_layers() -> None:
    model = tiny("gpt2")
    _, blocks = find_blocks(model)
    args, kwargs = _block_call(model, blocks)
    layers = find_layers(blocks[0], prefix="")
    assert [len(g) for g in group_by_input(blocks[0], layers, *args, **kwargs)] == [1, 1, 1, 1]
    other = find_layers(blocks[1], prefix="transformer.h.1")  # never called by block 0
    groups = group_by_input(blocks[0], layers[:1] + other, *args, **kwargs)
    expected = [[layers[0].name]] + [[layer.name] for layer in other]
    assert [[layer.name for layer in g] for g in groups] == expected


def test_input_hooks_groups_and_layers() -> None:
    model = tiny("llama")
    _, blocks = find_blocks(model)
    layers = find_layers(blocks[0], prefix="model.layers.0")
    args, kwargs = _block_call(model, blocks)
    groups = group_by_input(blocks[0], layers, *args, **kwargs)
    calls: list[tuple[str, tuple[int, ...]]] = []
    with input_hooks(groups, lambda key, x: calls.append((key, tuple(x.shape)))), torch.no_grad():
        blocks[0](*args, **kwargs)
    assert calls == [
        ("model.layers.0.self_attn.q_proj", (2, 8, 64)),
        ("model.layers.0.self_attn.o_proj", (2, 8, 64)),
        ("model.layers.0.mlp.gate_proj", (2, 8, 64)),
        ("model.layers.0.mlp.down_proj", (2, 8, 128)),
    ]
    calls.clear()
    with input_hooks(layers, lambda key, x: calls.append((key, tuple(x.shape)))), torch.no_grad():
        blocks[0](*args, **kwargs)
    assert [key for key, _ in calls] == [layer.name for layer in layers]
    assert all(not layer.module._forward_pre_hooks for layer in layers)
    with pytest.raises(ValueError, match="empty layer group"), input_hooks([[]], lambda key, x: None):
        pass
