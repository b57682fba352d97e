"""``tierd replay TRACE``: a request trace replayed through the daemon's own pool, to size a pool.

Each request LOOKUPs its keys (a hit is the longest prefix the pool holds), then every key of it
is stored (the ones missing) or touched, in the order a STORE commits and touches them. The pool
is tierd.pool.pool.Pool itself, with its index, size classes, eviction and policy, in process
and with a fake BLOCK_BYTES per block, so a replay makes the daemon's decisions and nothing else
(no separate simulator to drift from it). Per capacity and policy it reports the share of the
trace's blocks (prompt tokens) that hit, that share over what an infinite pool would hit, the
bytes stored and evicted at --bytes-per-token, and the replay's own requests per second.

Trace formats, one JSON object a line (README, "Size a pool", has an example of each):
- Mooncake's (FAST'25 traces): ``{"hash_ids": [int, ...], ...}``, 512-token blocks; every id
  counts as one whole block, the last one too (the trace does not say which is partial).
- an operator's own log: ``{"keys": ["<chunk key>", ...], "namespace": "<model>"}`` (namespace
  optional), one key per chunk of ``chunk_tokens`` tokens (a field of the line, default 256):
  what a connector can log per request, its chunk keys in prompt order, hex or any string.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from dataclasses import dataclass, field

import click

from tierd.pool import policy as policies
from tierd.pool.index import Span
from tierd.pool.policy import POLICIES
from tierd.pool.pool import EXISTS, Pool
from tierd.protocol.layout import GroupKind, GroupSpec
from tierd.tools.trace import Trace, TraceError, _count_infinite, read_trace  # noqa: F401 (tierd.tools.replay's API)

BLOCK_BYTES = 64  # what one block takes in the replay's pool (any size: one object a block)
LLAMA3_8B_BYTES_PER_TOKEN = 131072  # 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes (bf16)
DEFAULT_SHARES = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2)  # of the distinct blocks, without capacities
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
_TOKENS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
_BYTES = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


@dataclass
class Run:
    policy: str  # as asked for ("default" stays "default")
    resolved: str  # the policy's own name
    capacity_blocks: int
    hits: int = 0
    stored: int = 0
    evicted: int = 0
    rejected: int = 0
    seconds: float = 0.0
    state: dict = field(default_factory=dict)

    def hit_ratio(self, trace: Trace) -> float:
        return self.hits / trace.blocks if trace.blocks else 0.0

    def share(self, trace: Trace) -> float:
        return self.hits / trace.infinite_hits if trace.infinite_hits else 0.0


# ---- replaying -------------------------------------------------------------------------------
def replay(trace: Trace, policy: str, capacity_blocks: int, progress=None) -> Run:
    """``trace`` through a pool of ``capacity_blocks`` blocks evicting by ``policy`` (a name of
    tierd.pool.policy.POLICIES or "default"). ``progress(done)`` is called now and then."""
    resolved = policies.DEFAULT if policy == "default" else policy
    pool = Pool(
        capacity_blocks * BLOCK_BYTES, 0, BLOCK_BYTES, capacity_blocks * BLOCK_BYTES, eviction_policy=resolved
    )
    run = Run(policy, resolved, capacity_blocks)
    specs = [GroupSpec(GroupKind.FULL, trace.block_tokens)]
    span = Span({0: (0, 0)}, {0: 1})  # one group, one block a chunk: each object whole
    spaces = pool.index.spaces
    lookup, settle, writes, commit, touch = pool.lookup, pool.settle, pool.writes, pool.commit, pool.touch
    t0 = last = time.perf_counter()
    try:
        for i, (ns, keys) in enumerate(trace.requests):
            hit, _ = lookup(ns, keys, specs, trace.block_tokens, [0])
            settle()  # the daemon applies a LOOKUP's touches right after its reply
            run.hits += hit
            space = spaces.get(ns, {})
            new = [k for k in keys[hit:] if k not in space]
            if new:
                made = []
                with writes() as w:
                    for k in new:
                        obj = w.begin(ns, k, span, 0, BLOCK_BYTES, 1, "g0")
                        if obj is None:
                            run.rejected += 1
                        elif obj is not EXISTS:
                            made.append(obj)
                commit(made)  # the first ends up most recent
                run.stored += len(made)
            touch(ns, keys)  # as a STORE's touch of its prefix: the head most recent
            if progress is not None and i % 256 == 0:
                now = time.perf_counter()
                if now - last >= 0.5:
                    progress(i)
                    last = now
        run.seconds = time.perf_counter() - t0
        run.evicted = pool.evictions
        run.state = pool.policy.status()
    finally:
        pool.close()
    return run


# ---- capacities ------------------------------------------------------------------------------
def parse_capacities(
    blocks: str | None, sizes: str | None, block_tokens: int, bytes_per_token: int
) -> list[int]:
    """Capacities in blocks from ``--capacity-blocks 1000,3000`` and ``--capacity 3M,16GiB``
    (tokens with an optional K/M/G, or bytes with KiB..TiB at ``bytes_per_token``)."""
    out = []
    for item in _items(blocks):
        if not item.isdigit() or int(item) < 1:
            raise click.BadParameter(
                f"{item!r} is not a whole number of blocks >= 1", param_hint="--capacity-blocks"
            )
        out.append(int(item))
    for item in _items(sizes):
        m = _SIZE.match(item)
        unit = m.group(2).lower() if m else None
        if m is None or (unit not in _TOKENS and unit not in _BYTES):
            raise click.BadParameter(
                f"{item!r} is neither tokens (3M, 500K, 3000000) nor bytes (16GiB, 512MiB)",
                param_hint="--capacity",
            )
        if unit in _TOKENS:
            n = math.ceil(float(m.group(1)) * _TOKENS[unit] / block_tokens)
        else:
            n = int(float(m.group(1)) * _BYTES[unit] // (block_tokens * bytes_per_token))
        if n < 1:
            raise click.BadParameter(f"{item!r} holds no whole block", param_hint="--capacity")
        out.append(n)
    return out


def _items(text: str | None) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()] if text else []


# ---- printing --------------------------------------------------------------------------------
def _count(n: float) -> str:
    for unit, size in (("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def table(trace: Trace, runs: list[Run], bytes_per_token: int) -> str:
    block = trace.block_tokens * bytes_per_token
    lines = [
        f"{trace.name}: {len(trace.requests):,} requests, {trace.blocks:,} blocks of {trace.block_tokens} "
        f"tokens ({trace.distinct:,} distinct); an infinite pool hits {trace.infinite_hit_ratio:.3f} of them",
        f"bytes at {bytes_per_token:,} bytes a token ({_bytes(block)} a block)",
        "",
        f"{'policy':<8} {'capacity':>16} {'pool':>10} {'hit ratio':>9} {'of infinite':>11} "
        f"{'stored':>10} {'evicted':>10} {'requests/s':>10}",
    ]
    for r in runs:
        name = r.policy if r.policy == r.resolved else f"{r.resolved}*"
        lines.append(
            f"{name:<8} {r.capacity_blocks:>9,} blocks {_bytes(r.capacity_blocks * block):>10} "
            f"{r.hit_ratio(trace):>9.3f} {r.share(trace):>11.2f} {_bytes(r.stored * block):>10} "
            f"{_bytes(r.evicted * block):>10} {len(trace.requests) / max(r.seconds, 1e-9):>10,.0f}"
        )
    if any(r.policy != r.resolved for r in runs):
        lines.append("* the default policy")
    return "\n".join(lines)


def as_json(trace: Trace, runs: list[Run]) -> dict:
    """The stable form scripts read (README, "Size a pool")."""
    return {
        "requests": len(trace.requests),
        "blocks": trace.blocks,
        "infinite_hit_ratio": trace.infinite_hit_ratio,
        "runs": [
            {
                "policy": r.policy,
                "capacity_blocks": r.capacity_blocks,
                "hit_ratio": r.hit_ratio(trace),
                "share_of_infinite": r.share(trace),
            }
            for r in runs
        ],
    }


def plot(trace: Trace, runs: list[Run], path: str) -> str | None:
    """Draw hit ratio against capacity per policy into ``path``; a reason when it cannot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--plot needs matplotlib (pip install 'tierd[plot]'): no plot drawn"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r.policy for r in runs):
        pts = sorted(
            (r.capacity_blocks * trace.block_tokens, r.hit_ratio(trace)) for r in runs if r.policy == name
        )
        label = (
            name if name != "default" else f"default ({next(r.resolved for r in runs if r.policy == name)})"
        )
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=label)
    ax.axhline(trace.infinite_hit_ratio, linestyle="--", color="gray", label="infinite pool")
    ax.set_xscale("log")
    ax.set_xlabel("pool capacity (tokens)")
    ax.set_ylabel("hit ratio of prompt tokens")
    ax.set_ylim(0, max(0.05, trace.infinite_hit_ratio * 1.1))
    ax.set_title(f"tierd replay: {trace.name.rsplit('/', 1)[-1]}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        return f"--plot: cannot write {path}: {exc.strerror or exc}"
    finally:
        plt.close(fig)
    return None


# ---- the command -----------------------------------------------------------------------------
class _Progress:
    """A run's progress on stderr: one line redrawn on a terminal, else a line every 10 s."""

    def __init__(self, head: str, trace: Trace):
        self.head, self.trace = head, trace
        self.tty = sys.stderr.isatty()
        self.last = time.monotonic()

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        if self.tty or now - self.last >= 10:
            self.last = now
            line = f"{self.head}: {done:,}/{len(self.trace.requests):,} requests"
            click.echo(f"\r{line}" if self.tty else line, nl=not self.tty, err=True)

    def done(self, run: Run) -> None:
        t = self.trace
        line = (
            f"{self.head}: hit ratio {run.hit_ratio(t):.3f} ({run.share(t):.3f} of infinite), "
            f"{len(t.requests) / max(run.seconds, 1e-9):,.0f} requests/s"
        )
        click.echo(f"\r{line}" if self.tty else line, err=True)


@click.command("replay")
@click.argument("trace_path", metavar="TRACE")
@click.option("--capacity-blocks", default=None, help="Pool capacities in blocks, e.g. 1000,3000,5860.")
@click.option(
    "--capacity",
    default=None,
    help="Pool capacities in tokens (3M, 500K) or bytes (16GiB, at --bytes-per-token). Without either "
    "option: 0.5%, 1%, 2%, 5%, 10% and 20% of the trace's distinct blocks.",
)
@click.option(
    "--policy",
    default="lru,default",
    show_default=True,
    help="Eviction policies to compare: reuse, lru; default names --eviction-policy's default.",
)
@click.option(
    "--bytes-per-token",
    default=LLAMA3_8B_BYTES_PER_TOKEN,
    show_default=True,
    type=click.IntRange(min=1),
    help="KV bytes per token, for bytes stored and evicted and GiB capacities (default: Llama-3-8B, bf16).",
)
@click.option(
    "--json", "as_json_", is_flag=True, help="Print one JSON object (the stable form scripts read)."
)
@click.option(
    "--plot", "plot_path", default=None, metavar="FILE.png", help="Draw hit ratio against capacity."
)
@click.option("--quiet", is_flag=True, help="No progress on stderr.")
def command(trace_path, capacity_blocks, capacity, policy, bytes_per_token, as_json_, plot_path, quiet):
    """Replay a request trace through the daemon's pool at one or more capacities and policies, and
    print the hit ratio each gets (Mooncake's JSONL traces, or one list of chunk keys a line)."""
    names = _items(policy)
    for name in names:
        if name != "default" and name not in POLICIES:
            raise click.BadParameter(
                f"{name!r}: policies are {', '.join(POLICIES)} and default", param_hint="--policy"
            )
    if not names:
        raise click.BadParameter("name at least one policy", param_hint="--policy")
    try:
        trace = read_trace(trace_path)
    except TraceError as exc:
        raise click.ClickException(str(exc)) from None
    caps = parse_capacities(capacity_blocks, capacity, trace.block_tokens, bytes_per_token)
    if not caps:
        caps = sorted({max(1, round(trace.distinct * s)) for s in DEFAULT_SHARES})
    runs = []
    total = len(names) * len(caps)
    for i, (cap, name) in enumerate((c, n) for c in caps for n in names):
        shown = None if quiet else _Progress(f"replay {i + 1}/{total}: {name} at {cap:,} blocks", trace)
        run = replay(trace, name, cap, shown)
        runs.append(run)
        if shown is not None:
            shown.done(run)
    if as_json_:
        click.echo(json.dumps(as_json(trace, runs)))
    else:
        click.echo(table(trace, runs, bytes_per_token))
    if plot_path:
        why = plot(trace, runs, plot_path)
        if why is not None:
            click.echo(why, err=True)
        elif not quiet:
            click.echo(f"plot: {plot_path}", err=True)
