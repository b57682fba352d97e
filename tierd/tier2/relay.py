"""What runs on the tier's worker thread: the agent, the answers it gives, and the health verdict.

Hazards:

- Only the worker thread calls a Relay (``terminate`` excepted), so the agent sees one request at
  a time and its replies cannot cross.
- Codes become one bool per key here, and nothing else decides it: put True = stored or already
  there; get True = exactly the asked size landed (a larger object fails INVALID_PARAMS, a smaller
  one returns its size: both count SIZE_MISMATCH); exists True = present now; remove True = gone
  or never there (False for a key read within the master's lease TTL).
- Health: a call in which *every* key failed with an error code (not miss, full, exists or lease)
  is a failure; ``fail_after`` failures in a row call ``trouble``. One answered key resets the
  run, so a dead peer's segment (transfer errors for its objects only) does not take the tier
  down. A lost agent calls ``trouble`` at once.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable

from tierd.base.l2url import MooncakeUrl, route_host
from tierd.tier2 import client
from tierd.tier2.buffers import Buf, Buffers
from tierd.tier2.client import (
    ANSWERS,
    INVALID_PARAMS,
    NO_AVAILABLE_HANDLE,
    OBJECT_ALREADY_EXISTS,
    OBJECT_HAS_LEASE,
    OBJECT_NOT_FOUND,
    OK,
)
from tierd.tier2.link import AgentLink, AgentLost
from tierd.tier2.stats import L2Stats


class Relay:
    def __init__(
        self,
        url: MooncakeUrl,
        stats: L2Stats,
        buffers: Buffers,
        hang_s: float,
        trouble: Callable[[str], None],
        joined: Callable[[str], None],
    ):
        self.url, self.stats, self.buffers, self.hang_s = url, stats, buffers, hang_s
        self._trouble, self._joined = trouble, joined
        self.link: AgentLink | None = None
        self.connected = False  # the agent holds a client that joined the store
        self.registered: set[int] = set()  # buffer ids that client holds
        self.local = ""
        self.failures = 0
        self.last_error = ""

    # -- lifecycle -----------------------------------------------------------------------------

    def setup(self) -> bool:
        """Start an agent if there is none, have it join the store, hand it every buffer."""
        t0 = time.monotonic()
        try:
            if self.link is None or not self.link.alive:
                self.link = AgentLink(self.hang_s)
            host = self.url.local_host or route_host(self.url.master_host, self.url.master_port)
            rc, local = self.link.call("setup", dataclasses.asdict(self.url), host)
            if rc != 0:
                raise client.SetupFailed(rc, local)
            self.connected, self.registered, self.local = True, set(), local
            for buf in self.buffers.snapshot():
                if not self.register(buf):
                    raise client.SetupFailed(-1, f"the agent could not register buffer {buf.ident}")
        except (client.SetupFailed, client.L2Unavailable, AgentLost, OSError) as e:
            self.stats.add(setup_failures=1)
            if isinstance(e, AgentLost):
                self.link = None
            self.connected, self.last_error = False, str(e)
            self._trouble(str(e))
            return False
        finally:
            self.stats.observe("setup", time.monotonic() - t0)
        self.failures = 0
        self._joined(f"joined {self.url.master_addr} as {self.local}")
        return True

    def probe(self, name: str) -> bool:
        """While degraded: set up again if the client is gone, else ask the master about one key."""
        if not self.connected:
            return self.setup()
        self.stats.add(probes=1)
        code = (self._ask("exists", [name]) or [-1])[0]
        if code in (0, 1):
            self.failures = 0
            self._joined("the master answers again")
            return True
        self.last_error = f"probe: {client.code_name(code)}"
        return False

    def register(self, buf: Buf) -> bool:
        """True once the agent's client holds it; False while unconnected (setup registers it)."""
        if buf.ident in self.registered or not self.connected:
            return buf.ident in self.registered
        try:
            rc = self.link.call("register", buf.ident, buf.nbytes, buf.offset, fds=(buf.fd,))
        except AgentLost as e:
            self._lost(str(e))
            return False
        if rc == 0:
            self.registered.add(buf.ident)
        else:
            self.stats.code(client.code_name(rc) if isinstance(rc, int) else "REGISTER_FAILED")
        return rc == 0

    def unregister(self, buf: Buf) -> bool:
        """The agent drops it; then our duplicate descriptor is closed."""
        ok = True
        try:
            if self.connected and buf.ident in self.registered:
                self.registered.discard(buf.ident)
                ok = self.link.call("unregister", buf.ident) == 0
        except AgentLost as e:
            self._lost(str(e))
        finally:
            os.close(buf.fd)
        return ok

    def close(self, timeout_s: float) -> bool:
        link, self.link, self.connected = self.link, None, False
        return link is None or link.close(timeout_s)

    def terminate(self) -> None:
        """From any thread: kill the agent so a worker waiting on it moves on."""
        link = self.link
        if link is not None:
            link.terminate()

    # -- data ----------------------------------------------------------------------------------

    def put(self, names, ids, offs, sizes) -> list[bool]:
        codes = self._ask("put", names, ids, offs, sizes)
        if codes is None:
            return self._unanswered(len(names))
        ok = [c in (OK, OBJECT_ALREADY_EXISTS) for c in codes]
        self.stats.add(
            puts=1,
            put_keys=len(names),
            put_stored=sum(ok),
            put_bytes=sum(s for s, o in zip(sizes, ok) if o),
            put_full=sum(c == NO_AVAILABLE_HANDLE for c in codes),
        )
        self._judge(codes, ANSWERS)
        return ok

    def get(self, names, ids, offs, sizes) -> list[bool]:
        codes = self._ask("get", names, ids, offs, sizes)
        if codes is None:
            return self._unanswered(len(names))
        ok = [c == s for c, s in zip(codes, sizes)]
        mismatched = sum(1 for c, s in zip(codes, sizes) if 0 <= c != s or c == INVALID_PARAMS)
        self.stats.add(
            gets=1,
            get_keys=len(names),
            hits=sum(ok),
            misses=sum(c == OBJECT_NOT_FOUND for c in codes),
            get_bytes=sum(s for s, o in zip(sizes, ok) if o),
        )
        if mismatched:
            self.stats.code("SIZE_MISMATCH", mismatched)
        self._judge([OK if c >= 0 else c for c in codes], ANSWERS | {INVALID_PARAMS})
        return ok

    def exists(self, names) -> list[bool]:
        codes = self._ask("exists", names)
        if codes is None:
            return self._unanswered(len(names))
        self.stats.add(exists_calls=1, exists_keys=len(names), exists_hits=sum(c == 1 for c in codes))
        self._judge(codes, {0, 1})
        return [c == 1 for c in codes]

    def remove(self, names) -> list[bool]:
        codes = self._ask("remove", names)
        if codes is None:
            return self._unanswered(len(names))
        ok = [c in (OK, OBJECT_NOT_FOUND) for c in codes]
        self.stats.add(removes=1, removed=sum(ok))
        self._judge(codes, ANSWERS | {OBJECT_HAS_LEASE})
        return ok

    # -- internals -----------------------------------------------------------------------------

    def _unanswered(self, n: int) -> list[bool]:
        self.stats.add(errors=n)
        self.stats.code("AGENT_LOST", n)
        return [False] * n

    def _ask(self, verb: str, names, *args) -> list[int] | None:
        """The agent's codes, one per name (-1 for an answer that makes no sense); None if it died."""
        if self.link is None:
            return None
        try:
            codes = self.link.call(verb, names, *args)
        except AgentLost as e:
            self._lost(str(e))
            return None
        if isinstance(codes, list) and len(codes) == len(names) and all(isinstance(c, int) for c in codes):
            return codes
        self.last_error = f"{verb}: agent answered {str(codes)[:200]}"
        return [-1] * len(names)

    def _lost(self, reason: str) -> None:
        self.link, self.connected, self.registered = None, False, set()
        self.last_error = reason
        self._trouble(reason)

    def _judge(self, codes: list[int], answers) -> None:
        bad = [c for c in codes if c not in answers]
        for c in bad:
            self.stats.code(client.code_name(c))
        self.stats.add(errors=len(bad))
        if not bad or len(bad) < len(codes):
            self.failures = 0
            return
        self.failures += 1
        self.last_error = f"{client.code_name(bad[0])} for all {len(codes)} keys"
        if self.failures >= self.url.fail_after:
            self._trouble(f"{self.failures} calls in a row failed ({self.last_error})")
