"""Experiment: many pruning settings on one model, each from the dense weights."""

from __future__ import annotations

import torch

from sparseswaps_prune.core.spec import build_spec
from sparseswaps_prune.llm.experiment import Experiment
from sparseswaps_prune.llm.models import tiny_model
from sparseswaps_prune.llm.pipeline import PruneOptions
from sparseswaps_prune.recipes import RECIPES

REFIT = RECIPES["sparseswaps-refit"].spec  # Wanda -> SparseSwaps T=10 -> least-squares re-fit


def test_runs_start_from_dense_weights_and_measure(tiny_tokenizer):
    model = tiny_model("llama")
    dense = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.randint(3, 3000, (7, 16), generator=torch.Generator().manual_seed(0))
    stream = torch.randint(3, 3000, (1, 64), generator=torch.Generator().manual_seed(1))
    exp = Experiment(model, tiny_tokenizer, tokens[:5], holdout_tokens=tokens[5:], eval_tokens=stream, seqlen=16)
    dense_ppl = exp.evaluate()["perplexity"]
    warm = exp.run(PruneOptions(spec=build_spec(REFIT, sparsity=0.5, max_iters=0)))
    swapped = exp.run(PruneOptions(spec=build_spec(REFIT, sparsity=0.5, max_iters=5)))
    again = exp.run(PruneOptions(spec=build_spec(REFIT, sparsity=0.5, max_iters=0)))
    assert warm["totals"] == {**again["totals"], "seconds": warm["totals"]["seconds"]}
    assert warm["perplexity"] == again["perplexity"] != dense_ppl
    assert swapped["totals"]["loss_refined"] < warm["totals"]["loss_refined"]
    assert swapped["totals"]["holdout_refined"] is not None and swapped["options"]["spec"]["refine"]["max_iters"] == 5
    assert warm["totals"]["iters_max"] == 0 and 1 <= swapped["totals"]["iters_max"] <= 5
    exp.reset()
    assert all(torch.equal(v, dense[k]) for k, v in model.state_dict().items())
