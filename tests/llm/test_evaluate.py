"""Tests of sparseswaps_prune.llm.evaluate: windowed perplexity against the model's own loss, and
lm-eval zero-shot accuracy on a local 8-item task (offline)."""

from __future__ import annotations

import logging
import math
import time

import datasets
import pytest
import torch

from sparseswaps_prune.llm.data import load_eval_tokens
from sparseswaps_prune.llm.evaluate import perplexity, zero_shot
from sparseswaps_prune.llm.models import tiny_model

logger = logging.getLogger(__name__)


def _random_tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 1000, (1, n), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- perplexity


def test_perplexity_matches_model_loss(tiny_lm):
    seqlen = 32
    tokens = _random_tokens(3 * seqlen + 5)
    windows = tokens[0, : 3 * seqlen].view(3, seqlen)
    with torch.no_grad():
        losses = [tiny_lm(input_ids=w[None], labels=w[None]).loss.item() for w in windows]
    expected = math.exp(sum(losses) / len(losses))
    assert perplexity(tiny_lm, tokens, seqlen) == pytest.approx(expected, rel=1e-5)
    assert perplexity(tiny_lm, tokens, seqlen, batch_size=2) == pytest.approx(expected, rel=1e-5)
    assert perplexity(tiny_lm, tokens, seqlen, max_windows=1) == pytest.approx(math.exp(losses[0]), rel=1e-5)


@pytest.mark.parametrize("arch", ["opt", "gpt2", "gemma2"])
def test_perplexity_runs_on_other_archs(arch):
    model = tiny_model(arch)
    value = perplexity(model, _random_tokens(64), 16, batch_size=4)
    assert math.isfinite(value) and value > 1


def test_perplexity_restores_training_mode(tiny_lm):
    tiny_lm.train()
    perplexity(tiny_lm, _random_tokens(20), 10)
    assert tiny_lm.training


def test_perplexity_rejects_bad_inputs(tiny_lm):
    with pytest.raises(ValueError, match="fewer than seqlen=64"):
        perplexity(tiny_lm, _random_tokens(40), 64)
    with pytest.raises(ValueError, match="maximum of 512 positions"):
        perplexity(tiny_lm, _random_tokens(1024), 1024)
    with pytest.raises(ValueError, match=r"shape \[1, N\]"):
        perplexity(tiny_lm, _random_tokens(40).view(2, 20), 8)
    with pytest.raises(TypeError, match="integer"):
        perplexity(tiny_lm, _random_tokens(40).float(), 8)
    with pytest.raises(ValueError, match="at least 2"):
        perplexity(tiny_lm, _random_tokens(40), 1)
    with pytest.raises(ValueError, match="max_windows"):
        perplexity(tiny_lm, _random_tokens(40), 8, max_windows=0)
    with pytest.raises(ValueError, match="batch_size"):
        perplexity(tiny_lm, _random_tokens(40), 8, batch_size=0)


# ---------------------------------------------------------------- zero-shot


@pytest.mark.parametrize("by", ["name", "yaml_path"])
def test_zero_shot_on_local_task(monkeypatch, tiny_lm, tiny_tokenizer, local_task_dir, by):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    if by == "name":
        scores = zero_shot(tiny_lm, tiny_tokenizer, ["sparseswaps_tiny_mc"], include_path=str(local_task_dir), limit=6)
    else:
        scores = zero_shot(tiny_lm, tiny_tokenizer, [str(local_task_dir / "tiny_mc.yaml")], limit=6)
    assert set(scores) == {"sparseswaps_tiny_mc"}
    assert 0.0 <= scores["sparseswaps_tiny_mc"] <= 1.0
    assert scores["sparseswaps_tiny_mc"] * 6 == pytest.approx(round(scores["sparseswaps_tiny_mc"] * 6))


def test_zero_shot_indexes_lm_evals_tasks_only_when_the_users_need_them(
    monkeypatch, tiny_lm, tiny_tokenizer, local_task_dir
):
    import lm_eval
    import lm_eval.tasks

    built = []

    class Manager(lm_eval.tasks.TaskManager):  # records what was asked; never builds lm-eval's index (10-20 s)
        def __init__(self, include_path=None, include_defaults=True, **kwargs):
            built.append(include_defaults)
            super().__init__(include_path=include_path, include_defaults=False, **kwargs)

    def simple_evaluate(*, task_manager, tasks, **kwargs):  # as if the local task named one of lm-eval's own tasks
        if not built[-1]:
            raise KeyError("arc_easy")
        return {"results": {tasks[0]: {"acc,none": 0.5}}}

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Manager)
    monkeypatch.setattr(lm_eval, "simple_evaluate", simple_evaluate)
    scores = zero_shot(tiny_lm, tiny_tokenizer, ["sparseswaps_tiny_mc"], include_path=str(local_task_dir))
    assert scores == {"sparseswaps_tiny_mc": 0.5}
    assert built == [False, True]  # the user's task alone first; lm-eval's index when loading needed it
    built.clear()
    with pytest.raises(ValueError, match="Unknown lm-eval task"):  # not the user's: lm-eval's index is looked up
        zero_shot(tiny_lm, tiny_tokenizer, ["no_such_task"], include_path=str(local_task_dir))
    assert built == [False, True]


def test_zero_shot_rejects_unknown_task(tiny_lm, tiny_tokenizer, local_task_dir):
    with pytest.raises(ValueError, match=r"no_such_task.*include_path"):
        zero_shot(tiny_lm, tiny_tokenizer, ["no_such_task"], include_path=str(local_task_dir))


def test_zero_shot_argument_checks(tiny_lm, tiny_tokenizer, tmp_path):
    with pytest.raises(ValueError, match="tasks is empty"):
        zero_shot(tiny_lm, tiny_tokenizer, [])
    with pytest.raises(TypeError, match="list of task names"):
        zero_shot(tiny_lm, tiny_tokenizer, "boolq")
    with pytest.raises(FileNotFoundError, match="missing_dir"):
        zero_shot(tiny_lm, tiny_tokenizer, ["boolq"], include_path=str(tmp_path / "missing_dir"))


# ---------------------------------------------------------------- the packaged model, slow


@pytest.mark.slow
def test_default_model_builtin_perplexity(default_lm):
    model, tokenizer = default_lm
    tokens = load_eval_tokens("builtin", tokenizer)
    start = time.perf_counter()
    value = perplexity(model, tokens, 128, max_windows=2)
    logger.info("SmolLM2-135M builtin perplexity %.2f (2 x 128 tokens) in %.1f s", value, time.perf_counter() - start)
    assert 1.0 < value < 100.0
