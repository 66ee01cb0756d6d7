"""Tests of sparseswaps_prune.llm.data: the built-in corpus, calibration windows, local files and the
hub branches (with ``datasets.load_dataset`` monkeypatched, so no network)."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from sparseswaps_prune.llm.data import (
    C4_EVAL_DOCS,
    C4_REPO,
    C4_TRAIN_FILE,
    C4_VALIDATION_FILE,
    _tokenize,
    builtin_text,
    check_source,
    load_calibration,
    load_eval_tokens,
    stdlib_prose_text,
)

DOCS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Pruning removes weights from a network while keeping its accuracy.",
    "A swap exchanges one kept weight with one pruned weight in the same row.",
]


def _ids(tokenizer, text: str) -> torch.Tensor:
    return tokenizer(text, return_tensors="pt", verbose=False).input_ids


def _is_slice_of(window: torch.Tensor, stream: torch.Tensor) -> bool:
    """Whether the 1-D ``window`` occurs contiguously in the 1-D ``stream``."""
    return bool((stream.unfold(0, window.numel(), 1) == window).all(dim=1).any())


class _FakeLoadDataset:
    """Stand-in for ``datasets.load_dataset`` that records its calls and returns local data sets."""

    def __init__(self, texts: list[str]):
        self.texts = texts
        self.calls: list[tuple[tuple, dict]] = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return datasets.Dataset.from_dict({"text": self.texts})


# ---------------------------------------------------------------- built-in corpus


def test_builtin_split_is_deterministic_and_disjoint():
    calib, evaluation = builtin_text("calib"), builtin_text("eval")
    assert calib == builtin_text("calib") and evaluation == builtin_text("eval")
    assert 0.15 < len(evaluation) / (len(calib) + len(evaluation)) < 0.25
    calib_paragraphs = {p.strip() for p in calib.split("\n\n")}
    eval_paragraphs = {p.strip() for p in evaluation.split("\n\n")}
    assert not calib_paragraphs & eval_paragraphs
    long_eval = [p for p in eval_paragraphs if len(p) >= 100]
    assert len(long_eval) > 100
    assert not [p for p in long_eval if p in calib]


def test_builtin_text_rejects_unknown_split():
    with pytest.raises(ValueError, match="'test'"):
        builtin_text("test")


def test_stdlib_prose_is_english_text_the_builtin_corpus_does_not_hold(tiny_tokenizer):
    prose = stdlib_prose_text()
    assert prose == stdlib_prose_text() and 30_000 < len(prose) < 100_000
    assert "Integrated Development and Learning Environment" in prose and "Guido van Rossum" in prose
    assert "<" + "section" not in prose and "\u00b6" not in prose and "Previous topic" not in prose  # no navigation
    builtin = builtin_text("calib") + builtin_text("eval")
    paragraphs = [p for p in prose.split("\n\n") if len(p) >= 80]
    assert len(paragraphs) > 100 and not [p for p in paragraphs if p in builtin]
    check_source("stdlib-prose")
    assert torch.equal(load_eval_tokens("stdlib-prose", tiny_tokenizer), _ids(tiny_tokenizer, prose))
    windows = load_calibration("stdlib-prose", tiny_tokenizer, nsamples=3, seqlen=32, seed=0)
    assert windows.shape == (3, 32)


def test_stdlib_prose_missing_names_the_file(tmp_path, monkeypatch, tiny_tokenizer):
    import sysconfig

    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    with pytest.raises(FileNotFoundError, match=r"idlelib/help.html.*install it or evaluate on a local text file"):
        load_eval_tokens("stdlib-prose", tiny_tokenizer)


# ---------------------------------------------------------------- calibration windows


def test_builtin_calibration_windows(tiny_tokenizer):
    windows = load_calibration("builtin", tiny_tokenizer, nsamples=4, seqlen=64, seed=0)
    assert windows.shape == (4, 64) and windows.dtype == torch.long
    assert torch.equal(windows, load_calibration("builtin", tiny_tokenizer, nsamples=4, seqlen=64, seed=0))
    assert not torch.equal(windows, load_calibration("builtin", tiny_tokenizer, nsamples=4, seqlen=64, seed=1))
    stream = _ids(tiny_tokenizer, builtin_text("calib"))[0]
    assert all(_is_slice_of(w, stream) for w in windows)


@pytest.mark.parametrize(("nsamples", "seqlen"), [(0, 8), (2, 0), (-1, 8)])
def test_calibration_rejects_bad_sizes(tiny_tokenizer, nsamples, seqlen):
    with pytest.raises(ValueError, match="at least 1"):
        load_calibration("builtin", tiny_tokenizer, nsamples=nsamples, seqlen=seqlen)


def test_calibration_rejects_non_int_sizes(tiny_tokenizer):
    with pytest.raises(TypeError, match="seqlen"):
        load_calibration("builtin", tiny_tokenizer, nsamples=2, seqlen=8.0)


# ---------------------------------------------------------------- local files


def _write_sources(tmp_path: Path) -> dict[str, Path]:
    """Write DOCS as .txt, .jsonl, .json (array), .json (lines) and .parquet files."""
    paths = {
        "txt": tmp_path / "docs.txt",
        "jsonl": tmp_path / "docs.jsonl",
        "json": tmp_path / "docs.json",
        "json_lines": tmp_path / "lines.json",
        "parquet": tmp_path / "docs.parquet",
    }
    paths["txt"].write_text("\n\n".join(DOCS), encoding="utf-8")
    lines = "\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(DOCS)) + "\n\n"
    paths["jsonl"].write_text(lines, encoding="utf-8")
    paths["json_lines"].write_text(lines, encoding="utf-8")
    paths["json"].write_text(json.dumps([{"text": d} for d in DOCS]), encoding="utf-8")
    pq.write_table(pa.table({"text": DOCS, "id": list(range(len(DOCS)))}), paths["parquet"])
    return paths


@pytest.mark.parametrize("kind", ["txt", "jsonl", "json", "json_lines", "parquet"])
def test_local_file_eval_tokens(tmp_path, tiny_tokenizer, kind):
    path = _write_sources(tmp_path)[kind]
    tokens = load_eval_tokens(str(path), tiny_tokenizer)
    assert tokens.dtype == torch.long
    assert torch.equal(tokens, _ids(tiny_tokenizer, "\n\n".join(DOCS)))


def test_local_directory_is_read_in_sorted_order(tmp_path, tiny_tokenizer):
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": DOCS[1]}) + "\n", encoding="utf-8")
    (tmp_path / "a.txt").write_text(DOCS[0], encoding="utf-8")
    (tmp_path / "notes.md").write_text("ignored", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("ignored too", encoding="utf-8")
    tokens = load_eval_tokens(str(tmp_path), tiny_tokenizer)
    assert torch.equal(tokens, _ids(tiny_tokenizer, DOCS[0] + "\n\n" + DOCS[1]))


def test_local_calibration_windows_come_from_the_file(tmp_path, tiny_tokenizer):
    path = tmp_path / "docs.txt"
    path.write_text("\n\n".join(DOCS * 4), encoding="utf-8")
    windows = load_calibration(str(path), tiny_tokenizer, nsamples=6, seqlen=10, seed=3)
    assert windows.shape == (6, 10)
    stream = _ids(tiny_tokenizer, path.read_text(encoding="utf-8"))[0]
    assert all(_is_slice_of(w, stream) for w in windows)


def test_missing_path_raises_file_not_found(tmp_path, tiny_tokenizer):
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(FileNotFoundError, match=r"nope\.txt"):
        load_calibration(missing, tiny_tokenizer, nsamples=1, seqlen=4)
    with pytest.raises(FileNotFoundError, match=r"nope\.txt"):
        load_eval_tokens(missing, tiny_tokenizer)


def test_empty_file_raises(tmp_path, tiny_tokenizer):
    path = tmp_path / "empty.txt"
    path.write_text("  \n\n ", encoding="utf-8")
    with pytest.raises(ValueError, match="no text"):
        load_calibration(str(path), tiny_tokenizer, nsamples=1, seqlen=4)


def test_too_short_text_names_token_count(tmp_path, tiny_tokenizer):
    path = tmp_path / "short.txt"
    path.write_text(DOCS[0], encoding="utf-8")
    n_tokens = _ids(tiny_tokenizer, DOCS[0]).shape[1]
    with pytest.raises(ValueError, match=rf"has {n_tokens} tokens.*smaller seqlen"):
        load_calibration(str(path), tiny_tokenizer, nsamples=1, seqlen=n_tokens + 1)
    assert load_calibration(str(path), tiny_tokenizer, nsamples=2, seqlen=n_tokens).shape == (2, n_tokens)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("data.csv", "text\nhello", "Unsupported file type"),
        ("bad.jsonl", '{"body": "no text field"}\n', "'text' field"),
        ("bad2.jsonl", "{not json\n", "not valid JSON"),
        ("obj.json", '{"text": "an object, not an array"}', "JSON dict"),
    ],
)
def test_malformed_local_files_raise(tmp_path, tiny_tokenizer, name, content, message):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        load_eval_tokens(str(path), tiny_tokenizer)


def test_parquet_without_text_column_raises(tmp_path, tiny_tokenizer):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"body": DOCS}), path)
    with pytest.raises(ValueError, match="no 'text' column"):
        load_eval_tokens(str(path), tiny_tokenizer)


def test_directory_without_supported_files_raises(tmp_path, tiny_tokenizer):
    (tmp_path / "readme.md").write_text("x", encoding="utf-8")
    with pytest.raises(ValueError, match="holds no file"):
        load_eval_tokens(str(tmp_path), tiny_tokenizer)


# ---------------------------------------------------------------- hub branches (monkeypatched)


def test_wikitext_calibration_joins_train_split_with_spaces(monkeypatch, tiny_tokenizer):
    fake = _FakeLoadDataset(DOCS * 3)
    monkeypatch.setattr(datasets, "load_dataset", fake)
    windows = load_calibration("wikitext", tiny_tokenizer, nsamples=3, seqlen=8, seed=0)
    assert fake.calls == [(("wikitext", "wikitext-2-raw-v1"), {"split": "train"})]
    stream = _ids(tiny_tokenizer, " ".join(DOCS * 3))[0]
    assert windows.shape == (3, 8) and all(_is_slice_of(w, stream) for w in windows)


def test_wikitext_eval_joins_test_split_with_blank_lines(monkeypatch, tiny_tokenizer):
    fake = _FakeLoadDataset(DOCS)
    monkeypatch.setattr(datasets, "load_dataset", fake)
    tokens = load_eval_tokens("wikitext", tiny_tokenizer)
    assert fake.calls == [(("wikitext", "wikitext-2-raw-v1"), {"split": "test"})]
    assert torch.equal(tokens, _ids(tiny_tokenizer, "\n\n".join(DOCS)))


def test_c4_calibration_samples_long_documents(monkeypatch, tiny_tokenizer):
    long_docs = [" ".join(DOCS) + f" Document number {i}." for i in range(3)]
    fake = _FakeLoadDataset(["short", *long_docs, "tiny"])
    monkeypatch.setattr(datasets, "load_dataset", fake)
    windows = load_calibration("c4", tiny_tokenizer, nsamples=5, seqlen=12, seed=0)
    assert fake.calls == [((C4_REPO,), {"data_files": {"train": C4_TRAIN_FILE}, "split": "train"})]
    assert windows.shape == (5, 12)
    streams = [_ids(tiny_tokenizer, doc)[0] for doc in long_docs]
    assert all(any(_is_slice_of(w, s) for s in streams) for w in windows)
    assert torch.equal(windows, load_calibration("c4", tiny_tokenizer, nsamples=5, seqlen=12, seed=0))


def test_c4_calibration_without_long_documents_raises(monkeypatch, tiny_tokenizer):
    monkeypatch.setattr(datasets, "load_dataset", _FakeLoadDataset(["short", "tiny"]))
    with pytest.raises(ValueError, match="smaller seqlen"):
        load_calibration("c4", tiny_tokenizer, nsamples=1, seqlen=64)


def test_c4_eval_joins_first_validation_documents(monkeypatch, tiny_tokenizer):
    texts = [f"doc{i}" for i in range(C4_EVAL_DOCS + 50)]
    fake = _FakeLoadDataset(texts)
    monkeypatch.setattr(datasets, "load_dataset", fake)
    tokens = load_eval_tokens("c4", tiny_tokenizer)
    assert fake.calls == [((C4_REPO,), {"data_files": {"validation": C4_VALIDATION_FILE}, "split": "validation"})]
    assert torch.equal(tokens, _ids(tiny_tokenizer, " ".join(texts[:C4_EVAL_DOCS])))


def test_holdout_windows_are_disjoint_from_calibration_windows(tiny_tokenizer):
    plain = load_calibration("builtin", tiny_tokenizer, 8, 64, seed=3)
    both = load_calibration("builtin", tiny_tokenizer, 8, 64, seed=3, holdout=4)
    assert both.shape == (12, 64) and torch.equal(both[:8], plain)
    ids = _tokenize(builtin_text("calib"), tiny_tokenizer, "builtin")[0]
    spans = [next(s for s in range(ids.numel() - 63) if torch.equal(ids[s : s + 64], w)) for w in both]
    for held in spans[8:]:
        assert all(abs(held - fit) >= 64 for fit in spans[:8])
    with pytest.raises(ValueError, match="holdout"):
        load_calibration("builtin", tiny_tokenizer, 8, 64, holdout=-1)


def test_c4_holdout_windows_come_from_other_documents(monkeypatch, tiny_tokenizer):
    long_docs = [" ".join(f"{DOCS[i % 3].split()[j % 5]}{i}" for j in range(40)) for i in range(6)]
    monkeypatch.setattr(datasets, "load_dataset", _FakeLoadDataset(long_docs))
    windows = load_calibration("c4", tiny_tokenizer, nsamples=2, seqlen=12, seed=0, holdout=3)
    streams = [_ids(tiny_tokenizer, doc)[0] for doc in long_docs]
    source = [{i for i, s in enumerate(streams) if _is_slice_of(w, s)} for w in windows]
    fit_docs = set().union(*source[:2])
    assert windows.shape == (5, 12) and all(len(docs) == 1 for docs in source)
    assert all(not (docs & fit_docs) for docs in source[2:])
