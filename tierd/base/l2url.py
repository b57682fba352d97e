"""``--l2-url mooncake://MASTER_HOST[:PORT]?k=v&...`` parsed into a frozen :class:`MooncakeUrl`.

Hazards, as Mooncake 0.3.13 behaves (checked on this host, see the tests and docs/l2 notes):

- Mooncake's transfer engine advertises ``MC_TCP_BIND_ADDRESS`` if set, else the *first
  non-loopback interface* it finds; the host part of ``local_hostname`` is ignored for that. On a
  multi-homed node peers may be told an address they cannot reach, and in a namespace with only
  ``lo`` setup fails ("not valid LAN address found"). ``local=`` (or the address this host reaches
  the master from) is therefore exported as ``MC_TCP_BIND_ADDRESS`` by :mod:`tierd.tier2.mooncake`,
  process-wide, unless the operator already set it.
- The master's RPC port defaults to 50051 and its HTTP metadata server to 8080 (both from
  ``mooncake_master --help``). 8080 is often taken by something else: say ``metadata=`` then.
  The metadata server and the transfer engine's handshake and data ports bind 0.0.0.0 whatever
  host they are given: firewall them, or (tests) run them in a network namespace of their own.
- ``local`` without a port lets Mooncake pick one in 12300-14300 (``MC_STORE_CLIENT_MIN_PORT`` /
  ``MAX_PORT``), retrying 20 times on collisions, about 4.5 s per try when the master is absent;
  an explicit port is tried once and a collision fails setup.

:func:`parse_url` is pure (no DNS, no sockets); :func:`route_host` picks the local address.
"""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass, fields
from urllib.parse import parse_qsl, urlsplit

SCHEME = "mooncake"
MASTER_PORT = 50051  # mooncake_master -port default
METADATA_PORT = 8080  # mooncake_master -http_metadata_server_port default
PROTOCOLS = ("tcp", "rdma")
METADATA_SCHEMES = ("http", "https", "etcd", "redis")
PARAMETERS = (
    "metadata",
    "protocol",
    "device",
    "local",
    "segment_gb",
    "timeout_ms",
    "setup_timeout_s",
    "retry_s",
    "fail_after",
    "tenant",
    "prefix",
)


@dataclass(frozen=True)
class MooncakeUrl:
    """One Mooncake Store the daemon joins. Field docstrings are the ``--l2-url`` help."""

    master_host: str
    master_port: int = MASTER_PORT
    metadata: str = ""
    """Transfer-engine metadata service: http(s)://, etcd://, redis:// or P2PHANDSHAKE.
    Default: the master's own HTTP metadata server, http://MASTER_HOST:8080/metadata."""
    protocol: str = "tcp"
    """tcp, or rdma (then ``device`` names the NICs, e.g. mlx5_0,mlx5_1; empty: auto-discovery)."""
    device: str = ""
    local_host: str | None = None
    """Address peers reach this node's segment at. Default: the one this host reaches the master from."""
    local_port: int | None = None
    """Port naming this client to the master. Default: Mooncake picks a free one (12300-14300)."""
    segment_gb: float = 4.0
    """GiB of memory this daemon contributes to the shared pool (0: a pure client)."""
    timeout_ms: int = 2000
    """Deadline of each put/get/exists/remove call; past it the call's keys fail."""
    setup_timeout_s: float = 30.0
    """Deadline of connecting; past it the tier is degraded (and keeps retrying)."""
    retry_s: float = 5.0
    """While degraded: how often to probe the master (or retry setup)."""
    fail_after: int = 3
    """Consecutive failed calls that mark the tier degraded (a timeout does at once)."""
    tenant: str = "default"
    """Mooncake tenant id (its multi-tenant quotas, when the master enables them)."""
    prefix: str = "tierd"
    """First part of every object name, so an operator can list or drop tierd's objects."""

    def __post_init__(self):
        if not self.metadata:
            object.__setattr__(
                self, "metadata", f"http://{_bracket(self.master_host)}:{METADATA_PORT}/metadata"
            )

    @property
    def master_addr(self) -> str:
        return f"{_bracket(self.master_host)}:{self.master_port}"

    @property
    def segment_bytes(self) -> int:
        return int(self.segment_gb * (1 << 30))

    def local_hostname(self, host: str) -> str:
        """What ``setup`` gets as this client's name: ``host`` or ``host:port``."""
        return _bracket(host) if self.local_port is None else f"{_bracket(host)}:{self.local_port}"

    def __str__(self) -> str:
        """The canonical URL, every parameter spelled out (for /status and logs)."""
        parts = []
        for f in fields(self):
            if f.name in ("master_host", "master_port", "local_host", "local_port"):
                continue
            parts.append(f"{f.name}={getattr(self, f.name)}")
        local = "auto" if self.local_host is None else _bracket(self.local_host)
        if self.local_port is not None:
            local += f":{self.local_port}"
        return f"{SCHEME}://{self.master_addr}?local={local}&" + "&".join(parts)


def parse_url(url: str) -> MooncakeUrl:
    """``mooncake://HOST[:PORT]?metadata=&protocol=&device=&local=HOST[:PORT]&segment_gb=&...``.

    Raises ValueError naming the part that is wrong: scheme, master, an unknown or repeated
    parameter, or a value out of range.
    """
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(f"l2 url {url!r}: expected {SCHEME}://MASTER_HOST[:PORT]?...")
    try:
        split = urlsplit(url)
    except ValueError:  # urllib's own check of [ ]
        raise ValueError(f"l2 url master in {url!r}: unbalanced [ ] around an IPv6 address") from None
    if split.scheme != SCHEME:
        raise ValueError(f"l2 url scheme {split.scheme!r}: only {SCHEME}:// is supported")
    if split.path not in ("", "/") or split.fragment:
        raise ValueError(f"l2 url {url!r}: nothing may follow the master but ?parameters")
    host, port = _host_port(split.netloc, "master")
    kw: dict[str, object] = {"master_host": host, "master_port": MASTER_PORT if port is None else port}
    seen: set[str] = set()
    try:
        pairs = parse_qsl(split.query, keep_blank_values=True, strict_parsing=bool(split.query))
    except ValueError as e:
        raise ValueError(f"l2 url parameters {split.query!r}: {e}, expected name=value&...") from None
    for name, value in pairs:
        if name in seen:
            raise ValueError(f"l2 url parameter {name!r} given twice")
        seen.add(name)
        kw.update(_parameter(name, value))
    return MooncakeUrl(**kw)


def _parameter(name: str, value: str) -> dict[str, object]:
    if name == "metadata":
        scheme = value.split("://", 1)[0] if "://" in value else ""
        if value != "P2PHANDSHAKE" and scheme not in METADATA_SCHEMES:
            raise ValueError(
                f"l2 url metadata={value!r}: expected {'/'.join(METADATA_SCHEMES)}:// or P2PHANDSHAKE"
            )
        return {"metadata": value}
    if name == "protocol":
        if value not in PROTOCOLS:
            raise ValueError(f"l2 url protocol={value!r}: expected one of {', '.join(PROTOCOLS)}")
        return {"protocol": value}
    if name == "local":
        host, port = _host_port(value, "local")
        return {"local_host": host, "local_port": port}
    if name in ("device", "tenant", "prefix"):
        if name != "device" and not value:
            raise ValueError(f"l2 url {name}= is empty")
        if any(c.isspace() for c in value):
            raise ValueError(f"l2 url {name}={value!r}: no whitespace allowed")
        return {name: value}
    if name in ("segment_gb", "setup_timeout_s", "retry_s"):
        low = 0.0 if name == "segment_gb" else 1e-3
        return {name: _number(name, value, float, low)}
    if name in ("timeout_ms", "fail_after"):
        return {name: _number(name, value, int, 1)}
    raise ValueError(f"l2 url parameter {name!r} unknown (known: {', '.join(PARAMETERS)})")


def _number(name: str, text: str, kind: type, low: float):
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(
            f"l2 url {name}={text!r}: not a{'n integer' if kind is int else ' number'}"
        ) from None
    if not math.isfinite(value) or value < low:
        raise ValueError(f"l2 url {name}={text!r}: must be at least {low:g}")
    return value


def _host_port(text: str, what: str) -> tuple[str, int | None]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port``; ValueError naming ``what``."""
    if "@" in text or "/" in text or not text:
        raise ValueError(f"l2 url {what} {text!r}: expected HOST[:PORT]")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"l2 url {what} {text!r}: unbalanced [ ] around an IPv6 address")
        port_text = rest[1:] if rest else None
    else:
        host, sep, port_text = text.partition(":")
        port_text = port_text if sep else None
    bad = "[] \t\n" if text.startswith("[") else "[]: \t\n"
    if not host or any(c in bad for c in host):
        raise ValueError(f"l2 url {what} host {host!r} is not a host name or address")
    if port_text is None:
        return host, None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"l2 url {what} port {port_text!r}: expected 1-65535")
    return host, int(port_text)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def route_host(master_host: str, master_port: int) -> str:
    """The local address the kernel would use to reach the master (a UDP connect: no packet sent)."""
    info = socket.getaddrinfo(master_host, master_port, 0, socket.SOCK_DGRAM)
    with socket.socket(info[0][0], socket.SOCK_DGRAM) as s:
        s.connect(info[0][4])
        return s.getsockname()[0]
