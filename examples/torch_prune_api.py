"""SparseSwaps through plain ``torch.nn.utils.prune``: Grams from forward hooks, then ``global_unstructured``.

Run: ``python examples/torch_prune_api.py`` (a second on CPU). Prints, per layer, the layer loss
``sum_i r_i^T G r_i`` of the warmstart mask and of the final weights (SparseSwaps mask, re-fitted kept weights)
that ``global_unstructured`` installed.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.nn.utils import prune

from sparseswaps_prune import GramAccumulator, SparseSwapsMethod, row_losses, warmstart_mask
from sparseswaps_prune.core.losses import weight_losses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sparsity", type=float, default=0.6)
    parser.add_argument("--start", default="ria", choices=["magnitude", "wanda", "ria"])
    parser.add_argument("--max-iters", type=int, default=50)
    parser.add_argument("--samples", type=int, default=512, help="calibration inputs")
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, args.width), nn.ReLU(), nn.Linear(args.width, args.width), nn.ReLU())
    model.append(nn.Linear(args.width, 10))
    layers = [m for m in model if isinstance(m, nn.Linear)]
    x = torch.randn(args.samples, 32) @ torch.randn(32, 32)  # correlated features

    # 1. Calibration: one Gram accumulator per layer, fed by a forward pre-hook.
    accs = [GramAccumulator(layer.in_features) for layer in layers]
    handles = [
        layer.register_forward_pre_hook(lambda _mod, inputs, acc=acc: acc.add(inputs[0]))
        for layer, acc in zip(layers, accs, strict=True)
    ]
    with torch.no_grad():
        dense_out = model(x)
    for handle in handles:
        handle.remove()
    grams = [acc.gram for acc in accs]

    # The warmstart masks alone, for comparison (global_unstructured does not return the method).
    dense = [layer.weight.detach().clone() for layer in layers]
    warm = [warmstart_mask(w, args.start, gram=g, sparsity=args.sparsity) for w, g in zip(dense, grams, strict=True)]

    # 2. Prune: one call, each layer still gets its own per-row budget and its own Gram.
    params = [(layer, "weight") for layer in layers]
    prune.global_unstructured(
        params,
        pruning_method=SparseSwapsMethod,
        amount=args.sparsity,
        tensors=params,
        grams=grams,
        recipe="sparseswaps-refit",  # start -> SparseSwaps -> re-fit; the default is SparseSwaps masks only
        start=args.start,
        max_iters=args.max_iters,
    )  # the recipe also re-fits the kept weights (no recipe, or weights="keep", for the paper's mask-only method)

    print(f"{'layer':<8}{'sparsity':>10}{'warmstart loss':>18}{'final loss':>18}{'reduction':>11}")
    for i, (layer, w, g, m0) in enumerate(zip(layers, dense, grams, warm, strict=True)):
        mask = layer.weight_mask.bool()
        before, after = float(row_losses(w, g, m0).sum()), float(weight_losses(w, layer.weight.detach(), g).sum())
        sparsity = 1 - float(mask.float().mean())
        print(f"{i:<8}{sparsity:>10.3f}{before:>18.6g}{after:>18.6g}{1 - after / before:>11.1%}")
        assert after <= before * (1 + 1e-6)

    # 3. Make it permanent: plain weights with zeros, no weight_orig / weight_mask.
    for layer in layers:
        prune.remove(layer, "weight")
    with torch.no_grad():
        err = float((model(x) - dense_out).pow(2).mean())
    zeros = sum(int((layer.weight == 0).sum()) for layer in layers) / sum(layer.weight.numel() for layer in layers)
    print(f"after prune.remove: {zeros:.1%} of the weights are zero; output MSE vs dense {err:.4g}")


if __name__ == "__main__":
    main()
