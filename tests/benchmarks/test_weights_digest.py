"""benchmarks/weights_digest.py: equal tensors give equal digests, whatever the sharding; any change shows."""

from __future__ import annotations

import pytest
import torch

from sparseswaps_prune.llm.models import tiny_model


def test_digest_ignores_sharding_and_sees_one_changed_bit(benchmark_script, tmp_path):
    digest = benchmark_script("weights_digest").weights_digest
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "single")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    assert digest(tmp_path / "single") == digest(tmp_path / "sharded")
    with torch.no_grad():
        weight = model.model.layers[0].mlp.up_proj.weight
        weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(float("inf")))
    model.save_pretrained(tmp_path / "changed")
    assert digest(tmp_path / "changed") != digest(tmp_path / "single")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        digest(tmp_path)
