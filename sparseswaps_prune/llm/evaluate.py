"""Evaluation of (pruned) causal LMs: windowed perplexity and lm-eval zero-shot accuracy.

``lm_eval`` is imported inside :func:`zero_shot`, so importing this module is cheap.
"""

from __future__ import annotations

import logging
import math
import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from sparseswaps_prune.extras import require

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

PAPER_TASKS = ["boolq", "rte", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "openbookqa"]
"""The seven lm-eval zero-shot tasks reported by Wanda, SparseGPT follow-ups and SparseSwaps."""

_CE_CHUNK_ELEMENTS = 1 << 24
"""Logit elements per float64 cross-entropy chunk (128 MiB), bounding the float64 copy of the logits."""


def _max_positions(model: PreTrainedModel) -> int | None:
    """Return the model's maximum number of positions from its config, or None if it declares none."""
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(model.config, name, None)
        if isinstance(value, int):
            return value
    return None


def perplexity(
    model: PreTrainedModel,
    tokens: torch.Tensor,
    seqlen: int,
    *,
    batch_size: int = 1,
    device: str | torch.device | None = None,
    max_windows: int | None = None,
) -> float:
    """Perplexity over non-overlapping windows (the Wanda / SparseGPT protocol).

    ``tokens`` is cut into ``N // seqlen`` windows of ``seqlen`` tokens (the remainder is dropped;
    at most ``max_windows`` windows are used, from the start). Each window is scored independently:
    within a window, every token after the first is predicted from the ones before it. The result
    is ``exp(total NLL / number of predicted tokens)``, the NLL summed by
    ``cross_entropy(..., reduction="sum")`` on float64 logits. All windows predict ``seqlen - 1``
    tokens, so this equals Wanda's ``exp(mean over windows of the mean window loss)``.

    The model is run in eval mode under ``torch.no_grad()`` (its training flag is restored after).

    Args:
        model: A causal LM whose output has ``.logits`` ``[batch, seqlen, vocab]``.
        tokens: LongTensor ``[1, N]`` of token ids, e.g. from
            :func:`~sparseswaps_prune.llm.data.load_eval_tokens`.
        seqlen: Window length, at least 2 and at most the model's maximum positions.
        batch_size: Windows per forward pass.
        device: Device the windows are sent to, i.e. where the model's input embeddings live (the
            model is not moved); default: the device of the model's first parameter.
        max_windows: Use at most this many windows (e.g. 256 for the SparseGPT C4 protocol).

    Returns:
        The perplexity (a Python float, ``>= 1``).

    Raises:
        TypeError: ``tokens`` is not an integer tensor.
        ValueError: ``tokens`` is not ``[1, N]``, ``N < seqlen``, ``seqlen`` is out of range, or
            ``batch_size`` / ``max_windows`` < 1.
    """
    if not isinstance(tokens, torch.Tensor) or tokens.is_floating_point() or tokens.is_complex():
        raise TypeError(
            f"tokens must be an integer torch.Tensor [1, N], got {type(tokens).__name__} "
            f"{getattr(tokens, 'dtype', '')}; use load_eval_tokens()."
        )
    if tokens.dim() != 2 or tokens.shape[0] != 1:
        raise ValueError(f"tokens must have shape [1, N], got {list(tokens.shape)}; use tokens.view(1, -1).")
    if seqlen < 2:
        raise ValueError(f"seqlen must be at least 2 (one context and one predicted token), got {seqlen}.")
    max_positions = _max_positions(model)
    if max_positions is not None and seqlen > max_positions:
        raise ValueError(
            f"seqlen={seqlen} exceeds the model's maximum of {max_positions} positions; use seqlen <= {max_positions}."
        )
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}.")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be at least 1 or None, got {max_windows}.")
    n_windows = tokens.shape[1] // seqlen
    if n_windows == 0:
        raise ValueError(
            f"The evaluation stream has {tokens.shape[1]} tokens, fewer than seqlen={seqlen}; use a "
            "smaller seqlen or more evaluation text."
        )
    if max_windows is not None:
        n_windows = min(n_windows, max_windows)
    windows = tokens[0, : n_windows * seqlen].reshape(n_windows, seqlen).long()
    run_device = torch.device(device) if device is not None else next(model.parameters()).device

    was_training = model.training
    model.eval()
    nll = 0.0
    count = 0
    try:
        with torch.no_grad():
            for start in range(0, n_windows, batch_size):
                batch = windows[start : start + batch_size].to(run_device)
                logits = model(input_ids=batch, use_cache=False).logits
                vocab = logits.shape[-1]
                flat_logits = logits[:, :-1].reshape(-1, vocab)
                flat_targets = batch[:, 1:].reshape(-1)
                rows = max(1, _CE_CHUNK_ELEMENTS // vocab)
                for row in range(0, flat_targets.numel(), rows):
                    chunk = flat_logits[row : row + rows].to(torch.float64)
                    nll += F.cross_entropy(chunk, flat_targets[row : row + rows], reduction="sum").item()
                count += flat_targets.numel()
    finally:
        model.train(was_training)
    ppl = math.exp(nll / count)
    logger.info("Perplexity %.4f over %d windows of %d tokens", ppl, n_windows, seqlen)
    return ppl


def _is_task_file(task: str) -> bool:
    """Whether ``task`` names an existing lm-eval YAML task file."""
    return task.endswith((".yaml", ".yml")) and os.path.isfile(task)


def zero_shot(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    tasks: list[str],
    *,
    include_path: str | None = None,
    limit: int | None = None,
    batch_size: int = 1,
    num_fewshot: int = 0,
) -> dict[str, float]:
    """Accuracy on lm-eval tasks (``lm_eval.simple_evaluate`` on an in-memory model).

    For each task the returned score is ``acc_norm`` (length-normalised log-likelihood accuracy)
    when the task reports it and ``acc`` otherwise; e.g. for :data:`PAPER_TASKS`, hellaswag,
    arc_easy, arc_challenge and openbookqa give ``acc_norm`` and boolq, rte and winogrande give
    ``acc``. Standard errors are not computed (``bootstrap_iters=0``). A group or tag expands to its
    tasks, each reported under its own name (and the group under its name when it aggregates
    accuracy). Built-in tasks download their data sets from the hub unless cached.

    Note that lm-eval seeds Python's, NumPy's and torch's global RNGs.

    Args:
        model: A causal LM (any device; lm-eval uses the model's device).
        tokenizer: Its tokenizer.
        tasks: lm-eval task, group or tag names, or paths of YAML task files.
        include_path: Directory of extra YAML task configs (searched in addition to lm-eval's
            built-in tasks; when every task is found there or given as a YAML path, lm-eval's own task
            index is not built, unless loading them needs it). A local multiple-choice task can use
            ``dataset_path: json`` with ``dataset_kwargs: {data_files: {test: /abs/path/items.jsonl}}``; relative
            ``data_files`` resolve against the current directory, not the YAML's.
        limit: Evaluate at most this many documents per task (for quick checks).
        batch_size: lm-eval batch size.
        num_fewshot: Few-shot examples per prompt (0: zero-shot; tasks whose config fixes 0 keep 0).

    Returns:
        ``{task name: accuracy in [0, 1]}``.

    Raises:
        TypeError: ``tasks`` is not a list of str.
        FileNotFoundError: ``include_path`` does not exist.
        ValueError: empty ``tasks``, an unknown task, or no task reporting ``acc`` / ``acc_norm``.
    """
    if not isinstance(tasks, (list, tuple)) or not all(isinstance(t, str) for t in tasks):
        raise TypeError(f"tasks must be a list of task names (str), got {tasks!r}.")
    if not tasks:
        raise ValueError(f"tasks is empty; pass lm-eval task names, e.g. PAPER_TASKS = {PAPER_TASKS}.")
    if include_path is not None and not os.path.exists(include_path):
        raise FileNotFoundError(f"include_path {include_path!r} does not exist; pass a directory of YAML tasks.")
    require("eval", "lm_eval")
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    # The user's own tasks (include_path, YAML files) are indexed alone: lm-eval's index of its thousands of tasks
    # takes 10-20 s to build; it is built when a task is not the user's, or a user's task needs lm-eval's.
    def unknown_to(manager: TaskManager) -> list[str]:
        return [t for t in tasks if t not in manager.all_tasks and not _is_task_file(t)]

    manager = TaskManager(include_path=include_path, include_defaults=False)
    own_tasks = not unknown_to(manager)
    if not own_tasks:
        manager = TaskManager(include_path=include_path)
    unknown = unknown_to(manager)
    if unknown:
        raise ValueError(
            f"Unknown lm-eval task(s) {unknown}. To evaluate a local task, write a YAML task config "
            "(e.g. output_type: multiple_choice, dataset_path: json, dataset_kwargs: {data_files: "
            "{test: /abs/path/items.jsonl}}) into a directory and pass include_path=<that directory>, "
            "or pass the YAML file's path as the task name."
        )
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)

    def evaluate(manager: TaskManager) -> dict:
        return lm_eval.simple_evaluate(
            model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit, task_manager=manager,
            bootstrap_iters=0, log_samples=False,
        )  # fmt: skip

    try:
        output = evaluate(manager)
    except Exception:
        if not own_tasks:
            raise
        output = evaluate(TaskManager(include_path=include_path))  # e.g. a local group of lm-eval's own tasks
    scores: dict[str, float] = {}
    for name, metrics in output["results"].items():
        for key in ("acc_norm,none", "acc,none"):
            value = metrics.get(key)
            if isinstance(value, (int, float)):
                scores[name] = float(value)
                break
    if not scores:
        raise ValueError(
            f"None of the tasks {list(tasks)} reports 'acc' or 'acc_norm'; zero_shot supports "
            "log-likelihood (multiple-choice) tasks only."
        )
    logger.info("Zero-shot accuracy: %s", scores)
    return scores
