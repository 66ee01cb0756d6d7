"""The built-in cloze task: deterministic items from the evaluation text, loadable by lm-eval offline."""

from __future__ import annotations

import datasets
import pytest

from sparseswaps_prune.llm.data import builtin_text
from sparseswaps_prune.llm.evaluate import zero_shot
from sparseswaps_prune.llm.tasks import BUILTIN_CLOZE, builtin_cloze_items, write_builtin_cloze_task


def test_items_are_deterministic_and_from_the_eval_text_only():
    items = builtin_cloze_items(40, seed=1)
    assert items == builtin_cloze_items(40, seed=1) and items != builtin_cloze_items(40, seed=2)
    calib = " ".join(builtin_text("calib").split())
    for item in items:
        assert len(item["choices"]) == len(set(item["choices"])) == 4
        sentence = item["context"] + item["choices"][item["label"]]
        assert sentence in " ".join(builtin_text("eval").split()) and sentence not in calib
    assert len({item["label"] for item in items}) > 1
    with pytest.raises(ValueError, match="n_items"):
        builtin_cloze_items(0)


def test_task_runs_in_lm_eval_offline(monkeypatch, tmp_path, tiny_lm, tiny_tokenizer):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    name = write_builtin_cloze_task(tmp_path / "tasks", n_items=8)
    assert name == BUILTIN_CLOZE
    scores = zero_shot(tiny_lm, tiny_tokenizer, [name], include_path=str(tmp_path / "tasks"), limit=8)
    assert set(scores) == {BUILTIN_CLOZE} and scores[BUILTIN_CLOZE] * 8 == pytest.approx(round(scores[name] * 8))
