"""Routed-expert computation behind one interface: `reference` (dense PyTorch, the oracle and the training
path) and `triton` (fused kernels that compute only the chosen experts). `backend.create(name)` builds one;
the model receives it as `impl`. Importing this package does not import triton."""
