"""deploy.bench: the dense-against-sparse comparison of a saved model (what `sparseswaps bench` prints)."""

from __future__ import annotations

import json
import sys

import pytest

from sparseswaps_prune.cli import main
from sparseswaps_prune.deploy import save_sparse
from sparseswaps_prune.deploy.bench import bench_model_dir, dir_bytes, resident_memory, tensor_bytes
from tests.deploy.conftest import prune_model


def test_bench_model_dir_compares_disk_and_speed(tiny, tmp_path):
    model = tiny("llama")
    model.save_pretrained(tmp_path / "dense")
    result = bench_model_dir(tmp_path / "dense", new_tokens=4, repeats=1, threads=1, memory=False)
    json.dumps(result)  # JSON-ready
    assert result["disk"]["dense_bytes"] == dir_bytes(tmp_path / "dense", "*.safetensors")
    assert 0.5 < result["disk"]["ratio"] < 1.0  # the tiny model's unpruned embedding dominates
    assert result["decode"]["same_tokens"] and result["decode"]["dense_tokens_per_s"] > 0
    assert result["sparsified"]["converted"] == 15 and "memory" not in result  # 14 block linears and lm_head
    with pytest.raises(FileNotFoundError, match="does not exist"):
        bench_model_dir(tmp_path / "missing")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_resident_memory_of_a_sparse_load_tracks_its_tensors(tiny, tmp_path):
    model = tiny("llama", config={"hidden_size": 256, "intermediate_size": 1024})
    save_sparse(model, tmp_path / "ckpt")
    sparse = resident_memory(tmp_path / "ckpt", sparse=True)
    assert sparse["tensor_bytes"] < tensor_bytes(model)
    assert 0.5 * sparse["tensor_bytes"] < sparse["anon_model"] < 2 * sparse["tensor_bytes"]
    assert sparse["rss_model"] >= sparse["anon_model"] * 0.9


def test_the_bench_command_prints_and_writes_the_comparison(tiny, tmp_path, capsys):
    tiny("llama").save_pretrained(tmp_path / "dense")
    out = tmp_path / "bench.json"
    args = ["bench", str(tmp_path / "dense"), "--new-tokens", "4", "--repeats", "1", "--threads", "1"]
    assert main([*args, "--no-memory", "--json-out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert printed["sparsified"]["converted"] == 15 and printed["decode"]["same_tokens"]


def test_size_bound_is_the_saved_size_less_the_header(tmp_path):
    import torch

    from sparseswaps_prune.deploy import SPARSE_FILE
    from sparseswaps_prune.deploy.bench import size_bound
    from sparseswaps_prune.llm.models import tiny_model

    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model("llama", tie_word_embeddings=True)
        pruned = [f"{name}.weight" for name in prune_model(model, 0.625)]  # 5/8 of every row: exactly 62.5%
        model.to(dtype)
        report = save_sparse(model, tmp_path / str(dtype))
        bound = size_bound(model, pruned, 0.625)
        assert bound["dense_bytes"] == report.dense_bytes  # the tied embedding once
        with open(tmp_path / str(dtype) / SPARSE_FILE, "rb") as f:
            header = 8 + int.from_bytes(f.read(8), "little")
        assert bound["bound_bytes"] == report.file_bytes - header  # no zero signs: the bound is the file's tensors
        assert bound["ratio"] == bound["bound_bytes"] / bound["dense_bytes"]
        assert bound["sparsity_for_target"] is None  # the embedding alone is more than half of the tiny model
        again = size_bound(model, pruned, 0.625, target_ratio=bound["ratio"])
        assert again["sparsity_for_target"] == pytest.approx(0.625)
    with pytest.raises(ValueError, match="not 2-D tensors"):
        size_bound(model, ["model.norm.weight"], 0.5)
