"""FP8 weights: the MXFP8 format of the MiniMax-M3 release (e4m3 values, one power-of-two scale per 1 x 32 block
along K) and block FP8 (float scales per [bn, bk] tile), their plain PyTorch quantize / dequantize (`mxfp8.py`),
and the W8A16 Triton kernels that read them."""
