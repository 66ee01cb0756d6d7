"""Pure tensor math of SparseSwaps: no ``nn.Module``, no model, no I/O."""
