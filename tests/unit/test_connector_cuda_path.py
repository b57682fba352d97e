"""How a GPU rank's blocks are copied (``tierd.cuda_path``) and the KV layout the connector asks
vLLM for (``tierd.kv_layout``), as pure logic over vLLM 0.33's [B, H, N, C] views of each
physical order: a block-outermost layout goes direct (one DMA per block, no SM work), the others
through staging; an explicit direct the copy engines cannot move is refused at registration."""

from types import SimpleNamespace

import pytest
import torch

from tierd.protocol.layout import GroupLayout
from tierd_client.layouts import block_span, group
from tierd_client.vllm_connector.config import KV_LAYOUTS, ConnectorConfig
from tierd_client.vllm_connector.registration import cuda_path

LAYERS, BLOCKS, HEADS, TOKENS, CH = 3, 10, 2, 4, 128


def rank_layout(kind: str):
    """The layout a rank of physical order ``kind`` publishes over one flat buffer, and that buffer."""
    dims = {"L": LAYERS, "B": BLOCKS, "H": HEADS, "N": TOKENS, "C": CH}
    strides, acc = {}, 1
    for ch in reversed(kind):
        strides[ch] = acc
        acc *= dims[ch]
    shape, st = tuple(dims[ch] for ch in "BHNC"), tuple(strides[ch] for ch in "BHNC")
    spans = [block_span(shape, st, 1, 0, tensor=0, offset=i * strides["L"]) for i in range(LAYERS)]
    return SimpleNamespace(groups=[GroupLayout.from_wire(group("full", TOKENS, spans))]), [
        torch.zeros(acc, dtype=torch.uint8)
    ]


@pytest.mark.parametrize(
    "kind, auto",
    [
        ("BLNHC", "direct"),  # a block's layers one span: one DMA per block
        ("BLHNC", "direct"),
        ("LBNHC", "staged"),  # layer-outermost: a pitched copy per block, slower than staging
        ("LBHNC", "staged"),
        ("LHBNC", "staged"),  # a run per head: not movable by the copy engines
        ("BHLNC", "staged"),
    ],
)
def test_auto_goes_direct_exactly_where_a_blocks_layers_are_one_span(kind, auto):
    layout, flats = rank_layout(kind)
    assert cuda_path("auto", layout, flats) == auto
    assert cuda_path("staged", layout, flats) == "staged"


def test_direct_takes_a_pitched_layer_outermost_layout_and_refuses_what_it_cannot_move():
    assert cuda_path("direct", *rank_layout("LBNHC")) == "direct"
    with pytest.raises(ValueError, match="tierd.cuda_path=direct"):
        cuda_path("direct", *rank_layout("LHBNC"))


def test_the_layout_asked_of_vllm():
    auto = ConnectorConfig.from_extra({})
    assert (auto.cuda_path, auto.kv_layout) == ("auto", "auto")
    assert auto.required_layout("cuda") == "BLNHC"
    assert auto.required_layout("cpu") is None  # the CPU backend reads LBHNC only
    assert ConnectorConfig.from_extra({"tierd.cuda_path": "staged"}).required_layout("cuda") is None
    assert ConnectorConfig.from_extra({"tierd.kv_layout": "engine"}).required_layout("cuda") is None
    for name in KV_LAYOUTS:
        assert ConnectorConfig.from_extra({"tierd.kv_layout": name}).required_layout("cpu") == name


@pytest.mark.parametrize(
    "key, value", [("tierd.cuda_path", "dma"), ("tierd.kv_layout", "NHD"), ("tierd.kv_layout", "blnhc")]
)
def test_bad_path_or_layout_names_are_refused(key, value):
    with pytest.raises(ValueError, match=key):
        ConnectorConfig.from_extra({key: value})


def test_vllm_resolves_the_connectors_layout_through_its_own_call(tiny_model):
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.utils import get_kv_connector_cache_layout
    from vllm_sim import make_vllm_config

    vc = make_vllm_config(tiny_model, "ipc:///nowhere", 16, 64)  # a CPU engine: none asked
    assert get_kv_connector_cache_layout(vc) is None
    vc = make_vllm_config(tiny_model, "ipc:///nowhere", 16, 64, extra={"tierd.kv_layout": "BLHNC"})
    assert get_kv_connector_cache_layout(vc) == "BLHNC"
