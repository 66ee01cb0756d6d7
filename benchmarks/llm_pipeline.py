"""The full sequential pipeline (``prune_model``) end to end: time per block and in total, peak memory, per T.

One ``prune_model`` run per ``T`` in ``--iters`` (Wanda start, 60% per row by default; SparseSwaps masks only, the
kept weights as they are: ``build_spec(SPARSESWAPS_SPEC, start=..., max_iters=T, weights="keep")``; with
``--objective refit`` the swaps are chosen under the re-fit objective and the layer keeps the re-fitted weights
they yield, ``weights="ls", guard=False``), each from the same dense weights (restored between runs), on random
calibration token ids drawn with a fixed seed:

* ``--model llama-3.1-8b`` (or ``llama-3.1-70b``): the LLaMA-3.1 architecture built from its config with
  random weights (no download). ``--blocks K`` builds only the first K decoder blocks; the full-model time
  is then extrapolated as capture + N x the mean block time, and the output says so.
* ``--model smollm2``: the packaged default model (SmolLM2-135M-Instruct), ``--blocks K`` keeps K blocks.
* ``--model tiny``: a tiny random LLaMA (2 blocks, hidden 64), for the smoke test.

Printed per T: the prune_model wall time, the capture time (before the first block), the mean time per block
(Gram accumulation, start mask, refinement, masking and the pruned block's forward), the full-model time
(extrapolated from K of N blocks when K < N), the figure per iteration (per layer: refinement time / the
iterations it ran, summed over layers; the refinement time is the layer's time, ``seconds_mask +
seconds_weights``, minus its T=0 time when T=0 is in ``--iters``), the swaps, the peak memory
(``torch.cuda.max_memory_allocated`` on CUDA; the process's peak resident set, reset before each run where Linux
allows it, on CPU) and the mean per-layer error reduction over the start mask.

On CUDA the input embeddings, rotary embedding and block 0 are moved to the device before each run, so the
calibration capture (embeddings + block 0 forward) runs there; ``prune_model`` moves every block to the
device while it prunes it and back to the CPU after.

``--memory-plan NAME`` prints, from the layer shapes alone, what each stage holds for LLaMA-3.1-8B / 70B.

    python benchmarks/llm_pipeline.py --model llama-3.1-8b --blocks 2 --iters 0 1 5 25 100 --device cuda
    python benchmarks/llm_pipeline.py --model smollm2 --iters 100 --nsamples 16 --seqlen 256 --device cpu
    python benchmarks/llm_pipeline.py --memory-plan llama-3.1-70b
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sparseswaps_prune.core.backends import resolve_backend
from sparseswaps_prune.core.layer import prune_layer
from sparseswaps_prune.core.refine import ROW_BATCH_ELEMENTS
from sparseswaps_prune.core.spec import SCORES, SPARSESWAPS_SPEC, SwapRefine, build_spec
from sparseswaps_prune.llm import pipeline
from sparseswaps_prune.llm.io.memory import MemoryProbe
from sparseswaps_prune.llm.pipeline import PruneOptions, finalize, prune_model
from sparseswaps_prune.modules import find_blocks
from sparseswaps_prune.recipes import RECIPES

GB = 1e9

# LLaMA-3.1 rotary embedding: theta 500000 with the "llama3" frequency scaling (transformers 5 keeps
# rope_theta inside rope_parameters).
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA31_COMMON: dict[str, Any] = {
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "rope_parameters": LLAMA3_ROPE,
    "use_cache": False,
}
LLAMA_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        **_LLAMA31_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    "llama-3.1-70b": {
        **_LLAMA31_COMMON,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    },
}
MODELS = (*LLAMA_CONFIGS, "smollm2", "tiny")
# Calibration defaults per model: the paper's 128 x 2048 for LLaMA, 16 x 256 for SmolLM2 (the main job's until
# 2026-11-27, kept so that this script's timings stay comparable; the main job now calibrates on 64 windows).
DEFAULT_CALIB = {"llama-3.1-8b": (128, 2048), "llama-3.1-70b": (128, 2048), "smollm2": (16, 256), "tiny": (2, 32)}


# ----------------------------------------------------------------------------------------------------------
# Models and calibration tokens


def llama_config(name: str, num_hidden_layers: int | None = None):
    """The ``LlamaConfig`` of LLaMA-3.1-8B / 70B, optionally with only the first ``num_hidden_layers`` blocks."""
    from transformers import LlamaConfig

    fields = dict(LLAMA_CONFIGS[name])
    if num_hidden_layers is not None:
        fields["num_hidden_layers"] = num_hidden_layers
    return LlamaConfig(**fields)


def _keep_first_blocks(model: nn.Module, k: int) -> None:
    """Drop every decoder block after the first ``k`` (the model then runs ``k`` blocks)."""
    name, blocks = find_blocks(model)
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, nn.ModuleList(list(blocks)[:k]))
    model.config.num_hidden_layers = k
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:k]


def _check_host_memory(n_params: int, dtype: torch.dtype, what: str) -> None:
    need = n_params * dtype.itemsize
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > 0.8 * have:
        raise SystemExit(
            f"{what} needs {need / GB:.1f} GB of host memory in {dtype}; this machine has {have / GB:.1f} GB. "
            "Pass --blocks K to build only the first K decoder blocks (the total is then extrapolated)"
        )


def build_model(name: str, blocks: int | None, dtype: torch.dtype, seed: int = 0) -> tuple[nn.Module, int]:
    """The model to prune (CPU, eval mode) and the block count N of the full model it stands for."""
    from transformers import AutoModelForCausalLM

    if name in LLAMA_CONFIGS:
        full = LLAMA_CONFIGS[name]["num_hidden_layers"]
        config = llama_config(name, blocks)
        _check_host_memory(_llama_params(LLAMA_CONFIGS[name], config.num_hidden_layers)[0], dtype, name)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.eval()
        return model, full
    if name == "smollm2":
        from sparseswaps_prune.llm.models import load_model

        model, _ = load_model(dtype=dtype)
    elif name == "tiny":
        from sparseswaps_prune.llm.models import tiny_model

        model = tiny_model("llama", seed=seed).to(dtype)
    else:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    full = len(find_blocks(model)[1])
    if blocks is not None and blocks < full:
        _keep_first_blocks(model, blocks)
    model.eval()
    return model, full


def calibration_tokens(model: nn.Module, source: str, nsamples: int, seqlen: int, seed: int = 0) -> torch.Tensor:
    """``[nsamples, seqlen]`` int64 ids: uniform random over the vocabulary, or windows of the built-in corpus."""
    if source == "builtin":
        from sparseswaps_prune.llm.data import load_calibration
        from sparseswaps_prune.llm.models import default_tokenizer

        return load_calibration("builtin", default_tokenizer(), nsamples, seqlen, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (nsamples, seqlen), generator=gen)


# ----------------------------------------------------------------------------------------------------------
# Timing, memory, restoring the dense weights


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def block_clock(device: torch.device) -> Iterator[list[float]]:
    """Record the clock each time ``prune_model`` starts a block (it calls ``pipeline._prune_block`` once per
    block); pipeline.py itself is not changed. Block k's time is the gap to the next start (or the end)."""
    marks: list[float] = []
    original = pipeline._prune_block

    def timed(*args: Any, **kwargs: Any):
        _sync(device)
        marks.append(time.perf_counter())
        return original(*args, **kwargs)

    pipeline._prune_block = timed
    try:
        yield marks
    finally:
        pipeline._prune_block = original


def _peak_meter(device: torch.device) -> tuple[str, Callable[[], int]]:
    """Reset the peak-memory counter; returns what it measures and the function that reads it (bytes):
    CUDA's ``max_memory_allocated``, or the peak resident set of the process (``MemoryProbe``)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return "cuda max_memory_allocated", lambda: torch.cuda.max_memory_allocated(device)
    probe = MemoryProbe()
    return ("peak RSS of this run" if probe.since == "call" else "peak RSS since the process started"), probe.peak


def snapshot_blocks(model: nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of every decoder-block parameter (the only ones ``prune_model`` changes)."""
    return {name: p.detach().to("cpu", copy=True) for name, p in find_blocks(model)[1].named_parameters()}


@torch.no_grad()
def restore_blocks(model: nn.Module, snapshot: dict[str, torch.Tensor]) -> None:
    """Undo a ``prune_model`` run: drop the pruning reparametrization, then copy the dense weights back."""
    finalize(model)
    params = dict(find_blocks(model)[1].named_parameters())
    if params.keys() != snapshot.keys():
        raise RuntimeError("the decoder blocks' parameters changed names; cannot restore the dense weights")
    for name, p in params.items():
        p.copy_(snapshot[name])


def _stale_device_bytes(model: nn.Module) -> int:
    """Bytes of pruned layers' computed ``weight`` left on another device than their ``weight_orig`` (prune's
    computed weight is a plain attribute, which ``Module.to`` does not move)."""
    total = 0
    for module in model.modules():
        orig, weight = getattr(module, "weight_orig", None), getattr(module, "weight", None)
        if isinstance(orig, torch.Tensor) and isinstance(weight, torch.Tensor) and weight.device != orig.device:
            total += weight.numel() * weight.element_size()
    return total


def _place_for_capture(model: nn.Module, device: torch.device) -> None:
    """Move what the calibration capture runs (input embeddings, rotary embedding, block 0) to ``device``."""
    if device.type == "cpu":
        return
    name, blocks = find_blocks(model)
    model.get_input_embeddings().to(device)
    for module_name, module in model.named_modules():
        if module_name.endswith("rotary_emb") and not module_name.startswith(name + "."):
            module.to(device)
    blocks[0].to(device)


def warm_up(device: torch.device, nm: tuple[int, int] | None) -> None:
    """Compile the swap-search kernel (numba / triton) on a small problem so no run times its JIT."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=gen)
    weight, gram = torch.randn(16, 64, generator=gen).to(device), (x.T @ x).to(device)
    spec = build_spec(SPARSESWAPS_SPEC, sparsity=None if nm else 0.5, nm=nm, start="wanda", max_iters=2, weights="keep")
    prune_layer(weight, gram, spec, device=device)
    _sync(device)


def _seconds(report: pipeline.LayerReport) -> float:
    """A layer's pruning time: its mask stages (start and refinement) and its weight stage."""
    return report.seconds_mask + report.seconds_weights


def run_once(
    model: nn.Module,
    tokens: torch.Tensor,
    options: PruneOptions,
    device: torch.device,
    batch_size: int,
    full_blocks: int,
) -> dict[str, Any]:
    """One ``prune_model`` run; returns its row (times, memory, losses, per-block and per-layer figures)."""
    n_blocks = len(find_blocks(model)[1])
    _place_for_capture(model, device)
    peak_kind, read_peak = _peak_meter(device)
    with block_clock(device) as marks:
        _sync(device)
        start = time.perf_counter()
        result = prune_model(model, tokens, options, device=device, batch_size=batch_size, progress=False)
        _sync(device)
        end = time.perf_counter()
    peak = read_peak()
    stale = _stale_device_bytes(model)
    if len(marks) != n_blocks:
        raise RuntimeError(
            f"pipeline._prune_block ran {len(marks)} times for {n_blocks} blocks; update block_clock to how "
            "prune_model now runs its blocks"
        )
    bounds = [*marks, end]
    block_seconds = [b - a for a, b in itertools.pairwise(bounds)]
    capture = marks[0] - start
    mean_block = sum(block_seconds) / n_blocks
    layers = result.layers
    per_block = []
    for k in range(n_blocks):
        mine = [r for r in layers if r.block == k]
        per_block.append(
            {
                "block": k,
                "seconds": block_seconds[k],
                "layer_seconds": sum(_seconds(r) for r in mine),
                "loss_start": sum(r.loss_start for r in mine),
                "loss_refined": sum(r.loss_refined for r in mine),
                "n_swaps": sum(r.n_swaps for r in mine),
            }
        )
    return {
        "iters": getattr(options.spec.refine, "max_iters", 0),  # 0 where nothing swaps (e.g. the default)
        "prune_seconds": end - start,
        "capture_seconds": capture,
        "mean_block_seconds": mean_block,
        "blocks_run": n_blocks,
        "blocks_total": full_blocks,
        "extrapolation_factor": full_blocks / n_blocks,
        "full_model_seconds": capture + full_blocks * mean_block,
        "extrapolated": n_blocks < full_blocks,
        "seconds_per_iter": None,  # filled in by add_per_iteration once every T has run
        "n_swaps": sum(r.n_swaps for r in layers),
        "peak_memory_bytes": peak,
        "peak_memory_kind": peak_kind,
        "stale_device_bytes": stale,
        "loss_start": sum(r.loss_start for r in layers),
        "loss_refined": sum(r.loss_refined for r in layers),
        "mean_layer_reduction": sum(r.reduction for r in layers) / max(1, len(layers)),
        "blocks": per_block,
        "layers": [
            {
                "name": r.name,
                "block": r.block,
                "d_out": r.d_out,
                "d_in": r.d_in,
                "seconds": _seconds(r),
                "iters": r.iters,
                "n_swaps": r.n_swaps,
                "loss_start": r.loss_start,
                "loss_refined": r.loss_refined,
            }
            for r in layers
        ],
    }


def add_per_iteration(rows: list[dict[str, Any]]) -> None:
    """Set the ``seconds_per_iter`` of every row above the smallest T: per layer, (its time - its time in the
    smallest-T run) / (the iterations it ran - the iterations it ran there, at least 1), summed over the layers run.
    With a T=0 run the difference is the refinement (with the re-fit objective, its state build included); with a
    smallest T > 0 it is the marginal cost of one more iteration. With a single row the start mask is included
    (``per_iter_includes_start`` says so)."""
    base_row = min(rows, key=lambda r: r["iters"]) if len(rows) > 1 else None
    base = {layer["name"]: layer for layer in base_row["layers"]} if base_row else {}
    for row in rows:
        if row["iters"] == 0 or (base_row is not None and row["iters"] <= base_row["iters"]):
            continue
        total = 0.0
        for layer in row["layers"]:
            ref = base.get(layer["name"], {"seconds": 0.0, "iters": 0})
            refine = layer["seconds"] - ref["seconds"]
            total += max(0.0, refine) / max(1, layer["iters"] - ref["iters"])
        row["seconds_per_iter"] = total
        row["per_iter_includes_start"] = base_row is None
        row["per_iter_base"] = base_row["iters"] if base_row else None


# ----------------------------------------------------------------------------------------------------------
# Memory plan from the shapes


def _llama_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """``[d_out, d_in]`` of every linear layer of one LLaMA decoder block."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (inter, h),
        "up_proj": (inter, h),
        "down_proj": (h, inter),
    }


def _llama_params(cfg: dict[str, Any], n_blocks: int | None = None) -> tuple[int, int, int]:
    """(total parameters, linear parameters per block, parameters per block) of a LLaMA model."""
    n_blocks = cfg["num_hidden_layers"] if n_blocks is None else n_blocks
    linear = sum(o * i for o, i in _llama_shapes(cfg).values())
    block = linear + 2 * cfg["hidden_size"]  # + the two RMSNorm weights
    embed = cfg["vocab_size"] * cfg["hidden_size"] * (1 if cfg["tie_word_embeddings"] else 2)
    return embed + n_blocks * block + cfg["hidden_size"], linear, block


def memory_plan(
    name: str, nsamples: int = 128, seqlen: int = 2048, dtype: torch.dtype = torch.bfloat16, batch_size: int = 1
) -> tuple[dict[str, tuple[str, str, float]], dict[str, tuple[str, list[str]]]]:
    """What the pipeline holds for LLaMA-3.1 ``name``, from the layer shapes and the code as it is.

    Returns ``(items, phases)``: ``items[key] = (where, what, bytes)`` with ``where`` ``"device"`` (the
    compute device, which holds one block at a time) or ``"host"`` (CPU memory); ``phases[name] = (where,
    keys)`` lists the items alive together at one step, so the peak of ``where`` is the largest phase sum.
    The sizes count the tensors each step allocates (pipeline.py, capture.py, refine.py, losses.py,
    warmstart.py); allocator slack and small tensors are left out.
    """
    cfg = LLAMA_CONFIGS[name]
    b = dtype.itemsize
    dt = str(dtype).removeprefix("torch.")
    h, inter, n_blocks = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = h // cfg["num_attention_heads"]
    shapes = _llama_shapes(cfg)
    total, linear, block = _llama_params(cfg)
    # one Gram per distinct input: q/k/v share the block input, gate/up share the post-attention input
    gram_inputs = {"q/k/v": h, "o_proj": shapes["o_proj"][1], "gate/up": h, "down_proj": shapes["down_proj"][1]}
    d_max = max(gram_inputs.values())
    wide_out, wide_in = max(shapes.values(), key=lambda s: (s[1], s[0]))  # down_proj, the block's last layer
    biggest = max(o * i for o, i in shapes.values())
    rows_per_batch = ROW_BATCH_ELEMENTS // d_max  # every [rows, d_in] tensor of the swap loop is 2^24 elements
    n_batches = -(-nsamples // batch_size)
    items = {
        "block": ("device", f"one block's weights, dense ({dt}; {block / 1e6:.0f} M parameters)", block * b),
        "masked": (
            "device",
            f"  + once its 7 layers are masked: weight_mask + the computed masked weight (both {dt}; "
            "weight_orig is the dense weight itself)",
            2 * linear * b,
        ),
        "grams": (
            "device",
            "Grams of the block's 4 distinct inputs, fp32, alive while the block's layers are pruned ("
            + ", ".join(f"{k} {d}" for k, d in gram_inputs.items())
            + ")",
            sum(4 * d * d for d in gram_inputs.values()),
        ),
        "copies": (
            "device",
            f"refine_mask's float64 + float32 copies of the widest Gram (d_in {d_max})",
            12 * d_max**2,
        ),
        "layer": (
            "device",
            "largest layer: float32 copy of its weight + 3 bool [d_out, d_in] masks",
            biggest * (4 + 3),
        ),
        "engine": (
            "device",
            f"swap loop, one row batch: ~6 float64, 7 float32, 2 bool [rows, d_in] ({rows_per_batch} rows at d_in "
            f"{d_max}; the torch backend adds 0.8 GB, triton nothing)",
            ROW_BATCH_ELEMENTS * (6 * 8 + 7 * 4 + 2),
        ),
        "losses": (
            "device",
            f"row_losses at the end of refine_mask (on its float64 Gram): ~3 float64 [{wide_out}, {wide_in}]",
            3 * 8 * wide_out * wide_in,
        ),
        "forward": (
            "device",
            f"block forward, batch {batch_size}: MLP and attention activations + the Gram hook's fp32 input copy",
            batch_size * seqlen * (inter * (3 * b + 4) + (2 * h + 2 * cfg["num_key_value_heads"] * hd) * b),
        ),
        "io": ("device", "one batch of block inputs and outputs", 2 * batch_size * seqlen * h * b),
        "embed": (
            "device",
            "input embeddings (this benchmark moves them to the device for the capture)",
            cfg["vocab_size"] * h * b,
        ),
        "warmstart": (
            "device",
            "Wanda warmstart of the largest layer: scores and sorted scores (fp32) + sort indices (int64)",
            16 * biggest,
        ),
        "model": ("host", f"dense model ({dt}; {total / 1e9:.2f} B parameters)", total * b),
        "model_masked": (
            "host",
            f"  + weight_mask of every pruned weight ({dt}, until finalize) and the computed masked weight "
            "(prune_model recomputes it on the host when a block leaves the device)",
            2 * n_blocks * linear * b,
        ),
        "masks": ("host", "PruneResult.masks + .warmstart_masks: bool, 1 byte per weight each", 2 * n_blocks * linear),
        "inputs": ("host", f"captured block inputs [{nsamples}, {seqlen}, {h}] {dt}", nsamples * seqlen * h * b),
        "outputs": ("host", "  + the next block's inputs, written by run_block", nsamples * seqlen * h * b),
        "kwargs": (
            "host",
            "recorded block kwargs per batch: cos/sin [1, seqlen, head_dim] + position_ids (attention_mask None)",
            n_batches * (2 * seqlen * hd * b + 8 * seqlen),
        ),
    }
    phases = {
        "Gram accumulation (dense block forward with hooks)": ("device", ["block", "grams", "forward", "io", "embed"]),
        "warmstart of the largest layer": ("device", ["block", "masked", "grams", "layer", "warmstart", "embed"]),
        "swap loop of down_proj (last layer: the others masked)": (
            "device",
            ["block", "masked", "grams", "copies", "layer", "engine", "embed"],
        ),
        "row_losses of down_proj": ("device", ["block", "masked", "grams", "copies", "layer", "losses", "embed"]),
        "run_block (masked block forward)": ("device", ["block", "masked", "forward", "io", "embed"]),
        "last block done (all on the host)": (
            "host",
            ["model", "model_masked", "masks", "inputs", "outputs", "kwargs"],
        ),
    }
    return items, phases


def print_memory_plan(name: str, nsamples: int, seqlen: int, dtype: torch.dtype, batch_size: int) -> None:
    items, phases = memory_plan(name, nsamples, seqlen, dtype, batch_size)
    cfg = LLAMA_CONFIGS[name]
    print(
        f"memory plan: {name} (hidden {cfg['hidden_size']}, intermediate {cfg['intermediate_size']}, "
        f"{cfg['num_hidden_layers']} blocks, vocab {cfg['vocab_size']}), weights "
        f"{str(dtype).removeprefix('torch.')}, calibration {nsamples} x {seqlen}, batch {batch_size}; GB = 1e9 bytes"
    )
    for where in ("device", "host"):
        for item_where, what, size in items.values():
            if item_where == where:
                print(f"  {where:<6} {size / GB:>7.2f} GB  {what}")
        sums = {phase: sum(items[k][2] for k in keys) for phase, (w, keys) in phases.items() if w == where}
        for phase, size in sums.items():
            print(f"  {where:<6} {size / GB:>7.2f} GB  = {phase}")
        print(f"  {where:<6} {max(sums.values()) / GB:>7.2f} GB  = estimated peak ({where})")


# ----------------------------------------------------------------------------------------------------------


def _fmt_bytes(n: int) -> str:
    return f"{n / GB:.2f} GB"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="llama-3.1-8b")
    parser.add_argument("--blocks", type=int, default=None, help="build/keep only the first K decoder blocks")
    parser.add_argument("--nsamples", type=int, default=None, help="calibration windows (default per model)")
    parser.add_argument("--seqlen", type=int, default=None, help="tokens per window (default per model)")
    parser.add_argument("--calib", choices=("random", "builtin"), default="random", help="token ids")
    parser.add_argument("--iters", type=int, nargs="+", default=[0, 1, 5, 25, 100], help="T values, one run each")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto", help="weights dtype (auto: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--start", default="wanda", choices=SCORES, help="start mask scores (default wanda)")
    parser.add_argument("--sparsity", type=float, default=0.6)
    parser.add_argument("--objective", choices=("mask", "refit"), default="mask", help="SparseSwaps objective")
    parser.add_argument("--nm", default=None, help="N:M pattern such as 2:4 (instead of --sparsity)")
    parser.add_argument("--batch-size", type=int, default=1, help="calibration windows per block forward")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--block-tune-epochs",
        type=int,
        default=0,
        help="block tuning epochs after each block (default 0: this benchmark times the swaps, not the tuning)",
    )
    parser.add_argument(
        "--recipe",
        choices=tuple(RECIPES),
        default=None,
        help="time a named spec at --sparsity/--nm instead of the --start/--objective/--weights sweep (e.g. default: "
        "ALPS's solution; a recipe that does not swap runs once, --iters ignored)",
    )
    parser.add_argument("--json", default=None, help="write the rows (with per-block and per-layer figures) here")
    parser.add_argument("--memory-plan", choices=tuple(LLAMA_CONFIGS), default=None, help="print it and exit")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    default_n, default_len = DEFAULT_CALIB.get(args.memory_plan or args.model, (128, 2048))
    nsamples, seqlen = args.nsamples or default_n, args.seqlen or default_len
    if args.memory_plan:
        plan_dtype = dtype if args.dtype != "auto" else torch.bfloat16
        print_memory_plan(args.memory_plan, nsamples, seqlen, plan_dtype, args.batch_size)
        return []
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"device {args.device!r} requested but CUDA is not available; use --device cpu")
    nm = tuple(int(v) for v in args.nm.split(":")) if args.nm else None
    sparsity = None if nm else args.sparsity

    model, full_blocks = build_model(args.model, args.blocks, dtype, seed=args.seed)
    n_blocks = len(find_blocks(model)[1])
    tokens = calibration_tokens(model, args.calib, nsamples, seqlen, seed=args.seed)
    backend = resolve_backend("auto", device, nm)
    gpu = f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    print(
        f"machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"device {device}{gpu}"
    )
    print(
        f"model: {args.model} ({dtype_name}, random weights)"
        if args.model in LLAMA_CONFIGS
        else f"model: {args.model} ({dtype_name})"
    )
    if args.recipe:
        recipe = build_spec(RECIPES[args.recipe].spec, sparsity=sparsity, nm=nm)
        swaps = isinstance(recipe.refine, SwapRefine)
        iters_list = args.iters if swaps else [0]
        method = f"--recipe {args.recipe}: {recipe.describe()}"
    else:
        recipe, iters_list = None, args.iters
        method = f"{args.start} start, {args.nm or f'{sparsity:.0%} per row'}, {args.objective} objective"
    print(
        f"calibration: {nsamples} x {seqlen} {args.calib} tokens (seed {args.seed}), batch {args.batch_size}; "
        f"{method}, search backend {backend}, block tuning {args.block_tune_epochs} epochs"
    )
    if n_blocks < full_blocks:
        print(
            f"blocks: {n_blocks} of {full_blocks} run; 'full model s' is EXTRAPOLATED from {n_blocks} of "
            f"{full_blocks} blocks: capture + {full_blocks} x mean block time (extrapolation factor "
            f"{full_blocks / n_blocks:.1f})"
        )
    else:
        print(f"blocks: all {n_blocks} run; 'full model s' is measured (extrapolation factor 1.0)")
    if device.type != "cpu":
        print("capture: input embeddings, rotary embedding and block 0 moved to the device before each run")

    warm_up(device, nm)
    snapshot = snapshot_blocks(model) if len(iters_list) > 1 else None
    rows = []
    for i, iters in enumerate(iters_list):
        if i:
            restore_blocks(model, snapshot)
        if recipe is not None:
            spec = build_spec(recipe, max_iters=iters) if swaps else recipe
        else:
            # the re-fit objective yields its re-fitted weights itself (weights="ls"; no held-out windows: unguarded)
            weights = {"weights": "ls", "guard": False} if args.objective == "refit" else {"weights": "keep"}
            spec = build_spec(
                SPARSESWAPS_SPEC,
                start=args.start,
                sparsity=sparsity,
                nm=nm,
                max_iters=iters,
                objective=args.objective,
                **weights,
            )
        options = PruneOptions(spec=spec, block_tune_epochs=args.block_tune_epochs)
        rows.append(run_once(model, tokens, options, device, args.batch_size, full_blocks))
        print(f"  T={iters}: prune_model {rows[-1]['prune_seconds']:.2f} s", flush=True)
    add_per_iteration(rows)

    print(
        f"{'T':>4} {'prune s':>9} {'capture s':>9} {'s/block':>9} {'full model s':>12} {'s/iter':>8} "
        f"{'swaps':>10} {'peak mem':>10} {'layer red.':>10}"
    )
    for row in rows:
        per_iter = "-" if row["seconds_per_iter"] is None else f"{row['seconds_per_iter']:.3f}"
        full = f"{row['full_model_seconds']:.1f}{'*' if row['extrapolated'] else ''}"
        print(
            f"{row['iters']:>4} {row['prune_seconds']:>9.2f} {row['capture_seconds']:>9.2f} "
            f"{row['mean_block_seconds']:>9.2f} {full:>12} {per_iter:>8} {row['n_swaps']:>10} "
            f"{_fmt_bytes(row['peak_memory_bytes']):>10} {row['mean_layer_reduction']:>10.1%}"
        )
    notes = [f"peak mem: {rows[0]['peak_memory_kind']}" if rows else ""]
    if rows and rows[0]["extrapolated"]:
        notes.append(f"* extrapolated from {n_blocks} of {full_blocks} blocks")
    if any(r.get("per_iter_includes_start") for r in rows):
        notes.append("s/iter includes the start mask (no T=0 run to subtract)")
    elif rows and min(r["iters"] for r in rows) > 0:
        notes.append(
            f"s/iter: per layer (time - its T={min(r['iters'] for r in rows)} time) / extra iterations run, "
            "summed over layers (the marginal cost of an iteration)"
        )
    else:
        notes.append("s/iter: per layer (time - its T=0 time) / iterations run, summed over layers")
    print("; ".join(n for n in notes if n))
    stale = max((r["stale_device_bytes"] for r in rows), default=0)
    if stale:
        print(
            f"note: after a run, {_fmt_bytes(stale)} of masked weights of the finished blocks were still on {device} "
            "(pipeline.py moves blocks back with .to('cpu'), which leaves prune's computed weight behind); the "
            "peak above includes them, and a full-depth run holds one block's worth more per extra block"
        )
    if args.json:
        setup = {
            "model": args.model,
            "dtype": dtype_name,
            "device": str(device),
            "nsamples": nsamples,
            "seqlen": seqlen,
            "calib": args.calib,
            "start": args.start,
            "objective": args.objective,
            "recipe": args.recipe,
            "spec": None if recipe is None else recipe.to_dict(),
            "sparsity": sparsity,
            "nm": list(nm) if nm else None,
            "backend": backend,
            "blocks_run": n_blocks,
            "blocks_total": full_blocks,
            "torch": torch.__version__,
        }
        Path(args.json).write_text(json.dumps({"setup": setup, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
