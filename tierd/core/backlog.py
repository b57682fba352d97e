"""Requests read but not handled yet, and the order the main loop handles them in.

The main loop reads what every socket holds, then handles it one request at a time. In arrival
order, with one exception: a RETRIEVE goes before the STOREs that arrived ahead of it, and the
waiting kinds then take turns (one STORE, one RETRIEVE, ...). An engine waits for its restores
before it can run a step, while its stores only free staging room, so a burst of stores holds a
restore back by at most one store's planning; and both directions of the link get work at once
(on an H200 a burst of 64 MiB stores followed by as many retrieves left the host-to-device
engines idle for the 5 ms the main loop spent planning the stores, about a quarter of the job).
A RETRIEVE never moves past any other op (a REGISTER, a LOOKUP, a RELEASE ...): those keep their
order, and every request of one kind keeps its order among its kind.

Nothing a client can see depends on a STORE planned before a RETRIEVE sent after it: a STORE's
objects are readable only once its copy is done and committed, which comes after both were
planned either way. (A RETRIEVE planned first pins what it reads, so a STORE behind it evicts
something else.)
"""

from __future__ import annotations

from collections import deque

# how the two ops' frames begin (tierd.protocol.codec: a 3-array whose first item is the op, a
# msgpack fixstr); a frame encoded otherwise is handled in arrival order, like any other op
_STORE = b"\x93\xa5STORE"
_RETRIEVE = b"\x93\xa8RETRIEVE"
STORE, RETRIEVE, OTHER = 0, 1, 2


def kind(frame) -> int:
    """STORE, RETRIEVE or OTHER, from the head of a request frame alone."""
    head = bytes(frame[:10])
    if head.startswith(_STORE):
        return STORE
    if head.startswith(_RETRIEVE):
        return RETRIEVE
    return OTHER


class Backlog:
    """Requests waiting for the main loop: ``put`` in arrival order, ``take`` in handling order
    (module doc)."""

    __slots__ = ("q", "stores", "retrieves", "jumped")

    def __init__(self):
        self.q: deque[tuple] = deque()  # (kind, request...)
        self.stores = 0
        self.retrieves = 0
        self.jumped = False  # the last request taken was a RETRIEVE taken ahead of a STORE

    def __len__(self) -> int:
        return len(self.q)

    def put(self, frame, *request) -> None:
        """A request as read: its ``frame`` and whatever the loop needs to handle it."""
        k = kind(frame)
        if k == STORE:
            self.stores += 1
        elif k == RETRIEVE:
            self.retrieves += 1
        self.q.append((k, frame, *request))

    def take(self) -> tuple:
        """The next request to handle: ``(frame, *request)`` as put."""
        q = self.q
        if self.retrieves and q[0][0] == STORE and not self.jumped:
            for i, item in enumerate(q):
                k = item[0]
                if k == RETRIEVE:
                    del q[i]
                    self.retrieves -= 1
                    self.jumped = True
                    return item[1:]
                if k != STORE:
                    break
        self.jumped = False
        item = q.popleft()
        if item[0] == STORE:
            self.stores -= 1
        elif item[0] == RETRIEVE:
            self.retrieves -= 1
        return item[1:]

    def may_reorder(self) -> bool:
        """Whether a RETRIEVE read now could go before a request waiting here (a STORE waits)."""
        return self.stores > 0
