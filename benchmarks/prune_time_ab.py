"""Time ``prune_model`` on the first K blocks of the default model, for A/B timings of two commits on one host.

Runs the main job's pruning step as it was until 2026-11-27 (SmolLM2-135M-Instruct, 16 x 256 built-in calibration
windows and 8 held-out windows, batch 4, ``keep_dense=True``; the main job now calibrates on 64 windows) on the
decoder blocks ``0 .. K-1`` and prints the seconds and the summed final layer loss (equal losses: the same
computation). ``MODE`` is ``default`` (the ``best`` recipe's layer spec, the former ``DEFAULT_SPEC``: ALPS's mask
and weights) or ``olddefault`` (the default until 2026-11-25: Wanda, T=25, guarded least squares with ridge
``1e-3 * mean(diag G)``); ``ckpt`` adds a checkpoint directory, as the main job has. It also runs against code from
before the typed spec (issue 16), so an older commit can be timed on the same host:

    git worktree add /tmp/old 66ca5e0
    PYTHONPATH=/tmp/old python benchmarks/prune_time_ab.py 5 olddefault
    python benchmarks/prune_time_ab.py 5 olddefault
    python benchmarks/prune_time_ab.py 5 default [ckpt]
"""

from __future__ import annotations

import inspect
import sys
import tempfile
import time

import torch

import sparseswaps_prune
from sparseswaps_prune.llm import pipeline
from sparseswaps_prune.llm.data import load_calibration
from sparseswaps_prune.llm.models import load_model


def main(argv: list[str]) -> None:
    n_blocks, mode = int(argv[0]), argv[1]
    if mode not in ("default", "olddefault"):
        raise SystemExit(f"MODE must be default or olddefault, got {mode!r}")
    model, tokenizer = load_model(None, dtype=torch.float32)
    windows = load_calibration("builtin", tokenizer, 16, 256, seed=0, holdout=8)
    include = [f"model.layers.{i}.*" for i in range(n_blocks)]
    if "spec" in inspect.signature(pipeline.PruneOptions).parameters:
        from sparseswaps_prune.core.spec import PruneSpec, build_spec

        try:
            from sparseswaps_prune.recipes import RECIPES

            default, swaps = RECIPES["best"].spec, RECIPES["sparseswaps-refit"].spec
        except ImportError:  # before the recipes table: build_spec() was ALPS's, PruneSpec() the re-fit
            default, swaps = build_spec(), PruneSpec()
        olddefault = build_spec(swaps, max_iters=25, ridge="mean", guard=True)
        options = pipeline.PruneOptions(spec=olddefault if mode == "olddefault" else default, include=include)
    elif mode == "olddefault":  # before the typed spec (2026-11-23)
        options = pipeline.PruneOptions(max_iters=25, refit="ls", holdout_guard=True, include=include)
    else:
        raise SystemExit("code from before the typed spec has only MODE olddefault")
    checkpoint_dir = tempfile.mkdtemp() if "ckpt" in argv[2:] else None
    start = time.time()
    result = pipeline.prune_model(
        model, windows[:16], options, batch_size=4, holdout_tokens=windows[16:], progress=False, keep_dense=True,
        checkpoint_dir=checkpoint_dir,
    )  # fmt: skip
    seconds = time.time() - start
    final = sum(layer.loss_final for layer in result.layers)
    print(
        f"{sparseswaps_prune.__file__} K={n_blocks} mode={mode} ckpt={checkpoint_dir is not None} "
        f"prune_model {seconds:.1f} s, final {final:.6e}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
