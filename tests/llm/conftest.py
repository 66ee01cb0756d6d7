"""Shared fixtures for the LLM tests: the offline SmolLM2 tokenizer, tiny random-weight causal LMs,
and a local lm-eval multiple-choice task. Nothing here touches the network."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sparseswaps_prune.llm.models import default_tokenizer, tiny_model

DATA_DIR = Path(__file__).resolve().parent.parent / "data"


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """The SmolLM2 tokenizer read from the packaged GGUF (49152 ids, a few seconds once per session).

    Shared across tests: do not mutate it (``copy.deepcopy`` it first)."""
    return default_tokenizer()


@pytest.fixture
def tiny_lm():
    """A fresh tiny random-weight llama (2 layers, hidden 64, vocab 49152, float32, eval mode, seed 0)."""
    return tiny_model("llama", seed=0)


@pytest.fixture
def local_task_dir(tmp_path: Path) -> Path:
    """A directory with the 8-item ``sparseswaps_tiny_mc`` lm-eval task, for ``include_path``.

    The config in ``tests/data/lm_eval_tasks`` names its JSONL relative to the repository root;
    here it is rewritten with an absolute path and a temporary ``datasets`` cache directory, so the
    task loads from any working directory without writing to the user's cache."""
    source = DATA_DIR / "lm_eval_tasks"
    config = yaml.safe_load((source / "tiny_mc.yaml").read_text(encoding="utf-8"))
    config["dataset_kwargs"] = {
        "data_files": {"test": str(source / "tiny_mc.jsonl")},
        "cache_dir": str(tmp_path / "datasets_cache"),
    }
    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    (task_dir / "tiny_mc.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    return task_dir


@pytest.fixture
def saved_tiny(tmp_path, tiny_tokenizer) -> Path:
    """A tiny random llama and the packaged tokenizer saved with ``save_pretrained`` (a local model dir)."""
    path = tmp_path / "tiny-llama"
    tiny_model("llama").save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path
