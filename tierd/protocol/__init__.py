"""Wire protocol: msgpack frames over ZeroMQ ROUTER/DEALER (docs/protocol.md)."""

PROTOCOL_VERSION = 1
