"""Decoder blocks whose weights accelerate keeps off the compute device (``device_map`` CPU or disk offload).

A model loaded with ``from_pretrained(..., device_map=...)`` that puts modules on ``"cpu"`` (with a GPU as the main
device) or ``"disk"``, or passed through ``accelerate.cpu_offload``, ``disk_offload`` or ``dispatch_model``, carries
accelerate hooks (``module._hf_hook``). An ``AlignDevicesHook`` with ``offload=True`` keeps its module's tensors on
the ``meta`` device and, for each forward, loads them from its ``weights_map``: a ``PrefixedDataset`` over a dict of
CPU tensors (``cpu_offload``) or over an ``OffloadedWeightsLoader``, which holds CPU tensors in its ``state_dict``
(``dispatch_model``'s CPU offload) or reads memory-mapped ``<offload folder>/<name>.dat`` files or the checkpoint's
own safetensors (disk offload).

:func:`onloaded` gives :func:`~sparseswaps_prune.llm.pipeline.prune_model` one such block with real tensors on the
compute device and the block's hooks suspended; on exit it makes the block's pruning permanent, writes the pruned
tensors back into the offload storage (the dict or ``state_dict`` entry, or a new ``.dat`` file through accelerate's
``offload_weight``, never the checkpoint's safetensors) and returns them to ``meta``. A later forward through the
hooks and ``save_pretrained`` then read the pruned weights. Blocks that a ``device_map`` places on a device without
offloading (hooks with ``offload=False``) go through it too, so that they return to their own device.

This module imports accelerate only for a model that holds its hooks (a model can only hold them once
``accelerate.hooks`` is loaded).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils import prune

__all__ = ["check_prunable", "execution_device", "is_dispatched", "is_offloaded", "on_device", "onloaded"]


def _align_hooks(module: nn.Module) -> list[Any]:
    """The accelerate ``AlignDevicesHook``s of ``module`` itself (those inside a ``SequentialHook`` included)."""
    hooks = sys.modules.get("accelerate.hooks")
    hook = getattr(module, "_hf_hook", None)
    if hooks is None or hook is None:
        return []
    chain = hook.hooks if isinstance(hook, hooks.SequentialHook) else (hook,)
    return [h for h in chain if isinstance(h, hooks.AlignDevicesHook)]


@dataclass(frozen=True)
class _Offloaded:
    """One tensor that an offloading hook loads for each forward: ``module``'s tensor ``name`` (dotted when the hook
    places submodules), stored under ``name`` in ``hook.weights_map``; ``path`` is its name within the block."""

    module: nn.Module
    hook: Any
    name: str
    path: str

    def tensor(self) -> torch.Tensor:
        owner, _, attr = self.name.rpartition(".")
        return getattr(self.module.get_submodule(owner), attr)

    def storage(self) -> tuple[MutableMapping[str, Any], str]:
        """The writable mapping that holds this tensor and its key there; see :func:`_storage`."""
        return _storage(self.hook.weights_map, self.name)


def _offloaded_tensors(block: nn.Module) -> list[_Offloaded]:
    """Every tensor of ``block`` that an accelerate hook with ``offload=True`` keeps in its ``weights_map``: the
    names the hook itself loads in its ``pre_forward``."""
    from accelerate.utils import named_module_tensors

    found = []
    for module_name, module in block.named_modules():
        for hook in _align_hooks(module):
            if not hook.offload:
                continue
            names = named_module_tensors(
                module, include_buffers=hook.offload_buffers, recurse=hook.place_submodules, remove_non_persistent=True
            )
            prefix = f"{module_name}." if module_name else ""
            found.extend(_Offloaded(module, hook, name, prefix + name) for name, _ in names)
    return found


def is_dispatched(module: nn.Module) -> bool:
    """Whether accelerate's ``AlignDevicesHook``s place any tensor of ``module`` or of its submodules (a
    ``device_map`` over several devices or with offload, ``cpu_offload``, ``disk_offload``, ``dispatch_model``),
    offloaded or not. ``module`` is not modified."""
    return any(_align_hooks(sub) for sub in module.modules())


def is_offloaded(module: nn.Module) -> bool:
    """Whether accelerate keeps any tensor of ``module`` or of its submodules off-device (an ``AlignDevicesHook``
    with ``offload=True``, as a ``device_map`` with ``"cpu"``/``"disk"`` entries or ``cpu_offload`` attaches).
    ``module`` is not modified."""
    return any(hook.offload for sub in module.modules() for hook in _align_hooks(sub))


def execution_device(module: nn.Module) -> torch.device | None:
    """The device on which accelerate's hook of ``module`` itself runs its forward (where an offloaded module's
    inputs must go), or None when ``module`` has no such hook."""
    for hook in _align_hooks(module):
        if hook.execution_device is not None:
            return torch.device(hook.execution_device)
    return None


def _storage(weights_map: Mapping[str, Any], name: str) -> tuple[MutableMapping[str, Any], str]:
    """Resolve ``weights_map[name]`` through accelerate's ``PrefixedDataset`` wrappers to the mapping that holds it and
    its key there: a dict of CPU tensors, or an ``OffloadedWeightsLoader`` (whose index is writable when it has a
    ``save_folder`` for new ``.dat`` files, or whose ``state_dict`` holds the key).

    Raises:
        ValueError: the tensor lives where it cannot be replaced (naming the fix).
    """
    from accelerate.utils import OffloadedWeightsLoader, PrefixedDataset

    key = name
    while isinstance(weights_map, PrefixedDataset):
        key, weights_map = weights_map.prefix + key, weights_map.dataset
    if isinstance(weights_map, OffloadedWeightsLoader):
        if key in weights_map.state_dict or weights_map.save_folder is not None:
            return weights_map, key
        raise ValueError(
            f"offloaded tensor {key} is read from {weights_map.index.get(key)} and its offload loader has no "
            "folder to write the pruned tensor to (the checkpoint itself is never overwritten); load the model "
            "with from_pretrained(..., offload_folder=...) (or dispatch_model with offload_dir=)"
        )
    if isinstance(weights_map, MutableMapping):
        return weights_map, key
    raise ValueError(
        f"offloaded tensor {key} lives in a read-only {type(weights_map).__name__}; offload through "
        "from_pretrained(device_map=..., offload_folder=...), dispatch_model or cpu_offload"
    )


def _store(storage: MutableMapping[str, Any], key: str, value: torch.Tensor) -> None:
    """Replace ``storage[key]`` with the CPU tensor ``value`` (any shape and dtype): a new entry of a dict or of an
    ``OffloadedWeightsLoader.state_dict``, else a memory-mapped ``<save_folder>/<key>.dat`` file written by
    accelerate's ``offload_weight``, which also rewrites the loader's index entry (and the folder's ``index.json``,
    when there is one) so that the loader reads that file from now on."""
    from accelerate.utils import OffloadedWeightsLoader, offload_weight, save_offload_index

    if not isinstance(storage, OffloadedWeightsLoader):
        storage[key] = value
    elif key in storage.state_dict:
        storage.state_dict[key] = value
    else:
        offload_weight(value, key, storage.save_folder, index=storage.index)
        if os.path.isfile(os.path.join(storage.save_folder, "index.json")):
            save_offload_index({key: storage.index[key]}, storage.save_folder)


def check_prunable(model: nn.Module, blocks: nn.ModuleList, *, checkpoint: bool, distributed: bool) -> None:
    """Check, before anything is modified, that :func:`~sparseswaps_prune.llm.pipeline.prune_model` can prune
    ``model``, whose decoder blocks are ``blocks``, when accelerate offloads some of its weights (nothing to check
    otherwise). Nothing is modified.

    Raises:
        ValueError: ``model`` has offloaded tensors and a checkpoint directory or ``distributed`` was asked for, or an
            offloaded tensor of ``blocks`` lives where the pruned one cannot be written (naming the fix).
    """
    if not is_offloaded(model):
        return
    if checkpoint:
        raise ValueError(
            "checkpoint_dir does not work with a model whose weights accelerate offloads (device_map with 'cpu' or "
            "'disk' entries); drop checkpoint_dir, or load the model without offloading"
        )
    if distributed:
        raise ValueError(
            "distributed=True does not work with a model whose weights accelerate offloads (the ranks would write "
            "the same offload files); prune it in one process, or load the model without offloading"
        )
    for tensor in _offloaded_tensors(blocks):
        tensor.storage()


@contextlib.contextmanager
def _hooks_suspended(block: nn.Module) -> Iterator[None]:
    """Inside, every module of ``block`` with an ``AlignDevicesHook`` runs its own ``forward`` without accelerate's
    hook (which would reload the offloaded tensors from storage and move the inputs to its execution device); restored
    on exit."""
    wrapped = {module: module.forward for module in block.modules() if _align_hooks(module)}
    try:
        for module in wrapped:
            module.forward = module._old_forward
        yield
    finally:
        for module, forward in wrapped.items():
            module.forward = forward


def _make_permanent(block: nn.Module) -> None:
    """Remove every ``torch.nn.utils.prune`` reparametrization in ``block``, in place: each pruned tensor becomes a
    plain parameter holding ``orig * mask`` (exact zeros where pruned)."""
    for module in block.modules():
        for hook in list(module._forward_pre_hooks.values()):
            if isinstance(hook, prune.BasePruningMethod):
                prune.remove(module, hook._tensor_name)


@contextlib.contextmanager
def onloaded(block: nn.Module, device: torch.device | str) -> Iterator[nn.Module]:
    """Materialise a ``block`` that accelerate dispatches on ``device`` for pruning, then write it back.

    On entry every tensor that accelerate offloads is loaded from its hook's ``weights_map`` into a new tensor on
    ``device`` (storage is never aliased), the block's other tensors (those a ``device_map`` placed on a device) are
    moved to ``device``, and the block's hooks are suspended, so that ``block(...)`` runs on the materialised tensors
    as a plain module.

    On exit the hooks are restored and every ``torch.nn.utils.prune`` reparametrization in ``block`` is made permanent
    (``weight = weight_orig * weight_mask``: exact zeros; ``weight_orig``/``weight_mask`` disappear, as
    :func:`~sparseswaps_prune.llm.pipeline.finalize` does), since it cannot live on ``meta``. Unless the body
    raised, each offloaded tensor is then written back (on the CPU, in the block's dtype) into its storage: the dict
    entry of CPU offload, or a memory-mapped ``.dat`` file in the offload folder through accelerate's
    ``offload_weight`` for disk offload (the checkpoint's safetensors are never written). Offloaded tensors return
    to ``meta`` and the others to the devices they had on entry. When the body raises, nothing is written back: the
    stored weights stay those of entry.

    Args:
        block: a module with accelerate hooks (:func:`is_dispatched`); modified in place as described.
        device: where the tensors are materialised.

    Yields:
        ``block`` itself.

    Raises:
        ValueError: an offloaded tensor cannot be written back (see :func:`check_prunable`), raised on entry.
    """
    from accelerate.utils import set_module_tensor_to_device

    device = torch.device(device)
    offloaded = _offloaded_tensors(block)
    storages = [tensor.storage() for tensor in offloaded]
    paths = {tensor.path for tensor in offloaded}
    tensors = [*block.named_parameters(), *block.named_buffers()]
    others = {name: tensor.device for name, tensor in tensors if name not in paths}
    written = False
    try:
        for tensor in offloaded:
            value = tensor.hook.weights_map[tensor.name].to(device, copy=True)
            set_module_tensor_to_device(tensor.module, tensor.name, device, value=value)
        block.to(device)
        with _hooks_suspended(block):
            yield block
        written = True
    finally:
        _make_permanent(block)
        for tensor, (storage, key) in zip(offloaded, storages, strict=True):
            if written:
                _store(storage, key, tensor.tensor().detach().cpu())
            set_module_tensor_to_device(tensor.module, tensor.name, "meta")
        for name, original in others.items():
            set_module_tensor_to_device(block, name, original)


@contextlib.contextmanager
def on_device(block: nn.Module, device: torch.device) -> Iterator[None]:
    """``block`` on ``device`` inside (materialised there when accelerate dispatches it), back outside."""
    if is_dispatched(block):
        with onloaded(block, device):
            yield
    else:
        block.to(device)
        try:
            yield
        finally:
            block.to("cpu")
