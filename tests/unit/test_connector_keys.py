"""The connector's PAGE hashes: the same in every process whatever PYTHONHASHSEED is, and
distinct for whatever makes a prefix distinct (cache salt, LoRA adapter, multimodal items)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Not importorskip: the subprocesses below import this module and must not pay vLLM's import.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")

HERE = Path(__file__).resolve().parent
TOKENS = list(range(100, 100 + 600))

SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from test_connector_keys import keys_for
print(json.dumps({k: [h.hex() for h in v] for k, v in keys_for(lite=True).items()}))
"""


def lite_request(tokens, *, salt=None, lora=None, mm=None):
    """The attributes the key derivation reads, without importing vLLM (fast subprocesses)."""
    from types import SimpleNamespace as NS

    return NS(
        all_token_ids=list(tokens),
        cache_salt=salt,
        prompt_embeds=None,
        prompt_token_ids=list(tokens),
        lora_request=NS(lora_name=lora) if lora else None,
        mm_features=[NS(identifier=i, mm_position=NS(offset=o, length=n)) for i, o, n in mm or ()],
    )


def request(tokens, *, salt=None, lora=None, mm=None):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    kw = {}
    if lora:
        from vllm.lora.request import LoRARequest

        kw["lora_request"] = LoRARequest(lora_name=lora, lora_int_id=1, lora_path="/nonexistent")
    if mm:
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

        kw["mm_features"] = [
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=ident,
                mm_position=PlaceholderRange(offset=off, length=n),
            )
            for ident, off, n in mm
        ]
    return Request(
        request_id="r",
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        cache_salt=salt,
        **kw,
    )


def keys_for(lite: bool = False) -> dict[str, list[bytes]]:
    from tierd_client.vllm_connector.keys import extend_keys

    make = lite_request if lite else request
    out = {}
    for name, req in {
        "plain": make(TOKENS),
        "salt-a": make(TOKENS, salt="a"),
        "salt-b": make(TOKENS, salt="b"),
        "lora": make(TOKENS, lora="adapter-1"),
        "image-1": make(TOKENS, mm=[("img-1", 300, 50)]),
        "image-2": make(TOKENS, mm=[("img-2", 300, 50)]),
    }.items():
        keys: list[bytes] = []
        extend_keys(req, keys, 1, 256)
        extend_keys(req, keys, 2, 256)  # extended incrementally, as the scheduler does
        out[name] = keys
    return out


def test_keys_are_identical_across_processes_and_hash_seeds():
    runs = []
    for seed in ("0", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(HERE)], env=env, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert runs[0] == runs[1] == runs[2]
    # ...and equal to what the connector derives from vLLM's own Request objects here
    assert runs[0] == {k: [h.hex() for h in v] for k, v in keys_for().items()}


def test_keys_separate_salts_adapters_and_images():
    k = keys_for()
    assert len({tuple(v) for v in k.values()}) == len(k)  # every variant has its own first chunk chain
    # a multimodal item at tokens 300..349 changes chunk 1 only; chunk 0 is shared
    assert k["image-1"][0] == k["image-2"][0] == k["plain"][0]
    assert k["image-1"][1] != k["image-2"][1] != k["plain"][1]
    # salts and adapters change every chunk
    assert (
        k["salt-a"][0] != k["plain"][0] and k["salt-a"][0] != k["salt-b"][0] and k["lora"][0] != k["plain"][0]
    )
