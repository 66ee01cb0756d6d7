"""Validation helpers shared by the core: each names the bad value and the fix."""

from __future__ import annotations

import math

import torch


def check_weight(weight: torch.Tensor, *, what: str = "weight") -> None:
    """Raise unless ``weight`` is a finite floating 2-D tensor ``[d_out, d_in]``."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(
            f"{what} must be 2-D [d_out, d_in] (an nn.Linear weight), got shape {tuple(weight.shape)}; "
            "reshape convolution kernels to [out_channels, -1] first"
        )
    if not weight.is_floating_point():
        raise TypeError(f"{what} must be a floating-point tensor, got dtype {weight.dtype}")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError(f"{what} contains NaN or Inf; fix the model weights before pruning")


def check_gram(gram: torch.Tensor, d_in: int, *, what: str = "gram") -> None:
    """Raise unless ``gram`` is a finite ``[d_in, d_in]`` float tensor with calibration data in it."""
    if not isinstance(gram, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor [d_in, d_in], got {type(gram).__name__}")
    if gram.shape != (d_in, d_in):
        raise ValueError(
            f"{what} must have shape [d_in, d_in] = [{d_in}, {d_in}] to match the weight's input width, "
            f"got {tuple(gram.shape)}; accumulate it from this layer's inputs"
        )
    if not gram.is_floating_point():
        raise TypeError(f"{what} must be a floating-point tensor, got dtype {gram.dtype}")
    if not bool(torch.isfinite(gram).all()):
        raise ValueError(f"{what} contains NaN or Inf; check the calibration activations (fp16 overflow?)")
    if not bool((torch.diagonal(gram) > 0).any()):
        raise ValueError(
            f"{what} is all zeros: the layer saw no calibration tokens; run calibration data through it "
            "(check that its forward hook fired) before pruning"
        )


def check_mask(mask: torch.Tensor, weight: torch.Tensor, *, what: str = "keep_mask") -> None:
    """Raise unless ``mask`` is a bool tensor shaped like ``weight``."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"{what} must be a bool tensor (True = kept), got {got}")
    if mask.shape != weight.shape:
        raise ValueError(f"{what} shape {tuple(mask.shape)} does not match the weight's {tuple(weight.shape)}")


def check_budget(sparsity: float | None, nm: tuple[int, int] | None, d_in: int) -> None:
    """Exactly one of ``sparsity`` in [0, 1) and ``nm = (n, m)`` with ``0 <= n <= m`` and ``m | d_in``."""
    if (sparsity is None) == (nm is None):
        raise ValueError("give exactly one of sparsity= (e.g. 0.6) or nm= (e.g. (2, 4)), not both or neither")
    if sparsity is not None:
        if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or math.isnan(sparsity):
            raise TypeError(f"sparsity must be a float in [0, 1), got {sparsity!r}")
        if not 0.0 <= sparsity < 1.0:
            raise ValueError(f"sparsity must be in [0, 1) (the fraction of weights pruned), got {sparsity}")
    else:
        if (
            not isinstance(nm, (tuple, list))
            or len(nm) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in nm)
        ):
            raise TypeError(f"nm must be a pair of ints (n, m), e.g. (2, 4), got {nm!r}")
        n, m = nm
        if m < 1 or not 0 <= n <= m:
            raise ValueError(f"nm=(n, m) needs m >= 1 and 0 <= n <= m, got {tuple(nm)}")
        if d_in % m != 0:
            raise ValueError(
                f"nm=({n}, {m}): m={m} does not divide the input width d_in={d_in}; choose m dividing {d_in} "
                "or exclude this layer"
            )


def kept_per_row(sparsity: float, d_in: int) -> int:
    """Number of weights each row keeps at ``sparsity``: ``d_in - round(sparsity * d_in)``."""
    return d_in - round(sparsity * d_in)
