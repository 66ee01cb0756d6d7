"""Best-swap search backends: each returns, for every row, the pair ``(u, p)`` minimising

``dL(u, p) = A_u + B_p - 2 w_u w_p G_up`` with ``A_u = 2 w_u c_u + w_u^2 G_uu`` over kept ``u`` and
``B_p = -2 w_p c_p + w_p^2 G_pp`` over pruned nonzero ``p`` (for ``nm``: ``u`` and ``p`` in one block of ``m``),
and its ``dL`` (``+inf`` where a row has no feasible pair). Ties go to the smallest ``u``, then the
smallest ``p``. Backends search only; :mod:`sparseswaps_prune.core.refine` applies the swaps.

* ``torch``: vectorized, any device, memory bounded by chunks of ``u`` (the reference).
* ``numba``: compiled CPU kernel sharing each row of ``G`` across a block of rows (numba is a required
  dependency, so this is always available on the CPU).
* ``triton``: fused CUDA kernel sharing each tile of ``G`` across a block of rows (on the CPU only
  through the Triton interpreter, ``TRITON_INTERPRET=1``, for testing).
* N:M always uses the block-local torch search (``O(d_in * m)`` per row).

The re-fit objective has its own engines behind one contract (:class:`~.refit_engine.RefitEngine`;
:func:`resolve_refit_backend` names one, :func:`refit_engine_class` gives its class): the torch reference
(:class:`~.refit_engine.TorchRefitEngine`, on :mod:`.refit_state`), the compiled CPU engine :mod:`.refit_numba` and
the lazy state's Triton kernels on CUDA, :mod:`.refit_lazy_triton`.
"""

from __future__ import annotations

import os

import torch

from sparseswaps_prune.core.backends.nm_search import best_swaps_nm
from sparseswaps_prune.core.backends.numba_search import best_swaps_numba
from sparseswaps_prune.core.backends.refit_engine import RefitEngine, TorchRefitEngine
from sparseswaps_prune.core.backends.refit_numba import NumbaRefitState
from sparseswaps_prune.core.backends.torch_search import best_swaps_torch

BACKENDS = ("auto", "torch", "numba", "triton")


def triton_available() -> bool:
    """True if the fused Triton kernel can be compiled (triton importable)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, device: torch.device, nm: tuple[int, int] | None) -> str:
    """Pick the search backend: ``auto`` means triton on CUDA (when installed), numba on CPU, torch otherwise.
    ``triton`` on a non-CUDA device needs the interpreter (``TRITON_INTERPRET=1``); ``nm`` is always ``"nm"``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown swap-search backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if nm is not None:
        return "nm"
    if backend == "auto":
        if device.type == "cuda" and triton_available():
            return "triton"
        return "numba" if device.type == "cpu" else "torch"
    if backend == "numba" and device.type != "cpu":
        raise ValueError(f"backend='numba' runs on the CPU only, but the refinement device is {device}")
    if backend == "triton" and not triton_available():
        raise ValueError("backend='triton' needs the triton package: pip install triton")
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"backend='triton' runs on CUDA devices, but the refinement device is {device} "
            "(set TRITON_INTERPRET=1 to run the kernel in the Triton interpreter, for testing only)"
        )
    return backend


def resolve_refit_backend(backend: str, device: torch.device) -> str:
    """Engine of the re-fit objective (:func:`refit_engine_class` gives its class): ``"numba"`` (compiled,
    :mod:`.refit_numba`) for ``auto`` and ``numba`` on the CPU; ``"triton"`` (the lazy state's Triton kernels,
    :mod:`.refit_lazy_triton`: an iteration 3.2-5.8x faster than the eager Triton engine it replaced, on an H200,
    BENCHMARKS.md "GPU") for ``auto`` on CUDA when triton is installed, and for ``triton`` (off CUDA only in the
    interpreter, as :func:`resolve_backend`); ``"torch"`` (the reference, :class:`~.refit_engine.TorchRefitEngine`)
    otherwise. ``numba`` off the CPU is an error. All engines choose the same swaps."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown swap-search backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "numba" and device.type != "cpu":
        raise ValueError(f"backend='numba' runs on the CPU only, but the refinement device is {device}")
    if backend in ("auto", "numba") and device.type == "cpu":
        return "numba"
    if backend == "auto" and device.type == "cuda" and triton_available():
        return "triton"
    if backend == "triton":
        return resolve_backend("triton", device, None)  # the same availability checks and errors
    return "torch"


REFIT_ENGINES = ("torch", "numba", "triton")


def refit_engine_class(name: str) -> type[RefitEngine]:
    """The class of the re-fit engine ``name`` (one of :data:`REFIT_ENGINES`, as :func:`resolve_refit_backend`
    returns): :class:`~.refit_engine.TorchRefitEngine`, :class:`~.refit_numba.NumbaRefitState` or
    :class:`~.refit_lazy_triton.TritonRefitState` (imported here: triton is optional)."""
    if name == "torch":
        return TorchRefitEngine
    if name == "numba":
        return NumbaRefitState
    if name == "triton":
        from sparseswaps_prune.core.backends.refit_lazy_triton import TritonRefitState

        return TritonRefitState
    raise ValueError(f"unknown re-fit engine {name!r}; choose one of {', '.join(REFIT_ENGINES)}")


def best_swaps(
    name: str,
    weight: torch.Tensor,
    keep: torch.Tensor,
    corr: torch.Tensor,
    gram: torch.Tensor,
    nm: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dispatch to backend ``name`` (as returned by :func:`resolve_backend`).

    Args:
        weight, corr: ``[rows, d_in]`` in the compute dtype; keep: ``[rows, d_in]`` bool (True = kept);
        gram: ``[d_in, d_in]`` compute dtype. Nothing is modified.

    Returns:
        ``u``, ``p`` (int64 ``[rows]``) and ``dL`` (``[rows]``, compute dtype, ``+inf`` if no pair).
    """
    if name == "nm":
        return best_swaps_nm(weight, keep, corr, gram, nm[1])
    if name == "numba":
        return best_swaps_numba(weight, keep, corr, gram)
    if name == "triton":
        from sparseswaps_prune.core.backends.triton_search import best_swaps_triton

        return best_swaps_triton(weight, keep, corr, gram)
    return best_swaps_torch(weight, keep, corr, gram)
