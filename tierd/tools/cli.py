"""``tierd serve | status | bench``."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import MISSING, fields

import click

from tierd import __version__
from tierd.base.config import Settings, default_socket
from tierd.daemon.server import Daemon
from tierd.edge.endpoint import EndpointError
from tierd.pool.pooldir import PoolDirError
from tierd.state.tenants import TokenFileError, load_tokens
from tierd.tools.bench import BenchError, BenchOptions, run_bench
from tierd.tools.bench.options import DEFAULTS as BENCH
from tierd.tools.replay import command as replay_command
from tierd.tools.report import bench_table, status_table
from tierd_client import TierdClient, TierdError

SOCKET_HELP = "ZeroMQ endpoint of the daemon (its --socket)."
STATUS_TIMEOUT_S = 5.0  # `tierd status`: how long a daemon whose socket exists has to answer
STARTING_S = 2.0  # ...and how long a missing socket file may take to appear (a daemon started in
# the same breath, as in the README, binds within about a second)


def _settings_options(fn):
    """One click option per Settings field; the field's help (with unit and default) is the help."""
    for f in reversed(fields(Settings)):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else None
        shown = default_socket() if f.name == "socket" else default
        help_text = f"{f.metadata['help']} [default: {shown}]"
        if f.type in (bool, "bool"):
            fn = click.option(f"{flag}/--no-{flag[2:]}", f.name, default=default, help=help_text)(fn)
            continue
        kind = {"int": int, "float": float, "str": str}.get(str(f.type), str)
        choices = f.metadata.get("choices")
        ptype = click.Choice(choices) if choices else kind
        fn = click.option(flag, f.name, type=ptype, default=default, help=help_text, show_default=False)(fn)
    return fn


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, "-V", "--version", prog_name="tierd")
def main():
    """tierd: a node-local KV-cache tier for LLM serving."""


main.add_command(replay_command)  # tierd replay TRACE: size a pool on a request trace (tierd.tools.replay)


@main.command()
@_settings_options
def serve(**kwargs):
    """Run the daemon in the foreground (systemd: see deploy/tierd.service)."""
    try:
        settings = Settings(**kwargs)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    _check_ceiling(settings)
    if settings.tcp_token_file:
        try:
            load_tokens(settings.tcp_token_file)
        except TokenFileError as exc:
            raise click.UsageError(str(exc)) from None
    _check_l2(settings)
    try:
        daemon = Daemon(settings)
    except PoolDirError as exc:
        index = f" --pool-index-dir {settings.pool_index_dir}" if settings.pool_index_dir else ""
        raise click.UsageError(f"{exc} [--pool-dir {settings.pool_dir}{index}]") from None
    except EndpointError as exc:  # it names the socket and what to do (not: pass the busy socket)
        raise click.UsageError(str(exc)) from None
    except (RuntimeError, OSError) as exc:
        raise click.ClickException(f"cannot start: {exc}") from None
    daemon.install_signals()
    try:
        daemon.start_http()
    except OSError as exc:
        daemon.close()  # nothing served yet: the socket file goes too
        raise click.UsageError(
            f"--http-port {settings.http_port} on {settings.http_host}: {exc.strerror or exc} "
            "(another process listens there? pick another port, 0 for any, or -1 for none)"
        ) from None
    if daemon.http_port is not None:
        click.echo(
            f"tierd: serving {settings.socket}, HTTP on http://{settings.http_host}:{daemon.http_port}",
            err=True,
        )
    daemon.run()


def _check_l2(settings: Settings) -> None:
    """--l2-url needs Mooncake's client: without it, say what to install (a usage error, before
    anything starts)."""
    if settings.l2_url is None:
        return
    from tierd.tier2.client import L2Unavailable, load_store_class

    try:
        load_store_class()
    except L2Unavailable as exc:
        raise click.UsageError(str(exc)) from None


def _check_ceiling(settings: Settings) -> None:
    """A ceiling beyond the host's memory is a typo or a plan to swap: say both figures."""
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return
    if settings.ceiling_bytes > host:
        raise click.UsageError(
            f"--l1-size-gb {settings.l1_size_gb:g} GiB is more than this host's memory "
            f"({host / 2**30:.1f} GiB)"
        )


@main.command()
@click.option("--socket", default=None, help=f"{SOCKET_HELP} [default: {default_socket()}]")
@click.option(
    "--url",
    default=None,
    help="Read /status over HTTP from this base URL instead (e.g. http://127.0.0.1:9800).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the raw status object.")
def status(socket, url, as_json):
    """Show a running daemon's status as a table."""
    data = _status_http(url) if url else _status_socket(socket or default_socket())
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    click.echo(status_table(data))


def _status_http(url: str) -> dict:
    base = url.rstrip("/")
    try:
        with urllib.request.urlopen(f"{base}/status", timeout=5) as resp:
            return json.load(resp)
    except (urllib.error.URLError, OSError) as exc:
        raise click.ClickException(f"no tierd answers at {base}/status: {exc}") from None


def _status_socket(socket: str) -> dict:
    serve = "`tierd serve`" if socket == default_socket() else f"`tierd serve --socket {socket}`"
    file = socket.startswith("ipc://") and not socket.startswith("ipc://@")  # not an abstract name
    path = socket[len("ipc://") :] if file else None
    if path is not None and not _appears(path, STARTING_S):
        raise click.ClickException(
            f"no tierd at {socket}: {path} does not exist. Start one with {serve}, or give "
            "--socket the socket of the one that runs"
        )
    client = TierdClient(socket, timeout_s=STATUS_TIMEOUT_S, name="tierd-status")
    try:
        return client.status()
    except TierdError as exc:
        raise click.ClickException(
            f"no tierd answers at {socket}: {exc} (a daemon that died leaves its socket file; start one "
            f"with {serve})"
        ) from None
    finally:
        client.close()


def _appears(path: str, wait_s: float) -> bool:
    """Whether ``path`` exists, or comes to within ``wait_s`` (a daemon started just before)."""
    deadline = time.monotonic() + wait_s
    while not os.path.exists(path):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


@main.command()
@click.option("--socket", default=BENCH.socket, help=f"{SOCKET_HELP} Without it a private daemon is started.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=BENCH.device, show_default=True)
@click.option("--layers", default=BENCH.layers, show_default=True, help="Layers of the synthetic layout.")
@click.option("--kv-heads", default=BENCH.kv_heads, show_default=True, help="KV heads per layer.")
@click.option("--head-dim", default=BENCH.head_dim, show_default=True, help="Head size (K and V each).")
@click.option(
    "--block-tokens", default=BENCH.block_tokens, show_default=True, help="Tokens per engine block."
)
@click.option(
    "--chunk-tokens", default=BENCH.chunk_tokens, show_default=True, help="Tokens per stored chunk."
)
@click.option(
    "--dtype-bytes", default=BENCH.dtype_bytes, show_default=True, help="Bytes per element (2 = bf16)."
)
@click.option(
    "--mla",
    is_flag=True,
    default=BENCH.mla,
    help="MLA layout: [blocks, block_tokens, 576], one latent per token.",
)
@click.option(
    "--chunks", default=BENCH.chunks, show_default=True, help="Chunks stored and retrieved per round."
)
@click.option(
    "--batch",
    default=BENCH.batch,
    show_default=True,
    help="Chunks per STORE/RETRIEVE request (CUDA --path direct: at most 64 MiB of them, at least one).",
)
@click.option(
    "--rounds",
    default=BENCH.rounds,
    show_default=True,
    help="Timed rounds (CPU: the best after the first is reported, the first apart).",
)
@click.option(
    "--runs",
    default=BENCH.runs,
    show_default=True,
    type=click.IntRange(min=1),
    help="CPU: each block's bytes in this many runs, each run of a layer's blocks a region of its own "
    "(2: K and V halves apart, vLLM's CPU layout): a chunk is that many contiguous ranges per layer.",
)
@click.option(
    "--pool-gb",
    default=BENCH.pool_gb,
    type=float,
    help="Pool ceiling of the private daemon. [default: sized to fit]",
)
@click.option(
    "--interference",
    is_flag=True,
    default=BENCH.interference,
    help="CUDA: time a bf16 matmul and an HBM-bound copy alone, while tierd copies, and while raw DMA runs.",
)
@click.option(
    "--staging-mb",
    default=BENCH.staging_mb,
    show_default=True,
    help="CUDA: the engine's staging buffer, MiB.",
)
@click.option(
    "--impl",
    type=click.Choice(["auto", "kernel", "torch"]),
    default=BENCH.impl,
    show_default=True,
    help="CUDA: engine-side gather/scatter: native kernels, the torch fallback, or kernels once built.",
)
@click.option(
    "--ctas",
    default=BENCH.ctas,
    show_default=True,
    type=click.IntRange(min=0),
    help="CUDA: CTAs per engine-side gather/scatter kernel (0: 8 per multiprocessor).",
)
@click.option(
    "--gpu-order",
    type=click.Choice(["host", "device"]),
    default=BENCH.gpu_order,
    show_default=True,
    help="CUDA: the engine sends each request once its staging bytes are ready (host), or the daemon's "
    "DMAs wait on the GPU for the engine's interprocess events (device; slows a co-running engine more).",
)
@click.option(
    "--step-burst",
    default=BENCH.step_burst,
    show_default=True,
    type=click.IntRange(min=0),
    help="CUDA --interference: queue the timed engine steps this many at a time (0: all at once). A full "
    "launch queue holds the GIL inside a launch and can starve the copies' threads in the bench process.",
)
@click.option(
    "--kv-layout",
    default=BENCH.kv_layout,
    show_default=True,
    help="CUDA: physical order of the KV buffer (vLLM 0.33's KVCacheLayout): LBNHC layer-outermost, "
    "BLNHC block-outermost (a block's layers one span), LBHNC, BLHNC, ...",
)
@click.option(
    "--path",
    type=click.Choice(["staged", "direct"]),
    default=BENCH.path,
    show_default=True,
    help="CUDA: gather/scatter in this process through a staging buffer (staged), or the daemon's "
    "DMAs straight between the KV blocks and its pool, no SM work (direct).",
)
@click.option(
    "--ranks",
    default=BENCH.ranks,
    show_default=True,
    type=click.IntRange(min=1),
    help="Engine processes (TP ranks) on one daemon at once, each its own KV buffer (CUDA: GPU rank % "
    "GPUs); timed in shared windows next to raw copies run the same way.",
)
@click.option(
    "--seconds",
    default=BENCH.seconds,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="With --ranks > 1: the length of each timed window.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object of figures.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def bench(as_json, quiet, **opts):
    """Store and retrieve a synthetic multi-layer KV layout through the real protocol, verify
    every byte, and print GB/s next to a same-run memcpy baseline."""
    try:
        result = run_bench(BenchOptions(**opts), progress=not quiet and not as_json)
    except BenchError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(result))
    else:
        click.echo(bench_table(result))
    if not result["verified"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
