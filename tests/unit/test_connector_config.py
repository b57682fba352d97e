"""Connector settings: our keys, and LMCacheMPConnector's keys as aliases."""

import pytest

from tierd.protocol.sockets import default_socket
from tierd_client.vllm_connector.config import ConnectorConfig


def test_defaults_point_at_the_daemons_default_socket():
    cfg = ConnectorConfig.from_extra({})
    assert cfg.url == default_socket() and cfg.chunk_tokens is None and cfg.store_decode  # None: fitted


def test_lmcache_mp_keys_are_aliases():
    cfg = ConnectorConfig.from_extra(
        {
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": 6555,
            "lmcache.mp.mq_timeout": 7,
            "lmcache.chunk_size": 512,
        }
    )
    assert cfg.url == "tcp://127.0.0.1:6555" and cfg.timeout_s == 7 and cfg.chunk_tokens == 512
    assert ConnectorConfig.from_extra({"lmcache.mp.host": "localhost"}).url == "tcp://localhost:5555"
    assert ConnectorConfig.from_extra({"lmcache.mp.host": "ipc:///run/x.sock"}).url == "ipc:///run/x.sock"


def test_tierd_keys_win_over_aliases():
    cfg = ConnectorConfig.from_extra(
        {
            "tierd.url": "ipc:///a",
            "lmcache.mp.host": "tcp://b",
            "tierd.chunk_tokens": 128,
            "tierd.store_decode": "false",
        }
    )
    assert cfg.url == "ipc:///a" and cfg.chunk_tokens == 128 and not cfg.store_decode


def test_a_chunk_size_is_set_under_either_key_and_only_then():
    assert ConnectorConfig.from_extra({}).chunk_tokens is None
    assert ConnectorConfig.from_extra({"tierd.chunk_tokens": "256"}).chunk_tokens == 256
    assert ConnectorConfig.from_extra({"lmcache.chunk_size": 256}).chunk_tokens == 256
    with pytest.raises(ValueError, match="tierd.chunk_tokens must be >= 1"):
        ConnectorConfig.from_extra({"tierd.chunk_tokens": 0})


@pytest.mark.parametrize(
    "least, blocks, chunk",
    [
        (256, [16], 256),  # attention models: the default as it is
        (256, [16, 16], 256),
        (256, [80], 320),  # a GDN hybrid's 70 KiB state over 1 KiB/token attention
        (256, [544, 544], 544),  # blocks longer than the default: one block
        (256, [64, 96], 384),  # two sizes: a multiple of both (192), twice
        (1024, [544], 1088),
        (256, [256], 256),
    ],
)
def test_an_unset_chunk_size_is_the_least_whole_number_of_every_groups_blocks(least, blocks, chunk):
    from types import SimpleNamespace

    from tierd_client.vllm_connector.geometry import check_chunk_tokens, fit_chunk_tokens

    groups = [SimpleNamespace(block_tokens=b) for b in blocks]
    assert fit_chunk_tokens(least, groups) == chunk
    check_chunk_tokens(chunk, groups)  # what a set value must be: accepted


def test_gpu_order_defaults_to_host_and_refuses_anything_else():
    assert ConnectorConfig.from_extra({}).gpu_order == "host"
    assert ConnectorConfig.from_extra({"tierd.gpu_order": "device"}).gpu_order == "device"
    with pytest.raises(ValueError, match="tierd.gpu_order"):
        ConnectorConfig.from_extra({"tierd.gpu_order": "gpu"})
