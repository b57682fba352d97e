"""What the tenant tests share (tests/daemon/test_tenants.py and those built on it): one small
full-attention geometry, the namespace two tenants both name, and a token file of three tenants."""

from __future__ import annotations

from kv import GroupGeom
from util import chunk

GEOM = GroupGeom("full", layers=2, block_bytes=512, block_tokens=4)
NS_FP = "shared-fingerprint"
SPECS = [{"kind": "full", "block_tokens": 4, "window_tokens": 0}]


def ns(salt=""):
    return {"model": "test-model", "fingerprint": NS_FP, "world_size": 1, "salt": salt}


def store_body(ks, inst="r0", base=0):
    return {
        "instance": inst,
        "chunks": [chunk(k, range(base + 4 * i, base + 4 * i + 4)) for i, k in enumerate(ks)],
    }


def tokens_file(tmp_path, mode=0o600):
    """``TENANT TOKEN`` lines for alice, bob and admin, at ``mode``."""
    path = tmp_path / "tokens"
    path.write_text(
        "# tenant token\nalice alice-token-0123456789\nbob bob-token-0123456789ab\n"
        "admin admin-token-0123456789\n"
    )
    path.chmod(mode)
    return path
