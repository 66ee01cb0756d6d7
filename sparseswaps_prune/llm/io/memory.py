"""Resident host memory of this process, now and at its peak (:class:`MemoryProbe`), for the block-wise path's
report and the benchmarks."""

from __future__ import annotations

import resource
import sys

__all__ = ["MemoryProbe"]


def _status_bytes(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class MemoryProbe:
    """Resident host memory of this process: now, and its peak since the probe was made.

    On Linux the peak (``VmHWM``) is reset when the probe is made (``/proc/self/clear_refs``), so it covers only
    what follows; where that fails the peak is the process's lifetime peak (``getrusage``), and :attr:`since`
    says ``"process"``.
    """

    def __init__(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.since = "call" if _status_bytes("VmHWM") is not None else "process"
        except OSError:
            self.since = "process"
        self.start = self.rss()

    @staticmethod
    def rss() -> int:
        """Resident set size now, in bytes."""
        now = _status_bytes("VmRSS")
        if now is not None:
            return now
        try:
            import psutil

            return int(psutil.Process().memory_info().rss)
        except ImportError:
            return MemoryProbe.peak()

    @staticmethod
    def peak() -> int:
        """Peak resident set size in bytes (since the last reset, see the class docstring)."""
        peak = _status_bytes("VmHWM")
        if peak is not None:
            return peak
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return maxrss if sys.platform == "darwin" else maxrss * 1024
