"""sparseswaps-prune: exact 1-swap refinement of pruning masks (SparseSwaps, arXiv 2512.10922)."""

import warnings

from sparseswaps_prune.core.gram import GramAccumulator
from sparseswaps_prune.core.layer import LayerOutcome, prune_layer
from sparseswaps_prune.core.losses import row_losses
from sparseswaps_prune.core.refine import RefineResult, refine_mask
from sparseswaps_prune.core.refit import refit_weights
from sparseswaps_prune.core.spec import SPARSESWAPS_SPEC, PruneSpec, build_spec
from sparseswaps_prune.core.warmstart import warmstart_mask
from sparseswaps_prune.prune import SparseSwapsMethod, sparseswaps_unstructured
from sparseswaps_prune.recipes import RECIPES, Recipe, get_recipe

__all__ = [
    "RECIPES",
    "SPARSESWAPS_SPEC",
    "GramAccumulator",
    "LayerOutcome",
    "PruneSpec",
    "Recipe",
    "RefineResult",
    "SparseSwapsMethod",
    "build_spec",
    "get_recipe",
    "prune_layer",
    "refine_mask",
    "refit_weights",
    "row_losses",
    "sparseswaps_unstructured",
    "warmstart_mask",
]
__version__ = "0.2.0"


def __getattr__(name: str):
    if name == "DEFAULT_SPEC":  # the previous release's name of the `best` recipe's layer spec
        warnings.warn(
            "DEFAULT_SPEC is renamed RECIPES['best'].spec (the CLI's default recipe's layer spec); the namesake "
            "entry points' default is SPARSESWAPS_SPEC",
            DeprecationWarning,
            2,
        )
        return RECIPES["best"].spec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
