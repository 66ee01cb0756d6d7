"""``sparseswaps prune --blockwise`` (``JobConfig(blockwise=True)``): the block-wise path through the job and the
CLI saves what the in-memory job saves, bit for bit, and refuses what it cannot do before writing anything; under
torchrun (``--distributed``) it saves what one process saves."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from sparseswaps_prune.cli import main
from sparseswaps_prune.core.spec import build_spec
from sparseswaps_prune.llm import pipeline, streaming
from sparseswaps_prune.llm.job import STAGING_DIR, STATE_DIR, JobConfig, run_job
from sparseswaps_prune.llm.models import default_gguf_path
from sparseswaps_prune.recipes import RECIPES

ARGS = ["--nsamples", "2", "--seqlen", "16", "--holdout", "1", "--recipe", "sparseswaps-refit", "--max-iters", "2",
        "--quiet"]  # fmt: skip

REFIT = RECIPES["sparseswaps-refit"].spec  # Wanda -> SparseSwaps T=10 -> least-squares re-fit


@pytest.mark.parametrize("flags", [[], ["--sparsity-profile", "owl"]])
def test_blockwise_job_saves_the_in_memory_model(saved_tiny, tmp_path, capsys, flags):
    streamed, loaded = tmp_path / "streamed", tmp_path / "loaded"
    args = [*ARGS, *flags]
    assert main(["prune", "--model", str(saved_tiny), "--blockwise", *args, "--out", str(streamed)]) == 0
    assert main(["prune", "--model", str(saved_tiny), "--eval", "none", *args, "--out", str(loaded)]) == 0
    a, b = load_file(streamed / "model.safetensors"), load_file(loaded / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    report = json.loads((streamed / "report.json").read_text())
    assert report["config"]["blockwise"] and report["perplexity"]["refined"] is None
    assert report["memory"]["peak_rss_bytes"] > 0 and report["memory"]["bytes_written"] > 0
    assert report["numerics"]["device"] == "cpu" and report["numerics"]["cpu_threads"] == torch.get_num_threads()
    assert len(report["memory"]["blocks"]) == 2
    untimed = [{k: v for k, v in row.items() if not k.startswith("seconds")} for row in report["layers"]]
    loaded_rows = json.loads((loaded / "report.json").read_text())["layers"]
    assert untimed == [{k: v for k, v in row.items() if not k.startswith("seconds")} for row in loaded_rows]
    q_proj = {row["sparsity"] for row in report["layers"] if row["name"].endswith("q_proj")}
    assert len(q_proj) == (2 if flags else 1)  # OWL: each block its own budget
    for name in ("config.json", "tokenizer.json", "report.csv", "report.png", "config_sparseswaps.json"):
        assert (streamed / name).exists(), name
    assert not (streamed / STAGING_DIR).exists()


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"model": "HuggingFaceTB/SmolLM2-135M"}, "hub names are not read block by block"),
        ({"eval": "builtin"}, "eval=None (--eval none)"),
        ({"gguf_file": "x.gguf"}, "GGUF file 'x.gguf' not found"),
        ({"blockwise": 1}, "blockwise must be a bool"),
    ],
)
def test_blockwise_refusals_write_nothing(saved_tiny, tmp_path, changes, says):
    config = JobConfig(model=str(saved_tiny), eval=None, blockwise=True, nsamples=2, seqlen=16)
    for key, value in changes.items():
        setattr(config, key, value)
    with pytest.raises((ValueError, TypeError, FileNotFoundError), match=says.replace("(", r"\(").replace(")", r"\)")):
        run_job(config, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_blockwise_with_distributed_is_accepted(saved_tiny):
    """The combination was refused before (issue 19); now only the block-wise checks apply to it."""
    JobConfig(model=str(saved_tiny), eval=None, blockwise=True, distributed=True, nsamples=2, seqlen=16).validate()
    JobConfig(eval=None, blockwise=True, distributed=True).validate()  # the packaged GGUF
    with pytest.raises(ValueError, match="local directory of safetensors weights or a local GGUF file"):
        JobConfig(model="HuggingFaceTB/SmolLM2-135M", eval=None, blockwise=True, distributed=True).validate()


def test_blockwise_job_reads_a_gguf(tmp_path, monkeypatch):
    """The packaged GGUF (``model=None``) and a ``.gguf`` path reach ``prune_checkpoint`` as its directory and
    ``gguf_file`` (what it writes from a GGUF is tested in test_streaming.py)."""
    calls = []

    def stop(source, out_dir, calib, options, **kwargs):
        calls.append((source, kwargs["gguf_file"], tuple(calib.shape)))
        raise KeyboardInterrupt

    monkeypatch.setattr(streaming, "prune_checkpoint", stop)
    path = default_gguf_path()
    JobConfig(model=path, eval=None, blockwise=True).validate()
    with pytest.raises(KeyboardInterrupt):
        run_job(
            JobConfig(eval=None, blockwise=True, nsamples=2, seqlen=16, holdout=0), tmp_path / "out", progress=False
        )
    assert calls == [(os.path.dirname(path), os.path.basename(path), (2, 16))]


def test_interrupted_blockwise_job_resumes_bit_for_bit(saved_tiny, tmp_path, monkeypatch):
    """Stopped while pruning block 1: the finished block stays in the staging shards and the checkpoint, and the
    same call prunes block 1 only and saves what an uninterrupted run saves."""
    config = JobConfig(model=str(saved_tiny), eval=None, blockwise=True, nsamples=2, seqlen=16, holdout=1)
    config.prune.spec = build_spec(REFIT, max_iters=2)
    reference = run_job(config, tmp_path / "reference", progress=False)
    original, calls = pipeline._process_block, []

    def step(run, index, *args, **kwargs):
        calls.append(index)
        if index == 1 and len(calls) == 2:
            raise KeyboardInterrupt
        return original(run, index, *args, **kwargs)

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


def test_torchrun_blockwise_job_equals_one_process(saved_tiny, tmp_path):
    """``torchrun --nproc-per-node=2 ... prune --blockwise --distributed`` (gloo) writes the files and layer losses
    of one ``--blockwise`` process with the same ``--calib-shards``; rank 0 alone reports and nothing is left over."""
    args = ["prune", "--model", str(saved_tiny), "--blockwise", "--eval", "none", "--nsamples", "2", "--holdout", "2",
            "--batch-size", "1", "--calib-shards", "2", "--seqlen", "16", "--recipe", "sparseswaps-refit",
            "--max-iters", "2", "--block-tune-epochs", "0", "--quiet"]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cli = [sys.executable, "-m", "sparseswaps_prune.cli"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                "sparseswaps_prune.cli"]  # fmt: skip
    runs = {}
    for name, launch, extra in (("one", cli, []), ("two", torchrun, ["--distributed"])):
        runs[name] = subprocess.run([*launch, *args, *extra, "--out", str(tmp_path / name)], capture_output=True,
                                    text=True, env=env, cwd=tmp_path, timeout=600)  # fmt: skip
        assert runs[name].returncode == 0, runs[name].stderr
    assert runs["two"].stdout.count("final layer loss") == 1  # rank 0 alone reports
    one, two = tmp_path / "one", tmp_path / "two"
    assert sorted(p.name for p in one.iterdir()) == sorted(p.name for p in two.iterdir())
    assert (two / "model.safetensors").read_bytes() == (one / "model.safetensors").read_bytes()
    report_one, report_two = (json.loads((d / "report.json").read_text()) for d in (one, two))
    untimed = lambda rows: [{k: v for k, v in row.items() if not k.startswith("seconds")} for row in rows]  # noqa: E731
    assert untimed(report_two["layers"]) == untimed(report_one["layers"])
    assert report_two["config"] == report_one["config"] | {"distributed": True}
    assert report_two["memory"]["world_size"] == 2 and report_two["memory"]["rank"] == 0
    assert not (two / STATE_DIR).exists() and not (two / STAGING_DIR).exists()


def test_blockwise_runs_the_best_recipe_without_its_fine_tune(saved_tiny, tmp_path, caplog):
    """The recipe's fine-tune needs the whole pruned model: block by block it is not run (and said so), and the
    saved weights are those of the in-memory run with ``finetune_steps=0``; asking for steps is refused."""
    small = {"model": str(saved_tiny), "eval": None, "nsamples": 2, "seqlen": 16, "holdout": 1}
    config = JobConfig(blockwise=True, **small)
    assert RECIPES[config.prune.recipe].finetune_steps > 0 and config.finetune_steps == 0
    with caplog.at_level("INFO", logger="sparseswaps_prune.llm.job"):
        report = run_job(config, tmp_path / "blockwise", progress=False)
    assert "fine-tunes the whole pruned model at the end, which --blockwise never holds: not run" in caplog.text
    assert "finetune" not in report
    run_job(JobConfig(finetune_steps=0, **small), tmp_path / "memory", progress=False)
    blockwise = load_file(tmp_path / "blockwise" / "model.safetensors")
    memory = load_file(tmp_path / "memory" / "model.safetensors")
    assert blockwise.keys() == memory.keys() and all(torch.equal(blockwise[k], memory[k]) for k in memory)
    with pytest.raises(ValueError, match="never holds"):
        JobConfig(blockwise=True, finetune_steps=20, **small).validate()
