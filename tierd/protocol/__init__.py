"""Wire protocol: msgpack frames over ZeroMQ ROUTER/DEALER (docs/protocol.md)."""

PROTOCOL_VERSION = 1

# Work one request may ask of the daemon's main loop (docs/protocol.md section 19); clients split
# (STORE, RETRIEVE) or shorten (LOOKUP: a prefix of the keys) what would exceed them.
MAX_REQUEST_PARTS = 1024  # chunks x groups of one STORE or RETRIEVE (a few microseconds each)
MAX_LOOKUP_PARTS = 1 << 15  # keys x groups x ranks one LOOKUP folds over (benchmarks/lookup_latency.py)
# Block ids one STORE or RETRIEVE carries, as clients split them: frames stay well under the
# daemon's --max-frame-mb (a block id is at most 9 bytes of msgpack).
MAX_REQUEST_IDS = 1 << 20
