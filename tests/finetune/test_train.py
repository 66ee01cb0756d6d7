"""finetune_causal_lm: PERP in plain PyTorch on a pruned tiny Hugging Face model."""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils import prune

from sparseswaps_prune.finetune import adapted_modules, finetune_causal_lm
from tests.finetune.helpers import counting_ids, pruned_tiny

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


@pytest.mark.parametrize(
    ("arch", "adapter"), [("llama", "masklora"), ("gpt2", "scalelora"), ("gpt2", "lora"), ("llama", "none")]
)
def test_lowers_the_training_loss_and_keeps_the_sparsity(arch, adapter):
    model, masks = pruned_tiny(arch)
    windows = counting_ids(16, seed=1)
    result = finetune_causal_lm(
        model, windows, steps=12, lr=2e-2, batch_size=4, adapter=adapter, rank=4, progress=False
    )
    assert len(result.losses) == 12 and result.adapter == adapter
    assert sum(result.losses[-3:]) / 3 < result.losses[0] - 0.05
    assert result.model is model and adapted_modules(model) == []
    assert result.adapted == ([] if adapter == "none" else list(masks))
    assert 0 < result.n_trainable < result.n_total and result.seconds > 0
    for name, mask in masks.items():
        layer = model.get_submodule(name)
        weight = layer.weight_orig * layer.weight_mask if prune.is_pruned(layer) else layer.weight
        assert prune.is_pruned(layer) == (adapter != "lora")  # peft LoRA makes pruning permanent
        assert torch.equal(weight != 0, mask)
    assert not model.training  # mode restored


def test_unmerged_lora_returns_the_peft_model():
    model, _ = pruned_tiny("llama")
    result = finetune_causal_lm(model, counting_ids(4), steps=1, adapter="lora", merge=False, progress=False)
    assert type(result.model).__name__ == "PeftModel"


@pytest.mark.parametrize(
    ("windows", "kwargs", "error", "match"),
    [
        (counting_ids(4).float(), {}, TypeError, "integer torch.Tensor"),
        (counting_ids(4)[0], {}, ValueError, r"\[N >= 1, seqlen >= 2\]"),
        (counting_ids(4), {"adapter": "dora"}, ValueError, "unknown adapter"),
        (counting_ids(4), {"steps": 0}, ValueError, "steps must be a positive int"),
        (counting_ids(4), {"steps": 2.5}, TypeError, "steps must be a positive int"),
        (counting_ids(4), {"lr": -1.0}, ValueError, "lr must be > 0"),
        (counting_ids(4), {"adapter": "none", "biases": False, "norms": False}, ValueError, "trains nothing"),
        (counting_ids(4), {"rank": 0}, ValueError, "rank must be >= 1"),
    ],
)
def test_bad_arguments_leave_the_model_alone(windows, kwargs, error, match):
    model, _ = pruned_tiny("llama")
    with pytest.raises(error, match=match):
        finetune_causal_lm(model, windows, progress=False, **kwargs)
    assert adapted_modules(model) == [] and all(p.requires_grad for p in model.parameters())
