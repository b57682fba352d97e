"""The client's routing identity never starts with a zero byte (ZeroMQ reserves those for the
identities a ROUTER makes up for peers that name none), whatever the random source gives."""

from __future__ import annotations

import uuid

from tierd_client import TierdClient


def test_the_clients_routing_identity_never_starts_with_a_zero_byte(monkeypatch, tmp_path):
    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(bytes=bytes(16)))  # the 1-in-256 draw, always
    conn = TierdClient(f"ipc://{tmp_path}/none.sock", connect_timeout_s=0.1, lookup_channel=False)
    try:
        ident = conn.transport.identity
    finally:
        conn.close(bye_timeout=0.1)
    assert len(ident) == 16 and ident[0] != 0, ident
