"""Human-readable tables for ``tierd status`` and ``tierd bench``."""

from __future__ import annotations

from tierd.base.stats import STAGES
from tierd.pool.pages import SMALL_PAGES
from tierd.protocol.versions import vllm_in_tested_range
from tierd.tools.bench.ranks import DEPTH, PHASES_ALL, RAW_OF


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _rows(rows: list[tuple[str, object]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _version(s: dict) -> str:
    key_format = (s.get("versions") or {}).get("key_format")
    keys = "" if key_format is None else f", key format {key_format}"
    return f"tierd {s['version']}{keys} (pid {s['pid']}, up {s['uptime_s']:.0f} s)"


def _vllm(v: dict) -> str:
    """The daemon's environment's vLLM next to the releases tierd is tested with."""
    here, tested = v.get("vllm"), v.get("vllm_tested")
    text = f"{here} in the daemon's environment" if here else "none in the daemon's environment"
    if not tested:
        return text + "; tested range unknown (tierd runs from a source tree, not installed)"
    text += f"; tierd is tested with vLLM {tested}"
    if here and vllm_in_tested_range(here, tested) is False:
        text += f" (this {here.split()[0]} is not)"
    return text + ("" if here else "; each engine's connector logs its own")


def status_table(s: dict) -> str:
    hit = s["hit_chunks"] / s["lookup_chunks"] if s.get("lookup_chunks") else 0.0
    rows = [
        ("version", _version(s)),
        ("socket", s["socket"]),
        ("memory", _memory(s)),
        (
            "objects",
            f"{s['objects']}  " + "  ".join(f"{g}={n}" for g, n in sorted(s["group_objects"].items())),
        ),
        ("lookups", f"{s['lookups']}  (hit {s['hit_chunks']} of {s['lookup_chunks']} chunks, {hit:.1%})"),
        (
            "stores",
            f"{s['stores']}  ({s['stored_chunks']} chunks, {_bytes(s['stored_bytes'])}, "
            f"{s['store_rejects']} rejected)",
        ),
        (
            "retrieves",
            f"{s['retrieves']}  ({s['retrieved_chunks']} chunks, {_bytes(s['retrieved_bytes'])}, "
            f"{s['retrieve_failed_blocks']} failed blocks)",
        ),
        ("evictions", _evictions(s)),
        (
            "leases",
            f"{s['leases_active']} active, {s['leases_granted']} granted, {s['leases_expired']} expired",
        ),
        (
            "errors",
            f"{s['errors']}  " + "  ".join(f"{c}={n}" for c, n in sorted(s["errors_by_code"].items())),
        ),
        ("sessions", s["sessions"]),
    ]
    if "largest_storable_bytes" in s:
        rows.insert(
            3,
            (
                "room",
                f"largest new object storable now {_bytes(s['largest_storable_bytes'])} "
                f"({_bytes(s['largest_free_bytes'])} without evicting)",
            ),
        )
    rows.insert(1, ("vllm", _vllm(s.get("versions") or {})))
    for op, row in sorted((s.get("request_stages") or {}).items()):
        rows.append((f"{op.lower()} stages", _stages(row)))
    if s.get("warm_restart"):
        rows.append(("warm restart", _warm(s["warm_restart"])))
    if s.get("pool_grow_error"):
        rows.append(("pool growth", f"stopped: {s['pool_grow_error']}"))
    out = [_rows(rows + _l2_rows(s.get("l2"))), "", f"instances ({len(s['instances'])})"]
    for inst in s["instances"]:
        ns = inst["namespace"]
        beat = inst["last_heartbeat_s_ago"]
        out.append(
            f"  {inst['instance']:<28} {inst['model']:<24} rank {inst['rank']}/{ns['world_size']} "
            f"{inst['device']:<5} {inst.get('copies', ''):<6} groups {_groups(inst)}  "
            f"heartbeat {'-' if beat is None else f'{beat:.1f} s ago'}"
        )
    return "\n".join(out)


def _stages(row: dict) -> str:
    """Where a copy's time went in the daemon: mean ms per stage since start (tierd.base.stats STAGES)."""
    jobs, secs = row["jobs"], row["seconds"]
    means = "  ".join(f"{name} {secs[name] / jobs * 1e3:.3f}" for name, _ in STAGES if name in secs)
    return f"{means}  (ms per copy, mean of {jobs})"


def _groups(inst: dict) -> str:
    """Group kinds, a block-major group's marked ``/block`` (objects laid out block by block)."""
    orders = inst.get("object_order") or ["layer"] * len(inst["groups"])
    return ",".join(k + ("/block" if o == "block" else "") for k, o in zip(inst["groups"], orders))


def _evictions(s: dict) -> str:
    p = s.get("eviction_policy")  # (absent from a daemon before eviction policies)
    if p is None:
        return str(s["evictions"])
    why = "  ".join(f"{r}={n}" for r, n in sorted(p["evictions_by_reason"].items()))
    out = f"{s['evictions']}  (policy {p['name']}{':  ' + why if why else ''})"
    if "reuse_distance" in p:
        out += f"  reuse distance {p['reuse_distance']:,} ticks, bonus x{p['bonus_scale']}"
        if "bonus_gate" in p:  # (a daemon before the LRU shadow: not shown)
            out += f" (gate {p['bonus_gate']:g} by an LRU shadow of {p['shadow_keys']:,} keys)"
    return out


def _memory(s: dict) -> str:
    backed = f"{_bytes(s['memory_total_bytes'])} backed"
    if "memory_segments" in s:  # (a daemon before segments that grow with the pool: not shown)
        n, step = s["memory_segments"], s["memory_next_segment_bytes"]
        grow = f"the next grows {_bytes(step)}" if step else "none can grow"
        if s.get("memory_ahead_bytes"):
            grow += ", backed ahead"
        backed += f" ({n} segment{'' if n == 1 else 's'}; {grow})"
    ceiling = _bytes(s["memory_configured_bytes"])
    huge = s.get("memory_huge_pages")
    pages = "" if huge is None else f"; huge pages {huge}" + (" (4 KiB pages)" if huge in SMALL_PAGES else "")
    return f"{_bytes(s['memory_used_bytes'])} used / {backed} / {ceiling} ceiling{pages}"


def _warm(w: dict) -> str:
    if w["warm"]:
        text = (
            f"warm: {w['objects']} objects ({_bytes(w['bytes'])}) recovered in {w['seconds']:.3f} s "
            f"from {w['pool_dir']}"
        )
    else:
        text = f"cold: {w['reason']} ({w['pool_dir']})"
    return text + (f"; NOT PERSISTING: {w['persist_error']}" if w.get("persist_error") else "")


def _l2_rows(l2: dict | None) -> list[tuple[str, object]]:
    """``tierd status`` rows of the second tier (none without --l2-url)."""
    if not l2:
        return []
    lat = l2["latency_s"]
    ms = {op: 1e3 * lat[op]["sum"] / max(1, lat[op]["count"]) for op in ("put", "get", "exists")}
    return [
        ("l2", f"{l2['state']}  {l2['url']}  ({l2['policy']}, segment {_bytes(l2['segment_bytes'])})"),
        (
            "l2 lookups",
            f"{l2['lookups']} asked  (+{l2['hit_chunks']} chunks from L2, "
            f"{l2['lookups_late']} late, {l2['lookups_skipped']} skipped)  "
            f"exists {ms['exists']:.2f} ms",
        ),
        (
            "l2 gets",
            f"{l2['gets']}  ({l2['hits']} hits, {l2['misses']} misses, {_bytes(l2['get_bytes'])}, "
            f"{l2['fetch_failed']} fetches failed)  {ms['get']:.2f} ms",
        ),
        (
            "l2 puts",
            f"{l2['puts']}  ({l2['put_stored']} stored, {l2['put_full']} full, "
            f"{_bytes(l2['put_bytes'])})  {ms['put']:.2f} ms",
        ),
        (
            "l2 backlog",
            f"{l2['writeback_queued']} objects ({_bytes(l2['writeback_queued_bytes'])}) queued, "
            f"{_bytes(l2['writeback_inflight_bytes'])} in flight, {l2['writeback_lost']} lost",
        ),
        (
            "l2 errors",
            f"{l2['errors']}  timeouts {l2['timeouts']}  degraded {l2['degraded']}  "
            + "  ".join(f"{c}={n}" for c, n in sorted(l2["errors_by_code"].items()))
            + (f"  last: {l2['last_error']}" if l2["last_error"] else ""),
        ),
    ]


def bench_table(r: dict) -> str:
    if r.get("bench") == "ranks":
        return ranks_table(r)
    rows = [
        (
            "layout",
            f"{r['layout']} on {r['device']}: {r['layers']} layers, "
            f"{_bytes(r['block_bytes'])} per block per layer, "
            f"{_bytes(r['object_bytes'])} per chunk",
        ),
        ("moved per round", f"{_bytes(r['bytes_per_round'])} ({r['chunks']} chunks)"),
        ("store", f"{r['store_gbps']:.2f} GB/s  ({r['store_ratio']:.2f}x baseline)"),
        ("retrieve", f"{r['retrieve_gbps']:.2f} GB/s  ({r['retrieve_ratio']:.2f}x baseline)"),
    ]
    if "store_first_gbps" in r:
        rows.append(
            (
                "first round",
                f"store {r['store_first_gbps']:.2f} GB/s, retrieve {r['retrieve_first_gbps']:.2f} GB/s "
                f"(memory no round touched before)",
            )
        )
    if "both_gbps" in r:
        ratio = (
            f"  ({r['both_ratio']:.2f}x both-ways baseline {r['baseline_both_gbps']:.2f} GB/s)"
            if "both_ratio" in r
            else ""
        )
        rows.append(("both ways", f"{r['both_gbps']:.2f} GB/s{ratio}"))
    if "huge_pages" in r:
        hp = r["huge_pages"]
        small = any(v in SMALL_PAGES for v in hp.values())
        why = "  (4 KiB pages: slower than the baseline's huge pages, whatever tierd does: README)"
        rows.append(("huge pages", f"memfd {hp['memfd']}, /dev/shm {hp['dev_shm']}" + (why if small else "")))
    if "per_block_gbps" in r:
        rows.append(("per-block memcpy baseline", f"{r['per_block_gbps']:.2f} GB/s"))
    if "baseline_d2h_gbps" in r:
        rows.append(
            (
                "raw pinned copy",
                f"D2H {r['baseline_d2h_gbps']:.2f} GB/s, H2D {r['baseline_h2d_gbps']:.2f} GB/s",
            )
        )
    for n, lat in (r.get("latency_ms") or {}).items():
        rows.append(
            (
                f"latency, {n.replace('_', ' ')}",
                f"store {lat['store']:.2f} ms (raw {lat['raw_d2h']:.2f}, goal "
                f"{lat['store_goal']:.2f}), retrieve {lat['retrieve']:.2f} ms "
                f"(raw {lat['raw_h2d']:.2f}, goal "
                f"{lat['retrieve_goal']:.2f})",
            )
        )
    for op, row in sorted((r.get("daemon_stages_ms") or {}).items()):
        rows.append(
            (f"daemon, {op}", "  ".join(f"{k} {v:.3f}" for k, v in row.items()) + "  (ms per request)")
        )
    if "lookups_per_s" in r:
        rows.append(("lookups", f"{r['lookups_per_s']:.0f}/s one at a time ({r['lookup_keys']} keys each)"))
    for step, row in (r.get("interference") or {}).items():
        rows.append(
            (
                f"interference, {step}",
                f"alone {row['alone_ms']:.2f} ms; with tierd {row['tierd_slowdown']:.3f}x "
                f"(copying {row['tierd_copy_gbps']:.1f} GB/s); with raw DMA {row['raw_dma_slowdown']:.3f}x "
                f"({row['raw_dma_copy_gbps']:.1f} GB/s)",
            )
        )
    rows.append(
        ("baseline", f"{r['baseline_gbps']:.2f} GB/s  ({r.get('baseline', 'memcpy of the same bytes')})")
    )
    rows.append(("verified", "yes, every byte" if r["verified"] else "NO: restored bytes differ"))
    return _rows(rows)


def ranks_table(r: dict) -> str:

    a, ratio, one = r["aggregate_gbps"], r["ratio_to_raw"], r["ratio_to_one_rank"]
    base = RAW_OF[r["device"]]
    rows = [
        (
            "layout",
            f"{r['layout']} on {r['device']}: {r['ranks']} ranks ({len(r['gpus']) or 'no'} GPUs), "
            f"{r['layers']} layers, {_bytes(r['block_bytes'])} per block per layer, "
            f"{_bytes(r['object_bytes'])} per chunk",
        ),
        ("windows", f"{r['window_s']:g} s each, requests of {r['batch']} chunks, {DEPTH} in flight per rank"),
    ]
    for k in PHASES_ALL:
        rows.append(
            (
                f"{k}, all ranks",
                f"{a[k]:.2f} GB/s  ({ratio[k]:.2f}x raw {a[base[k]]:.2f} GB/s at the same "
                f"time; {one[k]:.2f}x one rank alone {a['solo_' + k]:.2f} GB/s)",
            )
        )
    for o in r["per_rank"]:
        g = o["gbps"]
        rows.append(
            (
                f"rank {o['rank']}" + (f" (GPU {o['gpu']})" if o["gpu"] is not None else ""),
                f"store {g['store']:.2f}, retrieve {g['retrieve']:.2f}, both {g['both']:.2f} GB/s; "
                f"{o['stored_objects']} objects stored",
            )
        )
    if "one_copy" in r:
        rows.append(("MLA", "one copy in the pool (only rank 0 stored)" if r["one_copy"] else "NOT one copy"))
    rows.append(
        ("verified", "yes, every rank's every byte" if r["verified"] else "NO: restored bytes differ")
    )
    return _rows(rows)
