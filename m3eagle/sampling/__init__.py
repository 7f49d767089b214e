"""Sampling: parameters, counter-based sampling, penalties and lossless speculative verification."""
