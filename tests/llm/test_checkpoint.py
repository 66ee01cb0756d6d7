"""Checkpoints of the block-wise pipeline: crash safety at every write, and no resuming across runs."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch

from sparseswaps_prune import atomic
from sparseswaps_prune.core.spec import build_spec
from sparseswaps_prune.llm import checkpoint, pipeline
from sparseswaps_prune.llm.checkpoint import CheckpointMismatch, to_plain
from sparseswaps_prune.llm.job import STATE_DIR, JobConfig, run_job
from sparseswaps_prune.llm.models import tiny_model
from sparseswaps_prune.llm.pipeline import PruneOptions, finalize, prune_model
from sparseswaps_prune.recipes import RECIPES
from tests.llm.helpers import crash_on_call

N_BLOCKS = 2
WRITES_PER_BLOCK = 4  # block file, fit inputs, held-out inputs, progress marker

REFIT = RECIPES["sparseswaps-refit"].spec  # Wanda -> SparseSwaps T=10 -> least-squares re-fit


def options(**spec) -> PruneOptions:
    # untuned: WRITES_PER_BLOCK counts the pruned model's streams (block tuning's are in test_block_tune.py)
    return PruneOptions(spec=build_spec(REFIT, **({"max_iters": 2} | spec)), block_tune_epochs=0)


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 3000, (n, 16), generator=torch.Generator().manual_seed(seed))


def run(checkpoint_dir=None, model=None, opts=None, calib=None, keep_dense=True, batch_size=1, threads=None):
    model = model if model is not None else tiny_model("llama", num_hidden_layers=N_BLOCKS)
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        result = prune_model(
            model,
            tokens(4, 0) if calib is None else calib,
            opts or options(),
            checkpoint_dir=checkpoint_dir,
            progress=False,
            holdout_tokens=tokens(2, 1),
            keep_dense=keep_dense,
            batch_size=batch_size,
        )
    finally:
        torch.set_num_threads(before)
    return model, result


@pytest.fixture(scope="module")
def reference():
    """An uninterrupted run without checkpoints: its finalized state dict and its result."""
    model, result = run()
    finalize(model)
    return model.state_dict(), result


def assert_identical(model, result, reference) -> None:
    state_dict, ref = reference
    finalize(model)
    for (name, a), b in zip(state_dict.items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    timeless = lambda r: {k: v for k, v in asdict(r).items() if not k.startswith("seconds")}  # noqa: E731
    assert list(map(timeless, result.layers)) == list(map(timeless, ref.layers))
    for got, want in ((result.masks, ref.masks), (result.warmstart_masks, ref.warmstart_masks),
                      (result.dense_weights, ref.dense_weights)):  # fmt: skip
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)


class Crash(KeyboardInterrupt):
    """Stands in for a kill or Ctrl-C."""


def crash_on_write(monkeypatch, number: int, when: str) -> None:
    """Make the ``number``-th atomic write (1-based) crash: ``"during"`` it (a half-written temporary file is
    left behind, as after a kill, and the target is not replaced) or ``"after"`` it (the file is in place)."""
    original, count = atomic.atomic_write, {"n": 0}

    def write(path, fn):
        path = Path(path)
        count["n"] += 1
        if count["n"] == number and when == "during":
            (path.parent / f".{path.name}.killed.tmp").write_bytes(b"half a file")
            raise Crash
        original(path, fn)
        if count["n"] == number:
            raise Crash

    monkeypatch.setattr(atomic, "atomic_write", write)


CRASH_POINTS = [
    ("during", 1),  # block 0's file: nothing committed yet
    ("after", 2),  # block 0's fit inputs written, no marker yet
    ("during", 4),  # the first marker
    ("after", 4),  # the first marker committed, nothing removed yet
    ("during", 6),  # block 1's held-out inputs (the old bug: new inputs beside the old marker)
    ("after", 7),  # block 1's inputs written, the marker still names block 1's inputs
    ("during", 8),  # the last marker
]


@pytest.mark.parametrize(("when", "number"), CRASH_POINTS)
def test_crash_at_any_write_resumes_bit_for_bit(tmp_path, monkeypatch, reference, when, number):
    assert (N_BLOCKS * WRITES_PER_BLOCK) >= number
    with monkeypatch.context() as patch:
        crash_on_write(patch, number, when)
        with pytest.raises(Crash):
            run(tmp_path)
    committed = (number - (when == "during")) // WRITES_PER_BLOCK
    progress = tmp_path / "progress.json"
    assert (json.loads(progress.read_text())["next_block"] if progress.exists() else 0) == committed
    model, result = run(tmp_path)  # a restarted process reloads the dense model
    assert_identical(model, result, reference)
    named = json.loads(progress.read_text())
    expected = {"progress.json", *named["blocks"], *named["inputs"].values()}
    assert {p.name for p in tmp_path.iterdir()} == expected  # stray and superseded files are gone


def test_crash_while_removing_superseded_inputs(tmp_path, monkeypatch, reference):
    calls = {"n": 0}

    def remove(path):
        calls["n"] += 1
        raise Crash

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint, "_remove", remove)
        with pytest.raises(Crash):
            run(tmp_path)
    assert calls["n"] == 1 and json.loads((tmp_path / "progress.json").read_text())["next_block"] == 2
    assert (tmp_path / "inputs_fit_0001.pt").exists()  # superseded but not yet removed
    model, result = run(tmp_path)
    assert_identical(model, result, reference)
    assert not (tmp_path / "inputs_fit_0001.pt").exists()


def test_crash_inside_a_block_then_resume(tmp_path, reference):
    with crash_on_call(pipeline, "_prune_block", 2, Crash):
        run(tmp_path)
    model, result = run(tmp_path)
    assert_identical(model, result, reference)


@pytest.fixture(scope="module")
def interrupted_once(tmp_path_factory):
    path = tmp_path_factory.mktemp("interrupted")
    with pytest.MonkeyPatch.context() as patch:
        crash_on_write(patch, WRITES_PER_BLOCK + 1, "during")
        with pytest.raises(Crash):
            run(path)
    return path


@pytest.fixture
def interrupted(interrupted_once, tmp_path):
    """A checkpoint directory holding block 0 of the default run (interrupted before block 1's marker)."""
    shutil.copytree(interrupted_once, tmp_path / "state")
    return tmp_path / "state"


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"model": lambda: tiny_model("llama", num_hidden_layers=N_BLOCKS, seed=1)}, r"another model \(weights differ"),
        ({"model": lambda: tiny_model("llama", num_hidden_layers=N_BLOCKS, intermediate_size=96)},
         r"another model \(config/weights differ\)"),
        ({"model": lambda: tiny_model("llama", num_hidden_layers=N_BLOCKS).to(torch.bfloat16)},
         r"another dtype \(float32 -> bfloat16\)"),
        ({"opts": lambda: options(sparsity=0.5)}, r"other options: spec\.budget\.sparsity 0\.6 -> 0\.5"),
        ({"opts": lambda: options(max_iters=3)}, r"other options: spec\.refine\.max_iters 2 -> 3"),
        ({"calib": lambda: tokens(4, 5)}, "other calibration windows"),
        ({"keep_dense": lambda: False}, "other settings: keep_dense True -> False"),
        # the numerics: forwards of other batch shapes, or Cholesky factors on another thread count, round otherwise
        ({"batch_size": lambda: 2}, "other settings: batch_size 1 -> 2"),
        ({"threads": lambda: torch.get_num_threads() + 1}, "other settings: cpu_threads [0-9]+ -> [0-9]+"),
    ],
)  # fmt: skip
def test_other_run_is_refused_naming_what_differs(interrupted, change, match):
    before = {p.name: p.read_bytes() for p in interrupted.iterdir()}
    with pytest.raises(CheckpointMismatch, match=match) as err:
        run(interrupted, **{key: make() for key, make in change.items()})
    assert f"delete {interrupted}" in str(err.value) and "--out" in str(err.value)
    assert {p.name: p.read_bytes() for p in interrupted.iterdir()} == before  # nothing touched


@pytest.mark.parametrize("module", ["torch", "transformers"])
def test_a_resume_under_another_library_version_is_refused(interrupted, module, monkeypatch):
    library = __import__(module)
    monkeypatch.setattr(library, "__version__", "0.0.1")
    with pytest.raises(CheckpointMismatch, match=rf"other settings: {module} \S+ -> 0\.0\.1"):
        run(interrupted)


def test_older_checkpoint_format_is_refused(interrupted):
    progress = interrupted / "progress.json"
    progress.write_text(json.dumps({"fingerprint": "0123456789abcdef", "next_block": 1, "inputs": ["fit"]}))
    with pytest.raises(CheckpointMismatch, match="older version"):
        run(interrupted)


def test_checkpoint_of_the_previous_format_without_hashes_is_refused(interrupted):
    progress = interrupted / "progress.json"
    marker = json.loads(progress.read_text())
    del marker["hashes"], marker["measurements"]
    progress.write_text(json.dumps(marker | {"format": 2}))
    with pytest.raises(CheckpointMismatch, match=r"older version \(its files carry no content hashes\).*delete"):
        run(interrupted)


# --- issue 47, item 7: the checkpoint's files are those that were committed, inside its directory


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["inputs_fit_0001.pt", "inputs_holdout_0001.pt", "block_0000.pt"])
def test_a_flipped_byte_in_a_checkpoint_file_is_refused_naming_it(interrupted, name):
    """One flipped bit resumed to another model, exit 0; now the sha256 the marker records refuses it."""
    assert json.loads((interrupted / "progress.json").read_text())["hashes"].keys() == {
        "block_0000.pt", "inputs_fit_0001.pt", "inputs_holdout_0001.pt"
    }  # fmt: skip
    flip_byte(interrupted / name)
    before = {p.name: p.read_bytes() for p in interrupted.iterdir() if p.suffix != ".tmp"}
    with pytest.raises(checkpoint.CheckpointCorrupt, match=rf"{name} differs from the file that was committed") as err:
        run(interrupted)
    assert f"delete {interrupted}" in str(err.value) and "\n" not in str(err.value)
    assert {p.name: p.read_bytes() for p in interrupted.iterdir() if p.suffix != ".tmp"} == before  # not touched


def forge_marker(state: Path, change) -> None:
    """Rewrite the committed marker with ``change(marker)`` applied (and the hashes made to match)."""
    path = state / "progress.json"
    marker = json.loads(path.read_text())
    change(marker)
    path.write_text(json.dumps(marker))


@pytest.mark.parametrize("where", ["absolute", "parent", "symlink", "block"])
def test_paths_outside_the_checkpoint_directory_are_refused(interrupted, tmp_path, where):
    """``progress.json`` naming a file outside its directory (with the right hash, so that it would be used)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    moved = "block_0000.pt" if where == "block" else "inputs_fit_0001.pt"
    shutil.copy(interrupted / moved, outside / moved)
    digest = checkpoint.file_digest(outside / moved)
    name = {"absolute": str(outside / moved), "parent": f"../outside/{moved}"}.get(where, moved)
    if where == "symlink":  # the marker's name is its own; the file is a link leading out
        (interrupted / moved).unlink()
        (interrupted / moved).symlink_to(outside / moved)

    def change(marker):
        if where == "block":
            marker["blocks"][0] = f"../outside/{moved}"
            marker["hashes"][f"../outside/{moved}"] = digest
        else:
            marker["inputs"]["fit"] = name
            marker["hashes"][name] = digest

    forge_marker(interrupted, change)
    with pytest.raises(checkpoint.CheckpointCorrupt, match="not a file of its own directory") as err:
        run(interrupted)
    assert repr(name if where != "block" else f"../outside/{moved}") in str(err.value)
    assert "delete" in str(err.value)


def test_an_unloadable_file_is_one_clear_error_naming_it(interrupted):
    """A planted pickle (``weights_only=True`` refuses to run it) with a forged hash: one line naming the file."""
    import pickle

    class Planted:
        def __reduce__(self):
            return (print, ("planted code ran",))

    for name in ("inputs_fit_0001.pt", "block_0000.pt"):
        path = interrupted / name
        kept = path.read_bytes()
        path.write_bytes(pickle.dumps(Planted(), protocol=2))
        forge_marker(interrupted, lambda m, path=path: m["hashes"].update({path.name: checkpoint.file_digest(path)}))
        with pytest.raises(checkpoint.CheckpointCorrupt, match=rf"{name} cannot be loaded \(UnpicklingError: "):
            run(interrupted)
        path.write_bytes(kept)
        forge_marker(interrupted, lambda m, path=path: m["hashes"].update({path.name: checkpoint.file_digest(path)}))


def test_to_plain_handles_nested_dataclasses_and_tuples():
    @dataclass(frozen=True)
    class Inner:
        nm: tuple[int, int] | None = (2, 4)
        dtype: torch.dtype = torch.float32

    @dataclass
    class Outer:
        inner: Inner
        names: tuple[str, ...] = ("a", "b")
        extra: dict | None = None

    plain = to_plain(Outer(Inner(), extra={"x": (1, Inner(nm=None))}))
    assert plain == {
        "type": "Outer",
        "inner": {"type": "Inner", "nm": [2, 4], "dtype": "torch.float32"},
        "names": ["a", "b"],
        "extra": {"x": [1, {"type": "Inner", "nm": None, "dtype": "torch.float32"}]},
    }
    assert json.loads(json.dumps(plain)) == plain


def test_job_refuses_another_model_or_dtype_and_rekeys_the_dense_perplexity(saved_tiny, tiny_tokenizer, tmp_path):
    from sparseswaps_prune.llm.data import load_eval_tokens
    from sparseswaps_prune.llm.evaluate import perplexity
    from sparseswaps_prune.llm.models import load_model

    other = tmp_path / "other-llama"
    tiny_model("llama", seed=1).save_pretrained(other)
    tiny_tokenizer.save_pretrained(other)
    base = {"model": str(saved_tiny), "prune": options(), "nsamples": 2, "seqlen": 16, "holdout": 2, "batch_size": 2,
            "eval_warmstart": False}  # fmt: skip
    out = tmp_path / "out"
    with crash_on_call(pipeline, "_prune_block", 2, Crash):
        run_job(JobConfig(**base, eval_windows=2), out, progress=False)
    dense_two = json.loads((out / STATE_DIR / "dense.json").read_text())["perplexity"]

    with pytest.raises(ValueError, match=r"another model \(weights differ\).*delete .*--out"):
        run_job(JobConfig(**base | {"model": str(other)}, eval_windows=2), out, progress=False)
    with pytest.raises(ValueError, match=r"another dtype \(float32 -> bfloat16\)"):
        run_job(JobConfig(**base, eval_windows=2, dtype="bfloat16"), out, progress=False)
    with pytest.raises(ValueError, match=r"other options: spec\.budget\.sparsity 0\.6 -> 0\.5"):
        run_job(JobConfig(**base | {"prune": options(sparsity=0.5)}, eval_windows=2), out, progress=False)
    with pytest.raises(ValueError, match=r"other settings: batch_size 2 -> 1"):
        run_job(JobConfig(**base | {"batch_size": 1}, eval_windows=2), out, progress=False)

    report = run_job(JobConfig(**base, eval_windows=3), out, progress=False)  # resumes; the dense ppl is re-measured
    model, tokenizer = load_model(str(saved_tiny))
    expected = perplexity(model, load_eval_tokens("builtin", tokenizer), 16, batch_size=2, max_windows=3)
    assert report["perplexity"]["dense"] == pytest.approx(expected, rel=1e-6)
    assert report["perplexity"]["dense"] != pytest.approx(dense_two, rel=1e-9)
