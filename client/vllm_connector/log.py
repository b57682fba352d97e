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

from tierd.protocol.versions import (
    KEY_VERSION,
    TIERD_VERSION,
    vllm_in_tested_range,
    vllm_installed,
    vllm_tested,
)

_ROOT = "tierd_client"


class _ToVllm(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        vllm = logging.getLogger("vllm")
        if record.levelno >= vllm.getEffectiveLevel():
            vllm.handle(record)


def versions_line(vllm_version: str, tested: str | None) -> tuple[int, str]:
    """(level, text) of the connector's first line: tierd's, the key format's and vLLM's versions,
    and the vLLM releases tierd is tested with; a warning when this vLLM is not one of them."""
    text = f"tierd {TIERD_VERSION} (key format {KEY_VERSION}) on vLLM {vllm_version}"
    if not tested:
        return (
            logging.INFO,
            text + "; tested vLLM range unknown (tierd runs from a source tree, not installed)",
        )
    if vllm_in_tested_range(vllm_version, tested) is False:
        return logging.WARNING, text + f", which tierd is not tested with (tested: vLLM {tested})"
    return logging.INFO, text + f"; tierd is tested with vLLM {tested}"


def say_versions(log: logging.Logger, role: str) -> None:
    """Log ``versions_line`` for the running vLLM, prefixed with the connector's role."""
    import vllm

    running = getattr(vllm, "__version__", None) or vllm_installed() or "unknown"
    level, text = versions_line(running, vllm_tested())
    log.log(level, "TierdConnector (%s): %s", role, text)


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
