"""Connector settings: our keys, and LMCacheMPConnector's keys as aliases."""

import pytest

from tierd.protocol.sockets import default_socket
from tierd_client.vllm_connector.config import ConnectorConfig


def test_defaults_point_at_the_daemons_default_socket():
    cfg = ConnectorConfig.from_extra({})
    assert cfg.url == default_socket() and cfg.chunk_tokens == 256 and cfg.store_decode


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


def test_gpu_order_defaults_to_host_and_refuses_anything_else():
    assert ConnectorConfig.from_extra({}).gpu_order == "host"
    assert ConnectorConfig.from_extra({"tierd.gpu_order": "device"}).gpu_order == "device"
    with pytest.raises(ValueError, match="tierd.gpu_order"):
        ConnectorConfig.from_extra({"tierd.gpu_order": "gpu"})
