"""Tests for sparseswaps_prune.llm.capture on tiny random-weight models built from configs (no download)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from sparseswaps_prune.llm.capture import BlockInputs, call_block, capture_block_inputs
from sparseswaps_prune.llm.layers import group_by_input
from sparseswaps_prune.modules import find_blocks, find_layers, input_hooks

SEQLEN = 12
_DECODER = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
}
# sliding_window < SEQLEN so that sliding-window blocks really see a different mask than full-attention ones.
_CONFIGS = {
    "llama": (LlamaForCausalLM, lambda: LlamaConfig(**_DECODER)),
    "qwen2": (
        Qwen2ForCausalLM,
        lambda: Qwen2Config(**_DECODER, use_sliding_window=True, sliding_window=4, max_window_layers=1),
    ),
    "mistral": (MistralForCausalLM, lambda: MistralConfig(**_DECODER, sliding_window=4)),
    "gemma2": (Gemma2ForCausalLM, lambda: Gemma2Config(**_DECODER, head_dim=16, sliding_window=4)),
    "opt": (
        OPTForCausalLM,
        lambda: OPTConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128, vocab_size=512,
            word_embed_proj_dim=64,
        ),
    ),
    "gpt2": (
        GPT2LMHeadModel,
        lambda: GPT2Config(
            n_embd=64, n_layer=2, n_head=4, n_inner=128, vocab_size=512, n_positions=64, bos_token_id=0,
            eos_token_id=0,
        ),
    ),
}  # fmt: skip
_CASES = [(arch, attn) for arch in _CONFIGS for attn in ("eager", "sdpa") if (arch, attn) != ("gemma2", "sdpa")]


def tiny(arch: str, attn: str = "eager") -> PreTrainedModel:
    """A seeded 2-block random-weight model of ``arch`` with attention ``attn``, in eval mode."""
    model_cls, make_config = _CONFIGS[arch]
    config = make_config()
    config._attn_implementation = attn
    torch.manual_seed(0)
    return model_cls(config).eval()


def _tokens(n: int = 3) -> torch.Tensor:
    return torch.randint(0, 512, (n, SEQLEN), generator=torch.Generator().manual_seed(1))


def _reference(model: PreTrainedModel, blocks: nn.ModuleList, ids: torch.Tensor) -> list[torch.Tensor]:
    """[input of block 0, output of block 0, output of block 1, ...] from one ordinary forward."""
    seen: list[torch.Tensor] = []
    handles = [blocks[0].register_forward_pre_hook(lambda _m, args: seen.append(args[0]))]
    handles += [b.register_forward_hook(lambda _m, _a, out: seen.append(out)) for b in blocks]
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return seen


@pytest.mark.parametrize("batch_size", [1, 2])
@pytest.mark.parametrize(("arch", "attn"), _CASES)
def test_sequential_replay_reproduces_the_model(arch: str, attn: str, batch_size: int) -> None:
    model = tiny(arch, attn)
    _, blocks = find_blocks(model)
    ids = _tokens()
    reference = _reference(model, blocks, ids)
    originals = list(blocks)

    inputs = capture_block_inputs(model, blocks, ids, batch_size=batch_size)
    assert list(blocks) == originals
    assert inputs.num_batches == -(-3 // batch_size) and inputs.num_blocks == 2 and inputs.block_index == 0
    assert inputs.hidden_states.shape == (3, SEQLEN, 64)
    torch.testing.assert_close(inputs.hidden_states, reference[0], rtol=0, atol=1e-5)
    for k, block in enumerate(blocks):
        inputs = inputs.run_block(block, "cpu")
        assert inputs.block_index == k + 1
        torch.testing.assert_close(inputs.hidden_states, reference[k + 1], rtol=0, atol=1e-5)
    assert all("past_key_values" not in kw and kw.get("use_cache") in (None, False) for kw in inputs.block_kwargs[0])


def test_last_block_output_vs_output_hidden_states() -> None:
    """Transformers 5 ties hidden_states[-1] to the *normed* last hidden state; earlier entries are raw."""
    model = tiny("llama")
    _, blocks = find_blocks(model)
    ids = _tokens()
    with torch.no_grad():
        states = model(ids, output_hidden_states=True, use_cache=False).hidden_states
    inputs = capture_block_inputs(model, blocks, ids, batch_size=2)
    torch.testing.assert_close(inputs.hidden_states, states[0], rtol=0, atol=1e-5)
    inputs = inputs.run_block(blocks[0], "cpu")
    torch.testing.assert_close(inputs.hidden_states, states[1], rtol=0, atol=1e-5)
    inputs = inputs.run_block(blocks[1], "cpu")
    with torch.no_grad():
        torch.testing.assert_close(model.model.norm(inputs.hidden_states), states[2], rtol=0, atol=1e-5)


def test_kwargs_are_recorded_per_block() -> None:
    """Gemma2 alternates sliding-window and full attention: block 1 must not reuse block 0's mask."""
    model = tiny("gemma2")
    _, blocks = find_blocks(model)
    ids = _tokens()
    inputs = capture_block_inputs(model, blocks, ids, batch_size=3)
    first, second = inputs.block_kwargs[0]
    assert not torch.equal(first["attention_mask"], second["attention_mask"])
    assert first["position_embeddings"][0] is second["position_embeddings"][0]  # shared, stored once
    after_first = inputs.run_block(blocks[0], "cpu")
    with torch.no_grad():
        wrong = call_block(blocks[1], after_first.hidden_states, first)
    right = after_first.run_block(blocks[1], "cpu").hidden_states
    torch.testing.assert_close(right, _reference(model, blocks, ids)[2], rtol=0, atol=1e-5)
    assert (wrong - right).abs().max() > 1e-3


def test_feed_block_with_hooks_sees_every_token() -> None:
    model = tiny("llama", "sdpa")
    path, blocks = find_blocks(model)
    inputs = capture_block_inputs(model, blocks, _tokens(), batch_size=2)
    layers = find_layers(blocks[0], prefix=f"{path}.0")
    hidden, kwargs = next(inputs.batches("cpu"))
    groups = group_by_input(blocks[0], layers, hidden, **kwargs)
    grams: dict[str, torch.Tensor] = {}

    def accumulate(key: str, x: torch.Tensor) -> None:
        x2 = x.reshape(-1, x.shape[-1]).double()
        grams[key] = grams.get(key, 0) + x2.T @ x2

    with input_hooks(groups, accumulate):
        inputs.feed_block(blocks[0], "cpu")
    assert sorted(grams) == sorted(group[0].name for group in groups)
    normed = model.model.layers[0].input_layernorm(inputs.hidden_states).reshape(-1, 64).double().detach()
    torch.testing.assert_close(grams[f"{path}.0.self_attn.q_proj"], normed.T @ normed)


def test_capture_restores_blocks_on_error() -> None:
    model = tiny("llama")
    _, blocks = find_blocks(model)
    originals = list(blocks)

    def fail(*_args: object) -> None:
        raise RuntimeError("embedding failed")

    handle = model.model.rotary_emb.register_forward_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="embedding failed"):
            capture_block_inputs(model, blocks, _tokens())
    finally:
        handle.remove()
    assert list(blocks) == originals

    model.config.num_hidden_layers = 1  # the model loop now skips the last block
    with pytest.raises(ValueError, match=r"did not call blocks \[1\]"):
        capture_block_inputs(model, blocks, _tokens())
    assert list(blocks) == originals


def test_capture_rejects_bad_arguments() -> None:
    model = tiny("llama")
    _, blocks = find_blocks(model)
    with pytest.raises(TypeError, match="input_ids"):
        capture_block_inputs(model, blocks, _tokens().float())
    with pytest.raises(ValueError, match=r"shape \(12,\)"):
        capture_block_inputs(model, blocks, _tokens()[0])
    with pytest.raises(ValueError, match="batch_size=0"):
        capture_block_inputs(model, blocks, _tokens(), batch_size=0)
    with pytest.raises(TypeError, match=r"nn\.ModuleList"):
        capture_block_inputs(model, list(blocks), _tokens())  # type: ignore[arg-type]


def test_save_load_round_trip(tmp_path: Path) -> None:
    model = tiny("gemma2")
    _, blocks = find_blocks(model)
    inputs = capture_block_inputs(model, blocks, _tokens(), batch_size=2).run_block(blocks[0], "cpu")
    path = tmp_path / "block1.pt"
    path.write_bytes(b"older checkpoint")  # replaced atomically
    inputs.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["block1.pt"]
    loaded = BlockInputs.load(path)
    assert (loaded.block_index, loaded.batch_size, loaded.num_batches) == (1, 2, 2)
    assert torch.equal(loaded.hidden_states, inputs.hidden_states)
    for got_batch, want_batch in zip(loaded.block_kwargs, inputs.block_kwargs, strict=True):
        for got, want in zip(got_batch, want_batch, strict=True):
            assert got.keys() == want.keys()
            assert torch.equal(got["attention_mask"], want["attention_mask"])
            assert all(
                torch.equal(g, w) for g, w in zip(got["position_embeddings"], want["position_embeddings"], strict=True)
            )
        assert got_batch[0]["position_embeddings"][0] is got_batch[1]["position_embeddings"][0]
    torch.testing.assert_close(loaded.run_block(blocks[1], "cpu").hidden_states,
                               inputs.run_block(blocks[1], "cpu").hidden_states, rtol=0, atol=0)  # fmt: skip

    bad = tmp_path / "bad.pt"
    torch.save({"something": 1}, bad)
    with pytest.raises(ValueError, match="not a BlockInputs file"):
        BlockInputs.load(bad)


def test_block_inputs_validation_and_end() -> None:
    hidden = torch.zeros(3, 4, 8)
    with pytest.raises(ValueError, match="need 2"):
        BlockInputs(hidden, 2, [[{}]])
    with pytest.raises(ValueError, match="expected \\[n, seqlen, hidden\\]"):
        BlockInputs(torch.zeros(3, 8), 3, [[{}]])
    with pytest.raises(ValueError, match="block_index=2"):
        BlockInputs(hidden, 3, [[{}]], block_index=2)
    done = BlockInputs(hidden, 3, [[{}]], block_index=1)
    with pytest.raises(ValueError, match="past the last block"):
        next(done.batches("cpu"))


class _TupleBlock(nn.Module):
    """A block with a positional mask argument that returns ``(hidden, None)`` like older HF layers."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.proj = nn.Linear(8, 8)

    def forward(
        self, hidden_states: torch.Tensor, scale: torch.Tensor, use_cache: bool = True
    ) -> tuple[torch.Tensor, None]:
        if use_cache:
            raise RuntimeError("the capture and the replay must run with use_cache=False")
        return hidden_states + torch.tanh(self.proj(hidden_states)) * scale, None


class _TupleModel(nn.Module):
    """Toy LM whose loop passes arguments positionally, reads a block attribute and indexes [0]."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(_TupleBlock(kind) for kind in ("a", "b", "a"))
        self.scales = {"a": torch.tensor(0.5), "b": torch.tensor(2.0)}

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def forward(self, input_ids: torch.Tensor, use_cache: bool = True) -> torch.Tensor:
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, self.scales[layer.kind], use_cache)[0]
        return hidden


def test_tuple_returning_blocks_with_positional_args() -> None:
    torch.manual_seed(0)
    model = _TupleModel().eval()
    path, blocks = find_blocks(model)
    assert path == "layers"
    ids = torch.randint(0, 16, (5, 6))
    with torch.no_grad():
        expected = model(ids, use_cache=False)
    inputs = capture_block_inputs(model, blocks, ids, batch_size=2)
    recorded = inputs.block_kwargs[0][1]
    assert recorded.keys() == {"scale", "use_cache"} and recorded["use_cache"] is False
    assert torch.equal(recorded["scale"], model.scales["b"])
    for block in blocks:
        inputs = inputs.run_block(block, "cpu")
    torch.testing.assert_close(inputs.hidden_states, expected, rtol=0, atol=1e-6)
