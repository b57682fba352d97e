"""A KV connector whose hooks do nothing: the control for a tier's per-step cost and exactness.

vLLM schedules differently once any KV connector is configured (greedy outputs of a server with this
connector differ from a server without one, and decode steps cost more), so a tier's serving figures
and token ids are compared with a server running this class, not with one running no connector.

    --kv-transfer-config '{"kv_connector": "NothingConnector",
                           "kv_connector_module_path": "nothing_connector", "kv_role": "kv_both"}'

(with this folder on PYTHONPATH)."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)

KV_TRANSFER_CONFIG = {
    "kv_connector": "NothingConnector",
    "kv_connector_module_path": "nothing_connector",
    "kv_role": "kv_both",
}


class _NoMetadata(KVConnectorMetadata):
    pass


class NothingConnector(KVConnectorBase_V1, SupportsHMA):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return _NoMetadata()

    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass

    def request_finished_all_groups(self, request, block_ids):
        return False, None
