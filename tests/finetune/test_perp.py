"""PERP parameter selection: biases, norms and adapters train; every weight is frozen."""

from __future__ import annotations

import pytest

from sparseswaps_prune.finetune import add_lora, attach_adapters, mark_trainable, parameter_groups
from tests.finetune.helpers import fresh_tiny, pruned_tiny

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def test_llama_norms_and_adapters():
    model, _ = pruned_tiny("llama")
    attach_adapters(model, "masklora", rank=2)
    selection = mark_trainable(model)
    assert selection.groups["bias"] == []  # llama linears have no bias
    assert selection.groups["norm"] == [
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.1.input_layernorm.weight",
        "model.layers.1.post_attention_layernorm.weight",
        "model.norm.weight",
    ]
    assert len(selection.groups["adapter"]) == 2 * 14
    assert all(name.endswith((".adapter_A", ".adapter_B")) for name in selection.groups["adapter"])
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(selection.names)
    assert selection.n_trainable == sum(p.numel() for p in selection.parameters)
    assert selection.n_total == sum(p.numel() for p in model.parameters())
    assert 0 < selection.fraction < 0.05
    groups = parameter_groups(model)
    assert groups["model.layers.0.mlp.up_proj.weight_orig"] == "other"
    assert groups["model.embed_tokens.weight"] == groups["lm_head.weight"] == "other"


def test_gpt2_biases_and_layernorms_without_adapters():
    model = fresh_tiny("gpt2")
    selection = mark_trainable(model, adapters=False)
    assert set(selection.groups["bias"]) == {
        f"transformer.h.{i}.{layer}.bias"
        for i in (0, 1)
        for layer in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    }
    assert set(selection.groups["norm"]) == {
        *(f"transformer.h.{i}.{ln}.{p}" for i in (0, 1) for ln in ("ln_1", "ln_2") for p in ("weight", "bias")),
        "transformer.ln_f.weight",
        "transformer.ln_f.bias",
    }
    assert not model.transformer.wte.weight.requires_grad and not model.transformer.h[0].mlp.c_fc.weight.requires_grad

    only_norms = mark_trainable(model, biases=False, adapters=False)
    assert only_norms.groups["bias"] == [] and not model.transformer.h[0].mlp.c_fc.bias.requires_grad


def test_peft_lora_parameters_count_as_adapters():
    model, _ = pruned_tiny("llama")
    peft_model = add_lora(model, rank=2, include=["*.q_proj"])
    selection = mark_trainable(peft_model, norms=False)
    assert len(selection.groups["adapter"]) == 4  # lora_A, lora_B of 2 layers
    assert all(".lora_" in name for name in selection.groups["adapter"])


def test_nothing_to_train_is_an_error_and_changes_nothing():
    model = fresh_tiny("llama")
    with pytest.raises(ValueError, match="nothing to train"):
        mark_trainable(model, norms=False)  # no biases, no adapters
    assert all(p.requires_grad for p in model.parameters())
    with pytest.raises(TypeError, match="biases must be a bool"):
        mark_trainable(model, biases=1)
