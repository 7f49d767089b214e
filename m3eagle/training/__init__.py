"""Training pipeline for m3eagle's embedded default model: corpus -> tokenizer -> target -> Eagle3 head
-> evaluation. Each stage is a CLI command (see `cli.py`) with a resumable output directory."""
