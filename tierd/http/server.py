"""Operator endpoints: GET /status (JSON), /metrics (Prometheus text), /healthz."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

log = logging.getLogger("tierd.http")


def start_http_server(board, metrics, host: str, port: int) -> ThreadingHTTPServer:
    """Serve ``board`` (a tierd.status.StatusBoard) and the Prometheus registry ``metrics``."""
    class Handler(BaseHTTPRequestHandler):
        server_version = "tierd"

        def do_GET(self):  # noqa: N802 - http.server's naming
            path = self.path.split("?", 1)[0]
            try:
                if path == "/status":
                    self._send(200, "application/json", json.dumps(board.ask(), indent=1).encode())
                elif path == "/metrics":
                    self._send(200, CONTENT_TYPE_LATEST, generate_latest(metrics))
                elif path == "/healthz":
                    if board.stopping:
                        self._send(503, "text/plain", b"stopping\n")
                    else:
                        self._send(200, "text/plain", b"ok\n")
                else:
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

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="tierd-http", daemon=True).start()
    log.info("HTTP on http://%s:%d (/status /metrics /healthz)", host, server.server_address[1])
    return server
