"""Test helpers shared by the LLM tests (imported as ``tests.llm.helpers``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from sparseswaps_prune.llm.io.readers import SafetensorsCheckpoint


@contextlib.contextmanager
def crash_on_call(
    module: ModuleType, name: str, number: int, error: type[BaseException] = KeyboardInterrupt
) -> Iterator[None]:
    """Within the ``with`` block, the ``number``-th call (1-based) of ``module.name`` raises ``error`` (a stand-in
    for a kill or Ctrl-C) and the calls before it run the original. The block must raise ``error``
    (``pytest.raises``); ``module.name`` is restored on exit."""
    original, calls = getattr(module, name), 0

    def crashing(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == number:
            raise error
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, name, crashing)
        with pytest.raises(error):
            yield


def saved_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors checkpoint saved in ``directory`` (one file or sharded with an index)."""
    reader = SafetensorsCheckpoint(directory)
    return reader.read(reader.files)


def one_line_error(capsys, *needles: str) -> str:
    """The CLI's error: exactly one ``sparseswaps:`` line on stderr, no traceback, containing every needle."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("sparseswaps:")]
    assert "Traceback" not in err and len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]
