"""MaskLoRA / ScaleLoRA adapters on tiny llama (nn.Linear) and GPT-2 (Conv1D) models, pruned or not."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch.nn.utils import prune

from sparseswaps_prune.core.spec import build_spec
from sparseswaps_prune.finetune import (
    AdapterHook,
    adapted_modules,
    adapter_mask,
    attach_adapters,
    effective_weight,
    mark_trainable,
    merge_adapters,
)
from sparseswaps_prune.llm.pipeline import PruneOptions, prune_model
from sparseswaps_prune.modules import find_layers
from sparseswaps_prune.recipes import RECIPES
from tests.finetune.helpers import counting_ids, fresh_tiny, pruned_tiny, weight_2d

ARCHS = ["llama", "gpt2"]
KINDS = ["masklora", "scalelora"]

REFIT = RECIPES["sparseswaps-refit"].spec  # Wanda -> SparseSwaps T=10 -> least-squares re-fit


def train_steps(model, ids, steps: int = 4, lr: float = 1e-2) -> list[float]:
    selection = mark_trainable(model)
    optimizer = torch.optim.AdamW(selection.parameters, lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", KINDS)
def test_zero_initialised_adapters_change_nothing_and_add_no_linear(arch, kind):
    model, _ = pruned_tiny(arch)
    ids = counting_ids(2)
    before = model(input_ids=ids).logits
    modules_before = [name for name, _ in model.named_modules()]
    layers_before = [layer.name for layer in find_layers(model, prefix="")]
    names = attach_adapters(model, kind, rank=4)
    assert len(names) == 7 * 2 if arch == "llama" else 4 * 2
    assert torch.equal(model(input_ids=ids).logits, before)
    assert [name for name, _ in model.named_modules()] == modules_before  # no submodule added
    assert [layer.name for layer in find_layers(model, prefix="")] == layers_before  # pruning finds the same
    module = model.get_submodule(names[0])
    hook = module._sparse_adapter
    assert isinstance(hook, AdapterHook) and hook.kind == kind and hook.scale == 1.0
    d_out, d_in = weight_2d(module, module.weight).shape
    assert module.adapter_A.shape == (4, d_in) and module.adapter_B.shape == (d_out, 4)
    assert bool((module.adapter_B == 0).all()) and bool((module.adapter_A != 0).any())
    assert "adapter_mask" not in module.state_dict()  # non-persistent


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("permanent", [False, True], ids=["reparam", "permanent"])
def test_training_keeps_zeros_and_merge_is_exact(arch, kind, permanent):
    model, masks = pruned_tiny(arch, permanent=permanent)
    ids = counting_ids(4)
    attach_adapters(model, kind, rank=4, alpha=8)
    losses = train_steps(model, ids)
    assert losses[-1] != losses[0]
    for name, mask in masks.items():
        module = model.get_submodule(name)
        assert torch.equal(adapter_mask(module), mask)
        effective = effective_weight(module)
        assert bool((module.adapter_B != 0).any())
        assert bool((effective[~weight_2d(module, mask)] == 0).all())  # zeros kept while training
    trained = model(input_ids=ids).logits

    assert sorted(merge_adapters(model)) == sorted(masks)
    assert adapted_modules(model) == []
    assert torch.allclose(model(input_ids=ids).logits, trained, atol=1e-4, rtol=1e-4)
    for name, mask in masks.items():
        module = model.get_submodule(name)
        assert not hasattr(module, "adapter_A") and not hasattr(module, "_sparse_adapter")
        assert not module._forward_hooks
        assert prune.is_pruned(module) != permanent  # a reparametrized layer stays reparametrized
        weight = module.weight_orig * module.weight_mask if not permanent else module.weight
        assert torch.equal(weight != 0, mask)  # exactly the zeros pruning left


@pytest.mark.parametrize("kind", KINDS)
def test_pruning_after_attaching_is_followed(kind):
    """Attach to the dense model (as before Trainer.fit), prune with a reparametrization, then make it
    permanent: the adapter uses weight_mask, then the zeros of the weight."""
    model = fresh_tiny("llama")
    ids = counting_ids(4)
    names = attach_adapters(model, kind, rank=2, include=["*.mlp.up_proj"])
    assert names == ["model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj"]
    module = model.get_submodule(names[0])
    assert bool(adapter_mask(module).all())
    mask = torch.rand(module.weight.shape, generator=torch.Generator().manual_seed(0)) > 0.3
    prune.custom_from_mask(module, "weight", mask)
    train_steps(model, ids, steps=2)
    assert torch.equal(effective_weight(module) != 0, mask)
    prune.remove(module, "weight")
    assert torch.equal(adapter_mask(module), mask)
    merge_adapters(model)
    assert torch.equal(module.weight != 0, mask)


def test_pipeline_prunes_the_linears_not_the_adapters():
    model = fresh_tiny("llama")
    attach_adapters(model, "masklora", rank=4)
    options = PruneOptions(spec=build_spec(REFIT, sparsity=0.5, max_iters=2))
    result = prune_model(model, counting_ids(2), options, progress=False)
    assert len(result.layers) == 14 and not any("adapter" in report.name for report in result.layers)
    train_steps(model, counting_ids(4), steps=2)
    merge_adapters(model)
    for name, mask in result.masks.items():
        assert torch.equal(model.get_submodule(name).weight_mask.bool(), mask)
        assert torch.equal(effective_weight(model.get_submodule(name)) != 0, mask)


def test_deepcopy_and_pickle_keep_working_adapters():
    model, masks = pruned_tiny("gpt2")
    ids = counting_ids(2)
    attach_adapters(model, "masklora", rank=2)
    train_steps(model, ids, steps=2)
    buffer = io.BytesIO()
    torch.save(model, buffer)  # whole-model pickling, as ddp_spawn does
    buffer.seek(0)
    for clone in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        assert torch.equal(clone(input_ids=ids).logits, model(input_ids=ids).logits)
        merge_adapters(clone)
        assert adapted_modules(clone) == [] and len(adapted_modules(model)) == len(masks)
        assert all(not clone.get_submodule(n)._forward_hooks for n in masks)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"kind": "dora"}, ValueError, "unknown adapter kind"),
        ({"rank": 0}, ValueError, "rank must be >= 1"),
        ({"rank": 2.0}, TypeError, "rank must be an int"),
        ({"alpha": "16"}, TypeError, "alpha"),
        ({"include": "*.q_proj"}, TypeError, "list of fnmatch patterns"),
        ({"include": ["*.nothing"]}, ValueError, "no nn.Linear/Conv1D"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    model = fresh_tiny("llama")
    with pytest.raises(error, match=match):
        attach_adapters(model, **kwargs)
    assert adapted_modules(model) == []


def test_attaching_twice_and_reading_a_plain_layer_are_errors():
    model = fresh_tiny("llama")
    attach_adapters(model, include=["*.q_proj"])
    with pytest.raises(ValueError, match="already have an adapter"):
        attach_adapters(model, include=["*.q_proj", "*.k_proj"])
    with pytest.raises(ValueError, match="has no adapter"):
        adapter_mask(model.model.layers[0].self_attn.k_proj)
    assert merge_adapters(fresh_tiny("llama")) == []
