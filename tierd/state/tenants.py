"""Tenants: who a session acts as, and what it may touch (docs/protocol.md section 21).

A session's tenant is fixed at HELLO from what the kernel says about its connection, never from
what the client claims:

- ``ipc://``: the connecting process's uid (SO_PEERCRED, tierd.edge.peer). The daemon's own user is
  the *default tenant* (``""``); any other uid ``N`` is tenant ``uid:N``. The daemon's user and
  root are operators (CLEAR; every instance and lease in /status).
- ``tcp://``: a token from ``--tcp-token-file`` (lines ``TENANT TOKEN``) sent in HELLO; the tenant
  is ``tcp:TENANT`` (an operator when TENANT is ``admin``). Without a valid token HELLO is
  FORBIDDEN, unless ``--insecure-tcp`` admits every tcp client as the default tenant.

Isolation is by construction: a tenant's namespace ids are derived from its name and the
namespace it names (``scoped_namespace_id``), so two tenants naming the same model never share
objects, and instance names and leases are looked up within the caller's tenant only.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from dataclasses import dataclass

from tierd.edge.peer import Peer
from tierd.protocol.errors import ErrorCode, ProtocolError
from tierd.protocol.keys import KEY_BYTES, namespace_id
from tierd.protocol.layout import Namespace

DEFAULT_TENANT = ""
ADMIN = "admin"


@dataclass(frozen=True)
class Principal:
    """What a session acts as."""

    tenant: str  # "" (the daemon's own user), "uid:N" or "tcp:NAME"
    operator: bool  # may CLEAR and sees every tenant in /status
    peer_key: str  # what --max-sessions-per-peer counts: "uid:N", "tcp:NAME" or "tcp"


def scoped_namespace_id(tenant: str, ns: Namespace) -> bytes:
    """The index's namespace key of ``ns`` as named by ``tenant`` (the plain id for the default tenant)."""
    base = namespace_id(ns)
    if not tenant:
        return base
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"tierd/tenant/v1")
    h.update(tenant.encode())
    h.update(b"\0")
    h.update(base)
    return h.digest()


class TokenFileError(ValueError):
    pass


def load_tokens(path: str) -> dict[str, str]:
    """``token -> tenant`` from a file of ``TENANT TOKEN`` lines (``#`` comments). The file must be
    a regular file not readable by group or others (a token is a password)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise TokenFileError(f"--tcp-token-file {path}: {exc.strerror}") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise TokenFileError(f"--tcp-token-file {path}: not a regular file")
        if st.st_mode & 0o077:
            raise TokenFileError(
                f"--tcp-token-file {path}: mode {stat.S_IMODE(st.st_mode):04o} lets others read "
                f"the tokens; chmod 0600 it"
            )
        tokens: dict[str, str] = {}
        for n, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2 or len(parts[1]) < 16:
                raise TokenFileError(
                    f"--tcp-token-file {path}:{n}: want 'TENANT TOKEN' with a token of at least 16 characters"
                )
            tenant, token = parts
            if not tenant.isprintable():
                raise TokenFileError(f"--tcp-token-file {path}:{n}: the tenant name has a control character")
            if token in tokens:
                raise TokenFileError(
                    f"--tcp-token-file {path}:{n}: this token is already tenant {tokens[token]!r}'s"
                )
            tokens[token] = tenant
    if not tokens:
        raise TokenFileError(f"--tcp-token-file {path}: no 'TENANT TOKEN' line")
    return tokens


class Tenants:
    """Decides a connection's principal at HELLO."""

    def __init__(
        self, tcp: bool, tokens: dict[str, str] | None, insecure_tcp: bool, own_uid: int | None = None
    ):
        self.tcp = tcp
        self.tokens = tokens or {}
        self.insecure_tcp = insecure_tcp
        self.own_uid = os.getuid() if own_uid is None else own_uid

    def principal(self, peer: Peer, token: str) -> Principal:
        if peer.local:
            uid = peer.uid
            if uid == self.own_uid:
                return Principal(DEFAULT_TENANT, True, f"uid:{uid}")
            return Principal(f"uid:{uid}", uid == 0, f"uid:{uid}")
        if not self.tcp:  # an ipc:// connection always has credentials; refuse rather than guess
            raise ProtocolError(ErrorCode.FORBIDDEN, "the connection carries no credentials")
        name = self._token_tenant(token)
        if name is not None:
            return Principal(f"tcp:{name}", name == ADMIN, f"tcp:{name}")
        if self.insecure_tcp:
            return Principal(DEFAULT_TENANT, True, "tcp")
        if token:
            raise ProtocolError(ErrorCode.FORBIDDEN, "the tenant token is not one of --tcp-token-file's")
        raise ProtocolError(
            ErrorCode.FORBIDDEN,
            "a tcp:// client must send a tenant token in HELLO (the daemon "
            "runs with --tcp-token-file; --insecure-tcp admits clients without one)",
        )

    def _token_tenant(self, token: str) -> str | None:
        if not token:
            return None
        found = None
        given = token.encode()
        for known, tenant in self.tokens.items():  # every token compared, in constant time each
            if hmac.compare_digest(known.encode(), given):
                found = tenant
        return found
