"""benchmarks/serve.py's trace workload: a window of a production trace in Mooncake's format,
sent through vLLM's own ``timed_trace`` dataset. Which requests share which prefix blocks must
be the trace's, and every client process must send the same prompts for the same window, or a
warm server finds nothing of what the cold one stored."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_scripts import load_benchmark
from conftest_vllm import tiny_model  # noqa: F401 - fixture


@pytest.fixture
def serve(monkeypatch):
    mod = load_benchmark("serve", monkeypatch)
    return mod


def write_trace(path: Path, rows: list[dict | str]) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


TRACE = [
    {"timestamp": 0, "input_length": 1000, "output_length": 500, "hash_ids": [0, 1]},
    "",  # blank lines are no request
    {"timestamp": 5, "input_length": 3000, "output_length": 3, "hash_ids": [0, 2, 3, 4, 5, 6]},
    {"timestamp": 9, "input_length": 10, "output_length": 0, "hash_ids": [7]},
]


def test_a_trace_window_keeps_each_requests_blocks_scaled_and_cut_to_fit(serve, tmp_path):
    path = write_trace(tmp_path / "t.jsonl", TRACE)
    # 32 tokens a block: prompts scale by 32/512; outputs capped at 8; prompt + output within 128
    rows = serve.trace_window(path, 0, 3, 32, 128, 8)
    assert rows == [
        {"timestamp": 0, "input_length": 62, "output_length": 8, "hash_ids": [0, 1]},
        # 188 tokens scaled; cut to 128 - 3: the first 4 of its 6 blocks (the last one partial)
        {"timestamp": 5, "input_length": 125, "output_length": 3, "hash_ids": [0, 2, 3, 4]},
        {"timestamp": 9, "input_length": 1, "output_length": 1, "hash_ids": [7]},
    ]
    # a window further on starts at the trace's second request (blank lines not counted)
    assert serve.trace_window(path, 1, 1, 32, 128, 8) == rows[1:2]
    # at the trace's own 512 tokens a block nothing is scaled, only capped
    assert serve.trace_window(path, 0, 1, 512, 16384, 600)[0] == TRACE[0]


def test_a_trace_that_cannot_be_sent_is_refused_naming_the_file_and_line(serve, tmp_path):
    from tierd.tools.trace import TraceError

    with pytest.raises(TraceError, match="cannot read the trace"):
        serve.trace_window(str(tmp_path / "missing.jsonl"), 0, 1, 32, 128, 8)
    bad = write_trace(tmp_path / "bad.jsonl", [TRACE[0], {"input_length": 5, "output_length": 1}])
    with pytest.raises(TraceError, match=r"bad.jsonl:2: not a trace request"):
        serve.trace_window(bad, 0, 2, 32, 128, 8)
    short = write_trace(tmp_path / "short.jsonl", TRACE)
    with pytest.raises(TraceError, match="3 requests, fewer than the 4 asked"):
        serve.trace_window(short, 2, 2, 32, 128, 8)
    with pytest.raises(TraceError, match="leave no prompt"):
        serve.trace_window(short, 0, 1, 32, 8, 8)


SAMPLE = """
import json, sys
from transformers import AutoTokenizer
from vllm.benchmarks.datasets.datasets import TimedTrace

tok = AutoTokenizer.from_pretrained(sys.argv[1])
labels = {f"timed_trace_label_{k}": v for k, v in (
    ("timestamp", "timestamp"), ("input_length", "input_length"), ("output_length", "output_length"),
    ("hash_ids", "hash_ids"))}  # the client's defaults
ds = TimedTrace(dataset_path=sys.argv[2], random_seed=0, timed_trace_chunk_hash_size=32, **labels)
print(json.dumps([s.prompt for s in ds.sample(tokenizer=tok, num_requests=3)]))
"""


def test_every_client_process_sends_the_same_prompts_for_a_trace_window(serve, tmp_path, tiny_model):
    """vLLM's timed-trace dataset seeds each block's tokens from Python's hash() of a string: the
    client's environment (tests/serving.py CLIENT_ENV) fixes it. Control: a process with another
    hash seed sends other prompts for the same window."""
    pytest.importorskip("vllm")
    path = write_trace(tmp_path / "t.jsonl", TRACE)
    rows = serve.trace_window(path, 0, 3, 32, 128, 8)
    window = tmp_path / "window.jsonl"
    window.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from serving import CLIENT_ENV

    def start(env: dict) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-c", SAMPLE, tiny_model, str(window)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "VLLM_TARGET_DEVICE": "cpu", **env},
        )

    procs = [start(CLIENT_ENV), start(CLIENT_ENV), start({"PYTHONHASHSEED": "1"})]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    first, again, other = outs
    assert [len(p) for p in first] == [r["input_length"] for r in rows]
    assert first[0][:32] == first[1][:32]  # block 0 of the trace, shared by both prompts
    assert first[0][32:62] != first[1][32:62]  # their second blocks differ (ids 1 and 2)
    assert again == first
    assert other != first, "control: another hash seed should give other prompts"
