"""The thin engine client: the protocol's verbs (docs/protocol.md section 14) over a ``Session``
(``tierd_client.session``: I/O thread, deadlines, HELLO, heartbeats, restart recovery, BYE)."""

from __future__ import annotations

from concurrent.futures import Future

from tierd.protocol import MAX_LOOKUP_PARTS, MAX_REQUEST_PARTS
from tierd_client.errors import DaemonUnavailable, DeadlineExceeded, TierdError
from tierd_client.futures import join, merge_retrieves, merge_stores
from tierd_client.session import Session

MAX_REQUEST_IDS = 1 << 20  # block ids per request: at most ~5 MiB of frame

__all__ = ["TierdClient", "TierdError", "DeadlineExceeded", "DaemonUnavailable"]


class TierdClient(Session):
    def register(
        self, instance: str, layout: dict, timeout: float | None = None, publish: object | None = None
    ) -> dict:
        return self.register_async(instance, layout, timeout, publish).result()

    def unregister(self, instance: str, timeout: float | None = None) -> dict:
        self._registrations.pop(instance, None)
        return self.call("UNREGISTER", {"instance": instance}, timeout)

    def lookup_async(
        self,
        namespace: dict,
        keys: list[bytes],
        groups: list[dict],
        chunk_tokens: int,
        *,
        replicated: bool = False,
        lease: bool = True,
        timeout: float | None = None,
        wait: bool = False,
    ) -> Future:
        # the daemon folds at most MAX_LOOKUP_PARTS (keys x groups x ranks) per LOOKUP: a longer
        # prompt is looked up by its longest prefix that fits (a hit is a prefix anyway)
        ranks = 1 if replicated else int(namespace.get("world_size", 1))
        keys = keys[: max(1, MAX_LOOKUP_PARTS // (max(1, len(groups)) * max(1, ranks)))]
        body = {
            "namespace": namespace,
            "keys": keys,
            "groups": groups,
            "chunk_tokens": chunk_tokens,
            "replicated": replicated,
            "lease": lease,
        }
        return self.call_async("LOOKUP", body, timeout, wait=wait)

    def lookup(self, *args, **kwargs) -> dict:
        return self.lookup_async(*args, wait=True, **kwargs).result()

    def release(self, lease: int, timeout: float | None = None) -> dict:
        return self.call("RELEASE", {"lease": lease}, timeout)

    def store_async(
        self,
        instance: str,
        chunks: list[dict],
        touch: list[bytes] | None = None,
        timeout: float | None = None,
        event: bytes | None = None,
        wait: bool = False,
    ) -> Future:
        parts = _split(chunks)
        futs = []
        for i, part in enumerate(parts):
            body = {"instance": instance, "chunks": part}
            if touch and i == 0:
                body["touch"] = touch
            if event is not None:
                body["event"] = event  # CUDA: IPC event the daemon's gather waits on
            futs.append(self.call_async("STORE", body, timeout, wait=wait and len(parts) == 1))
        return _one(futs, merge_stores)

    def store(self, *args, **kwargs) -> dict:
        return self.store_async(*args, wait=True, **kwargs).result()

    def retrieve_async(
        self,
        instance: str,
        chunks: list[dict],
        lease: int = 0,
        timeout: float | None = None,
        wait: bool = False,
    ) -> Future:
        parts = _split(chunks)
        futs = [
            self.call_async(
                "RETRIEVE",
                {"instance": instance, "chunks": part, "lease": lease},
                timeout,
                wait=wait and len(parts) == 1,
            )
            for part in parts
        ]
        return _one(futs, merge_retrieves)

    def retrieve(self, *args, **kwargs) -> dict:
        return self.retrieve_async(*args, wait=True, **kwargs).result()

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


def _split(chunks: list[dict]) -> list[list[dict]]:
    """``chunks`` in requests of at most MAX_REQUEST_PARTS chunks x groups (the daemon's bound)."""
    groups = max(1, len(chunks[0]["blocks"])) if chunks else 1
    ids = max(1, sum(len(b) for b in chunks[0]["blocks"])) if chunks else 1
    step = max(
        1, min(MAX_REQUEST_PARTS // groups, MAX_REQUEST_IDS // ids)
    )  # and frames well under --max-frame-mb
    return [chunks[i : i + step] for i in range(0, len(chunks), step)] or [chunks]


def _one(futs: list[Future], merge) -> Future:
    """The future of a request sent in parts: the part's own, or their replies merged in order."""
    if len(futs) == 1:
        return futs[0]
    out: Future = Future()
    join(futs, out, merge)
    return out
