"""Sparse inference modules: :class:`SparseLinear` (CPU) and :func:`sparsify`, which swaps a pruned model's linears.

``sparsify(model)`` replaces, in place, every ``nn.Linear`` (and GPT-2 ``Conv1D``) whose weight is at least
``min_sparsity`` zeros by a :class:`SparseLinear` holding only the bitmask + kept values
(:mod:`~sparseswaps_prune.deploy.kernels`): about ``1/32 + (1 - s)`` of the fp32 bytes and ``1/16 + (1 - s)`` of the
bf16 ones at sparsity ``s``. Up to ``crossover`` tokens per call go through the sparse kernel; more (a long prompt)
through a dense matmul of the weight rebuilt for that call, or of a kept dense copy (``keep_dense=True``).

``sparsify(model, backend="semi-structured")`` instead converts the 2:4-pruned linears of a model on CUDA with
``torch.sparse.to_sparse_semi_structured`` (cuSPARSELt / CUTLASS kernels); it needs CUDA and fp16/bf16 weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numba
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from sparseswaps_prune.deploy import kernels
from sparseswaps_prune.deploy.format import (
    DEFAULT_MIN_SPARSITY,
    nm_pattern,
    packed_width,
    row_counts,
    zero_fraction,
)
from sparseswaps_prune.modules import find_layers

__all__ = ["BACKENDS", "DEFAULT_CROSSOVER", "SparseLinear", "SparsifyReport", "sparsify"]

BACKENDS = ("cpu", "semi-structured")

DEFAULT_CROSSOVER = 8
"""Most tokens per call that :class:`SparseLinear` sends through the sparse kernel; above it, a dense matmul.
Measured with ``benchmarks/sparse_inference.py`` (docs/deploy.md): on the 2-core test machine, one thread, float32,
4096 x 14336 and 14336 x 4096 layers at 50-70% sparsity, the kernel ran at 1.0-1.7x torch's dense ``nn.Linear``
speed at 1 token, 1.8-5.3x at 2 to 8 tokens, and 1.0-2.1x at 16 (never slower); 8 keeps a margin for cores where
the dense matmul is relatively faster."""

_VALUE_DTYPES = (torch.float32, torch.bfloat16)


def _numpy_values(values: torch.Tensor) -> np.ndarray:
    """float32 values as float32, bfloat16 values as their uint16 bits (no copy)."""
    if values.dtype == torch.bfloat16:
        return values.view(torch.int16).numpy().view(np.uint16)
    return values.numpy()


class _KernelArrays(NamedTuple):
    """What :class:`SparseLinear`'s sparse path needs, cached: the buffers it was built from (to notice a
    replaced one), the ``kernel`` attribute it was built for and the kernel it resolved to, and numpy views of the
    buffers."""

    values: torch.Tensor
    bitmask: torch.Tensor
    row_ptr: torch.Tensor
    kernel_option: str | None
    kernel: str
    bitmask_np: np.ndarray
    row_ptr_np: np.ndarray
    values_np: np.ndarray


class SparseLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W [out_features, in_features]`` held as a bitmask + kept values, on the CPU.

    Inference only (no gradients). Build one with :meth:`from_dense` or :meth:`from_linear` (or let
    :func:`sparsify` swap them in). Buffers (not saved in the state dict): ``bitmask`` (uint8
    ``[out_features, ceil(in_features / 8)]``), ``row_ptr`` (int64 ``[out_features + 1]``) and ``values`` (float32
    or bfloat16, the kept weights in row-major order followed by 8 zeros of padding). The state dict holds the
    dense ``weight`` (in the replaced module's own layout) and ``bias``, so ``save_pretrained`` and
    :func:`~sparseswaps_prune.deploy.save_sparse` work on a sparsified model; pruned entries come back as ``+0.0``.

    Attributes:
        in_features, out_features: the layer's sizes.
        transposed: True when it replaced a GPT-2 ``Conv1D`` (``weight`` is then ``[in_features, out_features]``).
        crossover: most tokens per call for the sparse kernel (:data:`DEFAULT_CROSSOVER`); more use a dense matmul.
        kernel: ``"avx2"``, ``"portable"`` or None (:func:`~sparseswaps_prune.deploy.kernels.default_kernel`).
    """

    def __init__(
        self,
        bitmask: torch.Tensor,
        row_ptr: torch.Tensor,
        values: torch.Tensor,
        in_features: int,
        bias: torch.Tensor | None = None,
        *,
        transposed: bool = False,
        keep_dense: bool = False,
        crossover: int = DEFAULT_CROSSOVER,
        kernel: str | None = None,
    ) -> None:
        """Wrap an encoded weight; prefer :meth:`from_dense`, which builds the buffers.

        Args:
            bitmask: uint8 ``[out_features, ceil(in_features / 8)]``, little-endian bits, padding bits 0.
            row_ptr: int64 ``[out_features + 1]``, ``row_ptr[0] == 0``, non-decreasing, each row's count of set bits.
            values: float32 or bfloat16 ``[row_ptr[-1] + 8]`` (the last 8 are padding).
            in_features: number of input features (``>= 1``).
            bias: None or ``[out_features]``.
            transposed: the weight's own layout is ``[in_features, out_features]`` (``Conv1D``).
            keep_dense: also keep the dense weight, for calls of more than ``crossover`` tokens.
            crossover: most tokens per call for the sparse kernel (``>= 0``).
            kernel: see :func:`~sparseswaps_prune.deploy.kernels.spmm`.

        Raises:
            ValueError: inconsistent buffers, an unknown kernel, or a bad ``crossover``.
        """
        super().__init__()
        if not isinstance(in_features, int) or in_features < 1:
            raise ValueError(f"in_features must be a positive int, got {in_features!r}")
        rows = bitmask.shape[0] if bitmask.dim() == 2 else -1
        if bitmask.dtype != torch.uint8 or tuple(bitmask.shape) != (rows, packed_width(in_features)):
            raise ValueError(
                f"bitmask must be uint8 [out_features, {packed_width(in_features)}], got {bitmask.dtype} "
                f"{tuple(bitmask.shape)}"
            )
        if row_ptr.dtype != torch.int64 or tuple(row_ptr.shape) != (rows + 1,):
            raise ValueError(f"row_ptr must be int64 [{rows + 1}], got {row_ptr.dtype} {tuple(row_ptr.shape)}")
        if in_features % 8 and rows > 0 and (bitmask[:, -1] >> (in_features % 8)).any():
            raise ValueError(f"bitmask has bits set past column {in_features}")
        if int(row_ptr[0]) != 0 or not torch.equal(row_ptr.diff(), row_counts(bitmask)):
            raise ValueError("row_ptr does not match the bitmask: row_ptr[r + 1] - row_ptr[r] must count row r's bits")
        if values.dtype not in _VALUE_DTYPES or values.dim() != 1 or values.numel() != int(row_ptr[-1]) + 8:
            raise ValueError(
                f"values must be float32 or bfloat16 [{int(row_ptr[-1]) + 8}] (the kept values, then 8 of padding), "
                f"got {values.dtype} {tuple(values.shape)}"
            )
        if bias is not None and tuple(bias.shape) != (rows,):
            raise ValueError(f"bias must be [{rows}], got {tuple(bias.shape)}")
        if not isinstance(crossover, int) or crossover < 0:
            raise ValueError(f"crossover must be an int >= 0 (tokens per call), got {crossover!r}")
        if kernel is not None and kernel not in kernels.KERNELS:
            raise ValueError(f"kernel={kernel!r} must be one of {list(kernels.KERNELS)} or None")
        self.in_features, self.out_features = in_features, rows
        self.transposed, self.crossover, self.kernel = transposed, crossover, kernel
        self.register_buffer("bitmask", bitmask.contiguous(), persistent=False)
        self.register_buffer("row_ptr", row_ptr.contiguous(), persistent=False)
        self.register_buffer("values", values.contiguous(), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.register_buffer("dense_weight", self.weight_2d() if keep_dense else None, persistent=False)
        self._arrays: _KernelArrays | None = None  # rebuilt when a buffer or the kernel is replaced

    @classmethod
    def from_dense(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        transposed: bool = False,
        keep_dense: bool = False,
        crossover: int = DEFAULT_CROSSOVER,
        kernel: str | None = None,
    ) -> SparseLinear:
        """Encode a dense weight with exact zeros.

        Args:
            weight: float32 or bfloat16 ``[out_features, in_features]`` (``[in_features, out_features]`` with
                ``transposed``); not modified. Entries equal to 0 are dropped.
            bias: None or ``[out_features]``.
            transposed, keep_dense, crossover, kernel: see :class:`SparseLinear`.

        Returns:
            The module (on the CPU).

        Raises:
            ValueError: a weight that is not 2-D, float32/bfloat16, with at least one input feature.
        """
        if weight.dim() != 2 or weight.dtype not in _VALUE_DTYPES:
            raise ValueError(
                f"SparseLinear needs a 2-D float32 or bfloat16 weight, got {weight.dtype} {tuple(weight.shape)}; "
                "cast float16 or float64 models to torch.bfloat16 or torch.float32 first"
            )
        w = weight.detach().cpu()
        w = (w.t() if transposed else w).contiguous()
        kept = w != 0
        bitmask = torch.from_numpy(np.packbits(kept.numpy(), axis=1, bitorder="little"))
        row_ptr = torch.zeros(w.shape[0] + 1, dtype=torch.int64)
        row_ptr[1:] = kept.sum(dim=1).cumsum(0)
        values = torch.cat([w[kept], torch.zeros(8, dtype=w.dtype)])
        b = None if bias is None else bias.detach().cpu()
        return cls(
            bitmask,
            row_ptr,
            values,
            w.shape[1],
            b,
            transposed=transposed,
            keep_dense=keep_dense,
            crossover=crossover,
            kernel=kernel,
        )

    @classmethod
    def from_bitmask(
        cls,
        bitmask: torch.Tensor,
        values: torch.Tensor,
        in_features: int,
        bias: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> SparseLinear:
        """Build from a bitmask + values pair as stored in a sparse checkpoint (:mod:`~.format`), never densifying.

        Args:
            bitmask: uint8 ``[out_features, ceil(in_features / 8)]``.
            values: float32 or bfloat16 kept values ``[n_kept]`` (no padding).
            in_features: number of input features.
            bias: None or ``[out_features]``.
            **kwargs: ``transposed``, ``keep_dense``, ``crossover``, ``kernel`` (see :class:`SparseLinear`).

        Returns:
            The module.

        Raises:
            ValueError: inconsistent tensors (see :class:`SparseLinear`).
        """
        row_ptr = torch.zeros(bitmask.shape[0] + 1, dtype=torch.int64)
        row_ptr[1:] = row_counts(bitmask).cumsum(0)
        padded = torch.cat([values.reshape(-1), torch.zeros(8, dtype=values.dtype)])
        return cls(bitmask.contiguous(), row_ptr, padded, in_features, bias, **kwargs)

    @classmethod
    def from_linear(cls, module: nn.Module, **kwargs: Any) -> SparseLinear:
        """Encode an ``nn.Linear`` (or a GPT-2 ``Conv1D``: ``transposed`` is set from its type).

        Args:
            module: the layer; not modified.
            **kwargs: ``keep_dense``, ``crossover``, ``kernel`` (see :class:`SparseLinear`).

        Returns:
            The module.
        """
        from sparseswaps_prune.modules import is_transposed

        return cls.from_dense(module.weight, module.bias, transposed=is_transposed(module), **kwargs)

    @property
    def nnz(self) -> int:
        """Number of kept weights."""
        return int(self.row_ptr[-1])

    @property
    def sparsity(self) -> float:
        """Fraction of pruned weights."""
        return 1.0 - self.nnz / (self.in_features * self.out_features)

    @property
    def sparse_bytes(self) -> int:
        """Bytes held by the encoded weight (bitmask, row pointers, values) and the dense copy if kept."""
        tensors = [self.bitmask, self.row_ptr, self.values, self.dense_weight]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def weight_2d(self) -> torch.Tensor:
        """The dense ``[out_features, in_features]`` weight, rebuilt (a new tensor; pruned entries ``+0.0``)."""
        values = self.values
        dense = kernels.densify(self.bitmask.numpy(), self.row_ptr.numpy(), _numpy_values(values), self.in_features)
        if values.dtype == torch.bfloat16:
            return torch.from_numpy(dense.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(dense)

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight in the replaced module's layout, rebuilt on every access (costly; not a parameter)."""
        dense = self.weight_2d()
        return dense.t().contiguous() if self.transposed else dense

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"sparsity={self.sparsity:.3f}, dtype={self.values.dtype}, crossover={self.crossover}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + bias`` over the last axis.

        Args:
            x: ``[..., in_features]`` floating tensor on the CPU.

        Returns:
            ``[..., out_features]`` in ``x.dtype``. Up to ``crossover`` tokens: summed in float32 by the sparse
            kernel (equal to the dense layer within float32 rounding), then rounded to ``x.dtype``. More tokens:
            ``torch.nn.functional.linear`` with the dense weight in the values' dtype.

        Raises:
            RuntimeError: gradients are required, or the module or ``x`` is not on the CPU.
            ValueError: ``x``'s last axis is not ``in_features``, or the values' dtype is not float32/bfloat16.

        The sparse kernel uses torch's thread count (``torch.set_num_threads``), which it copies into numba.
        """
        if x.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(
                "SparseLinear is inference-only (no gradients); run the model under torch.no_grad() or "
                "torch.inference_mode()"
            )
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features on its last axis, expected {self.in_features}")
        if not x.is_cpu:
            raise RuntimeError(
                f"SparseLinear runs on the CPU (input on {x.device}); for CUDA use "
                "sparsify(model, backend='semi-structured') on a 2:4 model"
            )
        # The hot path (decoding calls it once per layer and token): module attributes are read from the module's
        # dicts directly, and the numpy views of the buffers are built once (again when a buffer or the kernel is
        # replaced, e.g. by load_state_dict or .to()), which also checks them.
        buffers = self._buffers
        arrays = self._arrays
        if (
            arrays is None
            or arrays.values is not buffers["values"]
            or arrays.bitmask is not buffers["bitmask"]
            or arrays.row_ptr is not buffers["row_ptr"]
            or arrays.kernel_option != self.kernel
        ):
            arrays = self._kernel_arrays()
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] > self.crossover:
            dense = self.dense_weight if self.dense_weight is not None else self.weight_2d()
            bias = None if self.bias is None else self.bias.to(dense.dtype)
            return F.linear(x2.to(dense.dtype), dense, bias).to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        threads = torch.get_num_threads()
        if threads > 1:
            threads = min(threads, numba.config.NUMBA_NUM_THREADS)
            if numba.get_num_threads() != threads:
                numba.set_num_threads(threads)
        xs = x2.detach() if x2.requires_grad else x2
        if xs.dtype != torch.float32:
            xs = xs.to(torch.float32)
        xs = kernels.pad_inputs(xs.numpy(), arrays.bitmask_np.shape[1])
        y = torch.from_numpy(
            kernels.run_spmm(arrays.kernel, threads, arrays.bitmask_np, arrays.row_ptr_np, arrays.values_np, xs)
        )
        bias = self._parameters.get("bias")  # None: the module has no bias
        if bias is not None:
            y += bias.detach()
        if x.dtype != torch.float32:
            y = y.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _kernel_arrays(self) -> _KernelArrays:
        """Check the buffers for the sparse kernel and cache what it needs in ``self._arrays``."""
        bitmask, row_ptr, values = self.bitmask, self.row_ptr, self.values
        if values.device.type != "cpu":
            raise RuntimeError(
                f"SparseLinear runs on the CPU (weights on {values.device}); for CUDA use "
                "sparsify(model, backend='semi-structured') on a 2:4 model"
            )
        if values.dtype not in _VALUE_DTYPES:
            raise ValueError(f"SparseLinear values are {values.dtype}; only float32 and bfloat16 are supported")
        kernel = self.kernel or kernels.default_kernel()
        arrays = _KernelArrays(
            values, bitmask, row_ptr, self.kernel, kernel, bitmask.numpy(), row_ptr.numpy(), _numpy_values(values)
        )
        self._arrays = arrays
        return arrays

    def to_linear(self) -> nn.Linear:
        """A dense ``nn.Linear`` with the same weight and bias (for a ``Conv1D`` original: the transposed weight)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, dtype=self.values.dtype)
        with torch.no_grad():
            linear.weight.copy_(self.weight_2d())
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        destination[prefix + "weight"] = self.weight
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        key = prefix + "weight"
        if key not in state_dict:
            missing_keys.append(key)
            return
        weight = state_dict[key]
        expected = (self.in_features, self.out_features) if self.transposed else (self.out_features, self.in_features)
        if tuple(weight.shape) != expected:
            error_msgs.append(f"size mismatch for {key}: got {tuple(weight.shape)}, expected {expected}")
            return
        bias_key = prefix + "bias"
        if (self.bias is not None) != (bias_key in state_dict):
            (missing_keys if self.bias is not None else unexpected_keys).append(bias_key)
            return
        fresh = SparseLinear.from_dense(
            weight.to(self.values.dtype),
            state_dict.get(bias_key),
            transposed=self.transposed,
            keep_dense=self.dense_weight is not None,
            crossover=self.crossover,
            kernel=self.kernel,
        )
        self.bitmask, self.row_ptr, self.values = fresh.bitmask, fresh.row_ptr, fresh.values
        self.dense_weight = fresh.dense_weight
        if self.bias is not None:
            with torch.no_grad():
                self.bias.copy_(fresh.bias)


@dataclass
class SparsifyReport:
    """What :func:`sparsify` did.

    Attributes:
        backend: ``"cpu"`` or ``"semi-structured"``.
        converted: name -> sparsity of each swapped (cpu) or converted (semi-structured) layer.
        skipped: name -> reason, for each linear layer left as it was.
        dense_bytes: bytes of the converted layers' dense weights before.
        sparse_bytes: bytes of their encoded weights after (cpu backend; 0 for semi-structured).
    """

    backend: str
    converted: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    dense_bytes: int = 0
    sparse_bytes: int = 0


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def _shared_weights(model: nn.Module) -> set[int]:
    """ids of parameters held by more than one module (tied weights)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                seen[id(param)] = seen.get(id(param), 0) + 1
    return {key for key, count in seen.items() if count > 1}


def sparsify(
    model: nn.Module,
    min_sparsity: float = DEFAULT_MIN_SPARSITY,
    *,
    backend: str = "cpu",
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    keep_dense: bool = False,
    crossover: int = DEFAULT_CROSSOVER,
    kernel: str | None = None,
) -> tuple[nn.Module, SparsifyReport]:
    """Swap the pruned linear layers of ``model`` for sparse ones, in place.

    Args:
        model: any module; its ``nn.Linear`` / ``Conv1D`` layers are candidates.
        min_sparsity: least fraction of zero weights for a layer to be converted (cpu backend).
        backend: ``"cpu"`` (:class:`SparseLinear`) or ``"semi-structured"`` (``to_sparse_semi_structured`` on CUDA,
            for layers whose weight is 2:4 sparse).
        include, exclude: fnmatch patterns on the layers' qualified names (as
            :func:`sparseswaps_prune.modules.find_layers`).
        keep_dense, crossover, kernel: passed to :class:`SparseLinear` (cpu backend).

    Returns:
        ``(model, report)``: the same model object, and a :class:`SparsifyReport` naming the converted layers and
        why the others were skipped (below ``min_sparsity``, tied to another module, a dtype or device the backend
        does not take, a ``torch.nn.utils.prune`` re-parametrisation still in place, not 2:4).

    Raises:
        ValueError: an unknown backend or a ``min_sparsity`` outside ``[0, 1]``.
        RuntimeError: ``backend="semi-structured"`` without CUDA, or with no parameter of the model on CUDA.

    Example:
        >>> model, report = sparsify(model)  # doctest: +SKIP
        >>> with torch.inference_mode():  # doctest: +SKIP
        ...     out = model.generate(ids, max_new_tokens=32, do_sample=False)
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {list(BACKENDS)}")
    if not isinstance(min_sparsity, (int, float)) or not 0.0 <= min_sparsity <= 1.0:
        raise ValueError(f"min_sparsity must be a number in [0, 1], got {min_sparsity!r}")
    if backend == "semi-structured":
        return model, _semi_structured(model, include, exclude)
    report = SparsifyReport(backend)
    shared = _shared_weights(model)
    for layer in find_layers(model, prefix="", include=include, exclude=exclude):
        module, name = layer.module, layer.name
        weight = getattr(module, "weight", None)
        reason = None
        if hasattr(module, "weight_orig"):
            reason = "torch.nn.utils.prune re-parametrisation in place (call prune.remove first)"
        elif not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            reason = "no 2-D weight"
        elif id(weight) in shared:
            reason = "weight tied to another module"
        elif weight.device.type != "cpu":
            reason = f"weight on {weight.device} (the cpu backend needs CPU weights)"
        elif weight.dtype not in _VALUE_DTYPES:
            reason = f"dtype {weight.dtype} (the cpu backend takes float32 and bfloat16)"
        else:
            sparsity = zero_fraction(weight.detach())
            if sparsity < min_sparsity:
                reason = f"sparsity {sparsity:.3f} < min_sparsity {min_sparsity}"
        if reason is not None:
            report.skipped[name] = reason
            continue
        sparse = SparseLinear.from_linear(module, keep_dense=keep_dense, crossover=crossover, kernel=kernel)
        report.dense_bytes += weight.numel() * weight.element_size()
        report.sparse_bytes += sparse.sparse_bytes
        report.converted[name] = sparse.sparsity
        _set_module(model, name, sparse)
    return model, report


def _semi_structured(model: nn.Module, include: Sequence[str] | None, exclude: Sequence[str] | None) -> SparsifyReport:
    if not torch.cuda.is_available():
        raise RuntimeError(
            "sparsify(backend='semi-structured') needs CUDA (torch.sparse.to_sparse_semi_structured runs on NVIDIA "
            "GPUs of compute capability 8.0+); on the CPU use backend='cpu'"
        )
    if not any(p.device.type == "cuda" for p in model.parameters()):
        raise RuntimeError("sparsify(backend='semi-structured') needs the model on CUDA; call model.to('cuda') first")
    from torch.sparse import to_sparse_semi_structured

    report = SparsifyReport("semi-structured")
    shared = _shared_weights(model)
    for layer in find_layers(model, prefix="", include=include, exclude=exclude):
        module, name = layer.module, layer.name
        weight = getattr(module, "weight", None)
        reason = None
        if not isinstance(module, nn.Linear):
            reason = f"{type(module).__name__} (only nn.Linear converts)"
        elif hasattr(module, "weight_orig"):
            reason = "torch.nn.utils.prune re-parametrisation in place (call prune.remove first)"
        elif id(weight) in shared:
            reason = "weight tied to another module"
        elif weight.device.type != "cuda":
            reason = f"weight on {weight.device}, not CUDA"
        elif weight.dtype not in (torch.float16, torch.bfloat16):
            reason = f"dtype {weight.dtype} (semi-structured takes float16 and bfloat16)"
        elif nm_pattern(weight.detach() != 0) != (2, 4):
            reason = "not 2:4 sparse"
        if reason is None:
            try:
                sparse = to_sparse_semi_structured(weight.detach())
            except (RuntimeError, ValueError) as err:
                reason = f"to_sparse_semi_structured refused it: {err}".splitlines()[0]
        if reason is not None:
            report.skipped[name] = reason
            continue
        report.dense_bytes += weight.numel() * weight.element_size()
        report.converted[name] = zero_fraction(weight.detach())
        module.weight = nn.Parameter(sparse, requires_grad=False)
    return report
