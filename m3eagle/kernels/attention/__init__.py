"""Paged attention: the step metadata, the plain PyTorch reference and the Triton dense / sparse (MSA) and
indexer kernels, behind one backend interface."""
