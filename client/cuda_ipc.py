"""Publishing CUDA tensors to the daemon over CUDA IPC, and the store fence.

``share_cuda_tensors`` turns the engine's KV tensors into REGISTER tensor refs
``{"handle": {"kind": "cuda_ipc", "device_uuid": ..., "ipc": [...]}, "nbytes": ...}``: the eight
fields of torch's ``untyped_storage()._share_cuda_()`` (msgpack-safe: ints, bytes, a bool) plus
the GPU's UUID, so the daemon opens the memory on the same physical GPU whatever its
CUDA_VISIBLE_DEVICES. Offsets in the layout's spans are relative to the start of the storage.

The engine keeps its tensors (and the ``StoreFence``'s event) alive while registered; torch's
IPC reference counting (a small file in /dev/shm) keeps freed blocks from being reused while the
daemon still maps them. Engine and daemon must share /dev/shm (on Kubernetes: hostIPC).
"""

from __future__ import annotations


def device_uuid(device) -> str:
    import torch

    return str(torch.cuda.get_device_properties(device).uuid)


def share_cuda_tensors(tensors) -> tuple[list[dict], list[tuple[int, int]]]:
    """REGISTER refs for the distinct storages of ``tensors`` (CUDA), like ``shm.share_torch_tensors``.

    Returns ``(refs, where)`` with ``where[i] = (ref index, byte offset of tensors[i]'s first
    element in that storage)``; views over one buffer share one ref.
    """
    refs: list[dict] = []
    by_storage: dict[int, int] = {}
    where = []
    for t in tensors:
        if t.device.type != "cuda":
            raise ValueError(f"share_cuda_tensors takes CUDA tensors, got one on {t.device}")
        storage = t.untyped_storage()
        base = storage.data_ptr()
        if base not in by_storage:
            dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = storage._share_cuda_()
            by_storage[base] = len(refs)
            refs.append(
                {
                    "handle": {
                        "kind": "cuda_ipc",
                        "device_uuid": device_uuid(t.device),
                        "ipc": [
                            int(dev),
                            bytes(handle),
                            int(size),
                            int(offset),
                            bytes(rc_handle),
                            int(rc_offset),
                            bytes(ev_handle),
                            bool(ev_sync),
                        ],
                    },
                    "nbytes": storage.nbytes(),
                }
            )
        where.append((by_storage[base], t.data_ptr() - base))
    return refs, where


class StoreFence:
    """One interprocess event per engine stream: ``mark()`` records it where the KV writes a STORE
    reads are enqueued and returns the 64-byte handle for the STORE's ``event`` field. The
    daemon's gather then waits for it on the GPU (no host sync on either side). Keep the fence
    alive while the daemon may still wait on it."""

    def __init__(self, device=None):
        import torch

        self.event = torch.cuda.Event(interprocess=True)
        self.device = device
        self._handle: bytes | None = None

    def mark(self, stream=None) -> bytes:
        import torch

        self.event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        if self._handle is None:
            self._handle = bytes(self.event.ipc_handle())
        return self._handle


def store_event_recorder(device=None):
    """A callable that records the fence on ``device``'s current stream and returns its handle
    (what the vLLM worker passes as STORE's ``event``)."""
    return StoreFence(device).mark
