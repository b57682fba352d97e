"""benchmarks/serve.py prints no figure for a run that failed, and its ratios over --repeat rounds.

Regression: a faulted run whose client thread raised printed ``failed -1`` and a longest TTFT of
0 ms (which reads as an improvement) and exited 0; a phase whose requests failed printed its row.
Now any such run ends the benchmark with the error and exit status 1, before the table. vLLM is
not started: its API server and client are replaced by stand-ins that return what they would."""

from __future__ import annotations

import sys
import types

import pytest
from bench_scripts import load_benchmark


@pytest.fixture
def serve(monkeypatch):
    mod = load_benchmark("serve", monkeypatch)
    monkeypatch.setattr(mod, "ApiServer", FakeServer)
    monkeypatch.setattr(mod, "tokenizer", lambda model: None)  # the prefix workload asks none
    return mod


class FakeServer:
    url = "http://127.0.0.1:1"
    start_s = 0.0

    def __init__(self, *a, **kw):
        pass

    def reset_prefix_cache(self):
        pass

    def metrics(self):
        return {}

    def prefill_ms(self, model, tokens):
        return 123.0

    def close(self):
        return 0


def result(ttft_ms: float, tok_s: float, failed: int = 0, n: int = 4) -> dict:
    """What ``vllm bench serve`` saves, the fields serve.py reads."""
    return {
        "completed": n - failed,
        "failed": failed,
        "errors": ["" for _ in range(n - failed)] + ["Internal Server Error: the engine died"] * failed,
        "median_ttft_ms": ttft_ms,
        "p99_ttft_ms": ttft_ms,
        "median_tpot_ms": 10.0,
        "median_itl_ms": 10.0,
        "output_throughput": tok_s,
        "duration": 1.0,
        "ttfts": [ttft_ms / 1e3] * (n - failed),
        "generated_texts": ["x"] * (n - failed),
    }


def run_main(serve, monkeypatch, tmp_path, capsys, *argv) -> tuple[int, str, str]:
    monkeypatch.setattr(
        sys, "argv", ["serve.py", "--model", str(tmp_path), "--workdir", str(tmp_path / "w"), *argv]
    )
    with pytest.raises(SystemExit) as exit_:
        serve.main()
        raise SystemExit(0)
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


def test_a_phase_with_failed_requests_exits_non_zero_and_prints_no_table(
    serve, monkeypatch, tmp_path, capsys
):
    calls = []

    def bench_serve(server, model, workload, workdir, *, concurrency, seed):
        calls.append(seed)
        return result(100.0, 50.0, failed=1 if len(calls) == 2 else 0)

    monkeypatch.setattr(serve, "bench_serve", bench_serve)
    code, out, err = run_main(
        serve,
        monkeypatch,
        tmp_path,
        capsys,
        "--phases",
        "none",
        "--workloads",
        "prefix",
        "--concurrency",
        "1,4",
    )
    assert code == 1, (out, err)
    assert "| workload |" not in out, out
    assert "phase none, prefix at concurrency 4: 1 request(s) failed, 3 completed" in err, err
    assert "the engine died" in err, err


def test_a_faulted_run_whose_client_thread_failed_is_an_error_not_a_figure(
    serve, monkeypatch, tmp_path, capsys
):
    from tierd.tools import testing

    class FakeDaemon:
        endpoint = "ipc:///nowhere"

        def __init__(self, *a, **kw):
            pass

        def status(self):
            return {"sessions": 0, "leases_active": 0, "objects": 0, "errors": 0}

        def restart(self):
            pass

        def kill(self):
            pass

    def bench_serve(server, model, workload, workdir, *, concurrency, seed):
        if seed == 9001:  # the faulted run: its client fails
            raise RuntimeError("vllm bench serve failed (rc=1)")
        return result(100.0, 50.0)

    monkeypatch.setattr(testing, "ServeProcess", FakeDaemon)  # what run_fault starts its daemon with
    monkeypatch.setattr(serve, "bench_serve", bench_serve)
    argv = ["--phases", "none", "--workloads", "prefix", "--concurrency", "4", "--faults", "kill"]
    code, out, err = run_main(serve, monkeypatch, tmp_path, capsys, *argv, "--fault-at-s", "0")
    assert code == 1, (out, err)
    assert "| workload |" not in out and "fault kill at" not in out, out
    assert "fault kill: the faulted run: RuntimeError: vllm bench serve failed (rc=1)" in err, err


def test_repeated_rounds_print_each_ratio_as_median_and_range_of_the_rounds(
    serve, monkeypatch, tmp_path, capsys
):
    # round r: none 1000 ms and 10 tok/s; warm (r+1)*100 ms and 20*(r+1) tok/s
    figures = iter(
        [(1000.0, 10.0), (500.0, 10.0), (100.0, 20.0)]
        + [(1000.0, 10.0), (500.0, 10.0), (200.0, 40.0)]
        + [(1000.0, 10.0), (500.0, 10.0), (300.0, 60.0)]
    )

    def bench_serve(server, model, workload, workdir, *, concurrency, seed):
        return result(*next(figures))

    monkeypatch.setattr(
        serve, "Tierd", lambda *a, **kw: types.SimpleNamespace(endpoint="ipc:///x", close=lambda: 0)
    )
    monkeypatch.setattr(serve, "bench_serve", bench_serve)
    scrapes = iter(range(1, 1000))  # vLLM's own prefix cache: half of each run's queried tokens hit

    def metrics(self):
        k = next(scrapes)
        return {"vllm:prefix_cache_queries_total": 100.0 * k, "vllm:prefix_cache_hits_total": 50.0 * k}

    monkeypatch.setattr(FakeServer, "metrics", metrics)
    argv = ["--phases", "none,cold,warm", "--workloads", "prefix", "--concurrency", "4", "--repeat", "3"]
    code, out, err = run_main(serve, monkeypatch, tmp_path, capsys, *argv)
    assert code == 0, (out, err)
    header = next(line for line in out.splitlines() if line.startswith("| workload |"))
    assert [c.strip() for c in header.split("|")][7:9] == ["ext. hits", "HBM hits"], header
    warm = next(line for line in out.splitlines() if line.startswith("| prefix | 4 | warm |"))
    cells = [c.strip() for c in warm.split("|")]
    assert cells[7:9] == ["0.00", "0.50"], warm  # what none would reuse in GPU memory is shown
    assert cells[10:12] == ["0.20 [0.10-0.30]", "4.00 [2.00-6.00]"], warm
    none = next(line for line in out.splitlines() if line.startswith("| prefix | 4 | none |"))
    assert [c.strip() for c in none.split("|")][10:12] == ["1.00 [1.00-1.00]", "1.00 [1.00-1.00]"], none
    # beside the table, the same run's prefill of one prompt alone (3,136 tokens: --prefix-len 3072
    # and --suffix-len 64 by default), from each round's `none` server
    assert "the same run's prefill: 3136 new tokens alone, max_tokens 1, 123.00 [123.00-123.00] ms" in out
