"""tierd: a node-local KV-cache tier for LLM serving."""

__version__ = "0.1.0"
