"""``--l2-url mooncake://...``: every default, every parameter, and a ValueError naming each bad part."""

import socket

import pytest

from tierd.base.l2url import MooncakeUrl, parse_url, route_host


def test_defaults_follow_the_master_host():
    u = parse_url("mooncake://10.1.2.3")
    assert u == MooncakeUrl(master_host="10.1.2.3")
    assert (u.master_port, u.metadata, u.protocol, u.device) == (
        50051,
        "http://10.1.2.3:8080/metadata",
        "tcp",
        "",
    )
    assert (u.local_host, u.local_port, u.segment_gb, u.segment_bytes) == (None, None, 4.0, 4 << 30)
    assert (u.timeout_ms, u.setup_timeout_s, u.retry_s, u.fail_after, u.tenant, u.prefix) == (
        2000,
        30.0,
        5.0,
        3,
        "default",
        "tierd",
    )
    assert u.master_addr == "10.1.2.3:50051"
    assert u.local_hostname("10.9.9.9") == "10.9.9.9"


def test_every_parameter():
    u = parse_url(
        "mooncake://master.example:6000?metadata=etcd://e1:2379&protocol=rdma&device=mlx5_0,mlx5_1"
        "&local=10.0.0.7:13000&segment_gb=0.5&timeout_ms=250&setup_timeout_s=3&retry_s=0.5&fail_after=5"
        "&tenant=team-a&prefix=prod"
    )
    assert (u.master_host, u.master_port, u.metadata) == ("master.example", 6000, "etcd://e1:2379")
    assert (u.protocol, u.device, u.local_host, u.local_port) == ("rdma", "mlx5_0,mlx5_1", "10.0.0.7", 13000)
    assert (u.segment_bytes, u.timeout_ms, u.setup_timeout_s, u.retry_s, u.fail_after) == (
        1 << 29,
        250,
        3.0,
        0.5,
        5,
    )
    assert (u.tenant, u.prefix, u.local_hostname("10.0.0.7")) == ("team-a", "prod", "10.0.0.7:13000")


def test_ipv6_master_and_local():
    u = parse_url("mooncake://[fd00::1]:7000?local=[fd00::2]:13001")
    assert (u.master_host, u.master_port, u.master_addr) == ("fd00::1", 7000, "[fd00::1]:7000")
    assert u.metadata == "http://[fd00::1]:8080/metadata"
    assert (u.local_host, u.local_port, u.local_hostname("fd00::2")) == ("fd00::2", 13001, "[fd00::2]:13001")


def test_segment_zero_is_a_pure_client_and_p2p_metadata_is_accepted():
    u = parse_url("mooncake://m?segment_gb=0&metadata=P2PHANDSHAKE")
    assert (u.segment_bytes, u.metadata) == (0, "P2PHANDSHAKE")


def test_canonical_string_spells_every_parameter():
    text = str(parse_url("mooncake://m:1?local=h:2&timeout_ms=9"))
    assert text.startswith("mooncake://m:1?local=h:2&metadata=http://m:8080/metadata&protocol=tcp&")
    assert "timeout_ms=9" in text and "segment_gb=4.0" in text and "prefix=tierd" in text


@pytest.mark.parametrize(
    "url, part",
    [
        ("redis://m", "scheme 'redis'"),
        ("m:50051", "expected mooncake://"),
        ("mooncake://", "master ''"),
        ("mooncake://m:0", "master port '0'"),
        ("mooncake://m:99999", "master port '99999'"),
        ("mooncake://m:port", "master port 'port'"),
        ("mooncake://user@m", "master 'user@m'"),
        ("mooncake://m/path", "nothing may follow"),
        ("mooncake://[fd00::1", "unbalanced"),
        ("mooncake://m?protocol=udp", "protocol='udp'"),
        ("mooncake://m?metadata=m:2379", "metadata='m:2379'"),
        ("mooncake://m?segment_gb=-1", "segment_gb='-1'"),
        ("mooncake://m?segment_gb=lots", "segment_gb='lots': not a number"),
        ("mooncake://m?segment_gb=nan", "segment_gb='nan'"),
        ("mooncake://m?timeout_ms=0", "timeout_ms='0'"),
        ("mooncake://m?timeout_ms=1.5", "timeout_ms='1.5': not an integer"),
        ("mooncake://m?fail_after=0", "fail_after='0'"),
        ("mooncake://m?retry_s=0", "retry_s='0'"),
        ("mooncake://m?local=h:0", "local port '0'"),
        ("mooncake://m?local=", "local ''"),
        ("mooncake://m?tenant=", "tenant= is empty"),
        ("mooncake://m?prefix=a%20b", "prefix='a b'"),
        ("mooncake://m?segment=4", "parameter 'segment' unknown"),
        ("mooncake://m?timeout_ms=1&timeout_ms=2", "'timeout_ms' given twice"),
        ("mooncake://m?novalue", "bad query field"),
    ],
)
def test_bad_urls_name_the_bad_part(url, part):
    with pytest.raises(ValueError, match=None) as e:
        parse_url(url)
    assert part in str(e.value), str(e.value)


def test_route_host_is_the_address_that_reaches_the_master():
    assert route_host("127.0.0.1", 50051) == "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # any local address routes to itself
        s.connect(("127.0.0.2", 9))
        assert route_host("127.0.0.2", 9) == s.getsockname()[0]
