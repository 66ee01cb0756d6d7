"""Gram accumulation ``G = sum_t x_t x_t^T`` over calibration tokens (SparseGPT's ``add_batch``, summed)."""

from __future__ import annotations

import torch


class GramAccumulator:
    """Sum of ``x x^T`` over the tokens a layer sees, with the token count (and, for ``[B, S, d_in]``
    inputs, the sequence count ``n_sequences``) beside it.

    Args:
        d_in: input width of the layer(s) fed by this input.
        dtype: accumulation dtype, ``torch.float32`` (default) or ``torch.float64``.
        device: where the ``[d_in, d_in]`` sum lives (default: the first batch's device).
        track_sum: also keep ``feature_sum = sum_t x_t`` ``[d_in]`` (activation means for DSnoT).

    Example:
        >>> acc = GramAccumulator(layer.in_features)
        >>> handle = layer.register_forward_pre_hook(lambda mod, args: acc.add(args[0]))
    """

    def __init__(
        self,
        d_in: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        track_sum: bool = False,
    ) -> None:
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"GramAccumulator dtype must be torch.float32 or torch.float64, got {dtype}")
        self.d_in, self.dtype, self.device, self.track_sum = d_in, dtype, device, track_sum
        self.gram: torch.Tensor | None = None
        self.feature_sum: torch.Tensor | None = None
        self.n_tokens = 0
        self.n_sequences = 0

    @torch.no_grad()
    def add(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """Accumulate inputs ``x`` shaped ``[N, d_in]`` or ``[B, S, d_in]``; ``attention_mask`` ``[B, S]``
        (nonzero = real token) drops padded positions."""
        if x.shape[-1] != self.d_in:
            raise ValueError(f"input width {x.shape[-1]} does not match the accumulator's d_in={self.d_in}")
        if x.dim() == 3:
            self.n_sequences += x.shape[0]
        if attention_mask is not None:
            x = x[attention_mask.to(device=x.device, dtype=torch.bool)]
        x = x.reshape(-1, self.d_in).to(device=self.device or x.device, dtype=self.dtype)
        if self.gram is None:
            self.gram = torch.zeros(self.d_in, self.d_in, dtype=self.dtype, device=x.device)
            self.feature_sum = torch.zeros(self.d_in, dtype=self.dtype, device=x.device) if self.track_sum else None
        self.gram.addmm_(x.T, x)
        if self.feature_sum is not None:
            self.feature_sum += x.sum(dim=0)
        self.n_tokens += x.shape[0]

    def merge(self, other: GramAccumulator) -> GramAccumulator:
        """Add ``other``'s sums into this one in place (e.g. across processes); returns ``self``."""
        if other.d_in != self.d_in:
            raise ValueError(f"cannot merge Grams of widths {self.d_in} and {other.d_in}")
        if other.gram is not None:
            if self.gram is None:
                self.gram = torch.zeros_like(other.gram, dtype=self.dtype)
                self.feature_sum = torch.zeros_like(self.gram[0]) if self.track_sum else None
            self.gram += other.gram.to(self.gram)
            if self.feature_sum is not None and other.feature_sum is not None:
                self.feature_sum += other.feature_sum.to(self.feature_sum)
        self.n_tokens += other.n_tokens
        self.n_sequences += other.n_sequences
        return self

    def feature_stats(self, *, n_samples: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-input activation statistics for DSnoT: ``(mean, var, sq_mean)``, each ``[d_in]`` float64.

        ``mean = feature_sum / n_tokens`` and ``sq_mean = diag(gram) / n_tokens``; with ``n_samples`` both
        sums are divided by ``n_samples`` (the number of calibration sequences) instead, DSnoT's
        ``sum_metric_row`` and ``scaler_row`` (``lib/layerwrapper.py``), on which its ``update_threshold``
        is set. ``var = E[x^2] - E[x]^2`` per token (clamped at 0 against cancellation), the population
        variance over all tokens (``torch.var(unbiased=False)`` of every token at once), whatever
        ``n_samples``. DSnoT's wrapper instead averages the per-forward-call population variances weighted
        by tokens, which leaves out the variance of the per-call means; it only orders regrowing candidates.
        With a float32 accumulator, ``var`` loses precision where ``|mean| >> std``; accumulate in float64
        then.

        Raises:
            ValueError: the accumulator was made without ``track_sum=True``, has seen no tokens, or
                ``n_samples`` is not a positive int.
        """
        if not self.track_sum:
            raise ValueError(
                "feature_stats needs the per-input sums: create the accumulator with "
                "GramAccumulator(d_in, track_sum=True) before the calibration forwards"
            )
        if self.gram is None or self.feature_sum is None or self.n_tokens == 0:
            raise ValueError("feature_stats: the accumulator has seen no tokens; run calibration data through it first")
        if n_samples is not None and (isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1):
            raise ValueError(f"n_samples must be a positive int (calibration sequences) or None, got {n_samples!r}")
        total = self.feature_sum.to(torch.float64)
        squares = torch.diagonal(self.gram).to(torch.float64)
        mean, sq_mean = total / self.n_tokens, squares / self.n_tokens
        var = (sq_mean - mean * mean).clamp_min(0.0)
        if n_samples is not None:
            mean, sq_mean = total / n_samples, squares / n_samples
        return mean, var, sq_mean
