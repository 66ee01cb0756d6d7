"""Issue 47, item 4: a damaged source checkpoint is found when it is opened, before any block is pruned or committed,
and named in one line (``ValueError``; the CLI exits 2): a safetensors shard cut short or cut inside its header, a
header whose JSON or dtype was changed, a broken index, a truncated GGUF; and ``load_model`` (the in-memory path) on
the same files."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from sparseswaps_prune.cli import main
from sparseswaps_prune.core.spec import build_spec
from sparseswaps_prune.llm import pipeline
from sparseswaps_prune.llm.io import readers
from sparseswaps_prune.llm.io.formats import read_safetensors_header
from sparseswaps_prune.llm.io.readers import SafetensorsCheckpoint
from sparseswaps_prune.llm.job import STATE_DIR
from sparseswaps_prune.llm.models import load_model, tiny_model
from sparseswaps_prune.llm.pipeline import PruneOptions
from sparseswaps_prune.llm.streaming import prune_checkpoint
from sparseswaps_prune.recipes import RECIPES

SHARD = "1MB"  # the embeddings get shards of their own, the 3 blocks share the last one
LAST_BLOCK = "model.layers.2.mlp.down_proj.weight"  # read last by the stream: found late before issue 47
OPTIONS = PruneOptions(spec=build_spec(RECIPES["sparseswaps-refit"].spec, max_iters=1), block_tune_epochs=0)


def header_of(path: Path) -> tuple[int, bytes]:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return length, data


def shard_of(source: Path, key: str) -> Path:
    return source / json.loads((source / "model.safetensors.index.json").read_text())["weight_map"][key]


def replace_in_header(path: Path, key: str, old: str, new: str) -> None:
    """Replace ``old`` by ``new`` (of the same length) in tensor ``key``'s entry of the header of ``path``."""
    length, data = header_of(path)
    header = data[8 : 8 + length].decode()
    start = header.index(f'"{key}"')
    at = header.index(old, start)
    assert len(old) == len(new)
    header = header[:at] + new + header[at + len(old) :]
    path.write_bytes(data[:8] + header.encode() + data[8 + length :])


def cut_short(source: Path) -> str:
    path = shard_of(source, LAST_BLOCK)
    path.write_bytes(path.read_bytes()[:-100])
    return rf"{path.name} is not a valid safetensors file: its header ends the tensors at byte \d+, but the file " \
        r"has \d+ \(cut short\?\)"  # fmt: skip


def cut_in_header(source: Path) -> str:
    path = shard_of(source, LAST_BLOCK)
    length, data = header_of(path)
    path.write_bytes(data[: 8 + length // 2])
    return rf"{path.name} is not a valid safetensors file: its header claims {length} bytes, but only \d+ follow"


def json_broken(source: Path) -> str:
    path = shard_of(source, LAST_BLOCK)
    replace_in_header(path, LAST_BLOCK, '"dtype"', '"dtype ')  # same length: the string is no longer closed
    return rf"{path.name} is not a valid safetensors file: its JSON header does not parse \(.*"


def dtype_half(source: Path) -> str:
    replace_in_header(shard_of(source, LAST_BLOCK), LAST_BLOCK, '"F32"', '"F16"')
    return rf"tensor {LAST_BLOCK} \(F16, shape \[64, 128\]\) takes 16384 bytes, but its data_offsets .* span 32768"


def dtype_int(source: Path) -> str:
    path = shard_of(source, LAST_BLOCK)
    replace_in_header(path, LAST_BLOCK, '"F32"', '"I32"')  # same size: only the model's expectation tells
    return rf"{path.name}: tensor {LAST_BLOCK} is stored as I32, but the model's {LAST_BLOCK} is float32 and needs a " \
        "floating-point dtype"  # fmt: skip


def dtype_unknown(source: Path) -> str:
    replace_in_header(shard_of(source, LAST_BLOCK), LAST_BLOCK, '"F32"', '"Q32"')
    return rf"tensor {LAST_BLOCK} has dtype 'Q32', not one of BOOL, "


def offsets_overlap(source: Path) -> str:
    path = shard_of(source, LAST_BLOCK)
    length, data = header_of(path)
    header = json.loads(data[8 : 8 + length])
    begin, end = header[LAST_BLOCK]["data_offsets"]
    header[LAST_BLOCK]["data_offsets"] = [begin - 4, end - 4]  # its size is right, its place overlaps another's
    raw = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])
    return rf"tensor {LAST_BLOCK} \(data_offsets \[{begin - 4}, {end - 4}\]\) overlaps the tensor before it"


def index_broken(source: Path) -> str:
    index = source / "model.safetensors.index.json"
    index.write_text(index.read_text()[:50])
    return r"model\.safetensors\.index\.json is not a valid safetensors index"


def index_outside(source: Path) -> str:
    index = source / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"][LAST_BLOCK] = "../elsewhere.safetensors"
    index.write_text(json.dumps(data))
    return rf"maps tensor {LAST_BLOCK} to '../elsewhere.safetensors', not a file name in"


DAMAGES = [cut_short, cut_in_header, json_broken, dtype_half, dtype_int, dtype_unknown, offsets_overlap,
           index_broken, index_outside]  # fmt: skip


@pytest.fixture(scope="module")
def clean_source(tmp_path_factory):
    source = tmp_path_factory.mktemp("clean") / "src"
    tiny_model("llama", num_hidden_layers=3).save_pretrained(source, max_shard_size=SHARD)
    assert len(list(source.glob("*.safetensors"))) > 1
    return source


@pytest.fixture
def source(clean_source, tmp_path):
    shutil.copytree(clean_source, tmp_path / "src")
    return tmp_path / "src"


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_source_is_refused_when_opened_before_any_block(source, tmp_path, monkeypatch, damage):
    """``prune_checkpoint`` with a checkpoint directory: refused before the first block, nothing written."""
    match = damage(source)
    blocks = []
    monkeypatch.setattr(pipeline, "_process_block", lambda *a, **k: blocks.append(a[1]) or pytest.fail("pruned"))
    with pytest.raises(ValueError, match=match) as err:
        prune_checkpoint(source, tmp_path / "out", torch.randint(3, 3000, (2, 12)), OPTIONS, progress=False,
                         max_shard_size=SHARD, checkpoint_dir=tmp_path / "ckpt")  # fmt: skip
    assert "\n" not in str(err.value) and blocks == []
    assert not (tmp_path / "out").exists() and not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("damage", DAMAGES)
def test_load_model_names_the_damaged_file(source, damage):
    """The in-memory path: ``load_model`` checks the same before ``from_pretrained`` (which raised safetensors'
    ``SafetensorError`` without the file's name, or loaded integer bits as weights)."""
    match = damage(source)
    with pytest.raises(ValueError, match=match) as err:
        load_model(str(source))
    assert "\n" not in str(err.value)


def test_a_sound_source_passes_every_check(clean_source):
    reader = SafetensorsCheckpoint(clean_source)
    assert LAST_BLOCK in reader.shapes and reader.shapes[LAST_BLOCK] == ("F32", [64, 128])
    for path in set(reader.files.values()):
        assert read_safetensors_header(path)["__metadata__"] == {"format": "pt"}
    empty = clean_source.parent / "empty.safetensors"  # no tensors: an 8-byte length and "{}"
    empty.write_bytes(struct.pack("<Q", 2) + b"{}")
    assert read_safetensors_header(empty) == {}


def test_reading_a_file_changed_after_it_was_opened_names_it(source):
    """A shard damaged between the open and the read (the checks cannot see it): still one line naming it."""
    reader = SafetensorsCheckpoint(source)
    path = shard_of(source, LAST_BLOCK)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"{path.name}: cannot read tensor\(s\) \['{LAST_BLOCK}'\]"):
        reader.read([LAST_BLOCK])


@pytest.mark.parametrize("blockwise", [True, False])
def test_cli_prints_one_line_and_exits_2(source, tmp_path, capsys, tiny_tokenizer, blockwise):
    """``sparseswaps prune`` on a shard cut short: ``sparseswaps: error: ...`` naming the file, exit 2, no block
    committed (before issue 47: a SafetensorError traceback, exit 1, after 3 blocks with --blockwise)."""
    tiny_tokenizer.save_pretrained(source)
    cut_short(source)
    out = tmp_path / "out"
    mode = ["--blockwise"] if blockwise else ["--eval", "none"]
    args = ["prune", "--model", str(source), *mode, "--nsamples", "2", "--seqlen", "16", "--holdout", "0",
            "--recipe", "sparseswaps-refit", "--max-iters", "1", "--quiet", "--out", str(out)]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("sparseswaps:")]
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("sparseswaps: error: ") and shard_of(source, LAST_BLOCK).name in lines[0]
    assert "cut short" in lines[0]
    assert not (out / STATE_DIR / "progress.json").exists()


def test_a_truncated_gguf_is_named(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((64, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ValueError, match=r"tiny\.gguf is not a valid GGUF file .*re-download"):
        readers.GGUFCheckpoint(path)
