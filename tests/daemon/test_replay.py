"""``tierd replay``: a trace through the daemon's own pool, with numbers worked out by hand for tiny
traces, its stable JSON form, both trace formats, capacities in tokens and bytes, and clear errors
for bad input."""

import json
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from tierd.tools import replay
from tierd.tools.cli import main

# Worked by hand, 4-block pool, tail-first LRU (most recent first after each request):
#   [1,2,3]    miss, store 1 2 3          -> 1 2 3
#   [1,2,3,4]  hit 3, store 4             -> 1 2 3 4
#   [5]        miss, store 5 evicts 4     -> 5 1 2 3     (the prefix's tail goes, not its head)
#   [1,2,6]    hit 2, store 6 evicts 3    -> 1 2 6 5
#   [1,2,3,4]  hit 2 (3 is gone)
# hits 0 + 3 + 0 + 2 + 2 = 7 of 15 blocks; an infinite pool hits 0 + 3 + 0 + 2 + 4 = 9.
TINY = [[1, 2, 3], [1, 2, 3, 4], [5], [1, 2, 6], [1, 2, 3, 4]]


def write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def mooncake(ids) -> dict:
    return {"timestamp": 0, "input_length": 512 * len(ids), "output_length": 1, "hash_ids": ids}


def invoke(*args):
    result = CliRunner().invoke(main, ["replay", *args])
    return result


def test_json_gives_the_hand_worked_numbers(tmp_path):
    trace = write(tmp_path / "t.jsonl", [mooncake(r) for r in TINY])
    r = invoke(trace, "--capacity-blocks", "4,100", "--policy", "lru,default", "--json", "--quiet")
    assert r.exit_code == 0, r.output
    # the reuse policy has measured no reuse distance on 5 requests: it evicts as LRU does
    assert json.loads(r.stdout) == {
        "requests": 5,
        "blocks": 15,
        "infinite_hit_ratio": 9 / 15,
        "runs": [
            {"policy": "lru", "capacity_blocks": 4, "hit_ratio": 7 / 15, "share_of_infinite": 7 / 9},
            {"policy": "default", "capacity_blocks": 4, "hit_ratio": 7 / 15, "share_of_infinite": 7 / 9},
            {"policy": "lru", "capacity_blocks": 100, "hit_ratio": 9 / 15, "share_of_infinite": 1.0},
            {"policy": "default", "capacity_blocks": 100, "hit_ratio": 9 / 15, "share_of_infinite": 1.0},
        ],
    }


def test_the_console_script_prints_one_json_object_and_progress_on_stderr(tmp_path):
    trace = write(tmp_path / "t.jsonl", [mooncake(r) for r in TINY])
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tierd",
            "replay",
            trace,
            "--capacity-blocks",
            "4",
            "--policy",
            "reuse",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["runs"] == [
        {"policy": "reuse", "capacity_blocks": 4, "hit_ratio": 7 / 15, "share_of_infinite": 7 / 9}
    ]
    assert "replay 1/1: reuse at 4 blocks: hit ratio 0.467 (0.778 of infinite)" in out.stderr


def test_the_table_names_capacities_bytes_and_the_default_policy(tmp_path):
    trace = write(tmp_path / "t.jsonl", [mooncake(r) for r in TINY])
    r = invoke(trace, "--capacity-blocks", "4", "--bytes-per-token", "2", "--quiet")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].endswith(
        "5 requests, 15 blocks of 512 tokens (6 distinct); an infinite pool hits 0.600 of them"
    )
    assert lines[1] == "bytes at 2 bytes a token (1.0 KiB a block)"
    lru, reuse = lines[4].split(), lines[5].split()
    # policy, capacity, pool bytes, hit ratio, share, stored, evicted, req/s: stored 3+1+1+1 and
    # the last request's 3 and 4 (8 blocks), evicted 4, 3, then 5 and 6 for 3 and 4 (4 blocks)
    assert lru[:11] == ["lru", "4", "blocks", "4.0", "KiB", "0.467", "0.78", "8.0", "KiB", "4.0", "KiB"]
    assert reuse[0] == "reuse*" and lines[-1] == "* the default policy"


def test_an_operators_key_log_replays_per_namespace(tmp_path):
    rows = [
        {"keys": ["aa", "bb"], "namespace": "m1"},
        {"keys": ["aa", "bb", "cc"], "namespace": "m1"},
        {"keys": ["aa", "bb"], "namespace": "m2"},  # another model: the same keys are other chunks
        {"keys": ["aa"]},
    ]
    trace = write(tmp_path / "keys.jsonl", rows)
    r = invoke(trace, "--capacity-blocks", "2", "--policy", "lru", "--json", "--quiet")
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    # infinite: 0 + 2 + 0 + 0 = 2 of 8. At 2 blocks: [aa bb] stored; [aa bb cc] hits 2 and
    # storing cc evicts bb (the tail); m2 misses and evicts; the empty namespace misses.
    assert got["infinite_hit_ratio"] == 2 / 8
    assert got["runs"] == [
        {"policy": "lru", "capacity_blocks": 2, "hit_ratio": 2 / 8, "share_of_infinite": 1.0}
    ]
    trace = replay.read_trace(write(tmp_path / "k256.jsonl", [{"keys": ["x"], "chunk_tokens": 256}]))
    assert trace.block_tokens == 256


def test_capacities_in_tokens_and_bytes():
    assert replay.parse_capacities("1000,3000", "3M,500K,1000", 512, 131072) == [1000, 3000, 5860, 977, 2]
    assert replay.parse_capacities(None, "16GiB", 512, 131072) == [256]  # 64 MiB a block
    with pytest.raises(click.BadParameter, match="neither tokens"):
        replay.parse_capacities(None, "3 parsecs", 512, 1)
    with pytest.raises(click.BadParameter, match="whole number of blocks"):
        replay.parse_capacities("10,-2", None, 512, 1)


def test_without_capacities_it_replays_shares_of_the_distinct_blocks(tmp_path):
    trace = write(tmp_path / "t.jsonl", [mooncake(list(range(i, i + 100))) for i in range(0, 2000, 100)])
    r = invoke(trace, "--policy", "lru", "--json", "--quiet")
    assert r.exit_code == 0, r.output
    caps = [run["capacity_blocks"] for run in json.loads(r.stdout)["runs"]]
    assert caps == [10, 20, 40, 100, 200, 400]  # 0.5% .. 20% of 2000 distinct blocks


@pytest.mark.parametrize(
    "lines, message",
    [
        ([json.dumps(mooncake([1])), "{not json"], "line 2: "),
        ([json.dumps(mooncake([1])), "", json.dumps({"hash_ids": [1, -3]})], "line 3: hash_ids must be"),
        ([json.dumps({"prompt": "hi"})], 'line 1: a request needs "hash_ids" (Mooncake) or "keys"'),
        ([json.dumps({"keys": ["a", 7]})], "line 1: keys must be a list of non-empty strings"),
        (["[1, 2]"], "line 1: expected a JSON object, got list"),
        ([], "no requests in the trace"),
    ],
)
def test_a_bad_trace_is_refused_naming_its_line(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    r = invoke(str(path), "--capacity-blocks", "2", "--quiet")
    assert r.exit_code == 1
    assert f"Error: {path}" in r.stderr and message in r.stderr


def test_a_missing_trace_or_policy_is_a_clear_error(tmp_path):
    r = invoke(str(tmp_path / "nope.jsonl"), "--capacity-blocks", "2")
    assert r.exit_code == 1 and "nope.jsonl: cannot read the trace: No such file or directory" in r.stderr
    trace = write(tmp_path / "t.jsonl", [mooncake([1])])
    r = invoke(trace, "--policy", "lru,arc")
    assert r.exit_code == 2 and "'arc': policies are reuse, lru and default" in r.stderr


def test_plot_without_matplotlib_says_so_and_still_prints(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    trace = write(tmp_path / "t.jsonl", [mooncake(r) for r in TINY])
    png = tmp_path / "p.png"
    r = invoke(trace, "--capacity-blocks", "4", "--json", "--quiet", "--plot", str(png))
    assert r.exit_code == 0 and json.loads(r.stdout)["requests"] == 5
    assert "--plot needs matplotlib (pip install 'tierd[plot]'): no plot drawn" in r.stderr
    assert not png.exists()


def test_plot_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    trace = write(tmp_path / "t.jsonl", [mooncake(r) for r in TINY])
    png = tmp_path / "p.png"
    r = invoke(trace, "--capacity-blocks", "2,4", "--quiet", "--plot", str(png))
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
