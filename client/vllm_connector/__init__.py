"""TierdConnector for vLLM: ``kv_connector_module_path = "tierd_client.vllm_connector"``.

The class is imported on first access (vLLM's factory does ``getattr(module, "TierdConnector")``),
so the vLLM-free parts of this package import without vLLM.
"""

__all__ = ["TierdConnector"]


def __getattr__(name: str):
    if name == "TierdConnector":
        from tierd_client.vllm_connector.connector import TierdConnector

        return TierdConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
