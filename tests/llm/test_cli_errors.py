"""Bad input at the door (issue 18, item 7): one-line errors from ``sparseswaps``, raised before the model loads
where they can be, and always before anything is written in ``--out``; the same checks in the library."""

from __future__ import annotations

import errno
import os
import tempfile

import pytest
import torch

from sparseswaps_prune import refine_mask, refit_weights, warmstart_mask
from sparseswaps_prune.cli import main
from sparseswaps_prune.core.checks import check_device
from sparseswaps_prune.llm import models
from sparseswaps_prune.llm.models import tiny_model
from sparseswaps_prune.llm.pipeline import PruneOptions, check_layers, prune_model
from tests.llm.helpers import one_line_error

BAD_UTF8 = b"calibration text, then Latin-1: caf\xe9 na\xefve \xff\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer):
    """A tiny random llama (hidden 32, 2 blocks, context 512) with the packaged tokenizer, saved once."""
    path = tmp_path_factory.mktemp("model") / "tiny"
    tiny_model(
        "llama", hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1
    ).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("files")
    (root / "latin1.txt").write_bytes(BAD_UTF8)
    (root / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    (root / "notes.md").write_text("text", encoding="utf-8")
    (root / "short.txt").write_text("Too short.", encoding="utf-8")
    (root / "a_file").write_text("not a directory", encoding="utf-8")
    return root


def prune_args(model_dir, out, *flags: str) -> list[str]:
    return ["prune", "--model", str(model_dir), "--nsamples", "2", "--seqlen", "16", "--holdout", "1",
            "--eval-windows", "1", "--recipe", "sparseswaps", "--max-iters", "1", "--quiet", "--out", str(out),
            *flags]  # fmt: skip


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if the model is loaded."""

    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(models, "load_model", load_model)


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (["--device", "tpu9"], ["'tpu9' is not a device"]),
        (["--device", "meta"], ["'meta' holds no data"]),
        (["--device", "cuda:99"], ["'cuda:99' requested but"]),
        (["--eps", "-1"], ["eps must be >= 0"]),
        (["--max-iters", "-2"], ["max_iters"]),
        (["--nsamples", "0"], ["nsamples must be a positive int"]),
        (["--seqlen", "1"], ["seqlen must be at least 2"]),
        (["--eval-windows", "0"], ["eval_windows must be a positive int"]),
        (
            ["--calib", "{files}/latin1.txt"],
            ["calibration source", "latin1.txt is not UTF-8", "0xe9 at offset 35", "iconv -f latin1 -t utf-8"],
        ),
        (["--calib", "{files}/latin1.jsonl"], ["latin1.jsonl is not UTF-8", "iconv"]),
        (["--eval", "{files}/latin1.txt"], ["evaluation source", "latin1.txt is not UTF-8"]),
        (["--calib", "{files}/missing.txt"], ["missing.txt", "neither one of"]),
        (["--eval", "{files}/notes.md"], ["Unsupported file type 'notes.md'"]),
    ],
)
def test_bad_options_fail_before_the_model_loads(model_dir, files, tmp_path, capsys, no_model_load, flags, needles):
    out = tmp_path / "out"
    flags = [flag.format(files=files) for flag in flags]
    assert main(prune_args(model_dir, out, *flags)) == 2
    one_line_error(capsys, *needles)
    assert not out.exists()


@pytest.mark.parametrize(
    ("out", "needles"),
    [("a_file", ["output directory", "a_file is a file"]), ("a_file/sub", ["cannot create", "a_file is a file"])],
)
def test_out_naming_a_file_fails_before_the_model_loads(model_dir, files, capsys, no_model_load, out, needles):
    assert main(prune_args(model_dir, files / out)) == 2
    one_line_error(capsys, *needles)
    assert (files / "a_file").read_text(encoding="utf-8") == "not a directory"


def read_only(monkeypatch, directory) -> None:
    """Make creating files in ``directory`` fail as on a read-only mount (root ignores chmod, so tests simulate it)."""
    original = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):
        if dir is not None and os.path.realpath(dir) == os.path.realpath(directory):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dir))
        return original(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)


@pytest.mark.parametrize("exists", [True, False])
def test_unwritable_out_fails_before_the_model_loads(model_dir, tmp_path, monkeypatch, capsys, no_model_load, exists):
    out = tmp_path / "out"
    if exists:
        out.mkdir()
    read_only(monkeypatch, out if exists else tmp_path)  # without --out, its parent is where it would be created
    assert main(prune_args(model_dir, out)) == 2
    one_line_error(capsys, f"{out if exists else tmp_path} is not writable", "Read-only file system", "--out")
    assert list(out.iterdir()) == [] if exists else not out.exists()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes through chmod")
def test_chmod_read_only_out_fails_before_the_model_loads(model_dir, tmp_path, capsys, no_model_load):
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o555)
    try:
        assert main(prune_args(model_dir, out)) == 2
        one_line_error(capsys, "is not writable", "--out")
        assert list(out.iterdir()) == []
    finally:
        out.chmod(0o755)


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (["--nm", "3:5"], ["layer model.layers.0.self_attn.q_proj", "m=5 does not divide the input width d_in=32"]),
        (["--include", "*.nomatch*", "lm_head"], ["no linear layer of the decoder blocks matches include="]),
        (["--exclude", "*"], ["matches include=None exclude=['*']", "model.layers.0.self_attn.q_proj"]),
        (["--sparsity", "0.99"], ["sparsity=0.99 keeps none of the 32 weights of each row"]),
        (["--sparsity", "0.9999", "--scope", "layer"], ["keeps none of the 1024 weights of the layer"]),
        (["--seqlen", "1024"], ["seqlen=1024 exceeds the model's context of 512"]),
        (["--eval", "{files}/short.txt"], ["evaluation text", "short.txt", "fewer than seqlen=16"]),
        (["--calib", "{files}/short.txt"], ["fewer than seqlen=16"]),
    ],
)
def test_model_dependent_errors_leave_out_untouched(model_dir, files, tmp_path, capsys, flags, needles):
    """Checks that need the model (widths, context) or the tokenizer (token counts) run after it loads, but before
    ``--out`` (or its ``.sparseswaps_state``) is created."""
    out = tmp_path / "out"
    flags = [flag.format(files=files) for flag in flags]
    assert main(prune_args(model_dir, out, *flags)) == 2
    one_line_error(capsys, *needles)
    assert not out.exists()


def test_eval_command_checks_device_and_text_before_loading(model_dir, files, capsys, no_model_load):
    assert main(["eval", "--model", str(model_dir), "--device", "tpu9"]) == 2
    one_line_error(capsys, "--device 'tpu9' is not a device")
    assert main(["eval", "--model", str(model_dir), "--ppl", str(files / "latin1.txt")]) == 2
    one_line_error(capsys, "perplexity source", "not UTF-8")


def small_model():
    return tiny_model("llama", hidden_size=32, intermediate_size=64, vocab_size=256, num_attention_heads=2,
                      num_key_value_heads=1)  # fmt: skip


def test_include_matching_nothing_is_refused_before_the_model_changes():
    model = small_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.randint(3, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    for options in (PruneOptions(include=["*.q_prj"]), PruneOptions(exclude=["model.*"])):
        with pytest.raises(ValueError, match="no linear layer of the decoder blocks matches"):
            prune_model(model, tokens, options, progress=False)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert [layer.name for layer in check_layers(model, PruneOptions(include=["*.mlp.*"]))] == [
        f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")
    ]


@pytest.mark.parametrize(
    ("device", "error", "match"),
    [
        ("tpu9", ValueError, "'tpu9' is not a device torch knows"),
        ("meta", ValueError, "holds no data"),
        ("cuda:99", ValueError, "'cuda:99' requested but"),
        (1.5, TypeError, "device must be a str"),
    ],
)
def test_library_entry_points_check_the_device(device, error, match):
    weight = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    keep = warmstart_mask(weight, "magnitude", sparsity=0.5)
    with pytest.raises(error, match=match):
        check_device(device)
    with pytest.raises(error, match=match):
        refine_mask(weight, x.T @ x, keep, device=device)
    model = small_model()
    with pytest.raises(error, match=match):
        prune_model(model, torch.zeros(1, 4, dtype=torch.long), PruneOptions(), device=device, progress=False)
    assert not any(hasattr(m, "weight_mask") for m in model.modules())
    assert check_device("cpu") == torch.device("cpu") == check_device(torch.device("cpu"))


@pytest.mark.parametrize(("value", "error"), [(2.5, TypeError), (True, TypeError), ("2", TypeError), (0, ValueError)])
def test_row_batch_must_be_a_positive_int(value, error):
    weight = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    keep = warmstart_mask(weight, "magnitude", sparsity=0.5)
    with pytest.raises(error, match="row_batch must be a positive int"):
        refine_mask(weight, x.T @ x, keep, row_batch=value)
    with pytest.raises(error, match="row_batch must be a positive int"):
        refit_weights(weight, x.T @ x, keep, row_batch=value, ridge="mean")
