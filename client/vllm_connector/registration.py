"""Publishing one rank's page layout to the daemon (REGISTER), without ever stalling the engine.

``publish`` describes the rank's KV tensors (CPU: moved into unnamed shared memory, named in
/dev/shm only while a REGISTER is in flight, see ``tierd_client.shm``; CUDA: IPC handles, and a
staging buffer on the rank's GPU, ``tierd_client.cuda_stage.Stager``, which the engine gathers
stores into and scatters loads out of in its own context: the daemon opens only that buffer and
DMAs whole objects through it, never launching a kernel on the engine's GPU) and waits at most
``tierd.connect_timeout_s`` (default 1 s) for the REGISTER to be accepted. It logs
once which daemon the rank uses and whether it registered. A rank not registered by then runs
without the tier; ``ready()`` (called by the steps that have loads or stores to do) re-sends the
REGISTER every ``tierd.register_retry_s`` (default 5 s) and logs once when the tier turns on. A
daemon that restarts later is handled by the client (it re-REGISTERs with the same publication).
"""

from __future__ import annotations

import time

from tierd.protocol.errors import ProtocolError
from tierd.protocol.layout import PageLayout
from tierd_client.cuda_ipc import share_cuda_tensors
from tierd_client.cuda_stage import Stager
from tierd_client.direct_rank import direct_layout
from tierd_client.layouts import block_span
from tierd_client.layouts import group as group_desc
from tierd_client.layouts import layout as layout_desc
from tierd_client.shm import share_torch_tensors
from tierd_client.vllm_connector.config import STAGING_AUTO_CAP_MB, STAGING_AUTO_CHUNKS
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
        self.layout: PageLayout | None = None
        self.publication = None  # CPU: /dev/shm names of the KV memory, only while a REGISTER is in flight
        self.stager = None  # CUDA, staged: the rank's staging buffer and copy streams
        self.direct = None  # CUDA, direct: the rank's GPU (the daemon copies straight to its blocks)
        self.chunk_bytes = 0  # CUDA: a chunk's bytes on this rank (PageLayout.chunk_bytes)
        self.registered = False
        self._future = None
        self._sent_at = 0.0
        self._said_down = False  # this rank logged that it runs without the tier

    def publish(self, kv_caches: dict, rank: int) -> None:
        """Describe and REGISTER the rank's KV tensors. A CUDA rank is then either staged
        (``stager``) or direct (``direct``: its GPU), as ``tierd.cuda_path`` and its layout decide."""
        named = [(g, [kv_caches[n] for n in g.layer_names if n in kv_caches]) for g in self.geo.groups]
        tensors = [t for _, ts in named for t in ts]
        if not tensors:
            raise ValueError("register_kv_caches got none of the layers in the KV cache config")
        device = tensors[0].device.type
        if device == "cpu":
            refs, where, self.publication = share_torch_tensors(tensors)
        elif device == "cuda":
            devices = sorted({str(t.device) for t in tensors})
            if len(devices) > 1:
                raise ValueError(f"a rank's KV tensors lie on one GPU, got {devices}")
            # what the engine queued on its KV (vLLM's zero fill of it) completes before the daemon
            # can touch it: the daemon's copies also wait for the sharing event on the GPU, but an
            # engine that died before its own queued work ran must not leave them waiting for it
            import torch

            torch.cuda.synchronize(tensors[0].device)
            refs, where = share_cuda_tensors(tensors)
        else:
            raise ValueError(f"TierdConnector supports cpu and cuda KV caches, not {device}")
        groups, i = [], 0
        for g, ts in named:
            spans = []
            for t in ts:
                ref, offset = where[i]
                i += 1
                if t.shape[0] % self.num_blocks:
                    raise ValueError(
                        f"layer tensor with {t.shape[0]} blocks is not a multiple of {self.num_blocks}"
                    )
                spans.append(
                    block_span(
                        tuple(t.shape),
                        tuple(t.stride()),
                        t.element_size(),
                        0,
                        tensor=ref,
                        offset=offset,
                        blocks_per_block=t.shape[0] // self.num_blocks,
                    )
                )
            groups.append(
                group_desc(
                    g.kind.value,
                    g.block_tokens,
                    spans,
                    window_tokens=g.window_tokens,
                    dtype=str(ts[0].dtype) if ts else "",
                )
            )
        desc = layout_desc(
            self.geo.namespace,
            rank,
            self.geo.chunk_tokens,
            refs,
            groups,
            device=device,
            replicated=self.geo.replicated,
        )
        self.rank = rank
        if device == "cuda":
            layout, flats = PageLayout.from_wire(desc), _flats(tensors, where)
            self.chunk_bytes = layout.chunk_bytes
            if cuda_path(self.cfg.cuda_path, layout, flats) == "direct":
                self.direct = tensors[0].device
                log.info(
                    "tierd: rank %d is copied straight between its KV blocks and the pool (no staging)",
                    rank,
                )
            else:
                self.stager = self._stager(layout, flats, tensors[0].device)
                desc["staging"] = self.stager.ref
        try:  # what REGISTER sends, typed: checked here as the daemon checks it
            self.layout = PageLayout.from_wire(desc, "layout")
        except ProtocolError as exc:
            self._say_down(f"its layout is not one tierd takes ({exc})")
            return
        self.ready(wait_s=self.cfg.connect_timeout_s)

    def _stager(self, layout, flats: list, device):
        """The rank's Stager over ``flats`` (each distinct storage of its KV tensors as one flat uint8
        tensor: the layout's spans are offsets into them), with ``staging_bytes`` of staging."""
        size = staging_bytes(self.cfg.staging_mb, layout.chunk_bytes)
        stager = Stager(layout, flats, size)
        log.info(
            "tierd: rank %d stages its copies through %.1f MiB on %s (%d chunks each way)",
            self.rank,
            size / 2**20,
            device,
            size // 2 // layout.chunk_bytes,
        )
        return stager

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
            fut = self._future = self.client.register_async(
                self.instance, self.layout, self.cfg.timeout_s, publish=self.publication
            )
        if wait_s:
            try:
                fut.result(timeout=wait_s)
            except Exception:  # noqa: BLE001 - a timeout or a refusal, reported below
                pass
        if not fut.done():
            self._say_down(
                f"no answer from a tierd within {self.cfg.connect_timeout_s:g} s "
                "(is `tierd serve` running, and is tierd.url its --socket?)"
            )
            return False
        self._future = None
        exc = fut.exception()
        if exc is not None:
            self._say_down(str(exc))
            return False
        self.registered = True
        log.info(
            "tierd: rank %d registered with %s as %s (chunks of %d tokens, groups %s): the tier is on",
            self.rank,
            self.client.url,
            self.instance,
            self.geo.chunk_tokens,
            [g.kind.value for g in self.geo.groups],
        )
        return True

    def _say_down(self, why: str) -> None:
        if not self._said_down:
            self._said_down = True
            log.warning(
                "tierd: rank %d runs without the tier for now: %s at %s; registering again every %g s",
                self.rank,
                why,
                self.client.url,
                self.cfg.register_retry_s,
            )

    def leave(self) -> None:
        """UNREGISTER (bounded) on a clean stop. Not once the client is leaving in a hurry (a
        signal queued its BYE, which drops this rank, and the scheduler side's UNREGISTER names it)."""
        if self.registered:
            self.registered = False
            if self.client.leaving:
                return
            try:
                self.client.unregister(self.instance, timeout=0.5)
            except Exception:  # noqa: BLE001 - BYE or the heartbeat timeout reaps us anyway
                pass


def _flats(tensors, where) -> list:
    """Each distinct storage of ``tensors`` (``where``: each tensor's (storage index, offset), as
    the layout names them) as one flat uint8 tensor, in storage index order."""
    import torch

    flats: dict[int, object] = {}
    for t, (ref, _) in zip(tensors, where):
        if ref not in flats:
            st = t.untyped_storage()
            flat = torch.empty(0, dtype=torch.uint8, device=t.device)
            flats[ref] = flat.set_(st, 0, (st.nbytes(),), (1,))
    return [flats[i] for i in range(len(flats))]


def cuda_path(choice: str, layout, flats: list) -> str:
    """ "direct" or "staged" for a CUDA rank of ``layout`` (a PageLayout over ``flats``), as
    ``tierd.cuda_path`` ``choice`` asks (ConnectorConfig.cuda_path): auto takes direct where every
    group keeps a block's layers in one span; direct where the copy engines cannot move the
    layout is a ValueError."""
    if choice == "staged":
        return "staged"
    movable = direct_layout(layout, flats)
    if choice == "direct":
        if not movable:
            raise ValueError(
                "tierd.cuda_path=direct: the copy engines cannot move this KV layout (a group's layers "
                "in more than one tensor, or not a constant pitch apart); use auto or staged"
            )
        return "direct"
    return "direct" if movable and all(g.block_major for g in layout.groups) else "staged"


def staging_bytes(staging_mb: float, chunk: int) -> int:
    """Size of a CUDA rank's staging buffer: two equal halves (stores, loads) of whole chunks.
    ``staging_mb`` > 0: that many MiB, rounded down to whole chunks each way; 0: each way
    STAGING_AUTO_CHUNKS chunks, at most STAGING_AUTO_CAP_MB MiB. Never less than a chunk each way."""
    if staging_mb > 0:
        each = int(staging_mb * 2**20) // 2 // chunk
    else:
        each = min(STAGING_AUTO_CHUNKS, (STAGING_AUTO_CAP_MB << 20) // chunk)
    return 2 * max(1, each) * chunk
