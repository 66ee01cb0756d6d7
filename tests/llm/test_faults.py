"""Fault injection (issue 18): a run stopped at any checkpoint write, at a random instant by SIGKILL from outside,
by Ctrl-C inside, by a full disk, or refused by a read-only output directory, leaves a state from which the same
command finishes with output bit-identical to an uninterrupted run; the CLI reports each in one line.

Complements ``test_checkpoint.py`` (hand-picked crash points of the pipeline, runs that must not be mixed)."""

from __future__ import annotations

import copy
import errno
import functools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sparseswaps_prune import atomic
from sparseswaps_prune.cli import main
from sparseswaps_prune.core.spec import SPARSESWAPS_SPEC, build_spec
from sparseswaps_prune.llm import checkpoint, job, models, pipeline
from sparseswaps_prune.llm.capture import BlockInputs
from sparseswaps_prune.llm.data import builtin_text
from sparseswaps_prune.llm.job import STAGING_DIR, STATE_DIR
from sparseswaps_prune.llm.models import tiny_model
from sparseswaps_prune.llm.pipeline import PruneOptions, finalize, prune_model
from tests.llm.helpers import one_line_error

SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1}
N_BLOCKS = 2
CHECKPOINT_WRITES = N_BLOCKS * 4  # per block: its file, fit inputs, held-out inputs, the progress marker
JOB_CHECKPOINT_WRITES = N_BLOCKS * 6  # the job tunes blocks (the default): also the dense model's fit, held-out inputs
# The swap search does not matter here; numba's OpenMP workers spin after each search and slow every later torch
# call of the process on a busy machine (OMP_WAIT_POLICY=passive avoids it), so these runs use the torch search.
BACKEND = "torch"


class Killed(KeyboardInterrupt):
    """Stands in for a kill or Ctrl-C inside the process."""


def kill_at_write(patch: pytest.MonkeyPatch, number: int, when: str, name: str | None = None) -> list[str]:
    """Stop the ``number``-th atomic write (1-based; of a file called ``name`` if given) ``"during"`` it (a
    half-written temporary file is left, the target is not replaced: as after a kill, no clean-up runs) or
    ``"after"`` it (the target is in place). Returns the list of written paths, growing as the run goes."""
    original, written = atomic.atomic_write, []

    def write(path, fn):
        path = Path(path)
        written.append(str(path))
        hit = sum(name is None or Path(p).name == name for p in written) == number and path.name == (name or path.name)
        if hit and when == "during":
            path.parent.mkdir(parents=True, exist_ok=True)
            (path.parent / f".{path.name}.killed.tmp").write_bytes(b"half a file")
            raise Killed
        original(path, fn)
        if hit:
            raise Killed

    patch.setattr(atomic, "atomic_write", write)
    return written


def kill_at_call(patch: pytest.MonkeyPatch, owner, name: str, number: int) -> dict[str, int]:
    """Raise :class:`Killed` on the ``number``-th call of ``owner.name`` (before it runs)."""
    original, count = getattr(owner, name), {"n": 0}

    def call(*args, **kwargs):
        count["n"] += 1
        if count["n"] == number:
            raise Killed
        return original(*args, **kwargs)

    patch.setattr(owner, name, call)
    return count


# ---------------------------------------------------------------- the pipeline, at every checkpoint write


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 256, (n, 16), generator=torch.Generator().manual_seed(seed))


@functools.cache
def dense_model():
    return tiny_model("llama", vocab_size=256, **SMALL)


def run_pipeline(state: Path | None):
    """Prune a fresh copy of the dense tiny model (as a restarted process would reload it); return the final
    state dict."""
    model = copy.deepcopy(dense_model())
    prune_model(
        model,
        tokens(4, 0),
        PruneOptions(spec=build_spec(SPARSESWAPS_SPEC, max_iters=1, backend=BACKEND), block_tune_epochs=0),
        checkpoint_dir=state,
        batch_size=4,
        progress=False,
        holdout_tokens=tokens(2, 1),
        keep_dense=True,
    )
    finalize(model)
    return model.state_dict()


@pytest.fixture(scope="module")
def pipeline_reference(tmp_path_factory):
    """The final weights of an uninterrupted run (with checkpoints: ``test_checkpoint`` shows they are those of a
    run without) and the number of calls, in it, of every function the tests below interrupt."""
    calls = {}
    with pytest.MonkeyPatch.context() as patch:
        written = kill_at_write(patch, 0, "after")
        for owner, name in INTERRUPTED:
            calls[name] = kill_at_call(patch, owner, name, 0)
        weights = run_pipeline(tmp_path_factory.mktemp("pipeline") / "state")
    return weights, len(written), {name: count["n"] for name, count in calls.items()}


def assert_same_weights(got: dict, want: dict, where: str) -> None:
    assert got.keys() == want.keys(), where
    for name in want:
        assert torch.equal(got[name], want[name]), f"{where}: {name} differs"


def assert_clean_checkpoint(state: Path) -> None:
    """Only what the progress marker names is left (stray temporary and superseded files were removed), besides
    the job's dense perplexity."""
    named = json.loads((state / "progress.json").read_text())
    left = {p.name for p in state.iterdir()} - {"dense.json"}
    assert left == {"progress.json", *named["blocks"], *named["inputs"].values()}


def test_pipeline_killed_at_every_checkpoint_write_resumes_bit_for_bit(tmp_path, pipeline_reference):
    reference, n_writes, _ = pipeline_reference
    assert n_writes == CHECKPOINT_WRITES
    for number in range(1, CHECKPOINT_WRITES + 1):
        for when in ("during", "after"):
            state = tmp_path / f"{when}_{number}"
            with pytest.MonkeyPatch.context() as patch:
                kill_at_write(patch, number, when)
                with pytest.raises(Killed):
                    run_pipeline(state)
            committed = (number - (when == "during")) // 4  # the marker is each block's 4th write
            marker = state / "progress.json"
            assert (json.loads(marker.read_text())["next_block"] if marker.exists() else 0) == committed
            assert_same_weights(run_pipeline(state), reference, f"killed {when} write {number}")
            assert_clean_checkpoint(state)


# Where Ctrl-C lands inside the pipeline: removing a superseded checkpoint file, pruning a layer, a block's forward
# on the (pruned) block's inputs to get the next block's, a block's forward that accumulates its Grams.
INTERRUPTED = [(checkpoint, "_remove"), (pipeline, "prune_layer"), (BlockInputs, "run_block"),
               (BlockInputs, "feed_block")]  # fmt: skip


@pytest.mark.parametrize("seed", [0, 1])
def test_pipeline_interrupted_at_random_calls_resumes_bit_for_bit(tmp_path, pipeline_reference, seed):
    """Ctrl-C inside, at a seeded random call of each function of :data:`INTERRUPTED`."""
    reference, _, calls = pipeline_reference
    assert calls == {"_remove": 2, "prune_layer": 7 * N_BLOCKS, "run_block": 2 * N_BLOCKS, "feed_block": 2 * N_BLOCKS}
    rng = random.Random(seed)
    for owner, name in INTERRUPTED:
        number = rng.randint(1, calls[name])
        state = tmp_path / f"{name}_{number}"
        with pytest.MonkeyPatch.context() as patch:
            kill_at_call(patch, owner, name, number)
            with pytest.raises(Killed):
                run_pipeline(state)
        assert_same_weights(run_pipeline(state), reference, f"interrupted at {name} call {number}")
        assert_clean_checkpoint(state)


# ---------------------------------------------------------------- the job and the CLI


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer):
    """A saved tiny llama with the packaged tokenizer, and short calibration and evaluation texts beside it."""
    path = tmp_path_factory.mktemp("model") / "tiny"
    tiny_model("llama", **SMALL).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    (path / "calib.txt").write_text(builtin_text("calib")[:4000], encoding="utf-8")
    (path / "eval.txt").write_text(builtin_text("eval")[:2000], encoding="utf-8")
    return path


def prune_args(model_dir: Path, out: Path) -> list[str]:
    return ["prune", "--model", str(model_dir), "--calib", str(model_dir / "calib.txt"), "--eval",
            str(model_dir / "eval.txt"), "--nsamples", "2", "--seqlen", "16", "--holdout", "1", "--eval-windows", "1",
            "--recipe", "sparseswaps-refit", "--max-iters", "1", "--backend", BACKEND, "--quiet", "--out",
            str(out)]  # fmt: skip


def output_of(out: Path) -> dict:
    """What a finished run leaves: the saved tensors, the report without timings, the file names."""
    report = json.loads((out / "report.json").read_text())
    return {
        "tensors": load_file(out / "model.safetensors"),
        "layers": [{k: v for k, v in row.items() if not k.startswith("seconds")} for row in report["layers"]],
        "perplexity": report["perplexity"],
        "files": sorted(p.name for p in out.iterdir()),
    }


def assert_same_output(out: Path, reference: dict, where: str) -> None:
    got = output_of(out)
    assert_same_weights(got.pop("tensors"), reference["tensors"], where)
    assert got == {k: v for k, v in reference.items() if k not in ("tensors", "dir")}, where


@pytest.fixture(scope="module")
def job_reference(model_dir, tmp_path_factory):
    """An uninterrupted ``sparseswaps prune`` run's output and directory; checks which atomic writes it made."""
    out = tmp_path_factory.mktemp("reference") / "out"
    with pytest.MonkeyPatch.context() as patch:
        written = kill_at_write(patch, 0, "after")
        assert main(prune_args(model_dir, out)) == 0
    reference = output_of(out)
    assert STATE_DIR not in reference["files"] and STAGING_DIR not in reference["files"]
    # the job's own atomic writes around the pipeline's
    names = [str(Path(p).relative_to(out)) for p in written]
    state, staging = f"{STATE_DIR}/", f"{STAGING_DIR}/"
    assert names[0] == f"{state}dense.json" and names[-1] == "report.json"
    assert names[-2] == f"{state}{job.PUBLISHED}"  # the names publishing moves, recorded before it moves them
    assert len([n for n in names if n.startswith(state)]) == 2 + JOB_CHECKPOINT_WRITES
    assert f"{staging}config_sparseswaps.json" in names
    return reference | {"dir": out}


def interrupt_save_pretrained(patch: pytest.MonkeyPatch, error: BaseException) -> None:
    """Make ``save_pretrained`` of the model write part of a file, then raise ``error``."""
    from transformers import PreTrainedModel

    def save_pretrained(self, directory, *args, **kwargs):
        Path(directory, "model.safetensors").write_bytes(b"part of the weights")
        raise error

    patch.setattr(PreTrainedModel, "save_pretrained", save_pretrained)


def interrupt_state_removal(patch: pytest.MonkeyPatch) -> None:
    """Stop the job while it removes its checkpoint (after ``report.json``), half-way."""
    original = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if Path(path).name == STATE_DIR:
            (Path(path) / "progress.json").unlink()
            raise Killed
        return original(path, *args, **kwargs)

    patch.setattr(job.shutil, "rmtree", rmtree)


def interrupt_publishing(patch: pytest.MonkeyPatch) -> None:
    """Stop the job after it has moved two of its staged files into ``--out`` (as a kill while publishing)."""
    original, moved = os.replace, []

    def replace(src, dst, *args, **kwargs):
        if Path(src).parent.name == STAGING_DIR != Path(dst).parent.name:  # not an atomic write into staging
            if len(moved) == 2:
                raise Killed
            moved.append(src)
        return original(src, dst, *args, **kwargs)

    patch.setattr(job.os, "replace", replace)


@pytest.mark.parametrize(
    "fault",
    ["after dense.json", "after config_sparseswaps.json", "during report.json", "save_pretrained", "state removal",
     "publishing"],
)  # fmt: skip
def test_job_interrupted_at_its_own_writes_resumes_bit_for_bit(model_dir, job_reference, tmp_path, capsys, fault):
    """Ctrl-C at the writes the job adds to the pipeline's (the dense perplexity, the outputs in a staging
    directory, ``report.json``, removing the checkpoint, moving the staged files into ``--out``): exit 130 with one
    line, then the same command finishes with the uninterrupted run's output (files a stopped publish moved are
    recognised as the run's own, so no ``--overwrite`` is needed)."""
    out = tmp_path / "out"
    with pytest.MonkeyPatch.context() as patch:
        if fault == "save_pretrained":
            interrupt_save_pretrained(patch, Killed())
        elif fault == "state removal":
            interrupt_state_removal(patch)
        elif fault == "publishing":  # issue 47: the published files are the run's own, not another model's
            interrupt_publishing(patch)
        else:
            when, name = fault.split()
            written = kill_at_write(patch, 1, when, name)
        assert main(prune_args(model_dir, out)) == 130
    if fault.startswith(("during", "after")):
        assert Path(written[-1]).name == name
    if fault == "publishing":
        assert len([p for p in out.iterdir() if not p.name.startswith(".")]) == 2
    one_line_error(capsys, "interrupted (re-run the same command to resume)")
    assert main(prune_args(model_dir, out)) == 0
    assert_same_output(out, job_reference, fault)


def reached(out: Path, stage: int) -> bool:
    """Whether a run writing to ``out`` has created its checkpoint (0), committed block 0 (1), started saving (2)."""
    if stage == 0:
        return (out / STATE_DIR).exists()
    if stage == 1:
        try:
            return json.loads((out / STATE_DIR / "progress.json").read_text())["next_block"] >= 1
        except (OSError, ValueError):
            return False
    return (out / STAGING_DIR).exists() or (out / "report.json").exists()


@pytest.mark.parametrize("seed", [1, 2])
def test_sigkill_at_a_random_instant_then_rerun_is_bit_identical(model_dir, job_reference, tmp_path, seed):
    """``kill -9`` of a ``sparseswaps prune`` process at a seeded random delay after it reached stage ``seed`` of
    :func:`reached` (1: block 0 committed, block 1 under way; 2: saving), then the same command in this process.
    (Stage 0, block 0, is the crash-at-every-write tests' first half; a subprocess costs its imports, seconds.)"""
    out = tmp_path / "out"
    args = prune_args(model_dir, out)
    env = os.environ | {"OMP_NUM_THREADS": str(torch.get_num_threads())}
    delay = random.Random(seed).uniform(0.0, 0.06)
    for _ in range(4):  # a run that finished before the kill is retried with a shorter delay
        shutil.rmtree(out, ignore_errors=True)
        proc = subprocess.Popen(
            [sys.executable, "-m", "sparseswaps_prune.cli", *args],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 300
        while not reached(out, seed) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=60) == -signal.SIGKILL
            break
        assert proc.returncode == 0
        delay /= 4
    else:
        pytest.fail("every run finished before it could be killed")
    left = sorted(p.name for p in out.iterdir())
    print(f"killed {delay:.3f} s after stage {seed}, leaving {left}")  # shown with pytest -s
    assert main(args) == 0
    assert_same_output(out, job_reference, f"SIGKILL {delay:.3f} s after stage {seed}, leaving {left}")


def disk_full_at_write(patch: pytest.MonkeyPatch, number: int) -> None:
    """Make the ``number``-th atomic write run out of space half-way (the real clean-up of the write runs)."""
    original, count = atomic.atomic_write, {"n": 0}

    def write(path, fn):
        count["n"] += 1
        if count["n"] != number:
            return original(path, fn)

        def full(f):
            f.write(b"half")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        original(path, full)

    patch.setattr(atomic, "atomic_write", write)


def test_full_disk_keeps_the_checkpoint_and_the_rerun_finishes(model_dir, job_reference, tmp_path, capsys):
    out = tmp_path / "out"
    state = out / STATE_DIR
    with pytest.MonkeyPatch.context() as patch:  # block 1's held-out inputs (dense.json is write 1)
        disk_full_at_write(patch, 1 + 4 + 3)
        assert main(prune_args(model_dir, out)) == 2
    one_line_error(capsys, "No space left on device", "free some space", "re-run the same command to resume")
    assert json.loads((state / "progress.json").read_text())["next_block"] == 1
    assert_clean_checkpoint(state)
    with pytest.MonkeyPatch.context() as patch:  # the disk fills up again while the model is saved
        interrupt_save_pretrained(patch, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        assert main(prune_args(model_dir, out)) == 2
    one_line_error(capsys, "No space left on device", "free some space")
    assert sorted(p.name for p in out.iterdir()) == [STATE_DIR]  # the partial copy is gone, nothing half-saved
    assert json.loads((state / "progress.json").read_text())["next_block"] == N_BLOCKS
    assert main(prune_args(model_dir, out)) == 0  # space freed
    assert_same_output(out, job_reference, "after a full disk")


def snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(directory)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}  # fmt: skip


def read_only(patch: pytest.MonkeyPatch, directory: Path) -> None:
    """Make creating files in ``directory`` fail as on a read-only mount (root ignores chmod, so it is simulated)."""
    original = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):
        if dir is not None and os.path.realpath(dir) == os.path.realpath(directory):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dir))
        return original(*args, dir=dir, **kwargs)

    patch.setattr(tempfile, "mkstemp", mkstemp)


def test_read_only_out_keeps_an_interrupted_run_untouched(model_dir, job_reference, tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.MonkeyPatch.context() as patch:
        kill_at_write(patch, 1, "during", "inputs_fit_0002.pt")  # block 1's: block 0 is in the checkpoint
        assert main(prune_args(model_dir, out)) == 130
    capsys.readouterr()
    before = snapshot(out)
    assert f"{STATE_DIR}/progress.json" in before
    with pytest.MonkeyPatch.context() as patch:
        read_only(patch, out)
        patch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded the model for a read-only --out"))
        assert main(prune_args(model_dir, out)) == 2
    one_line_error(capsys, f"output directory {out} is not writable", "Read-only file system", "--out")
    assert snapshot(out) == before
    assert main(prune_args(model_dir, out)) == 0  # writable again: resumes
    assert_same_output(out, job_reference, "after a read-only --out")


def test_read_only_out_with_the_finished_run_needs_no_write(model_dir, job_reference, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(job_reference["dir"], out)
    before = snapshot(out)
    with pytest.MonkeyPatch.context() as patch:
        read_only(patch, out)
        patch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded the model for a finished run"))
        assert main(prune_args(model_dir, out)) == 0
    assert snapshot(out) == before
    assert_same_output(out, job_reference, "finished run, read-only")


# ---------------------------------------------------------------- issue 47, item 7: the checkpoint's integrity


@pytest.fixture(scope="module")
def interrupted_job(model_dir, tmp_path_factory):
    """``--out`` of a run stopped while writing block 1's inputs: block 0 committed, with the dense perplexity."""
    out = tmp_path_factory.mktemp("interrupted_job") / "out"
    with pytest.MonkeyPatch.context() as patch:
        kill_at_write(patch, 1, "during", "inputs_fit_0002.pt")
        assert main(prune_args(model_dir, out)) == 130
    marker = json.loads((out / STATE_DIR / "progress.json").read_text())
    assert marker["next_block"] == 1 and "dense.json" in marker["measurements"]
    return out


@pytest.fixture
def stopped_out(interrupted_job, tmp_path):
    shutil.copytree(interrupted_job, tmp_path / "out", symlinks=True)
    return tmp_path / "out"


def forge(state: Path, change) -> None:
    marker = json.loads((state / "progress.json").read_text())
    change(marker)
    (state / "progress.json").write_text(json.dumps(marker))


@pytest.mark.parametrize("fault", ["flipped byte", "planted pickle", "path outside"])
def test_an_altered_checkpoint_is_refused_in_one_line_and_a_fresh_start_finishes(
    model_dir, job_reference, stopped_out, capsys, fault
):
    """One flipped byte in a saved tensor file resumed to another model with exit 0; a planted pickle (even with
    its hash forged into the marker) was an ``UnpicklingError`` traceback, exit 1; a marker naming a file outside
    the state directory was read. Now each is one line naming the file and how to start over, exit 2, before any
    block runs; deleting the state directory, as it says, then gives the uninterrupted run's output."""
    import pickle

    state = stopped_out / STATE_DIR
    target = state / "inputs_fit_0001.pt"
    if fault == "flipped byte":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x10
        target.write_bytes(bytes(data))
        needles = ["inputs_fit_0001.pt differs from the file that was committed", "sha256"]
    elif fault == "planted pickle":
        target.write_bytes(pickle.dumps(print, protocol=2))  # weights_only=True refuses it: nothing runs
        forge(state, lambda m: m["hashes"].update({target.name: checkpoint.file_digest(target)}))
        needles = ["inputs_fit_0001.pt cannot be loaded (UnpicklingError: "]
    else:
        shutil.copy(target, stopped_out.parent / target.name)
        forge(state, lambda m: m["inputs"].update({"fit": f"../../{target.name}"}))
        needles = [f"names '../../{target.name}' as an inputs file, which is not a file of its own directory"]
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as patch:
        kill_at_call(patch, pipeline, "_process_block", 1)  # a block that ran would raise Killed (exit 130)
        assert main(prune_args(model_dir, stopped_out)) == 2
    one_line_error(capsys, *needles, f"delete {state}")
    shutil.rmtree(state)
    assert main(prune_args(model_dir, stopped_out)) == 0
    assert_same_output(stopped_out, job_reference, fault)


def test_a_planted_dense_perplexity_is_measured_again(model_dir, job_reference, stopped_out):
    """``dense.json`` with its key kept and another perplexity was reported as measured; now its hash is checked
    against the one the committed marker records, so the planted value is measured again (and the output is the
    uninterrupted run's)."""
    path = stopped_out / STATE_DIR / "dense.json"
    planted = json.loads(path.read_text()) | {"perplexity": 1.2345}
    path.write_text(json.dumps(planted))
    assert main(prune_args(model_dir, stopped_out)) == 0
    report = json.loads((stopped_out / "report.json").read_text())
    assert report["perplexity"]["dense"] == job_reference["perplexity"]["dense"] != 1.2345
    assert_same_output(stopped_out, job_reference, "planted dense.json")


def test_an_untouched_dense_perplexity_is_reused(model_dir, job_reference, stopped_out, monkeypatch):
    """The same file, as committed: reused (the dense model is not evaluated again)."""
    calls = []
    original = job._dense_perplexity

    def spy(path, key, ppl):
        return original(path, key, lambda: calls.append(1) or ppl())

    monkeypatch.setattr(job, "_dense_perplexity", spy)
    assert main(prune_args(model_dir, stopped_out)) == 0
    assert calls == []
    assert_same_output(stopped_out, job_reference, "dense.json reused")
