"""sparseswaps-prune: exact 1-swap refinement of pruning masks (SparseSwaps, arXiv 2512.10922)."""

from sparseswaps_prune.core.gram import GramAccumulator
from sparseswaps_prune.core.layer import LayerOutcome, prune_layer
from sparseswaps_prune.core.losses import row_losses
from sparseswaps_prune.core.refine import RefineResult, refine_mask
from sparseswaps_prune.core.refit import refit_weights
from sparseswaps_prune.core.spec import DEFAULT_SPEC, RECIPES, SPARSESWAPS_SPEC, PruneSpec, build_spec
from sparseswaps_prune.core.warmstart import warmstart_mask
from sparseswaps_prune.prune import SparseSwapsMethod, sparseswaps_unstructured

__all__ = [
    "DEFAULT_SPEC",
    "RECIPES",
    "SPARSESWAPS_SPEC",
    "GramAccumulator",
    "LayerOutcome",
    "PruneSpec",
    "RefineResult",
    "SparseSwapsMethod",
    "build_spec",
    "prune_layer",
    "refine_mask",
    "refit_weights",
    "row_losses",
    "sparseswaps_unstructured",
    "warmstart_mask",
]
__version__ = "0.1.0"
