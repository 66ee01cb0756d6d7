"""``sparseswaps prune --blockwise`` (``JobConfig(blockwise=True)``): the block-wise path through the job and the
CLI saves what the in-memory job saves, bit for bit, and refuses what it cannot do before writing anything."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from sparseswaps_prune.cli import main
from sparseswaps_prune.core.spec import build_spec
from sparseswaps_prune.llm import pipeline
from sparseswaps_prune.llm.job import STAGING_DIR, STATE_DIR, JobConfig, run_job

ARGS = ["--nsamples", "2", "--seqlen", "16", "--holdout", "1", "--max-iters", "2", "--quiet"]


def test_blockwise_job_saves_the_in_memory_model(saved_tiny, tmp_path, capsys):
    streamed, loaded = tmp_path / "streamed", tmp_path / "loaded"
    assert main(["prune", "--model", str(saved_tiny), "--blockwise", *ARGS, "--out", str(streamed)]) == 0
    assert main(["prune", "--model", str(saved_tiny), "--eval", "none", *ARGS, "--out", str(loaded)]) == 0
    a, b = load_file(streamed / "model.safetensors"), load_file(loaded / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    report = json.loads((streamed / "report.json").read_text())
    assert report["config"]["blockwise"] and report["perplexity"]["refined"] is None
    assert report["memory"]["peak_rss_bytes"] > 0 and report["memory"]["bytes_written"] > 0
    assert len(report["memory"]["blocks"]) == 2
    untimed = [{k: v for k, v in row.items() if not k.startswith("seconds")} for row in report["layers"]]
    loaded_rows = json.loads((loaded / "report.json").read_text())["layers"]
    assert untimed == [{k: v for k, v in row.items() if not k.startswith("seconds")} for row in loaded_rows]
    for name in ("config.json", "tokenizer.json", "report.csv", "report.png", "config_sparseswaps.json"):
        assert (streamed / name).exists(), name
    assert not (streamed / STAGING_DIR).exists()


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"model": None}, "local directory of safetensors"),
        ({"eval": "builtin"}, "eval=None (--eval none)"),
        ({"gguf_file": "x.gguf"}, "GGUF files"),
        ({"blockwise": 1}, "blockwise must be a bool"),
    ],
)
def test_blockwise_refusals_write_nothing(saved_tiny, tmp_path, changes, says):
    config = JobConfig(model=str(saved_tiny), eval=None, blockwise=True, nsamples=2, seqlen=16)
    for key, value in changes.items():
        setattr(config, key, value)
    with pytest.raises((ValueError, TypeError), match=says.replace("(", r"\(").replace(")", r"\)")):
        run_job(config, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_interrupted_blockwise_job_resumes_bit_for_bit(saved_tiny, tmp_path, monkeypatch):
    """Stopped while pruning block 1: the finished block stays in the staging shards and the checkpoint, and the
    same call prunes block 1 only and saves what an uninterrupted run saves."""
    config = JobConfig(model=str(saved_tiny), eval=None, blockwise=True, nsamples=2, seqlen=16, holdout=1)
    config.prune.spec = build_spec(max_iters=2)
    reference = run_job(config, tmp_path / "reference", progress=False)
    original, calls = pipeline._process_block, []

    def step(blocks, blocks_name, index, *args, **kwargs):
        calls.append(index)
        if index == 1 and len(calls) == 2:
            raise KeyboardInterrupt
        return original(blocks, blocks_name, index, *args, **kwargs)

    monkeypatch.setattr(pipeline, "_process_block", step)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        run_job(config, out, progress=False)
    assert json.loads((out / STATE_DIR / "progress.json").read_text())["next_block"] == 1
    assert [p.name for p in (out / STAGING_DIR).iterdir()] == ["model.safetensors.partial"]
    report = run_job(config, out, progress=False)
    assert calls == [0, 1, 1] and report["memory"]["first_block"] == 1
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "reference" / "model.safetensors").read_bytes()
    untimed = lambda rows: [{k: v for k, v in row.items() if not k.startswith("seconds")} for row in rows]  # noqa: E731
    assert untimed(report["layers"]) == untimed(reference["layers"])
    assert not (out / STATE_DIR).exists() and not (out / STAGING_DIR).exists()
