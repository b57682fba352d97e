"""Key derivation is deterministic across processes (no per-process hash seed), chains every
chunk to everything before it, and separates tenants (cache salt), LoRAs, parents and extras."""

import os
import subprocess
import sys

import numpy as np

from tierd.protocol.keys import KEY_BYTES, chunk_hashes, namespace_id, root_hash
from tierd.protocol.layout import Namespace

TOKENS = list(range(1000, 1000 + 64))

SCRIPT = """
from tierd.protocol.keys import chunk_hashes, namespace_id, root_hash
from tierd.protocol.layout import Namespace
hs = chunk_hashes(
    list(range(1000, 1064)), 16, parent=root_hash("salt", "lora"), chunk_extras=[None, {"mm": "x"}]
)
print(" ".join(h.hex() for h in hs), namespace_id(Namespace("m", "fp", 2, "s")).hex(), hash("probe"))
"""


def run_in(seed: str) -> tuple[str, str]:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, check=True
    ).stdout
    *hashes, probe = out.split()
    return " ".join(hashes), probe


def test_keys_identical_across_processes_with_different_hash_seeds():
    a, probe_a = run_in("1")
    b, probe_b = run_in("4242")
    assert probe_a != probe_b  # the processes really had different str hashes
    assert a == b
    here = chunk_hashes(TOKENS, 16, parent=root_hash("salt", "lora"), chunk_extras=[None, {"mm": "x"}])
    assert a.split()[:4] == [h.hex() for h in here]
    assert a.split()[4] == namespace_id(Namespace("m", "fp", 2, "s")).hex()


def test_chunk_hashes_shape_and_prefix_property():
    hs = chunk_hashes(TOKENS + [1, 2, 3], 16)  # a trailing partial chunk gets no hash
    assert len(hs) == 4 and all(len(h) == KEY_BYTES for h in hs) and len(set(hs)) == 4
    assert chunk_hashes(TOKENS[:32], 16) == hs[:2]  # a prefix has the prefix's hashes
    assert chunk_hashes(TOKENS, 16, start=2) == hs[2:]
    assert chunk_hashes(TOKENS[32:], 16, parent=hs[1]) == hs[2:]  # resume from a known parent


def test_token_dtype_does_not_matter():
    ref = chunk_hashes(TOKENS, 16)
    assert chunk_hashes(np.array(TOKENS, dtype=np.int32), 16) == ref
    assert chunk_hashes(np.array(TOKENS, dtype=">i8"), 16) == ref
    assert chunk_hashes(tuple(TOKENS), 16) == ref


def test_any_difference_changes_every_later_hash():
    ref = chunk_hashes(TOKENS, 16)
    other = list(TOKENS)
    other[20] += 1  # inside chunk 1
    changed = chunk_hashes(other, 16)
    assert changed[0] == ref[0] and all(a != b for a, b in zip(changed[1:], ref[1:]))


def test_salts_parents_and_extras_separate_keys():
    base = chunk_hashes(TOKENS, 16)
    assert chunk_hashes(TOKENS, 16, parent=root_hash()) == base
    variants = [
        chunk_hashes(TOKENS, 16, parent=root_hash(cache_salt="tenant-a")),
        chunk_hashes(TOKENS, 16, parent=root_hash(cache_salt="tenant-b")),
        chunk_hashes(TOKENS, 16, parent=root_hash(lora="adapter")),
        chunk_hashes(TOKENS, 16, parent=root_hash(extra=[1])),
        chunk_hashes(TOKENS, 16, parent=base[0]),
        chunk_hashes(TOKENS, 16, chunk_extras=[{"image": "abc"}]),
    ]
    firsts = {v[0] for v in variants} | {base[0]}
    assert len(firsts) == len(variants) + 1
    lasts = {v[-1] for v in variants} | {base[-1]}
    assert len(lasts) == len(variants) + 1
    # an extra on chunk 2 leaves chunks 0-1 alone
    e = chunk_hashes(TOKENS, 16, chunk_extras=[None, None, "x"])
    assert e[:2] == base[:2] and e[2] != base[2]
    # chunk size is part of the geometry: different keys
    assert chunk_hashes(TOKENS, 32)[0] != base[1]


def test_namespace_id_depends_on_every_field():
    ns = Namespace("m", "fp", 2, "s")
    assert namespace_id(ns) == namespace_id(Namespace("m", "fp", 2, "s"))
    others = [
        Namespace("m2", "fp", 2, "s"),
        Namespace("m", "fp2", 2, "s"),
        Namespace("m", "fp", 4, "s"),
        Namespace("m", "fp", 2, ""),
    ]
    assert len({namespace_id(n) for n in others} | {namespace_id(ns)}) == 5
