"""Validation helpers shared by the core: each names the bad value and the fix."""

from __future__ import annotations

import math

import torch


def check_int(
    value: object, name: str, *, low: int | None = None, below: int | None = None, none_ok: bool = False
) -> int | None:
    """Return ``value`` if it is an int (not a bool) in ``[low, below)`` (either bound optional), or None with
    ``none_ok``; else raise naming ``name`` and the accepted range (``TypeError`` for another type, ``ValueError``
    out of range)."""
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        error: type[Exception] = TypeError
    elif (low is not None and value < low) or (below is not None and value >= below):
        error = ValueError
    else:
        return value
    raise error(f"{name} must be {_int_range(low, below)}{' or None' if none_ok else ''}, got {value!r}")


def _int_range(low: int | None, below: int | None) -> str:
    """``"a positive int"``, ``"an int >= 0"``, ``"an int in [0, 2**64)"``, ``"an int"``."""
    if below is not None:
        top = f"2**{below.bit_length() - 1}" if below >= 2**32 and below & (below - 1) == 0 else str(below)
        return f"an int in [{low}, {top})" if low is not None else f"an int < {top}"
    if low is None:
        return "an int"
    return "a positive int" if low == 1 else f"an int >= {low}"


def check_bool(value: object, name: str) -> bool:
    """Return ``value`` if it is a bool; else raise ``TypeError`` naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def check_str(value: object, name: str, *, none_ok: bool = False) -> str | None:
    """Return ``value`` if it is a str (or None with ``none_ok``); else raise ``TypeError`` naming ``name``."""
    if not (isinstance(value, str) or (value is None and none_ok)):
        raise TypeError(f"{name} must be a str{' or None' if none_ok else ''}, got {value!r}")
    return value


def check_choice(value: object, name: str, choices: tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``choices``; else raise ``ValueError`` naming ``name`` and the choices."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value


def check_number(
    value: object, name: str, *, low: float | None = None, high: float | None = None, high_open: bool = False
) -> float:
    """Return ``value`` as a float if it is a finite real number (not a bool) in ``[low, high]`` (``[low, high)``
    with ``high_open``); else raise naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")
    if high is not None and (value >= high if high_open else value > high):
        raise ValueError(f"{name} must be {'<' if high_open else '<='} {high}, got {value!r}")
    return float(value)


def check_positive(value: object, name: str, *, note: str = "") -> float:
    """Return ``value`` as a float if it is a finite real number (not a bool) above 0; else raise naming ``name``
    (and ``note``, what the value is, in the message)."""
    check_number(value, name)
    if not value > 0:
        raise ValueError(f"{name} must be > 0{f' ({note})' if note else ''}, got {value!r}")
    return float(value)


def check_unused(config: object, defaults: dict[str, tuple[str, object]], *, owner: str, off: str, fix: str) -> None:
    """Raise ``ValueError`` if ``config`` sets an option of a stage that is off: ``defaults`` maps each of the stage's
    option names to ``(CLI flag, default)``; the message names the options set, ``owner`` (what they set), ``off``
    (why the stage is off) and ``fix``."""
    unused = [f"{name} (--{flag})" for name, (flag, default) in defaults.items() if getattr(config, name) != default]
    if unused:
        raise ValueError(f"{', '.join(unused)} set {owner}, but {off}: {fix}")


def check_device(device: str | int | torch.device, what: str = "device") -> torch.device:
    """Return ``device`` as a ``torch.device`` if computation can run there now, else raise naming the fix.

    Accepted: ``cpu``, and ``cuda``/``cuda:N`` (or the index ``N``), ``mps``, ``xpu``/``xpu:N`` when that backend is
    available here (and ``N`` is below its device count). ``meta`` holds no data, so nothing can run on it.

    Raises:
        TypeError: ``device`` is not a str, an int or a ``torch.device``.
        ValueError: an invalid device string (e.g. ``"tpu9"``), ``meta``, or a backend or index not available here.
    """
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"{what} must be a str such as 'cpu' or 'cuda:0', got {type(device).__name__}")
    try:
        parsed = torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    except RuntimeError:
        raise ValueError(f"{what} {device!r} is not a device torch knows; use cpu, cuda, cuda:N or mps") from None
    if parsed.type == "cpu":
        return parsed
    if parsed.type == "meta":
        raise ValueError(f"{what} {str(device)!r} holds no data (meta); use cpu or cuda")
    backend = getattr(torch, parsed.type, None) if parsed.type in ("cuda", "mps", "xpu") else None
    if backend is None:
        raise ValueError(f"{what} {str(device)!r} is not supported here; use cpu, cuda, cuda:N or mps")
    available = parsed.type == "mps" and torch.backends.mps.is_available()
    available = available or (parsed.type != "mps" and backend.is_available())
    if not available:
        raise ValueError(
            f"{what} {str(device)!r} requested but {parsed.type.upper()} is not available on this machine; use cpu"
        )
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if parsed.index is not None and parsed.index >= count:
        raise ValueError(
            f"{what} {str(device)!r} requested but this machine has {count} {parsed.type} device(s) "
            f"({parsed.type}:0 to {parsed.type}:{count - 1})"
        )
    return parsed


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
    if weight.device.type == "meta":
        raise ValueError(f"{what} is a meta tensor (no data); load the weights (e.g. without device_map='meta') first")
    if weight.numel() == 0:
        raise ValueError(f"{what} has shape {tuple(weight.shape)}: there is nothing to prune; exclude this layer")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError(f"{what} contains NaN or Inf; fix the model weights before pruning")


# Relative tolerance of the Gram's symmetry and Cauchy-Schwarz checks (float32 accumulation rounds G_ij and G_ji
# differently; a real X^T X never comes near it).
GRAM_RTOL = 1e-3
# Rows of the Gram checked at once (bounds the temporaries of the symmetry check).
GRAM_CHECK_ROWS = 1024


def check_gram(gram: torch.Tensor, d_in: int, *, what: str = "gram") -> None:
    """Raise unless ``gram`` is a finite ``[d_in, d_in]`` float tensor with calibration data in it that can be a
    Gram matrix ``sum_t x_t x_t^T``: non-negative diagonal, symmetric and ``|G_ij| <= sqrt(G_ii G_jj)``
    (Cauchy-Schwarz; both up to ``GRAM_RTOL``). These are necessary, not sufficient, for positive
    semi-definiteness, which the swap search relies on; ``O(d_in^2)``, like reading the Gram once."""
    if not isinstance(gram, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor [d_in, d_in], got {type(gram).__name__}")
    if gram.shape != (d_in, d_in):
        raise ValueError(
            f"{what} must have shape [d_in, d_in] = [{d_in}, {d_in}] to match the weight's input width, "
            f"got {tuple(gram.shape)}; accumulate it from this layer's inputs"
        )
    if not gram.is_floating_point():
        raise TypeError(f"{what} must be a floating-point tensor, got dtype {gram.dtype}")
    if gram.device.type == "meta":
        raise ValueError(f"{what} is a meta tensor (no data); accumulate it from real calibration inputs")
    if not bool(torch.isfinite(gram).all()):
        raise ValueError(f"{what} contains NaN or Inf; check the calibration activations (fp16 overflow?)")
    diag = torch.diagonal(gram)
    if bool((diag < 0).any()):
        bad = torch.nonzero(diag < 0).flatten().tolist()[:5]
        raise ValueError(
            f"{what} has negative diagonal entries (inputs {bad}), so it is not a Gram matrix sum_t x_t x_t^T "
            "(whose G_jj = sum_t x_tj^2 >= 0); pass the Gram of this layer's inputs (GramAccumulator)"
        )
    if not bool((diag > 0).any()):
        raise ValueError(
            f"{what} is all zeros: the layer saw no calibration tokens; run calibration data through it "
            "(check that its forward hook fired) before pruning"
        )
    scale = diag.clamp_min(0).sqrt()
    for r0 in range(0, d_in, GRAM_CHECK_ROWS):
        rows = slice(r0, r0 + GRAM_CHECK_ROWS)
        bound = GRAM_RTOL * scale[rows, None] * scale[None, :]
        if bool(((gram[rows] - gram[:, rows].T).abs() > bound).any()):
            raise ValueError(
                f"{what} is not symmetric (|G_ij - G_ji| above {GRAM_RTOL:g} sqrt(G_ii G_jj)), so it is not a Gram "
                "matrix sum_t x_t x_t^T; pass the Gram of this layer's inputs, or symmetrise it: (G + G.T) / 2"
            )
        if bool((gram[rows].abs() > bound / GRAM_RTOL * (1 + GRAM_RTOL)).any()):
            raise ValueError(
                f"{what} has |G_ij| > sqrt(G_ii G_jj), so it is not positive semi-definite and not a Gram matrix "
                "sum_t x_t x_t^T (losses would be negative and the swap search invalid); pass the Gram of this "
                "layer's inputs"
            )


def check_mask(mask: torch.Tensor, weight: torch.Tensor, *, what: str = "keep_mask") -> None:
    """Raise unless ``mask`` is a bool tensor shaped like ``weight``."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"{what} must be a bool tensor (True = kept), got {got}")
    if mask.shape != weight.shape:
        raise ValueError(f"{what} shape {tuple(mask.shape)} does not match the weight's {tuple(weight.shape)}")


def check_budget(sparsity: float | None, nm: tuple[int, int] | None, d_in: int | None) -> None:
    """Exactly one of ``sparsity`` in [0, 1) and ``nm = (n, m)`` with ``1 <= n <= m`` and ``m | d_in`` (``d_in``
    None: no layer width to check against yet). ``n = 0`` keeps no weight (an all-zero model), as ``sparsity=1``
    would; ``n = m`` keeps every weight, as ``sparsity=0`` does."""
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
            raise ValueError(f"nm=(n, m) needs m >= 1 and 1 <= n <= m (e.g. 2:4), got {tuple(nm)}")
        if n == 0:
            raise ValueError(
                f"nm=({n}, {m}) keeps none of every {m} weights, so every pruned layer would be all zeros; n must be "
                f"at least 1 (e.g. nm=(2, 4), --nm 2:4)"
            )
        if d_in is not None and d_in % m != 0:
            raise ValueError(
                f"nm=({n}, {m}): m={m} does not divide the input width d_in={d_in}; choose m dividing {d_in} "
                "or exclude this layer"
            )


def check_keeps_some(sparsity: float | None, count: int, what: str) -> None:
    """Raise if keeping ``count - round(sparsity * count)`` of ``count`` weights keeps none (``sparsity`` just
    below 1 rounds to pruning everything)."""
    if sparsity is not None and sparsity > 0 and kept_per_row(sparsity, count) == 0:
        top = (count - 0.5) / count
        raise ValueError(
            f"sparsity={sparsity} keeps none of the {count} weights of {what} ({count} - round({sparsity} * {count})"
            f" = 0); use a sparsity below {top:.6g}"
        )


def kept_per_row(sparsity: float, d_in: int) -> int:
    """Number of weights each row keeps at ``sparsity``: ``d_in - round(sparsity * d_in)``."""
    return d_in - round(sparsity * d_in)


# Above this |W| * sqrt(max diag G) the products a weight stage forms may overflow (float32 holds 3.4e38); a trained
# model's layers stay far below it.
HUGE_SCALE = 1e15


def check_finite_weights(
    weight: torch.Tensor, gram: torch.Tensor, stages: list[tuple[str, str, torch.Tensor | None]]
) -> None:
    """Raise ``ValueError`` naming the stage, the rows and the likely cause when a stage's weights are not all
    finite, so that a NaN is never written into a model.

    Args:
        weight, gram: the layer's original weights and Gram (for the cause).
        stages: ``(stage, method, weights or None)`` per stage, e.g. ``("start", "alps", start_weight)``.
    """
    for stage, method, tensor in stages:
        if tensor is None:
            continue
        bad = ~torch.isfinite(tensor).all(dim=1)
        if not bool(bad.any()):
            continue
        rows = torch.nonzero(bad).flatten().tolist()
        peak, diag = float(weight.abs().max()), float(torch.diagonal(gram).max())
        cause = (
            f"weights of magnitude up to {peak:.3g} overflow its arithmetic; rescale or clip them"
            if peak * max(diag, 0.0) ** 0.5 > HUGE_SCALE
            else f"{method} broke down numerically (largest weight {peak:.3g}, largest Gram diagonal {diag:.3g}); "
            "check the calibration inputs, or raise the stage's damp"
        )
        raise ValueError(
            f"the {stage} stage ({method}) returned non-finite weights in {len(rows)} of {weight.shape[0]} rows "
            f"(rows {rows[:5]}{', ...' if len(rows) > 5 else ''}): {cause}"
        )
