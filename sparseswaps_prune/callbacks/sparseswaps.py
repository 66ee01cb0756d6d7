"""Lightning callback: calibrate, then prune every selected linear layer by warmstart + SparseSwaps."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import islice
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from torch import nn
from torch.nn.utils import prune

from sparseswaps_prune.core.checks import check_budget
from sparseswaps_prune.core.gram import GramAccumulator
from sparseswaps_prune.core.losses import weight_losses
from sparseswaps_prune.core.refit import REFIT_DAMP
from sparseswaps_prune.core.warmstart import WARMSTARTS
from sparseswaps_prune.llm.layers import PrunableLayer, _check_patterns, find_layers, input_hooks
from sparseswaps_prune.llm.pipeline import apply_mask
from sparseswaps_prune.prune import SparseSwapsMethod

logger = logging.getLogger(__name__)

__all__ = ["LayerStats", "SparseSwapsPruning", "all_reduce_grams", "restore_masks"]

MODES = ("one_shot", "sequential")


@dataclass
class LayerStats:
    """What pruning one layer did (``SparseSwapsPruning.stats[name]``).

    Attributes:
        name: qualified module name inside the LightningModule.
        loss_before: summed layer loss ``sum_i r_i^T G r_i`` of the warmstart mask (with ``objective="refit"``:
            of its re-fitted weights).
        loss_after: the same for the refined mask (never larger); with ``refit="ls"`` the loss of the
            re-fitted weights ``sum_i (w_i - v_i)^T G (w_i - v_i)``.
        swaps: total number of 1-swaps applied.
        sparsity: fraction of the layer's weights that are zero in the mask.
        n_tokens: calibration tokens in the layer's Gram (summed over all ranks under DDP).
        seconds: time to compute the mask.
    """

    name: str
    loss_before: float
    loss_after: float
    swaps: int
    sparsity: float
    n_tokens: int
    seconds: float

    @property
    def reduction(self) -> float:
        """``1 - loss_after / loss_before`` (0 when the warmstart had no loss)."""
        return 0.0 if self.loss_before <= 0 else 1.0 - self.loss_after / self.loss_before


@contextmanager
def _same_param_slot(module: nn.Module, old_name: str, new_name: str) -> Iterator[None]:
    """Inside, ``torch.nn.utils.prune`` swaps parameter ``old_name`` for ``new_name`` (``weight`` <->
    ``weight_orig``); afterwards ``new_name`` is moved into ``old_name``'s slot of ``module._parameters``.

    prune appends the new name at the end, which changes ``module.parameters()`` order: an optimizer built
    before pruning (the usual case in Lightning: ``configure_optimizers`` runs before ``on_fit_start``) and one
    built after resuming from a checkpoint would disagree on the order, and ``optimizer.load_state_dict``
    would pair momentum buffers with the wrong tensors."""
    order = list(module._parameters)
    yield
    params = module._parameters
    if new_name in params and old_name in order:
        order[order.index(old_name)] = new_name
        reordered = [(k, params[k]) for k in order if k in params] + [
            (k, v) for k, v in params.items() if k not in order
        ]
        params.clear()
        params.update(reordered)


def restore_masks(module: nn.Module, state_dict: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Re-create the ``torch.nn.utils.prune`` reparametrization of every layer whose ``<name>.weight_mask``
    is in ``state_dict``, so that ``module.load_state_dict(state_dict)`` (with its ``weight_orig`` and
    ``weight_mask`` keys) then loads strictly.

    Call it from ``LightningModule.on_load_checkpoint(self, checkpoint)`` as
    ``restore_masks(self, checkpoint["state_dict"])`` to make ``MyModule.load_from_checkpoint(path)`` work
    on a checkpoint written after :class:`SparseSwapsPruning` pruned; inside ``Trainer.fit(ckpt_path=...)``
    the callback does this itself.

    Returns:
        The qualified names of the layers given a mask (layers already pruned are left alone).
    """
    restored = []
    for key, mask in state_dict.items():
        if not key.startswith(prefix) or not key.endswith(".weight_mask"):
            continue
        name = key[len(prefix) : -len(".weight_mask")]
        try:
            layer = module.get_submodule(name)
        except AttributeError:
            continue  # strict loading reports the unexpected key
        if prune.is_pruned(layer) and hasattr(layer, "weight_mask"):
            continue
        with _same_param_slot(layer, "weight", "weight_orig"):
            prune.custom_from_mask(layer, "weight", mask.to(device=layer.weight.device, dtype=layer.weight.dtype))
        restored.append(name)
    return restored


def all_reduce_grams(accumulators: Mapping[str, GramAccumulator], device: torch.device | str | None = None) -> None:
    """Sum every accumulator's Gram and token count over all processes of the default group, in place.

    Afterwards every rank holds the same Grams (the Gram of all ranks' calibration tokens), so identical
    weights give identical masks. Call on every rank with the same keys in the same order. An accumulator
    that saw no tokens on this rank contributes zeros (allocated on ``device``; the default is CPU, which
    gloo needs; NCCL needs the CUDA device)."""
    import torch.distributed as dist

    for acc in accumulators.values():
        if acc.gram is None:
            acc.gram = torch.zeros(acc.d_in, acc.d_in, dtype=acc.dtype, device=device or "cpu")
        count = torch.tensor([acc.n_tokens], dtype=torch.float64, device=acc.gram.device)
        dist.all_reduce(acc.gram, op=dist.ReduceOp.SUM)
        dist.all_reduce(count, op=dist.ReduceOp.SUM)
        acc.n_tokens = int(count.item())


@contextmanager
def _eval_mode(module: nn.Module) -> Iterator[None]:
    """``module.eval()`` (no dropout during calibration), restoring each submodule's own mode after."""
    modes = {m: m.training for m in module.modules()}
    module.eval()
    try:
        yield
    finally:
        for m, training in modes.items():
            m.train(training)


class SparseSwapsPruning(pl.Callback):
    """Prune a LightningModule's linear layers with warmstart + SparseSwaps refinement.

    At the chosen moment (``when``) the callback runs ``calibration_batches`` batches through the module under
    ``torch.no_grad()``, accumulates each selected layer's input Gram matrix ``G = sum_t x_t x_t^T`` with
    temporary forward pre-hooks, computes a mask per layer (a ``warmstart`` mask, then exact loss-decreasing
    1-swaps per row against ``G``, keeping each row's kept count) and installs it as the standard
    ``torch.nn.utils.prune`` reparametrization (``weight_orig`` parameter, ``weight_mask`` buffer): the weight
    is recomputed as ``weight_orig * weight_mask`` on every forward, so pruned weights stay exactly zero
    while training goes on, and both tensors are saved in checkpoints.

    Compared with Lightning's own ``ModelPruning`` (magnitude/random/``ln`` criteria on the weights alone),
    this adds a calibration pass, data-aware masks that minimise each layer's output reconstruction error
    ``||(W - M*W) X||^2`` exactly by 1-swaps, per-row budgets and N:M semi-structured sparsity. Migration:
    ``ModelPruning("l1_unstructured", amount=0.6)`` -> ``SparseSwapsPruning(sparsity=0.6)``.

    Args:
        sparsity: fraction of each row's weights pruned, in ``[0, 1)``; exclusive with ``nm``.
        nm: ``(n, m)``: keep ``n`` of every ``m`` consecutive inputs of each row (e.g. ``(2, 4)``).
        warmstart: ``"magnitude"``, ``"wanda"`` or ``"ria"``: the mask refinement starts from.
        max_iters: 1-swap iterations per layer (0: warmstart mask only).
        calibration_batches: batches taken from the calibration dataloader (>= 1).
        include, exclude: fnmatch patterns on qualified module names (as in ``named_modules()``); default:
            every ``nn.Linear`` and transformers ``Conv1D`` in the module, ``lm_head`` included.
        calibration_dataloader: an iterable of batches; default: the fit's train dataloader.
        mode: ``"one_shot"``: one calibration pass over the dense model, then every layer is pruned.
            ``"sequential"``: layers are pruned one by one in module order, each with a Gram collected
            after the layers before it were pruned (so later layers see the pruned model's activations).
            It costs one calibration pass per layer (``n_layers * calibration_batches`` forwards).
        when: ``"fit_start"`` (in ``on_fit_start``, after the optimizers exist) or an epoch number (in
            ``on_train_epoch_start`` of the first epoch ``>= when``).
        scope: ``"row"`` (each row keeps its count) or ``"layer"`` (only each layer's count; refinement also
            moves weights between rows).
        refit: ``"none"`` or ``"ls"``: after a layer's mask is final, re-fit its kept weights by exact per-row
            least squares on the layer's Gram (ridge ``damp``); the re-fitted weights land in ``weight_orig``
            (so the masked ``weight`` is ``re-fitted * mask``), and training continues from them.
        objective: ``"mask"`` (swaps judged with the weights as they are) or ``"refit"`` (judged by the loss
            after re-fitting; needs ``refit="ls"``).
        damp: relative ridge dampening of the re-fit, ``lambda = damp * mean(diag G)`` (default ``REFIT_DAMP``,
            1e-3).
        make_permanent: at ``on_fit_end``, ``prune.remove`` the reparametrization (zeros written into plain
            ``weight`` parameters). Under spawn-based strategies (``ddp_spawn``, ``ddp_fork``) this is always
            done at the end of fit in the worker processes, so that the module of the main process, into which
            Lightning loads rank 0's weights non-strictly, gets the pruned weights.

    Calibration contract (one forward per batch, after moving it with ``pl_module.transfer_batch_to_device``):
    ``pl_module.calibration_step(batch)`` if the module defines it; else ``pl_module(batch)`` for a tensor,
    ``pl_module(**batch)`` for a mapping, ``pl_module(batch[0])`` for a list/tuple (the ``(inputs, targets)``
    convention). Any other batch type needs ``calibration_step``.

    Under DDP each rank calibrates on its own batches and the Grams and token counts are all-reduced (sum)
    before the masks are computed, so every rank installs the same masks. Resuming with
    ``Trainer.fit(ckpt_path=...)`` re-creates the saved masks before the state dict is loaded and does not
    prune again (the callback's state is ``{"pruned": True}``); for ``load_from_checkpoint`` see
    :func:`restore_masks`.

    After pruning, ``stats`` maps each layer name to its :class:`LayerStats`; the per-layer losses, swaps and
    seconds also go to every logger of the trainer (``sparseswaps/<layer>/<metric>``) and to ``logging``.

    Example:
        >>> trainer = Trainer(callbacks=[SparseSwapsPruning(sparsity=0.5, include=["*mlp*"])])
    """

    def __init__(
        self,
        sparsity: float | None = None,
        *,
        nm: tuple[int, int] | None = None,
        warmstart: str = "wanda",
        max_iters: int = 100,
        calibration_batches: int = 32,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
        calibration_dataloader: Iterable[Any] | None = None,
        mode: str = "one_shot",
        when: str | int = "fit_start",
        make_permanent: bool = False,
        scope: str = "row",
        refit: str = "none",
        objective: str = "mask",
        damp: float = REFIT_DAMP,
    ) -> None:
        if sparsity is None and nm is None:
            raise ValueError("give sparsity= (e.g. 0.6) or nm= (e.g. (2, 4))")
        if nm is not None:
            if isinstance(nm, (list, tuple)) and len(nm) == 2:
                nm = tuple(nm)
            check_budget(sparsity, nm, nm[1] if isinstance(nm, tuple) and isinstance(nm[1], int) else 1)
        else:
            check_budget(sparsity, None, 1)
        if warmstart not in WARMSTARTS:
            raise ValueError(f"unknown warmstart {warmstart!r}; choose one of {', '.join(WARMSTARTS)}")
        for arg, value, low in (("max_iters", max_iters, 0), ("calibration_batches", calibration_batches, 1)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{arg} must be an int, got {value!r}")
            if value < low:
                raise ValueError(f"{arg} must be >= {low}, got {value}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if isinstance(when, bool) or not (when == "fit_start" or (isinstance(when, int) and when >= 0)):
            raise ValueError(f"when must be 'fit_start' or an epoch number >= 0, got {when!r}")
        for arg, value, choices in (
            ("scope", scope, ("row", "layer")),
            ("refit", refit, ("none", "ls")),
            ("objective", objective, ("mask", "refit")),
        ):
            if value not in choices:
                raise ValueError(f"{arg} must be one of {', '.join(choices)}, got {value!r}")
        if objective == "refit" and refit == "none":
            raise ValueError("objective='refit' chooses masks for re-fitted weights: also pass refit='ls'")
        if isinstance(damp, bool) or not isinstance(damp, (int, float)) or not damp >= 0:
            raise ValueError(f"damp must be a number >= 0, got {damp!r}")
        if not isinstance(make_permanent, bool):
            raise TypeError(f"make_permanent must be a bool, got {make_permanent!r}")
        if calibration_dataloader is not None and not isinstance(calibration_dataloader, Iterable):
            raise TypeError(f"calibration_dataloader must be an iterable of batches, got {calibration_dataloader!r}")
        self.sparsity, self.nm, self.warmstart, self.max_iters = sparsity, nm, warmstart, max_iters
        self.calibration_batches = calibration_batches
        self.include = _check_patterns(include, "include")
        self.exclude = _check_patterns(exclude, "exclude")
        self.calibration_dataloader = calibration_dataloader
        self.mode, self.when, self.make_permanent = mode, when, make_permanent
        self.scope, self.refit, self.objective, self.damp = scope, refit, objective, float(damp)
        self.pruned = False
        self.stats: dict[str, LayerStats] = {}
        self._pruned_names: list[str] = []
        self._load_hook: Any = None

    # ---------------------------------------------------------------- state and checkpoints

    def state_dict(self) -> dict[str, Any]:
        return {"pruned": self.pruned}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pruned = self.pruned or bool(state_dict.get("pruned", False))

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Lightning loads the module's state dict before calling callbacks' on_load_checkpoint, so the masks
        # saved in a checkpoint are re-created by a load_state_dict pre-hook (removed in teardown).
        def pre_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_args: Any) -> None:
            names = restore_masks(module, state_dict, prefix)
            if names:
                self.pruned = True
                self._pruned_names = sorted(set(self._pruned_names) | set(names))
                logger.info("SparseSwapsPruning: restored %d masks from the state dict", len(names))

        if self._load_hook is None:
            self._load_hook = pl_module.register_load_state_dict_pre_hook(pre_hook)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._load_hook is not None:
            self._load_hook.remove()
            self._load_hook = None
        if stage == "fit" and isinstance(getattr(trainer.strategy, "launcher", None), _MultiProcessingLauncher):
            # ddp_spawn / ddp_fork: after teardown Lightning sends rank 0's state dict to the main process and loads
            # it into the (still dense) module there with strict=False, which would drop weight_orig / weight_mask
            # and leave the initial weights in every pruned layer. Plain pruned weights load correctly.
            self._make_permanent(pl_module)

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if any(k.endswith(".weight_mask") for k in checkpoint.get("state_dict", {})):
            self.pruned = True
        for module in pl_module.modules():  # weight = weight_orig * mask with the loaded tensors
            if prune.is_pruned(module) and hasattr(module, "weight_mask"):
                module.weight = module.weight_orig * module.weight_mask

    # ---------------------------------------------------------------- when to prune

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.when == "fit_start" and not self.pruned:
            self.prune(trainer, pl_module)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.when != "fit_start" and trainer.current_epoch >= self.when and not self.pruned:
            self.prune(trainer, pl_module)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.make_permanent:
            self._make_permanent(pl_module)

    def _make_permanent(self, pl_module: pl.LightningModule) -> None:
        for name in self._pruned_names:
            module = pl_module.get_submodule(name)
            if prune.is_pruned(module) and hasattr(module, "weight_mask"):
                with _same_param_slot(module, "weight_orig", "weight"):
                    prune.remove(module, "weight")

    # ---------------------------------------------------------------- pruning

    def layers(self, pl_module: nn.Module) -> list[PrunableLayer]:
        """The layers this callback prunes, in module order."""
        return find_layers(pl_module, prefix="", include=self.include, exclude=self.exclude)

    def prune(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Calibrate and prune now (what the hooks call); sets ``pruned`` and ``stats``."""
        layers = self.layers(pl_module)
        if not layers:
            raise ValueError(
                f"SparseSwapsPruning: no nn.Linear/Conv1D in {type(pl_module).__name__} matches include="
                f"{self.include} exclude={self.exclude}; check the patterns against named_modules()"
            )
        dataloader = self._dataloader(trainer, pl_module)
        distributed = trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()
        start = time.perf_counter()
        if self.mode == "one_shot":
            accs = self._calibrate(pl_module, layers, dataloader, distributed)
            for layer in layers:
                self._prune_layer(layer, accs[layer.name])
        else:
            for layer in layers:
                self._prune_layer(layer, self._calibrate(pl_module, [layer], dataloader, distributed)[layer.name])
        self.pruned = True
        self._pruned_names = [layer.name for layer in layers]
        self._log(trainer, time.perf_counter() - start)

    def _dataloader(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Iterable[Any]:
        """The explicit ``calibration_dataloader``, else the fit's train dataloader as the training loop will
        see it (set up now if needed, so under DDP each rank gets its own shard), else the datamodule's or
        the module's ``train_dataloader()``."""
        if self.calibration_dataloader is not None:
            return self.calibration_dataloader
        if trainer.train_dataloader is None and trainer.training:
            trainer.fit_loop.setup_data()  # what the fit loop does right after on_fit_start; idempotent
        loader = trainer.train_dataloader
        if loader is not None and not isinstance(loader, (Mapping, list, tuple)):
            return loader
        if trainer.datamodule is not None:
            return trainer.datamodule.train_dataloader()
        return pl_module.train_dataloader()

    def _forward(self, pl_module: pl.LightningModule, batch: Any) -> None:
        batch = pl_module.transfer_batch_to_device(batch, pl_module.device, 0)
        if callable(getattr(pl_module, "calibration_step", None)):
            pl_module.calibration_step(batch)
        elif isinstance(batch, torch.Tensor):
            pl_module(batch)
        elif isinstance(batch, Mapping):
            pl_module(**batch)
        elif isinstance(batch, (list, tuple)) and batch:
            pl_module(batch[0])
        else:
            raise TypeError(
                f"SparseSwapsPruning cannot feed a {type(batch).__name__} batch to the module; define "
                "calibration_step(self, batch) on the LightningModule to run its forward"
            )

    def _calibrate(
        self, pl_module: pl.LightningModule, layers: list[PrunableLayer], dataloader: Iterable[Any], distributed: bool
    ) -> dict[str, GramAccumulator]:
        accs = {layer.name: GramAccumulator(layer.d_in) for layer in layers}
        n_batches = 0
        with torch.no_grad(), _eval_mode(pl_module), input_hooks(layers, lambda key, x: accs[key].add(x.detach())):
            for batch in islice(dataloader, self.calibration_batches):
                self._forward(pl_module, batch)
                n_batches += 1
        if n_batches == 0:
            raise ValueError("SparseSwapsPruning: the calibration dataloader yielded no batches")
        if distributed:
            all_reduce_grams(accs, device=pl_module.device)
        for name, acc in accs.items():
            if acc.gram is None:
                raise ValueError(f"SparseSwapsPruning: layer {name} received no input during calibration; exclude it")
        return accs

    def _prune_layer(self, layer: PrunableLayer, acc: GramAccumulator) -> None:
        start = time.perf_counter()
        module = layer.module
        weight = layer.weight_2d().detach()
        existing = getattr(module, "weight_mask", None)
        if existing is None:
            existing = torch.ones_like(weight, dtype=torch.bool)
        else:
            existing = existing.bool().t() if layer.is_transposed else existing.bool()
        method = SparseSwapsMethod(
            self.sparsity, grams=[acc.gram], tensors=[(module, "weight")], warmstart=self.warmstart, nm=self.nm,
            max_iters=self.max_iters, scope=self.scope, refit=self.refit, damp=self.damp, objective=self.objective,
        )  # fmt: skip
        gram = acc.gram.to(weight.device)
        mask = method.layer_mask(weight, existing, gram, layer.name)  # with refit="ls" also the re-fitted weights
        result = method.results[-1]
        loss_after = result.loss_after if result.weight is None else weight_losses(weight, result.weight, gram)
        with _same_param_slot(module, "weight", "weight_orig"):
            apply_mask(layer, mask, result.weight)
        self.stats[layer.name] = LayerStats(
            name=layer.name,
            loss_before=float(result.loss_before.sum()),
            loss_after=float(loss_after.sum()),
            swaps=int(result.n_swaps.sum()),
            sparsity=1.0 - float(mask.float().mean()),
            n_tokens=acc.n_tokens,
            seconds=time.perf_counter() - start,
        )

    def _log(self, trainer: pl.Trainer, seconds: float) -> None:
        metrics: dict[str, float] = {}
        for s in self.stats.values():
            for key in ("loss_before", "loss_after", "swaps", "sparsity", "seconds"):
                metrics[f"sparseswaps/{s.name}/{key}"] = float(getattr(s, key))
        before = sum(s.loss_before for s in self.stats.values())
        after = sum(s.loss_after for s in self.stats.values())
        metrics.update(
            {"sparseswaps/loss_before": before, "sparseswaps/loss_after": after, "sparseswaps/seconds": seconds}
        )
        for lg in trainer.loggers:
            lg.log_metrics(metrics, step=trainer.global_step)
        if trainer.is_global_zero:
            for s in self.stats.values():
                logger.info(
                    "%s: sparsity %.3f, loss %.6g -> %.6g (%.1f%% lower), %d swaps, %.2f s",
                    s.name, s.sparsity, s.loss_before, s.loss_after, 100 * s.reduction, s.swaps, s.seconds,
                )  # fmt: skip
            reduction = 0.0 if before <= 0 else 1 - after / before
            logger.info(
                "SparseSwapsPruning (%s): %d layers, summed loss %.6g -> %.6g (%.1f%% lower) in %.1f s",
                self.mode, len(self.stats), before, after, 100 * reduction, seconds,
            )  # fmt: skip
