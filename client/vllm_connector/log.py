"""The connector's logging, routed through vLLM's.

vLLM configures one logger, ``vllm``, with its handler and format ("(EngineCore pid=..) INFO
date [file:line] msg") and ``propagate=False`` (when an engine starts, not at import). A logger
outside that tree gets none of it: its INFO lines vanish and its warnings reach Python's
last-resort handler as bare lines. The connector's loggers live under ``tierd_client`` (the
client library logs there too, also without vLLM), so ``tierd_client`` gets one handler that
hands each record to the ``vllm`` logger at emit time, filtered by that logger's level: lines
look and filter exactly like vLLM's own, whenever and however vLLM's logging is (re)configured
(VLLM_CONFIGURE_LOGGING=0 included: then both go wherever the user's root logging sends them).
A ``tierd_client`` logger that already has handlers of its own is left alone.
"""

from __future__ import annotations

import logging

from vllm.logger import init_logger

_ROOT = "tierd_client"


class _ToVllm(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        vllm = logging.getLogger("vllm")
        if record.levelno >= vllm.getEffectiveLevel():
            vllm.handle(record)


def get_logger(name: str):
    """A vLLM logger (``info_once`` etc.) named ``name``, under ``tierd_client``."""
    route_to_vllm()
    return init_logger(name)


def route_to_vllm() -> None:
    ours = logging.getLogger(_ROOT)
    if ours.handlers:
        return  # routed already, or configured by the user
    ours.addHandler(_ToVllm())
    ours.setLevel(logging.DEBUG)  # the handler filters by vLLM's level
    ours.propagate = False
