"""The thin engine client: the protocol's verbs (docs/protocol.md section 14) over a ``Connection``
(``tierd_client.session``: I/O thread, deadlines, HELLO, heartbeats, restart recovery, BYE).

Each verb sends the typed request of tierd.protocol.messages that the daemon decodes it into, so
a field's name and default are written once for both sides. Its parts (a namespace, group specs,
chunks) may be those types too or plain maps of the same fields: both encode to the same map."""

from __future__ import annotations

from concurrent.futures import Future

from tierd.protocol import MAX_LOOKUP_PARTS, MAX_REQUEST_IDS, MAX_REQUEST_PARTS, messages
from tierd.protocol.layout import Namespace
from tierd_client.errors import DaemonUnavailable, DeadlineExceeded, TierdError
from tierd_client.futures import join, merge_retrieves, merge_stores
from tierd_client.session import Connection

__all__ = ["TierdClient", "TierdError", "DeadlineExceeded", "DaemonUnavailable"]


class TierdClient(Connection):
    def register(
        self, instance: str, layout: dict, timeout: float | None = None, publish: object | None = None
    ) -> dict:
        return self.register_async(instance, layout, timeout, publish).result()

    def unregister(self, instance: str, timeout: float | None = None) -> dict:
        self._registrations.pop(instance, None)
        return self.call("UNREGISTER", messages.Unregister(instance), timeout)

    def lookup_async(
        self,
        namespace: Namespace | dict,
        keys: list[bytes],
        groups: list,
        chunk_tokens: int,
        *,
        replicated: bool = False,
        lease: bool = True,
        timeout: float | None = None,
        wait: bool = False,
    ) -> Future:
        body = lookup_request(namespace, keys, groups, chunk_tokens, replicated, lease)
        return self.call_async("LOOKUP", body, timeout, wait=wait)

    def lookup(self, *args, **kwargs) -> dict:
        return self.lookup_async(*args, wait=True, **kwargs).result()

    def release(self, lease: int, timeout: float | None = None) -> dict:
        return self.call("RELEASE", messages.Release(lease), timeout)

    def store_async(
        self,
        instance: str,
        chunks: list,
        touch: list[bytes] | None = None,
        timeout: float | None = None,
        event: bytes | None = None,
        wait: bool = False,
    ) -> Future:
        parts = _split(chunks)
        futs = []
        for i, part in enumerate(parts):
            # event (CUDA): the IPC event the daemon's gather waits on
            body = messages.Store(instance, part, touch=(touch or []) if i == 0 else [], event=event)
            futs.append(self.call_async("STORE", body, timeout, wait=wait and len(parts) == 1))
        return _one(futs, merge_stores)

    def store(self, *args, **kwargs) -> dict:
        return self.store_async(*args, wait=True, **kwargs).result()

    def retrieve_async(
        self,
        instance: str,
        chunks: list,
        lease: int = 0,
        timeout: float | None = None,
        wait: bool = False,
    ) -> Future:
        parts = _split(chunks)
        futs = [
            self.call_async(
                "RETRIEVE",
                messages.Retrieve(instance, part, lease=lease),
                timeout,
                wait=wait and len(parts) == 1,
            )
            for part in parts
        ]
        return _one(futs, merge_retrieves)

    def retrieve(self, *args, **kwargs) -> dict:
        return self.retrieve_async(*args, wait=True, **kwargs).result()

    def ping(self, timeout: float | None = None) -> dict:
        return self.call("PING", messages.Ping(), timeout)

    def status(self, timeout: float | None = None) -> dict:
        return self.call("STATUS", messages.Status(), timeout)

    def clear(self, timeout: float | None = None) -> dict:
        return self.call("CLEAR", messages.Clear(), timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def lookup_request(
    namespace: Namespace | dict,
    keys: list[bytes],
    groups: list,
    chunk_tokens: int,
    replicated: bool,
    lease: bool,
) -> messages.Lookup:
    """The LOOKUP of ``keys``, or of their longest prefix the daemon folds: at most
    MAX_LOOKUP_PARTS (keys x groups x ranks) per LOOKUP (a hit is a prefix anyway)."""
    if isinstance(namespace, Namespace):
        world = namespace.world_size
    else:
        world = int(namespace.get("world_size", 1))
    ranks = 1 if replicated else world
    keys = keys[: max(1, MAX_LOOKUP_PARTS // (max(1, len(groups)) * max(1, ranks)))]
    return messages.Lookup(namespace, keys, chunk_tokens, groups, replicated=replicated, lease=lease)


def blocks_of(chunk) -> list:
    """A chunk's block ids per group, of a typed Chunk or a plain map."""
    return chunk.blocks if isinstance(chunk, messages.Chunk) else chunk["blocks"]


def _split(chunks: list) -> list[list]:
    """``chunks`` in requests of at most MAX_REQUEST_PARTS chunks x groups (the daemon's bound)."""
    groups = max(1, len(blocks_of(chunks[0]))) if chunks else 1
    ids = max(1, sum(len(b) for b in blocks_of(chunks[0]))) if chunks else 1
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
