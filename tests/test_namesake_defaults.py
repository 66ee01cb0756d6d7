"""The namesake entry points run SparseSwaps with no spec: ADMM's mask as the warmstart, then exact 1-swaps, masks only.

The call forms are those a user writes from the package's names (issue 46); each must swap (``n_swaps > 0``), end
below the warmstart's loss, leave ``weight_orig`` equal to the original parameter, and ``prune.remove`` must give
``orig * mask``.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn.utils import prune

from sparseswaps_prune import (
    RECIPES,
    SPARSESWAPS_SPEC,
    GramAccumulator,
    SparseSwapsMethod,
    build_spec,
    prune_layer,
    sparseswaps_unstructured,
)
from sparseswaps_prune.callbacks import SparseSwapsPruning
from sparseswaps_prune.core.admm import admm_prune
from sparseswaps_prune.core.losses import row_losses
from sparseswaps_prune.core.select import select_mask
from sparseswaps_prune.core.warmstart import importance_scores


def problem(d_out: int = 12, d_in: int = 24, seed: int = 0) -> tuple[nn.Linear, torch.Tensor]:
    """A linear layer and the Gram of correlated inputs (so a score mask is far from the best one)."""
    generator = torch.Generator().manual_seed(seed)
    layer = nn.Linear(d_in, d_out)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(d_out, d_in, generator=generator))
    mixing = torch.randn(d_in, d_in, generator=generator)
    x = torch.randn(256, d_in, generator=generator) @ mixing
    return layer, x.T @ x


def score_loss(weight: torch.Tensor, gram: torch.Tensor, sparsity: float, score: str) -> float:
    mask = select_mask(importance_scores(weight, score, gram), sparsity=sparsity, nm=None, scope="row")
    return float(row_losses(weight, gram, mask).sum())


def admm_mask_loss(weight: torch.Tensor, gram: torch.Tensor, sparsity: float) -> float:
    """The mask objective of ADMM's mask per row (its weights discarded): the default's start."""
    return float(row_losses(weight, gram, admm_prune(weight, gram, sparsity=sparsity, scope="row").keep_mask).sum())


def test_prune_layer_with_no_spec_swaps_masks_only():
    layer, gram = problem()
    out = prune_layer(layer.weight, gram)
    assert out.weight is None  # masks only
    assert int(out.n_swaps.sum()) > 0
    assert float(out.loss.refined.sum()) < float(out.loss.start.sum())
    assert float(out.loss.start.sum()) == pytest.approx(admm_mask_loss(layer.weight.detach(), gram, 0.6))
    assert torch.equal(out.keep_mask.sum(dim=1), torch.full((12,), 24 - round(0.6 * 24)))


def test_sparseswaps_unstructured_with_swap_options_and_no_spec():
    layer, gram = problem()
    original = layer.weight.detach().clone()
    sparseswaps_unstructured(layer, "weight", amount=0.5, gram=gram, start="wanda", max_iters=20)
    assert torch.equal(layer.weight_orig, original)  # the original parameter, untouched
    mask = layer.weight_mask.bool()
    assert torch.equal(mask.sum(dim=1), torch.full((12,), 12))
    loss = float(row_losses(original, gram, mask).sum())
    assert loss < score_loss(original, gram, 0.5, "wanda")
    prune.remove(layer, "weight")
    assert torch.equal(layer.weight.detach(), original * mask)


def test_global_unstructured_with_max_iters_and_no_spec():
    first, gram1 = problem(seed=1)
    second, gram2 = problem(d_out=8, d_in=24, seed=2)
    originals = [first.weight.detach().clone(), second.weight.detach().clone()]
    params = [(first, "weight"), (second, "weight")]
    prune.global_unstructured(
        params, pruning_method=SparseSwapsMethod, amount=0.6, max_iters=30, tensors=params, grams=[gram1, gram2]
    )
    for (module, _), original, gram in zip(params, originals, (gram1, gram2), strict=True):
        assert torch.equal(module.weight_orig, original)
        loss = float(row_losses(original, gram, module.weight_mask.bool()).sum())
        assert loss < admm_mask_loss(original, gram, 0.6)  # the default start: ADMM's mask
        prune.remove(module, "weight")
        assert torch.equal(module.weight.detach(), original * (module.weight != 0))


def test_the_method_records_swaps_and_a_recipe_updates_weights_only_when_asked():
    layer, gram = problem()
    method = SparseSwapsMethod(0.6, grams=[gram])
    mask = method.compute_mask(layer.weight.detach(), torch.ones_like(layer.weight))
    assert int(method.results[0].n_swaps.sum()) > 0 and mask.shape == layer.weight.shape
    original = layer.weight.detach().clone()
    sparseswaps_unstructured(layer, "weight", amount=0.6, gram=gram, recipe="alps")  # ALPS's weights: asked for
    assert not torch.equal(layer.weight_orig, original)
    assert (
        build_spec(RECIPES["alps"].spec, sparsity=0.6)
        == SparseSwapsMethod(0.6, grams=[gram], tensors=[(layer, "weight")], recipe="alps").spec
    )
    with pytest.raises(ValueError, match="give spec= or recipe="):
        SparseSwapsMethod(0.6, grams=[gram], spec=SPARSESWAPS_SPEC, recipe="alps")
    with pytest.raises(ValueError, match="unknown recipe 'alpz'"):
        SparseSwapsMethod(0.6, grams=[gram], recipe="alpz")


def test_the_default_swaps_from_admm_masks_only_and_prunes_a_pruned_tensor_again():
    layer, gram = problem()
    original = layer.weight.detach().clone()
    params = [(layer, "weight")]
    prune.global_unstructured(params, pruning_method=SparseSwapsMethod, amount=0.6, grams=[gram], tensors=params)
    assert torch.equal(layer.weight_orig, original)  # masks only: ADMM's weights are discarded
    admm_mask = admm_prune(original, gram, sparsity=0.6, scope="row").keep_mask
    first = layer.weight_mask.bool().clone()
    assert float(row_losses(original, gram, first).sum()) < float(row_losses(original, gram, admm_mask).sum())
    assert not torch.equal(first, admm_mask)  # the swaps moved it
    sparseswaps_unstructured(layer, "weight", amount=0.5, gram=gram)  # iterative pruning: within the first mask
    second = layer.weight_mask.bool()
    assert not (second & ~first).any()
    assert torch.equal(second.sum(dim=1), first.sum(dim=1) - torch.round(0.5 * first.sum(dim=1)).long())
    assert torch.equal(layer.weight_orig, original)
    with pytest.raises(ValueError, match="alps pruning of an already pruned tensor is not supported"):
        sparseswaps_unstructured(layer, "weight", amount=0.3, gram=gram, recipe="alps")
    assert torch.equal(layer.weight_mask.bool(), second) and torch.equal(layer.weight_orig, original)


def test_warmstart_is_accepted_with_a_deprecation_warning():
    layer, gram = problem()
    with pytest.warns(DeprecationWarning, match="warmstart= is renamed start="):
        sparseswaps_unstructured(layer, "weight", amount=0.5, gram=gram, warmstart="magnitude", max_iters=3)
    other, _ = problem()
    sparseswaps_unstructured(other, "weight", amount=0.5, gram=gram, start="magnitude", max_iters=3)
    assert torch.equal(layer.weight_mask, other.weight_mask)


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(64, 16, generator=generator) @ torch.randn(16, 16, generator=generator)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, _idx):
        return self(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # the weights stay: only the masks are checked

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x), batch_size=16)


def test_the_callback_with_swap_options_and_no_spec(tmp_path):
    model = Tiny()
    dense = {name: m.weight.detach().clone() for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    callback = SparseSwapsPruning(sparsity=0.5, start="wanda", max_iters=5, calibration_batches=4)
    trainer = pl.Trainer(
        max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, callbacks=[callback],
    )  # fmt: skip
    trainer.fit(model)
    gram = GramAccumulator(16)
    gram.add(model.x)
    for name, weight in dense.items():
        module = model.get_submodule(name)
        assert torch.equal(module.weight_orig, weight), name  # masks only: lr 0, and no weight update
        assert callback.stats[name].swaps > 0, name
        assert callback.stats[name].loss_refined < callback.stats[name].loss_start, name
    first = model.net[0].weight_mask.bool()
    wanda = score_loss(dense["net.0"], gram.gram, 0.5, "wanda")
    assert float(row_losses(dense["net.0"], gram.gram, first).sum()) < wanda


def test_an_embedding_among_the_parameters_is_refused_before_anything_changes():
    layer, gram = problem()
    embedding = nn.Embedding(10, 24)
    before = embedding.weight.detach().clone()
    params = [(layer, "weight"), (embedding, "weight")]
    with pytest.raises(TypeError, match=r"tensors\[1\] \(Embedding.weight\): SparseSwaps prunes linear layers"):
        prune.global_unstructured(
            params, pruning_method=SparseSwapsMethod, amount=0.5, tensors=params, grams=[gram, torch.eye(24)]
        )
    assert not prune.is_pruned(layer) and not prune.is_pruned(embedding)
    assert torch.equal(embedding.weight, before)
