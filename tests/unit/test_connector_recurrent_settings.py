"""The vLLM settings the connector makes or asks for when a model has a recurrent-state group
(``recurrent``): the retention interval that keeps a state at every chunk, and the start-up line
about prefill steps that run over chunk boundaries."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from tierd.protocol.layout import GroupKind  # noqa: E402
from tierd_client.vllm_connector.geometry import EngineGeometry, Group  # noqa: E402
from tierd_client.vllm_connector.recurrent import (  # noqa: E402
    keep_states_at_chunks,
    retention_interval,
    step_warning,
)


@pytest.mark.parametrize(
    "current,wanted",
    [(None, None), (0, 256), (256, 256), (128, 128), (64, 64), (512, 256), (384, 128), (768, 256)],
)
def test_retention_keeps_what_vllm_keeps_and_every_chunk(current, wanted):
    assert retention_interval(current, 256) == wanted


def geo(*kinds: GroupKind, chunk: int = 256) -> EngineGeometry:
    groups = tuple(Group(i, k, 64, 0, "spec", ("l",), 1024, False) for i, k in enumerate(kinds))
    return EngineGeometry(groups, chunk, "m", 1, "f")


def vllm_config(batched: int, retention: int | None = 0):
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=batched, max_num_scheduled_tokens=None),
        cache_config=SimpleNamespace(prefix_cache_retention_interval=retention),
    )


def test_the_retention_is_set_on_the_kv_cache_config_and_the_cache_config():
    vc, kcc = vllm_config(256), SimpleNamespace(prefix_cache_retention_interval=0)
    assert keep_states_at_chunks(vc, kcc, geo(GroupKind.STATE, GroupKind.FULL)) == 256
    assert kcc.prefix_cache_retention_interval == vc.cache_config.prefix_cache_retention_interval == 256
    # set already, dense, or no recurrent group: left alone
    assert keep_states_at_chunks(vc, kcc, geo(GroupKind.STATE, GroupKind.FULL)) is None
    dense = SimpleNamespace(prefix_cache_retention_interval=None)
    assert (
        keep_states_at_chunks(vc, dense, geo(GroupKind.STATE)) is None
        and dense.prefix_cache_retention_interval is None
    )
    attention = SimpleNamespace(prefix_cache_retention_interval=0)
    assert keep_states_at_chunks(vc, attention, geo(GroupKind.SLIDING, GroupKind.FULL)) is None
    assert attention.prefix_cache_retention_interval == 0


def test_steps_over_a_chunk_are_named_with_the_setting_that_stops_them():
    line = step_warning(vllm_config(4096), geo(GroupKind.STATE, GroupKind.FULL))
    assert "4096" in line and "--max-num-batched-tokens 256" in line
    assert step_warning(vllm_config(256), geo(GroupKind.STATE, GroupKind.FULL)) is None
    assert step_warning(vllm_config(4096), geo(GroupKind.FULL)) is None
