"""The /metrics series an operator's dashboard and alerts read, against a real daemon: each tenant's
objects, bytes and ranks; every error code from 0; the HTTP server's own counts; and how long
since the main loop beat, which a scrape still answers while that loop is stuck (a blocked log
pipe, as tests/daemon/test_healthz_main_loop.py makes it), past 5 s."""

from __future__ import annotations

import re
import subprocess
import threading
import time
import urllib.request

from conftest import ROOT, free_port
from kv import FakeRank, GroupGeom, keys
from operate import series
from test_healthz_main_loop import SENT, LogPipe, healthz
from util import chunk
from wire import Raw, wait_for

from tierd.daemon.status import ASK_TIMEOUT_S, STALL_S
from tierd.protocol.errors import ErrorCode
from tierd.tools.testing import serve_argv

GEOM = GroupGeom("full", layers=2, block_bytes=512, block_tokens=4)
SPECS = [{"kind": "full", "block_tokens": 4, "window_tokens": 0}]


def test_each_tenants_objects_bytes_and_ranks_and_every_error_code_are_series(daemon_factory, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(
        "alice alice-token-0123456789\nbob bob-token-0123456789ab\nadmin admin-token-0123456789\n"
    )
    tokens.chmod(0o600)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    d = daemon_factory("--socket", endpoint, "--tcp-token-file", str(tokens))
    text = d.metrics()
    codes = series(text, "tierd_errors_by_code_total")
    assert {re.search(r'code="(\w+)"', k).group(1) for k in codes} == {c.name for c in ErrorCode}
    assert set(codes.values()) == {0.0}
    assert series(text, "tierd_tenant_objects") == {}  # no tenant holds anything yet
    for name in ("tierd_http_thread_restarts_total", "tierd_http_failures_total", "tierd_http_refused_total"):
        assert series(text, name) == {"": 0.0}, name
    assert 0 <= series(text, "tierd_main_loop_heartbeat_age_seconds")[""] < 1

    ranks, conns = [], []
    try:
        for token, n in (("alice-token-0123456789", 3), ("bob-token-0123456789ab", 1)):
            raw = Raw(endpoint)
            conns.append(raw)
            assert raw.call("HELLO", {"protocol": 1, "token": token})[0]
            rank = FakeRank([GEOM], fingerprint="fp")
            ranks.append(rank)
            raw.ok("REGISTER", {"instance": "r0", "layout": rank.layout()})
            body = {
                "instance": "r0",
                "chunks": [chunk(k, range(4 * i, 4 * i + 4)) for i, k in enumerate(keys(n))],
            }
            assert raw.ok("STORE", body)["results"] == ["stored"] * n
        bad = raw.call("RELEASE", {"lease": 12345})
        assert not bad[0] and bad[1]["code"] == "UNKNOWN_LEASE"
        text = d.metrics()
    finally:
        for raw in conns:
            raw.close()
        for rank in ranks:
            rank.close()
    objects, held = series(text, "tierd_tenant_objects"), series(text, "tierd_tenant_bytes")
    assert objects == {'{tenant="tcp:alice"}': 3.0, '{tenant="tcp:bob"}': 1.0}, objects
    assert held['{tenant="tcp:alice"}'] == 3 * held['{tenant="tcp:bob"}'] > 0
    assert series(text, "tierd_tenant_instances") == {'{tenant="tcp:alice"}': 1.0, '{tenant="tcp:bob"}': 1.0}
    assert series(text, "tierd_errors_by_code_total")['{code="UNKNOWN_LEASE"}'] == 1


def test_a_scrape_while_the_main_loop_is_stuck_answers_with_the_heartbeats_age_past_five_seconds(tmp_path):
    port = free_port()
    endpoint = f"ipc://{tmp_path}/tierd.sock"
    proc = subprocess.Popen(
        serve_argv(endpoint=endpoint, http_port=port, pool_mb=64, log_level="debug"),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    logs = LogPipe(proc.stderr)
    r = None
    got: dict = {}

    def scrape():
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as resp:
            got["text"] = resp.read().decode()

    try:
        wait_for(lambda: healthz(port)[0] == 200, timeout=30)
        r = Raw(endpoint)
        r.hello()
        logs.hold()
        time.sleep(0.2)
        for _ in range(SENT):  # each error reply is logged at debug: the pipe fills, the loop blocks
            r.send(b"\x93\xa4NOPE\x00\x80")
        answered = 0
        while not r.quiet(0.3):  # the loop answers until its log write blocks
            r.recv(1)
            answered += 1
        assert answered < SENT, "the loop answered every request: it is not stuck"
        t = threading.Thread(target=scrape, daemon=True)
        t.start()
        # the scrape's status waits ASK_TIMEOUT_S for the loop, then the age is read; its reply then
        # waits for the log (the HTTP thread logs each request): read the log again after that
        time.sleep(ASK_TIMEOUT_S + 0.5)
        logs.release()
        t.join(30)
        age = series(got["text"], "tierd_main_loop_heartbeat_age_seconds")[""]
        assert age > max(STALL_S, ASK_TIMEOUT_S), age  # what TierdMainLoopStalled fires on
        wait_for(lambda: healthz(port) == (200, b"ok\n"), timeout=5, interval=0.1)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert series(text, "tierd_main_loop_heartbeat_age_seconds")[""] < 1  # beating again
    finally:
        logs.release()
        if r is not None:
            r.close()
        proc.terminate()
        proc.wait(15)
