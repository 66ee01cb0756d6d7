"""sparseswaps-prune: exact 1-swap refinement of pruning masks (SparseSwaps, arXiv 2512.10922)."""

from sparseswaps_prune.core.gram import GramAccumulator
from sparseswaps_prune.core.losses import row_losses
from sparseswaps_prune.core.refit import refit_weights
from sparseswaps_prune.core.swaps import RefineResult, refine_mask
from sparseswaps_prune.core.warmstart import warmstart_mask
from sparseswaps_prune.prune import SparseSwapsMethod, sparseswaps_unstructured

__all__ = [
    "GramAccumulator",
    "RefineResult",
    "SparseSwapsMethod",
    "refine_mask",
    "refit_weights",
    "row_losses",
    "sparseswaps_unstructured",
    "warmstart_mask",
]
__version__ = "0.1.0"
