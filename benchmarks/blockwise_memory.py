"""Host memory and time of the out-of-core block-wise path (llm/streaming.py) against the in-memory one.

Builds a model with LLaMA-3.1-8B widths (hidden 4096, MLP 14336, 32 query / 8 key-value heads) but only a few
decoder blocks and a small vocabulary, with random weights, saved by ``save_pretrained`` as sharded safetensors in
a work directory. For each block count it then runs, each in a fresh process so that the peaks are separate:

* ``stream``: :func:`~sparseswaps_prune.llm.streaming.prune_checkpoint` (with ``--ranks 2``, also 2 gloo processes);
* ``memory``: ``from_pretrained`` + ``prune_model`` + ``finalize`` + ``save_pretrained`` (what the job does),

and prints per run: the peak resident set of the process since the call began (``VmHWM``, reset through
``/proc/self/clear_refs``), the same less the resident set at the start (imports), that increase as a multiple of
one block's bytes, the wall time, the mean time per block (stream), the bytes written, and whether the saved
tensors equal the 1-process in-memory output bit for bit.

By default only ``k_proj`` and ``v_proj`` of each block are pruned (``--include``): on the CPU the other layers'
pruning takes minutes each at these widths (the 4096 x 14336 down_proj about 4 min on one thread), and its working
set (fp64 Gram copies, row losses: several GB) would then be the peak; here every block is still read, run,
written and dropped in full. ``--all-layers`` prunes every linear layer. ``--row-shards 0 256`` runs every rank
count above 1 once with whole layers and once cut into row shards of at least 256 rows (``PruneOptions.row_shards``),
e.g. to time a block whose pruning one layer dominates. Block tuning is off (``block_tune_epochs=0``).

    python benchmarks/blockwise_memory.py --layers 2 4 --ranks 1 2
    OMP_NUM_THREADS=1 python benchmarks/blockwise_memory.py --layers 1 --ranks 1 2 --include "*.mlp.down_proj" \
        "*.self_attn.k_proj" --row-shards 0 256
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

GB = 1e9


def build_source(path: Path, layers: int, vocab: int, dtype: torch.dtype, shard: str) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_hidden_layers=layers,
        vocab_size=vocab,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        use_cache=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path, max_shard_size=shard)
    del model
    gc.collect()


def calibration(args: argparse.Namespace) -> torch.Tensor:
    return torch.randint(0, args.vocab, (args.nsamples, args.seqlen), generator=torch.Generator().manual_seed(0))


def options(args: argparse.Namespace):
    from sparseswaps_prune.core.spec import SPARSESWAPS_SPEC, build_spec
    from sparseswaps_prune.llm.pipeline import PruneOptions

    include = None if args.all_layers else args.include
    spec = build_spec(SPARSESWAPS_SPEC, max_iters=args.max_iters, weights="keep")
    return PruneOptions(spec=spec, include=include, row_shards=args.row_shards, block_tune_epochs=0)


def set_threads() -> None:
    """Torch and numba (the swap search) each use ``OMP_NUM_THREADS`` threads (default 1) in this process: numba's
    default is every core whatever ``OMP_NUM_THREADS`` says, which oversubscribes the cores with several ranks."""
    from sparseswaps_prune.llm.distributed import match_numba_threads

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    match_numba_threads()


def child_memory(args: argparse.Namespace) -> dict:
    """In-memory path, as the job runs it."""
    from transformers import AutoModelForCausalLM

    from sparseswaps_prune.llm.io.memory import MemoryProbe
    from sparseswaps_prune.llm.pipeline import finalize, prune_model

    probe = MemoryProbe()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.src, dtype=getattr(torch, args.dtype)).eval()
    prune_model(model, calibration(args), options(args), device=args.device, progress=False)
    finalize(model)
    model.save_pretrained(args.out, max_shard_size=args.shard_size)
    seconds = time.perf_counter() - start
    written = sum(p.stat().st_size for p in Path(args.out).iterdir())
    return {
        "peak_rss_bytes": probe.peak(),
        "start_rss_bytes": probe.start,
        "seconds": seconds,
        "bytes_written": written,
    }


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    set_threads()
    dist.init_process_group("gloo", init_method=f"file://{args.out}.rendezvous", rank=rank, world_size=world_size)
    try:
        report = _stream(args, distributed=True)
        Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def _stream(args: argparse.Namespace, distributed: bool = False) -> dict:
    from sparseswaps_prune.llm.streaming import prune_checkpoint

    result = prune_checkpoint(
        args.src,
        args.out,
        calibration(args),
        options(args),
        dtype=getattr(torch, args.dtype),
        device=args.device,
        max_shard_size=args.shard_size,
        progress=False,
        distributed=distributed,
    )
    report = dict(result.report)
    report["mean_block_seconds"] = sum(b["seconds"] for b in report["blocks"]) / len(report["blocks"])
    return report


def child_stream(args: argparse.Namespace) -> dict:
    if args.ranks == 1:
        return _stream(args)
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(args.ranks, args), nprocs=args.ranks, join=True)
    reports = [json.loads(Path(f"{args.out}.rank{r}.json").read_text()) for r in range(args.ranks)]
    for r in range(args.ranks):
        Path(f"{args.out}.rank{r}.json").unlink()
    Path(f"{args.out}.rendezvous").unlink(missing_ok=True)
    main = reports[0]
    main["per_rank_peak_rss_bytes"] = [r["peak_rss_bytes"] for r in reports]
    main["per_rank_start_rss_bytes"] = [r["start_rss_bytes"] for r in reports]
    return main


def same_tensors(a: Path, b: Path) -> bool:
    """Every tensor of the two checkpoints equal bit for bit (read one at a time)."""
    from safetensors import safe_open

    from sparseswaps_prune.llm.io.readers import SafetensorsCheckpoint

    ra, rb = SafetensorsCheckpoint(a), SafetensorsCheckpoint(b)
    if set(ra.files) != set(rb.files):
        return False
    for key in ra.files:
        with safe_open(str(ra.files[key]), "pt") as fa, safe_open(str(rb.files[key]), "pt") as fb:
            x, y = fa.get_tensor(key), fb.get_tensor(key)
            if x.dtype != y.dtype or not torch.equal(x, y):
                return False
    return True


def run_child(kind: str, args: argparse.Namespace, src: Path, out: Path, ranks: int = 1, row_shards: int = 0) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--src", str(src), "--out", str(out), "--ranks", str(ranks)]
    cmd += ["--vocab", str(args.vocab), "--nsamples", str(args.nsamples), "--seqlen", str(args.seqlen)]
    cmd += ["--max-iters", str(args.max_iters), "--dtype", args.dtype, "--device", args.device]
    cmd += ["--row-shards", str(row_shards)]
    cmd += ["--shard-size", args.shard_size, "--include", *args.include] + (["--all-layers"] if args.all_layers else [])
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4], help="decoder blocks, one model per value")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--nsamples", type=int, default=2)
    parser.add_argument("--seqlen", type=int, default=64)
    parser.add_argument("--max-iters", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shard-size", default="1GB", help="max_shard_size of the source and both outputs")
    parser.add_argument("--include", nargs="+", default=["*.self_attn.k_proj", "*.self_attn.v_proj"])
    parser.add_argument("--all-layers", action="store_true", help="prune every linear layer (slow on the CPU)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1], help="stream with these numbers of gloo ranks")
    parser.add_argument(
        "--row-shards", type=int, nargs="+", default=[0],
        help="PruneOptions.row_shards, one run per value with each rank count above 1 (0: whole layers)",
    )  # fmt: skip
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary directory, removed after")
    parser.add_argument("--json", type=Path, default=None, help="also write all results here")
    parser.add_argument("--child", choices=["memory", "stream"], help=argparse.SUPPRESS)
    parser.add_argument("--src", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        set_threads()
        args.ranks, args.row_shards = args.ranks[0], args.row_shards[0]
        report = child_memory(args) if args.child == "memory" else child_stream(args)
        print(json.dumps(report))
        return

    work = args.workdir or Path(tempfile.mkdtemp(prefix="blockwise_memory_"))
    work.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    # q, o [4096, 4096]; k, v [1024, 4096]; gate, up [14336, 4096]; down [4096, 14336]; two norms [4096]
    block_bytes = (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 14336 + 2 * 4096) * dtype.itemsize
    pruned = "every linear layer" if args.all_layers else " ".join(args.include)
    print(
        f"LLaMA-3.1-8B widths (hidden 4096, MLP 14336, heads 32/8), vocab {args.vocab}, {args.dtype}, random weights; "
        f"calibration {args.nsamples} x {args.seqlen}; weights=keep, max_iters={args.max_iters}; pruned: {pruned}; "
        f"device {args.device}; threads per process (torch and numba) {os.environ.get('OMP_NUM_THREADS', '1')}"
    )
    print(f"one block: {block_bytes / GB:.3f} GB; GB = 1e9 bytes; peak = VmHWM since the call; +peak = peak - RSS at")
    print("the start of the call (after imports); x block = +peak / one block; identical = tensors equal to memory")
    header = f"{'blocks':>6} {'path':<18} {'peak GB':>8} {'+peak GB':>9} {'x block':>8} {'wall s':>8} {'s/block':>8}"
    print(header + f" {'written GB':>10}  identical")
    results = []
    try:
        for layers in args.layers:
            src = work / f"src{layers}"
            t0 = time.perf_counter()
            build_source(src, layers, args.vocab, dtype, args.shard_size)
            build_seconds = time.perf_counter() - t0
            memory_out = work / f"memory{layers}"
            runs = [("memory", 1, run_child("memory", args, src, memory_out))]
            outs = {"memory": memory_out}
            for ranks in args.ranks:
                for row_shards in args.row_shards if ranks > 1 else [0]:
                    name = f"stream x{ranks}" + (f" rows {row_shards}" if row_shards else "")
                    outs[name] = work / f"stream{layers}_{ranks}_{row_shards}"
                    runs.append((name, ranks, run_child("stream", args, src, outs[name], ranks, row_shards)))
            for name, ranks, rep in runs:
                out = outs[name]
                rep["identical"] = True if name == "memory" else same_tensors(memory_out, out)
                if name != "memory" and rep["block_bytes"] != block_bytes:
                    raise RuntimeError(f"block bytes: measured {rep['block_bytes']}, computed {block_bytes}")
                extra = rep["peak_rss_bytes"] - rep["start_rss_bytes"]
                per_block = f"{rep['mean_block_seconds']:8.1f}" if "mean_block_seconds" in rep else f"{'':>8}"
                print(
                    f"{layers:>6} {name:<18} {rep['peak_rss_bytes'] / GB:8.2f} {extra / GB:9.2f} "
                    f"{extra / block_bytes:8.2f} {rep['seconds']:8.1f} {per_block} {rep['bytes_written'] / GB:10.2f}  "
                    f"{rep['identical']}"
                )
                if "per_rank_peak_rss_bytes" in rep:
                    peaks = ", ".join(f"{p / GB:.2f}" for p in rep["per_rank_peak_rss_bytes"])
                    print(f"{'':>6} {'':<18} per-rank peak GB: {peaks}")
                results.append({"layers": layers, "path": name, "ranks": ranks, "build_seconds": build_seconds, **rep})
            for path in [src, *outs.values()]:
                shutil.rmtree(path, ignore_errors=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps({"block_bytes": block_bytes, "args": vars(args), "runs": results}, default=str))


if __name__ == "__main__":
    main()
