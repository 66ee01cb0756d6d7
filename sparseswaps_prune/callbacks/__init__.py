"""Lightning integration: :class:`SparseSwapsPruning` prunes a LightningModule during ``Trainer.fit``."""

from sparseswaps_prune.callbacks.sparseswaps import LayerStats, SparseSwapsPruning, all_reduce_grams, restore_masks

__all__ = ["LayerStats", "SparseSwapsPruning", "all_reduce_grams", "restore_masks"]
