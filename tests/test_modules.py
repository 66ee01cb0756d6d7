"""Tests for sparseswaps_prune.modules: layer discovery, input hooks and pruning masks on plain modules."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import prune

from sparseswaps_prune.modules import (
    PrunableLayer,
    apply_mask,
    check_patterns,
    find_layers,
    input_hooks,
    is_transposed,
    linear_types,
    restore_masks,
)

_ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
_MLP = ["gate_proj", "up_proj", "down_proj"]


def _conv1d_class() -> type[nn.Module]:
    return pytest.importorskip("transformers.pytorch_utils").Conv1D


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for name in _ATTN:
            setattr(self, name, nn.Linear(8, 8))


class _MLPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)


class _Block(nn.Module):
    """Llama-like names: ``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj`` and a norm."""

    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(8)
        self.self_attn = _Attention()
        self.mlp = _MLPBlock()


def test_find_layers_include_exclude() -> None:
    block = _Block()
    names = [layer.name for layer in find_layers(block, prefix="model.layers.1")]
    assert names == [f"model.layers.1.self_attn.{n}" for n in _ATTN] + [f"model.layers.1.mlp.{n}" for n in _MLP]
    names = [layer.name for layer in find_layers(block, prefix="model.layers.1", include=["*.self_attn.*"])]
    assert names == [f"model.layers.1.self_attn.{n}" for n in _ATTN]
    names = [layer.name for layer in find_layers(block, prefix="model.layers.1", exclude=["*.mlp.*", "*.o_proj"])]
    assert names == [f"model.layers.1.self_attn.{n}" for n in _ATTN[:3]]
    names = [
        layer.name
        for layer in find_layers(block, prefix="model.layers.1", include=["*_proj"], exclude=["*.self_attn.*"])
    ]
    assert names == [f"model.layers.1.mlp.{n}" for n in _MLP]
    assert [layer.name for layer in find_layers(block, prefix="", include=["mlp.*"])] == [f"mlp.{n}" for n in _MLP]
    assert find_layers(block, prefix="model.layers.1", include=["model.layers.0.*"]) == []
    with pytest.raises(TypeError, match="include='\\*q_proj'"):
        find_layers(block, prefix="", include="*q_proj")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="exclude"):
        find_layers(block, prefix="", exclude=[3])  # type: ignore[list-item]


def test_check_patterns() -> None:
    assert check_patterns(None, "include") is None
    assert check_patterns(("*.q_proj",), "include") == ["*.q_proj"]
    with pytest.raises(TypeError, match=r"exclude='x' must be a list of fnmatch patterns"):
        check_patterns("x", "exclude")  # type: ignore[arg-type]


def test_conv1d_is_found_and_transposed() -> None:
    conv1d = _conv1d_class()
    assert conv1d in linear_types()
    model = nn.Sequential(conv1d(nf=6, nx=4), nn.ReLU(), nn.Linear(6, 3))
    layers = find_layers(model, prefix="")
    assert [(layer.name, layer.is_transposed, layer.d_in, layer.d_out) for layer in layers] == [
        ("0", True, 4, 6),
        ("2", False, 6, 3),
    ]
    assert is_transposed(model[0]) and not is_transposed(model[2])


def test_conv1d_weight_2d_is_the_linear_map() -> None:
    torch.manual_seed(0)
    conv = _conv1d_class()(nf=7, nx=5)
    nn.init.normal_(conv.bias)
    layer = PrunableLayer("c", conv)
    assert (layer.d_in, layer.d_out) == (5, 7)
    x = torch.randn(3, 4, 5)
    w2d = layer.weight_2d()
    assert w2d.shape == (7, 5)
    torch.testing.assert_close(x @ w2d.T + conv.bias, conv(x), rtol=1e-6, atol=1e-6)
    mask = torch.rand(7, 5) > 0.5
    assert torch.equal(layer.to_param_layout(mask), mask.T)
    expected = (w2d * mask).T.clone()
    w2d.mul_(mask)  # a view: writes go to the parameter
    assert torch.equal(conv.weight.data, expected)


def test_linear_weight_2d_and_layout() -> None:
    linear = nn.Linear(5, 7)
    layer = PrunableLayer("l", linear)
    assert layer.weight_2d().data_ptr() == linear.weight.data_ptr()
    mask = torch.ones(7, 5, dtype=torch.bool)
    assert layer.to_param_layout(mask) is mask
    with pytest.raises(ValueError, match=r"expected \[d_out, d_in\] = \[7, 5\]"):
        layer.to_param_layout(torch.ones(5, 7))


def test_input_hooks_see_inputs_and_are_removed_when_fn_or_body_raises() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    layers = find_layers(model, prefix="")
    x = torch.randn(3, 4)
    seen: dict[str, torch.Tensor] = {}
    with input_hooks(layers, seen.__setitem__), torch.no_grad():
        model(x)
    assert seen["0"] is x and seen["2"].shape == (3, 6)

    def boom(key: str, x: torch.Tensor) -> None:
        raise RuntimeError(f"boom in {key}")

    with pytest.raises(RuntimeError, match="boom in 0"), input_hooks(layers, boom), torch.no_grad():
        model(x)
    assert all(not layer.module._forward_pre_hooks for layer in layers)
    with pytest.raises(KeyError), input_hooks(layers, lambda key, x: None):
        raise KeyError("body")
    assert all(not layer.module._forward_pre_hooks for layer in layers)
    with pytest.raises(ValueError, match="empty layer group"), input_hooks([[]], lambda key, x: None):
        pass


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_apply_mask_replaces_the_mask_and_weights(kind: str) -> None:
    torch.manual_seed(0)
    module = nn.Linear(5, 7) if kind == "linear" else _conv1d_class()(nf=7, nx=5)
    layer = PrunableLayer("m", module)
    dense = layer.weight_2d().clone()
    first = torch.rand(7, 5) > 0.5
    apply_mask(layer, first)
    assert prune.is_pruned(module)
    assert torch.equal(layer.weight_2d(), dense * first)
    second = ~first  # replaced, not combined with the first mask
    refit = torch.randn(7, 5)
    apply_mask(layer, second, refit)
    assert torch.equal(layer.weight_2d(), refit * second)
    assert torch.equal(layer.dense_weight_2d(), refit)
    assert torch.equal(module.weight_mask.bool(), layer.to_param_layout(second))


def test_restore_masks_keeps_parameter_order() -> None:
    source = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    apply_mask(PrunableLayer("0", source[0]), torch.rand(3, 4) > 0.5)
    state = source.state_dict()
    target = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    order = [name for name, _ in target.named_parameters()]
    assert restore_masks(target, state) == ["0"]
    assert [name for name, _ in target.named_parameters()] == [n.replace("0.weight", "0.weight_orig") for n in order]
    target.load_state_dict(state)  # strict
    x = torch.randn(2, 4)
    torch.testing.assert_close(target(x), source(x), rtol=0, atol=0)  # the pruning hook recomputes the weight
    assert restore_masks(target, state) == []  # already pruned: left alone
