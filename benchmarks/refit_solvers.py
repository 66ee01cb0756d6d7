"""Accuracy and time of the conjugate-gradient re-fit against the direct solve, on real SmolLM2 layers.

``refit_weights`` has two solvers for the same ridge problem per row, ``(G_SS + lambda I) v_S = (G w)_S``:
``"direct"`` (float64 Cholesky of every row's ``G_SS``, ``O(k^3)`` per row) and ``"cg"`` (batched
Jacobi-preconditioned conjugate gradients that share ``G`` across rows, one ``[rows, d_in] @ [d_in, d_in]``
product per step). This script captures the calibration Gram of every linear layer of ``--blocks`` from the
dense packaged SmolLM2-135M-Instruct (``--nsamples`` x ``--seqlen`` built-in calibration tokens, as the
main job), prunes each layer with the Wanda mask of every ``--patterns`` entry, and compares, summed over
the layers of each kind (``q_proj``, ..., ``down_proj``):

* ``gain lost``: ``(L_cg - L_direct) / (L_mask - L_direct)``, the share of the re-fit's loss reduction that
  CG after a fixed number of steps has not reached yet (``L_mask``: the mask's loss with weights as they are);
* ``weight error``: ``||V_cg - V_direct|| / ||V_direct||`` (Frobenius, over all rows);
* seconds of each solver on this machine.

CG runs ``--steps`` fixed step counts (``tol=0``) and once with the library default stopping rule
(``tol=1e-6``, at most 200 steps).

    python benchmarks/refit_solvers.py [--blocks 0 15 29] [--patterns 60% 2:4] [--steps 5 10 25 50 100]
"""

from __future__ import annotations

import argparse
import platform
import time
from collections import defaultdict

import torch
from common import capture_grams, pattern_options

from sparseswaps_prune.core.losses import weight_losses
from sparseswaps_prune.core.refit import REFIT_DAMP, refit_weights
from sparseswaps_prune.core.warmstart import warmstart_mask


def compare_solvers(
    weight: torch.Tensor, gram: torch.Tensor, keep: torch.Tensor, steps: list[int], damp: float = REFIT_DAMP
) -> dict[str, dict[str, float]]:
    """``{solver: {"loss", "weight_error", "seconds"}}`` for one layer; ``"mask"`` (no re-fit) and
    ``"direct"`` are the two ends, ``"cg N"`` a fixed step count, ``"cg tol"`` the default stopping rule.

    ``weight`` ``[d_out, d_in]``, ``gram`` ``[d_in, d_in]``, ``keep`` ``[d_out, d_in]`` bool (not modified).
    """
    w64 = weight.double()

    def run(**kwargs) -> tuple[torch.Tensor, float]:
        start = time.perf_counter()
        fitted = refit_weights(w64, gram, keep, damp=damp, ridge="mean", **kwargs)
        return fitted, time.perf_counter() - start

    reference, seconds = run(solver="direct")
    results = {"mask": {"loss": float(weight_losses(w64, torch.where(keep, w64, 0.0), gram).sum()), "seconds": 0.0}}
    candidates = {"direct": (reference, seconds)}
    candidates.update({f"cg {n}": run(solver="cg", max_steps=n, tol=0.0) for n in steps})
    candidates["cg tol"] = run(solver="cg")
    scale = float(reference.norm())
    for name, (fitted, seconds) in candidates.items():
        results[name] = {
            "loss": float(weight_losses(w64, fitted, gram).sum()),
            "weight_error": float((fitted - reference).norm()) / scale,
            "seconds": seconds,
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, nargs="+", default=[0, 15, 29])
    parser.add_argument("--patterns", nargs="+", default=["60%", "2:4"])
    parser.add_argument("--steps", type=int, nargs="+", default=[5, 10, 25, 50, 100])
    parser.add_argument("--nsamples", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--damp", type=float, default=REFIT_DAMP)
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    weights, grams = capture_grams(args.blocks, args.nsamples, args.nsamples, 0, args.seqlen)
    for pattern_text in args.patterns:
        pattern = pattern_options(pattern_text)
        by_kind: dict[str, dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
        for name, weight in weights.items():
            gram = grams[name]["small"].gram
            keep = warmstart_mask(weight.double(), "wanda", gram=gram, **pattern)
            kind = f"{name.rsplit('.', 1)[-1]} ({weight.shape[1]} in)"
            for solver, figures in compare_solvers(weight, gram, keep, args.steps, args.damp).items():
                for key, value in figures.items():
                    by_kind[kind][solver][key] += value
            print(f"  {pattern_text}: {name} done", flush=True)
        report(pattern_text, args, by_kind)


def report(pattern: str, args: argparse.Namespace, by_kind: dict) -> None:
    """Markdown table: per layer kind, the gain lost and weight error of every CG setting, and the times."""
    solvers = [s for s in next(iter(by_kind.values())) if s.startswith("cg")]
    print(f"\n{pattern}, Wanda masks, damp {args.damp:g}, blocks {args.blocks}, {args.nsamples} x {args.seqlen} tokens")
    print("| layer | direct s | " + " | ".join(f"{s}: gain lost / weight err / s" for s in solvers) + " |")
    print("|---|---|" + "---|" * len(solvers))
    n_blocks = len(args.blocks)
    for kind, res in by_kind.items():
        gain = res["mask"]["loss"] - res["direct"]["loss"]
        cells = [
            f"{100 * (res[s]['loss'] - res['direct']['loss']) / gain:.2g}% / "
            f"{res[s]['weight_error'] / n_blocks:.1e} / {res[s]['seconds']:.2f}"
            for s in solvers
        ]
        print(f"| {kind} | {res['direct']['seconds']:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
