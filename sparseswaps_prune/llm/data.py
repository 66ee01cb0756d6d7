"""Calibration and evaluation token streams for LLM pruning (Wanda / SparseGPT protocol).

Sources, accepted by :func:`load_calibration` and :func:`load_eval_tokens`:

* ``"builtin"``: English text with no network, the Python documentation topics of the standard
  library (``pydoc_data.topics.topics``, ~465 KB), split into non-overlapping calibration and
  evaluation parts by :func:`builtin_text`. Its content depends on the Python version.
* ``"stdlib-prose"``: English prose the built-in corpus does not hold, also from the standard library: the
  text of IDLE's manual (``idlelib/help.html``) and Python's history and license (``LICENSE.txt``), about
  50 KB (see :func:`stdlib_prose_text`). For measuring on text calibration never touches.
* ``"c4"``: the first shards of ``allenai/c4`` (English) from the Hugging Face hub, as Wanda and
  SparseGPT use them.
* ``"wikitext"``: ``wikitext-2-raw-v1`` from the hub (train split to calibrate, test split to
  evaluate), as Wanda and SparseGPT use it.
* a local path: a ``.txt`` file, a ``.json`` / ``.jsonl`` file of records with a ``"text"`` field,
  a ``.parquet`` file with a ``"text"`` column, or a directory holding such files (read in sorted
  file-name order, not recursively). Documents are joined with ``"\\n\\n"``.

Texts are tokenized whole with the tokenizer's default special tokens (e.g. a leading BOS for
Llama tokenizers, as in the reference code); ``verbose=False`` silences the "longer than the
model's maximum length" warning, since windows are cut afterwards.

``datasets`` and ``pyarrow`` are imported inside the functions that need them.
"""

from __future__ import annotations

import html.parser
import json
import logging
import os
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from sparseswaps_prune.extras import require

if TYPE_CHECKING:
    from collections.abc import Sequence

    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

BUILTIN_EVAL_EVERY = 5
"""Every ``BUILTIN_EVAL_EVERY``-th unique paragraph of the built-in corpus goes to the eval split."""

NAMED_SOURCES = ("builtin", "stdlib-prose", "c4", "wikitext")
"""Source names that are not local paths."""

LOCAL_SUFFIXES = (".txt", ".json", ".jsonl", ".parquet")
"""File suffixes readable as local text sources."""

C4_REPO = "allenai/c4"
C4_TRAIN_FILE = "en/c4-train.00000-of-01024.json.gz"
C4_VALIDATION_FILE = "en/c4-validation.00000-of-00008.json.gz"
C4_EVAL_DOCS = 1100
"""Number of leading C4 validation documents joined for evaluation (SparseGPT's ``valdata[:1100]``)."""

_MAX_DRAWS_PER_SAMPLE = 1000


def builtin_text(split: Literal["calib", "eval"]) -> str:
    """Return one split of the built-in corpus (Python's ``pydoc_data.topics``), with no network.

    Rule: the topics are taken in sorted key order and cut into paragraphs at blank lines
    (``"\\n\\n"``); empty paragraphs and exact repeats (compared after stripping whitespace; the
    first occurrence is kept) are dropped. Unique paragraph ``i`` (0-based) goes to ``"eval"`` when
    ``i % BUILTIN_EVAL_EVERY == BUILTIN_EVAL_EVERY - 1`` and to ``"calib"`` otherwise, so about 20%
    of the text is for evaluation and no paragraph appears in both. Each split is its paragraphs
    joined with ``"\\n\\n"``. Deterministic for a given Python version.

    Args:
        split: ``"calib"`` (about 300 KB) or ``"eval"`` (about 74 KB on Python 3.11).

    Returns:
        The text of the split.

    Raises:
        ValueError: ``split`` is not ``"calib"`` or ``"eval"``.
    """
    if split not in ("calib", "eval"):
        raise ValueError(f"split must be 'calib' or 'eval', got {split!r}.")
    from pydoc_data.topics import topics

    seen: set[str] = set()
    paragraphs: list[str] = []
    for key in sorted(topics):
        for paragraph in topics[key].split("\n\n"):
            stripped = paragraph.strip()
            if stripped and stripped not in seen:
                seen.add(stripped)
                paragraphs.append(paragraph)
    to_eval = split == "eval"
    return "\n\n".join(
        p for i, p in enumerate(paragraphs) if (i % BUILTIN_EVAL_EVERY == BUILTIN_EVAL_EVERY - 1) == to_eval
    )


class _SectionText(html.parser.HTMLParser):
    """The text inside the outermost ``<section>`` elements of an HTML page (a Sphinx page's content, without
    its navigation), a blank line at each block element."""

    BLOCKS = frozenset({"p", "li", "dt", "dd", "pre", "h1", "h2", "h3", "h4", "section", "div", "tr"})

    def __init__(self) -> None:
        super().__init__()
        self.depth, self.parts = 0, []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.depth += tag == "section"
        if self.depth and tag in self.BLOCKS:
            self.parts.append("\n\n")

    def handle_endtag(self, tag: str) -> None:
        self.depth -= tag == "section" and self.depth > 0

    def handle_data(self, data: str) -> None:
        if self.depth:
            self.parts.append(data)


def stdlib_prose_text() -> str:
    """Return the ``"stdlib-prose"`` text: English prose from the standard library that the built-in corpus
    (``pydoc_data.topics``) does not hold, with no network.

    Rule: the text of the sections of IDLE's manual (``idlelib/help.html``: inside its ``<section>``
    elements, a paragraph per block element; the page's navigation is left out), then Python's history and
    license (``LICENSE.txt`` beside the standard library); runs of blank lines become one, ``"¶"`` anchors
    are dropped. About 50 KB; depends on the Python version, like the built-in corpus.

    Raises:
        FileNotFoundError: this Python installation lacks ``idlelib/help.html`` or ``LICENSE.txt`` (some
            distributions package IDLE separately); install it, or evaluate on a local text file.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    pieces = []
    for path in (stdlib / "idlelib" / "help.html", stdlib / "LICENSE.txt"):
        if not path.is_file():
            raise FileNotFoundError(
                f"the 'stdlib-prose' source reads {path}, which this Python installation lacks (some "
                "distributions package IDLE separately); install it or evaluate on a local text file."
            )
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".html":
            parser = _SectionText()
            parser.feed(text)
            text = "".join(parser.parts)
        pieces.append(text.replace("\u00b6", ""))
    paragraphs = (p.strip() for p in "\n\n".join(pieces).split("\n\n"))
    return "\n\n".join(p for p in paragraphs if p)


def _texts_from_records(records: Sequence[object], path: Path) -> list[str]:
    """Return the ``"text"`` field of each JSON record.

    Args:
        records: Parsed JSON values, each a dict with a string ``"text"``.
        path: File the records came from (for error messages).

    Returns:
        The texts, in record order.

    Raises:
        ValueError: a record is not an object with a string ``"text"`` field.
    """
    texts = []
    for index, record in enumerate(records):
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(
                f"Record {index} of {path} is not a JSON object with a string 'text' field "
                f"(got {str(record)[:80]!r}); every record needs one."
            )
        texts.append(record["text"])
    return texts


def _read_json_lines(path: Path) -> list[str]:
    """Read the ``"text"`` fields of a JSON Lines file (blank lines skipped).

    Raises:
        ValueError: a line is not valid JSON or lacks a string ``"text"``.
    """
    records = []
    for number, line in enumerate(_read_text(path).split("\n"), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"Line {number} of {path} is not valid JSON ({exc}); fix the file.") from exc
    return _texts_from_records(records, path)


def _not_utf8(path: Path, err: UnicodeDecodeError, offset: int = 0) -> ValueError:
    """The error for a local text file that is not UTF-8: names the file, the first bad byte and the fix."""
    byte = err.object[err.start : err.start + 1].hex()
    return ValueError(
        f"{path} is not UTF-8 text (byte 0x{byte} at offset {offset + err.start}); local text sources must be "
        f"UTF-8: convert it, e.g. `iconv -f latin1 -t utf-8 {path} > {path.stem}.utf8{path.suffix}`, and pass the "
        "converted file"
    )


def _read_text(path: Path) -> str:
    """The UTF-8 text of ``path`` with universal newlines (as ``read_text``); a ``ValueError`` naming the file and
    the fix if it is not UTF-8."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise _not_utf8(path, err) from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _check_utf8(path: Path, chunk: int = 1 << 22) -> None:
    """Raise :func:`_not_utf8`'s error unless ``path`` decodes as UTF-8 (read in chunks, nothing kept)."""
    import codecs

    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with path.open("rb") as handle:
        while True:
            data = handle.read(chunk)
            try:
                decoder.decode(data, final=not data)
            except UnicodeDecodeError as err:
                raise _not_utf8(path, err, offset) from None
            if not data:
                return
            offset += len(data)


def check_source(source: str, what: str = "data") -> None:
    """Check a data source before anything is loaded: a named source (:data:`NAMED_SOURCES`), or a local file
    with a supported suffix (text files must be UTF-8) or a directory holding at least one.

    Raises:
        TypeError: ``source`` is not a str.
        FileNotFoundError: a local path that does not exist.
        ValueError: an unsupported file, a directory with no supported file, or a text file that is not UTF-8.
    """
    if not isinstance(source, str):
        raise TypeError(f"the {what} source must be a str (one of {list(NAMED_SOURCES)} or a path), got {source!r}")
    if source in NAMED_SOURCES:
        return
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"The {what} source {source!r} is neither one of {list(NAMED_SOURCES)} nor an existing file or "
            "directory; check the path."
        )
    files = [path] if not path.is_dir() else _local_files(path, source)
    for file in files:
        suffix = file.suffix.lower()
        if suffix not in LOCAL_SUFFIXES:
            raise ValueError(
                f"Unsupported file type {file.name!r}; local sources must end with one of {LOCAL_SUFFIXES}."
            )
        if suffix != ".parquet":
            try:
                _check_utf8(file)
            except ValueError as err:
                raise ValueError(f"the {what} source {err}") from None


def _local_files(path: Path, source: str) -> list[Path]:
    """The supported files of a directory source, in sorted name order."""
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in LOCAL_SUFFIXES)
    if not files:
        raise ValueError(f"Directory {source!r} holds no file ending with one of {LOCAL_SUFFIXES}; add some.")
    return files


def _read_file_documents(path: Path) -> list[str]:
    """Read the documents of one local file.

    Args:
        path: A ``.txt`` (one document), ``.jsonl`` (one record per line), ``.json`` (a JSON array
            of records, or JSON Lines) or ``.parquet`` (a ``"text"`` column) file.

    Returns:
        The documents, in file order.

    Raises:
        ValueError: unsupported suffix, or a file without the expected ``"text"`` data.
    """
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return [_read_text(path)]
    if suffix == ".jsonl":
        return _read_json_lines(path)
    if suffix == ".json":
        raw = _read_text(path)
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError:
            return _read_json_lines(path)
        if not isinstance(parsed, list):
            raise ValueError(
                f"{path} holds a JSON {type(parsed).__name__}; expected an array of objects with a "
                "'text' field, or JSON Lines."
            )
        return _texts_from_records(parsed, path)
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        columns = pq.read_schema(path).names
        if "text" not in columns:
            raise ValueError(f"{path} has no 'text' column (columns: {columns}); add or rename one.")
        return [str(value) for value in pq.read_table(path, columns=["text"]).column("text").to_pylist()]
    raise ValueError(f"Unsupported file type {path.name!r}; local sources must end with one of {LOCAL_SUFFIXES}.")


def _read_local_documents(source: str) -> list[str]:
    """Read the documents of a local file or directory source.

    Args:
        source: Path of a file with a suffix in :data:`LOCAL_SUFFIXES`, or of a directory of such
            files (read in sorted name order, not recursively).

    Returns:
        The documents, in file order.

    Raises:
        FileNotFoundError: ``source`` does not exist.
        ValueError: an unsupported file, or a directory with no supported file.
    """
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"Data source {source!r} is neither one of {list(NAMED_SOURCES)} nor an existing file or "
            "directory; check the path."
        )
    if not path.is_dir():
        return _read_file_documents(path)
    return [doc for file in _local_files(path, source) for doc in _read_file_documents(file)]


def _tokenize(text: str, tokenizer: PreTrainedTokenizerBase, source: str) -> torch.Tensor:
    """Tokenize a whole text into one row of ids.

    Args:
        text: The text.
        tokenizer: A Hugging Face tokenizer.
        source: Source name, for error messages.

    Returns:
        LongTensor ``[1, N]`` of token ids.

    Raises:
        ValueError: the text is empty or all whitespace.
    """
    if not text.strip():
        raise ValueError(f"Data source {source!r} holds no text; give a file or directory with text in it.")
    return tokenizer(text, return_tensors="pt", verbose=False).input_ids.long()


def _check_sizes(nsamples: int, seqlen: int) -> None:
    """Validate ``nsamples`` and ``seqlen``.

    Raises:
        TypeError: not integers.
        ValueError: smaller than 1.
    """
    for name, value in (("nsamples", nsamples), ("seqlen", seqlen)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__}).")
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}.")


def _physical_memory() -> int | None:
    """This machine's physical memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def check_window_budget(nsamples: int, seqlen: int, holdout: int = 0, *, memory: int | None = None) -> None:
    """Raise ``ValueError`` naming ``nsamples`` or ``holdout`` if the token ids of ``nsamples + holdout`` windows of
    ``seqlen`` tokens (int64, the least any calibration holds of them) exceed ``memory`` bytes (default: this
    machine's physical memory; no check where it is unknown). Windows may overlap, so any count can be drawn from a
    text of at least ``seqlen`` tokens; this catches counts that could only end in an allocation error, before any
    text or model is read. Non-int sizes are left to the callers' own checks."""
    sizes = (nsamples, seqlen, holdout)
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in sizes):
        return
    memory = _physical_memory() if memory is None else memory
    if memory is None:
        return
    per_window = seqlen * torch.int64.itemsize
    gib = lambda n: f"{n / 2**30:.3g} GiB"  # noqa: E731
    if nsamples * per_window > memory:
        raise ValueError(
            f"nsamples={nsamples} (--nsamples) windows of seqlen={seqlen} tokens need {gib(nsamples * per_window)} "
            f"for their token ids alone, more than this machine's {gib(memory)} of memory; use a smaller --nsamples "
            f"(at most {memory // per_window}) or --seqlen"
        )
    if (nsamples + holdout) * per_window > memory:
        raise ValueError(
            f"holdout={holdout} (--holdout) held-out windows of seqlen={seqlen} tokens, with the {nsamples} "
            f"calibration windows, need {gib((nsamples + holdout) * per_window)} for their token ids alone, more "
            f"than this machine's {gib(memory)} of memory; use a smaller --holdout (at most "
            f"{memory // per_window - nsamples})"
        )


def _random_windows(
    ids: torch.Tensor, nsamples: int, seqlen: int, seed: int, source: str, holdout: int = 0
) -> torch.Tensor:
    """Cut ``nsamples`` windows of ``seqlen`` tokens at seeded uniform random starts, then ``holdout`` more
    whose tokens overlap none of the first ``nsamples`` windows.

    Args:
        ids: LongTensor ``[1, N]``.
        nsamples: Number of windows.
        seqlen: Tokens per window.
        seed: Seed of the ``torch.Generator`` drawing the starts (from ``0 .. N - seqlen``).
        source: Source name, for error messages.
        holdout: Number of held-out windows appended (uniform over the starts that keep them disjoint
            from the first ``nsamples`` windows; they may overlap each other).

    Returns:
        LongTensor ``[nsamples + holdout, seqlen]``; the first ``nsamples`` windows may overlap.

    Raises:
        ValueError: ``N < seqlen``, or no room for a held-out window.
    """
    total = ids.shape[1]
    if total < seqlen:
        raise ValueError(
            f"Calibration source {source!r} has {total} tokens, fewer than seqlen={seqlen}; use a "
            f"smaller seqlen (at most {total}) or give more text."
        )
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, total - seqlen + 1, (nsamples,), generator=generator)
    if holdout:
        count = total - seqlen + 1
        candidates = torch.arange(count)
        # A start is free if no calibration start lies within seqlen - 1 of it: mark the blocked ranges
        # [s - seqlen + 1, s + seqlen) by +1/-1 at their ends and a running sum (O(count + nsamples) memory).
        marks = torch.zeros(count + 1, dtype=torch.int64)
        marks.index_add_(0, (starts - seqlen + 1).clamp_min(0), torch.ones_like(starts))
        marks.index_add_(0, (starts + seqlen).clamp_max(count), torch.full_like(starts, -1))
        free = marks[:count].cumsum(0) == 0
        if not bool(free.any()):
            raise ValueError(
                f"Calibration source {source!r} ({total} tokens) has no room for held-out windows disjoint from "
                f"{nsamples} x {seqlen} calibration windows; use a smaller --nsamples or --seqlen, --holdout 0, or "
                "more text."
            )
        pick = torch.randint(0, int(free.sum()), (holdout,), generator=generator)
        starts = torch.cat([starts, candidates[free][pick]])
    offsets = torch.arange(seqlen)
    return ids[0, starts[:, None] + offsets[None, :]]


def _document_windows(
    documents: Sequence[str],
    tokenizer: PreTrainedTokenizerBase,
    nsamples: int,
    seqlen: int,
    seed: int,
    holdout: int = 0,
) -> torch.Tensor:
    """Wanda's C4 sampling: per sample, draw random documents until one has more than ``seqlen``
    tokens, then cut a window of ``seqlen`` tokens at a random start inside it. ``holdout`` more windows
    are appended, drawn the same way from documents none of the first ``nsamples`` windows came from.

    Args:
        documents: The documents.
        tokenizer: A Hugging Face tokenizer.
        nsamples: Number of windows.
        seqlen: Tokens per window.
        seed: Seed of the ``torch.Generator`` drawing documents and starts.

    Returns:
        LongTensor ``[nsamples + holdout, seqlen]``.

    Raises:
        ValueError: no long enough document after ``1000 * (nsamples + holdout)`` draws.
    """
    generator = torch.Generator().manual_seed(seed)
    windows, used = [], set()
    draws = 0
    while len(windows) < nsamples + holdout:
        if draws >= _MAX_DRAWS_PER_SAMPLE * (nsamples + holdout):
            raise ValueError(
                f"Found only {len(windows)} of {nsamples} C4 documents longer than seqlen={seqlen} tokens "
                f"in {draws} random draws; use a smaller seqlen."
            )
        draws += 1
        index = int(torch.randint(len(documents), (1,), generator=generator))
        if len(windows) >= nsamples and index in used:
            continue
        ids = tokenizer(documents[index], return_tensors="pt", verbose=False).input_ids.long()
        if ids.shape[1] > seqlen:
            start = int(torch.randint(ids.shape[1] - seqlen + 1, (1,), generator=generator))
            windows.append(ids[0, start : start + seqlen])
            if len(windows) <= nsamples:
                used.add(index)
    return torch.stack(windows)


def load_calibration(
    source: str,
    tokenizer: PreTrainedTokenizerBase,
    nsamples: int,
    seqlen: int,
    seed: int = 0,
    holdout: int = 0,
) -> torch.Tensor:
    """Draw calibration windows (Wanda / SparseGPT protocol), deterministically for a given seed.

    With ``holdout > 0``, that many held-out windows follow the ``nsamples`` calibration windows; their
    tokens come from outside every calibration window (other documents for C4). The first ``nsamples``
    windows are the same with or without a held-out part.

    * ``"builtin"``, ``"wikitext"``, local paths: the whole text is tokenized and ``nsamples``
      windows of ``seqlen`` tokens start at uniform random offsets (a seeded ``torch.Generator``).
      ``"wikitext"`` is the ``wikitext-2-raw-v1`` train split joined with ``" "`` (as the Wanda and
      SparseGPT reference code does).
    * ``"c4"``: shard ``en/c4-train.00000-of-01024.json.gz`` of ``allenai/c4``; per sample, random
      documents are drawn until one is longer than ``seqlen`` tokens, and a random window is cut
      from it (as Wanda does).

    Args:
        source: ``"builtin"``, ``"stdlib-prose"``, ``"c4"``, ``"wikitext"`` or a local path (see the module docstring).
        tokenizer: A Hugging Face tokenizer.
        nsamples: Number of windows, at least 1.
        seqlen: Tokens per window, at least 1.
        seed: Seed of the window draws.
        holdout: Number of held-out windows appended (held-out Grams measure generalisation).

    Returns:
        LongTensor ``[nsamples + holdout, seqlen]`` of token ids (CPU).

    Raises:
        FileNotFoundError: a local path that does not exist.
        TypeError: ``nsamples`` or ``seqlen`` not an int.
        ValueError: ``nsamples`` or ``seqlen`` < 1, no text, too few tokens for one window, or an
            unreadable local file.
    """
    _check_sizes(nsamples, seqlen)
    if isinstance(holdout, bool) or not isinstance(holdout, int) or holdout < 0:
        raise ValueError(f"holdout must be an int >= 0, got {holdout!r}.")
    check_window_budget(nsamples, seqlen, holdout)
    if source == "c4":
        require("llm", "datasets")
        import datasets

        data = datasets.load_dataset(C4_REPO, data_files={"train": C4_TRAIN_FILE}, split="train")
        windows = _document_windows(data["text"], tokenizer, nsamples, seqlen, seed, holdout)
    else:
        if source == "builtin":
            text = builtin_text("calib")
        elif source == "stdlib-prose":
            text = stdlib_prose_text()
        elif source == "wikitext":
            require("llm", "datasets")
            import datasets

            text = " ".join(datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="train")["text"])
        else:
            text = "\n\n".join(_read_local_documents(source))
        windows = _random_windows(_tokenize(text, tokenizer, source), nsamples, seqlen, seed, source, holdout)
    logger.info("Calibration: %d windows of %d tokens from %r (seed %d)", nsamples, seqlen, source, seed)
    return windows


def load_eval_tokens(source: str, tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """Tokenize an evaluation text into one stream for :func:`~sparseswaps_prune.llm.evaluate.perplexity`.

    * ``"builtin"``: :func:`builtin_text` ``("eval")``; ``"stdlib-prose"``: :func:`stdlib_prose_text`.
    * ``"wikitext"``: the ``wikitext-2-raw-v1`` test split joined with ``"\\n\\n"`` (the Wanda /
      SparseGPT perplexity protocol).
    * ``"c4"``: the first 1100 documents of shard ``en/c4-validation.00000-of-00008.json.gz``
      joined with ``" "``. SparseGPT / Wanda then keep only the first ``256 * seqlen`` tokens: pass
      ``max_windows=256`` to ``perplexity`` to reproduce that.
    * a local path: its documents joined with ``"\\n\\n"``.

    Args:
        source: ``"builtin"``, ``"stdlib-prose"``, ``"c4"``, ``"wikitext"`` or a local path.
        tokenizer: A Hugging Face tokenizer.

    Returns:
        LongTensor ``[1, N]`` of token ids (CPU).

    Raises:
        FileNotFoundError: a local path that does not exist.
        ValueError: no text, or an unreadable local file.
    """
    if source == "builtin":
        text = builtin_text("eval")
    elif source == "stdlib-prose":
        text = stdlib_prose_text()
    elif source == "wikitext":
        require("llm", "datasets")
        import datasets

        text = "\n\n".join(datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")["text"])
    elif source == "c4":
        require("llm", "datasets")
        import datasets

        data = datasets.load_dataset(C4_REPO, data_files={"validation": C4_VALIDATION_FILE}, split="validation")
        text = " ".join(data.select(range(min(C4_EVAL_DOCS, len(data))))["text"])
    else:
        text = "\n\n".join(_read_local_documents(source))
    ids = _tokenize(text, tokenizer, source)
    logger.info("Evaluation stream: %d tokens from %r", ids.shape[1], source)
    return ids
