"""THE table of named recipes: what ``--recipe NAME`` (CLI), ``PruneOptions(recipe=NAME)`` / ``run_job``, the
prune method's and the callback's ``recipe=NAME`` run.

A recipe is a named method as data: the per-layer spec (:class:`~sparseswaps_prune.core.spec.PruneSpec`), the
block tuning the Hugging Face pipeline runs after each block's layers are pruned, and the PERP fine-tune the job
(``sparseswaps prune``, ``run_job``) runs on the whole pruned model at the end. The prune method and the Lightning
callback prune layer by layer and run the recipe's layer spec only (block tuning needs the dense model's block
outputs, which only the pipeline has; the fine-tune is the user's own training loop there).

Calibration sizes are the job's (``JobConfig``: 64 windows of 256 tokens, 8 held out) for every recipe, so that the
methods compare on the same tokens (RESULTS.md).

Example:
    >>> RECIPES["best"].spec.describe()
    '60% per layer: alps -> none -> start'
    >>> options = PruneOptions(recipe="alps")   # what `sparseswaps prune --recipe alps` runs
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from sparseswaps_prune.core.spec import (
    SPARSESWAPS_SPEC,
    ADMMStart,
    ALPSStart,
    Budget,
    KeepWeights,
    LeastSquares,
    NoRefine,
    OBSUpdate,
    PruneSpec,
    ScoreStart,
    SparseGPTStart,
    StartWeights,
    SwapRefine,
)

BLOCK_TUNE_EPOCHS = 3
"""Epochs of block tuning in the recipes that tune without a fine-tune after (``sparseswaps-refit``,
``alps-swaps``)."""
BEST_BLOCK_TUNE_EPOCHS = 2
"""Epochs of block tuning in ``best``: one fewer than :data:`BLOCK_TUNE_EPOCHS`, whose time its fine-tune takes."""
BEST_FINETUNE_STEPS = 20
"""PERP steps after pruning in ``best`` (the job's): about the time of one block-tuning epoch on the default model."""


@dataclass(frozen=True)
class Recipe:
    """A named method.

    Attributes:
        spec: how each layer is pruned (60% unless changed by options).
        block_tune_epochs: epochs of block tuning after each block's layers are pruned (pipeline only; 0: none).
        summary: one line for ``--help`` and the run's header.
        finetune_steps: PERP steps on the whole pruned model at the end (the job only,
            ``JobConfig.finetune_steps``; 0: none).
    """

    spec: PruneSpec
    block_tune_epochs: int
    summary: str
    finetune_steps: int = 0

    @property
    def updates_weights(self) -> bool:
        """True if the recipe changes the kept weights (a weight stage, block tuning or a fine-tune)."""
        return self.spec.updates_weights or self.block_tune_epochs > 0 or self.finetune_steps > 0


_LAYER = Budget(sparsity=0.6, scope="layer")
_ALPS = PruneSpec(budget=_LAYER, start=ALPSStart(), refine=NoRefine(), weights=StartWeights())
"""ALPS as published: its layer-wise mask and its own weights (``alps``; ``best`` adds block tuning)."""
_WANDA = ScoreStart("wanda")

RECIPES: dict[str, Recipe] = {
    "best": Recipe(
        _ALPS,
        BEST_BLOCK_TUNE_EPOCHS,
        f"ALPS's mask and weights, {BEST_BLOCK_TUNE_EPOCHS} epochs of block tuning, then {BEST_FINETUNE_STEPS} PERP "
        "steps on the whole model (the job's): the lowest perplexity measured in the main job's budget",
        finetune_steps=BEST_FINETUNE_STEPS,
    ),
    "sparseswaps": Recipe(
        SPARSESWAPS_SPEC,
        0,
        "SparseSwaps, masks only: ADMM's mask per row (its weights discarded), 25 exact 1-swap iterations per row, "
        "the weights kept: the lowest masks-only perplexity measured",
    ),
    "sparseswaps-refit": Recipe(
        PruneSpec(start=_WANDA, refine=SwapRefine(max_iters=10), weights=LeastSquares()),
        BLOCK_TUNE_EPOCHS,
        "Wanda, SparseSwaps T=10, least-squares re-fit on G + 0.1 diag(G), then block tuning",
    ),
    "alps-swaps": Recipe(
        PruneSpec(
            budget=_LAYER,
            start=ALPSStart(),
            refine=SwapRefine(max_iters=25, objective="refit", scope="row"),
            weights=LeastSquares(),
        ),
        BLOCK_TUNE_EPOCHS,
        "ALPS, then swaps within rows under the re-fit objective, then that re-fit and block tuning (slow)",
    ),
    "paper": Recipe(
        PruneSpec(start=_WANDA, refine=SwapRefine(max_iters=100), weights=KeepWeights()),
        0,
        "SparseSwaps as the paper's main runs: Wanda, T=100, masks only",
    ),
    "wanda": Recipe(PruneSpec(start=_WANDA, refine=NoRefine(), weights=KeepWeights()), 0, "Wanda as published"),
    "sparsegpt": Recipe(
        PruneSpec(budget=_LAYER, start=SparseGPTStart(), refine=NoRefine(), weights=OBSUpdate()),
        0,
        "SparseGPT as published",
    ),
    "admm": Recipe(
        PruneSpec(budget=_LAYER, start=ADMMStart(), refine=NoRefine(), weights=StartWeights()),
        0,
        "ADMM pruning (Boza 2024) as published",
    ),
    "alps": Recipe(_ALPS, 0, "ALPS (Meng et al. 2024) as published"),
}
"""Every named recipe. With ``nm`` a layer-wise recipe selects per row (N:M fixes every row's count)."""

DEFAULT_RECIPE = "best"
"""What ``sparseswaps prune`` and ``PruneOptions()`` run."""

RENAMED_RECIPES = {"default": "best"}
"""The previous release's recipe names (accepted for one release with a ``DeprecationWarning``)."""


def get_recipe(name: str | None) -> Recipe:
    """The recipe called ``name`` (None: :data:`DEFAULT_RECIPE`).

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    return RECIPES[recipe_name(name)]


def recipe_name(name: str | None) -> str:
    """``name`` checked against :data:`RECIPES` (a renamed one warns and gives the new name; None: the default)."""
    if name is None:
        return DEFAULT_RECIPE
    if name in RENAMED_RECIPES:
        new = RENAMED_RECIPES[name]
        message = f"recipe {name!r} is renamed {new!r} (the old name goes in the next release)"
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        return new
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPES)} (CLI: --recipe)")
    return name


def layer_spec(spec: PruneSpec | None, recipe: str | None) -> PruneSpec:
    """The layer spec a namesake entry point runs: ``spec``, or ``recipe``'s layer spec, or (neither given)
    :data:`~sparseswaps_prune.core.spec.SPARSESWAPS_SPEC`.

    Raises:
        ValueError: both given, or an unknown recipe. TypeError: ``spec`` not a ``PruneSpec``.
    """
    if spec is not None and recipe is not None:
        raise ValueError(f"give spec= or recipe= (got recipe={recipe!r}), not both")
    if recipe is not None:
        return get_recipe(recipe).spec
    if spec is None:
        return SPARSESWAPS_SPEC
    if not isinstance(spec, PruneSpec):
        raise TypeError(f"spec must be a PruneSpec (see build_spec, or recipe=NAME), got {type(spec).__name__}")
    return spec
