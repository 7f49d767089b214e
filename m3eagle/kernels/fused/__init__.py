"""Fused elementwise ops (norms, RoPE, activations, argmax) and the decode GEMV: plain PyTorch in `reference.py`,
one Triton launch per chain in `norm.py`, `rope.py`, `activation.py`, `argmax.py` and `gemv.py`, behind the
`FusedOps` interface (`backend.py`, `triton_backend.py`) that each engine picks through `registry.create`."""
