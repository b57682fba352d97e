"""The thin engine client: the protocol's verbs (docs/protocol.md section 14) over a ``Connection``
(``tierd_client.session``: I/O thread, deadlines, HELLO, heartbeats, restart recovery, BYE).

Each verb sends the typed request of tierd.protocol.messages that the daemon decodes it into, its
parts (a namespace, group specs, a layout, chunks) typed too, so a field's name and default are
written once for both sides. A part may be given as a plain map of its fields: the verb converts
it with the daemon's own checks (tierd_client.wire.typed), so a field the daemon does not know is
refused before anything is sent. Each verb returns the op's typed reply (messages.REPLIES, read
through tierd_client.wire): ``lookup`` a LookupReply, ``store`` a StoreReply and so on; ``status``
the /status map. A daemon's error raises TierdError with its code and message."""

from __future__ import annotations

from concurrent.futures import Future

from tierd.protocol import MAX_LOOKUP_PARTS, MAX_REQUEST_IDS, MAX_REQUEST_PARTS, messages
from tierd.protocol.layout import GroupSpec, Namespace, PageLayout
from tierd_client.errors import DaemonUnavailable, DeadlineExceeded, TierdError
from tierd_client.futures import failed, join, merge_retrieves, merge_stores
from tierd_client.session import Connection
from tierd_client.wire import typed

__all__ = ["TierdClient", "TierdError", "DeadlineExceeded", "DaemonUnavailable"]


class TierdClient(Connection):
    def register(
        self,
        instance: str,
        layout: PageLayout | dict,
        timeout: float | None = None,
        publish: object | None = None,
    ) -> messages.RegisterReply:
        return self.register_async(instance, layout, timeout, publish).result()

    def unregister(self, instance: str, timeout: float | None = None) -> messages.Empty:
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
        try:
            body = lookup_request(namespace, keys, groups, chunk_tokens, replicated, lease)
        except TierdError as exc:
            return failed(exc)
        return self.call_async("LOOKUP", body, timeout, wait=wait)

    def lookup(self, *args, **kwargs) -> messages.LookupReply:
        return self.lookup_async(*args, wait=True, **kwargs).result()

    def release(self, lease: int, timeout: float | None = None) -> messages.Empty:
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
        try:
            parts = _split(typed_chunks(chunks))
        except TierdError as exc:
            return failed(exc)
        futs = []
        for i, part in enumerate(parts):
            # event (CUDA): the IPC event the daemon's gather waits on
            body = messages.Store(instance, part, touch=(touch or []) if i == 0 else [], event=event)
            futs.append(self.call_async("STORE", body, timeout, wait=wait and len(parts) == 1))
        return _one(futs, merge_stores)

    def store(self, *args, **kwargs) -> messages.StoreReply:
        return self.store_async(*args, wait=True, **kwargs).result()

    def retrieve_async(
        self,
        instance: str,
        chunks: list,
        lease: int = 0,
        timeout: float | None = None,
        wait: bool = False,
    ) -> Future:
        try:
            parts = _split(typed_chunks(chunks))
        except TierdError as exc:
            return failed(exc)
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

    def retrieve(self, *args, **kwargs) -> messages.RetrieveReply:
        return self.retrieve_async(*args, wait=True, **kwargs).result()

    def ping(self, timeout: float | None = None) -> messages.PingReply:
        return self.call("PING", messages.Ping(), timeout)

    def status(self, timeout: float | None = None) -> dict:
        """The daemon's /status object (docs/protocol.md section 16), a map."""
        return self.call("STATUS", messages.Status(), timeout)

    def clear(self, timeout: float | None = None) -> messages.ClearReply:
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
    MAX_LOOKUP_PARTS (keys x groups x ranks) per LOOKUP (a hit is a prefix anyway). ``namespace``
    and ``groups`` typed, or plain maps converted (tierd_client.wire.typed; raises TierdError)."""
    namespace = typed(namespace, Namespace, "namespace")
    for g in groups:  # (converted only when some are not typed: a LOOKUP's every microsecond counts)
        if type(g) is not GroupSpec:
            groups = tuple(typed(g, GroupSpec, f"groups[{i}]") for i, g in enumerate(groups))
            break
    ranks = 1 if replicated else namespace.world_size
    keys = keys[: max(1, MAX_LOOKUP_PARTS // (max(1, len(groups)) * max(1, ranks)))]
    return messages.Lookup(namespace, keys, chunk_tokens, groups, replicated=replicated, lease=lease)


def blocks_of(chunk) -> list:
    """A chunk's block ids per group, of a typed Chunk or a plain map."""
    return chunk.blocks if isinstance(chunk, messages.Chunk) else chunk["blocks"]


def typed_chunks(chunks: list) -> list[messages.Chunk]:
    """``chunks`` as typed Chunks: themselves when they are, else each converted (raises TierdError)."""
    for c in chunks:
        if type(c) is not messages.Chunk:
            return [typed(c, messages.Chunk, f"chunks[{i}]") for i, c in enumerate(chunks)]
    return chunks


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
