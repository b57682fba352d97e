"""Operator endpoints: GET /status (JSON), /metrics (Prometheus text), /healthz.

Hazard: /status waits for the main loop (``board.ask``), so it is answered on a worker thread of
the bounded server (tierd.edge.http.server), never on the accepting thread; /healthz, whose reply never
waits, is answered by that accepting thread from ``board.health`` and never reaches the handler
here. A request that fails while being answered gets a 500 with the error, never a hang. This
module says what each path answers; the server bounds the connections and threads.
"""

from __future__ import annotations

import io
import json
import logging
from http.server import BaseHTTPRequestHandler

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tierd.edge.http.server import BoundedHTTPServer

log = logging.getLogger("tierd.http")


def start_http_server(
    board, metrics, host: str, port: int, timeout_s: float = 5.0, max_connections: int = 64
) -> BoundedHTTPServer:
    """Serve ``board`` (a tierd.daemon.status.StatusBoard) and the Prometheus registry ``metrics``."""

    class Handler(BaseHTTPRequestHandler):
        server_version = "tierd"

        def setup(self):  # the request has been read already (BoundedHTTPServer)
            self.connection = self.request.sock
            self.rfile = io.BytesIO(bytes(self.request.head))
            self.wfile = self.connection.makefile("wb")

        def do_GET(self):  # noqa: N802 - http.server's naming
            path = self.path.split("?", 1)[0]
            try:
                if path == "/status":
                    self._send(200, "application/json", json.dumps(board.ask(), indent=1).encode())
                elif path == "/metrics":
                    self._send(200, CONTENT_TYPE_LATEST, generate_latest(metrics))
                else:  # (/healthz is answered by the accepting thread)
                    self._send(404, "text/plain", b"not found: try /status, /metrics or /healthz\n")
            except Exception as exc:  # noqa: BLE001 - answer, never hang the operator
                log.exception("HTTP %s failed", path)
                self._send(500, "text/plain", f"{type(exc).__name__}: {exc}\n".encode())

        def _send(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt, *args):
            log.debug("http: " + fmt, *args)

    server = BoundedHTTPServer(host, port, Handler, timeout_s, max_connections, health=board.health)
    server.start()
    log.info(
        "HTTP on http://%s:%d (/status /metrics /healthz; at most %d connections, %.3g s each to send "
        "its request)",
        host,
        server.server_address[1],
        max_connections,
        timeout_s,
    )
    return server
