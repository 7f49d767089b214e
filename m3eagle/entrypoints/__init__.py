"""What users call: the offline `LLM` API, the `m3eagle` CLI and the OpenAI-compatible server."""
