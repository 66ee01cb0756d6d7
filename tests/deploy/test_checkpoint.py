"""Sparse checkpoints: bit-identical round trips, size, atomic and refusing writes, clear errors on bad files."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from sparseswaps_prune.deploy import (
    SPARSE_FILE,
    is_sparse_checkpoint,
    load_sparse,
    read_sparse_state_dict,
    save_sparse,
)
from sparseswaps_prune.deploy.checkpoint import METADATA_KEY, encode_state_dict
from sparseswaps_prune.llm.models import TINY_ARCHS
from tests.deploy.conftest import assert_bit_equal, prune_model


def _file_tensors(path):
    with safe_open(str(path / SPARSE_FILE), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}, json.loads(f.metadata()[METADATA_KEY])


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pattern", ["60%", "2:4"])
@pytest.mark.parametrize("compress", [False, True])
def test_round_trip_is_bit_identical(tiny, tmp_path, arch, dtype, pattern, compress):
    nm = (2, 4) if pattern == "2:4" else None
    model = tiny(arch, dtype, sparsity=0.6, nm=nm, negative_zeros=pattern == "60%")
    report = save_sparse(model, tmp_path / "ckpt", compress=compress)
    assert report.encoded and all(s >= 0.5 for s in report.encoded.values())
    loaded = load_sparse(tmp_path / "ckpt")
    assert type(loaded) is type(model) and not loaded.training
    assert_bit_equal(model.state_dict(), loaded.state_dict())
    tensors, metadata = _file_tensors(tmp_path / "ckpt")
    entries = metadata["tensors"]
    assert metadata["format_version"] == (2 if compress else 1)  # an uncompressed file stays readable by version 1
    assert metadata["dtype"] == str(dtype).removeprefix("torch.")
    encoded = [name for name, e in entries.items() if e["encoding"] == "bitmask"]
    assert sorted(encoded) == sorted(f"{n}.weight" for n in prune_model_names(model))
    stored_dtype = torch.uint8 if compress else dtype
    for name in encoded:
        assert tensors[f"{name}.bitmask"].dtype == torch.uint8 and tensors[f"{name}.values"].dtype == stored_dtype
        assert entries[name].get("codec") == ("zlib-planes" if compress else None)
        if arch != "gpt2":  # gpt2's Conv1D stores [d_in, d_out]: its 2:4 groups run down the stored columns
            assert entries[name]["nm"] == ([2, 4] if nm else None)
        assert f"{name}.zero_signs" in tensors if pattern == "60%" else f"{name}.zero_signs" not in tensors
    tied = [name for name, e in entries.items() if e["encoding"] == "alias"]
    if model.config.tie_word_embeddings:
        assert tied and all(name not in tensors for name in tied)


def prune_model_names(model):
    embedding = model.get_input_embeddings().weight
    return [
        n
        for n, m in model.named_modules()
        if hasattr(m, "weight")
        and isinstance(m.weight, torch.Tensor)
        and m.weight.dim() == 2
        and m.weight is not embedding
        and bool((m.weight == 0).float().mean() >= 0.3)
    ]


def test_float16_round_trip_and_tokenizer_directory(tiny, tmp_path):
    model = tiny("llama", torch.float16)
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_text("{}")
    (tok_dir / "tokenizer_config.json").write_text("{}")
    save_sparse(model, tmp_path / "ckpt", tokenizer=tok_dir)
    assert (tmp_path / "ckpt" / "tokenizer.json").read_text() == "{}"
    assert (tmp_path / "ckpt" / "config.json").is_file()
    assert_bit_equal(model.state_dict(), load_sparse(tmp_path / "ckpt").state_dict())
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds none of the tokenizer files"):
        save_sparse(model, tmp_path / "other", tokenizer=tmp_path / "empty")
    with pytest.raises(TypeError, match="tokenizer must be a tokenizer object"):
        save_sparse(model, tmp_path / "other", tokenizer=tmp_path / "missing")
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize("dtype, limit", [(torch.float32, 0.45), (torch.bfloat16, 0.48)])
def test_at_60_percent_the_checkpoint_is_under_half_the_dense_one(tmp_path, dtype, limit):
    model = nn.Sequential(nn.Linear(512, 512, bias=False), nn.Linear(512, 512, bias=False)).to(dtype)
    prune_model(model, 0.6)
    report = save_sparse(model, tmp_path / "ckpt")
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    assert report.dense_bytes == dense and report.file_bytes == (tmp_path / "ckpt" / SPARSE_FILE).stat().st_size
    assert report.ratio < limit  # 1/32 + 0.4 for fp32, 1/16 + 0.4 for bf16, plus the header
    # a plain nn.Module: no config, loads through read_sparse_state_dict
    state = read_sparse_state_dict(tmp_path / "ckpt")
    assert_bit_equal(model.state_dict(), state)
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_sparse(tmp_path / "ckpt")


@pytest.mark.parametrize(("dtype", "limit"), [(torch.float32, 0.42), (torch.bfloat16, 0.4)])
def test_compressed_at_60_percent_is_smaller_still_and_loads_as_sparse_linears(tiny, tmp_path, dtype, limit):
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512, bias=False), nn.Linear(512, 512, bias=False), nn.LayerNorm(512))
    with torch.no_grad():
        for layer in model[:2]:
            layer.weight.copy_(torch.randn(512, 512, generator=generator) * 0.02)  # a trained layer's scale
    model = model.to(dtype)
    prune_model(model, 0.6)
    plain = save_sparse(model, tmp_path / "plain")
    packed = save_sparse(model, tmp_path / "packed", compress=True)
    assert packed.dense_bytes == plain.dense_bytes and packed.encoded == plain.encoded
    assert packed.ratio < limit < plain.ratio  # plain: 1/32 + 0.4 (fp32), 1/16 + 0.4 (bf16)
    tensors, metadata = _file_tensors(tmp_path / "packed")
    assert metadata["tensors"]["2.weight"]["codec"] == "zlib-planes" and tensors["2.weight"].dtype == torch.uint8
    assert_bit_equal(model.state_dict(), read_sparse_state_dict(tmp_path / "packed"))
    llama = tiny("llama", dtype)
    save_sparse(llama, tmp_path / "llama", compress=True)
    save_sparse(llama, tmp_path / "llama-plain")
    sparse = load_sparse(tmp_path / "llama", sparse=True)  # SparseLinear modules from the decompressed values
    assert any(type(m).__name__ == "SparseLinear" for m in sparse.modules())
    x = torch.randint(0, llama.config.vocab_size, (1, 6))
    with torch.no_grad():
        assert torch.equal(sparse(x).logits, load_sparse(tmp_path / "llama-plain", sparse=True)(x).logits)
    with pytest.raises(TypeError, match="compress must be True or False"):
        save_sparse(model, tmp_path / "bad", compress="zlib")


def test_min_sparsity_rule_and_reparametrisation_refused():
    layer = nn.Linear(16, 8)
    with torch.no_grad():
        layer.weight[:, :4] = 0.0  # 25% zeros
    _, entries = encode_state_dict(layer.state_dict(), min_sparsity=0.3)
    assert entries["weight"]["encoding"] == "dense" and entries["bias"]["encoding"] == "dense"
    _, entries = encode_state_dict(layer.state_dict(), min_sparsity=0.25)
    assert entries["weight"]["encoding"] == "bitmask" and entries["weight"]["sparsity"] == 0.25
    with pytest.raises(ValueError, match="min_sparsity"):
        encode_state_dict(layer.state_dict(), min_sparsity=1.5)
    torch.nn.utils.prune.l1_unstructured(layer, "weight", amount=0.5)
    with pytest.raises(ValueError, match=r"prune\.remove"):
        encode_state_dict(layer.state_dict())


def test_out_dir_rules_and_atomic_replacement(tiny, tmp_path, monkeypatch):
    model = tiny("llama")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a sparse checkpoint"):
        save_sparse(model, other)
    assert (other / "notes.txt").read_text() == "mine"
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="is a file"):
        save_sparse(model, tmp_path / "file")
    empty = tmp_path / "empty"
    empty.mkdir()
    save_sparse(model, empty)
    assert is_sparse_checkpoint(empty) and not is_sparse_checkpoint(other)
    before = (empty / SPARSE_FILE).read_bytes()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        save_sparse(model, empty)  # replacing an earlier save fails half-way: the old one stays
    assert (empty / SPARSE_FILE).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file", "other"]  # no temporary left
    monkeypatch.undo()
    with torch.no_grad():
        model.lm_head.weight.zero_()
    save_sparse(model, empty)  # replaces the earlier sparse save
    assert (empty / SPARSE_FILE).read_bytes() != before
    assert_bit_equal(model.state_dict(), load_sparse(empty).state_dict())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file", "other"]


def _rewrite(path, tensors=None, metadata=None):
    """Rewrite ``path/SPARSE_FILE`` with changed tensors and/or metadata."""
    old, meta = _file_tensors(path)
    tensors = old if tensors is None else tensors(old)
    meta = meta if metadata is None else metadata(meta)
    save_file(tensors, str(path / SPARSE_FILE), metadata={METADATA_KEY: json.dumps(meta)})


def test_bad_files_raise_clear_errors_before_any_model_is_built(tiny, tmp_path, monkeypatch):
    model = tiny("llama")
    path = tmp_path / "ckpt"
    save_sparse(model, path)
    good = (path / SPARSE_FILE).read_bytes()
    name = "model.layers.0.mlp.up_proj.weight"
    built = []
    import transformers

    original = transformers.LlamaForCausalLM.from_pretrained.__func__
    monkeypatch.setattr(
        transformers.LlamaForCausalLM,
        "from_pretrained",
        classmethod(lambda cls, *a, **k: built.append(1) or original(cls, *a, **k)),
    )

    def check(match):
        with pytest.raises(ValueError, match=match):
            load_sparse(path)
        assert not built
        (path / SPARSE_FILE).write_bytes(good)

    (path / SPARSE_FILE).write_bytes(good[: len(good) // 2])
    check(rf"{SPARSE_FILE}: not a readable safetensors file .*truncated")
    (path / SPARSE_FILE).write_bytes(good[:5])
    check("not a readable safetensors file")
    _rewrite(path, tensors=lambda t: t | {f"{name}.values": t[f"{name}.values"][:-3]})
    check(rf"{SPARSE_FILE}: tensor '{name}': .* values for .* set bits")
    _rewrite(path, tensors=lambda t: {k: v for k, v in t.items() if k != f"{name}.bitmask"})
    check(rf"tensor '{name}': '{name}.bitmask' is missing")
    _rewrite(path, tensors=lambda t: t | {"stray": torch.zeros(1)})
    check(r"tensors \['stray'\] are in the file but not in its metadata")
    _rewrite(path, tensors=lambda t: t | {"model.norm.weight": t["model.norm.weight"].double()})
    check(r"tensor 'model.norm.weight': stored as torch.float64")
    _rewrite(path, metadata=lambda m: m | {"format_version": 99})
    check("format_version 99 is not supported")
    save_sparse(model, path, compress=True)
    good = (path / SPARSE_FILE).read_bytes()
    _rewrite(path, tensors=lambda t: t | {f"{name}.values": t[f"{name}.values"][:-5]})
    check(rf"{SPARSE_FILE}: tensor '{name}' values: the zlib-planes stream .*cut short")

    def entry(**changes):
        return lambda m: {**m, "tensors": {**m["tensors"], name: {**m["tensors"][name], **changes}}}

    _rewrite(path, metadata=entry(values_numel=7))
    check(rf"tensor '{name}' values: the zlib-planes stream holds more than 28 bytes")
    _rewrite(path, metadata=entry(codec="lz4"))
    check(rf"tensor '{name}': metadata codec 'lz4' is not 'zlib-planes'")
    _rewrite(path, tensors=lambda t: t | {"model.norm.weight": t["model.norm.weight"] ^ 0xFF})
    check(r"tensor 'model.norm.weight': the zlib-planes stream")
    _rewrite(path, metadata=lambda m: {**m, "tensors": {**m["tensors"], name: {**m["tensors"][name], "dtype": "x"}}})
    check(rf"tensor '{name}': metadata dtype 'x'")
    save_file(_file_tensors(path)[0], str(path / SPARSE_FILE), metadata={METADATA_KEY: "{not json"})
    check("metadata is not valid JSON")
    save_file(_file_tensors(path)[0], str(path / SPARSE_FILE))
    check("no 'sparseswaps_sparse' metadata")
    assert_bit_equal(model.state_dict(), load_sparse(path).state_dict())
    assert built


def test_dtype_casts_as_from_pretrained_casts_the_dense_save(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny("llama", torch.bfloat16, negative_zeros=True)
    model.save_pretrained(tmp_path / "dense")
    save_sparse(model, tmp_path / "sparse")
    for dtype in (torch.float32, torch.bfloat16):
        want = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", dtype=dtype)
        got = load_sparse(tmp_path / "sparse", dtype=dtype)
        assert_bit_equal(want.state_dict(), got.state_dict())
        assert_bit_equal(dict(want.named_buffers()), dict(got.named_buffers()))
    with pytest.raises(ValueError, match=r"sparse=True keeps the saved dtype \(torch.bfloat16\)"):
        load_sparse(tmp_path / "sparse", sparse=True, dtype=torch.float32)
    with pytest.raises(TypeError, match=r"dtype must be None or a floating torch.dtype"):
        load_sparse(tmp_path / "sparse", dtype=torch.int8)
    with pytest.raises(TypeError, match=r"load_sparse sets \['torch_dtype'\] itself"):
        load_sparse(tmp_path / "sparse", torch_dtype=torch.float32)


def test_the_documented_from_pretrained_way_gives_the_same_model(tiny, tmp_path):
    import transformers

    model = tiny("qwen2", negative_zeros=True)
    save_sparse(model, tmp_path / "sparse")
    config = transformers.AutoConfig.from_pretrained(tmp_path / "sparse")  # as docs/deploy.md shows it
    cls = getattr(transformers, config.architectures[0])
    got = cls.from_pretrained(None, config=config, state_dict=read_sparse_state_dict(tmp_path / "sparse"))
    assert_bit_equal(model.state_dict(), got.state_dict())
