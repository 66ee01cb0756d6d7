"""Plain peft LoRA on a pruned model: merged in the right order, the sparsity is exactly what pruning left."""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils import prune

from sparseswaps_prune.finetune import add_lora, attach_adapters, merge_lora_keep_sparsity
from tests.finetune.helpers import counting_ids, fresh_tiny, pruned_tiny, weight_2d

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def randomise_lora_b(peft_model) -> None:
    """Stand-in for training: a nonzero B, so that the merged update is dense."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("permanent", [False, True], ids=["reparam", "permanent"])
def test_merge_keeps_exact_sparsity(arch, permanent):
    model, masks = pruned_tiny(arch, permanent=permanent)
    dense = {n: model.get_submodule(n).weight.detach().clone() for n in masks}  # already masked
    peft_model = add_lora(model, rank=2, alpha=4)
    randomise_lora_b(peft_model)
    expected = {}
    for name in masks:
        lora = peft_model.base_model.model.get_submodule(name)
        update = lora.scaling["default"] * (lora.lora_B["default"].weight @ lora.lora_A["default"].weight)
        layer_update = weight_2d(lora.get_base_layer(), update)  # [d_out, d_in] -> the parameter layout
        expected[name] = (dense[name] + layer_update) * masks[name]

    merged = merge_lora_keep_sparsity(peft_model)
    assert merged is model and not any("lora" in name for name, _ in merged.named_modules())
    for name, mask in masks.items():
        layer = merged.get_submodule(name)
        assert not prune.is_pruned(layer)  # made permanent before merging
        assert torch.equal(layer.weight != 0, mask)  # exactly the zeros pruning left
        assert torch.allclose(layer.weight, expected[name], atol=1e-6)
    merged(input_ids=counting_ids(2))  # runs as a plain model


def test_merging_without_the_glue_loses_the_update():
    """Why the order matters: peft adds B A to `weight`, which the pruning pre-hook then recomputes."""
    model, _ = pruned_tiny("llama")
    ids = counting_ids(2)
    pruned_logits = model(input_ids=ids).logits
    peft_model = add_lora(model, rank=2)
    randomise_lora_b(peft_model)
    naive = peft_model.merge_and_unload()
    assert torch.equal(naive(input_ids=ids).logits, pruned_logits)  # the update is gone


def test_bad_inputs():
    with pytest.raises(TypeError, match=r"peft\.PeftModel"):
        merge_lora_keep_sparsity(fresh_tiny("llama"))
    with pytest.raises(ValueError, match="rank must be >= 1"):
        add_lora(fresh_tiny("llama"), rank=0)
    model = fresh_tiny("llama")
    attach_adapters(model, include=["*.q_proj"])
    with pytest.raises(ValueError, match="merge_adapters"):
        add_lora(model)
