"""Where the time of the re-fit objective's Triton engine goes: ``torch.profiler`` over 3 iterations of its row scope
(``refit_lazy_triton.TritonRefitState``: the swaps of the rows whose best swap lowers the loss -- pending rank-one
terms, its moves and scan terms in Triton kernels -- then their scan), or with ``--build`` over 2 builds of the
state (``refit_state.build_state``: the Cholesky factor, ``H``, ``v``, ``Z``), on ``common.random_layer``
(``--pattern``: 60% or 2:4, ``--width`` inputs, ``--rows`` rows in one batch), after one warm-up; prints the
operators by device time. Iterations on CUDA (on the CPU only in the Triton interpreter, for testing); ``--build``
also on the CPU (``--device cpu``). ``--engine mask``: the mask objective's iterations (``refine.MaskRows`` with the
Triton search, N:M's search at 2:4) instead, for comparison.

``--count``: instead of profiling, count what the iterations ask of the device, per iteration: torch operators that
run a kernel (views and allocations excluded; on the CPU a copy between host and device is not an operator, so
transfers are not counted), Triton kernel launches, and synchronisations with the host (reads of a value such as
``item``, ``nonzero``, indexing by a boolean mask; not ``tolist``, which bypasses the operators). The counts are
the device's on CUDA too (iterations without a fold of the lazy state's terms: it folds every 32 swaps), but for the
transfers; on the CPU they need the Triton interpreter (``TRITON_INTERPRET=1``). An iteration is
``refine.iterate``'s: the rows whose best swap lowers the loss chosen on the host from the figures copied there (not
counted), their slots copied to the device, their swaps and their scan, whose figures go back to the host (one
transfer each way, counted as operators on CUDA only).

    python benchmarks/refit_iteration_profile.py [--width 4096] [--rows 256] [--build | --engine mask] [--count]
        [--pattern 60%|2:4] [--device cuda]   # --engine: triton (default), mask
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections import Counter

import torch
from common import iterate_step, pattern_options, triton_refit_layer
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from sparseswaps_prune.core import refit_swaps as rs
from sparseswaps_prune.core.refine import Figures, MaskRows
from sparseswaps_prune.core.refit import damping

# torch operators that launch no kernel: allocations without a fill
_ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh"}


def _masked(name: str, args: tuple) -> bool:
    """An indexing operator with a boolean mask (``t[mask]``: on CUDA it waits for the mask's count)."""
    if name not in ("index", "index_put", "index_put_"):
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)


class DeviceOps(TorchDispatchMode):
    """Counts the torch operators that run a kernel, the Triton launches (their own operators not counted) and the
    synchronisations with the host (a read of a value, ``nonzero``, indexing by a boolean mask), while active."""

    def __init__(self) -> None:
        super().__init__()
        self.operators: Counter[str] = Counter()
        self.launches: Counter[str] = Counter()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense" or name == "nonzero" or _masked(name, args):
            self.syncs += 1
        if name != "_local_scalar_dense" and not func.is_view and name not in _ALLOCATIONS:
            self.operators[name] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        import triton

        self.kernel_class = type(triton.jit(lambda: None))  # JITFunction, or the interpreter's InterpretedFunction
        run = self.original_run = self.kernel_class.run
        counter = self

        def counted(kernel, *args, **kwargs):
            counter.launches[kernel.__name__] += 1
            with _disable_current_modes():  # the interpreter's own copies are not the kernel's launches
                return run(kernel, *args, **kwargs)

        self.kernel_class.run = counted
        return super().__enter__()

    def __exit__(self, *exc):
        self.kernel_class.run = self.original_run
        return super().__exit__(*exc)

    @staticmethod
    def paused() -> contextlib.AbstractContextManager:
        """A context in which nothing is counted (the host's own work)."""
        return _disable_current_modes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--build", action="store_true", help="profile the state's build instead of iterations")
    parser.add_argument("--engine", default="triton", choices=["triton", "mask"])
    parser.add_argument("--count", action="store_true", help="count device operations per iteration instead")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--pattern", default="60%", choices=["60%", "2:4"])
    args = parser.parse_args()
    if args.device == "cpu" and not args.build and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("iterations run the Triton kernels: CUDA only (--build profiles on the CPU)")
    if args.build and args.count:
        parser.error("--count counts iterations, not builds")
    cuda = args.device == "cuda"
    weight, gram, keep, state, _, _ = triton_refit_layer(args.width, args.rows, args.pattern, args.device)
    rows = torch.arange(args.rows, device=args.device)
    lam, (k, q) = damping(gram, 0.01), state.slots
    counter = DeviceOps() if args.count else None
    if args.build:
        del state  # the profiled builds need the memory

        def step() -> None:
            rs.build_state(weight, keep, gram, lam, k, q)

        repeat = 2
    else:
        keep = keep.clone()  # the row model's mask (the state's build read the original)
        if args.engine == "mask":  # the mask objective's row model with the Triton search, for comparison
            del state
            nm = pattern_options(args.pattern)["nm"]  # N:M: the N:M search (refine's choice for any backend)
            search = "nm" if nm else "triton"
            model = MaskRows(weight, keep, gram, gram.float(), search=search, nm=nm, row_batch=args.rows)

            def figures_of(rows: torch.Tensor) -> Figures:
                return model.figures(rows, cross=False)

            apply = model.apply
        else:

            def figures_of(rows: torch.Tensor) -> Figures:
                return Figures.on_host(list(state.scan(rows)))

            def apply(moves: tuple[torch.Tensor, ...]) -> None:  # as RefitRows.apply
                u, p = state.swap(*moves)
                keep[moves[0], u] = False
                keep[moves[0], p] = True

        figures = figures_of(rows)
        host = counter.paused if counter else contextlib.nullcontext

        def step() -> None:  # as refine.iterate
            iterate_step(apply, figures_of, figures, args.device, host)

        repeat = 3
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step()
    sync()
    name = torch.cuda.get_device_name() if cuda else "CPU"
    what = f"{repeat} builds" if args.build else f"{repeat} iterations of the {args.engine} engine"
    print(f"{name}, torch {torch.__version__}, {args.width} inputs, {args.rows} rows, {args.pattern}, {what}")
    if counter:
        with counter as ops:
            for _ in range(repeat):
                step()
        per = {"torch operators": ops.operators, "Triton launches": ops.launches}
        for label, counts in per.items():
            listed = ", ".join(f"{op} {n / repeat:g}" for op, n in counts.most_common())
            print(f"{label} per iteration: {sum(counts.values()) / repeat:g} ({listed})")
        print(f"synchronisations per iteration: {ops.syncs / repeat:g}")
        return
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda
    with profile(activities=activities) as prof:
        for _ in range(repeat):
            step()
        sync()
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    main()
