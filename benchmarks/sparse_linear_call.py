"""Per-call cost of ``SparseLinear.forward`` at one token, this tree's against other versions of
``sparseswaps_prune/deploy/linear.py``, one thread, float32.

    git show REV:sparseswaps_prune/deploy/linear.py > /tmp/linear_old.py
    python benchmarks/sparse_linear_call.py --baseline /tmp/linear_old.py      # seconds
    python benchmarks/sparse_linear_call.py --quick                            # for the tests

Decoding calls every pruned linear once per token: the default model's are 576 x 576, 192 x 576, 1536 x 576 and
576 x 1536 (210 calls per token), where Python's cost per call is a visible share of the kernel's time. For each
shape (and a 16 x 64 layer, where the kernel's time is almost nothing), with and without a bias, the script times
loops of ``--calls`` one-token calls of: the kernel alone (``kernels.run_spmm`` on the layer's arrays), this tree's
``SparseLinear`` and each ``--baseline`` file's, interleaved (kernel, current, baselines, kernel, ...), and prints
the median microseconds per call over ``--repeats`` loops; ``cost`` is a module's time minus the kernel's: what the
module adds around the kernel. Each ``--baseline`` file is imported as a module of its own (it imports the rest of
the package from this tree); its outputs are checked equal to this tree's.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # before torch and numba start their thread pools

import argparse
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numba
import torch
from common import import_file, median_seconds
from torch import nn

from sparseswaps_prune.deploy import kernels
from sparseswaps_prune.deploy.bench import machine_line
from sparseswaps_prune.deploy.linear import SparseLinear

FULL = {"shapes": [(16, 64), (576, 576), (192, 576), (1536, 576), (576, 1536)], "calls": 200, "repeats": 15}
QUICK = {"shapes": [(16, 64)], "calls": 5, "repeats": 2}
SPARSITY = 0.6


def load_linear(path: str) -> ModuleType:
    """The ``linear`` module in file ``path``, imported under a name of its own (``linear_<stem>``)."""
    return import_file(path, f"linear_{Path(path).stem}")


def loop_medians(fns: list[Callable[[], object]], calls: int, repeats: int) -> list[float]:
    """Median seconds per call of each of ``fns``, timed as loops of ``calls`` calls, the loops interleaved."""
    loops = [lambda fn=fn: [fn() for _ in range(calls)] for fn in fns]
    return [seconds / calls for seconds in median_seconds(loops, repeats)]


def run(setting: dict, baselines: list[str]) -> None:
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    modules = [("current", SparseLinear)] + [(Path(p).stem, load_linear(p).SparseLinear) for p in baselines]
    print("machine:", machine_line())
    print(
        f"kernel: {kernels.default_kernel()}; one token, {SPARSITY:.0%} sparsity, median us per call over "
        f"{setting['repeats']} loops of {setting['calls']} calls; cost = module - kernel"
    )
    header = f"{'shape':>10} {'bias':>4} {'kernel':>7}"
    print(header + "".join(f" {name[:14]:>14} {'cost':>6}" for name, _ in modules))
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for d_out, d_in in setting["shapes"]:
            for bias in (False, True):
                dense = nn.Linear(d_in, d_out, bias=bias)
                dense.weight.mul_(torch.rand(d_out, d_in, generator=gen) >= SPARSITY)
                layers = [cls.from_linear(dense) for _, cls in modules]
                x = torch.randn(1, 1, d_in, generator=gen)
                expected = layers[0](x)
                for (name, _), layer in zip(modules[1:], layers[1:], strict=True):
                    if not torch.equal(layer(x), expected):
                        raise RuntimeError(f"{name}'s SparseLinear gives other outputs than this tree's")
                encoded = layers[0]
                arrays = (encoded.bitmask.numpy(), encoded.row_ptr.numpy(), encoded.values.numpy())
                xs = kernels.pad_inputs(x.reshape(1, -1).numpy(), arrays[0].shape[1])
                kernel = kernels.default_kernel()
                calls = [lambda: kernels.run_spmm(kernel, 1, *arrays, xs)]  # noqa: B023
                calls += [lambda m=layer: m(x) for layer in layers]  # noqa: B023
                seconds = loop_medians(calls, setting["calls"], setting["repeats"])
                us = [s * 1e6 for s in seconds]
                line = f"{d_out:>4}x{d_in:<5} {'yes' if bias else 'no':>4} {us[0]:>7.1f}"
                print(line + "".join(f" {t:>14.1f} {t - us[0]:>6.1f}" for t in us[1:]))
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", action="append", default=[], help="another linear.py to time (repeatable)")
    parser.add_argument("--quick", action="store_true", help="one small shape, few calls")
    args = parser.parse_args(argv)
    for path in args.baseline:
        if not Path(path).is_file():
            raise SystemExit(f"--baseline {path!r}: no such file (write one with `git show REV:path > FILE`)")
    run(dict(QUICK if args.quick else FULL), args.baseline)


if __name__ == "__main__":
    main()
