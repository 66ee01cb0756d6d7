"""Lightning integration: :class:`SparseSwapsPruning` prunes a LightningModule during ``Trainer.fit``.

Needs the ``lightning`` extra (``pip install 'sparseswaps-prune[lightning]'``). :func:`restore_masks` (for
``load_from_checkpoint`` of a pruned module) lives in :mod:`sparseswaps_prune.modules` and is offered here too.
"""

from sparseswaps_prune.extras import require

require("lightning", "lightning")

from sparseswaps_prune.callbacks.sparseswaps import LayerStats, SparseSwapsPruning, all_reduce_grams  # noqa: E402
from sparseswaps_prune.modules import restore_masks  # noqa: E402

__all__ = ["LayerStats", "SparseSwapsPruning", "all_reduce_grams", "restore_masks"]
