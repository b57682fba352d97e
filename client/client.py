"""The thin engine client: the protocol's verbs (docs/protocol.md section 14) over a ``Session``
(``tierd_client.session``: I/O thread, deadlines, HELLO, heartbeats, restart recovery, BYE)."""

from __future__ import annotations

from concurrent.futures import Future

from tierd_client.errors import DaemonUnavailable, DeadlineExceeded, TierdError
from tierd_client.session import Session

__all__ = ["TierdClient", "TierdError", "DeadlineExceeded", "DaemonUnavailable"]


class TierdClient(Session):
    def register(self, instance: str, layout: dict, timeout: float | None = None, publish: object | None = None) -> dict:
        return self.register_async(instance, layout, timeout, publish).result()

    def unregister(self, instance: str, timeout: float | None = None) -> dict:
        self._registrations.pop(instance, None)
        return self.call("UNREGISTER", {"instance": instance}, timeout)

    def lookup_async(self, namespace: dict, keys: list[bytes], groups: list[dict], chunk_tokens: int,
                     *, replicated: bool = False, lease: bool = True, timeout: float | None = None) -> Future:
        body = {"namespace": namespace, "keys": keys, "groups": groups, "chunk_tokens": chunk_tokens,
                "replicated": replicated, "lease": lease}
        return self.call_async("LOOKUP", body, timeout)

    def lookup(self, *args, **kwargs) -> dict:
        return self.lookup_async(*args, **kwargs).result()

    def release(self, lease: int, timeout: float | None = None) -> dict:
        return self.call("RELEASE", {"lease": lease}, timeout)

    def store_async(self, instance: str, chunks: list[dict], touch: list[bytes] | None = None,
                    timeout: float | None = None, event: bytes | None = None) -> Future:
        body = {"instance": instance, "chunks": chunks}
        if touch:
            body["touch"] = touch
        if event is not None:
            body["event"] = event  # CUDA: IPC event the daemon's gather waits on
        return self.call_async("STORE", body, timeout)

    def store(self, *args, **kwargs) -> dict:
        return self.store_async(*args, **kwargs).result()

    def retrieve_async(self, instance: str, chunks: list[dict], lease: int = 0, timeout: float | None = None) -> Future:
        return self.call_async("RETRIEVE", {"instance": instance, "chunks": chunks, "lease": lease}, timeout)

    def retrieve(self, *args, **kwargs) -> dict:
        return self.retrieve_async(*args, **kwargs).result()

    def ping(self, timeout: float | None = None) -> dict:
        return self.call("PING", {}, timeout)

    def status(self, timeout: float | None = None) -> dict:
        return self.call("STATUS", {}, timeout)

    def clear(self, timeout: float | None = None) -> dict:
        return self.call("CLEAR", {}, timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

