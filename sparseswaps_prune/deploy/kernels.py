"""CPU kernels for ``y = x @ W.T`` with ``W`` stored as a bitmask + kept values (:mod:`~.format`'s layout).

The weight ``W [rows, cols]`` is held as ``bitmask uint8 [rows, nbytes]`` (``nbytes = ceil(cols / 8)``, bit ``c % 8``
of byte ``c // 8`` set where column ``c`` is kept), ``row_ptr int64 [rows + 1]`` (where each row's values start) and
``values [n_kept + 8]`` (float32, or bfloat16 bits as uint16; 8 trailing zeros so that a vector load at the last
value stays inside the array). Memory per weight: 1 bit plus the kept fraction times the value size.

Two kernels compute the same sums up to float32 rounding (8 lanes per row, lane ``l`` summing the columns ``c`` with
``c % 8 == l``, the lanes then added in a fixed order: deterministic, independent of the thread count):

* ``avx2`` (x86-64 with AVX2 and FMA, when numba compiles for the host CPU): the bitmask is read 8 bytes at a time
  as one 64-bit word; each byte's first value is found from a popcount of the word's lower bits (no chain of
  additions from byte to byte), the byte itself is loaded on its own (a load port is freer than the ALUs here),
  and ``values`` is prefetched ahead. Per mask byte one unaligned 32-byte load holds
  all its values, those of bits 0-3 the last of its low 16 bytes and those of bits 4-7 the first of its high 16
  bytes, so that one in-lane ``vpshufb`` (a 256-entry table per dtype) moves each kept value to its lane and zeroes
  the others, widening bfloat16 to float32 in the same shuffle; a fused multiply-add accumulates it against the 8
  inputs, into 8 accumulators in all (byte ``i`` of a word into accumulator ``i % (8 // tokens)`` of its token, the
  bytes after the last whole word into the first; the accumulators are added in order at the end). It handles 1,
  2 or 4 tokens per pass over a row (the spread values are reused for every token), so a batch of ``B`` tokens
  reads each weight row once per 4 tokens. The load starts up to 8 values before a byte's first value: a row whose
  values start within the first 8 of ``values`` runs on a copy of its values behind 8 zeros, so that no read leaves
  the array. Written as numba intrinsics emitting LLVM IR (no fast-math flags).
* ``portable`` (any CPU): the same lanes in plain numba, one set bit at a time (multiply then add, one accumulator
  per lane).

Both are ``numba.njit(parallel=True, fastmath=False, cache=True)``, ``prange`` over output rows, with numba's
current thread count (``numba.set_num_threads``); calls with less work than :data:`PARALLEL_MIN_WORK` run a serial
twin on the calling thread. Inputs are float32 (bf16 values are widened exactly, to the high half of a float32),
sums float32.
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


def _shuffle_table(value_bytes: int) -> np.ndarray:
    """``vpshufb`` controls ``uint8 [256, 32]`` for values of ``value_bytes`` bytes (4: float32, 2: bfloat16 bits)
    loaded as 32 bytes that end the values of bits 0-3 of a mask byte at byte 16 and start those of bits 4-7 there:
    lane ``l`` of the result takes its value's bytes into the high bytes of the lane, or 0x80 (zero) for a clear
    bit."""
    table = np.full((256, 32), 0x80, dtype=np.uint8)
    per_half = 16 // value_bytes
    for byte in range(256):
        low = [lane for lane in range(4) if byte >> lane & 1]
        high = [lane for lane in range(4, 8) if byte >> lane & 1]
        # value i of the low nibble is element per_half - len(low) + i of the load, value i of the high one per_half + i
        places = [(lane, per_half - len(low) + i) for i, lane in enumerate(low)]
        places += [(lane, per_half + i) for i, lane in enumerate(high)]
        for lane, element in places:
            source = value_bytes * element - 16 * (lane // 4)  # vpshufb indexes within each 16-byte half
            for b in range(value_bytes):
                table[byte, 4 * lane + 4 - value_bytes + b] = source + b
    return table


LANE_TABLE = np.stack([_shuffle_table(4), _shuffle_table(2)]).reshape(-1)
"""uint8 ``[2 * 256 * 32]``: the ``vpshufb`` control per mask byte for float32 values, then for bfloat16 values."""

_FRONT = 8
"""Values the avx2 kernel may read before a row's current one (``16 / value bytes``, at most 8 for bfloat16)."""

_PREFETCH_BYTES, _PREFETCH_LINES = 2048, 3
"""The avx2 kernel prefetches ``_PREFETCH_LINES`` cache lines of ``values`` from ``_PREFETCH_BYTES`` ahead of the
current value, per 8 mask bytes."""


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

_I64, _I32, _I8 = ir.IntType(64), ir.IntType(32), ir.IntType(8)
_V8F, _V32B = ir.VectorType(ir.FloatType(), 8), ir.VectorType(_I8, 32)


def _const(value: int) -> ir.Constant:
    return ir.Constant(_I64, value)


def _emit_row(context, builder, signature, args, tokens: int):
    """numba codegen of one weight row against ``tokens`` inputs: returns a tuple of ``tokens`` float32 sums. The
    row's values are ``front``'s where ``use_front`` is nonzero, else ``values``' (chosen here, so that the calling
    loop binds no array per row: numba would count its references, atomic operations that serialize the rows)."""
    mask_a, vals_a, front_a, x_a, lut_a = (
        context.make_array(ty)(context, builder, value) for ty, value in zip(signature.args[:5], args[:5], strict=True)
    )
    use_front, mstart, k0, nbytes, xoff, xstride = args[5:11]
    value_bytes = 2 if signature.args[1].dtype == types.uint16 else 4
    module = builder.module
    pshufb = cgutils.get_or_insert_function(module, ir.FunctionType(_V32B, [_V32B, _V32B]), "llvm.x86.avx2.pshuf.b")
    fma = cgutils.get_or_insert_function(module, ir.FunctionType(_V8F, [_V8F, _V8F, _V8F]), "llvm.fma.v8f32")
    ctpop = cgutils.get_or_insert_function(module, ir.FunctionType(_I64, [_I64]), "llvm.ctpop.i64")
    prefetch = cgutils.get_or_insert_function(
        module, ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]), "llvm.prefetch"
    )
    zero = ir.Constant(_V8F, None)
    mask_row = builder.gep(mask_a.data, [mstart])
    table = builder.gep(lut_a.data, [_const(0 if value_bytes == 4 else 256 * 32)])
    chosen = builder.select(builder.icmp_signed("!=", use_front, _const(0)), front_a.data, vals_a.data)
    value_base = builder.bitcast(chosen, _I8.as_pointer())
    x_rows = [builder.gep(x_a.data, [builder.add(xoff, builder.mul(xstride, _const(t)))]) for t in range(tokens)]
    groups = 8 // tokens  # 8 independent accumulator chains in all

    def value_ptr(k):
        return builder.gep(value_base, [builder.mul(k, _const(value_bytes))])

    def step(byte_index, m, high_ptr, accs):
        """Accumulate mask byte ``m`` (i64) at ``byte_index``, whose bits 4-7 have their values from ``high_ptr``."""
        ctrl = builder.gep(table, [builder.shl(m, _const(5))])
        ctrl = builder.load(builder.bitcast(ctrl, _V32B.as_pointer()), align=1)
        raw = builder.load(builder.bitcast(builder.gep(high_ptr, [_const(-16)]), _V32B.as_pointer()), align=1)
        spread_v = builder.bitcast(builder.call(pshufb, [raw, ctrl]), _V8F)
        column = builder.shl(byte_index, _const(3))
        out = []
        for t, acc in enumerate(accs):
            xv = builder.load(builder.bitcast(builder.gep(x_rows[t], [column]), _V8F.as_pointer()), align=4)
            out.append(builder.call(fma, [spread_v, xv, acc]))
        return out

    function, entry = builder.function, builder.block
    n_main = builder.and_(nbytes, _const(-8))
    head = function.append_basic_block("sparse.head")
    body = function.append_basic_block("sparse.body")
    tail_head = function.append_basic_block("sparse.tail_head")
    tail_body = function.append_basic_block("sparse.tail_body")
    done = function.append_basic_block("sparse.done")
    builder.branch(head)

    builder.position_at_end(head)  # whole 64-bit words of the mask
    j, k = builder.phi(_I64), builder.phi(_I64)
    accs = [[builder.phi(_V8F) for _ in range(tokens)] for _ in range(groups)]
    j.add_incoming(_const(0), entry)
    k.add_incoming(k0, entry)
    for group in accs:
        for acc in group:
            acc.add_incoming(zero, entry)
    builder.cbranch(builder.icmp_signed("<", j, n_main), body, tail_head)

    builder.position_at_end(body)
    new_accs = [list(group) for group in accs]
    word = builder.load(builder.bitcast(builder.gep(mask_row, [j]), _I64.as_pointer()), align=1)
    word_ptr = value_ptr(k)
    for line in range(_PREFETCH_LINES):
        ahead = builder.gep(word_ptr, [_const(_PREFETCH_BYTES + 64 * line)])
        builder.call(prefetch, [ahead, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
    for u in range(8):
        m = builder.zext(builder.load(builder.gep(mask_row, [builder.add(j, _const(u))])), _I64)  # not a shift
        before = builder.call(ctpop, [builder.shl(word, _const(60 - 8 * u))])  # set bits below bit 8u + 4
        high_ptr = builder.gep(word_ptr, [builder.mul(before, _const(value_bytes))])
        new_accs[u % groups] = step(builder.add(j, _const(u)), m, high_ptr, new_accs[u % groups])
    j.add_incoming(builder.add(j, _const(8)), body)
    k.add_incoming(builder.add(k, builder.call(ctpop, [word])), body)
    for group, new_group in zip(accs, new_accs, strict=True):
        for acc, new in zip(group, new_group, strict=True):
            acc.add_incoming(new, body)
    builder.branch(head)

    builder.position_at_end(tail_head)  # the last bytes, one at a time, into the first accumulator group
    tj, tk = builder.phi(_I64), builder.phi(_I64)
    taccs = [builder.phi(_V8F) for _ in range(tokens)]
    tj.add_incoming(j, head)
    tk.add_incoming(k, head)
    for tacc, acc in zip(taccs, accs[0], strict=True):
        tacc.add_incoming(acc, head)
    builder.cbranch(builder.icmp_signed("<", tj, nbytes), tail_body, done)

    builder.position_at_end(tail_body)
    m = builder.zext(builder.load(builder.gep(mask_row, [tj])), _I64)
    high_ptr = value_ptr(builder.add(tk, builder.call(ctpop, [builder.and_(m, _const(15))])))
    new_taccs = step(tj, m, high_ptr, taccs)
    tj.add_incoming(builder.add(tj, _const(1)), tail_body)
    tk.add_incoming(builder.add(tk, builder.call(ctpop, [m])), tail_body)
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
    def row_dot(typingctx, mask, vals, front, x, lut, use_front, mstart, k0, nbytes, xoff, xstride):
        sig = types.UniTuple(types.float32, tokens)(mask, vals, front, x, lut, *([types.int64] * 6))

        def codegen(context, builder, signature, args):
            return _emit_row(context, builder, signature, args, tokens)

        return sig, codegen

    return row_dot


_row1, _row2, _row4 = _row_intrinsic(1), _row_intrinsic(2), _row_intrinsic(4)


@nb.njit(cache=True)
def _front_values(row_ptr, values):  # pragma: no cover - compiled
    """``(head, front)``: the rows ``r < head`` start within the first ``_FRONT`` values, before which the avx2
    kernel would read; ``front`` holds their values (and the 8 after them) behind ``_FRONT`` zeros, so that row
    ``r < head`` runs on ``front`` from ``row_ptr[r] + _FRONT``."""
    rows, head = row_ptr.shape[0] - 1, 0
    while head < rows and row_ptr[head] < _FRONT:
        head += 1
    end = row_ptr[head] + 8
    front = np.zeros(_FRONT + end, dtype=values.dtype)
    front[_FRONT:] = values[:end]
    return head, front


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
    """Row ``r`` of ``out [batch, rows]``: the lanes of the avx2 kernel, one accumulator each, multiply then add."""
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
        lut = LANE_TABLE
        batch, nbytes, width = out.shape[0], mask.shape[1], x.shape[1]
        head, front = _front_values(row_ptr, values)
        for r in nb.prange(out.shape[1]):
            if kernel != "avx2":
                _portable_row(mask, row_ptr, values, x, out, r)
                continue
            # row r, 4 tokens at a time, then 2, then 1; a row starting within the first _FRONT values runs on front
            use_front = np.int64(r < head)
            mstart, k0 = r * nbytes, row_ptr[r] + use_front * _FRONT
            t = 0
            while t + 4 <= batch:
                s0, s1, s2, s3 = _row4(mask, values, front, x, lut, use_front, mstart, k0, nbytes, t * width, width)
                out[t, r] = s0
                out[t + 1, r] = s1
                out[t + 2, r] = s2
                out[t + 3, r] = s3
                t += 4
            if t + 2 <= batch:
                s0, s1 = _row2(mask, values, front, x, lut, use_front, mstart, k0, nbytes, t * width, width)
                out[t, r] = s0
                out[t + 1, r] = s1
                t += 2
            if t < batch:
                (s0,) = _row1(mask, values, front, x, lut, use_front, mstart, k0, nbytes, t * width, width)
                out[t, r] = s0

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
    bitmask, values = np.ascontiguousarray(bitmask), np.ascontiguousarray(values)
    return run_spmm(kernel, threads, bitmask, row_ptr, values, pad_inputs(x, nbytes))


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
