"""How the two ends wait for each other (docs/protocol.md section 2.1, "Waiting"): a caller reads
its lookup-channel reply spinning before it sleeps in poll(), and ``--busy-poll-us`` keeps the
daemon's main loop polling without sleeping for a while after each request."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from wire import wait_for

import tierd_client.transport as transport
from tierd.tools.testing import proc_stat, serve_argv
from tierd_client import TierdClient


def channel_polls(monkeypatch, client) -> list[int]:
    """The timeouts of the transport's zmq_poll calls on ``client``'s lookup channel, from now on."""
    polls: list[int] = []
    real = transport.zmq.zmq_poll

    def counting(items, timeout=-1):
        if any(sock is client.transport.channel.sock for sock, _ in items):
            polls.append(timeout)
        return real(items, timeout)

    monkeypatch.setattr(transport.zmq, "zmq_poll", counting)
    return polls


def attached(client):
    wait_for(
        lambda: client.transport.channel.sock is not None, 5, what="the client's channel to be acknowledged"
    )
    return client


def test_a_caller_reads_its_channel_reply_spinning_and_never_sleeps_for_it(
    daemon, client_factory, monkeypatch
):
    spinning = attached(client_factory(daemon, spin_s=2.0))
    polls = channel_polls(monkeypatch, spinning)
    for _ in range(100):
        assert spinning.ping().time > 0
    assert polls == []  # every reply came within the spin: no sleep in poll()


def test_a_caller_with_spin_s_zero_sleeps_in_poll_for_its_channel_reply(daemon, client_factory, monkeypatch):
    asleep = attached(client_factory(daemon, spin_s=0))
    polls = channel_polls(monkeypatch, asleep)
    for _ in range(100):
        assert asleep.ping().time > 0
    # a reply is there at the first read only when the daemon, woken on this CPU, ran first (about
    # half of them on a 2-core VM); every other PING sleeps for its reply
    assert polls and all(t > 0 for t in polls), polls


def test_a_negative_spin_is_refused_before_anything_starts():
    threads = {t.name for t in threading.enumerate()}
    with pytest.raises(ValueError, match="spin_s must be >= 0"):
        TierdClient("ipc:///nonexistent/tierd.sock", spin_s=-0.001, name="negative-spin")
    assert not {t.name for t in threading.enumerate()} - threads


def cpu_seconds(pid: int) -> float:
    fields = proc_stat(f"/proc/{pid}/stat")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def cpu_over_spaced_pings(d, client_factory) -> float:
    """The daemon's CPU seconds over 20 PINGs 30 ms apart (on ZeroMQ and on the channel)."""
    c = attached(client_factory(d))
    c.ping()
    pid = c.server.pid
    t0 = cpu_seconds(pid)
    for _ in range(20):
        c.ping()
        time.sleep(0.03)
    return cpu_seconds(pid) - t0


def test_busy_poll_keeps_the_daemon_polling_after_each_request_and_sleeping_without_it(
    daemon_factory, client_factory
):
    busy = cpu_over_spaced_pings(daemon_factory("--busy-poll-us", "10000"), client_factory)
    idle = cpu_over_spaced_pings(daemon_factory(), client_factory)
    # busy: up to 10 ms of polling after each of the 20 PINGs (and the heartbeats), ~0.2 s
    assert busy >= 0.08, (busy, idle)
    assert idle < 0.05, (busy, idle)


@pytest.mark.parametrize("value", ["-1", "10001"])
def test_busy_poll_out_of_range_is_refused_at_start(value, tmp_path):
    run = subprocess.run(
        serve_argv("--busy-poll-us", value, endpoint=f"ipc://{tmp_path}/s"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode != 0 and "busy-poll-us" in run.stderr, run.stderr[-2000:]
