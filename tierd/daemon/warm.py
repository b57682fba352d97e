"""Warm restart, the daemon's side (the pool's side is tierd.pool.persist): what a restart must
find unchanged, what it says at start, and what /status and /metrics report.

Hazards: a restart that serves objects written under other rules hands engines wrong KV. The
pool checks its own geometry (alignment, segment size, ceiling); ``pool_meta`` adds everything
else that decides an object's bytes or its key, so any change there starts cold. The software
version is deliberately not in it: an upgrade that keeps these keeps the pool. A pool folder on
a mount smaller than the ceiling fills up; the pool then stops growing, a journal write that
fails stops persisting, and the next start is cold (``room_warning`` says so at start).
"""

from __future__ import annotations

import logging
import os
import time

from tierd.base.config import Settings
from tierd.protocol.keys import KEY_VERSION
from tierd.state.planner import OBJECT_LAYOUT_VERSION

log = logging.getLogger("tierd")

GIB = 1 << 30


def pool_meta(settings: Settings) -> dict:
    """The settings and code versions that shape stored objects and their keys."""
    return {
        "separate_object_groups": settings.separate_object_groups,
        "key_version": KEY_VERSION,
        "object_layout": OBJECT_LAYOUT_VERSION,
    }


def announce(settings: Settings, pool) -> None:
    """At start: what a warm start recovered, and a mount too small for the ceiling."""
    line = start_line(pool.warm_restart)
    if line:
        log.info(line)
    line = room_warning(settings, pool.backed_bytes, pool.configured_bytes)
    if line:
        log.warning(line)


def save(pool, registry) -> None:
    """At a planned stop, once every copy is done: index every committed object and the
    namespaces (``registry.persisted()``) for the next start. A failure is logged; the pool has
    then removed its index, so the next start is cold, never stale."""
    if pool.persist is None:
        return
    t0 = time.perf_counter()
    try:
        pool.save(extra=registry.persisted())
    except OSError as exc:
        log.error("could not save the pool index in %s: %s", pool.persist.folder.path, exc)
        return
    log.info("saved the pool index: %d objects in %.3f s", pool.objects, time.perf_counter() - t0)


def start_line(report: dict | None) -> str | None:
    """One line for the log at start: what a warm start recovered (a cold one is logged by the pool)."""
    if not report or not report["warm"]:
        return None
    return (
        f"warm restart from {report['pool_dir']}: {report['objects']} objects, "
        f"{report['bytes'] / GIB:.2f} GiB in {report['seconds']:.3f} s "
        f"({report['journal_records']} journal records replayed)"
    )


def room_warning(settings: Settings, backed: int, ceiling: int) -> str | None:
    """Why the pool folder's mount cannot hold the whole ceiling, or None (also when unknown)."""
    if settings.pool_dir is None:
        return None
    try:
        st = os.statvfs(settings.pool_dir)
    except OSError:
        return None
    if not st.f_blocks:  # hugetlbfs without size=: bounded by the host's free huge pages
        return None
    room = st.f_bavail * st.f_frsize + backed
    if room >= ceiling:
        return None
    return (
        f"the pool folder {settings.pool_dir} has room for {room / GIB:.2f} GiB of the "
        f"{ceiling / GIB:.2f} GiB ceiling: past that the pool stops growing, and a full mount stops "
        "the journal too (the next start is then cold); grow the mount or lower --l1-size-gb"
    )


def status(pool) -> dict | None:
    """The /status ``warm_restart`` object: what this start recovered, or why it was cold, and
    whether the pool still persists (``persist_error``: why the journal stopped)."""
    if pool.persist is None:
        return None
    return {**pool.warm_restart, "persist_error": pool.persist.error}
