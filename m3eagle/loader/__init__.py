"""Checkpoints in: config and safetensors (bf16 / fp32, MXFP8, block FP8), per-rank slices, random weights,
Eagle3 heads, the tokenizer and the embedded model."""
