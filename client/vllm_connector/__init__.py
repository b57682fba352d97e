"""TierdConnector for vLLM: ``kv_connector_module_path = "tierd_client.vllm_connector"``."""

from tierd_client.vllm_connector.connector import TierdConnector

__all__ = ["TierdConnector"]
