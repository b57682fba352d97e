"""Golden keys: fixed token ids, salt, LoRA name, multimodal item and layout give these exact
digests, in this process and in others whatever their PYTHONHASHSEED. Warm restart (--pool-dir)
and a store shared through L2 rely on every tierd version deriving the same keys; a version
that derives them otherwise must say so by bumping KEY_VERSION, which starts pool folders cold
and moves L2 names (tests/e2e/test_warm_restart_formats.py, test_l2_daemon.py). The values are
keyed by KEY_VERSION, so a bump without this version's values fails here too, and they are
checked against docs/protocol.md section 8's formulas, computed here from hashlib alone."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import msgpack
import pytest

from tierd.protocol import keys
from tierd.protocol.keys import KEY_VERSION, namespace_id
from tierd.protocol.layout import Namespace
from tierd.state.tenants import scoped_namespace_id
from tierd.tier2.keys import FORMAT, chunk_key, object_name
from tierd_client.vllm_connector.keys import extend_keys

HERE = Path(__file__).resolve().parent
CHUNK = 16
TOKENS = list(range(1000, 1000 + 3 * CHUNK + 5))  # three full chunks and a tail (no key)
NAMESPACE = Namespace("org/model-1b", "aa251862e69e1d92", 2, "")
TENANT = "tenant-b"

# What KEY_VERSION N derives from the inputs above; hex digests, each PAGE hash list in chunk order.
GOLDEN = {
    1: {
        "page_hashes": [
            "d36775edd98ed1c81bc2e2312419ffc8",
            "82a12ed5265201cd4ac16273b34b629e",
            "77ae4068b8953f22e871397462e41ea8",
        ],
        "page_hashes_salt_lora_image": [
            "d9c0a3372bb187d0dd4a6af539f56130",
            "2665266380f279b2292bc1aebc609903",
            "1e9ab72d161b6a2d92749ff22a2bae2b",
        ],
        "namespace_id": "d6a943834cadaba7fd0a62649d5889d2",
        "tenant_namespace_id": "2a55dbbea123a1d2bec9f2b5f122fd0c",
    }
}
# The whole name of the first salted chunk's L2 object (tenant-scoped namespace, group 0, rank 1),
# keyed by the name format, which holds KEY_VERSION and the object layout's version too.
GOLDEN_L2_NAME = {
    "v3-k1-o2": "tierd/v3-k1-o2/2a55dbbea123a1d2bec9f2b5f122fd0cd9c0a3372bb187d0dd4a6af539f5613000000001"
}
# The layout fingerprint the connector derives for the engine of ``engine_geometry``.
GOLDEN_FINGERPRINT = {1: "aa251862e69e1d92"}

BUMP = (
    "A change to this derivation must bump tierd.protocol.keys.KEY_VERSION on purpose (pool "
    "folders then start cold and L2 names move) and record that version's values in "
    "tests/unit/test_key_formats.py; if the change was not meant, restore the derivation."
)


def golden(table: dict, version) -> dict | str:
    if version not in table:
        pytest.fail(
            f"no golden values for version {version!r} (recorded: {sorted(table)}): a version bump must "
            "come with its values, computed once with it and checked against docs/protocol.md section 8"
        )
    return table[version]


def request(salt=None, lora=None, images=()):
    """The attributes of a vLLM request that the connector's key derivation reads."""
    return NS(
        all_token_ids=TOKENS,
        prompt_token_ids=TOKENS,
        prompt_embeds=None,
        cache_salt=salt,
        lora_request=NS(lora_name=lora) if lora else None,
        mm_features=[NS(identifier=i, mm_position=NS(offset=o, length=n)) for i, o, n in images],
    )


def connector_keys(req) -> list[bytes]:
    """PAGE hashes as the connector's scheduler computes them: one chunk, then the rest."""
    keys: list[bytes] = []
    extend_keys(req, keys, 1, CHUNK)
    extend_keys(req, keys, 3, CHUNK)
    return keys


def derive() -> dict:
    """Every golden value of this process (no vLLM: the subprocesses import only this)."""
    salted = connector_keys(request("salt-1", "adapter-1", [("img-0", 20, 8)]))  # the image: chunk 1
    tenant_ns = scoped_namespace_id(TENANT, NAMESPACE)
    return {
        "page_hashes": [h.hex() for h in connector_keys(request())],
        "page_hashes_salt_lora_image": [h.hex() for h in salted],
        "namespace_id": namespace_id(NAMESPACE).hex(),
        "tenant_namespace_id": tenant_ns.hex(),
        "l2_name": object_name(chunk_key(tenant_ns, salted[0], 0, 1), "tierd"),
    }


@pytest.mark.parametrize("what", list(GOLDEN[1]))
def test_golden_keys(what):
    assert derive()[what] == golden(GOLDEN, KEY_VERSION)[what], f"{what}: {BUMP}"


def test_keys_of_another_key_version_never_coincide_with_these(monkeypatch):
    """The version is part of every digest, so two derivations never give one key two meanings:
    an engine of another version sharing a daemon, a pool folder or a store with this one never
    hits objects stored under this version's keys, even where its change left the inputs alone."""
    here = derive()
    monkeypatch.setattr(keys, "KEY_VERSION", KEY_VERSION + 1)
    monkeypatch.setattr(keys, "_NS_IDS", {})  # namespace ids are memoised per process
    other = derive()
    for what in ("page_hashes", "page_hashes_salt_lora_image"):
        assert not set(other[what]) & set(here[what]), what
    assert other["namespace_id"] != here["namespace_id"]
    assert other["tenant_namespace_id"] != here["tenant_namespace_id"]


def test_a_version_without_golden_values_fails_saying_so():
    with pytest.raises(pytest.fail.Exception, match=f"no golden values for version {KEY_VERSION + 1}"):
        golden(GOLDEN, KEY_VERSION + 1)


def test_golden_l2_object_name():
    assert derive()["l2_name"] == golden(GOLDEN_L2_NAME, FORMAT), (
        "L2 object names changed: a change to the name encoding must bump tierd.tier2.keys.NAME_VERSION, "
        f"a change to the keys in it KEY_VERSION. {BUMP}"
    )


def test_the_golden_values_are_what_the_documented_derivation_gives():
    """docs/protocol.md section 8, from hashlib and msgpack alone: the code and the document agree."""

    def d(*parts: bytes) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        for p in parts:
            h.update(len(p).to_bytes(8, "little") + p)
        return h.digest()

    def chain(root: bytes, extras: list) -> list[str]:
        out, h = [], root
        for i, extra in enumerate(extras):
            part = TOKENS[i * CHUNK : (i + 1) * CHUNK]
            tokens = b"".join(t.to_bytes(8, "little", signed=True) for t in part)
            h = d(h, b"" if extra is None else msgpack.packb(extra, use_bin_type=True), tokens)
            out.append(h.hex())
        return out

    want = golden(GOLDEN, KEY_VERSION)
    plain_root = d(b"tierd/page/v1", msgpack.packb(["", "", None], use_bin_type=True))
    salted_root = d(b"tierd/page/v1", msgpack.packb(["salt-1", "adapter-1", None], use_bin_type=True))
    assert chain(plain_root, [None] * 3) == want["page_hashes"]
    assert chain(salted_root, [None, ["img-0"], None]) == want["page_hashes_salt_lora_image"]
    ns = {"model": "org/model-1b", "fingerprint": "aa251862e69e1d92", "world_size": 2, "salt": ""}
    ns_id = d(b"tierd/ns/v1", msgpack.packb(ns, use_bin_type=True))
    assert ns_id.hex() == want["namespace_id"]
    scoped = hashlib.blake2b(TENANT.encode() + b"\0" + ns_id, digest_size=16, person=b"tierd/tenant/v1")
    assert scoped.hexdigest() == want["tenant_namespace_id"]
    assert scoped_namespace_id("", NAMESPACE) == ns_id  # the default tenant's ids are the plain ones


SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from test_key_formats import derive
print(json.dumps({"keys": derive(), "probe": hash("probe")}))
"""


def test_the_same_values_in_processes_of_other_hash_seeds():
    runs = []
    for seed in ("0", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(HERE)], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert runs[0]["probe"] != runs[1]["probe"]  # the processes really hashed strings differently
    assert runs[0]["keys"] == runs[1]["keys"] == derive(), BUMP


def engine_geometry():
    """The connector's geometry of a TP-2 engine with a full and a sliding-window group (real
    vLLM spec classes: the connector tells groups apart by their type)."""
    torch = pytest.importorskip("torch")
    interface = pytest.importorskip("vllm.v1.kv_cache_interface")
    from tierd_client.vllm_connector.geometry import build_geometry

    spec = dict(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    full, window = interface.FullAttentionSpec(**spec), interface.SlidingWindowSpec(**spec, sliding_window=64)
    kcc = NS(
        kv_cache_groups=[
            NS(kv_cache_spec=full, layer_names=["layers.0", "layers.2"]),
            NS(kv_cache_spec=window, layer_names=["layers.1", "layers.3"]),
        ],
        kv_cache_layout="LBNHC",
    )
    vllm_config = NS(
        parallel_config=NS(tensor_parallel_size=2, pipeline_parallel_size=1),
        model_config=NS(model="org/model-1b", dtype=torch.bfloat16),
        cache_config=NS(cache_dtype="auto"),
    )
    return build_geometry(vllm_config, kcc, 4 * CHUNK)


def test_golden_layout_fingerprint_and_namespace_of_an_engine():
    """The fingerprint is part of the namespace id, so of every key: it changes only when what
    decides a block's bytes changes (here vLLM's page size, 1024 bytes, is part of it)."""
    geo = engine_geometry()
    assert geo.fingerprint == golden(GOLDEN_FINGERPRINT, KEY_VERSION), f"layout fingerprint: {BUMP}"
    assert geo.namespace == NAMESPACE, BUMP
