"""CausalLMModule: PERP + MaskLoRA / ScaleLoRA through Lightning, with SparseSwapsPruning at fit start."""

from __future__ import annotations

import pickle

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from sparseswaps_prune import RECIPES
from sparseswaps_prune.callbacks import SparseSwapsPruning
from sparseswaps_prune.finetune import CausalLMModule, adapted_modules, effective_weight
from tests.finetune.helpers import counting_ids, fresh_tiny

MLP_LAYERS = [f"model.layers.{i}.mlp.{p}" for i in (0, 1) for p in ("gate_proj", "up_proj", "down_proj")]
REFIT = RECIPES["sparseswaps-refit"].spec  # Wanda -> SparseSwaps T=10 -> least-squares re-fit


def make_trainer(tmp_path, *callbacks, **kwargs) -> pl.Trainer:
    options = {
        "accelerator": "cpu",
        "max_steps": 6,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": tmp_path,
        **kwargs,
    }
    return pl.Trainer(callbacks=list(callbacks), **options)


def loader() -> DataLoader:
    return DataLoader(TensorDataset(counting_ids(16, seed=2)), batch_size=4)


class Probe(pl.Callback):
    """The trainable parameters the optimizer holds, and the frozen weights right after pruning."""

    def on_train_start(self, trainer, pl_module):
        self.optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
        self.weights = {
            n: pl_module.get_submodule(n).weight_orig.detach().clone() for n in ("model." + m for m in MLP_LAYERS)
        }
        with torch.no_grad():
            self.loss_after_pruning = float(pl_module.lm_loss(counting_ids(16, seed=2)))


@pytest.mark.parametrize("adapter", ["masklora", "scalelora"])
def test_prune_at_fit_start_then_train_adapters(tmp_path, adapter):
    module = CausalLMModule(fresh_tiny("llama"), adapter=adapter, rank=4, include=["*.mlp.*"], lr=1e-2)
    assert module.adapted == MLP_LAYERS
    cb = SparseSwapsPruning(spec=REFIT, sparsity=0.5, include=["*.mlp.*"], max_iters=5, calibration_batches=2)
    probe = Probe()
    make_trainer(tmp_path, cb, probe).fit(module, loader())
    assert sorted(cb.stats) == sorted("model." + name for name in MLP_LAYERS)

    adapter_params = {id(p) for _, m in adapted_modules(module) for p in (m.adapter_A, m.adapter_B)}
    assert adapter_params <= probe.optimized  # the optimizer built before pruning holds the adapters
    assert {id(p) for p in module.parameters() if p.requires_grad} == probe.optimized
    with torch.no_grad():
        final_loss = float(module.lm_loss(counting_ids(16, seed=2)))
    assert final_loss < probe.loss_after_pruning  # training moved the adapters and norms
    masks = {}
    for name in MLP_LAYERS:
        layer = module.model.get_submodule(name)
        masks[name] = layer.weight_mask.bool()
        assert torch.equal(layer.weight_orig.detach(), probe.weights["model." + name])  # frozen
        assert bool((layer.adapter_B != 0).any())
        assert torch.equal(effective_weight(layer) != 0, masks[name])  # zeros kept after the steps

    logits = module(counting_ids(2)).logits
    assert sorted(module.merge_adapters()) == sorted(MLP_LAYERS)
    assert torch.allclose(module(counting_ids(2)).logits, logits, atol=1e-5)
    for name, mask in masks.items():
        layer = module.model.get_submodule(name)
        assert torch.equal((layer.weight_orig * layer.weight_mask) != 0, mask)
        assert float((layer.weight == 0).float().mean()) == pytest.approx(0.5)


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
def test_checkpoint_round_trip_with_adapters(tmp_path):
    module = CausalLMModule(fresh_tiny("llama"), rank=2, include=["*.mlp.*"], lr=1e-2)
    cb = SparseSwapsPruning(spec=REFIT, sparsity=0.5, include=["*.mlp.*"], max_iters=5, calibration_batches=1)
    trainer = make_trainer(tmp_path, cb, max_steps=3)
    trainer.fit(module, loader())
    path = tmp_path / "perp.ckpt"
    trainer.save_checkpoint(path)
    ids = counting_ids(2)
    expected = module(ids).logits

    loaded = CausalLMModule.load_from_checkpoint(path, model=fresh_tiny("llama"))  # masks re-created on load
    assert loaded.hparams.rank == 2 and loaded.adapted == module.adapted
    assert torch.allclose(loaded(ids).logits, expected, atol=1e-6)
    up = "model.layers.1.mlp.up_proj"
    assert torch.equal(loaded.model.get_submodule(up).weight_mask, module.model.get_submodule(up).weight_mask)

    resumed = CausalLMModule(fresh_tiny("llama"), rank=2, include=["*.mlp.*"], lr=1e-2)
    cb2 = SparseSwapsPruning(spec=REFIT, sparsity=0.5, include=["*.mlp.*"], max_iters=5, calibration_batches=1)
    make_trainer(tmp_path, cb2, max_steps=5).fit(resumed, loader(), ckpt_path=path)  # Adam state restores too
    assert cb2.pruned and cb2.stats == {}  # not pruned again
    layer = resumed.model.get_submodule(up)
    assert torch.equal(layer.weight_mask, module.model.get_submodule(up).weight_mask)
    assert torch.equal(effective_weight(layer) != 0, layer.weight_mask.bool())


def test_module_pickles_with_its_hooks():
    """ddp_spawn pickles the LightningModule: the adapter hooks and the restore pre-hook must survive."""
    module = CausalLMModule(fresh_tiny("gpt2"), adapter="scalelora", rank=2)
    with torch.no_grad():
        for _, layer in adapted_modules(module):
            layer.adapter_B.normal_()
    clone = pickle.loads(pickle.dumps(module))
    ids = counting_ids(2)
    assert torch.equal(clone(ids).logits, module(ids).logits)
    assert len(clone._load_state_dict_pre_hooks) == 1 and len(adapted_modules(clone)) == 8


def test_bad_arguments():
    with pytest.raises(ValueError, match="SparseSwapsPruning would prune"):
        CausalLMModule(fresh_tiny("llama"), adapter="lora")
    with pytest.raises(ValueError, match="unknown adapter"):
        CausalLMModule(fresh_tiny("llama"), adapter="dora")
    with pytest.raises(ValueError, match="lr must be"):
        CausalLMModule(fresh_tiny("llama"), lr=0)
    with pytest.raises(TypeError, match=r"nn\.Module"):
        CausalLMModule("HuggingFaceTB/SmolLM2-135M")
    with pytest.raises(TypeError, match="cannot read a str batch"):
        CausalLMModule(fresh_tiny("llama")).lm_loss("text")
