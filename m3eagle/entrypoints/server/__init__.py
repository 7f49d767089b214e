"""The OpenAI-compatible HTTP server: app.py (routes, SSE, shutdown), protocol.py (request bodies, errors),
async_engine.py (the engine thread and its hand-off to asyncio), metrics.py (Prometheus). Chat
templates live in ../chat.py, shared with LLM.chat()."""

from m3eagle.entrypoints.server.app import OpenAIServer, ServerThread, run_server

__all__ = ["OpenAIServer", "ServerThread", "run_server"]
