"""Atomic file writes: a temporary file in the target's directory, fsynced, then renamed over the target."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], None]) -> None:
    """Call ``write(f)`` on a temporary binary file next to ``path``, then ``os.replace`` it onto ``path``.

    An interrupted write never leaves a truncated ``path``: either the old file or the complete new one. The
    directory is fsynced after the rename, so a completed write also survives a power loss.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (POSIX); a no-op where directories cannot be opened (Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_torch(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)``, atomically."""
    atomic_write(path, lambda f: torch.save(obj, f))


def save_text(text: str, path: str | os.PathLike[str]) -> None:
    """Write ``text`` (UTF-8) to ``path``, atomically."""
    atomic_write(path, lambda f: f.write(text.encode()))


def save_json(obj: Any, path: str | os.PathLike[str]) -> None:
    """Write ``obj`` as indented JSON to ``path``, atomically."""
    save_text(json.dumps(obj, indent=2) + "\n", path)
