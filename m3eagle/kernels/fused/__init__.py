"""Fused elementwise ops (norms, RoPE, activations, router): plain PyTorch in `reference.py`, one Triton
kernel per chain in `triton_fused.py`, picked per engine through `backend.create`."""
