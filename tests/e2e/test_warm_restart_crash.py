"""Crash safety of the file-backed pool: a writer SIGKILLed at random points (while objects are
half written, evicted, replaced, during checkpoints and during its own recovery) leaves a folder
from which a restart serves only objects byte for byte as committed; and a kill after known
commits loses none of them."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pool_writer as pw
import pytest
from pool_dirs import shm_dir, small_slabs  # noqa: F401 - fixtures

pytestmark = pytest.mark.usefixtures("small_slabs")  # several size classes in a few MiB

WRITER = str(Path(__file__).resolve().parents[1] / "pool_writer.py")
TRIALS = int(os.environ.get("TIERD_CRASH_TRIALS", "36"))  # soak: more trials, other seeds
SEED = int(os.environ.get("TIERD_CRASH_SEED", "1234"))


def spawn(*args: str) -> subprocess.Popen:
    path = os.pathsep.join([str(Path(WRITER).parent), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    return subprocess.Popen(
        [sys.executable, WRITER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def kill(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGKILL, err  # it was still running: no exception ended it early
    return err


def test_sigkill_at_random_points_never_serves_a_wrong_byte(shm_dir):
    rnd = random.Random(SEED)
    served = warm = torn = 0
    indexed = False  # a writer has finished its first start: from then on every start is warm
    for trial in range(TRIALS):
        proc = spawn("random", shm_dir, str(SEED * 1000 + trial + 1))
        assert proc.stdout.readline().strip() == "opening"
        if trial % 5 == 4:
            time.sleep(rnd.uniform(0, 0.004))  # inside the child's recovery
        else:
            line = proc.stdout.readline()
            assert line.startswith("ready"), proc.stderr.read()
            indexed = True
            time.sleep(rnd.uniform(0.02, 0.5))
        kill(proc)
        pool = pw.open_pool(shm_dir)
        try:
            report = pool.warm_restart
            assert report["warm"] or not indexed, report["reason"]
            n, wrong = pw.check(pool)
            assert wrong == [], f"trial {trial}: {wrong[:5]}"
            served, warm, torn = served + n, warm + report["warm"], torn + (report["torn_bytes"] > 0)
        finally:
            pool.close()
    print(f"\n{TRIALS} kills: {warm} warm starts, {torn} torn tails, {served} objects served, 0 wrong")
    assert served > 20 * TRIALS  # the checker saw real content, not an empty pool


def test_a_kill_loses_no_durable_commit_and_serves_no_write_in_flight(shm_dir):
    proc = spawn("script", shm_dir)
    line = proc.stdout.readline()
    assert line, proc.stderr.read()
    expect = json.loads(line)
    kill(proc)
    assert expect["in_flight"] == 4 and len(expect["live"]) > 20
    pool = pw.open_pool(shm_dir)
    try:
        assert pool.warm_restart["warm"] and pool.warm_restart["journal_records"] > 0
        n, wrong = pw.check(pool)
        assert wrong == [] and n == len(expect["live"])
        ns = pw.NAMESPACES[0]
        for k, v in expect["live"]:
            obj = pool.find_ready(ns, k.encode(), next(iter(pw.span_of(ns, k.encode()))), 0)
            assert obj is not None and obj.label == f"v{v}"
        assert all(
            pool.find_ready(pw.NAMESPACES[1], pw.key(i), g, 1) is None
            for i in range(pw.KEYS, pw.KEYS + 4)
            for g in range(3)
        )
        for lru in pool.lru.values():  # no touches after the commits: recency is commit order
            versions = [int(o.label[1:]) for o in lru]
            assert versions == sorted(versions)
    finally:
        pool.close()
