"""tierd_client: the thin engine client for the tierd daemon (no vLLM needed)."""

from tierd_client.client import DaemonUnavailable, DeadlineExceeded, TierdClient, TierdError

__all__ = ["TierdClient", "TierdError", "DeadlineExceeded", "DaemonUnavailable"]
