"""The out-of-core block-wise path (llm/streaming.py) and layer-parallel ranks (llm/distributed.py), against the
in-memory pipeline on tiny random models saved as sharded safetensors."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from sparseswaps_prune.core.spec import build_spec
from sparseswaps_prune.llm import pipeline, streaming
from sparseswaps_prune.llm.checkpoint import CheckpointMismatch
from sparseswaps_prune.llm.distributed import plan_work
from sparseswaps_prune.llm.io import readers
from sparseswaps_prune.llm.io.writers import ShardedWriter
from sparseswaps_prune.llm.models import tiny_model
from sparseswaps_prune.llm.pipeline import PruneOptions, finalize, prune_model
from sparseswaps_prune.llm.streaming import prune_checkpoint
from sparseswaps_prune.modules import PrunableLayer
from sparseswaps_prune.recipes import RECIPES
from tests.llm.helpers import saved_tensors

SHARD = "1MB"  # the tiny models' embeddings (12.6 MB) get shards of their own, the blocks share one

REFIT = RECIPES["sparseswaps-refit"].spec  # Wanda -> SparseSwaps T=10 -> least-squares re-fit


def calib(n: int = 2, seqlen: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 3000, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def assert_same_checkpoint(a: Path, b: Path) -> None:
    """Same tensors (names, dtypes, bits), same shard layout and config."""
    ta, tb = saved_tensors(a), saved_tensors(b)
    assert ta.keys() == tb.keys()
    for key in ta:
        assert ta[key].dtype == tb[key].dtype and torch.equal(ta[key], tb[key]), key
    weights = [n for n in sorted(os.listdir(a)) if n.startswith("model")]
    assert weights == [n for n in sorted(os.listdir(b)) if n.startswith("model")]
    if "model.safetensors.index.json" in weights:
        assert json.loads((a / weights[-1]).read_text()) == json.loads((b / weights[-1]).read_text())
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())


def timeless(reports: list) -> list:
    """Layer reports without their timings (the only fields two runs may differ in)."""
    return [dataclasses.replace(r, seconds_mask=0.0, seconds_weights=0.0) for r in reports]


def save_source(path: Path, arch: str, dtype: torch.dtype = torch.float32, **overrides) -> Path:
    tiny_model(arch, **overrides).to(dtype).save_pretrained(path, max_shard_size=SHARD)
    return path


def in_memory(source: Path, out: Path, options: PruneOptions, dtype: torch.dtype, **kwargs):
    """What the job does: from_pretrained, prune_model, finalize, save_pretrained."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).eval()
    result = prune_model(model, calib(), options, progress=False, **kwargs)
    finalize(model)
    model.save_pretrained(out, max_shard_size=SHARD)
    return model, result


@pytest.mark.parametrize(
    ("arch", "weights", "stored", "dtype"),
    [
        ("llama", "keep", torch.float32, torch.float32),
        ("llama", None, torch.float32, torch.float32),  # the default spec (re-fit, held-out guard)
        ("qwen2", "keep", torch.bfloat16, torch.bfloat16),  # bf16 kept as stored (dtype=None)
        ("mistral", "keep", torch.bfloat16, torch.float32),  # bf16 stored, pruned in fp32
        ("gemma2", "keep", torch.float32, torch.float32),  # tied embeddings
        ("opt", "keep", torch.float32, torch.float32),
        ("gpt2", None, torch.float32, torch.float32),  # Conv1D layers, tied embeddings
    ],
)
def test_streaming_equals_in_memory_bit_for_bit(tmp_path, arch, weights, stored, dtype):
    source = save_source(tmp_path / "src", arch, stored)
    spec = build_spec(REFIT, max_iters=1) if weights is None else build_spec(REFIT, max_iters=1, weights=weights)
    options = PruneOptions(spec=spec)
    held = calib(2, seed=1) if weights is None else None
    model, result = in_memory(source, tmp_path / "mem", options, dtype, holdout_tokens=held)
    streamed = prune_checkpoint(
        source,
        tmp_path / "stream",
        calib(),
        options,
        dtype=None if dtype == stored else dtype,
        holdout_tokens=held,
        max_shard_size=SHARD,
        progress=False,
    )
    assert_same_checkpoint(tmp_path / "mem", tmp_path / "stream")
    assert timeless(streamed.layers) == timeless(result.layers)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "stream")
    assert reloaded.dtype == dtype
    expected = model.state_dict()
    for key, value in reloaded.state_dict().items():
        assert torch.equal(value, expected[key]), key
    modules = dict(reloaded.named_modules())
    for report in streamed.layers:  # exact zeros where the masks prune
        weight = PrunableLayer(report.name, modules[report.name]).weight_2d()
        assert not weight[~result.masks[report.name]].any()


def test_one_block_in_memory_at_a_time_and_report(tmp_path, monkeypatch):
    source = save_source(tmp_path / "src", "llama", num_hidden_layers=3)
    seen = []
    original = pipeline._process_block

    def spy(run, index, *args, **kwargs):
        model_blocks = [any(p.device.type != "meta" for p in block.parameters()) for block in run.blocks]
        seen.append((index, model_blocks, spy.model.lm_head.weight.device.type, spy.model.model.embed_tokens))
        return original(run, index, *args, **kwargs)

    real_skeleton = streaming.empty_model

    def skeleton(*args, **kwargs):
        spy.model = real_skeleton(*args, **kwargs)
        return spy.model

    monkeypatch.setattr(streaming, "empty_model", skeleton)
    monkeypatch.setattr(pipeline, "_process_block", spy)
    options = PruneOptions(spec=build_spec(REFIT, max_iters=1, weights="keep"))
    result = prune_checkpoint(source, tmp_path / "out", calib(), options, max_shard_size=SHARD, progress=False)
    assert [s[0] for s in seen] == [0, 1, 2]
    for index, loaded, head_device, embeddings in seen:
        assert loaded == [k == index for k in range(3)]  # only the block being pruned holds weights
        assert head_device == "meta"  # the untied lm_head is never loaded
        assert embeddings.weight.device.type == "meta"  # the embeddings are dropped after the capture
    report = result.report
    files = sorted(os.listdir(tmp_path / "out"))
    assert sorted(result.files) == files
    assert report["bytes_written"] == sum((tmp_path / "out" / name).stat().st_size for name in files)
    assert report["bytes_read"] == sum(t.numel() * t.element_size() for t in saved_tensors(source).values())
    block = tiny_model("llama").model.layers[0]
    assert report["block_bytes"] == sum(p.numel() * 4 for p in block.parameters())
    assert report["embedding_bytes"] == 49152 * 64 * 4 + 64 * 4  # embeddings + final norm
    assert [b["block"] for b in report["blocks"]] == [0, 1, 2]
    assert all(b["seconds"] > 0 and b["peak_rss_bytes"] >= b["rss_bytes"] > 0 for b in report["blocks"])
    assert report["peak_rss_bytes"] >= report["blocks"][-1]["peak_rss_bytes"]
    assert report["peak_rss_since"] in ("call", "process") and report["world_size"] == 1


def test_single_file_checkpoint_other_files_and_stale_shards(tmp_path):
    source = tmp_path / "src"
    tiny_model("gpt2").save_pretrained(source)  # one model.safetensors, no index
    (source / "tokenizer.json").write_text('{"made": "by the test"}')
    out = tmp_path / "out"
    out.mkdir()
    (out / "model-00001-of-00009.safetensors").write_bytes(b"stale")  # an earlier save's shard
    (out / "notes.txt").write_text("kept")
    options = PruneOptions(spec=build_spec(REFIT, max_iters=1, weights="keep"))
    result = prune_checkpoint(source, out, calib(), options, progress=False)
    assert "model.safetensors.index.json" not in result.files
    assert sorted(os.listdir(out)) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", "notes.txt", "tokenizer.json"]
    )
    assert (out / "tokenizer.json").read_text() == '{"made": "by the test"}'
    model, _ = in_memory(source, tmp_path / "mem", options, torch.float32)
    saved = saved_tensors(out)
    for key, value in model.state_dict().items():
        if key != "lm_head.weight":  # tied to the embeddings: saved once
            assert torch.equal(saved[key], value), key


def test_refusals_write_nothing(tmp_path):
    source = save_source(tmp_path / "src", "llama")
    options = PruneOptions(spec=build_spec(REFIT, max_iters=1))
    with pytest.raises(ValueError, match="source directory"):
        prune_checkpoint(source, source, calib(), options, progress=False)
    with pytest.raises(ValueError, match="no linear layer"):
        prune_checkpoint(source, tmp_path / "a", calib(), PruneOptions(include=["*.nothing"]), progress=False)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        prune_checkpoint(tmp_path / "a", tmp_path / "b", calib(), options, progress=False)
    index = json.loads((source / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight is not in the checkpoint"):
        prune_checkpoint(source, tmp_path / "c", calib(), options, progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_sharded_writer_any_order_and_incomplete(tmp_path):
    gen = torch.Generator().manual_seed(0)
    data = {
        "a.weight": torch.randn(10, 30, generator=gen),  # 1200 bytes: over the limit, a shard of its own
        "b.weight": torch.randn(40, generator=gen).to(torch.bfloat16),
        "c.mask": torch.rand(7, 5, generator=gen) > 0.5,
        "d.count": torch.tensor(3, dtype=torch.int64),
    }
    plan = [(k, v.dtype, tuple(v.shape)) for k, v in data.items()]
    writer = ShardedWriter(tmp_path / "w", plan, 200)
    for key in reversed(list(data)):
        writer.write(key, data[key])
    with pytest.raises(ValueError, match="already written"):
        writer.write("a.weight", data["a.weight"])
    files = writer.close()
    assert files == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    index = json.loads((tmp_path / "w" / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["a.weight"] == files[0] and index["weight_map"]["d.count"] == files[1]
    back = saved_tensors(tmp_path / "w")
    assert back.keys() == data.keys() and all(
        torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in data.items()
    )
    incomplete = ShardedWriter(tmp_path / "x", plan, "1KB")
    with pytest.raises(ValueError, match="planned"):
        incomplete.write("b.weight", data["b.weight"].float())
    incomplete.write("a.weight", data["a.weight"])
    with pytest.raises(ValueError, match="never written"):
        incomplete.close()
    assert os.listdir(tmp_path / "x") == []


def owners(layers, world_size):
    """The rank of each whole layer in :func:`plan_work`'s plan without row shards."""
    return [unit.rank for unit in plan_work(layers, world_size)]


def test_whole_layers_are_balanced_by_cost():
    model = tiny_model("llama")
    from sparseswaps_prune.modules import find_layers

    layers = find_layers(model.model.layers[0], prefix="b")  # q k v o (64 in), gate up (64 in), down (128 in)
    ranks = owners(layers, 2)
    assert ranks == owners(layers, 2) and set(ranks) == {0, 1}
    down = [layer.name for layer in layers].index("b.mlp.down_proj")
    assert ranks.count(ranks[down]) < ranks.count(1 - ranks[down])  # the costliest layer's rank gets fewer
    assert owners(layers, 1) == [0] * len(layers)


def _ranks_worker(rank: int, world_size: int, tmp: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world_size)
    try:
        options = PruneOptions(spec=build_spec(REFIT, max_iters=1), block_tune_epochs=0)  # as the one process it equals
        model = AutoModelForCausalLM.from_pretrained(f"{tmp}/src").eval()
        result = prune_model(model, calib(), options, progress=False, holdout_tokens=calib(2, seed=1), distributed=True)
        finalize(model)
        torch.save({"state": model.state_dict(), "masks": result.masks, "layers": result.layers}, f"{tmp}/mem{rank}.pt")
        held = calib(2, seed=1)
        streamed = prune_checkpoint(
            f"{tmp}/src",
            f"{tmp}/stream",
            calib(),
            options,
            holdout_tokens=held,
            max_shard_size=SHARD,
            distributed=True,
            progress=False,
        )
        torch.save({"layers": streamed.layers, "files": streamed.files, "report": streamed.report}, f"{tmp}/s{rank}.pt")
        _interrupt_and_resume(rank, Path(tmp))
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_equal_one_process(tmp_path):
    """In memory and streamed, and streamed with a checkpoint, stopped in block 2 and resumed (one spawn: a process
    start costs seconds)."""
    source = save_source(tmp_path / "src", "llama", num_hidden_layers=3)
    # untuned: block tuning's backward passes round differently with another number of threads per process
    options = PruneOptions(spec=build_spec(REFIT, max_iters=1), block_tune_epochs=0)
    model, result = in_memory(source, tmp_path / "one", options, torch.float32, holdout_tokens=calib(2, seed=1))
    mp.spawn(_ranks_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    expected = model.state_dict()
    for rank in (0, 1):
        got = torch.load(tmp_path / f"mem{rank}.pt", weights_only=False)
        assert got["state"].keys() == expected.keys()
        assert all(torch.equal(got["state"][k], v) for k, v in expected.items())
        assert all(torch.equal(got["masks"][k], v) for k, v in result.masks.items())
        assert timeless(got["layers"]) == timeless(result.layers)
        s = torch.load(tmp_path / f"s{rank}.pt", weights_only=False)
        assert timeless(s["layers"]) == timeless(result.layers)
        assert s["report"]["world_size"] == 2 and s["report"]["rank"] == rank
        assert (s["files"] != []) == (rank == 0)  # rank 0 writes
    assert_same_checkpoint(tmp_path / "one", tmp_path / "stream")
    for rank in (0, 1):
        got = torch.load(tmp_path / f"r{rank}.pt", weights_only=False)
        assert got["recorded"]["next_block"] == 2 and "fit.rank1" in got["recorded"]["inputs"]
        assert got["calls"] == [2]  # blocks 0 and 1 are not pruned again on either rank
        assert timeless(got["layers"]) == timeless(result.layers)
    assert files_of(tmp_path / "resumed") == files_of(tmp_path / "stream")
    assert not (tmp_path / "ckpt").exists()


# ---------------------------------------------------------------- resuming an interrupted call (checkpoint_dir)

N_BLOCKS = 4
RESUME_OPTIONS = PruneOptions(
    spec=build_spec(REFIT, max_iters=1), block_tune_epochs=0
)  # untuned: the call counts are those of the pruned streams


class Crash(KeyboardInterrupt):
    """Stands in for a kill or Ctrl-C."""


def count_blocks(patch: pytest.MonkeyPatch, crash_at: int | None = None) -> list[int]:
    """Record the index of every block ``pipeline._process_block`` is called on; raise :class:`Crash` instead of
    running the ``crash_at``-th call (1-based). Returns the growing list of indices."""
    original, calls = pipeline._process_block, []

    def step(run, index, *args, **kwargs):
        calls.append(index)
        if len(calls) == crash_at:
            raise Crash
        return original(run, index, *args, **kwargs)

    patch.setattr(pipeline, "_process_block", step)
    return calls


def stream(source: Path, out: Path, checkpoint_dir: Path | None, **changes):
    kwargs = {"options": RESUME_OPTIONS, "holdout_tokens": calib(2, seed=1), "max_shard_size": SHARD} | changes
    return prune_checkpoint(source, out, calib(), progress=False, checkpoint_dir=checkpoint_dir, **kwargs)


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def resume_case(tmp_path_factory):
    """A 4-block llama source, the output of an uninterrupted call without a checkpoint, and the output and
    checkpoint directories of a call stopped while pruning block 2 (blocks 0 and 1 recorded)."""
    root = tmp_path_factory.mktemp("resume")
    source = save_source(root / "src", "llama", num_hidden_layers=N_BLOCKS)
    reference = stream(source, root / "reference", None)
    with pytest.MonkeyPatch.context() as patch:
        count_blocks(patch, crash_at=3)
        with pytest.raises(Crash):
            stream(source, root / "out", root / "ckpt")
    return {"source": source, "reference": reference, "root": root}


@pytest.fixture
def interrupted_run(resume_case, tmp_path):
    """A copy of the stopped call's output and checkpoint directories: ``(source, out, checkpoint_dir)``."""
    shutil.copytree(resume_case["root"] / "out", tmp_path / "out")
    shutil.copytree(resume_case["root"] / "ckpt", tmp_path / "ckpt")
    return resume_case["source"], tmp_path / "out", tmp_path / "ckpt"


def test_interrupted_call_resumes_to_the_same_files_and_reports(resume_case, interrupted_run, monkeypatch):
    source, out, state = interrupted_run
    progress = json.loads((state / "progress.json").read_text())
    assert progress["next_block"] == 2 and progress["blocks"] == ["block_0000.pt", "block_0001.pt"]
    assert all(name.endswith(".partial") for name in os.listdir(out))  # nothing renamed yet
    saved = torch.load(state / "block_0001.pt", weights_only=True)
    assert sorted(saved) == ["reports", "tune"]  # the reports only: the block's weights are in the shards
    calls = count_blocks(monkeypatch)
    resumed = stream(source, out, state)
    assert calls == [2, 3]  # blocks 0 and 1 are not pruned again, and nothing is captured
    reference_dir = resume_case["root"] / "reference"
    assert files_of(out) == files_of(reference_dir)  # byte for byte
    assert timeless(resumed.layers) == timeless(resume_case["reference"].layers)
    assert sorted(resumed.files) == sorted(resume_case["reference"].files)
    assert resumed.report["first_block"] == 2 and [b["block"] for b in resumed.report["blocks"]] == [2, 3]
    assert resumed.report["embedding_bytes"] == 0
    assert not state.exists()  # the checkpoint is removed on success


def test_interrupted_close_resumes(resume_case, interrupted_run, monkeypatch):
    """A call stopped after renaming some of its shards (all blocks recorded) finishes them on the next call."""
    source, out, state = interrupted_run
    original, renamed = os.replace, []

    def replace(src, dst):
        original(src, dst)
        if str(src).endswith(".partial"):
            renamed.append(dst)
            raise Crash

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", replace)
        with pytest.raises(Crash):
            stream(source, out, state)
    assert len(renamed) == 1 and json.loads((state / "progress.json").read_text())["next_block"] == N_BLOCKS
    calls = count_blocks(monkeypatch)
    resumed = stream(source, out, state)
    assert calls == []
    assert files_of(out) == files_of(resume_case["root"] / "reference")
    assert timeless(resumed.layers) == timeless(resume_case["reference"].layers)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            {"options": PruneOptions(spec=build_spec(REFIT, max_iters=2), block_tune_epochs=0)},
            r"other options: spec\.refine\.max_iters 1 -> 2",
        ),
        ({"holdout_tokens": calib(2, seed=2)}, "other holdout windows"),
        ({"max_shard_size": "2MB"}, r"other settings: max_shard_size 1000000 -> 2000000"),
        ({"dtype": torch.bfloat16}, r"another dtype \(float32 -> bfloat16\)"),
        ({"batch_size": 2}, r"other settings: batch_size 1 -> 2"),
    ],
)
def test_resume_of_another_run_is_refused_before_writing(interrupted_run, change, match):
    source, out, state = interrupted_run
    before = files_of(out), files_of(state)
    with pytest.raises(CheckpointMismatch, match=match) as err:
        stream(source, out, state, **change)
    assert f"delete {state}" in str(err.value)
    assert (files_of(out), files_of(state)) == before  # nothing touched


def test_resume_of_another_model_or_missing_shards_is_refused(interrupted_run, tmp_path):
    source, out, state = interrupted_run
    other = save_source(tmp_path / "other", "llama", num_hidden_layers=N_BLOCKS, seed=1)
    before = files_of(out), files_of(state)
    with pytest.raises(CheckpointMismatch, match=r"another model \(weights differ\)"):
        stream(other, out, state)
    partial = sorted(out.iterdir())[-1]
    partial.rename(tmp_path / partial.name)
    with pytest.raises(CheckpointMismatch, match=rf"records blocks 0-1 .*{partial.name} is missing.*delete {state}"):
        stream(source, out, state)
    (tmp_path / partial.name).rename(partial)
    assert (files_of(out), files_of(state)) == before


@pytest.mark.parametrize("fault", ["inputs_fit_0002.pt", "block_0001.pt", "outside", "older"])
def test_resume_of_an_altered_checkpoint_is_refused_before_writing(interrupted_run, fault):
    """Issue 47: the block-wise path's checkpoint carries the same hashes (``commit_block``): one flipped byte in its
    inputs or in a block file, a marker naming a file outside the directory, or a marker of the previous format
    (no hashes) stops the resume, naming the file, before anything is written."""
    source, out, state = interrupted_run
    marker = json.loads((state / "progress.json").read_text())
    assert set(marker["hashes"]) == {"block_0000.pt", "block_0001.pt", "inputs_fit_0002.pt", "inputs_holdout_0002.pt"}
    if fault == "outside":
        marker["blocks"][1] = "/etc/hostname"
        match = "names '/etc/hostname' as a block file, which is not a file of its own directory"
    elif fault == "older":
        marker = {k: v for k, v in marker.items() if k != "hashes"} | {"format": 2}
        match = r"older version \(its files carry no content hashes\)"
    else:
        data = bytearray((state / fault).read_bytes())
        data[-100] ^= 0xFF
        (state / fault).write_bytes(bytes(data))
        match = rf"{fault} differs from the file that was committed"
    (state / "progress.json").write_text(json.dumps(marker))
    before = files_of(out), files_of(state)
    with pytest.raises(CheckpointMismatch, match=match) as err:
        stream(source, out, state)
    assert f"delete {state}" in str(err.value)
    assert (files_of(out), files_of(state)) == before  # nothing touched


def _interrupt_and_resume(rank: int, tmp: Path) -> None:
    """On every rank: a streamed call with a checkpoint stops while pruning block 2, then the same call resumes."""
    import torch.distributed as dist

    source, out, state = tmp / "src", tmp / "resumed", tmp / "ckpt"
    with pytest.MonkeyPatch.context() as patch:
        count_blocks(patch, crash_at=3)
        with pytest.raises(Crash):
            stream(source, out, state, distributed=True)
    dist.barrier()
    recorded = json.loads((state / "progress.json").read_text())
    with pytest.MonkeyPatch.context() as patch:
        calls = count_blocks(patch)
        result = stream(source, out, state, distributed=True)
    torch.save({"recorded": recorded, "calls": calls, "layers": result.layers}, tmp / f"r{rank}.pt")


# ---------------------------------------------------------------- GGUF: the packaged default model, block by block

# One layer in each of blocks 0 and 1 (the stream still reads, forwards and writes all 30 blocks).
GGUF_OPTIONS = PruneOptions(
    spec=build_spec(REFIT, max_iters=1, weights="keep"),
    include=["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.o_proj"],
)


@pytest.fixture(scope="module")
def gguf_case(tmp_path_factory, default_lm):
    """The packaged SmolLM2 GGUF (30 blocks; one layer of blocks 0 and 1 pruned) in memory (``load_model``, a copy
    of the session's ``default_lm``, + ``prune_model`` + ``finalize`` + ``save_pretrained``, and the tokenizer) and
    block by block from the GGUF (the same run records which blocks and whether the embeddings held weights when each
    block was pruned, and keeps its reader); one run each."""
    root = tmp_path_factory.mktemp("gguf")
    model, tokenizer = copy.deepcopy(default_lm[0]), default_lm[1]
    loaded = {key: value.clone() for key, value in model.state_dict().items()}
    result = prune_model(model, calib(), GGUF_OPTIONS, progress=False)
    finalize(model)
    model.save_pretrained(root / "mem")
    tokenizer.save_pretrained(root / "mem")
    del model
    seen, readers, skeletons = [], [], []
    original_step, original_open, original_skeleton = (
        pipeline._process_block,
        streaming.open_checkpoint,
        streaming.empty_model,
    )

    def step(run, index, *args, **kwargs):
        held = [k for k, block in enumerate(run.blocks) if any(p.device.type != "meta" for p in block.parameters())]
        seen.append((index, held, skeletons[-1].model.embed_tokens.weight.device.type))
        return original_step(run, index, *args, **kwargs)

    def open_checkpoint(*args, **kwargs):
        readers.append(original_open(*args, **kwargs))
        return readers[-1]

    def skeleton(*args, **kwargs):
        skeletons.append(original_skeleton(*args, **kwargs))
        return skeletons[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline, "_process_block", step)
        patch.setattr(streaming, "open_checkpoint", open_checkpoint)
        patch.setattr(streaming, "empty_model", skeleton)
        streamed = prune_checkpoint(None, root / "stream", calib(), GGUF_OPTIONS, progress=False)
    return {"root": root, "loaded": loaded, "result": result, "streamed": streamed, "seen": seen, "reader": readers[0]}


def test_gguf_reader_equals_from_pretrained(gguf_case):
    """Every tensor the reader gives (de-quantized, q/k rows un-permuted) is the one ``load_model`` loads."""
    reader, loaded = gguf_case["reader"], gguf_case["loaded"]
    assert isinstance(reader, readers.GGUFCheckpoint)
    assert sorted(reader.shapes) == sorted(set(loaded) - {"lm_head.weight"})  # tied to the embeddings
    before = reader.bytes_read
    got = reader.read(reversed(list(reader.shapes)))
    assert reader.bytes_read - before == sum(t.numel() * t.element_size() for t in got.values())
    for key, value in got.items():
        assert value.dtype == loaded[key].dtype and torch.equal(value, loaded[key]), key
        assert reader.shapes[key] == ("F32", list(value.shape))
    single = reader.read(["model.layers.7.self_attn.k_proj.weight"])  # one tensor alone: the same
    assert torch.equal(
        single["model.layers.7.self_attn.k_proj.weight"], loaded["model.layers.7.self_attn.k_proj.weight"]
    )


def test_gguf_streaming_equals_in_memory_bit_for_bit(gguf_case):
    root, streamed = gguf_case["root"], gguf_case["streamed"]
    assert_same_checkpoint(root / "mem", root / "stream")  # tensors, shard layout and config.json (use_cache false)
    assert files_of(root / "stream") == files_of(root / "mem")  # byte for byte, tokenizer files included
    assert sorted(streamed.files) == sorted(os.listdir(root / "stream"))
    assert timeless(streamed.layers) == timeless(gguf_case["result"].layers)
    assert [r.name for r in streamed.layers] == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.o_proj"]
    # One block holds weights at a time; the embeddings and the other blocks are on meta while it is pruned.
    assert gguf_case["seen"] == [(index, [index], "meta") for index in range(30)]
    assert streamed.report["embedding_bytes"] == 49152 * 576 * 4 + 576 * 4


def test_gguf_sources_named_as_load_model_names_them(tmp_path):
    from sparseswaps_prune.llm.models import default_gguf_path

    path = Path(default_gguf_path())
    with pytest.raises(ValueError, match="already names its GGUF file"):
        readers.open_checkpoint(None, gguf_file=path.name)
    with pytest.raises(FileNotFoundError, match="not found in directory"):
        readers.open_checkpoint(tmp_path, gguf_file="missing.gguf")
    with pytest.raises(FileNotFoundError, match="local files only"):
        readers.open_checkpoint("HuggingFaceTB/SmolLM2-135M-GGUF", gguf_file=path.name)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        prune_checkpoint(tmp_path / "x.gguf", tmp_path / "out", calib(), GGUF_OPTIONS, progress=False)
    assert not (tmp_path / "out").exists()
