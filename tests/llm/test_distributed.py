"""Calibration windows split into shards (``PruneOptions.calib_shards``) and across gloo ranks (llm/distributed.py):
one process with S shards equals W processes with the same S shards, bit for bit, and each rank holds only its
windows. Layers divided by rows across ranks (``PruneOptions.row_shards``, ``plan_work``) equal one process too."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from sparseswaps_prune.cli import main
from sparseswaps_prune.core.gram import GramAccumulator
from sparseswaps_prune.core.spec import build_spec
from sparseswaps_prune.llm import pipeline
from sparseswaps_prune.llm.capture import BlockInputs, capture_block_inputs
from sparseswaps_prune.llm.checkpoint import CheckpointMismatch
from sparseswaps_prune.llm.distributed import (
    TORCHRUN_ENV,
    WindowShards,
    WorkUnit,
    init_from_env,
    plan_work,
    sum_shard_grams,
)
from sparseswaps_prune.llm.job import JobConfig
from sparseswaps_prune.llm.models import tiny_model
from sparseswaps_prune.llm.pipeline import PruneOptions, finalize, prune_model
from sparseswaps_prune.llm.streaming import prune_checkpoint
from sparseswaps_prune.modules import find_blocks
from sparseswaps_prune.recipes import RECIPES
from tests.llm.helpers import saved_tensors

SHARD = "1MB"
N_CALIB, N_HOLDOUT = 7, 4  # in batches of 2: the last calibration batch is short

REFIT = RECIPES["sparseswaps-refit"].spec  # Wanda -> SparseSwaps T=10 -> least-squares re-fit


def calib(n: int = N_CALIB, seqlen: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 3000, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def timeless(reports: list) -> list:
    return [dataclasses.replace(r, seconds_mask=0.0, seconds_weights=0.0) for r in reports]


def options(shards: int) -> PruneOptions:
    return PruneOptions(
        spec=build_spec(REFIT, max_iters=1), calib_shards=shards, block_tune_epochs=0 if shards > 1 else 5
    )


def test_window_shards_split_whole_batches_in_order():
    split = WindowShards(n_windows=9, batch_size=2, n_shards=2)  # 5 batches, the last one short
    assert split.num_batches == 5 and split.starts == [0, 2, 5] and split.owners == [0, 0] and split.own == [0, 1]
    assert split.rows == slice(0, 9) and split.local_batches(1) == range(2, 5)
    one, two = (WindowShards(9, 2, 4, world_size=2, rank=r) for r in (0, 1))
    assert one.starts == [0, 1, 2, 3, 5] and one.owners == [0, 0, 1, 1]
    assert one.own == [0, 1] and one.rows == slice(0, 4) and one.local_batches(1) == range(1, 2)
    assert two.own == [2, 3] and two.rows == slice(4, 9) and two.local_batches(3) == range(1, 3)
    assert WindowShards(9, 2, 3, world_size=2, rank=1).owners == [0, 0, 1]
    # One shard: nothing split, every rank holds every window.
    assert WindowShards(9, 2, 1, world_size=4, rank=3).own == [0] and WindowShards(9, 2, 1, 4, 3).rows == slice(0, 9)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_shards": 0}, "calib_shards must be a positive int"),
        ({"n_shards": 4, "batch_size": 3}, r"calib_shards=4 .* make only 3 batches; use calib_shards <= 3"),
        ({"n_shards": 2, "world_size": 4}, r"calib_shards=2 is fewer than the 4 ranks.*use calib_shards >= 4"),
    ],
)
def test_window_shards_errors_name_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WindowShards(**({"n_windows": 8, "batch_size": 1} | kwargs))


def test_options_and_job_check_calib_shards():
    with pytest.raises(ValueError, match="calib_shards must be a positive int"):
        PruneOptions(calib_shards=0).validate()
    with pytest.raises(ValueError, match="held-out windows"):
        JobConfig(nsamples=8, holdout=2, batch_size=1, prune=PruneOptions(calib_shards=4)).validate()
    JobConfig(nsamples=8, holdout=4, batch_size=1, prune=PruneOptions(calib_shards=4)).validate()
    assert PruneOptions.from_dict(options(3).to_dict()) == options(3)
    with pytest.raises(ValueError, match=r"calib_shards=4 .*held-out"):
        prune_model(tiny_model("llama").eval(), calib(), options(4), progress=False, holdout_tokens=calib(3, seed=1))


def test_block_inputs_select_is_a_view_of_whole_batches():
    model = tiny_model("llama").eval()
    _, blocks = find_blocks(model)
    inputs = capture_block_inputs(model, blocks, calib(5), batch_size=2)
    part = inputs.select(range(1, 3))
    assert part.num_samples == 3 and part.num_batches == 2 and part.block_kwargs == inputs.block_kwargs[1:3]
    assert part.hidden_states.data_ptr() == inputs.hidden_states[2].data_ptr()
    assert inputs.select(range(3)) is inputs
    for bad in (range(0), range(2, 4), range(0, 3, 2)):
        with pytest.raises(ValueError, match="contiguous part"):
            inputs.select(bad)
    # The batches of a capture of some windows are those of a capture of all of them.
    tail = capture_block_inputs(model, blocks, calib(5)[2:], batch_size=2)
    assert torch.equal(tail.hidden_states, part.hidden_states[:3]) and isinstance(tail, BlockInputs)


def test_sum_shard_grams_folds_in_shard_order():
    xs = [torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    partials = {}
    for s, x in enumerate(xs):
        partials[s] = {"a": GramAccumulator(8, track_sum=True)}
        partials[s]["a"].add(x)
    expected = (xs[0].reshape(-1, 8).T @ xs[0].reshape(-1, 8)).clone()
    total = sum_shard_grams(dict(partials), WindowShards(3, 1, 3), None, torch.device("cpu"))["a"]
    fold = partials[0]["a"].gram  # consumed: the first partial holds the sum
    assert total.gram is fold and total.n_tokens == 45 and total.n_sequences == 9
    for x in xs[1:]:
        expected += x.reshape(-1, 8).T @ x.reshape(-1, 8)
    torch.testing.assert_close(total.gram, expected)
    torch.testing.assert_close(total.feature_sum, torch.cat(xs).reshape(-1, 8).sum(0))


def test_one_shard_is_the_default_and_shards_only_reorder_sums():
    held = calib(N_HOLDOUT, seed=1)

    def run(opts: PruneOptions):
        return prune_model(tiny_model("llama").eval(), calib(), opts, progress=False, batch_size=2, holdout_tokens=held)

    base = run(PruneOptions(spec=build_spec(REFIT, max_iters=1)))
    assert timeless(run(options(1)).layers) == timeless(base.layers)
    sharded = run(options(2))
    for got, want in zip(sharded.layers, base.layers, strict=True):
        assert got.name == want.name
        assert got.loss_start == pytest.approx(want.loss_start, rel=1e-4)
        assert got.holdout_start == pytest.approx(want.holdout_start, rel=1e-4)


@contextmanager
def spy_forwards() -> Iterator[list[tuple[int, torch.Tensor]]]:
    """Record ``(block_index, next inputs [n, seqlen, hidden])`` of every ``BlockInputs.run_block`` call."""
    seen: list[tuple[int, torch.Tensor]] = []
    run_block = BlockInputs.run_block

    def spy(self: BlockInputs, block: torch.nn.Module, device: torch.device | str) -> BlockInputs:
        out = run_block(self, block, device)
        seen.append((self.block_index, out.hidden_states.clone()))
        return out

    BlockInputs.run_block = spy
    try:
        yield seen
    finally:
        BlockInputs.run_block = run_block


def _shards_worker(rank: int, world_size: int, tmp: str, shards: int, batch: int, stream: bool) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world_size)
    try:
        model = AutoModelForCausalLM.from_pretrained(f"{tmp}/src").eval()
        with spy_forwards() as seen:
            result = prune_model(model, calib(), options(shards), progress=False, batch_size=batch,
                                 holdout_tokens=calib(N_HOLDOUT, seed=1), distributed=True)  # fmt: skip
        finalize(model)
        out = {"state": model.state_dict(), "masks": result.masks, "warm": result.warmstart_masks,
               "layers": result.layers, "seen": seen}  # fmt: skip
        if stream:
            streamed = prune_checkpoint(f"{tmp}/src", f"{tmp}/stream", calib(), options(shards), batch_size=batch,
                                        holdout_tokens=calib(N_HOLDOUT, seed=1), max_shard_size=SHARD,
                                        distributed=True, progress=False)  # fmt: skip
            out |= {"stream_layers": streamed.layers, "files": streamed.files}
        torch.save(out, f"{tmp}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("world_size", "shards", "batch", "stream"),
    [(1, 2, 2, False), (2, 2, 2, True), (2, 4, 1, False)],  # 2 ranks x 2 shards each, at batch 1
)
def test_ranks_with_shards_equal_one_process_with_the_same_shards(tmp_path, world_size, shards, batch, stream):
    tiny_model("llama", num_hidden_layers=3).save_pretrained(tmp_path / "src", max_shard_size=SHARD)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "src").eval()
    held = calib(N_HOLDOUT, seed=1)
    with spy_forwards() as seen:
        result = prune_model(model, calib(), options(shards), progress=False, batch_size=batch, holdout_tokens=held)
    finalize(model)
    mp.spawn(_shards_worker, args=(world_size, str(tmp_path), shards, batch, stream), nprocs=world_size, join=True)
    expected = model.state_dict()
    got = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]
    for rank, out in enumerate(got):
        assert out["state"].keys() == expected.keys()
        assert all(torch.equal(out["state"][k], v) for k, v in expected.items())
        assert all(torch.equal(out["masks"][k], v) for k, v in result.masks.items())
        assert all(torch.equal(out["warm"][k], v) for k, v in result.warmstart_masks.items())
        assert timeless(out["layers"]) == timeless(result.layers)  # held-out losses included, on every rank
        # Each rank forwards only its own windows (calibration, then held-out, block after block).
        for (block, mine), (_, everything), n, key in zip(
            out["seen"], seen, [N_CALIB, N_HOLDOUT] * 3, ["calibration", "held-out"] * 3, strict=True
        ):
            rows = WindowShards(n, batch, shards, world_size, rank, key).rows
            assert torch.equal(mine, everything[rows]), (block, key)
            assert world_size == 1 or mine.shape[0] < n
        if stream:
            assert timeless(out["stream_layers"]) == timeless(result.layers)
            assert (out["files"] != []) == (rank == 0)
    if stream:
        model.save_pretrained(tmp_path / "one", max_shard_size=SHARD)
        one, streamed = saved_tensors(tmp_path / "one"), saved_tensors(tmp_path / "stream")
        assert one.keys() == streamed.keys() and all(torch.equal(one[k], v) for k, v in streamed.items())


def _resume_worker(rank: int, world_size: int, tmp: str, crash: bool) -> None:
    """Prune with a checkpoint directory; with ``crash``, rank 1 dies (``os._exit``) in the middle of recording
    block 1, after writing its own inputs and before the commit."""
    import datetime
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous{int(crash)}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=60))  # fmt: skip
    save = BlockInputs.save
    if crash and rank == 1:

        def dying_save(self: BlockInputs, path: Path) -> None:
            save(self, path)
            if self.block_index == 2:
                os._exit(1)

        BlockInputs.save = dying_save
    try:
        model = AutoModelForCausalLM.from_pretrained(f"{tmp}/src").eval()
        with spy_forwards() as seen:
            result = prune_model(model, calib(), options(2), progress=False, batch_size=2, distributed=True,
                                 holdout_tokens=calib(N_HOLDOUT, seed=1), checkpoint_dir=f"{tmp}/ckpt")  # fmt: skip
        finalize(model)
        blocks = sorted({block for block, _ in seen})
        torch.save({"state": model.state_dict(), "layers": result.layers, "blocks": blocks}, f"{tmp}/rank{rank}.pt")
    finally:
        BlockInputs.save = save
        dist.destroy_process_group()


def test_ranks_with_a_checkpoint_survive_a_killed_rank_and_resume(tmp_path):
    tiny_model("llama", num_hidden_layers=3).save_pretrained(tmp_path / "src", max_shard_size=SHARD)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "src").eval()
    result = prune_model(
        model, calib(), options(2), progress=False, batch_size=2, holdout_tokens=calib(N_HOLDOUT, seed=1)
    )
    finalize(model)
    with pytest.raises(mp.ProcessExitedException):  # rank 1 killed: the run fails on every rank
        mp.spawn(_resume_worker, args=(2, str(tmp_path), True), nprocs=2, join=True)
    progress = (tmp_path / "ckpt" / "progress.json").read_text()
    assert '"next_block": 1' in progress and "inputs_fit_r1_0001.pt" in progress  # block 0 committed, 1 not
    mp.spawn(_resume_worker, args=(2, str(tmp_path), False), nprocs=2, join=True)
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert out["blocks"] == [1, 2]  # resumed: block 0 was not run again
        assert all(torch.equal(out["state"][k], v) for k, v in model.state_dict().items())
        assert timeless(out["layers"]) == timeless(result.layers)
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert [f for f in files if f.startswith("inputs_")] == [
        f"inputs_{key}_r{r}_0003.pt" for key in ("fit", "holdout") for r in range(2)
    ]
    # the checkpoint of 2 ranks is not resumed by one process (or another number of ranks), before anything runs
    fresh = AutoModelForCausalLM.from_pretrained(tmp_path / "src").eval()
    with pytest.raises(CheckpointMismatch, match="world_size"):
        prune_model(fresh, calib(), options(2), progress=False, batch_size=2, holdout_tokens=calib(N_HOLDOUT, seed=1),
                    checkpoint_dir=tmp_path / "ckpt")  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == files


def _cli(args: list[str], tmp: Path, ranks: int = 0) -> subprocess.CompletedProcess:
    """``sparseswaps prune ...`` in a fresh process (one thread), or under torchrun with ``ranks`` processes."""
    launch = [sys.executable, "-m", "sparseswaps_prune.cli"]
    if ranks:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "-m",
                  "sparseswaps_prune.cli"]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([*launch, *args], capture_output=True, text=True, env=env, cwd=tmp, timeout=600)


def test_torchrun_job_equals_one_process(saved_tiny, tmp_path, capsys, monkeypatch):
    args = ["prune", "--model", str(saved_tiny), "--nsamples", "4", "--holdout", "2", "--batch-size", "1",
            "--calib-shards", "2", "--seqlen", "32", "--eval-windows", "2", "--recipe", "sparseswaps-refit",
            "--max-iters", "2", "--block-tune-epochs", "0", "--quiet"]  # fmt: skip
    one = _cli([*args, "--out", str(tmp_path / "one")], tmp_path)
    assert one.returncode == 0, one.stderr
    two = _cli([*args, "--distributed", "--out", str(tmp_path / "two")], tmp_path, ranks=2)
    assert two.returncode == 0, two.stderr
    assert two.stdout.count("final layer loss") == 1  # rank 0 alone reports
    a, b = saved_tensors(tmp_path / "one"), saved_tensors(tmp_path / "two")
    assert a.keys() == b.keys() and all(torch.equal(a[k], v) for k, v in b.items())
    report_a, report_b = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("one", "two"))
    timeless_totals = [{k: v for k, v in r["totals"].items() if k != "seconds"} for r in (report_a, report_b)]
    assert report_b["perplexity"] == report_a["perplexity"] and timeless_totals[0] == timeless_totals[1]
    assert report_b["config"] == report_a["config"] | {"distributed": True}
    assert not (tmp_path / "two" / ".sparseswaps_state").exists()
    for name in TORCHRUN_ENV:  # not under torchrun
        monkeypatch.delenv(name, raising=False)
    capsys.readouterr()
    assert main([*args, "--distributed", "--out", str(tmp_path / "bad")]) == 2
    assert "launched by torchrun" in capsys.readouterr().err and not (tmp_path / "bad").exists()


# --- row shards of layers across ranks (PruneOptions.row_shards) ---


def shapes(*dims: tuple[int, int]) -> list:
    return [dataclasses.make_dataclass("Layer", ["d_out", "d_in"])(d_out, d_in) for d_out, d_in in dims]


LLAMA_8B = shapes((4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336))


def loads(layers: list, units: list[WorkUnit], world_size: int) -> list[int]:
    load = [0] * world_size
    for u in units:
        load[u.rank] += (u.stop - u.start) * layers[u.layer].d_in ** 2
    return load


@pytest.mark.parametrize("min_rows", [32, 256])
@pytest.mark.parametrize("world_size", [1, 2, 3, 8, 16])
def test_plan_work_balances_row_shards_and_covers_every_row_once(world_size, min_rows):
    units = plan_work(LLAMA_8B, world_size, [True] * 7, min_rows=min_rows)
    assert units == plan_work(LLAMA_8B, world_size, [True] * 7, min_rows=min_rows)  # deterministic: shapes alone
    for j, layer in enumerate(LLAMA_8B):  # contiguous shards in row order, every row once
        mine = [u for u in units if u.layer == j]
        assert mine[0].start == 0 and mine[-1].stop == layer.d_out
        assert all(a.stop == b.start for a, b in itertools.pairwise(mine))
        assert all(u.stop - u.start >= min_rows for u in mine) and all(0 <= u.rank < world_size for u in mine)
    load = loads(LLAMA_8B, units, world_size)
    assert max(load) <= 1.01 * sum(load) / world_size  # whole layers: 4.5x the mean with 8 ranks
    if world_size == 1:
        assert [(u.start, u.stop) for u in units] == [(0, layer.d_out) for layer in LLAMA_8B]


def test_plan_work_without_split_places_whole_layers_largest_first():
    whole = plan_work(LLAMA_8B, 8)
    assert [(u.layer, u.start, u.stop) for u in whole] == [(j, 0, x.d_out) for j, x in enumerate(LLAMA_8B)]
    assert [u.rank for u in whole] == [u.rank for u in plan_work(LLAMA_8B, 8)] == [3, 5, 6, 4, 1, 2, 0]
    assert max(loads(LLAMA_8B, whole, 8)) == 4096 * 14336**2  # down_proj alone
    # Layers that may not be split stay whole and are placed first; the others fill around them.
    mixed = plan_work(LLAMA_8B, 4, [True] * 6 + [False])
    assert [u for u in mixed if u.layer == 6] == [WorkUnit(6, 0, 4096, 0)]
    assert max(loads(LLAMA_8B, mixed, 4)) == 4096 * 14336**2  # the whole down_proj bounds the block; the rest fit
    mixed = plan_work(LLAMA_8B, 8, [True] * 6 + [False])
    assert max(loads(LLAMA_8B, mixed, 8)) == 4096 * 14336**2 and len(mixed) > 7
    # Too few rows for two shards of min_rows: whole; enough: split in two.
    assert plan_work(shapes((63, 64)), 2, [True], min_rows=32) == [WorkUnit(0, 0, 63, 0)]
    assert plan_work(shapes((64, 64)), 2, [True], min_rows=32) == [WorkUnit(0, 0, 32, 0), WorkUnit(0, 32, 64, 1)]
    assert plan_work(shapes((63, 64), (64, 64)), 2, [True, True]) == [WorkUnit(0, 0, 63, 0), WorkUnit(1, 0, 64, 1)]
    with pytest.raises(ValueError, match="split has 1 flags for 2 layers"):
        plan_work(shapes((8, 8), (8, 8)), 2, [True])


@pytest.mark.parametrize(
    ("kwargs", "separable", "why"),
    [
        ({}, True, None),
        ({"nm": (2, 4), "guard": True}, True, None),
        ({"start": "magnitude", "refine": "dsnot", "weights": "cg"}, True, None),
        ({"objective": "refit"}, True, None),
        ({"scope": "layer"}, False, "per-layer budget"),
        ({"start": "ria"}, False, "column sums"),
        ({"start": "sparsegpt"}, False, "sparsegpt start does not treat rows apart: its float32 OBS"),
        ({"start": "admm", "scope": "row"}, False, "admm start does not"),
        ({"weights": "obs"}, False, "obs weight update does not"),
        ({"weights": "alps"}, False, "penalty schedule"),
    ],
)
def test_row_separable_specs(kwargs, separable, why):
    spec = build_spec(REFIT, **kwargs)
    assert spec.row_separable is separable
    assert (spec.row_obstacle is None) if why is None else (why in spec.row_obstacle)


def test_row_shards_option_is_checked():
    for bad in (True, -1, 2.0):
        with pytest.raises(ValueError, match=r"row_shards must be an int >= 0 \(0: whole layers; n: row shards"):
            PruneOptions(row_shards=bad).validate()
    assert PruneOptions.from_dict(PruneOptions(row_shards=256).to_dict()).row_shards == 256
    assert PruneOptions().row_shards == 0  # off by default


ROW_SPECS = {
    "row": build_spec(REFIT, max_iters=2),  # the default: 60% per row, Wanda, swaps, LS re-fit
    "nm": build_spec(REFIT, nm=(2, 4), max_iters=2, guard=True),  # N:M, with the held-out guard (updated_rows)
    "layer": build_spec(REFIT, scope="layer", max_iters=2),  # per-layer budget: not separable, whole layers
}


def _rows_worker(rank: int, world_size: int, tmp: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world_size)
    calls, prune_layer = [], pipeline.prune_layer

    def spy(weight: torch.Tensor, *args, name: str, **kwargs):
        calls.append((name, weight.shape[0]))
        return prune_layer(weight, *args, name=name, **kwargs)

    pipeline.prune_layer = spy
    try:
        out = {}
        for key, spec in ROW_SPECS.items():
            model = AutoModelForCausalLM.from_pretrained(f"{tmp}/src").eval()
            calls.clear()
            result = prune_model(model, calib(), PruneOptions(spec=spec, row_shards=32), progress=False,
                                 batch_size=2, holdout_tokens=calib(N_HOLDOUT, seed=1), distributed=True)  # fmt: skip
            finalize(model)
            out[key] = {"state": model.state_dict(), "masks": result.masks, "warm": result.warmstart_masks,
                        "layers": result.layers, "calls": list(calls)}  # fmt: skip
        torch.save(out, f"{tmp}/rank{rank}.pt")
    finally:
        pipeline.prune_layer = prune_layer
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def row_shard_runs(tmp_path_factory):
    """Each spec of ROW_SPECS pruned by one process and by 2 gloo ranks with row_shards=32 (one spawn)."""
    tmp = tmp_path_factory.mktemp("rows")
    tiny_model("llama", num_hidden_layers=2).save_pretrained(tmp / "src", max_shard_size=SHARD)
    one = {}
    for key, spec in ROW_SPECS.items():
        model = AutoModelForCausalLM.from_pretrained(tmp / "src").eval()
        result = prune_model(model, calib(), PruneOptions(spec=spec), progress=False, batch_size=2,
                             holdout_tokens=calib(N_HOLDOUT, seed=1))  # fmt: skip
        finalize(model)
        one[key] = (model.state_dict(), result)
    mp.spawn(_rows_worker, args=(2, str(tmp)), nprocs=2, join=True)
    return one, [torch.load(tmp / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


def assert_same_as_one_process(one: tuple, out: dict) -> None:
    state, result = one
    assert out["state"].keys() == state.keys() and all(torch.equal(out["state"][k], v) for k, v in state.items())
    assert all(torch.equal(out["masks"][k], v) for k, v in result.masks.items())
    assert all(torch.equal(out["warm"][k], v) for k, v in result.warmstart_masks.items())
    assert timeless(out["layers"]) == timeless(result.layers)  # every loss, held-out ones, swaps, updated_rows


@pytest.mark.parametrize("key", ["row", "nm"])
def test_row_shards_across_ranks_equal_one_process(row_shard_runs, key):
    one, ranks = row_shard_runs
    for out in ranks:
        assert_same_as_one_process(one[key], out[key])
    # up_proj and gate_proj (128 rows) were divided: rows 0:32 on one rank, 32:128 on the other (plan_work)
    calls = [out[key]["calls"] for out in ranks]
    assert ("model.layers.0.mlp.up_proj", 32) in calls[0] and ("model.layers.0.mlp.up_proj", 96) in calls[1]
    assert any(rows < 128 for name, rows in calls[0] + calls[1] if "up_proj" in name or "gate_proj" in name)
    assert len(calls[0]) + len(calls[1]) > 2 * 7  # more units than layers
    if key == "nm":
        assert any(r.updated_rows < 1 for r in one[key][1].layers)  # the guard rejected some rows


def test_non_separable_spec_prunes_whole_layers_and_equals_one_process(row_shard_runs):
    one, ranks = row_shard_runs
    for out in ranks:
        assert_same_as_one_process(one["layer"], out["layer"])
    calls = ranks[0]["layer"]["calls"] + ranks[1]["layer"]["calls"]
    assert len(calls) == 2 * 7 and all(rows in (32, 64, 128) for _, rows in calls)
    names = {name: rows for name, rows in calls}
    assert names["model.layers.0.mlp.up_proj"] == 128 and names["model.layers.0.self_attn.k_proj"] == 32


def test_init_from_env_limits_numba_to_the_torch_threads(monkeypatch):
    """torchrun sets OMP_NUM_THREADS (1 by default); numba's swap search would take every core in every rank."""
    import socket

    import numba
    import torch.distributed as dist

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    torch_threads, numba_threads = torch.get_num_threads(), numba.get_num_threads()
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    torch.set_num_threads(1)
    try:
        ranks = init_from_env("cpu")
        assert (ranks.rank, ranks.world_size) == (0, 1)
        assert numba.get_num_threads() == 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(torch_threads)
        numba.set_num_threads(numba_threads)


# --- issue 47, item 6: a stalled rank fails the run within the collective timeout, naming the rank

STALL_SCRIPT = """
import json, os, signal, sys, time
from sparseswaps_prune.llm.distributed import CollectiveTimeout, init_from_env
stalled, out = int(sys.argv[1]), sys.argv[2]
ranks = init_from_env("cpu", timeout=float(sys.argv[3]))
ranks.broadcast("hello", src=0)  # both ranks are up: collective operation #1
if ranks.rank == stalled:
    os.kill(os.getpid(), signal.SIGSTOP)  # stopped, as by `kill -STOP`: never answers again
start = time.monotonic()
try:
    ranks.barrier()
    result = {"error": None}
except CollectiveTimeout as err:
    result = {"error": str(err), "timeout": isinstance(err, TimeoutError)}
result["seconds"] = time.monotonic() - start
with open(out, "w") as f:
    json.dump(result, f)
os._exit(0)
"""


@pytest.mark.parametrize("stalled", [1, 0])
def test_a_stopped_rank_fails_the_other_within_the_collective_timeout(tmp_path, stalled):
    """Two gloo ranks initialised as torchrun's (``init_from_env``, timeout 5 s); one is stopped (SIGSTOP) after the
    first collective operation. The other fails in its next one within the timeout (before: gloo's 30 minutes), with
    a ``CollectiveTimeout`` naming the stopped rank and ``--collective-timeout``. Rank 0 serves the rendezvous store
    here, so when rank 0 is the one stopped rank 1 cannot read who arrived and says that rank 0 is likely stopped."""
    import signal
    import socket
    import time

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    procs = []
    for rank in range(2):
        env = os.environ | {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip
        cmd = [sys.executable, "-c", STALL_SCRIPT, str(stalled), str(tmp_path / f"rank{rank}.json"), "5"]
        procs.append(subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True))
    waiting = procs[1 - stalled]
    try:
        deadline = time.monotonic() + 120  # imports included; the wait itself is checked below
        while waiting.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert waiting.poll() == 0, waiting.stderr.read() if waiting.poll() is not None else "still waiting"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)  # a stopped process dies on SIGKILL too
            proc.wait(timeout=30)
    result = json.loads((tmp_path / f"rank{1 - stalled}.json").read_text())
    assert result["error"] is not None and result["timeout"]
    assert 4.5 < result["seconds"] < 5 + 3 + 5  # the timeout, plus at most the store's bounded read (3 s)
    message = result["error"]
    assert message.startswith(f"rank {1 - stalled}: a barrier (collective operation #2) got no answer within the "
                              "collective timeout of 5 s: ")  # fmt: skip
    assert "raise --collective-timeout (collective_timeout, now 5 s)" in message and "\n" not in message
    if stalled == 1:
        assert "rank 1 did not reach it (rank 1 at #1)" in message
    else:
        assert "rank 0 is likely the one stopped" in message
    assert not (tmp_path / f"rank{stalled}.json").exists()


def test_collective_timeout_option_is_checked_and_reaches_the_process_group(monkeypatch, tmp_path):
    from sparseswaps_prune import cli
    from sparseswaps_prune.llm import distributed

    with pytest.raises(ValueError, match=r"collective_timeout \(--collective-timeout\) must be in \(0, "):
        JobConfig(distributed=True, collective_timeout=0).validate()
    with pytest.raises(TypeError, match="collective_timeout"):
        JobConfig(distributed=True, collective_timeout="5").validate()
    with pytest.raises(ValueError, match=r"--collective-timeout\) bounds the waits .* drop --collective-timeout"):
        JobConfig(collective_timeout=5).validate()
    JobConfig(distributed=True, collective_timeout=5).validate()
    assert JobConfig().collective_timeout == distributed.DEFAULT_COLLECTIVE_TIMEOUT == 600
    seen = {}

    def init(device, timeout):
        seen["timeout"] = timeout
        raise ValueError("stop here")

    monkeypatch.setattr(distributed, "init_from_env", init)
    args = ["prune", "--distributed", "--collective-timeout", "7.5", "--eval", "none", "--out", str(tmp_path / "o")]
    assert cli.main(args) == 2 and seen == {"timeout": 7.5}
    with pytest.raises(ValueError, match="collective_timeout"):
        distributed.check_collective_timeout(float("nan"))
