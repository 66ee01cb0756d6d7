"""Per-layer loss of ADMM (Boza 2024) and ALPS (Meng et al. 2024) against Wanda, on random layers (CPU).

Each layer is a random ``[d_out, d_in]`` weight and a Gram ``G = X^T X`` of correlated random inputs whose
features have unequal scales and a few outlier features (LLM-like). For every ``--patterns`` entry it
prints the summed loss ``sum_i (w_i - v_i)^T G (w_i - v_i)`` relative to the Wanda mask with the original
weights (``wanda``; layer-wise for unstructured patterns, the budget ADMM and ALPS use), for:

* ``<mask>``: the method's own weights (Wanda: the original ones);
* ``<mask> + refit``: the exact least-squares re-fit of that mask (``refit_weights``, ``damp=--refit-damp``);
* ``wanda + admm_update`` / ``wanda + alps_update``: the two weight updates on the Wanda mask;

and the seconds each took (one layer, this machine). Nothing touches a real model.

    python benchmarks/admm_alps_layers.py [--shapes 256x512 512x256] [--patterns 60% 80% 2:4] [--seeds 0 1]
"""

from __future__ import annotations

import argparse
import platform
import time
from collections import defaultdict

import torch

from sparseswaps_prune.core.admm import admm_prune, admm_update
from sparseswaps_prune.core.alps import alps_prune, alps_update
from sparseswaps_prune.core.losses import weight_losses
from sparseswaps_prune.core.refit import REFIT_DAMP, refit_weights
from sparseswaps_prune.core.warmstart import warmstart_mask


def random_layer(d_out: int, d_in: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight [d_out, d_in] float32, gram [d_in, d_in] float64)`` from ``4 * d_in`` correlated tokens."""
    gen = torch.Generator().manual_seed(seed)
    tokens = 4 * d_in
    mixing = torch.eye(d_in, dtype=torch.float64) + torch.randn(d_in, d_in, generator=gen, dtype=torch.float64) / (
        2 * d_in**0.5
    )
    x = torch.randn(tokens, d_in, generator=gen, dtype=torch.float64) @ mixing
    scale = torch.rand(d_in, generator=gen, dtype=torch.float64).add(0.2)
    scale[torch.randperm(d_in, generator=gen)[: max(1, d_in // 100)]] *= 20  # outlier features
    x = x * scale
    weight = torch.randn(d_out, d_in, generator=gen) / d_in**0.5
    return weight, x.T @ x


def parse_pattern(text: str) -> dict:
    """``"60%"`` -> ``{"sparsity": 0.6}``, ``"2:4"`` -> ``{"nm": (2, 4)}``."""
    if ":" in text:
        n, m = (int(v) for v in text.split(":"))
        return {"nm": (n, m)}
    if text.endswith("%"):
        return {"sparsity": float(text[:-1]) / 100}
    raise argparse.ArgumentTypeError(f"pattern must look like 60% or 2:4, got {text!r}")


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


def layer_rows(weight: torch.Tensor, gram: torch.Tensor, budget: dict, refit_damp: float) -> dict[str, tuple]:
    """``{name: (loss, seconds)}`` for one layer and one budget."""

    def loss(new_weight: torch.Tensor) -> float:
        return float(weight_losses(weight, new_weight, gram).sum())

    def refit(mask: torch.Tensor) -> tuple[float, float]:
        fitted, seconds = timed(refit_weights, weight, gram, mask, damp=refit_damp)
        return loss(fitted), seconds

    rows = {}
    gram32 = gram.float()
    wanda, seconds = timed(warmstart_mask, weight, "wanda", gram=gram32, scope="layer", **budget)
    rows["wanda"] = (loss(weight * wanda), seconds)
    rows["wanda + refit"] = refit(wanda)
    admm, seconds = timed(admm_prune, weight, gram32, **budget)
    rows["admm"] = (loss(admm.weight), seconds)
    rows["admm + refit"] = refit(admm.keep_mask)
    alps, seconds = timed(alps_prune, weight, gram32, **budget)
    rows["alps"] = (loss(alps.weight), seconds)
    rows["alps + refit"] = refit(alps.keep_mask)
    updated, seconds = timed(admm_update, weight, gram32, wanda)
    rows["wanda + admm_update"] = (loss(updated), seconds)
    updated, seconds = timed(alps_update, weight, gram32, wanda)
    rows["wanda + alps_update"] = (loss(updated), seconds)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["256x512", "512x256"], help="d_out x d_in of each layer")
    parser.add_argument("--patterns", nargs="+", type=parse_pattern, default=["60%", "80%", "2:4"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--refit-damp", type=float, default=REFIT_DAMP)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: LAPACK stalls on a busy CPU)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    patterns = [parse_pattern(p) if isinstance(p, str) else p for p in args.patterns]
    print(f"# torch {torch.__version__}, {platform.processor() or platform.machine()}, {args.threads} threads")
    for budget in patterns:
        label = f"{budget['nm'][0]}:{budget['nm'][1]}" if "nm" in budget else f"{budget['sparsity']:.0%}"
        totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for shape in args.shapes:
            d_out, d_in = (int(v) for v in shape.split("x"))
            for seed in args.seeds:
                weight, gram = random_layer(d_out, d_in, seed)
                for name, (value, seconds) in layer_rows(weight, gram, budget, args.refit_damp).items():
                    totals[name][0] += value
                    totals[name][1] += seconds
        base = totals["wanda"][0]
        print(f"\n## {label}: {len(args.shapes) * len(args.seeds)} layers ({', '.join(args.shapes)})")
        print(f"{'method':<22} {'loss / wanda':>12} {'seconds':>9}")
        for name, (value, seconds) in totals.items():
            print(f"{name:<22} {value / base:>12.4f} {seconds:>9.2f}")


if __name__ == "__main__":
    main()
