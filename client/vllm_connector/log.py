"""The connector's logging, routed through vLLM's.

vLLM configures one logger, ``vllm``, with its handler and format ("(EngineCore pid=..) INFO
date [file:line] msg") and ``propagate=False``; a logger outside that tree has no handler, so
its INFO lines vanish and its warnings reach Python's last-resort handler as bare lines. The
connector's loggers live under ``tierd_client`` (the client library logs there too, also
without vLLM), so when vLLM has configured logging, ``tierd_client`` is given the ``vllm``
logger's handlers and level. A process whose logging the user configured (VLLM_CONFIGURE_LOGGING=0,
or handlers of its own on ``tierd_client``) is left alone.
"""

from __future__ import annotations

import logging

from vllm.logger import init_logger

_ROOT = "tierd_client"


def get_logger(name: str):
    """A vLLM logger (``info_once`` etc.) named ``name``, under ``tierd_client``."""
    adopt_vllm_handlers()
    return init_logger(name)


def adopt_vllm_handlers() -> None:
    ours, theirs = logging.getLogger(_ROOT), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False
