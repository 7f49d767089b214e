"""The kernel layer: Triton fast paths for attention (dense and MSA), the routed MoE, the decode GEMV and fused
elementwise ops, each beside the plain PyTorch reference it must equal, and the per-engine choice between them
(`ops.make_ops`). Nothing here imports the models, the engine or anything above them."""
