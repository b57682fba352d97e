"""TierdConnector for vLLM."""
