"""Issue 47: ``--out`` never overwrites the input model, and replaces another model only with ``--overwrite``;
a resume that toggles ``--blockwise`` is refused naming it; window counts no machine can hold are refused before
the model loads. Real runs of ``sparseswaps prune`` / ``run_job`` on a tiny random Llama."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sparseswaps_prune.cli import main
from sparseswaps_prune.llm import checkpoint, models, pipeline, streaming
from sparseswaps_prune.llm.data import _random_windows, check_window_budget, load_calibration
from sparseswaps_prune.llm.job import PUBLISHED, STAGING_DIR, STATE_DIR, JobConfig, check_out_target, run_job
from sparseswaps_prune.llm.models import tiny_model
from tests.llm.helpers import one_line_error

SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer):
    """A tiny random llama (hidden 32, 2 blocks) with the packaged tokenizer, saved once; tests copy it before
    pointing ``--out`` at it."""
    path = tmp_path_factory.mktemp("model") / "tiny"
    tiny_model("llama", **SMALL).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def model_copy(model_dir, tmp_path) -> Path:
    path = tmp_path / "model"
    shutil.copytree(model_dir, path)
    return path


def args(model: Path, out: Path, *flags: str) -> list[str]:
    return ["prune", "--model", str(model), "--nsamples", "2", "--seqlen", "16", "--holdout", "1", "--eval", "none",
            "--recipe", "sparseswaps", "--max-iters", "1", "--backend", "torch", "--quiet", "--out", str(out),
            *flags]  # fmt: skip


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (links followed) and its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture
def nothing_loaded(monkeypatch):
    """Fail the test if the model is loaded or pruned block by block."""

    def fail(*args, **kwargs):
        raise AssertionError("the model was read before --out was refused")

    monkeypatch.setattr(models, "load_model", fail)
    monkeypatch.setattr(streaming, "prune_checkpoint", fail)


# ------------------------------------------------------------------ the input model's own directory (item 1)


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("blockwise", [False, True])
@pytest.mark.parametrize("how", ["same path", "symlink", "trailing ..", "parent of the model"])
def test_out_at_the_input_model_is_refused_even_with_overwrite(
    model_copy, tmp_path, capsys, nothing_loaded, how, blockwise, overwrite
):
    """``--out`` naming the model's directory (directly, through a symlink or ``sub/..``), or a directory that
    contains it: exit 2 with one line naming ``--out`` and ``--overwrite``, before anything is read; every file of
    the model byte-identical, nothing added."""
    if how == "symlink":
        out = tmp_path / "link"
        out.symlink_to(model_copy, target_is_directory=True)
    elif how == "trailing ..":
        out = model_copy / "tokenizer_dir_that_is_not_there" / ".."
        (model_copy / "tokenizer_dir_that_is_not_there").mkdir()
    else:
        out = model_copy if how == "same path" else tmp_path
    before = snapshot(model_copy)
    flags = ["--blockwise"] * blockwise + ["--overwrite"] * overwrite
    assert main(args(model_copy, out, *flags)) == 2
    where = "contains" if how == "parent of the model" else "is"
    one_line_error(capsys, f"--out {out} {where} the directory of the input model", "even with --overwrite")
    assert snapshot(model_copy) == before
    assert not (model_copy / STATE_DIR).exists() and not (model_copy / STAGING_DIR).exists()


def test_run_job_refuses_the_model_directory_and_a_gguf_beside_it(model_copy, tmp_path, nothing_loaded):
    """The same check in the library, for a local directory and for the directory of a ``.gguf`` file."""
    before = snapshot(model_copy)
    for blockwise in (False, True):
        config = JobConfig(model=str(model_copy), eval=None, nsamples=2, seqlen=16, blockwise=blockwise)
        with pytest.raises(ValueError, match="is the directory of the input model"):
            run_job(config, model_copy, progress=False, overwrite=True)
    (model_copy / "x.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="is the directory of the input model"):
        run_job(JobConfig(model=str(model_copy / "x.gguf"), eval=None), model_copy, progress=False)
    (model_copy / "x.gguf").unlink()
    assert snapshot(model_copy) == before


def test_out_inside_the_model_directory_is_a_new_directory(model_copy):
    """A new directory inside the model's (``model/pruned``) holds nothing and touches none of the model's files:
    accepted."""
    check_out_target(model_copy / "pruned", model_copy)
    with pytest.raises(ValueError, match="is the directory of the input model"):
        check_out_target(model_copy / "pruned" / "..", model_copy, overwrite=True)


# ------------------------------------------------------------------ another model in --out (item 1)


def another_model(path: Path, tiny_tokenizer) -> Path:
    """A different model saved in ``path`` as two shards with an index, and a README the run does not write."""
    tiny_model("llama", seed=5, **SMALL).save_pretrained(path, max_shard_size="100KB")
    tiny_tokenizer.save_pretrained(path)
    (path / "README.md").write_text("my other model\n", encoding="utf-8")
    assert (path / "model.safetensors.index.json").exists()
    return path


def test_out_holding_another_model_needs_overwrite(model_dir, tmp_path, capsys, tiny_tokenizer, monkeypatch):
    """Without ``--overwrite``: exit 2, one line naming ``--out``, the files found and ``--overwrite``, before the
    model loads, every file byte-identical (in memory and block-wise). With it: the pruned model replaces the other
    one (its shards and index go, since a mix could load), the README stays, and the saved tensors are those of a
    run into a new directory."""
    out = another_model(tmp_path / "other", tiny_tokenizer)
    before = snapshot(out)
    reference = tmp_path / "reference"
    assert main(args(model_dir, reference)) == 0
    with monkeypatch.context() as patch:
        patch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
        patch.setattr(streaming, "prune_checkpoint", lambda *a, **k: pytest.fail("pruned block by block"))
        for flags in ([], ["--blockwise"]):
            assert main(args(model_dir, out, *flags)) == 2
            one_line_error(capsys, f"--out {out} already holds files this run did not write", "README.md",
                           "config.json", "pass --overwrite")  # fmt: skip
            assert snapshot(out) == before
    assert main(args(model_dir, out, "--overwrite")) == 0
    files = {p.name for p in out.iterdir()}
    assert "README.md" in files and (out / "README.md").read_text(encoding="utf-8") == "my other model\n"
    assert not any(name.startswith("model-") or name.endswith(".index.json") for name in files), files
    a, b = load_file(out / "model.safetensors"), load_file(reference / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert files - {"README.md"} == {p.name for p in reference.iterdir()}
    # the run is finished: the same command without --overwrite has nothing to do
    assert main(args(model_dir, out)) == 0


def test_a_finished_run_with_other_options_is_replaced_only_with_overwrite(model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(args(model_dir, out)) == 0
    before = snapshot(out)
    assert main(args(model_dir, out, "--sparsity", "0.5")) == 2
    one_line_error(capsys, "already holds a finished run with other options", "--overwrite")
    assert snapshot(out) == before
    assert main(args(model_dir, out, "--sparsity", "0.5", "--overwrite")) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["prune"]["spec"]["budget"]["sparsity"] == 0.5
    assert snapshot(out)["model.safetensors"] != before["model.safetensors"]


def test_own_files_of_an_interrupted_or_published_run_are_not_foreign(tmp_path):
    """What the job itself leaves (checkpoint, staging directory, a probe and a temporary report of a killed run,
    and the files a stopped publish had moved, as its record names them) does not need ``--overwrite``; anything
    else does."""
    out = tmp_path / "out"
    (out / STATE_DIR).mkdir(parents=True)
    (out / STAGING_DIR).mkdir()
    (out / ".sparseswaps_probe_abc").write_bytes(b"")
    (out / ".report.json.x1.tmp").write_bytes(b"{")
    check_out_target(out, None)
    (out / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"already holds files this run did not write \(config.json\)"):
        check_out_target(out, None)
    (out / STATE_DIR / PUBLISHED).write_text(json.dumps({"files": ["config.json", "../escape"]}))
    check_out_target(out, None)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"\(notes.txt\).*--overwrite"):
        check_out_target(out, None)
    check_out_target(out, None, overwrite=True)


# ------------------------------------------------------------------ toggling --blockwise on a resume (item 8)


def stop_in_block(monkeypatch, target, name: str, block: int):
    """Raise KeyboardInterrupt when ``target.name`` starts block ``block`` (block 0 is then committed)."""
    original = getattr(target, name)

    def step(run, index, *args, **kwargs):
        if index == block:
            raise KeyboardInterrupt
        return original(run, index, *args, **kwargs)

    monkeypatch.setattr(target, name, step)


@pytest.mark.parametrize("first", ["in memory", "blockwise"])
def test_toggling_blockwise_on_a_resume_names_blockwise(model_dir, tmp_path, monkeypatch, first):
    """A run stopped after block 0 and re-run in the other mode: refused before the model loads, naming
    ``--blockwise`` (not "another model (weights differ)"); the checkpoint untouched; the same mode resumes."""
    blockwise = first == "blockwise"
    config = JobConfig(model=str(model_dir), eval=None, nsamples=2, seqlen=16, holdout=1, blockwise=blockwise)
    out = tmp_path / "out"
    with monkeypatch.context() as patch:
        stop_in_block(patch, pipeline, "_process_block", 1)
        with pytest.raises(KeyboardInterrupt):
            run_job(config, out, progress=False)
    assert json.loads((out / STATE_DIR / "progress.json").read_text())["next_block"] == 1
    before = snapshot(out / STATE_DIR)
    toggled = JobConfig(**{**config.__dict__, "blockwise": not config.blockwise, "finetune_steps": None})
    with monkeypatch.context() as patch:
        patch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
        patch.setattr(streaming, "prune_checkpoint", lambda *a, **k: pytest.fail("pruned block by block"))
        with pytest.raises(checkpoint.CheckpointMismatch) as err:
            run_job(toggled, out, progress=False)
    message = str(err.value)
    assert "another mode" in message and "--blockwise as before" in message and "another model" not in message
    assert f"re-run {'with' if config.blockwise else 'without'} --blockwise" in message
    assert snapshot(out / STATE_DIR) == before
    assert run_job(config, out, progress=False)["totals"]


def test_fingerprints_of_the_two_modes_differ_by_mode_only(model_dir):
    """``Fingerprint.differences`` of an in-memory and a block-wise fingerprint of the same run names the mode
    alone; another option beside it is still named."""
    options = pipeline.PruneOptions()
    tokens = torch.zeros(2, 4, dtype=torch.long)
    model = tiny_model("llama", **SMALL)
    memory = checkpoint.fingerprint(model, options, tokens, keep_dense=False)
    blockwise = checkpoint.fingerprint(
        model, options, tokens, known_model_parts={"model_config": "c", "model_weights": "w", "dtype": "float32"},
        keep_dense=False, max_shard_size=5, output_plan="p",
    )  # fmt: skip
    assert memory.differences(blockwise) == [checkpoint._mode_change(False, True)]
    other = checkpoint.fingerprint(model, pipeline.PruneOptions(include=["*.q_proj"]), tokens, keep_dense=False)
    diffs = blockwise.differences(other)
    assert diffs[0] == checkpoint._mode_change(True, False) and diffs[1].startswith("other options: include")


# ------------------------------------------------------------------ window counts no machine holds (item 8)


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (["--nsamples", str(10**12)], [f"nsamples={10**12} (--nsamples)", "token ids alone", "smaller --nsamples"]),
        (["--holdout", str(10**12)], [f"holdout={10**12} (--holdout)", "smaller --holdout"]),
        (["--seed", str(2**70)], ["seed (--seed) must be an int in [0, 2**64)"]),
        (["--seed", "-1"], ["seed (--seed) must be an int in [0, 2**64)"]),
        (["--row-shards", "256"], ["row_shards=256 (--row-shards)", "add --distributed"]),
        (["--nm", "0:4"], ["nm=(0, 4) keeps none of every 4 weights", "n must be at least 1"]),
    ],
)
def test_options_of_issue_47_fail_at_the_door(model_dir, tmp_path, capsys, nothing_loaded, flags, needles):
    """Each refused before the model loads, one line naming the option, exit 2, ``--out`` not created (in memory and
    block-wise)."""
    for mode in ([], ["--blockwise"]):
        out = tmp_path / "out"
        assert main(args(model_dir, out, *flags, *mode)) == 2
        one_line_error(capsys, *needles)
        assert not out.exists()


def test_window_budget_in_the_library(tiny_tokenizer):
    """``load_calibration`` refuses the same counts before reading any text; counts that fit are drawn as before."""
    with pytest.raises(ValueError, match=r"nsamples=1000000000000 \(--nsamples\)"):
        load_calibration("builtin", tiny_tokenizer, 10**12, 16)
    with pytest.raises(ValueError, match=r"holdout=10 \(--holdout\).*at most 0"):
        check_window_budget(8, 16, 10, memory=8 * 16 * 8)
    check_window_budget(8, 16, 0, memory=8 * 16 * 8)
    windows = load_calibration("builtin", tiny_tokenizer, 4, 16, seed=3, holdout=2)
    assert windows.shape == (6, 16)


def test_held_out_windows_are_disjoint_with_many_calibration_windows():
    """The held-out starts are found in memory linear in the text and the window count (the pairwise test took
    ``tokens x nsamples``); they still overlap no calibration window."""
    text_ids = torch.arange(5000).unsqueeze(0)
    windows = _random_windows(text_ids, 100, 8, 0, "test", holdout=20)
    starts = windows[:, 0]
    calib, held = starts[:100], starts[100:]
    assert ((held[:, None] - calib[None, :]).abs() >= 8).all()
    with pytest.raises(ValueError, match=r"no room for held-out windows.*--holdout 0"):
        _random_windows(torch.arange(40).unsqueeze(0), 200, 8, 0, "test", holdout=1)


def test_seed_at_the_limits_is_accepted():
    JobConfig(seed=2**64 - 1, eval=None).validate()
    with pytest.raises(ValueError, match=r"seed \(--seed\)"):
        JobConfig(seed=2**64, eval=None).validate()


def test_symlinked_model_dir_is_recognised(model_copy, tmp_path, nothing_loaded):
    """``--model`` given through a symlink and ``--out`` the real directory: the same directory."""
    link = tmp_path / "model_link"
    os.symlink(model_copy, link)
    with pytest.raises(ValueError, match="is the directory of the input model"):
        run_job(JobConfig(model=str(link), eval=None, nsamples=2, seqlen=16), model_copy, overwrite=True)
