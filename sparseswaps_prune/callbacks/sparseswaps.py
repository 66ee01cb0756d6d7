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
from torch import nn
from torch.nn.utils import prune

from sparseswaps_prune.core.checks import check_budget, check_gram, check_int
from sparseswaps_prune.core.gram import GramAccumulator
from sparseswaps_prune.core.layer import LayerOutcome, prune_layer
from sparseswaps_prune.core.spec import DSnoTRefine, PruneSpec, build_spec
from sparseswaps_prune.modules import (
    PrunableLayer,
    apply_mask,
    check_patterns,
    find_layers,
    input_hooks,
    replace_weight_mask,
    restore_masks,
    same_param_slot,
)
from sparseswaps_prune.recipes import layer_spec

logger = logging.getLogger(__name__)

__all__ = ["LayerStats", "SparseSwapsPruning", "all_reduce_grams"]

MODES = ("one_shot", "sequential")


@dataclass
class LayerStats:
    """What pruning one layer did (``SparseSwapsPruning.stats[name]``).

    Attributes:
        name: qualified module name inside the LightningModule.
        loss_start: summed layer loss ``sum_i r_i^T G r_i`` of the start mask (original weights).
        loss_refined: the same for the refined mask (never larger with SparseSwaps).
        loss_final: the loss of the final weights (``loss_refined`` when the weights are kept; with a re-fit
            ``sum_i (w_i - v_i)^T G (w_i - v_i)``).
        swaps: total number of moves (SparseSwaps) or updates (DSnoT) applied.
        sparsity: fraction of the layer's weights that are zero in the mask.
        n_tokens: calibration tokens in the layer's Gram (summed over all ranks under DDP).
        seconds: time to compute the mask.
    """

    name: str
    loss_start: float
    loss_refined: float
    loss_final: float
    swaps: int
    sparsity: float
    n_tokens: int
    seconds: float

    @property
    def reduction(self) -> float:
        """``1 - loss_final / loss_start`` (0 when the start mask had no loss)."""
        return 0.0 if self.loss_start <= 0 else 1.0 - self.loss_final / self.loss_start


def all_reduce_grams(accumulators: Mapping[str, GramAccumulator], device: torch.device | str | None = None) -> None:
    """Sum every accumulator's Gram, feature sum (with ``track_sum``), token and sequence counts over all
    processes of the default group, in place.

    Afterwards every rank holds the same Grams (the Gram of all ranks' calibration tokens), so identical
    weights give identical masks. Call on every rank with the same keys in the same order. An accumulator
    that saw no tokens on this rank contributes zeros (allocated on ``device``; the default is CPU, which
    gloo needs; NCCL needs the CUDA device)."""
    import torch.distributed as dist

    for acc in accumulators.values():
        if acc.gram is None:
            acc.gram = torch.zeros(acc.d_in, acc.d_in, dtype=acc.dtype, device=device or "cpu")
        count = torch.tensor([acc.n_tokens, acc.n_sequences], dtype=torch.float64, device=acc.gram.device)
        dist.all_reduce(acc.gram, op=dist.ReduceOp.SUM)
        if acc.track_sum:
            if acc.feature_sum is None:
                acc.feature_sum = torch.zeros(acc.d_in, dtype=acc.dtype, device=acc.gram.device)
            dist.all_reduce(acc.feature_sum, op=dist.ReduceOp.SUM)
        dist.all_reduce(count, op=dist.ReduceOp.SUM)
        acc.n_tokens, acc.n_sequences = (int(c) for c in count.tolist())


def _spawns_workers(trainer: pl.Trainer) -> bool:
    """Whether the fit runs in worker processes started by ``multiprocessing`` (``ddp_spawn``, ``ddp_fork``,
    ``ddp_notebook``), after which Lightning loads rank 0's state dict into the main process's module."""
    # Lightning 2.x has no public way to tell: ``Strategy.launcher`` is public, but every launcher class is
    # private. This is the one private Lightning name the callback uses; keep it here.
    from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher

    return isinstance(getattr(trainer.strategy, "launcher", None), _MultiProcessingLauncher)


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


class _Rollback:
    """Undo for the layers a failed :meth:`SparseSwapsPruning.prune` call changed: :meth:`save` records a layer's
    state (its dense weights, and its mask if it was pruned before) on the CPU before it is changed; :meth:`restore`
    puts every saved layer back (the same ``Parameter`` objects, in the same slots), the last changed first."""

    def __init__(self) -> None:
        self.layers: list[tuple[PrunableLayer, torch.Tensor, torch.Tensor | None]] = []

    def save(self, layer: PrunableLayer) -> None:
        module = layer.module
        pruned = prune.is_pruned(module) and hasattr(module, "weight_mask")
        dense = (module.weight_orig if pruned else module.weight).detach().to("cpu", copy=True)
        mask = module.weight_mask.detach().to("cpu", copy=True) if pruned else None
        self.layers.append((layer, dense, mask))

    def restore(self) -> None:
        for layer, dense, mask in reversed(self.layers):
            module = layer.module
            if mask is None:
                if prune.is_pruned(module) and hasattr(module, "weight_mask"):
                    with same_param_slot(module, "weight_orig", "weight"):
                        prune.remove(module, "weight")
                with torch.no_grad():
                    module.weight.copy_(dense)
            else:
                with torch.no_grad():
                    module.weight_orig.copy_(dense)
                replace_weight_mask(module, mask.to(module.weight_mask.device))
        self.layers.clear()


class SparseSwapsPruning(pl.Callback):
    """Prune a LightningModule's linear layers with warmstart + SparseSwaps refinement, masks only.

    At the chosen moment (``when``) the callback runs ``calibration_batches`` batches through the module under
    ``torch.no_grad()``, accumulates each selected layer's input Gram matrix ``G = sum_t x_t x_t^T`` with
    temporary forward pre-hooks, computes a mask per layer (by default ADMM's mask refined by 25 iterations of exact,
    loss-decreasing 1-swaps per row against ``G``: :data:`~sparseswaps_prune.core.spec.SPARSESWAPS_SPEC`) and
    installs it as the standard ``torch.nn.utils.prune`` reparametrization (``weight_orig`` the original parameter,
    ``weight_mask`` a buffer): the weight is recomputed as ``weight_orig * weight_mask`` on every forward, so pruned
    weights stay exactly zero while training goes on, and both tensors are saved in checkpoints.

    Compared with Lightning's own ``ModelPruning`` (magnitude/random/``ln`` criteria on the weights alone),
    this adds a calibration pass, data-aware masks that minimise each layer's output reconstruction error
    ``||(W - M*W) X||^2`` (exactly, by 1-swaps), weights that compensate if asked for, per-row budgets and N:M
    semi-structured sparsity. Migration:
    ``ModelPruning("l1_unstructured", amount=0.6)`` -> ``SparseSwapsPruning(sparsity=0.6)``.

    Args:
        sparsity: fraction of each row's (or with ``scope="layer"`` each layer's) weights pruned, in ``[0, 1)``;
            exclusive with ``nm`` (changes the budget of ``spec``; default: the spec's, 0.6).
        nm: ``(n, m)``: keep ``n`` of every ``m`` consecutive inputs of each row (e.g. ``(2, 4)``).
        spec: how each layer is pruned (:class:`~sparseswaps_prune.core.spec.PruneSpec`; default
            :data:`~sparseswaps_prune.core.spec.SPARSESWAPS_SPEC`, masks only). Build others with
            :func:`~sparseswaps_prune.core.spec.build_spec`, or change it with ``**options``; exclusive with
            ``recipe``. A spec that updates weights writes them into ``weight_orig``, so training continues from them.
        recipe: a name in :data:`~sparseswaps_prune.recipes.RECIPES`: its layer spec (e.g. ``"alps"``; block tuning
            is the Hugging Face pipeline's and does not run here).
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
        **options: flat options changing ``spec`` (:func:`~sparseswaps_prune.core.spec.build_spec`), e.g.
            ``max_iters=100``, ``start="magnitude"``, ``scope="layer"``, ``weights="ls"`` (a least-squares re-fit
            into ``weight_orig``); ``warmstart`` (now ``start``) is accepted with a ``DeprecationWarning``.
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
    :func:`~sparseswaps_prune.modules.restore_masks`.

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
        spec: PruneSpec | None = None,
        recipe: str | None = None,
        calibration_batches: int = 32,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
        calibration_dataloader: Iterable[Any] | None = None,
        mode: str = "one_shot",
        when: str | int = "fit_start",
        make_permanent: bool = False,
        **options: Any,
    ) -> None:
        if sparsity is not None and nm is not None:
            raise ValueError("give sparsity= (e.g. 0.6) or nm= (e.g. (2, 4)), not both")
        nm = tuple(nm) if isinstance(nm, list) else nm
        self.spec = build_spec(layer_spec(spec, recipe), sparsity=sparsity, nm=nm, **options)
        check_int(calibration_batches, "calibration_batches", low=1)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if isinstance(when, bool) or not (when == "fit_start" or (isinstance(when, int) and when >= 0)):
            raise ValueError(f"when must be 'fit_start' or an epoch number >= 0, got {when!r}")
        if not isinstance(make_permanent, bool):
            raise TypeError(f"make_permanent must be a bool, got {make_permanent!r}")
        if calibration_dataloader is not None and not isinstance(calibration_dataloader, Iterable):
            raise TypeError(f"calibration_dataloader must be an iterable of batches, got {calibration_dataloader!r}")
        self.calibration_batches = calibration_batches
        self.include = check_patterns(include, "include")
        self.exclude = check_patterns(exclude, "exclude")
        self.calibration_dataloader = calibration_dataloader
        self.mode, self.when, self.make_permanent = mode, when, make_permanent
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
        if stage == "fit" and _spawns_workers(trainer):
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
                with same_param_slot(module, "weight_orig", "weight"):
                    prune.remove(module, "weight")

    # ---------------------------------------------------------------- pruning

    def layers(self, pl_module: nn.Module) -> list[PrunableLayer]:
        """The layers this callback prunes, in module order."""
        return find_layers(pl_module, prefix="", include=self.include, exclude=self.exclude)

    def prune(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Calibrate and prune now (what the hooks call); sets ``pruned`` and ``stats``.

        All or nothing: if any layer fails (e.g. N:M that does not divide its width, a NaN/Inf Gram from NaN/Inf
        activations), the error is raised with every layer as it was before the call (``one_shot`` checks every
        layer and computes every mask before installing any; ``sequential`` restores the layers it had pruned)."""
        layers = self.layers(pl_module)
        if not layers:
            raise ValueError(
                f"SparseSwapsPruning: no nn.Linear/Conv1D in {type(pl_module).__name__} matches include="
                f"{self.include} exclude={self.exclude}; check the patterns against named_modules()"
            )
        dataloader = self._dataloader(trainer, pl_module)
        distributed = trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()
        start = time.perf_counter()
        for layer in layers:  # widths vs N:M, before any calibration
            self._check_layer(layer)
        stats, rollback = dict(self.stats), _Rollback()
        try:
            if self.mode == "one_shot":
                # Every layer's Gram is checked and every mask and weight computed before any is installed.
                accs = self._calibrate(pl_module, layers, dataloader, distributed)
                for layer in layers:
                    self._check_layer(layer, accs[layer.name])
                outcomes = [self._prune_layer(layer, accs[layer.name], install=False) for layer in layers]
                for layer, outcome in zip(layers, outcomes, strict=True):
                    rollback.save(layer)
                    self._install(layer, outcome)
            else:
                # Each layer needs the ones before it installed: on a failure they are all restored.
                for layer in layers:
                    acc = self._calibrate(pl_module, [layer], dataloader, distributed)[layer.name]
                    self._check_layer(layer, acc)
                    rollback.save(layer)
                    self._prune_layer(layer, acc)
        except BaseException:
            if rollback.layers:
                logger.warning(
                    "SparseSwapsPruning: pruning failed; restoring the %d layer(s) it had pruned", len(rollback.layers)
                )
            rollback.restore()
            self.stats = stats
            raise
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
        track_sum = isinstance(self.spec.refine, DSnoTRefine)  # DSnoT needs activation means
        accs = {layer.name: GramAccumulator(layer.d_in, track_sum=track_sum) for layer in layers}
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

    def _check_layer(self, layer: PrunableLayer, acc: GramAccumulator | None = None) -> None:
        """Raise ``ValueError`` naming ``layer`` if it cannot be pruned: its width against N:M, and with ``acc``
        its calibration Gram (finite, a Gram matrix)."""
        budget = self.spec.budget
        try:
            check_budget(budget.sparsity, budget.nm, layer.d_in)
            if acc is not None:
                check_gram(acc.gram, layer.d_in, what="its calibration Gram")
        except ValueError as err:
            raise ValueError(f"SparseSwapsPruning: layer {layer.name}: {err}") from None

    @staticmethod
    def _install(layer: PrunableLayer, outcome: LayerOutcome) -> None:
        """Install ``outcome``'s mask (and weights) as ``layer``'s pruning reparametrization."""
        with same_param_slot(layer.module, "weight", "weight_orig"):
            apply_mask(layer, outcome.keep_mask, outcome.weight)

    def _prune_layer(self, layer: PrunableLayer, acc: GramAccumulator, install: bool = True) -> LayerOutcome:
        module = layer.module
        weight = layer.weight_2d().detach()
        existing = getattr(module, "weight_mask", None)
        if existing is not None:
            existing = existing.bool().t() if layer.is_transposed else existing.bool()
            existing = None if bool(existing.all()) else existing
        # DSnoT's update_threshold is on its per-sequence scale (see GramAccumulator.feature_stats)
        stats = acc.feature_stats(n_samples=acc.n_sequences or None) if acc.track_sum else None
        outcome = prune_layer(
            weight, acc.gram.to(weight.device), self.spec, prior_mask=existing, feature_stats=stats, name=layer.name
        )
        if install:
            self._install(layer, outcome)
        self.stats[layer.name] = LayerStats(
            name=layer.name,
            loss_start=float(outcome.loss.start.sum()),
            loss_refined=float(outcome.loss.refined.sum()),
            loss_final=float(outcome.loss.final.sum()),
            swaps=int(outcome.n_swaps.sum()),
            sparsity=1.0 - float(outcome.keep_mask.float().mean()),
            n_tokens=acc.n_tokens,
            seconds=outcome.seconds_mask + outcome.seconds_weights,
        )
        return outcome

    def _log(self, trainer: pl.Trainer, seconds: float) -> None:
        metrics: dict[str, float] = {}
        for s in self.stats.values():
            for key in ("loss_start", "loss_refined", "loss_final", "swaps", "sparsity", "seconds"):
                metrics[f"sparseswaps/{s.name}/{key}"] = float(getattr(s, key))
        before = sum(s.loss_start for s in self.stats.values())
        after = sum(s.loss_final for s in self.stats.values())
        metrics.update(
            {"sparseswaps/loss_start": before, "sparseswaps/loss_final": after, "sparseswaps/seconds": seconds}
        )
        for lg in trainer.loggers:
            lg.log_metrics(metrics, step=trainer.global_step)
        if trainer.is_global_zero:
            for s in self.stats.values():
                logger.info(
                    "%s: sparsity %.3f, loss %.6g -> %.6g (%.1f%% lower), %d swaps, %.2f s",
                    s.name, s.sparsity, s.loss_start, s.loss_final, 100 * s.reduction, s.swaps, s.seconds,
                )  # fmt: skip
            reduction = 0.0 if before <= 0 else 1 - after / before
            logger.info(
                "SparseSwapsPruning (%s): %d layers, summed loss %.6g -> %.6g (%.1f%% lower) in %.1f s",
                self.mode, len(self.stats), before, after, 100 * reduction, seconds,
            )  # fmt: skip
