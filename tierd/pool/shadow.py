"""The reuse policy's guard (tierd.pool.policy): it keeps the policy from losing to LRU where past
frequency misleads, as when a working set is replaced at once and the old one's levels would
outlive it.

Once the pool has evicted, an LRU shadow of the pool's capacity in keys runs on a sample of the
keys LOOKUPs name: every key while the pool holds under 2 * SHADOW_KEYS, else 1 in 2**k by the
key's last two bytes (chunk keys are hashes), k the largest that leaves the shadow SHADOW_KEYS or
more; k follows the keys held when it would move by two or more (a miniature cache simulation).
Every WINDOW sampled keys, the pool's own prefix hits on them are compared with the shadow's:
while the shadow hits more, by over SIGMAS standard deviations, ``gate`` (the share of the bonus
the policy keeps) halves, down to GATE_MIN; once the pool hits at least as many, it doubles back
up to 1. LOOKUPs reach the shadow after their reply (the pool's touches), BATCH at a time.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from itertools import repeat

SHADOW_KEYS = 1024  # keys the shadow holds at least (every key below twice that, 1 in 2**k above)
WINDOW = 512  # sampled keys looked up between two comparisons
SHIFT_MAX = 16  # the shadow samples at least 1 key in 2**SHIFT_MAX
BATCH, BATCH_KEYS = 16, 4096  # LOOKUPs (keys) taken through the shadow at a time
GATE_MIN = 1 / 64  # the least share of the bonus the guard leaves
SIGMAS = 3  # how far the shadow must hit above the pool, in standard deviations


class Shadow:
    """The LRU shadow and its verdict, ``gate`` (module docstring)."""

    def __init__(self):
        self.gate = 1.0
        # namespace + key (bytes, which the garbage collector need not track; distinct for keys of
        # one length) -> None, least recent first
        self.shadow: OrderedDict[bytes, None] = OrderedDict()
        self.full = False  # the pool evicted something yet
        self.shift = -1  # sample 1 key in 2**shift (-1: not yet)
        self.duel = [0, 0, 0]  # sampled keys since the last comparison: looked up, hit here, hit in LRU
        self.cap = 0  # keys the shadow holds at most: the pool's keys, sampled as its keys are
        # LOOKUPs not through the shadow yet: (their sampled keys, how many of them the pool found)
        self.pending: list[tuple[list[bytes], int]] = []
        self.pending_keys = 0  # keys those LOOKUPs named

    def observe(self, ns: bytes, keys: Sequence[bytes], hit: int, held: int) -> None:
        """A LOOKUP of ``keys`` found the first ``hit`` (the pool holds ``held`` keys now): its
        sampled keys are picked now, while they are fresh in the CPU's cache (only they are kept),
        and go through the shadow BATCH LOOKUPs (or BATCH_KEYS keys looked up) at a time, in order."""
        if not self.full:  # no eviction yet: no order to judge
            return
        # the keys the pool holds now are its capacity: it has evicted, so it is full, or a
        # namespace or size class is; a pool that fills up later samples fewer keys
        ideal = min(SHIFT_MAX, int(math.log2(held / SHADOW_KEYS))) if held > SHADOW_KEYS else 0
        if self.shift < 0 or abs(ideal - self.shift) > 1:  # (by more than one: no flapping at a boundary)
            self.flush()  # what was sampled the old way goes through first
            self._resample(ideal)
        self.cap = held >> self.shift
        mine = sample(keys, self.shift) if self.shift else range(len(keys))
        if mine:  # the sampled keys, and how many of them lie within the pool's hit
            self.pending.append(([ns + keys[i] for i in mine], bisect.bisect_left(mine, hit)))
        self.pending_keys += len(keys)
        if len(self.pending) >= BATCH or self.pending_keys >= BATCH_KEYS:
            self.flush()

    def flush(self) -> None:
        """Take the LOOKUPs ``observe`` holds through the shadow now."""
        pending, self.pending, self.pending_keys = self.pending, [], 0
        shadow, duel, cap = self.shadow, self.duel, self.cap
        for sks, here in pending:
            found = 0
            for sk in sks:  # a hit is a prefix: the shadow's ends at its first missing sampled key
                if sk not in shadow:
                    break
                found += 1
            duel[0] += len(sks)
            duel[1] += here
            duel[2] += found
            deque(map(shadow.pop, sks, repeat(None)), 0)
            shadow.update(dict.fromkeys(reversed(sks)))  # tail first: the head ends up the most recent
            while len(shadow) > cap:  # (each LOOKUP's: a shadow over its capacity would hit more)
                shadow.popitem(last=False)
            if duel[0] >= WINDOW:
                self._judge()
                duel = self.duel

    def forget(self, ns: bytes | None) -> None:
        """A CLEAR of namespace ``ns`` (None: all): its keys leave the shadow as they left the pool,
        else LOOKUPs of them would count as LRU hits the pool could not have had."""
        if ns is None:
            self.shadow.clear()
            self.pending, self.pending_keys = [], 0
            return
        for sk in [sk for sk in self.shadow if sk.startswith(ns)]:  # (namespace ids have one length)
            del self.shadow[sk]
        self.pending = [p for p in self.pending if not p[0][0].startswith(ns)]

    def _resample(self, shift: int) -> None:
        """Sample 1 key in 2**``shift`` from now on: the shadow keeps the keys of a sparser sample
        (they are a subset); a denser one starts it over. The comparison so far is dropped."""
        if self.shift >= 0 and shift > self.shift:
            mask = (1 << shift) - 1  # a shadow key ends with the chunk key's last two bytes
            self.shadow = OrderedDict(
                (sk, None) for sk in self.shadow if not int.from_bytes(sk[-2:], "big") & mask
            )
        else:
            self.shadow.clear()
        self.shift, self.duel = shift, [0, 0, 0]

    def _judge(self) -> None:
        """Compare the window's hits with the shadow's; move the gate."""
        _, here, lru = self.duel
        self.duel = [0, 0, 0]
        if lru > here + SIGMAS * math.sqrt(max(1, lru)):  # a count's standard deviation, about
            self.gate = max(self.gate / 2, GATE_MIN)
        elif here >= lru:
            self.gate = min(1.0, self.gate * 2)

    def status(self) -> dict:
        return {
            "bonus_gate": self.gate,
            "shadow_keys": len(self.shadow),
            "shadow_sampling": 0.0 if self.shift < 0 else 1 / (1 << self.shift),
        }


# per shift 1..8: a byte -> 1 where its low ``shift`` bits are zero, else 0 (bytes.translate)
_LOW_ZERO = [None] + [bytes(int(not b & ((1 << k) - 1)) for b in range(256)) for k in range(1, 9)]


def sample(keys: Sequence[bytes], shift: int) -> list[int]:
    """The positions of the ``keys`` the LRU shadow samples at 1 in 2**``shift`` (1..16): those
    whose last two bytes (big-endian) have ``shift`` low zero bits. Chunk keys are hashes, so
    that is uniform. Keys of one length (a daemon's) are read in one pass of C: joined, every
    key's last byte sliced out and mapped to 1 where it qualifies, then found."""
    n = len(keys)
    mask = (1 << shift) - 1
    width = len(keys[0]) if n else 0
    joined = b"".join(keys)
    if width < 2 or len(joined) != n * width or len(keys[-1]) != width:  # (lengths differ: rare)
        return [i for i, k in enumerate(keys) if not int.from_bytes(k[-2:], "big") & mask]
    flags = joined[width - 1 :: width].translate(_LOW_ZERO[min(shift, 8)])
    at, find = [], flags.find
    i = find(1)
    while i >= 0:
        at.append(i)
        i = find(1, i + 1)
    if shift > 8:  # the next byte's low bits too
        high = mask >> 8
        at = [i for i in at if not joined[i * width + width - 2] & high]
    return at
