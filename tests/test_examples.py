"""The examples run offline on CPU with tiny settings (in-process via runpy, as ``python examples/X.py``)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / name), *args])
    try:
        runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    except SystemExit as exc:  # argparse errors exit non-zero
        assert exc.code in (0, None), f"{name} exited with {exc.code}"


def test_torch_prune_api(monkeypatch, capsys):
    run_example("torch_prune_api.py", ["--samples", "128", "--width", "32", "--max-iters", "20"], monkeypatch)
    out = capsys.readouterr().out
    assert "final loss" in out and "after prune.remove:" in out


@pytest.mark.parametrize(
    "recipe",
    [[], ["--recipe", "sparseswaps-refit", "--max-iters", "5"], ["--recipe", "sparseswaps", "--max-iters", "5"]],
    ids=["default", "sparseswaps-refit", "sparseswaps"],
)
def test_prune_hf_model(monkeypatch, capsys, tmp_path, recipe):
    args = ["--out", str(tmp_path / "out"), *recipe, "--nsamples", "2", "--seqlen", "32"]
    run_example("prune_hf_model.py", [*args, "--eval-windows", "2"], monkeypatch)
    out = capsys.readouterr().out
    assert "summed layer loss (calibration): start" in out and "perplexity: dense" in out
    assert (tmp_path / "out" / "report.json").exists()


def test_lightning_prune(monkeypatch, capsys):
    run_example("lightning_prune.py", ["--steps", "3", "--calibration-batches", "1", "--seqlen", "16"], monkeypatch)
    out = capsys.readouterr().out
    assert "final MLP sparsity: 50.0%" in out and "LM loss: dense" in out


def test_lightning_prune_finetune(monkeypatch, capsys):
    args = ["--tiny", "--steps", "2", "--nsamples", "8", "--seqlen", "32", "--calibration-batches", "1"]
    run_example(
        "lightning_prune_finetune.py",
        [*args, "--max-iters", "2", "--eval-windows", "2", "--batch-size", "2"],
        monkeypatch,
    )
    out = capsys.readouterr().out
    assert "final sparsity of the pruned layers: 50.00% (zeros exactly the pruning masks: True)" in out
    assert "perplexity: dense" in out and "| fine-tuned" in out
