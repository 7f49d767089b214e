"""Batch-invariant kernels: each row's result is independent of the batch, its chunking and its position."""
