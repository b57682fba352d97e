"""The tiny test model: the shape the vLLM tests rely on, the same bytes every build, safe under
racing builders."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_model import MARKER, RECIPE, build_tiny_llama

HERE = Path(__file__).resolve().parents[1]  # tests/


def _digests(folder: str | Path) -> dict:
    return json.loads((Path(folder) / MARKER).read_text())["sha256"]


def test_shape_fits_4k_prompts(tiny_model):
    cfg = json.loads((Path(tiny_model) / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 8192
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]) == (2, 256, 4)
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]) == (2, 64, 1024)
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model)
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    assert len(tok) <= cfg["vocab_size"]


def test_every_build_gives_the_same_bytes(tiny_model, tmp_path):
    again = build_tiny_llama(tmp_path / "again")
    assert _digests(again) == _digests(tiny_model)
    assert build_tiny_llama(again) == again  # built once: a second call only checks the marker


def test_racing_builders_leave_one_complete_folder(tiny_model, tmp_path):
    target = tmp_path / "raced"
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "tiny_model.py"), str(target)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=240)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert set(outs) == {str(target)}
    assert _digests(target) == _digests(tiny_model)
    assert json.loads((target / MARKER).read_text())["recipe"] == RECIPE
    leftovers = [
        p.name for p in tmp_path.iterdir() if p.name.startswith(".raced.") and not p.name.endswith(".lock")
    ]
    assert leftovers == []  # no temporary folders left behind
