"""``sparseswaps prune --save-format sparse``: the job saves a sparse checkpoint that loads to its dense save."""

from __future__ import annotations

import pytest
import torch

from sparseswaps_prune.cli import build_parser, job_config
from sparseswaps_prune.deploy import load_sparse
from sparseswaps_prune.llm.job import JobConfig, run_job
from sparseswaps_prune.llm.pipeline import PruneOptions
from tests.llm.helpers import saved_tensors


def test_the_job_saves_a_sparse_checkpoint_equal_to_its_dense_save(saved_tiny, tmp_path):
    settings = {"model": str(saved_tiny), "nsamples": 4, "seqlen": 32, "holdout": 1, "eval": None}
    dense = run_job(JobConfig(prune=PruneOptions(recipe="wanda"), **settings), tmp_path / "dense", progress=False)
    args = ["prune", "--model", str(saved_tiny), "--recipe", "wanda", "--nsamples", "4", "--seqlen", "32"]
    config = job_config(build_parser().parse_args([*args, "--holdout", "1", "--eval", "none", "--save-format",
                                                   "sparse", "--out", "x"]))  # fmt: skip
    assert config == JobConfig(prune=PruneOptions(recipe="wanda"), save_format="sparse", **settings)
    sparse = run_job(config, tmp_path / "sparse", progress=False)
    assert [row["loss_final"] for row in dense["layers"]] == [row["loss_final"] for row in sparse["layers"]]
    assert (tmp_path / "sparse" / "model.sparse.safetensors").is_file()
    assert not (tmp_path / "sparse" / "model.safetensors").exists()
    want, got = saved_tensors(tmp_path / "dense"), load_sparse(tmp_path / "sparse").state_dict()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    sizes = [sum(f.stat().st_size for f in (tmp_path / d).glob("*.safetensors")) for d in ("dense", "sparse")]
    assert sizes[1] < sizes[0]


def test_sparse_save_format_is_refused_with_blockwise(saved_tiny):
    config = JobConfig(model=str(saved_tiny), eval=None, blockwise=True, save_format="sparse")
    with pytest.raises(ValueError, match=r"save_format='sparse' \(--save-format sparse\) needs the whole pruned"):
        config.validate()
