"""Capture and replay the inputs of the decoder blocks for sequential (block-by-block) pruning.

:func:`capture_block_inputs` runs the model on the calibration tokens with every decoder block temporarily
replaced by a recording wrapper. The first block is really run (so the model loop sees a genuine output);
the others only record how they are called; the last one ends the forward with a private exception, so the
final norm and the LM head never run. The wrappers are removed afterwards, also on error.

What is recorded, per calibration batch:

* the first block's input hidden states (all batches together: ``[n, seqlen, hidden]``);
* the keyword arguments of *every* block call (attention masks, ``position_ids``, ``position_embeddings``
  ``(cos, sin)`` tuples, ...), with any cache dropped and ``use_cache=False``. They are recorded per block
  because they may differ between blocks: models with alternating sliding-window / full attention (Gemma2,
  Gemma3, Qwen2 with ``use_sliding_window``) pass each block the mask of its own attention type. Objects the
  model passes unchanged to several blocks stay one object (one copy in memory and on disk).

:class:`BlockInputs` then replays block ``k`` on these inputs (``batches``, ``feed_block``) and produces the
inputs of block ``k + 1`` (``run_block``); it can be saved and loaded to resume a run.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sparseswaps_prune.atomic import save_torch
from sparseswaps_prune.llm.offload import execution_device

logger = logging.getLogger(__name__)

__all__ = ["BlockInputs", "call_block", "capture_block_inputs"]

_FORMAT_VERSION = 1
# Keyword names under which decoder blocks receive a KV cache; never recorded (replay runs without a cache).
_CACHE_ARGS = frozenset({"past_key_values", "past_key_value", "layer_past"})


def _move(obj: Any, device: torch.device, memo: dict[int, Any]) -> Any:
    """Copy ``obj`` with every tensor moved (detached) to ``device``, recursing into tuples, lists and dicts.

    ``memo`` maps ``id(original) -> moved`` so that an object reached several times (the same mask passed to
    every block) is moved once and stays shared; the originals must stay alive while ``memo`` is used.
    Other values (``None``, numbers, strings, ...) are returned as they are.
    """
    if isinstance(obj, (torch.Tensor, tuple, list, dict)) and id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, torch.Tensor):
        moved: Any = obj.detach().to(device)
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        moved = type(obj)(*(_move(v, device, memo) for v in obj))
    elif isinstance(obj, (tuple, list)):
        moved = type(obj)(_move(v, device, memo) for v in obj)
    elif isinstance(obj, dict):
        moved = {k: _move(v, device, memo) for k, v in obj.items()}
    else:
        return obj
    memo[id(obj)] = moved
    return moved


def call_block(block: nn.Module, hidden_states: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """Run ``block(hidden_states, **kwargs)`` and return its output hidden states.

    Transformers 5 decoder layers return a tensor; older or remote-code ones return a tuple whose first item
    is the hidden states. Gradient mode is the caller's.

    Args:
        block: decoder block on the device of ``hidden_states``.
        hidden_states: ``[b, seqlen, hidden]``.
        kwargs: the recorded keyword arguments of this block for this batch, on the same device.

    Returns:
        ``[b, seqlen, hidden]`` output hidden states.

    Raises:
        TypeError: the block returned neither a tensor nor a sequence starting with one.
    """
    out = block(hidden_states, **kwargs)
    if not isinstance(out, torch.Tensor):
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            f"{type(block).__name__} returned {type(out).__name__} as its first output; expected the hidden "
            "states tensor. Pass blocks_path= to find_blocks if the wrong ModuleList was picked"
        )
    return out


@dataclass
class BlockInputs:
    """Recorded inputs of one decoder block, for every calibration batch, plus everything needed to replay.

    Attributes:
        hidden_states: ``[n, seqlen, hidden]`` input hidden states of block ``block_index`` (dtype as produced
            by the model), on the offload device. Batch ``i`` is rows ``i * batch_size : (i + 1) *
            batch_size``.
        batch_size: calibration batch size used at capture; the last batch may be smaller.
        block_kwargs: ``block_kwargs[i][k]`` is the keyword-argument dict of block ``k`` for batch ``i``
            (tensors on the offload device, shared between blocks where the model shared them).
        block_index: which block these hidden states feed; ``len(block_kwargs[0])`` means they are the output
            of the last block (the input of the final norm).
    """

    hidden_states: torch.Tensor
    batch_size: int
    block_kwargs: list[list[dict[str, Any]]]
    block_index: int = 0

    def __post_init__(self) -> None:
        if self.hidden_states.dim() != 3:
            raise ValueError(f"hidden_states has shape {tuple(self.hidden_states.shape)}; expected [n, seqlen, hidden]")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size!r}; expected a positive int")
        expected = math.ceil(self.hidden_states.shape[0] / self.batch_size)
        if len(self.block_kwargs) != expected:
            raise ValueError(
                f"block_kwargs has {len(self.block_kwargs)} batches; {self.hidden_states.shape[0]} samples "
                f"in batches of {self.batch_size} need {expected}"
            )
        if len({len(per_block) for per_block in self.block_kwargs}) != 1:
            raise ValueError("block_kwargs batches record different numbers of blocks; the capture is corrupt")
        if not 0 <= self.block_index <= self.num_blocks:
            raise ValueError(f"block_index={self.block_index} is outside [0, {self.num_blocks}]")

    @property
    def num_samples(self) -> int:
        """Number of calibration sequences ``n``."""
        return self.hidden_states.shape[0]

    @property
    def num_batches(self) -> int:
        """Number of calibration batches."""
        return len(self.block_kwargs)

    @property
    def num_blocks(self) -> int:
        """Number of decoder blocks whose call arguments were recorded."""
        return len(self.block_kwargs[0])

    @property
    def offload_device(self) -> torch.device:
        """Device where the hidden states (and recorded kwargs) are kept."""
        return self.hidden_states.device

    def kwargs(self, batch: int) -> dict[str, Any]:
        """Recorded keyword arguments of block ``block_index`` for batch ``batch`` (on the offload device).

        Raises:
            ValueError: these are the outputs of the last block, there is no block left to call.
        """
        if self.block_index == self.num_blocks:
            raise ValueError(
                f"block_index={self.block_index} is past the last block; these hidden states are the final "
                "block outputs and feed no block"
            )
        return self.block_kwargs[batch][self.block_index]

    def batches(self, device: torch.device | str) -> Iterator[tuple[torch.Tensor, dict[str, Any]]]:
        """Yield ``(hidden [b, seqlen, hidden], kwargs)`` per batch, both moved to ``device``.

        Meant for ``call_block(block, hidden, kwargs)`` while forward hooks accumulate statistics. Nothing
        stored is modified; the yielded tensors are copies when ``device`` differs from the offload device
        and the stored tensors themselves otherwise (treat them as read-only).
        """
        device = torch.device(device)
        for i in range(self.num_batches):
            kwargs = self.kwargs(i)
            rows = slice(i * self.batch_size, (i + 1) * self.batch_size)
            yield self.hidden_states[rows].to(device), _move(kwargs, device, {})

    def select(self, batches: range) -> BlockInputs:
        """The inputs of the contiguous ``batches`` only (e.g. one shard of windows): a view that shares the
        hidden-state rows and the recorded kwargs with ``self`` (nothing is copied); ``self`` itself when
        ``batches`` are all of them.

        Raises:
            ValueError: ``batches`` is empty, has a step other than 1 or is outside ``range(num_batches)``.
        """
        if batches.step != 1 or len(batches) == 0 or batches.start < 0 or batches.stop > self.num_batches:
            raise ValueError(f"batches={batches} is not a non-empty contiguous part of range({self.num_batches})")
        if len(batches) == self.num_batches:
            return self
        rows = slice(batches.start * self.batch_size, batches.stop * self.batch_size)
        kwargs = self.block_kwargs[batches.start : batches.stop]
        return BlockInputs(self.hidden_states[rows], self.batch_size, kwargs, self.block_index)

    def feed_block(self, block: nn.Module, device: torch.device | str) -> None:
        """Run ``block`` on every batch under ``torch.no_grad()`` and discard the outputs.

        Use it inside ``layers.input_hooks`` to accumulate per-layer input statistics. ``block`` must already
        be on ``device``; nothing is modified except through the caller's hooks.
        """
        with torch.no_grad():
            for hidden, kwargs in self.batches(device):
                call_block(block, hidden, kwargs)

    def run_block(self, block: nn.Module, device: torch.device | str) -> BlockInputs:
        """Apply ``block`` (block ``block_index``, already on ``device``) to every batch.

        Runs under ``torch.no_grad()`` (not ``inference_mode``, so the results remain usable in autograd
        later). ``self`` is not modified.

        Returns:
            The inputs of the next block: a new :class:`BlockInputs` with the ``[n, seqlen, hidden]`` outputs
            on the offload device, the same (shared) ``block_kwargs`` and ``block_index + 1``.
        """
        outputs: torch.Tensor | None = None
        with torch.no_grad():
            for i, (hidden, kwargs) in enumerate(self.batches(device)):
                out = call_block(block, hidden, kwargs)
                if outputs is None:
                    outputs = torch.empty(
                        (self.num_samples, *out.shape[1:]), dtype=out.dtype, device=self.offload_device
                    )
                outputs[i * self.batch_size : i * self.batch_size + out.shape[0]].copy_(out)
        return BlockInputs(outputs, self.batch_size, self.block_kwargs, self.block_index + 1)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write hidden states, kwargs, batch size and block index to ``path`` (``torch.save``), atomically.

        The data go to a temporary file in the same directory, which is then renamed over ``path``, so an
        interrupted save never leaves a truncated file. Shared kwargs tensors are stored once.
        """
        payload = {
            "format_version": _FORMAT_VERSION,
            "hidden_states": self.hidden_states,
            "batch_size": self.batch_size,
            "block_kwargs": self.block_kwargs,
            "block_index": self.block_index,
        }
        save_torch(payload, path)
        logger.info("saved inputs of block %d to %s", self.block_index, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str], offload_device: torch.device | str = "cpu") -> BlockInputs:
        """Load what :meth:`save` wrote, with every tensor on ``offload_device``.

        Raises:
            ValueError: the file was not written by :meth:`save` (or by an incompatible version).
        """
        payload = torch.load(path, map_location=torch.device(offload_device), weights_only=True)
        if not isinstance(payload, dict) or payload.get("format_version") != _FORMAT_VERSION:
            raise ValueError(
                f"{path} is not a BlockInputs file of format version {_FORMAT_VERSION}; re-run the capture"
            )
        return cls(payload["hidden_states"], payload["batch_size"], payload["block_kwargs"], payload["block_index"])


class _StopForward(Exception):
    """Raised by the last block's recorder to end the calibration forward."""


class _BlockRecorder(nn.Module):
    """Stand-in for block ``index`` during capture; forwards attribute reads to the wrapped block.

    Records the block's call into ``sink[index]`` as ``(hidden, kwargs)``. Block 0 is then really run and
    its output kept in ``sink["output"]``; later blocks return that output again (the model loop only needs
    something shaped like a block output) and the last block raises :class:`_StopForward`.
    """

    def __init__(self, block: nn.Module, index: int, is_last: bool, sink: dict[Any, Any]) -> None:
        super().__init__()
        self.block = block
        self.index = index
        self.is_last = is_last
        self.sink = sink

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            block = self.__dict__.get("_modules", {}).get("block")
            if block is None:
                raise
            return getattr(block, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden, call = _normalize_call(self.block, args, kwargs)
        # Block 0 runs below: keep a copy of its input in case the block writes to it in place.
        self.sink[self.index] = (hidden.detach().clone() if self.index == 0 else hidden, call)
        if self.is_last:
            raise _StopForward
        if self.index == 0:
            self.sink["output"] = self.block(*args, **kwargs)
        return self.sink["output"]


def _normalize_call(
    block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Turn one block call into ``(hidden_states, kwargs)`` replayable as ``block(hidden, **kwargs)``.

    Positional arguments after the hidden states (GPT-2 passes the cache and mask positionally) are bound
    to their parameter names; cache arguments and ``Cache`` objects are dropped; ``use_cache`` is ``False``.
    """
    signature = inspect.signature(block.forward)
    params = signature.parameters
    hidden_name = next(iter(params))
    if params[hidden_name].kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
        raise ValueError(
            f"{type(block).__name__}.forward starts with {hidden_name!r}, not a named hidden-states "
            "parameter; pass blocks_path= to find_blocks if this is not the decoder-block list"
        )
    bound = signature.bind(*args, **kwargs).arguments
    call: dict[str, Any] = {}
    for name, value in bound.items():
        kind = params[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            call.update(value)
        elif name == hidden_name:
            continue
        elif kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.POSITIONAL_ONLY):
            raise ValueError(
                f"{type(block).__name__}.forward receives {name!r} positionally only, which cannot be "
                "replayed by keyword; pass blocks_path= to find_blocks if this is not the decoder-block list"
            )
        else:
            call[name] = value
    hidden = bound[hidden_name]
    cache_types = _cache_types()
    call = {k: v for k, v in call.items() if k not in _CACHE_ARGS and not isinstance(v, cache_types)}
    if "use_cache" in params or "use_cache" in call:
        call["use_cache"] = False
    return hidden, call


def _cache_types() -> tuple[type, ...]:
    """transformers' ``Cache`` class if transformers has loaded it (a model can hold a KV cache only then), else
    nothing; so that this module does not import transformers."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    cache = getattr(cache_utils, "Cache", None)
    return () if cache is None else (cache,)


def _input_device(model: nn.Module) -> torch.device:
    """Device of the input-embedding weights (where the token ids must go); for embeddings that accelerate offloads
    (weights on ``meta``), the device their hook runs them on."""
    get_embeddings = getattr(model, "get_input_embeddings", None)
    embeddings = get_embeddings() if callable(get_embeddings) else None
    if isinstance(embeddings, nn.Module):
        for param in embeddings.parameters():
            offloaded = param.device.type == "meta"
            return (execution_device(embeddings) if offloaded else None) or param.device
    return next(model.parameters()).device


def capture_block_inputs(
    model: nn.Module,
    blocks: nn.ModuleList,
    input_ids: torch.Tensor,
    *,
    batch_size: int = 1,
    offload_device: torch.device | str = "cpu",
) -> BlockInputs:
    """Record the inputs of the first decoder block and the call arguments of every block.

    The model is called as ``model(input_ids=batch, use_cache=False)`` under ``torch.no_grad()``, one batch
    at a time, with the token ids on the device of the input embeddings. Only the modules that run before
    the first block (embeddings, rotary embedding, mask creation) and the first block itself must be on the
    compute device; the other blocks, the final norm and the LM head are never run, so they may stay on the
    CPU. The first block is run unchanged on each batch so that the model loop gets a genuine block output.

    ``blocks`` is temporarily modified (each entry replaced by a recorder) and restored on exit, also when
    the forward raises. Call ``model.eval()`` first: dropout would make the captured inputs random.

    Args:
        model: the causal LM (e.g. ``LlamaForCausalLM``); not modified.
        blocks: its decoder-block list (from ``layers.find_blocks``).
        input_ids: ``[n, seqlen]`` integer token ids, full length and unpadded (no attention mask is passed).
        batch_size: sequences per forward; the recorded kwargs are stored once per batch.
        offload_device: where the recorded hidden states and kwargs are kept.

    Returns:
        The inputs of block 0 (``block_index == 0``).

    Raises:
        TypeError: ``input_ids`` is not an integer tensor, or ``blocks`` not an ``nn.ModuleList``.
        ValueError: bad shapes or ``batch_size``, an empty ``blocks``, or the model did not call every block.
    """
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        raise TypeError(f"blocks must be a non-empty nn.ModuleList (from find_blocks), got {type(blocks).__name__}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError("input_ids must be a torch.long tensor of token ids shaped [n, seqlen]")
    if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}; expected a non-empty [n, seqlen]")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}; expected a positive int")
    if model.training:
        logger.warning("model is in training mode: dropout makes the captured inputs random; call model.eval()")

    offload = torch.device(offload_device)
    device = _input_device(model)
    n = input_ids.shape[0]
    originals = list(blocks)
    sink: dict[Any, Any] = {}
    hidden_states: torch.Tensor | None = None
    block_kwargs: list[list[dict[str, Any]]] = []
    try:
        for k, block in enumerate(originals):
            blocks[k] = _BlockRecorder(block, k, k == len(originals) - 1, sink)
        with torch.no_grad():
            for start in range(0, n, batch_size):
                sink.clear()
                try:
                    model(input_ids=input_ids[start : start + batch_size].to(device), use_cache=False)
                except _StopForward:
                    pass
                missing = [k for k in range(len(originals)) if k not in sink]
                if missing:
                    raise ValueError(
                        f"the forward of {type(model).__name__} did not call blocks {missing}; pass "
                        "blocks_path= to find_blocks with the list the model iterates over"
                    )
                memo: dict[int, Any] = {}
                hidden = sink[0][0]
                if hidden_states is None:
                    hidden_states = torch.empty((n, *hidden.shape[1:]), dtype=hidden.dtype, device=offload)
                hidden_states[start : start + hidden.shape[0]].copy_(hidden)
                block_kwargs.append([_move(sink[k][1], offload, memo) for k in range(len(originals))])
    finally:
        sink.clear()
        for k, block in enumerate(originals):
            blocks[k] = block
    logger.info(
        "captured %d x %d tokens in %d batches for %d blocks",
        n,
        input_ids.shape[1],
        len(block_kwargs),
        len(blocks),
    )
    return BlockInputs(hidden_states, batch_size, block_kwargs)
