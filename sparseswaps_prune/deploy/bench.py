"""Measuring what deployment gains: size on disk, resident memory and decoding speed, dense against sparse; and
the least size a sparse checkpoint of a model can have (:func:`size_bound`).

Used by ``benchmarks/sparse_inference.py`` and the ``sparseswaps bench`` command. :func:`bench_model_dir` runs the
whole comparison on a saved model directory (dense ``save_pretrained`` or sparse :func:`~.save_sparse`) and returns
a JSON-ready dict.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sparseswaps_prune.deploy.checkpoint import is_sparse_checkpoint, load_sparse, save_sparse
from sparseswaps_prune.deploy.format import DEFAULT_MIN_SPARSITY, packed_width
from sparseswaps_prune.deploy.linear import SparseLinear

__all__ = [
    "bench_model",
    "bench_model_dir",
    "decode_speed",
    "decode_speeds",
    "dir_bytes",
    "greedy_kwargs",
    "machine_line",
    "resident_memory",
    "size_bound",
    "tensor_bytes",
]


def machine_line() -> str:
    """One line naming the machine: platform, processor, CPU count, torch and numba threads, torch version."""
    import numba

    return (
        f"{platform.platform()} | {platform.processor() or platform.machine()} | {os.cpu_count()} CPUs | "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads) | numba {numba.__version__} "
        f"({numba.get_num_threads()} threads) | load average {os.getloadavg()[0]:.2f}"
    )


def dir_bytes(path: str | os.PathLike[str], pattern: str = "*") -> int:
    """Total size of the files of ``path`` (not recursive) whose names match ``pattern``."""
    return sum(p.stat().st_size for p in Path(path).glob(pattern) if p.is_file())


def tensor_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (each storage counted once, so tied weights count once)."""
    seen: set[tuple[Any, ...]] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        key = (tensor.device, storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def size_bound(model: nn.Module, pruned: Iterable[str], sparsity: float, target_ratio: float = 0.5) -> dict[str, Any]:
    """The least size a sparse checkpoint of ``model`` can have when the weights named in ``pruned`` are pruned at
    ``sparsity`` and nothing else is: every other tensor stored as it is, each pruned weight as its bitmask
    (``rows * ceil(cols / 8)`` bytes) and ``(1 - sparsity)`` of its values (no zero signs, no file header). Reads
    only shapes and dtypes: ``model`` may live on the ``meta`` device (built from a config, no weights).

    Args:
        model: the model; tied tensors (the same parameter under two names) count once.
        pruned: state-dict names of the 2-D weights that are pruned (e.g. the decoder blocks' linear weights).
        sparsity: fraction of each pruned weight's entries that are zero, in ``[0, 1]``.
        target_ratio: the size ratio to solve for in ``sparsity_for_target``.

    Returns:
        A JSON-ready dict, bytes unless said: ``dense_bytes`` (every tensor once, in its dtype), ``unpruned_bytes``
        (the tensors not in ``pruned``), ``values_bytes``, ``bitmask_bytes``, ``bound_bytes`` (their sum),
        ``ratio`` (``bound_bytes / dense_bytes``), ``pruned_fraction`` (of the parameters), and
        ``sparsity_for_target``: the least sparsity of the same weights whose bound is at most ``target_ratio``
        of the dense bytes (None when even pruning them entirely would not get there).

    Raises:
        ValueError: a name of ``pruned`` that is not a 2-D tensor of the state dict, or ``sparsity`` outside
            ``[0, 1]``.
    """
    if not 0.0 <= sparsity <= 1.0:
        raise ValueError(f"sparsity must be in [0, 1], got {sparsity!r}")
    state = model.state_dict(keep_vars=True)
    pruned = set(pruned)
    bad = sorted(name for name in pruned if name not in state or state[name].dim() != 2)
    if bad:
        raise ValueError(f"pruned names {bad[:3]} are not 2-D tensors of the model's state dict")
    seen: set[int] = set()
    dense = unpruned = kept_values = bitmask = pruned_params = params = 0
    for name, tensor in state.items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        size = tensor.numel() * tensor.element_size()
        dense += size
        params += tensor.numel()
        if name in pruned:
            rows, cols = tensor.shape
            kept_values += size
            bitmask += rows * packed_width(cols)
            pruned_params += tensor.numel()
        else:
            unpruned += size
    values = kept_values * (1.0 - sparsity)
    bound = unpruned + values + bitmask
    room = target_ratio * dense - unpruned - bitmask  # what the kept values may take
    least = 1.0 - room / kept_values if kept_values else None
    return {
        "sparsity": sparsity,
        "dense_bytes": dense,
        "unpruned_bytes": unpruned,
        "values_bytes": values,
        "bitmask_bytes": bitmask,
        "bound_bytes": bound,
        "ratio": bound / dense,
        "pruned_fraction": pruned_params / params,
        "target_ratio": target_ratio,
        "sparsity_for_target": None if least is None or least > 1.0 else max(least, 0.0),
    }


def decode_speeds(
    models: dict[str, nn.Module], input_ids: torch.Tensor, new_tokens: int = 32, repeats: int = 3
) -> dict[str, tuple[float, torch.Tensor]]:
    """Greedy decoding speed of several models, their timed runs interleaved (so that a change in the machine's
    load hits them alike): ``new_tokens`` tokens (exactly: ``min_new_tokens`` is set) after ``input_ids``.

    Args:
        models: name -> transformers causal LM.
        input_ids: ``[1, prompt]`` token ids.
        new_tokens: tokens to generate.
        repeats: timed runs of each model, after a warm-up generating 2 tokens.

    Returns:
        name -> ``(tokens_per_second, token_ids)``: ``new_tokens`` over the median wall time of a ``generate`` call
        (the prompt's prefill included), and the generated ids ``[1, prompt + new_tokens]``.
    """
    times: dict[str, list[float]] = {name: [] for name in models}
    ids: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for model in models.values():
            model.generate(input_ids, **greedy_kwargs(model, 2))
        for _ in range(max(1, repeats)):
            for name, model in models.items():
                start = time.perf_counter()
                ids[name] = model.generate(input_ids, **greedy_kwargs(model, new_tokens))
                times[name].append(time.perf_counter() - start)
    return {name: (new_tokens / statistics.median(times[name]), ids[name]) for name in models}


def decode_speed(
    model: nn.Module, input_ids: torch.Tensor, new_tokens: int = 32, repeats: int = 3
) -> tuple[float, torch.Tensor]:
    """:func:`decode_speeds` of one model: ``(tokens_per_second, token_ids)``."""
    return decode_speeds({"model": model}, input_ids, new_tokens, repeats)["model"]


def greedy_kwargs(model: nn.Module, new_tokens: int) -> dict[str, Any]:
    """``generate`` options for exactly ``new_tokens`` greedy tokens with the KV cache (what the speeds time)."""
    config = model.config
    return {
        "max_new_tokens": new_tokens,
        "min_new_tokens": new_tokens,
        "do_sample": False,
        "use_cache": True,
        "pad_token_id": getattr(config, "pad_token_id", None) or getattr(config, "eos_token_id", None),
    }


_RSS_CODE = """
import ctypes, gc, json, sys
def status():
    values = {}
    for line in open("/proc/self/status"):
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon"):
            values[key] = int(rest.split()[0]) * 1024
    return values
import numpy, torch, transformers
from sparseswaps_prune.deploy import load_sparse, is_sparse_checkpoint, sparsify
from sparseswaps_prune.deploy.bench import tensor_bytes
from sparseswaps_prune.deploy.kernels import spmm
torch.set_num_threads(1)
f32 = numpy.float32
spmm(numpy.ones((1, 1), numpy.uint8), numpy.array([0, 1], numpy.int64), numpy.zeros(9, f32), numpy.ones((1, 8), f32))
path, mode, min_sparsity = sys.argv[1], sys.argv[2], float(sys.argv[3])
base = status()
if is_sparse_checkpoint(path):
    model = load_sparse(path, sparse=mode == "sparse")
else:
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    if mode == "sparse":
        sparsify(model, min_sparsity)
gc.collect()
with torch.inference_mode():  # touch every weight, as inference does
    model(torch.ones(1, 8, dtype=torch.long))
gc.collect()
try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
except OSError:
    pass
after = status()
print(json.dumps({"before": base, "after": after, "tensor_bytes": tensor_bytes(model)}))
"""


def resident_memory(
    model_dir: str | os.PathLike[str], sparse: bool, min_sparsity: float = DEFAULT_MIN_SPARSITY
) -> dict:
    """Resident memory of a model loaded in a fresh Python process (Linux ``/proc/self/status``).

    The process first imports torch, transformers and numba and runs the sparse kernel once (their code and JIT
    state are not the model's), records its resident set, loads the model, runs one forward pass on 8 tokens
    (touching every weight, as inference does), frees what it can (``gc``, ``malloc_trim``), and records it again.
    A sparse checkpoint loads with :func:`~.load_sparse` (``sparse=sparse``: the pruned linears never exist densely);
    a dense one with ``from_pretrained`` (whose weights stay mapped from the file) then :func:`~.sparsify` if asked.

    Args:
        model_dir: a sparse checkpoint (preferred: both variants then hold their weights in anonymous memory) or a
            ``save_pretrained`` directory.
        sparse: run the model sparse.
        min_sparsity: passed to :func:`~.sparsify` for a dense directory.

    Returns:
        ``{"rss_model", "anon_model", "tensor_bytes", "before", "after"}``: the growth of the resident set (VmRSS)
        and of its anonymous part (RssAnon) in bytes, the model's tensor bytes, and the raw readings; the growths
        are None where ``/proc/self/status`` lacks them.

    Raises:
        RuntimeError: the subprocess failed (its stderr's last lines in the message).
    """
    command = [sys.executable, "-c", _RSS_CODE, str(model_dir), "sparse" if sparse else "dense", str(min_sparsity)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the memory probe failed: {done.stderr.strip()[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for key, name in (("VmRSS", "rss_model"), ("RssAnon", "anon_model")):
        before, after = result["before"].get(key), result["after"].get(key)
        result[name] = after - before if before is not None and after is not None else None
    return result


def _ratio(a: int | None, b: int | None) -> float | None:
    return a / b if a is not None and b else None


def bench_model_dir(model_dir: str | os.PathLike[str], **options: Any) -> dict[str, Any]:
    """:func:`bench_model` of a saved pruned model.

    Args:
        model_dir: a dense ``save_pretrained`` directory or a sparse checkpoint (:func:`~.save_sparse`).
        **options: keyword arguments of :func:`bench_model` (``prompt_ids``, ``new_tokens``, ``repeats``,
            ``threads``, ``min_sparsity``, ``memory``).

    Returns:
        :func:`bench_model`'s dict, with ``model_dir`` added.

    Raises:
        FileNotFoundError: ``model_dir`` does not exist.
    """
    from transformers import AutoModelForCausalLM

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} does not exist")
    sparse = is_sparse_checkpoint(model_dir)
    model = load_sparse(model_dir) if sparse else AutoModelForCausalLM.from_pretrained(model_dir)
    return {"model_dir": str(model_dir), **bench_model(model, **options)}


def bench_model(
    model: nn.Module,
    *,
    prompt_ids: list[int] | None = None,
    new_tokens: int = 32,
    repeats: int = 3,
    threads: int | None = None,
    min_sparsity: float = DEFAULT_MIN_SPARSITY,
    memory: bool = True,
) -> dict[str, Any]:
    """Compare a pruned model dense against sparse: size on disk, resident memory, tokens per second.

    The model is saved twice into a temporary directory (``save_pretrained`` and :func:`~.save_sparse`); the
    decoding and memory figures are of that sparse save loaded back, densely and sparse, on the CPU.

    Args:
        model: a transformers causal LM (on any device; not modified).
        prompt_ids: prompt token ids (default: ``[bos] + 7`` fixed ids, within the sparse kernel's token count).
        new_tokens: tokens generated greedily per run.
        repeats: timed runs per variant (median).
        threads: torch (and numba) threads; None leaves them.
        min_sparsity: layers with at least this fraction of zeros are stored and run sparse.
        memory: also measure resident memory in subprocesses (Linux).

    Returns:
        A JSON-ready dict: ``machine``; ``disk`` (``dense_bytes``: the weights of a ``save_pretrained`` in the
        model's dtype, ``sparse_bytes``: of a sparse save, ``ratio``); ``decode`` (tokens per second of that sparse
        save loaded densely, :func:`~.load_sparse`, and sparse, ``load_sparse(sparse=True)``, their runs interleaved;
        ``speedup``, ``same_tokens``); ``memory`` (the two :func:`resident_memory` results, and
        ``tensor_ratio``/``rss_ratio``/``anon_ratio``); ``sparsified`` (the layers run sparse).
    """
    if threads is not None:
        import numba

        torch.set_num_threads(threads)
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    result: dict[str, Any] = {"machine": machine_line()}
    with tempfile.TemporaryDirectory() as tmp:
        dense_dir, sparse_dir = Path(tmp) / "dense", Path(tmp) / "sparse"
        model.save_pretrained(dense_dir)
        save_sparse(model, sparse_dir, min_sparsity=min_sparsity)
        dense_b, sparse_b = dir_bytes(dense_dir, "*.safetensors"), dir_bytes(sparse_dir, "*.safetensors")
        result["disk"] = {"dense_bytes": dense_b, "sparse_bytes": sparse_b, "ratio": sparse_b / dense_b}
        bos = getattr(model.config, "bos_token_id", None) or 1
        ids = torch.tensor([prompt_ids if prompt_ids is not None else [bos, 504, 3458, 282, 4649, 314, 253, 1545]])
        dense_model = load_sparse(sparse_dir)
        sparse_model = load_sparse(sparse_dir, sparse=True)
        speeds = decode_speeds({"dense": dense_model, "sparse": sparse_model}, ids, new_tokens, repeats)
        (dense_tps, dense_ids), (sparse_tps, sparse_ids) = speeds["dense"], speeds["sparse"]
        result["decode"] = {
            "new_tokens": new_tokens,
            "dense_tokens_per_s": dense_tps,
            "sparse_tokens_per_s": sparse_tps,
            "speedup": sparse_tps / dense_tps,
            "same_tokens": bool(torch.equal(dense_ids, sparse_ids)),
        }
        converted = [name for name, module in sparse_model.named_modules() if isinstance(module, SparseLinear)]
        del dense_model, sparse_model
        if memory and Path("/proc/self/status").exists():
            dense_m = resident_memory(sparse_dir, sparse=False, min_sparsity=min_sparsity)
            sparse_m = resident_memory(sparse_dir, sparse=True, min_sparsity=min_sparsity)
            result["memory"] = {
                "dense": dense_m,
                "sparse": sparse_m,
                "tensor_ratio": sparse_m["tensor_bytes"] / dense_m["tensor_bytes"],
                "rss_ratio": _ratio(sparse_m["rss_model"], dense_m["rss_model"]),
                "anon_ratio": _ratio(sparse_m["anon_model"], dense_m["anon_model"]),
            }
    result["sparsified"] = {"converted": len(converted), "layers": converted}
    return result
