"""Publishing one rank's page layout to the daemon (REGISTER), without ever stalling the engine.

``publish`` describes the rank's KV tensors (CPU: moved into unnamed shared memory, named in
/dev/shm only while a REGISTER is in flight, see ``tierd_client.shm``; CUDA: IPC handles) and
waits at most ``tierd.connect_timeout_s`` (default 1 s) for the REGISTER to be accepted. It logs
once which daemon the rank uses and whether it registered. A rank not registered by then runs
without the tier; ``ready()`` (called by the steps that have loads or stores to do) re-sends the
REGISTER every ``tierd.register_retry_s`` (default 5 s) and logs once when the tier turns on. A
daemon that restarts later is handled by the client (it re-REGISTERs with the same publication).
"""

from __future__ import annotations

import time

from tierd_client.layouts import block_span, group as group_desc, layout as layout_desc
from tierd_client.vllm_connector.log import get_logger

log = get_logger("tierd_client.vllm_connector")


class RankRegistration:
    def __init__(self, cfg, geo, client, instance: str, num_blocks: int):
        self.cfg = cfg
        self.geo = geo
        self.client = client
        self.instance = instance
        self.num_blocks = num_blocks
        self.rank = 0
        self.layout: dict | None = None
        self.publication = None  # CPU: /dev/shm names of the KV memory, present only while a REGISTER is in flight
        self.registered = False
        self._future = None
        self._sent_at = 0.0
        self._said_down = False  # this rank logged that it runs without the tier

    def publish(self, kv_caches: dict, rank: int):
        """Describe and REGISTER the rank's KV tensors; returns the CUDA store-event recorder (or None)."""
        named = [(g, [kv_caches[n] for n in g.layer_names if n in kv_caches]) for g in self.geo.groups]
        tensors = [t for _, ts in named for t in ts]
        if not tensors:
            raise ValueError("register_kv_caches got none of the layers in the KV cache config")
        device, recorder = tensors[0].device.type, None
        if device == "cpu":
            from tierd_client.shm import share_torch_tensors

            refs, where, self.publication = share_torch_tensors(tensors)
        elif device == "cuda":
            from tierd_client.cuda_ipc import share_cuda_tensors, store_event_recorder

            refs, where = share_cuda_tensors(tensors)
            recorder = store_event_recorder(tensors[0].device)
        else:
            raise ValueError(f"TierdConnector supports cpu and cuda KV caches, not {device}")
        groups, i = [], 0
        for g, ts in named:
            spans = []
            for t in ts:
                ref, offset = where[i]
                i += 1
                if t.shape[0] % self.num_blocks:
                    raise ValueError(f"layer tensor with {t.shape[0]} blocks is not a multiple of {self.num_blocks}")
                spans.append(block_span(tuple(t.shape), tuple(t.stride()), t.element_size(), 0, tensor=ref,
                                        offset=offset, blocks_per_block=t.shape[0] // self.num_blocks))
            groups.append(group_desc(g.kind.value, g.block_tokens, spans, window_tokens=g.window_tokens,
                                     dtype=str(ts[0].dtype) if ts else ""))
        self.layout = layout_desc(self.geo.namespace, rank, self.geo.chunk_tokens, refs, groups,
                                  device=device, replicated=self.geo.replicated)
        self.rank = rank
        self.ready(wait_s=self.cfg.connect_timeout_s)
        return recorder

    def ready(self, wait_s: float = 0.0) -> bool:
        """Registered yet? Sends a REGISTER if none is in flight and the retry pause has passed,
        and waits for its answer at most ``wait_s``."""
        if self.registered or self.layout is None:
            return self.registered
        fut = self._future
        if fut is None:
            if time.monotonic() - self._sent_at < self.cfg.register_retry_s and not wait_s:
                return False
            self._sent_at = time.monotonic()
            fut = self._future = self.client.register_async(self.instance, self.layout, self.cfg.timeout_s,
                                                            publish=self.publication)
        if wait_s:
            try:
                fut.result(timeout=wait_s)
            except Exception:  # noqa: BLE001 - a timeout or a refusal, reported below
                pass
        if not fut.done():
            self._say_down(f"no answer from a tierd within {self.cfg.connect_timeout_s:g} s "
                           "(is `tierd serve` running, and is tierd.url its --socket?)")
            return False
        self._future = None
        exc = fut.exception()
        if exc is not None:
            self._say_down(str(exc))
            return False
        self.registered = True
        log.info("tierd: rank %d registered with %s as %s (chunks of %d tokens, groups %s): the tier is on",
                 self.rank, self.client.url, self.instance, self.geo.chunk_tokens, [g.kind.value for g in self.geo.groups])
        return True

    def _say_down(self, why: str) -> None:
        if not self._said_down:
            self._said_down = True
            log.warning("tierd: rank %d runs without the tier for now: %s at %s; registering again every %g s",
                        self.rank, why, self.client.url, self.cfg.register_retry_s)

    def leave(self) -> None:
        """UNREGISTER (bounded), for daemons that do not know BYE."""
        if self.registered:
            self.registered = False
            try:
                self.client.unregister(self.instance, timeout=0.5)
            except Exception:  # noqa: BLE001 - BYE or the heartbeat timeout reaps us anyway
                pass
