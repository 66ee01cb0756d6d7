"""``sparseswaps prune --save-format sparse``: the job saves a sparse checkpoint that loads to its dense save;
``load_model`` and ``sparseswaps eval`` read a sparse checkpoint as its dense save; ``--bench`` reports what the
sparse model gains."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from sparseswaps_prune.cli import build_parser, job_config, main
from sparseswaps_prune.deploy import SPARSE_FILE, load_sparse, save_sparse
from sparseswaps_prune.llm.job import JobConfig, run_job
from sparseswaps_prune.llm.models import load_model, tiny_model
from sparseswaps_prune.llm.pipeline import PruneOptions
from tests.deploy.conftest import assert_bit_equal, prune_model
from tests.llm.helpers import saved_tensors


def test_the_job_saves_a_sparse_checkpoint_equal_to_its_dense_save(saved_tiny, tmp_path):
    settings = {"model": str(saved_tiny), "nsamples": 4, "seqlen": 32, "holdout": 1, "eval": None}
    dense = run_job(JobConfig(prune=PruneOptions(recipe="wanda"), **settings), tmp_path / "dense", progress=False)
    args = ["prune", "--model", str(saved_tiny), "--recipe", "wanda", "--nsamples", "4", "--seqlen", "32"]
    config = job_config(build_parser().parse_args([*args, "--holdout", "1", "--eval", "none", "--save-format",
                                                   "sparse", "--out", "x"]))  # fmt: skip
    assert config == JobConfig(prune=PruneOptions(recipe="wanda"), save_format="sparse", **settings)
    sparse = run_job(config, tmp_path / "sparse", progress=False)
    assert "bench" not in sparse  # bench=False, the default
    assert [row["loss_final"] for row in dense["layers"]] == [row["loss_final"] for row in sparse["layers"]]
    assert (tmp_path / "sparse" / "model.sparse.safetensors").is_file()
    assert not (tmp_path / "sparse" / "model.safetensors").exists()
    want, got = saved_tensors(tmp_path / "dense"), load_sparse(tmp_path / "sparse").state_dict()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    packed = job_config(build_parser().parse_args([*args, "--holdout", "1", "--eval", "none", "--save-format",
                                                   "sparse-compressed", "--out", "x"]))  # fmt: skip
    assert packed == JobConfig(prune=PruneOptions(recipe="wanda"), save_format="sparse-compressed", **settings)
    run_job(packed, tmp_path / "packed", progress=False)
    got = load_sparse(tmp_path / "packed").state_dict()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    dirs = ("dense", "sparse", "packed")
    sizes = [sum(f.stat().st_size for f in (tmp_path / d).glob("*.safetensors")) for d in dirs]
    assert sizes[2] < sizes[1] < sizes[0]


@pytest.mark.parametrize("save_format", ["sparse", "sparse-compressed"])
def test_sparse_save_format_is_refused_with_blockwise(saved_tiny, save_format):
    config = JobConfig(model=str(saved_tiny), eval=None, blockwise=True, save_format=save_format)
    want = rf"save_format='{save_format}' \(--save-format {save_format}\) needs the whole pruned"
    with pytest.raises(ValueError, match=want):
        config.validate()


@pytest.fixture
def dense_and_sparse(tmp_path, tiny_tokenizer):
    """``save(dtype)``: a tiny llama pruned at 60% (negative zeros included) saved in ``dtype`` twice, with the
    tokenizer: ``save_pretrained`` and ``save_sparse``; returns the two directories."""

    def save(dtype):
        model = tiny_model("llama", seed=3)
        prune_model(model, 0.6, negative_zeros=True)
        model.to(dtype)
        dense, sparse = tmp_path / f"dense-{dtype}", tmp_path / f"sparse-{dtype}"
        model.save_pretrained(dense)
        tiny_tokenizer.save_pretrained(dense)
        save_sparse(model, sparse, tokenizer=tiny_tokenizer)
        return dense, sparse

    return save


@pytest.mark.parametrize("saved", [torch.float32, torch.bfloat16])
def test_load_model_reads_a_sparse_dir_as_its_dense_save_bit_for_bit(dense_and_sparse, saved):
    dense_dir, sparse_dir = dense_and_sparse(saved)
    for dtype in (torch.float32, torch.bfloat16):
        want, want_tokenizer = load_model(str(dense_dir), dtype=dtype)
        got, got_tokenizer = load_model(str(sparse_dir), dtype=dtype)
        assert type(got) is type(want) and not got.training and got.config.use_cache is False
        assert_bit_equal(want.state_dict(), got.state_dict())
        assert_bit_equal(dict(want.named_buffers()), dict(got.named_buffers()))
        assert got_tokenizer.get_vocab() == want_tokenizer.get_vocab()
        assert got_tokenizer.pad_token == want_tokenizer.pad_token


def test_load_model_refuses_a_damaged_or_ambiguous_sparse_dir(dense_and_sparse):
    dense_dir, sparse_dir = dense_and_sparse(torch.float32)
    good = (sparse_dir / SPARSE_FILE).read_bytes()
    (sparse_dir / SPARSE_FILE).write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match=rf"{SPARSE_FILE}: not a readable safetensors file .*truncated"):
        load_model(str(sparse_dir))
    (sparse_dir / SPARSE_FILE).write_bytes(good)
    (sparse_dir / "model.safetensors").write_bytes((dense_dir / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=rf"holds both a sparse checkpoint \({SPARSE_FILE}\) and dense weights"):
        load_model(str(sparse_dir))


def test_eval_of_a_sparse_dir_equals_eval_of_its_dense_save(dense_and_sparse, capsys):
    printed = []
    for directory in dense_and_sparse(torch.float32):
        args = ["eval", "--model", str(directory), "--seqlen", "32", "--eval-windows", "2", "--batch-size", "2"]
        assert main(args) == 0
        printed.append(json.loads(capsys.readouterr().out))
    assert printed[0] == printed[1]
    assert printed[0]["perplexity"] > 1 and 0.55 < printed[0]["sparsity_of_proj_weights"] < 0.65


def test_bench_option_reports_dense_against_sparse(saved_tiny, tmp_path, capsys):
    settings = {"model": str(saved_tiny), "nsamples": 4, "seqlen": 32, "holdout": 1, "eval": None}
    args = ["prune", "--model", str(saved_tiny), "--recipe", "wanda", "--nsamples", "4", "--seqlen", "32",
            "--holdout", "1", "--eval", "none", "--bench"]  # fmt: skip
    out = tmp_path / "out"
    config = job_config(build_parser().parse_args([*args, "--out", str(out)]))
    assert config == JobConfig(prune=PruneOptions(recipe="wanda"), bench=True, **settings)
    assert main([*args, "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
    report = json.loads((out / "report.json").read_text())
    bench = report["bench"]
    dense_bytes = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    assert bench["disk"]["dense_bytes"] == dense_bytes  # the dense save's weights, as the job saved them
    assert 0 < bench["disk"]["sparse_bytes"] < dense_bytes
    assert bench["disk"]["ratio"] == bench["disk"]["sparse_bytes"] / dense_bytes
    decode = bench["decode"]
    assert decode["dense_tokens_per_s"] > 0 and decode["sparse_tokens_per_s"] > 0 and decode["same_tokens"]
    assert decode["speedup"] == pytest.approx(decode["sparse_tokens_per_s"] / decode["dense_tokens_per_s"])
    assert bench["sparsified"]["converted"] == 14  # the block linears wanda pruned; lm_head stays dense
    assert bench["seconds"] > 0
    if sys.platform.startswith("linux"):
        memory = bench["memory"]
        assert memory["sparse"]["tensor_bytes"] < memory["dense"]["tensor_bytes"]
        assert memory["dense"]["rss_model"] > 0 and memory["sparse"]["rss_model"] > 0
    assert main(["report", str(out)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("deployment, dense -> sparse on the CPU: weights on disk ") and "same tokens: yes" in line


def test_bench_is_refused_with_blockwise(saved_tiny):
    config = JobConfig(model=str(saved_tiny), eval=None, blockwise=True, bench=True)
    with pytest.raises(ValueError, match=r"bench=True \(--bench\) measures the whole pruned model"):
        config.validate()
    with pytest.raises(TypeError, match=r"bench \(--bench\) must be a bool"):
        JobConfig(bench="yes").validate()
