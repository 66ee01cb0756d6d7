"""Compare pruning settings on one model with the same calibration and evaluation data.

:class:`Experiment` keeps the dense weights, and for each :class:`~sparseswaps_prune.llm.pipeline.PruneOptions`
restores them, prunes, measures and returns one row: summed layer losses (calibration and held-out Grams),
held-out perplexity, zero-shot accuracy and time. The model is loaded once, which makes a comparison matrix
far cheaper than one ``sparseswaps prune`` run per setting.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from sparseswaps_prune.llm.evaluate import perplexity, zero_shot
from sparseswaps_prune.llm.pipeline import PruneOptions, finalize, prune_model
from sparseswaps_prune.llm.report import totals


class Experiment:
    """One model, one calibration set, one evaluation set; many pruning settings.

    Args:
        model: a Hugging Face causal LM on the CPU, dense (its weights are restored before every run).
        tokenizer: its tokenizer (for zero-shot tasks).
        calib_tokens: ``[n, seqlen]`` calibration windows.
        holdout_tokens: ``[h, seqlen]`` held-out calibration windows (layer losses on their Gram), or None.
        eval_tokens: ``[1, N]`` evaluation token stream for perplexity, or None.
        extra_eval_tokens: more evaluation streams by name (e.g. ``{"stdlib-prose": tokens}``: text calibration
            never touches); their perplexities are reported under ``"perplexity_extra"``.
        seqlen: perplexity window length.
        eval_windows: at most this many perplexity windows.
        tasks, include_path, task_limit: lm-eval tasks for zero-shot accuracy (see ``evaluate.zero_shot``).
        device, batch_size: compute device and windows per forward.

    Example:
        >>> exp = Experiment(model, tok, calib, eval_tokens=tokens, seqlen=256)
        >>> rows = [exp.run(PruneOptions(spec=build_spec(SPARSESWAPS_SPEC, start=s))) for s in ("wanda", "ria")]
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        calib_tokens: torch.Tensor,
        *,
        holdout_tokens: torch.Tensor | None = None,
        eval_tokens: torch.Tensor | None = None,
        extra_eval_tokens: dict[str, torch.Tensor] | None = None,
        seqlen: int = 256,
        eval_windows: int | None = None,
        tasks: list[str] | None = None,
        include_path: str | None = None,
        task_limit: int | None = None,
        device: torch.device | str = "cpu",
        batch_size: int = 4,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.calib_tokens, self.holdout_tokens, self.eval_tokens = calib_tokens, holdout_tokens, eval_tokens
        self.extra_eval_tokens = dict(extra_eval_tokens or {})
        self.seqlen, self.eval_windows, self.device, self.batch_size = seqlen, eval_windows, device, batch_size
        self.tasks, self.include_path, self.task_limit = tasks, include_path, task_limit
        self.dense = {name: value.detach().clone() for name, value in model.state_dict().items()}

    def evaluate(self) -> dict[str, Any]:
        """Perplexity (on ``eval_tokens`` and on each extra stream) and zero-shot accuracy of the model as it is
        now (None where not configured)."""
        ppl = None if self.eval_tokens is None else self._perplexity(self.eval_tokens)
        extra = {name: self._perplexity(tokens) for name, tokens in self.extra_eval_tokens.items()}
        accuracy = None
        if self.tasks:
            accuracy = zero_shot(
                self.model.to(self.device),
                self.tokenizer,
                self.tasks,
                include_path=self.include_path,
                limit=self.task_limit,
                batch_size=self.batch_size,
            )
            self.model.to("cpu")
        return {"perplexity": ppl, "perplexity_extra": extra, "zero_shot": accuracy}

    def _perplexity(self, tokens: torch.Tensor) -> float:
        return perplexity(
            self.model,
            tokens,
            self.seqlen,
            batch_size=self.batch_size,
            device=self.device,
            max_windows=self.eval_windows,
        )

    def run(self, options: PruneOptions) -> dict[str, Any]:
        """Restore the dense weights, prune with ``options``, measure; returns one row (JSON-serialisable).

        The model is left pruned (plain tensors, zeros written) until the next :meth:`run` or :meth:`reset`.
        """
        self.reset()
        start = time.perf_counter()
        try:
            result = prune_model(
                self.model,
                self.calib_tokens,
                options,
                device=self.device,
                batch_size=self.batch_size,
                holdout_tokens=self.holdout_tokens,
                progress=False,
            )
        finally:
            finalize(self.model)
        prune_seconds = time.perf_counter() - start
        return {
            "options": options.to_dict(),
            "totals": totals(result.layers),
            "seconds_prune": prune_seconds,
            **self.evaluate(),
        }

    def reset(self) -> None:
        """Put the dense weights back (removing any pruning reparametrization first)."""
        finalize(self.model)
        self.model.load_state_dict(self.dense)
