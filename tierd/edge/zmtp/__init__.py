"""The daemon's ZeroMQ endpoint, served by the daemon itself: a ROUTER speaking ZMTP 3.1
(ZeroMQ's wire protocol, https://rfc.zeromq.org/spec/37/) with the NULL mechanism over a Unix
(``ipc://``) or TCP stream. Clients connect a plain libzmq DEALER and see a libzmq ROUTER.

Why not libzmq's own ROUTER: libzmq delivers a message whole and bounds each part
(``MAXMSGSIZE``), never their sum, so a client could make the daemon hold any number of parts
of up to the cap each before the daemon could read the first. Here the daemon reads the bytes
itself. A message's first frame is held (at most the message cap, backed only as its bytes
arrive); every later part is counted and let go as it streams in: a message of any number of
parts costs at most one cap. The daemon also knows, with no monitor socket and no ordering
hazard, which connection each message came on, when each connection ended, and each
connection's kernel credentials (SO_PEERCRED, read once at accept).

What a connection goes through: our greeting is sent at accept; the peer's (64 bytes,
signature, version 3, mechanism NULL) must arrive within HANDSHAKE_S, then its READY command
naming a socket type a ROUTER talks to (DEALER, REQ, ROUTER) and optionally its routing
identity; ours follows. Anything else closes the connection. After that, data frames make
messages; PING commands are answered PONG (ZMTP 3.1 heartbeats), other commands are ignored.
A frame larger than the message cap closes the connection before any of it is read (as
libzmq's ``MAXMSGSIZE`` did).

Routing: a message comes with its connection's routing identity (the peer's own if it named
one, else five bytes made here, the first zero, as libzmq makes them; a peer may name any
identity, a leading zero byte too, as libzmq lets it). A new connection naming
an identity in use takes it over (libzmq's ``ROUTER_HANDOVER``); the old connection stays open
until its peer closes it, orphaned as libzmq leaves it: what it sends is read and let go, and
its end drops no session (closing it would make a live peer reconnect and take the identity
back).
Replies are written without waiting: what the kernel does not take at once is queued, up to
SEND_QUEUE messages (libzmq's default high-water mark) or SEND_QUEUE_BYTES per connection; past
that, or to an identity with no connection, a reply is dropped and the client's deadline covers
it.

Caps: connections over ``max_total``, or over ``max_per_peer`` of one uid (all of tcp:// counts
as one peer), are closed at accept, as is any when no descriptor is left to accept with (the
backlog waits).
"""

from tierd.edge.zmtp.router import Router

__all__ = ["Router"]
