"""Sparse deployment figures: layer speed, decoding speed, resident memory and checkpoint size, dense vs sparse.

    python benchmarks/sparse_inference.py            # the figures in docs/deploy.md (about 5-10 minutes)
    python benchmarks/sparse_inference.py --quick    # small shapes and a tiny model (seconds; for the tests)

(a) One linear layer, ``d_out x d_in`` = 4096 x 14336 and 14336 x 4096, per-row magnitude pruning at 50/60/70%,
    1, 2, 4, 8, 16 tokens, one thread (torch and numba): torch's dense ``nn.Linear``, :class:`SparseLinear`'s kernel
    and torch CSR (``to_sparse_csr``; at 1, 4 and 16 tokens), in the same process, median wall time of ``--repeats``
    runs, the three interleaved.
(b) Greedy decoding (32 new tokens after an 8-token prompt) of the default model (SmolLM2-135M, float32) pruned at
    60% and 70% with a per-row magnitude mask (every linear but the tied embedding / lm_head): tokens per second of
    the model with zeros (dense) and sparsified, at 2 and 1 threads. The mask is not a good pruning (no
    calibration): only its sparsity pattern matters for speed.
(c) Resident memory of the same models, dense and sparsified: tensor bytes, and the resident set of a fresh process
    that loads the model (``/proc/self/status``, Linux).
(d) Checkpoint size on disk: ``save_pretrained`` against ``save_sparse`` and ``save_sparse(compress=True)``
    (lossless: byte planes under zlib), float32 and bfloat16, with the seconds to save and to load each sparse one
    (``load_sparse``) and a bit-for-bit check of both. ``--checkpoint`` prints this section alone, for the model's
    own weights (``own``) and for the same model with its weights redrawn from a normal distribution of each
    tensor's own mean and standard deviation (``normal``): the default model is de-quantized from a 4-bit GGUF, so
    its float32 values take few distinct low mantissa bits and compress far better than those of a model trained
    and saved in full precision, which the redrawn rows stand in for.
(e) The least size the format allows (:func:`~sparseswaps_prune.deploy.bench.size_bound`): the decoder blocks'
    linear weights pruned (what ``sparseswaps prune`` prunes) and stored as their bitmask plus the kept values,
    everything else (embeddings, an untied ``lm_head``, norms) as it is; from the configs alone (a model on the meta
    device, no weights) of the default model (SmolLM2-135M; a tiny llama with ``--quick``) and of a Llama-7B-shaped
    model (``LlamaConfig()``'s defaults), with the least sparsity at which the bound is 0.5x the dense size.
    ``--bound`` prints this section alone (seconds).

Each section prints a table; the first line names the machine and its load (other processes share the CPUs).
Idle OpenMP threads of torch and numba spin by default and slow each other down; like the test suite, the script
sets ``OMP_WAIT_POLICY=passive`` unless it is already set.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # before torch and numba start their thread pools

import argparse
import tempfile
import time
import warnings
from pathlib import Path

import numba
import torch
from common import median_seconds
from torch import nn

from sparseswaps_prune.deploy import SparseLinear, load_sparse, save_sparse, sparsify
from sparseswaps_prune.deploy.bench import (
    decode_speeds,
    dir_bytes,
    greedy_kwargs,
    machine_line,
    resident_memory,
    size_bound,
    tensor_bytes,
)
from sparseswaps_prune.deploy.kernels import default_kernel
from sparseswaps_prune.modules import find_blocks, find_layers

FULL = {
    "shapes": [(4096, 14336), (14336, 4096)],
    "sparsities": [0.5, 0.6, 0.7],
    "batches": [1, 2, 4, 8, 16],
    "csr_batches": [1, 4, 16],
    "model_sparsities": [0.6, 0.7],
    "threads": [2, 1],
    "new_tokens": 32,
}
QUICK = {
    "shapes": [(256, 512)],
    "sparsities": [0.7],
    "batches": [1, 4],
    "csr_batches": [1],
    "model_sparsities": [0.6],
    "threads": [1],
    "new_tokens": 8,
}
PROMPT = "The capital of France is Paris, and"


def set_threads(n: int) -> None:
    """Use ``n`` threads in torch and numba."""
    torch.set_num_threads(n)
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))


def magnitude_prune_(weight: torch.Tensor, sparsity: float) -> None:
    """Zero the ``sparsity`` fraction of smallest-magnitude entries of every row of ``weight`` (``+0.0``), in place
    (ties at the threshold are pruned too)."""
    k = int(weight.shape[1] * sparsity)
    if k == 0:
        return
    magnitude = weight.abs().float()
    threshold = magnitude.kthvalue(k, dim=1, keepdim=True).values
    weight.masked_fill_(magnitude <= threshold, 0.0)


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def layer_table(shapes, sparsities, batches, repeats: int, csr_batches) -> list[dict]:
    """Section (a): ms per call of dense / SparseLinear kernel / torch CSR (at ``csr_batches``); one thread."""
    set_threads(1)
    rows = []
    gen = torch.Generator().manual_seed(0)
    for d_out, d_in in shapes:
        base = torch.randn(d_out, d_in, generator=gen)
        for sparsity in sparsities:
            weight = base.clone()
            magnitude_prune_(weight, sparsity)
            dense = nn.Linear(d_in, d_out, bias=False)
            dense.weight.data = weight
            sparse = SparseLinear.from_dense(weight, crossover=max(batches))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "Sparse CSR tensor support is in beta state"
                csr = weight.to_sparse_csr()
            for batch in batches:
                x = torch.randn(batch, d_in, generator=gen)
                with torch.inference_mode():
                    fns = [lambda: dense(x), lambda: sparse(x)]  # noqa: B023
                    if batch in csr_batches:
                        fns.append(lambda: torch.mm(csr, x.t()))  # noqa: B023
                    t_dense, t_sparse, *t_csr = median_seconds(fns, repeats)
                    t_csr = t_csr[0] if t_csr else None
                    err = (sparse(x) - dense(x)).abs().max().item() / dense(x).abs().max().item()
                rows.append(
                    {
                        "shape": f"{d_out}x{d_in}",
                        "sparsity": sparsity,
                        "batch": batch,
                        "dense_ms": t_dense * 1e3,
                        "sparse_ms": t_sparse * 1e3,
                        "csr_ms": None if t_csr is None else t_csr * 1e3,
                        "rel_err": err,
                    }
                )
    return rows


def print_layer_table(rows: list[dict]) -> None:
    print("\n(a) one layer, 1 thread, float32, median ms per call (speedup = dense / other)")
    print(
        f"{'shape':>11} {'sparsity':>8} {'batch':>5} {'dense':>8} {'sparse':>8} {'speedup':>7} {'csr':>8} "
        f"{'csr x':>6} {'rel err':>8}"
    )
    for r in rows:
        print(
            f"{r['shape']:>11} {r['sparsity']:>8.0%} {r['batch']:>5} {r['dense_ms']:>8.2f} {r['sparse_ms']:>8.2f} "
            f"{r['dense_ms'] / r['sparse_ms']:>7.2f} "
            + (f"{r['csr_ms']:>8.2f} {r['dense_ms'] / r['csr_ms']:>6.2f} " if r["csr_ms"] else f"{'-':>8} {'-':>6} ")
            + f"{r['rel_err']:>8.1e}"
        )
    crossover = {}
    for r in rows:
        if r["sparse_ms"] < r["dense_ms"]:
            key = (r["shape"], r["sparsity"])
            crossover[key] = max(crossover.get(key, 0), r["batch"])
    print("largest batch where the kernel beats dense:", {f"{s} {p:.0%}": b for (s, p), b in crossover.items()})


def load_base_model(quick: bool):
    """The default SmolLM2-135M (float32), or a tiny random llama with ``quick``; and a tokenizer or None."""
    if quick:
        from sparseswaps_prune.llm.models import tiny_model

        return tiny_model("llama", seed=0), None
    from sparseswaps_prune.llm.models import load_model

    return load_model()


def prune_model_(model: nn.Module, sparsity: float) -> int:
    """Per-row magnitude pruning of every linear layer not tied to another module; returns how many."""
    tied = {id(model.get_input_embeddings().weight)}
    count = 0
    with torch.no_grad():
        for layer in find_layers(model, prefix=""):
            if id(layer.module.weight) in tied:
                continue
            magnitude_prune_(layer.weight_2d(), sparsity)
            count += 1
    return count


def decode_breakdown(model: nn.Module, ids: torch.Tensor, new_tokens: int) -> dict[str, float]:
    """Milliseconds per generated token of one more greedy ``generate`` call, split into the decoder blocks'
    linears (the layers that are pruned, dense or sparse), the output layer (``lm_head``, dense in both) and the
    rest (attention over the cache, norms, embedding, ``generate``'s own work), timed with forward hooks (which add
    their own small cost to the linears' share)."""
    spent = {"linears": 0.0, "lm_head": 0.0}
    output = model.get_output_embeddings()
    handles = []
    for module in model.modules():
        if module is output or isinstance(module, (nn.Linear, SparseLinear)):
            key = "lm_head" if module is output else "linears"
            starts: list[float] = []
            handles.append(module.register_forward_pre_hook(lambda *_, s=starts: s.append(time.perf_counter())))
            handles.append(
                module.register_forward_hook(
                    lambda *_, s=starts, k=key: spent.__setitem__(k, spent[k] + time.perf_counter() - s.pop())
                )
            )
    try:
        with torch.inference_mode():
            start = time.perf_counter()
            model.generate(ids, **greedy_kwargs(model, new_tokens))
            total = time.perf_counter() - start
    finally:
        for handle in handles:
            handle.remove()
    ms = {key: 1000 * value / new_tokens for key, value in spent.items()}
    ms["other"] = 1000 * total / new_tokens - ms["linears"] - ms["lm_head"]
    return ms


def model_sections(quick: bool, config: dict, repeats: int) -> None:
    """Sections (b), (c), (d) on the default (or tiny) model."""
    start = time.perf_counter()
    base, tokenizer = load_base_model(quick)
    print(f"\nmodel loaded in {time.perf_counter() - start:.1f} s ({type(base).__name__})")
    if tokenizer is not None:
        ids = tokenizer(PROMPT, return_tensors="pt").input_ids[:, :8]
    else:
        ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 253, 1545]])
    state = {k: v.clone() for k, v in base.state_dict().items()}
    decode_rows, memory_rows, disk_rows = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for sparsity in config["model_sparsities"]:
            base.load_state_dict(state)
            pruned = prune_model_(base, sparsity)
            # (d) checkpoint size, float32 and bfloat16
            for dtype in (torch.float32, torch.bfloat16):
                disk_rows.append(checkpoint_row(base.to(dtype), tokenizer, Path(tmp), sparsity, "own"))
                base.to(torch.float32)
            # (c) memory: tensor bytes here, resident set in fresh processes
            dense_tensor = tensor_bytes(base)
            sparse_model = load_sparse(Path(tmp) / "sparse-torch.float32", sparse=True)
            sparse_tensor = tensor_bytes(sparse_model)
            del sparse_model
            rss = {}
            if not quick and Path("/proc/self/status").exists():
                for variant in ("dense", "sparse"):
                    rss[variant] = resident_memory(Path(tmp) / "sparse-torch.float32", sparse=variant == "sparse")
            memory_rows.append((sparsity, dense_tensor, sparse_tensor, rss))
            # (b) decoding speed: the dense model with zeros and the sparse one, runs interleaved
            dense_model = load_sparse(Path(tmp) / "sparse-torch.float32")
            sparse_model, report = sparsify(load_sparse(Path(tmp) / "sparse-torch.float32"))
            for threads in config["threads"]:
                set_threads(threads)
                speeds = decode_speeds(
                    {"dense": dense_model, "sparse": sparse_model}, ids, config["new_tokens"], repeats
                )
                (dense_tps, dense_ids), (sparse_tps, sparse_ids) = speeds["dense"], speeds["sparse"]
                same = bool(torch.equal(dense_ids, sparse_ids))
                split = {
                    name: decode_breakdown(model, ids, config["new_tokens"])
                    for name, model in (("dense", dense_model), ("sparse", sparse_model))
                }
                decode_rows.append(
                    (sparsity, threads, pruned, len(report.converted), dense_tps, sparse_tps, same, split)
                )
            del dense_model, sparse_model
    print(
        f"\n(b) greedy decoding, {config['new_tokens']} new tokens after {ids.shape[1]} prompt tokens, float32, "
        f"median of {repeats} timed runs, dense and sparse interleaved"
    )
    print(
        f"{'sparsity':>8} {'threads':>7} {'layers':>6} {'dense tok/s':>11} {'sparse tok/s':>12} {'speedup':>7} "
        f"{'same tokens':>11}"
    )
    for sparsity, threads, _pruned, converted, dense_tps, sparse_tps, same, _split in decode_rows:
        print(
            f"{sparsity:>8.0%} {threads:>7} {converted:>6} {dense_tps:>11.1f} {sparse_tps:>12.1f} "
            f"{sparse_tps / dense_tps:>7.2f} {'yes' if same else 'NO':>11}"
        )
    print(
        "\n    where a token's time goes: ms per token in the blocks' linears (dense / sparse), the output layer and"
        "\n    the rest (one more hooked run of each), and the speedup if the linears took no time at all"
    )
    print(
        f"{'sparsity':>8} {'threads':>7} {'linears d':>9} {'linears s':>9} {'layer x':>7} {'lm_head d/s':>11} "
        f"{'other d/s':>11} {'free linears x':>14}"
    )
    for sparsity, threads, *_, split in decode_rows:
        d, s_ = split["dense"], split["sparse"]
        dense_total = sum(d.values())
        print(
            f"{sparsity:>8.0%} {threads:>7} {d['linears']:>9.1f} {s_['linears']:>9.1f} "
            f"{d['linears'] / s_['linears']:>7.2f} {d['lm_head']:>5.1f}/{s_['lm_head']:<5.1f} "
            f"{d['other']:>5.1f}/{s_['other']:<5.1f} {dense_total / (dense_total - d['linears']):>14.2f}"
        )
    print(
        "\n(c) memory of the model, float32: tensor bytes, and the growth of the resident set (VmRSS) and of its"
        "\n    anonymous part (RssAnon) in a fresh process that loads the sparse checkpoint densely (load_sparse) or"
        "\n    sparse (load_sparse(sparse=True)) and runs one forward pass; MB"
    )
    print(
        f"{'sparsity':>8} {'dense':>7} {'sparse':>7} {'ratio':>6} {'RSS d':>7} {'RSS s':>7} {'ratio':>6} "
        f"{'anon d':>7} {'anon s':>7} {'ratio':>6}"
    )
    for sparsity, dense_t, sparse_t, rss in memory_rows:
        line = f"{sparsity:>8.0%} {dense_t / 2**20:>7.1f} {sparse_t / 2**20:>7.1f} {sparse_t / dense_t:>6.2f}"
        for key in ("rss_model", "anon_model"):
            d, s_ = (rss[v][key] if v in rss else None for v in ("dense", "sparse"))
            line += (
                f" {d / 2**20:>7.1f} {s_ / 2**20:>7.1f} {s_ / d:>6.2f}"
                if d and s_ is not None
                else " " + " ".join(f"{'-':>7}" for _ in range(2)) + f" {'-':>6}"
            )
        print(line)
    print_checkpoint_table(disk_rows)


def checkpoint_row(model: nn.Module, tokenizer, tmp: Path, sparsity: float, weights: str) -> dict:
    """Section (d)'s row for ``model`` (already pruned): saved dense, sparse and sparse compressed into ``tmp``
    (``sparse-<dtype>`` stays for the other sections), each sparse one timed and loaded back bit for bit."""
    dtype = next(model.parameters()).dtype
    dense_dir = tmp / f"dense-{dtype}"
    model.save_pretrained(dense_dir)
    row = {"sparsity": sparsity, "dtype": str(dtype).removeprefix("torch."), "weights": weights}
    row["dense"] = dir_bytes(dense_dir, "*.safetensors")
    want = model.state_dict()
    for variant, compress in (("sparse", False), ("packed", True)):
        directory = tmp / f"{variant}-{dtype}"
        start = time.perf_counter()
        report = save_sparse(model, directory, tokenizer=tokenizer, compress=compress)
        row[f"{variant}_save_s"] = time.perf_counter() - start
        start = time.perf_counter()
        back = load_sparse(directory).state_dict()
        row[f"{variant}_load_s"] = time.perf_counter() - start
        row[variant] = dir_bytes(directory, "*.safetensors")
        row[f"{variant}_same"] = all(bit_equal(v, back[k]) for k, v in want.items())
        row["encoded"] = len(report.encoded)
    return row


def redraw_normal_(model: nn.Module, seed: int = 0) -> None:
    """Replace every floating tensor of ``model`` with more than one entry by draws from a normal distribution of
    its own mean and standard deviation (float32 draws, seeded), in place: full-precision values of the same
    shapes and scales (``--checkpoint``'s ``normal`` rows)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.dtype.is_floating_point and tensor.numel() > 1:
                values = tensor.float()
                draw = torch.randn(tensor.shape, generator=generator) * values.std() + values.mean()
                tensor.copy_(draw)


def checkpoint_sections(quick: bool, config: dict) -> list[dict]:
    """``--checkpoint``: section (d) alone, on the default (or tiny) model's weights and on normal redraws of them."""
    base, tokenizer = load_base_model(quick)
    state = {k: v.clone() for k, v in base.state_dict().items()}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for weights in ("own", "normal"):
            for sparsity in config["model_sparsities"]:
                base.load_state_dict(state)
                if weights == "normal":
                    redraw_normal_(base)
                prune_model_(base, sparsity)
                for dtype in (torch.float32, torch.bfloat16):
                    rows.append(checkpoint_row(base.to(dtype), tokenizer, Path(tmp), sparsity, weights))
                    base.to(torch.float32)
    print_checkpoint_table(rows)
    return rows


def print_checkpoint_table(rows: list[dict]) -> None:
    print("\n(d) checkpoint size on disk (weights files): save_pretrained vs save_sparse, plain and compressed")
    print(
        f"{'sparsity':>8} {'dtype':>8} {'weights':>7} {'dense MB':>9} {'sparse MB':>9} {'ratio':>6} {'packed MB':>9} "
        f"{'ratio':>6} {'save s':>6} {'save c':>6} {'load s':>6} {'load c':>6} {'encoded':>7} {'round trip':>10}"
    )
    for row in rows:
        dense = row["dense"]
        same = row["sparse_same"] and row["packed_same"]
        print(
            f"{row['sparsity']:>8.0%} {row['dtype']:>8} {row['weights']:>7} {dense / 2**20:>9.1f} "
            f"{row['sparse'] / 2**20:>9.1f} {row['sparse'] / dense:>6.3f} {row['packed'] / 2**20:>9.1f} "
            f"{row['packed'] / dense:>6.3f} {row['sparse_save_s']:>6.2f} {row['packed_save_s']:>6.2f} "
            f"{row['sparse_load_s']:>6.2f} {row['packed_load_s']:>6.2f} {row['encoded']:>7} "
            f"{'bit-exact' if same else 'DIFFERS':>10}"
        )


BOUND_SPARSITIES = (0.6, 0.7)


def bound_configs(quick: bool) -> dict:
    """name -> transformers config of the models of section (e): the default model's (a tiny llama's with
    ``quick``) and a Llama-7B-shaped one."""
    from transformers import AutoConfig, LlamaConfig

    if quick:
        from sparseswaps_prune.llm.models import tiny_config

        first = ("tiny llama", tiny_config("llama"))
    else:
        from sparseswaps_prune.llm.models import resolve_source

        source, gguf = resolve_source(None, None)
        first = ("SmolLM2-135M", AutoConfig.from_pretrained(source, gguf_file=gguf))
    return dict([first, ("Llama-7B shape", LlamaConfig())])


def bound_rows(configs: dict, sparsities=BOUND_SPARSITIES) -> list[dict]:
    """Section (e): :func:`size_bound` of each config's model on the meta device, float32 and bfloat16, with the
    decoder blocks' linear weights pruned."""
    from transformers import AutoModelForCausalLM

    rows = []
    for name, config in configs.items():
        for dtype in (torch.float32, torch.bfloat16):
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            blocks_name, blocks = find_blocks(model)
            pruned = [
                f"{layer.name}.weight"
                for index, block in enumerate(blocks)
                for layer in find_layers(block, prefix=f"{blocks_name}.{index}")
            ]
            for sparsity in sparsities:
                bound = size_bound(model, pruned, sparsity)
                rows.append({"model": name, "dtype": str(dtype).removeprefix("torch."), "layers": len(pruned)} | bound)
    return rows


def print_bound_table(rows: list[dict]) -> None:
    print(
        "\n(e) least checkpoint size of the format: the decoder blocks' linears pruned (bitmask + kept values), every"
        "\n    other tensor dense; dense = save_pretrained's tensor bytes; MB"
    )
    print(
        f"{'model':>15} {'dtype':>8} {'pruned':>6} {'sparsity':>8} {'dense':>9} {'unpruned':>9} {'values':>9} "
        f"{'bitmask':>8} {'bound':>9} {'ratio':>6} {'0.5x at':>7}"
    )
    for r in rows:
        at = "never" if r["sparsity_for_target"] is None else f"{r['sparsity_for_target']:.1%}"
        print(
            f"{r['model']:>15} {r['dtype']:>8} {r['pruned_fraction']:>6.1%} {r['sparsity']:>8.0%} "
            f"{r['dense_bytes'] / 2**20:>9.1f} {r['unpruned_bytes'] / 2**20:>9.1f} {r['values_bytes'] / 2**20:>9.1f} "
            f"{r['bitmask_bytes'] / 2**20:>8.1f} {r['bound_bytes'] / 2**20:>9.1f} {r['ratio']:>6.3f} {at:>7}"
        )
    print("pruned: the pruned linears' share of the parameters; 0.5x at: least sparsity of those with bound <= 0.5x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, a tiny model, few repeats (seconds)")
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed runs per figure (3; --quick: 2 a layer, 1 a model)"
    )
    parser.add_argument("--skip-layers", action="store_true", help="skip section (a)")
    parser.add_argument("--skip-model", action="store_true", help="skip sections (b), (c), (d)")
    parser.add_argument("--bound", action="store_true", help="print section (e) alone (seconds)")
    parser.add_argument(
        "--checkpoint", action="store_true", help="print section (d) alone, with normal-redrawn weights too"
    )
    args = parser.parse_args(argv)
    config = QUICK if args.quick else FULL
    repeats = args.repeats or (2 if args.quick else 3)
    start = time.perf_counter()
    set_threads(1)
    print("machine:", machine_line())
    print("kernel:", default_kernel())
    if args.checkpoint:
        checkpoint_sections(args.quick, config)
        print(f"\ntotal {time.perf_counter() - start:.0f} s; load average now {os.getloadavg()[0]:.2f}")
        return
    if not args.skip_layers and not args.bound:
        rows = layer_table(config["shapes"], config["sparsities"], config["batches"], repeats, config["csr_batches"])
        print_layer_table(rows)
    if not args.skip_model and not args.bound:
        model_sections(args.quick, config, args.repeats or (1 if args.quick else 3))
    print_bound_table(bound_rows(bound_configs(args.quick)))
    print(f"\ntotal {time.perf_counter() - start:.0f} s; load average now {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
