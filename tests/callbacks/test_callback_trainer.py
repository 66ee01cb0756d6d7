"""SparseSwapsPruning in real ``lightning.Trainer`` runs: DDP on two CPU processes (gloo), pruning after a
calibration epoch, and checkpoints written by ``ModelCheckpoint`` during fit (before and after pruning).

What ``test_callback.py`` already covers (fit-start pruning, manual checkpoint round trip, argument errors,
hooks removed in single-process runs) is not repeated here. The ``ddp_spawn`` test takes about 15 s (two
processes import torch and Lightning).
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import prune
from torch.utils.data import DataLoader, TensorDataset

from sparseswaps_prune import RECIPES
from sparseswaps_prune.callbacks import SparseSwapsPruning

N_SAMPLES, BATCH = 64, 8

REFIT = RECIPES["sparseswaps-refit"].spec  # Wanda -> SparseSwaps T=10 -> least-squares re-fit


class Regressor(pl.LightningModule):
    """Two linear layers on a fixed random regression task; records the inputs seen during calibration."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(N_SAMPLES, 16, generator=generator)
        self.y = torch.randn(N_SAMPLES, 4, generator=generator)
        self.calibration_inputs: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def calibration_step(self, batch) -> None:
        self.calibration_inputs.append(batch[0].clone())
        self(batch[0])

    def training_step(self, batch, _idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=BATCH)


class DumpPerRank(pl.Callback):
    """At train end, each rank writes its masks, weights, calibration inputs and hook kinds to ``rank{r}.pt``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module):
        layers = {name: m for name, m in pl_module.named_modules() if hasattr(m, "weight_mask")}
        hooks = [
            type(h).__name__
            for m in pl_module.modules()
            for h in [*m._forward_pre_hooks.values(), *m._forward_hooks.values()]
        ]
        torch.save(
            {
                "masks": {n: m.weight_mask.clone() for n, m in layers.items()},
                "weights": {n: m.weight_orig.detach().clone() for n, m in layers.items()},
                "calibration": torch.cat(pl_module.calibration_inputs),
                "n_tokens": {n: s.n_tokens for n, s in trainer.callbacks[0].stats.items()},
                "world_size": trainer.world_size,
                "hooks": hooks,
            },
            os.path.join(self.directory, f"rank{trainer.global_rank}.pt"),
        )


def test_ddp_spawn_two_processes_give_identical_masks(tmp_path):
    model = Regressor()
    cb = SparseSwapsPruning(spec=REFIT, sparsity=0.5, max_iters=20, calibration_batches=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",  # gloo on CPU
        max_epochs=1,
        callbacks=[cb, DumpPerRank(str(tmp_path))],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["world_size"] == r1["world_size"] == 2
    # each rank calibrated on its own shard (DistributedSampler), 2 batches of 8 samples
    assert r0["calibration"].shape == r1["calibration"].shape == (2 * BATCH, 16)
    assert not torch.equal(r0["calibration"], r1["calibration"])
    # ... the Grams were summed over both ranks, so both installed the same masks
    assert set(r0["masks"]) == set(r1["masks"]) == {"net.0", "net.2"}
    for name in r0["masks"]:
        assert torch.equal(r0["masks"][name], r1["masks"][name])
        assert torch.equal(r0["weights"][name], r1["weights"][name])  # DDP kept the replicas in sync
        assert r0["n_tokens"][name] == r1["n_tokens"][name] == 2 * len(r0["calibration"])
    d_in = {"net.0": 16, "net.2": 32}
    for name, mask in r0["masks"].items():
        assert bool((mask.sum(dim=1) == d_in[name] // 2).all())
    # calibration hooks are gone: only the pruning reparametrization's pre-hooks remain
    assert r0["hooks"] and set(r0["hooks"]) == {"CustomFromMask"}
    # the main process's module got the trained weights with the pruning made permanent (Lightning loads rank 0's
    # state dict into it with strict=False, which would drop weight_orig / weight_mask)
    for name, mask in r0["masks"].items():
        layer = model.get_submodule(name)
        assert not prune.is_pruned(layer) and not hasattr(layer, "weight_mask") and not layer._forward_pre_hooks
        assert torch.equal(layer.weight.detach(), r0["weights"][name] * mask)


class EpochProbe(pl.Callback):
    """Whether ``net.0`` is pruned at each training batch, and its weights at the end of epoch 0."""

    def __init__(self) -> None:
        self.pruned: list[tuple[int, bool]] = []
        self.weight_after_epoch0: torch.Tensor | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.pruned.append((trainer.current_epoch, hasattr(pl_module.net[0], "weight_mask")))

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == 0:
            self.weight_after_epoch0 = pl_module.net[0].weight.detach().clone()


def _trainer(tmp_path: Path, *callbacks, **kwargs) -> pl.Trainer:
    options = {
        "accelerator": "cpu",
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": tmp_path,
        **kwargs,
    }
    return pl.Trainer(callbacks=list(callbacks), **options)


def test_masks_applied_after_the_dense_epoch_and_zeros_kept(tmp_path):
    model, probe = Regressor(), EpochProbe()
    cb = SparseSwapsPruning(spec=REFIT, sparsity=0.5, when=1, max_iters=10, calibration_batches=3)
    _trainer(tmp_path, cb, probe, max_epochs=3, enable_checkpointing=False).fit(model)
    per_epoch = N_SAMPLES // BATCH
    assert probe.pruned == [(e, e >= 1) for e in range(3) for _ in range(per_epoch)]
    assert bool((probe.weight_after_epoch0 != 0).all())  # epoch 0 trained densely
    assert len(model.calibration_inputs) == 3  # calibrated on 3 train batches, at the start of epoch 1
    assert all(s.n_tokens == 3 * BATCH for s in cb.stats.values())
    for layer in (model.net[0], model.net[2]):
        mask = layer.weight_mask.bool()
        model(model.x)  # weight = weight_orig * mask after two epochs of steps
        assert bool((layer.weight[~mask] == 0).all()) and bool((layer.weight[mask] != 0).all())


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_model_checkpoint_before_and_after_pruning_resumes_correctly(tmp_path):
    ckpt_dir = tmp_path / "ckpts"
    saver = ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    model = Regressor()
    cb = SparseSwapsPruning(spec=REFIT, sparsity=0.5, when=1, max_iters=10, calibration_batches=2)
    _trainer(tmp_path, cb, saver, max_epochs=2).fit(model)
    masks = {n: model.get_submodule(n).weight_mask.clone() for n in ("net.0", "net.2")}
    dense, pruned = ckpt_dir / "epoch=0.ckpt", ckpt_dir / "epoch=1.ckpt"
    assert torch.load(dense, weights_only=False)["callbacks"]["SparseSwapsPruning"] == {"pruned": False}
    assert torch.load(pruned, weights_only=False)["callbacks"]["SparseSwapsPruning"] == {"pruned": True}

    # resuming from the pruned checkpoint restores the masks and does not prune again
    resumed, cb2 = (
        Regressor(seed=7),
        SparseSwapsPruning(spec=REFIT, sparsity=0.5, when=1, max_iters=10, calibration_batches=2),
    )
    _trainer(tmp_path, cb2, max_epochs=3, enable_checkpointing=False).fit(resumed, ckpt_path=pruned)
    assert cb2.pruned and cb2.stats == {} and resumed.calibration_inputs == []
    for name, mask in masks.items():
        layer = resumed.get_submodule(name)
        assert torch.equal(layer.weight_mask, mask) and bool((layer.weight[mask == 0] == 0).all())

    # resuming from the dense checkpoint prunes at the start of epoch 1, from the weights trained in epoch 0
    again, cb3 = (
        Regressor(seed=7),
        SparseSwapsPruning(spec=REFIT, sparsity=0.5, when=1, max_iters=10, calibration_batches=2),
    )
    _trainer(tmp_path, cb3, max_epochs=2, enable_checkpointing=False).fit(again, ckpt_path=dense)
    assert cb3.pruned and set(cb3.stats) == {"net.0", "net.2"}
    for name, mask in masks.items():  # same weights after epoch 0 and same calibration batches: same masks
        assert torch.equal(again.get_submodule(name).weight_mask, mask)
    assert all(isinstance(h, prune.BasePruningMethod) for h in again.net[0]._forward_pre_hooks.values())
