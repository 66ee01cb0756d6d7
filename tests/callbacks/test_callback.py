"""SparseSwapsPruning: a Lightning callback, on CPU with tiny modules (a few seconds in all)."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
import torch.multiprocessing as mp
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import prune
from torch.utils.data import DataLoader, TensorDataset

from sparseswaps_prune import RECIPES
from sparseswaps_prune.callbacks import SparseSwapsPruning, all_reduce_grams, restore_masks
from sparseswaps_prune.core.gram import GramAccumulator
from sparseswaps_prune.core.layer import prune_layer
from sparseswaps_prune.core.refit import refit_weights
from sparseswaps_prune.prune import SparseSwapsMethod

REFIT = RECIPES["sparseswaps-refit"].spec  # Wanda -> SparseSwaps T=10 -> least-squares re-fit


class MLP(pl.LightningModule):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(64, 16, generator=generator)
        self.y = torch.randn(64, 4, generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, _idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def validation_step(self, batch, _idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))

    def test_step(self, batch, _idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def _loader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=16)

    def train_dataloader(self):
        return self._loader()

    def val_dataloader(self):
        return self._loader()

    def test_dataloader(self):
        return self._loader()


class RestoringMLP(MLP):
    def on_load_checkpoint(self, checkpoint):
        restore_masks(self, checkpoint["state_dict"])


def make_trainer(tmp_path, *callbacks, **kwargs) -> pl.Trainer:
    options = {
        "max_epochs": 2,
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": tmp_path,
        **kwargs,
    }
    return pl.Trainer(callbacks=list(callbacks), **options)


class Snapshot(pl.Callback):
    """Records masks and weight_orig at train start and, per epoch, whether the layers are pruned."""

    def __init__(self) -> None:
        self.masks, self.origs, self.pruned_at_epoch_end = {}, {}, []

    def on_train_start(self, trainer, pl_module):
        for name, m in pl_module.named_modules():
            if hasattr(m, "weight_mask"):
                self.masks[name] = m.weight_mask.clone()
                self.origs[name] = m.weight_orig.detach().clone()

    def on_train_epoch_end(self, trainer, pl_module):
        if hasattr(pl_module, "net"):
            self.pruned_at_epoch_end.append(hasattr(pl_module.net[0], "weight_mask"))


def only_prune_hooks(module: nn.Module) -> bool:
    for m in module.modules():
        if m._forward_pre_hooks_with_kwargs:
            return False
        if not all(isinstance(h, prune.BasePruningMethod) for h in m._forward_pre_hooks.values()):
            return False
    return True


def test_prunes_at_fit_start_and_zeros_stay_zero(tmp_path):
    model, cb, snap = (
        MLP(),
        SparseSwapsPruning(spec=REFIT, sparsity=0.5, max_iters=20, calibration_batches=2),
        Snapshot(),
    )
    make_trainer(tmp_path, cb, snap).fit(model)
    assert cb.pruned and set(cb.stats) == {"net.0", "net.2"}
    assert set(snap.masks) == {"net.0", "net.2"}
    for name, d_in in (("net.0", 16), ("net.2", 32)):
        layer = model.get_submodule(name)
        mask = layer.weight_mask
        assert torch.equal(mask, snap.masks[name])  # the mask never changes during training
        assert torch.equal(mask.sum(dim=1), torch.full((mask.shape[0],), d_in // 2, dtype=mask.dtype))
        assert not torch.equal(layer.weight_orig, snap.origs[name])  # kept weights trained
        stats = cb.stats[name]
        assert stats.loss_final <= stats.loss_start and stats.sparsity == pytest.approx(0.5)
        assert stats.n_tokens == 32  # 2 batches of 16
    model(model.x)  # recomputes weight = weight_orig * mask
    assert all(
        bool((model.get_submodule(n).weight[model.get_submodule(n).weight_mask == 0] == 0).all()) for n in snap.masks
    )
    assert only_prune_hooks(model)
    assert [n for n, _ in model.net[0].named_parameters()] == ["weight_orig", "bias"]  # weight keeps its slot


@pytest.mark.parametrize("objective", ["mask", "refit"])
def test_refit_writes_least_squares_weights_into_weight_orig(tmp_path, objective):
    cb = SparseSwapsPruning(
        spec=REFIT, sparsity=0.5, max_iters=5, calibration_batches=2, weights="ls", objective=objective
    )
    plain = SparseSwapsPruning(spec=REFIT, sparsity=0.5, max_iters=5, calibration_batches=2, weights="keep")
    model, snap = MLP(), Snapshot()
    dense = model.net[0].weight.detach().clone()
    make_trainer(tmp_path, cb, snap, max_epochs=1).fit(model)
    make_trainer(tmp_path, plain, max_epochs=1).fit(MLP())
    x = model.x[:32]  # the two calibration batches of 16
    mask = snap.masks["net.0"].bool()
    expected = refit_weights(dense, x.T @ x, mask, damp=cb.spec.weights.damp, ridge=cb.spec.weights.ridge)
    torch.testing.assert_close(snap.origs["net.0"], expected, rtol=1e-4, atol=1e-5)
    assert bool((snap.origs["net.0"][~mask] == 0).all())
    for name in ("net.0", "net.2"):  # a re-fit never has a higher loss than the same search without it
        assert cb.stats[name].loss_final < cb.stats[name].loss_start
        if objective == "mask":
            assert cb.stats[name].loss_final < plain.stats[name].loss_final


def test_validate_and_test_before_and_after_pruning(tmp_path):
    model, cb = MLP(), SparseSwapsPruning(spec=REFIT, sparsity=0.5, max_iters=5, calibration_batches=1)
    trainer = make_trainer(tmp_path, cb, max_epochs=1)
    dense = trainer.validate(model, verbose=False)[0]["val_loss"]
    assert not hasattr(model.net[0], "weight_mask")  # validate does not prune
    trainer.test(model, verbose=False)
    trainer.fit(model)
    assert hasattr(model.net[0], "weight_mask")
    sparse = trainer.validate(model, verbose=False)[0]["val_loss"]
    assert trainer.test(model, verbose=False)[0]["test_loss"] > 0 and sparse != dense
    assert only_prune_hooks(model)


def test_checkpoint_round_trip_does_not_prune_again(tmp_path):
    model, cb = MLP(), SparseSwapsPruning(spec=REFIT, sparsity=0.6, max_iters=10, calibration_batches=2)
    trainer = make_trainer(tmp_path, cb, max_epochs=1)
    trainer.fit(model)
    path = tmp_path / "pruned.ckpt"
    trainer.save_checkpoint(path)
    saved = {n: model.get_submodule(n).weight_mask.clone() for n in ("net.0", "net.2")}

    resumed, cb2 = (
        MLP(seed=5),
        SparseSwapsPruning(spec=REFIT, sparsity=0.6, max_iters=10, calibration_batches=2),
    )
    make_trainer(tmp_path, cb2, max_epochs=2).fit(resumed, ckpt_path=path)  # SGD momentum state restores too
    assert cb2.pruned and cb2.stats == {}  # restored, not pruned again
    for name, mask in saved.items():
        layer = resumed.get_submodule(name)
        assert torch.equal(layer.weight_mask, mask)
        assert bool((layer.weight[mask == 0] == 0).all())
    assert torch.load(path, weights_only=False)["callbacks"]["SparseSwapsPruning"] == {"pruned": True}

    loaded = RestoringMLP.load_from_checkpoint(path, seed=3)
    for name, mask in saved.items():
        assert torch.equal(loaded.get_submodule(name).weight_mask, mask)
    assert torch.allclose(loaded(model.x), model(model.x))


def test_nm_and_logging(tmp_path):
    model, cb = (
        MLP(),
        SparseSwapsPruning(spec=REFIT, nm=(2, 4), max_iters=10, calibration_batches=1, exclude=["net.2"]),
    )
    make_trainer(tmp_path, cb, max_epochs=1, logger=CSVLogger(tmp_path)).fit(model)
    assert set(cb.stats) == {"net.0"} and not hasattr(model.net[2], "weight_mask")
    blocks = model.net[0].weight_mask.reshape(32, 4, 4).sum(dim=-1)
    assert bool((blocks == 2).all())
    metrics = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert "sparseswaps/net.0/loss_final" in metrics and "sparseswaps/loss_start" in metrics


def test_sequential_mode_epoch_trigger_and_make_permanent(tmp_path):
    loader = DataLoader(TensorDataset(torch.randn(32, 16)), batch_size=8)
    model, snap = MLP(), Snapshot()
    cb = SparseSwapsPruning(
        spec=REFIT,
        sparsity=0.25,
        mode="sequential",
        when=1,
        calibration_dataloader=loader,
        max_iters=5,
        make_permanent=True,
    )
    make_trainer(tmp_path, cb, snap).fit(model)
    assert snap.pruned_at_epoch_end == [False, True]  # pruned at the start of epoch 1
    assert set(cb.stats) == {"net.0", "net.2"}
    for layer, d_in in ((model.net[0], 16), (model.net[2], 32)):
        assert not prune.is_pruned(layer) and not hasattr(layer, "weight_orig")  # made permanent
        assert bool(((layer.weight != 0).sum(dim=1) == d_in - round(0.25 * d_in)).all())
    assert [n for n, _ in model.net[0].named_parameters()] == ["weight", "bias"]
    assert only_prune_hooks(model)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"sparsity": 1.0}, ValueError),
        ({"sparsity": -0.1}, ValueError),
        ({"sparsity": "0.5"}, TypeError),
        ({"sparsity": 0.5, "nm": (2, 4)}, ValueError),
        ({"nm": (5, 4)}, ValueError),
        ({"sparsity": 0.5, "mode": "global"}, ValueError),
        ({"sparsity": 0.5, "start": "obs"}, ValueError),
        ({"sparsity": 0.5, "spec": {"budget": None}}, TypeError),
        ({"sparsity": 0.5, "calibration_batches": 0}, ValueError),
        ({"sparsity": 0.5, "spec": REFIT, "max_iters": 1.5}, TypeError),
        ({"sparsity": 0.5, "recipe": "best", "max_iters": 10}, ValueError),  # a SparseSwaps option on ALPS's solution
        ({"sparsity": 0.5, "recipe": "best", "spec": REFIT}, ValueError),  # a recipe or a spec, not both
        ({"sparsity": 0.5, "recipe": "bestest"}, ValueError),
        ({"sparsity": 0.5, "when": "epoch_end"}, ValueError),
        ({"sparsity": 0.5, "when": -1}, ValueError),
        ({"sparsity": 0.5, "include": "*mlp*"}, TypeError),
        ({"sparsity": 0.5, "make_permanent": 1}, TypeError),
        ({"sparsity": 0.5, "calibration_dataloader": 3}, TypeError),
        ({"sparsity": 0.5, "weights": "lsq"}, ValueError),
        ({"sparsity": 0.5, "objective": "refit", "weights": "keep"}, ValueError),
        ({"sparsity": 0.5, "weights": "ls", "damp": -1.0}, ValueError),
        ({"sparsity": 0.5, "refine": "dsnot", "max_iters": 3}, ValueError),
        ({"sparsity": 0.5, "scope": "global"}, ValueError),
    ],
)
def test_bad_arguments_raise_at_construction(kwargs, error):
    with pytest.raises(error):
        SparseSwapsPruning(**kwargs)


def test_no_matching_layer_is_a_clear_error(tmp_path):
    cb = SparseSwapsPruning(sparsity=0.5, include=["*attn*"])
    with pytest.raises(ValueError, match=r"no nn\.Linear"):
        make_trainer(tmp_path, cb, max_epochs=1).fit(MLP())


class TinyLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from sparseswaps_prune.llm.models import tiny_model

        self.model = tiny_model("llama").train()  # tiny_model returns eval mode
        self.ids = torch.randint(0, 1000, (8, 16), generator=torch.Generator().manual_seed(0))

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits

    def training_step(self, batch, _idx):
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.ids), batch_size=4)


def test_hugging_face_model_mlp_only(tmp_path):
    lm, cb = (
        TinyLM(),
        SparseSwapsPruning(spec=REFIT, sparsity=0.5, include=["*mlp*"], max_iters=10, calibration_batches=2),
    )
    make_trainer(tmp_path, cb, max_epochs=1, max_steps=2).fit(lm)
    assert len(cb.stats) == 6 and all(".mlp." in name for name in cb.stats)
    assert all(s.loss_final <= s.loss_start for s in cb.stats.values())
    block = lm.model.model.layers[0]
    assert hasattr(block.mlp.down_proj, "weight_mask") and not hasattr(block.self_attn.q_proj, "weight_mask")
    lm(lm.ids[:1])
    assert float((block.mlp.up_proj.weight == 0).float().mean()) == pytest.approx(0.5)
    assert only_prune_hooks(lm)


def _ddp_worker(rank: int, world_size: int, tmp: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        layer = nn.Linear(12, 6)  # same weights on every rank
        x = torch.randn(20 + 10 * rank, 12, generator=torch.Generator().manual_seed(100 + rank))  # different data
        accs = {"layer": GramAccumulator(12, track_sum=True), "unused": GramAccumulator(12)}
        accs["layer"].add(x.reshape(-1, 10, 12))  # sequences of 10 tokens
        if rank == 0:
            accs["unused"].add(torch.ones(2, 12))
        all_reduce_grams(accs)
        method = SparseSwapsMethod(
            0.5, grams=[accs["layer"].gram], shapes=[(6, 12)], max_iters=20, weights="keep", spec=REFIT
        )
        existing = torch.ones(6, 12, dtype=torch.bool)
        mask = method.layer_outcome(layer.weight.detach(), existing, accs["layer"].gram).keep_mask
        torch.save(
            {
                "gram": accs["layer"].gram,
                "n": accs["layer"].n_tokens,
                "seqs": accs["layer"].n_sequences,
                "sum": accs["layer"].feature_sum,
                "unused": accs["unused"].gram,
                "mask": mask,
            },
            os.path.join(tmp, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def test_all_reduce_grams_gives_every_rank_the_same_masks(tmp_path):
    mp.spawn(_ddp_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    xs = [torch.randn(20 + 10 * r, 12, generator=torch.Generator().manual_seed(100 + r)) for r in (0, 1)]
    full = torch.cat(xs)
    assert r0["n"] == r1["n"] == 50 and r0["seqs"] == r1["seqs"] == 5
    assert torch.allclose(r0["sum"], full.sum(dim=0), atol=1e-4) and torch.equal(r0["sum"], r1["sum"])
    assert torch.allclose(r0["gram"], full.T @ full, rtol=1e-5, atol=1e-4)
    assert torch.equal(r0["gram"], r1["gram"]) and torch.equal(r0["mask"], r1["mask"])
    assert torch.equal(r0["unused"], r1["unused"]) and float(r1["unused"].sum()) == 2 * 144


class TinyGPT2(TinyLM):
    def __init__(self) -> None:
        pl.LightningModule.__init__(self)
        from sparseswaps_prune.llm.models import tiny_model

        self.model = tiny_model("gpt2").train()
        self.ids = torch.randint(0, 1000, (8, 16), generator=torch.Generator().manual_seed(0))


def test_gpt2_conv1d_refit_lands_in_the_parameter_layout(tmp_path):
    lm = TinyGPT2()
    cb = SparseSwapsPruning(
        spec=REFIT,
        sparsity=0.5,
        include=["*.h.0.mlp.c_fc"],
        max_iters=3,
        calibration_batches=1,
        weights="ls",
    )
    snap = Snapshot()
    make_trainer(tmp_path, cb, snap, max_epochs=1, max_steps=1).fit(lm)
    (name,) = snap.origs
    orig, mask = snap.origs[name], snap.masks[name].bool()  # Conv1D layout [d_in, d_out]
    assert orig.shape == mask.shape and bool((orig[~mask] == 0).all()) and bool((orig[mask] != 0).any())
    assert cb.stats[name].loss_final < cb.stats[name].loss_start


def test_gpt2_conv1d_layers_and_restore_masks(tmp_path):
    lm, cb = (
        TinyGPT2(),
        SparseSwapsPruning(spec=REFIT, sparsity=0.25, include=["*.mlp.c_fc"], max_iters=5, calibration_batches=1),
    )
    make_trainer(tmp_path, cb, max_epochs=1, max_steps=1).fit(lm)
    c_fc = lm.model.transformer.h[0].mlp.c_fc  # Conv1D, weight [d_in, d_out]
    d_in = c_fc.weight_orig.shape[0]
    assert c_fc.weight_mask.shape == c_fc.weight_orig.shape
    assert bool((c_fc.weight_mask.sum(dim=0) == d_in - round(0.25 * d_in)).all())  # per output row of W^T
    fresh = TinyGPT2()
    assert sorted(restore_masks(fresh, lm.state_dict())) == sorted(cb.stats)
    fresh.load_state_dict(lm.state_dict())
    assert torch.equal(fresh.model.transformer.h[0].mlp.c_fc.weight_mask, c_fc.weight_mask)


class Blowup(nn.Module):
    """Multiplies its input by ``factor`` (``inf``: every later activation is Inf or NaN)."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class DeepMLP(MLP):
    """Three linear layers; the last one (``net.4``) has input width ``width``, scaled by ``factor`` first."""

    def __init__(self, width: int = 8, factor: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, width), Blowup(factor), nn.Linear(width, 4)
        )


def dense_state(module: nn.Module) -> list[tuple[str, int, torch.Tensor]]:
    return [(name, id(p), p.detach().clone()) for name, p in module.named_parameters()]


def assert_same_state(module: nn.Module, before: list[tuple[str, int, torch.Tensor]]) -> None:
    after = dense_state(module)
    assert [(n, i) for n, i, _ in after] == [(n, i) for n, i, _ in before]  # same Parameters, same order
    for (name, _, a), (_, _, b) in zip(after, before, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("mode", ["one_shot", "sequential"])
@pytest.mark.parametrize(
    ("model_kwargs", "match"),
    [({"width": 6}, r"net\.4.*m=4 does not divide"), ({"factor": float("inf")}, r"net\.4.*NaN or Inf")],
)
def test_a_failing_later_layer_leaves_every_layer_as_before(tmp_path, caplog, mode, model_kwargs, match):
    model = DeepMLP(**model_kwargs)
    before = dense_state(model)
    cb = SparseSwapsPruning(spec=REFIT, nm=(2, 4), mode=mode, max_iters=3, calibration_batches=2)
    with pytest.raises(ValueError, match=match):
        make_trainer(tmp_path, cb, max_epochs=1).fit(model)
    assert not cb.pruned and cb.stats == {}
    assert not any(prune.is_pruned(m) or hasattr(m, "weight_mask") for m in model.modules())
    assert not any(m._forward_pre_hooks for m in model.modules())
    assert_same_state(model, before)
    # only sequential mode with a bad Gram had installed (and then restored) the layers before net.4
    restored = mode == "sequential" and "factor" in model_kwargs
    assert ("restoring the 2 layer(s)" in caplog.text) == restored


def test_a_failed_sequential_call_restores_the_masks_of_layers_pruned_before(tmp_path):
    model = DeepMLP()
    loader = model._loader()
    trainer = make_trainer(tmp_path)
    first = SparseSwapsPruning(spec=REFIT, sparsity=0.5, include=["net.0"], max_iters=3,
                               calibration_batches=2, calibration_dataloader=loader)  # fmt: skip
    first.prune(trainer, model)
    mask, orig = model.net[0].weight_mask.clone(), model.net[0].weight_orig.detach().clone()
    before = dense_state(model)
    model.net[3].factor = float("inf")
    second = SparseSwapsPruning(spec=REFIT, sparsity=0.75, mode="sequential", max_iters=3,
                                calibration_batches=2, calibration_dataloader=loader, weights="ls")  # fmt: skip
    with pytest.raises(ValueError, match=r"net\.4.*NaN or Inf"):
        second.prune(trainer, model)
    assert torch.equal(model.net[0].weight_mask, mask) and torch.equal(model.net[0].weight_orig, orig)
    assert torch.equal(model.net[0].weight, orig * mask)
    assert not hasattr(model.net[2], "weight_mask") and not prune.is_pruned(model.net[2])
    assert_same_state(model, before)


def test_dsnot_refine_gets_the_input_means_from_calibration(tmp_path):
    model = MLP()
    dense = model.net[0].weight.detach().clone()
    cb = SparseSwapsPruning(spec=REFIT, sparsity=0.5, refine="dsnot", calibration_batches=2)
    make_trainer(tmp_path, cb, max_epochs=1).fit(model)
    acc = GramAccumulator(16, track_sum=True)
    acc.add(model.x[:32])  # the 2 calibration batches; 2-D inputs, so per-token means
    expected = prune_layer(dense, acc.gram, cb.spec, feature_stats=acc.feature_stats())
    assert torch.equal(model.net[0].weight_mask.bool(), expected.keep_mask)
    assert cb.stats["net.0"].loss_final == pytest.approx(float(expected.loss.final.sum()), rel=1e-6)


def test_gram_accumulator_counts_sequences_of_3d_inputs():
    acc = GramAccumulator(4, track_sum=True)
    acc.add(torch.ones(3, 5, 4))
    assert (acc.n_tokens, acc.n_sequences) == (15, 3)
    assert torch.equal(acc.feature_sum, torch.full((4,), 15.0))
