"""CPU kernels for ``y = x @ W.T`` with ``W`` stored as a bitmask + kept values (:mod:`~.format`'s layout).

The weight ``W [rows, cols]`` is held as ``bitmask uint8 [rows, nbytes]`` (``nbytes = ceil(cols / 8)``, bit ``c % 8``
of byte ``c // 8`` set where column ``c`` is kept), ``row_ptr int64 [rows + 1]`` (where each row's values start) and
``values [n_kept + 8]`` (float32, or bfloat16 bits as uint16; 8 trailing zeros so that a vector load at the last
value stays inside the array). Memory per weight: 1 bit plus the kept fraction times the value size.

Two kernels compute the same sums (8 lanes per row, lane ``l`` summing the columns ``c`` with ``c % 8 == l``, the
lanes then added in a fixed order: deterministic, independent of the thread count):

* ``avx2`` (x86-64 with AVX2 and FMA, when numba compiles for the host CPU): per mask byte, the next 8 values are
  loaded, spread to their columns with one ``vpermps`` (a 256-entry table of permutations), the unset lanes are
  cleared with a 256-entry table of lane masks, and a fused multiply-add accumulates them against the 8 inputs. It
  handles 1, 2 or 4 tokens per pass over a row (the permuted values are reused for every token), so a batch of
  ``B`` tokens reads each weight row once per 4 tokens. Written as numba intrinsics emitting LLVM IR (no fast-math
  flags).
* ``portable`` (any CPU): the same loop in plain numba, one set bit at a time (multiply then add).

Both are ``numba.njit(parallel=True, fastmath=False, cache=True)``, ``prange`` over output rows, with numba's
current thread count (``numba.set_num_threads``); calls with less work than :data:`PARALLEL_MIN_WORK` run a serial
twin on the calling thread. Inputs are float32 (bf16 values are widened exactly by a 16-bit shift), sums float32.
"""

from __future__ import annotations

import functools
import os
import platform

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

__all__ = [
    "KERNELS",
    "LANE_TABLE",
    "PARALLEL_MIN_WORK",
    "default_kernel",
    "densify",
    "pad_inputs",
    "run_spmm",
    "spmm",
]

KERNELS = ("avx2", "portable")

_KERNEL_ENV = "SPARSESWAPS_SPARSE_KERNEL"
"""Environment variable forcing a kernel (``avx2`` or ``portable``) for :func:`default_kernel`."""


def _lane_table() -> np.ndarray:
    table = np.zeros((512, 8), dtype=np.int32)
    for byte in range(256):
        count = 0
        for lane in range(8):
            if byte >> lane & 1:
                table[byte, lane] = count  # which of the next 8 values lands in this lane
                table[256 + byte, lane] = -1  # all bits set: keep the lane
                count += 1
    return table.reshape(-1)


LANE_TABLE = _lane_table()
"""int32 ``[512 * 8]``: rows 0-255 the ``vpermps`` index of each lane per mask byte, rows 256-511 the lane masks."""


@functools.lru_cache(maxsize=1)
def default_kernel() -> str:
    """``"avx2"`` when the host is x86-64 with AVX2 and FMA and numba targets the host CPU, else ``"portable"``;
    the environment variable ``SPARSESWAPS_SPARSE_KERNEL`` (``avx2`` or ``portable``) overrides it. Decided once per
    process (``default_kernel.cache_clear()`` to decide again).

    Raises:
        ValueError: the environment variable holds another value.
    """
    forced = os.environ.get(_KERNEL_ENV)
    if forced:
        if forced not in KERNELS:
            raise ValueError(f"{_KERNEL_ENV}={forced!r} must be one of {list(KERNELS)}")
        return forced
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "portable"
    if nb.config.CPU_NAME not in (None, "host") or nb.config.CPU_FEATURES not in (None, ""):
        return "portable"
    import llvmlite.binding as llvm

    features = llvm.get_host_cpu_features()
    return "avx2" if features.get("avx2") and features.get("fma") else "portable"


# --------------------------------------------------------------------------------------------------------------------
# AVX2 intrinsics: tokens x[xoff + t * xstride : ...], t < tokens, against one weight row.

_I64, _I32, _I16 = ir.IntType(64), ir.IntType(32), ir.IntType(16)
_F32 = ir.FloatType()
_V8F, _V8I, _V8H = ir.VectorType(_F32, 8), ir.VectorType(_I32, 8), ir.VectorType(_I16, 8)


def _const(value: int) -> ir.Constant:
    return ir.Constant(_I64, value)


def _emit_row(context, builder, signature, args, tokens: int):
    """numba codegen of one weight row against ``tokens`` inputs: returns a tuple of ``tokens`` float32 sums."""
    mask_a, vals_a, x_a, lut_a = (
        context.make_array(ty)(context, builder, value) for ty, value in zip(signature.args[:4], args[:4], strict=True)
    )
    mstart, k0, nbytes, xoff, xstride = args[4:9]
    bf16 = signature.args[1].dtype == types.uint16
    module = builder.module
    permps = cgutils.get_or_insert_function(module, ir.FunctionType(_V8F, [_V8F, _V8I]), "llvm.x86.avx2.permps")
    fma = cgutils.get_or_insert_function(module, ir.FunctionType(_V8F, [_V8F, _V8F, _V8F]), "llvm.fma.v8f32")
    ctpop = cgutils.get_or_insert_function(module, ir.FunctionType(_I64, [_I64]), "llvm.ctpop.i64")
    zero = ir.Constant(_V8F, None)
    mask_row = builder.gep(mask_a.data, [mstart])
    x_rows = [builder.gep(x_a.data, [builder.add(xoff, builder.mul(xstride, _const(t)))]) for t in range(tokens)]
    unroll = max(1, 4 // tokens)  # 4 independent accumulator chains in all

    def spread(byte_index, k):
        """The 8 values of mask byte ``byte_index`` (starting at value ``k``) in their lanes, and the next ``k``."""
        m = builder.zext(builder.load(builder.gep(mask_row, [byte_index])), _I64)
        row8 = builder.shl(m, _const(3))
        perm = builder.load(builder.bitcast(builder.gep(lut_a.data, [row8]), _V8I.as_pointer()), align=4)
        lanes = builder.gep(lut_a.data, [builder.add(row8, _const(2048))])
        lanes = builder.load(builder.bitcast(lanes, _V8I.as_pointer()), align=4)
        if bf16:
            raw = builder.load(builder.bitcast(builder.gep(vals_a.data, [k]), _V8H.as_pointer()), align=2)
            v = builder.bitcast(builder.shl(builder.zext(raw, _V8I), ir.Constant(_V8I, [16] * 8)), _V8F)
        else:
            v = builder.load(builder.bitcast(builder.gep(vals_a.data, [k]), _V8F.as_pointer()), align=4)
        spread_v = builder.call(permps, [v, perm])
        spread_v = builder.bitcast(builder.and_(builder.bitcast(spread_v, _V8I), lanes), _V8F)
        return spread_v, builder.add(k, builder.call(ctpop, [m]))

    def accumulate(byte_index, spread_v, accs):
        column = builder.shl(byte_index, _const(3))
        out = []
        for t, acc in enumerate(accs):
            xv = builder.load(builder.bitcast(builder.gep(x_rows[t], [column]), _V8F.as_pointer()), align=4)
            out.append(builder.call(fma, [spread_v, xv, acc]))
        return out

    function, entry = builder.function, builder.block
    n_main = builder.and_(nbytes, _const(-unroll))
    head = function.append_basic_block("sparse.head")
    body = function.append_basic_block("sparse.body")
    tail_head = function.append_basic_block("sparse.tail_head")
    tail_body = function.append_basic_block("sparse.tail_body")
    done = function.append_basic_block("sparse.done")
    builder.branch(head)

    builder.position_at_end(head)
    j, k = builder.phi(_I64), builder.phi(_I64)
    accs = [[builder.phi(_V8F) for _ in range(tokens)] for _ in range(unroll)]
    j.add_incoming(_const(0), entry)
    k.add_incoming(k0, entry)
    for group in accs:
        for acc in group:
            acc.add_incoming(zero, entry)
    builder.cbranch(builder.icmp_signed("<", j, n_main), body, tail_head)

    builder.position_at_end(body)
    k_next, new_accs = k, []
    for u in range(unroll):
        byte_index = builder.add(j, _const(u))
        spread_v, k_next = spread(byte_index, k_next)
        new_accs.append(accumulate(byte_index, spread_v, accs[u]))
    j.add_incoming(builder.add(j, _const(unroll)), body)
    k.add_incoming(k_next, body)
    for group, new_group in zip(accs, new_accs, strict=True):
        for acc, new in zip(group, new_group, strict=True):
            acc.add_incoming(new, body)
    builder.branch(head)

    builder.position_at_end(tail_head)  # the last nbytes % unroll bytes, into the first accumulator group
    tj, tk = builder.phi(_I64), builder.phi(_I64)
    taccs = [builder.phi(_V8F) for _ in range(tokens)]
    tj.add_incoming(j, head)
    tk.add_incoming(k, head)
    for tacc, acc in zip(taccs, accs[0], strict=True):
        tacc.add_incoming(acc, head)
    builder.cbranch(builder.icmp_signed("<", tj, nbytes), tail_body, done)

    builder.position_at_end(tail_body)
    spread_v, tk_next = spread(tj, tk)
    new_taccs = accumulate(tj, spread_v, taccs)
    tj.add_incoming(builder.add(tj, _const(1)), tail_body)
    tk.add_incoming(tk_next, tail_body)
    for tacc, new in zip(taccs, new_taccs, strict=True):
        tacc.add_incoming(new, tail_body)
    builder.branch(tail_head)

    builder.position_at_end(done)
    sums = []
    for t in range(tokens):
        total = taccs[t]
        for group in accs[1:]:
            total = builder.fadd(total, group[t])
        lanes = [builder.extract_element(total, ir.Constant(_I32, lane)) for lane in range(8)]
        add = builder.fadd
        low = add(add(lanes[0], lanes[1]), add(lanes[2], lanes[3]))
        sums.append(add(low, add(add(lanes[4], lanes[5]), add(lanes[6], lanes[7]))))
    return context.make_tuple(builder, signature.return_type, sums)


def _row_intrinsic(tokens: int):
    @intrinsic
    def row_dot(typingctx, mask, vals, x, lut, mstart, k0, nbytes, xoff, xstride):
        sig = types.UniTuple(types.float32, tokens)(mask, vals, x, lut, *([types.int64] * 5))

        def codegen(context, builder, signature, args):
            return _emit_row(context, builder, signature, args, tokens)

        return sig, codegen

    return row_dot


_row1, _row2, _row4 = _row_intrinsic(1), _row_intrinsic(2), _row_intrinsic(4)


@nb.njit(fastmath=False, cache=True)
def _avx2_row(mask, row_ptr, values, x, out, r):  # pragma: no cover - compiled
    """Row ``r`` of ``out [batch, rows]``, 4 tokens at a time, then 2, then 1."""
    lut = LANE_TABLE
    batch, nbytes, width = out.shape[0], mask.shape[1], x.shape[1]
    mstart, k0 = r * nbytes, row_ptr[r]
    t = 0
    while t + 4 <= batch:
        s0, s1, s2, s3 = _row4(mask, values, x, lut, mstart, k0, nbytes, t * width, width)
        out[t, r] = s0
        out[t + 1, r] = s1
        out[t + 2, r] = s2
        out[t + 3, r] = s3
        t += 4
    if t + 2 <= batch:
        s0, s1 = _row2(mask, values, x, lut, mstart, k0, nbytes, t * width, width)
        out[t, r] = s0
        out[t + 1, r] = s1
        t += 2
    if t < batch:
        (s0,) = _row1(mask, values, x, lut, mstart, k0, nbytes, t * width, width)
        out[t, r] = s0


def _as_float32(value):
    """A float32 value, or the float32 that uint16 bfloat16 bits widen to (exactly)."""
    raise NotImplementedError("only called from numba-compiled code")


@overload(_as_float32)
def _as_float32_impl(value):
    if value == types.uint16:
        return lambda value: np.uint32(np.uint32(value) << np.uint32(16)).view(np.float32)
    return lambda value: np.float32(value)


@nb.njit(fastmath=False, cache=True)
def _portable_row(mask, row_ptr, values, x, out, r):  # pragma: no cover - compiled
    """Row ``r`` of ``out [batch, rows]``: the same lanes and order as the avx2 kernel, multiply then add."""
    batch, nbytes = out.shape[0], mask.shape[1]
    lanes = np.zeros((batch, 8), dtype=np.float32)
    k = row_ptr[r]
    for j in range(nbytes):
        m = np.int64(mask[r, j])
        if m == 0:
            continue
        for lane in range(8):
            if (m >> lane) & 1:
                v = _as_float32(values[k])
                k += 1
                for t in range(batch):
                    lanes[t, lane] += v * x[t, j * 8 + lane]
    for t in range(batch):
        a = lanes[t]
        out[t, r] = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))


def _runner(kernel: str, parallel: bool):
    """A compiled loop computing every output row ``r`` with ``kernel``'s row function, over numba's threads
    (``prange``) with ``parallel``, else on the calling thread (``prange`` is ``range`` there). ``kernel`` is a
    compile-time constant (numba prunes the other branch), and the closure holds only a string and a bool, so
    that numba's on-disk cache finds each of the four variants again in a new process."""

    @nb.njit(parallel=parallel, fastmath=False, cache=True)
    def run(mask, row_ptr, values, x, out):  # pragma: no cover - compiled
        for r in nb.prange(out.shape[1]):
            if kernel == "avx2":
                _avx2_row(mask, row_ptr, values, x, out, r)
            else:
                _portable_row(mask, row_ptr, values, x, out, r)

    return run


_RUNNERS = {(kernel, parallel): _runner(kernel, parallel) for kernel in KERNELS for parallel in (True, False)}

PARALLEL_MIN_WORK = 1 << 16
"""Least ``rows * nbytes * batch`` (mask bytes times tokens) for a call to use numba's threads: below it the
kernel runs on the calling thread, as waking the pool costs more than it saves."""


@nb.njit(parallel=True, cache=True)
def _densify(mask, row_ptr, values, out):  # pragma: no cover - compiled
    rows, nbytes = mask.shape
    for r in nb.prange(rows):
        k = row_ptr[r]
        for j in range(nbytes):
            m = np.int64(mask[r, j])
            if m == 0:
                continue
            for lane in range(8):
                if (m >> lane) & 1:
                    out[r, j * 8 + lane] = values[k]
                    k += 1


def pad_inputs(x: np.ndarray, nbytes: int) -> np.ndarray:
    """``x [batch, cols]`` as a C-contiguous float32 ``[batch, nbytes * 8]`` array, zero-padded on the right (the
    kernels read whole groups of 8 inputs); ``x`` itself when it already is one.

    Args:
        x: float32 ``[batch, cols]`` with ``cols <= nbytes * 8``.
        nbytes: bytes per bitmask row.

    Returns:
        The padded array.
    """
    width = nbytes * 8
    if x.shape[1] == width and x.dtype == np.float32 and x.flags.c_contiguous:
        return x
    padded = np.zeros((x.shape[0], width), dtype=np.float32)
    padded[:, : x.shape[1]] = x
    return padded


def spmm(
    bitmask: np.ndarray, row_ptr: np.ndarray, values: np.ndarray, x: np.ndarray, kernel: str | None = None
) -> np.ndarray:
    """``x @ W.T`` for ``W`` in bitmask + values form (the module docstring's layout).

    Args:
        bitmask: uint8 ``[rows, nbytes]``, C-contiguous, padding bits 0.
        row_ptr: int64 ``[rows + 1]``: row ``r``'s values are ``values[row_ptr[r]:row_ptr[r + 1]]``.
        values: float32, or uint16 holding bfloat16 bits, ``[row_ptr[-1] + 8]`` (8 trailing padding entries).
        x: float32 ``[batch, cols]`` with ``cols <= nbytes * 8`` (zero-padded here if shorter).
        kernel: ``"avx2"``, ``"portable"``, or None for :func:`default_kernel`.

    Returns:
        float32 ``[batch, rows]``.

    Raises:
        ValueError: an unknown kernel, arrays of the wrong dtype, or inconsistent shapes.
    """
    kernel = default_kernel() if kernel is None else kernel
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} must be one of {list(KERNELS)} or None")
    rows, nbytes = bitmask.shape
    if bitmask.dtype != np.uint8 or row_ptr.dtype != np.int64 or row_ptr.shape != (rows + 1,):
        raise ValueError("bitmask must be uint8 [rows, nbytes] and row_ptr int64 [rows + 1]")
    if values.dtype not in (np.float32, np.uint16) or values.ndim != 1 or values.shape[0] < row_ptr[-1] + 8:
        raise ValueError("values must be float32 or uint16 (bf16 bits), 1-D, with 8 entries of padding at the end")
    if x.ndim != 2 or x.shape[1] > nbytes * 8:
        raise ValueError(f"x must be [batch, cols <= {nbytes * 8}], got shape {x.shape}")
    threads = nb.get_num_threads()
    return run_spmm(kernel, threads, np.ascontiguousarray(bitmask), row_ptr, values, pad_inputs(x, nbytes))


def run_spmm(
    kernel: str, threads: int, bitmask: np.ndarray, row_ptr: np.ndarray, values: np.ndarray, x: np.ndarray
) -> np.ndarray:
    """:func:`spmm` without its checks (the caller guarantees them), for the hot path of ``SparseLinear``.

    Args:
        kernel: ``"avx2"`` or ``"portable"``.
        threads: numba threads in use (numba's current setting, which the caller has set); 1 runs serially.
        bitmask: C-contiguous uint8 ``[rows, nbytes]``.
        row_ptr, values: as for :func:`spmm`.
        x: C-contiguous float32 ``[batch, nbytes * 8]`` (:func:`pad_inputs`).

    Returns:
        float32 ``[batch, rows]``.
    """
    rows, nbytes = bitmask.shape
    out = np.empty((x.shape[0], rows), dtype=np.float32)
    if rows == 0 or x.shape[0] == 0:
        return out
    parallel = threads > 1 and rows * nbytes * x.shape[0] >= PARALLEL_MIN_WORK
    _RUNNERS[kernel, parallel](bitmask, row_ptr, values, x, out)
    return out


def densify(bitmask: np.ndarray, row_ptr: np.ndarray, values: np.ndarray, cols: int) -> np.ndarray:
    """The dense ``[rows, cols]`` weight (in ``values``' dtype: float32, or uint16 bf16 bits) of a bitmask + values
    weight.

    Args:
        bitmask, row_ptr, values: as for :func:`spmm`.
        cols: number of columns (``<= nbytes * 8``).

    Returns:
        A new C-contiguous array, zero where the bitmask is clear.
    """
    rows, nbytes = bitmask.shape
    out = np.zeros((rows, nbytes * 8), dtype=values.dtype)
    if rows:
        _densify(bitmask, row_ptr, values, out)
    return np.ascontiguousarray(out[:, :cols])
