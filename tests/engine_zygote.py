"""Engine processes forked from a process that has already imported torch and vLLM.

Hazard first: a forked engine is a new process (its own pid, memory, vLLM engine, connector and
sockets: what a test of "a new engine process" needs), but it starts from this server's memory,
so nothing may run here before a fork but imports: no engine, no torch op (OpenMP's threads would
not survive the fork), no connection. The server's own threads only wait for children.

Why: importing torch and vLLM takes about 10 s of CPU on the 2-core test machine, a third to a
half of a short engine run, and the end-to-end tests start some twenty engines. A fork skips it.

    server:  python tests/engine_zygote.py SOCKET        (prints "ready" once imported)
    request: one JSON line {"argv": [script, ...], "env": {...}, "cwd": DIR, "log": FILE}
    replies: "<pid>\\n" once forked, then "<exit code>\\n" when the child ends (-N: killed by signal N)

``tests/engine_runs.py`` starts one server per test process on first use and falls back to a plain
``python script`` when the server cannot start.
"""

from __future__ import annotations

import json
import os
import runpy
import socket
import sys
import threading
import traceback


def _child(req: dict) -> None:
    """In the forked child: become the requested process, run its script, exit."""
    code = 1
    try:
        os.setpgid(0, 0)  # a group of its own, as a test's Popen child would be killed alone
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        sys.argv = list(req["argv"])
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
        runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported in the child's log, as python would
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _reap(pid: int, conn: socket.socket) -> None:
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    try:
        conn.sendall(f"{code}\n".encode())
    except OSError:  # the test is gone
        pass
    conn.close()


def serve(path: str) -> None:
    import torch  # noqa: F401
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401

    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(16)
    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        with conn.makefile("rb") as f:
            line = f.readline()
        if not line:
            conn.close()
            continue
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            srv.close()
            conn.close()
            _child(req)
        conn.sendall(f"{pid}\n".encode())
        threading.Thread(target=_reap, args=(pid, conn), daemon=True).start()


if __name__ == "__main__":
    serve(sys.argv[1])
