"""ALPS (the default spec's start) at LLaMA-3.1-8B's layer shapes: time and peak memory per layer, on this machine.

The default spec's layer stage is :func:`~sparseswaps_prune.core.alps.alps_prune` (ADMM on the normalised Gram with
one float64 eigendecomposition, ``(G' + rho I)^-1`` rebuilt from it at every penalty update, then 10 CG steps). Its
cost per layer is a fixed part (set-up, the eigendecomposition, the final projection and CG) plus a part per ADMM
iteration (one ``[d_in, d_in] x [d_in, d_out]`` product, the top-k projection, and every 3 iterations the float64
rebuild of the shifted inverse, ``d_in^3``), and the number of iterations is ALPS's own (its penalty schedule stops
it; at most 300). So, for every distinct shape of a LLaMA-3.1-8B block (``--shapes``; random weights, and a Gram of
``4 d_in`` random LLM-like tokens: unequal feature scales, a few outlier features, a low-rank correlated part):

* ``full`` shapes (``--full``): one complete ``alps_prune`` call: wall time, ADMM iterations run, peak memory;
* every shape: two calls capped at ``--iters A B`` ADMM iterations (multiples of 3, so that each run ends on a
  penalty update); their difference gives the seconds per iteration and the rest the fixed part; the full time is
  then **extrapolated** as fixed + iterations x per-iteration for two iteration counts: the largest count of the
  ``full`` runs, the largest of ``--smollm2`` and ALPS's cap of 300, and printed as such.

With ``--smollm2 N`` it first runs ALPS on every linear layer of the default model's first ``N`` blocks (real
Grams of 48 x 256 built-in calibration tokens) and prints the iteration counts, to show how many
iterations real layers take.

Peak memory: the process's peak resident set (``MemoryProbe``: ``VmHWM``, reset through ``/proc/self/clear_refs``
before each call) less the resident set just before the call (the weight and Gram already held), in GB = 1e9 bytes.
Per block: the sums over q, k, v, o (``4096 x 4096`` twice, ``1024 x 4096`` twice), gate and up (``14336 x 4096``)
and down (``4096 x 14336``).

    python benchmarks/alps_scale.py --full 1024x4096 4096x4096 --iters 3 6 --smollm2 2
"""

from __future__ import annotations

import argparse
import platform
import time

import common
import torch

from sparseswaps_prune.core.alps import ALPS_MAX_ITER, alps_prune
from sparseswaps_prune.llm.io.memory import MemoryProbe

GB = 1e9
# LLaMA-3.1-8B (hidden 4096, intermediate 14336, 8 KV heads of 128): [d_out, d_in] -> the block's layers of that shape.
LLAMA_8B_SHAPES = {
    (4096, 4096): ("q_proj", "o_proj"),
    (1024, 4096): ("k_proj", "v_proj"),
    (14336, 4096): ("gate_proj", "up_proj"),
    (4096, 14336): ("down_proj",),
}


def llm_like_layer(d_out: int, d_in: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight [d_out, d_in] float32, gram [d_in, d_in] float32)``: the Gram of ``4 d_in`` random tokens with
    per-feature scales in [0.2, 1.2), 1% outlier features x20 and a rank-64 shared component."""
    gen = torch.Generator().manual_seed(seed)
    tokens = 4 * d_in
    scale = torch.rand(d_in, generator=gen).add(0.2)
    scale[torch.randperm(d_in, generator=gen)[: max(1, d_in // 100)]] *= 20
    gram = torch.zeros(d_in, d_in)
    for start in range(0, tokens, 4096):  # chunks bound the token buffer
        n = min(4096, tokens - start)
        shared = torch.randn(n, 64, generator=gen) @ torch.randn(64, d_in, generator=gen) / 8
        x = (torch.randn(n, d_in, generator=gen) + shared) * scale
        gram.addmm_(x.T, x)
    weight = torch.randn(d_out, d_in, generator=gen) / d_in**0.5
    return weight, gram


def measured_call(weight: torch.Tensor, gram: torch.Tensor, sparsity: float, max_iter: int) -> tuple[float, int, float]:
    """One ``alps_prune`` call: ``(seconds, ADMM iterations run, +peak GB over the resident set before it)``."""
    probe = MemoryProbe()  # resets the peak resident set
    t0 = time.perf_counter()
    iters = alps_prune(weight, gram, sparsity=sparsity, max_iter=max_iter).admm_iters
    seconds = time.perf_counter() - t0
    return seconds, iters, (probe.peak() - probe.start) / GB


def smollm2_iterations(blocks: int, sparsity: float) -> list[int]:
    """ALPS's iteration count on every linear layer of the default model's first ``blocks`` blocks."""
    weights, grams = common.capture_grams(list(range(blocks)), 0, 48, 0, 256)  # only the "large" Grams, once
    print(f"\nALPS on the default model (SmolLM2-135M), first {blocks} blocks, 48 x 256 calibration, {sparsity:.0%}:")
    counts = []
    for name, weight in weights.items():
        t0 = time.perf_counter()
        res = alps_prune(weight, grams[name]["large"].gram, sparsity=sparsity)
        counts.append(res.admm_iters)
        shape = "x".join(map(str, weight.shape))
        print(f"  {name:40s} {shape:>10s}  {res.admm_iters:3d} iterations  {time.perf_counter() - t0:6.2f} s")
    print(f"  iterations: min {min(counts)}, median {sorted(counts)[len(counts) // 2]}, max {max(counts)}\n")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=[f"{o}x{i}" for o, i in LLAMA_8B_SHAPES], help="d_out x d_in")
    parser.add_argument("--full", nargs="*", default=[], help="shapes also run to ALPS's own stop")
    parser.add_argument("--iters", type=int, nargs=2, default=[3, 6], help="two ADMM iteration caps, multiples of 3")
    parser.add_argument("--sparsity", type=float, default=0.6)
    parser.add_argument("--smollm2", type=int, default=0, help="also count iterations on this many default blocks")
    args = parser.parse_args()
    low, high = args.iters
    if not (0 < low < high and low % 3 == 0 and high % 3 == 0):
        parser.error("--iters A B: 0 < A < B, both multiples of 3 (ALPS updates its penalty every 3 iterations)")
    shapes = [common.parse_shape(s) for s in args.shapes]
    full = {common.parse_shape(s, "--full") for s in args.full}
    cpu = platform.processor() or platform.machine()
    print(f"{cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}")
    print(f"ALPS (alps_prune, float32, eigendecomposition float64), layer-wise {args.sparsity:.0%}; GB = 1e9 bytes")
    counts = smollm2_iterations(args.smollm2, args.sparsity) if args.smollm2 else []
    rows = {}
    for d_out, d_in in shapes:
        weight, gram = llm_like_layer(d_out, d_in)
        row = {}
        if (d_out, d_in) in full:
            row["full"] = measured_call(weight, gram, args.sparsity, ALPS_MAX_ITER)
        row["low"] = measured_call(weight, gram, args.sparsity, low)
        row["high"] = measured_call(weight, gram, args.sparsity, high)
        for key, cap in (("low", low), ("high", high)):
            if row[key][1] != cap:
                raise RuntimeError(f"{d_out}x{d_in}: ALPS stopped after {row[key][1]} iterations; raise --iters")
        rows[(d_out, d_in)] = row
        del weight, gram
        fmt = ", ".join(f"{k}: {s:.1f} s / {it} it / +{p:.2f} GB" for k, (s, it, p) in row.items())
        print(f"  {d_out}x{d_in}: {fmt}", flush=True)
    full_counts = [row["full"][1] for row in rows.values() if "full" in row]
    iteration_counts = sorted({max(c) for c in (counts, full_counts) if c} | {ALPS_MAX_ITER})
    print(
        "\nper layer (d_out x d_in; per-it and fixed from the capped runs; 'full' measured where run; 'at N it'"
        " EXTRAPOLATED as fixed + N x per-it):"
    )
    header = f"{'shape':>12s} {'layers':>20s} {'fixed s':>8s} {'per-it s':>8s} {'+peak GB':>8s}"
    header += f" {'full s':>8s} {'full it':>7s}"
    header += "".join(f" {f'at {n} it':>10s}" for n in iteration_counts)
    print(header)
    block = dict.fromkeys(["full", *iteration_counts], 0.0)
    for shape, row in rows.items():
        t_low, t_high = row["low"][0], row["high"][0]
        per_iter = (t_high - t_low) / (high - low)
        fixed = t_low - low * per_iter
        peak = max(p for _, _, p in row.values())
        layers = LLAMA_8B_SHAPES.get(shape, ("?",))
        full = f"{row['full'][0]:8.1f} {row['full'][1]:7d}" if "full" in row else f"{'-':>8s} {'-':>7s}"
        line = f"{shape[0]:>5d}x{shape[1]:<6d} {'/'.join(layers):>20s} {fixed:8.1f} {per_iter:8.2f} {peak:8.2f} {full}"
        for n in iteration_counts:
            est = fixed + n * per_iter
            line += f" {est:10.0f}"
            block[n] += len(layers) * est
        if "full" in row:
            block["full"] += len(layers) * row["full"][0]
        print(line)
    if set(rows) == set(LLAMA_8B_SHAPES):
        parts = [
            f"{n} it: {block[n] / 60:.1f} min (extrapolated), x 32 blocks {32 * block[n] / 3600:.1f} h"
            for n in iteration_counts
        ]
        if all("full" in row for row in rows.values()):
            parts.insert(0, f"measured full runs: {block['full'] / 60:.1f} min")
        print("one LLaMA-3.1-8B block, ALPS on its 7 layers: " + "; ".join(parts))


if __name__ == "__main__":
    main()
