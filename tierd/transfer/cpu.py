"""CPU data path: the engine's KV tensors live in shared-memory files; the daemon copies blocks
between them and its pool on the rank's transfer thread (GIL released): memcpy over a mapping of
the file, guarded against SIGBUS (tierd.transfer.mapcopy), or preadv/pwritev where that guard
cannot be built (no C compiler) or is not the process's SIGBUS handler any more.

Hazards: the file belongs to the client, which can truncate it at any time. A bare mapping of a
truncated file raises SIGBUS in the daemon at the next copy and every client loses every object:
the guarded copy stops at the range that faulted instead. A read past the end of a file is only a
short read. Either way the copy fails with ShmCopyError (naming the tensor and the sizes), the
request is answered DEVICE_ERROR and the daemon goes on. Before a copy the file's size is checked.
A store through the mapping can never grow the file; a pwritev past the end would, so a file
truncated between that check and a pwritev is grown back, at most to what it had at REGISTER: it
is the client's own race, and costs the daemon nothing it did not already hold.

Files are opened as the client may (tierd.transfer.shm), each distinct file (st_dev, st_ino)
once per rank however many tensors name it (``files``: the count the daemon caps per client).

Copies are coalesced: a layer's blocks are described as file ranges ``(file offset, object
offset, run_bytes)``, ordered by file offset; each range contiguous in both the file and the object
is one memcpy (one iovec), and each contiguous file range is one preadv/pwritev (at most IOV_MAX
iovecs). Consecutive block
ids of a layer (and the chunks of one request) are usually one range, so a typical call costs
one syscall per layer per run. Overlapping file ranges in a retrieve (repeated block ids) are
written in the old order (item, layer, block, run), so the last one wins as before.
"""

from __future__ import annotations

import itertools
import os

import numpy as np

from tierd.protocol.errors import ErrorCode, ProtocolError
from tierd.protocol.layout import FdHandle, GroupLayout, PageLayout, ShmHandle
from tierd.transfer import mapcopy
from tierd.transfer.items import CopyItem
from tierd.transfer.shm import Opener, Refused

IOV_MAX = max(1, min(os.sysconf("SC_IOV_MAX"), 1024))
BATCH_SEGMENTS = 1 << 16  # (layer, block, run) ranges planned at once: bounds the planning arrays' memory
_ORDERS = list(itertools.permutations(range(3)))  # axes of (layer, block, run) to try, natural first


class ShmCopyError(RuntimeError):
    """A copy could not reach an engine's file (it shrank after REGISTER, or I/O failed); the
    instance's memory is not usable any more."""


class SharedFile:
    """One open engine file, shared by every tensor that names it; ``end``: where the last of them
    ends; ``addr``: its first ``end`` bytes mapped for the guarded copy (0: not mapped, copied with
    preadv/pwritev)."""

    __slots__ = ("fd", "path", "tensors", "end", "addr", "mapped")

    def __init__(self, fd: int, path: str):
        self.fd, self.path, self.tensors = fd, path, []
        self.end = self.addr = self.mapped = 0

    def map(self) -> None:
        """Map every byte a tensor names, if the guarded copy is available (module doc). As long as
        the layout says, not as long as the file is now: a file cut short and grown again must not
        leave a copy the layout allows outside the mapping (past the file's end is SIGBUS, guarded;
        past a mapping's end would be SIGSEGV)."""
        if mapcopy.load() is None:
            return
        try:
            self.addr, self.mapped = mapcopy.map_file(self.fd, self.end), self.end
        except OSError:  # e.g. a memory map limit: this file's copies go through the syscalls
            self.addr = self.mapped = 0

    def close(self) -> None:
        if self.addr:
            mapcopy.unmap(self.addr, self.mapped)
            self.addr = self.mapped = 0
        os.close(self.fd)
        self.fd = -1


class _Layers:
    """Layers of one group in one file with one run geometry, as arrays (one entry per layer)."""

    __slots__ = ("file", "index", "base", "block_stride", "run_stride", "tensor", "runs", "run_bytes")

    def __init__(self, file: SharedFile, runs: int, run_bytes: int):
        self.file, self.runs, self.run_bytes = file, runs, run_bytes
        self.index, self.base, self.block_stride, self.run_stride, self.tensor = [], [], [], [], []

    def freeze(self) -> None:
        for name in ("index", "base", "block_stride", "run_stride", "tensor"):
            setattr(self, name, np.array(getattr(self, name), dtype=np.int64))


class CpuRankMemory:
    def __init__(self, layout: PageLayout, peer=None, refuse=None, claim=None):
        """``peer``: the client's kernel credentials (tierd.edge.peer.Peer); None or a tcp:// peer
        (no credentials): the daemon's own uid. ``refuse(stat)``: the reason a file may not be
        used (the daemon's own pool files), or None. ``claim(ticket)``: the descriptors this
        client sent under ``ticket`` (tierd.edge.fdinbox), for ``fd`` handles; None: none can be."""
        self.layout = layout
        self._claim = claim
        self._tickets: dict[bytes, list[int]] = {}  # this REGISTER's claimed descriptors
        self._adopted: set[int] = set()  # those of them a SharedFile owns (closed by close())
        self._files: dict[tuple[int, int], SharedFile] = {}
        self.tensors: list[tuple[SharedFile, int]] = []  # (file, byte offset of the tensor in it)
        if peer is not None and peer.local:
            uid, gid, pid, whose = peer.uid, peer.gid, peer.pid or None, "the client's"
        else:  # a tcp:// client has no kernel credentials: only the daemon's own files, no connector links
            uid, gid, pid = os.geteuid(), os.getegid(), None
            whose = "the daemon's" if peer is None else "the daemon's (a tcp:// client has no credentials)"
        try:
            opener = Opener(uid, gid, pid, refuse, whose)
        except Refused as exc:
            raise ProtocolError(ErrorCode.LAYOUT_INVALID, f"layout.tensors: {exc}") from None
        try:
            for i, ref in enumerate(layout.tensors):
                self.tensors.append(self._open(opener, i, ref))
        except BaseException:
            self.close()
            raise
        finally:
            opener.close()
            for fds in self._tickets.values():  # sent but not used (or duplicates of a file): closed
                for fd in fds:
                    if fd not in self._adopted:
                        os.close(fd)
            self._tickets.clear()
        self._map_tried = False  # files mapped at the first copy, on the copy thread (_copy)
        self.groups = [self._layers(g) for g in layout.groups]
        self.strides = [g.object_strides(layout.chunk_tokens) for g in layout.groups]

    @property
    def files(self) -> int:
        """Distinct files (and fds) this rank holds."""
        return len(self._files)

    def _open(self, opener: Opener, i: int, ref) -> tuple[SharedFile, int]:
        where = f"layout.tensors[{i}]"
        if isinstance(ref.handle, FdHandle):
            return self._open_fd(opener, where, ref)
        if not isinstance(ref.handle, ShmHandle):
            raise ProtocolError(
                ErrorCode.LAYOUT_INVALID, f"{where}: a cpu layout needs shm or fd tensor handles"
            )
        path, offset = ref.handle.path, ref.handle.offset
        try:
            fd, st = opener.open(path)
            try:
                if offset + ref.nbytes > st.st_size:
                    raise Refused(f"the file has {st.st_size} bytes, the tensor needs {offset + ref.nbytes}")
                file = self._files.get((st.st_dev, st.st_ino))
                if file is None:
                    file = SharedFile(opener.reopen(fd, st), path)
                    self._files[(st.st_dev, st.st_ino)] = file
            finally:
                os.close(fd)
        except Refused as exc:
            raise ProtocolError(ErrorCode.LAYOUT_INVALID, f"{where} {path!r}: {exc}") from None
        file.tensors.append(i)
        file.end = max(file.end, offset + ref.nbytes)
        return file, offset

    def _open_fd(self, opener: Opener, where: str, ref) -> tuple[SharedFile, int]:
        h = ref.handle
        fds = self._tickets.get(h.ticket)
        if fds is None:
            fds = self._claim(h.ticket) if self._claim is not None else None
            if fds is None:
                raise ProtocolError(
                    ErrorCode.LAYOUT_INVALID,
                    f"{where}: no descriptors were sent under its ticket "
                    f"(send them to the daemon's fd socket, <socket>.fds, first: tierd_client.fdpass)",
                )
            self._tickets[h.ticket] = fds
        if h.index >= len(fds):
            raise ProtocolError(
                ErrorCode.LAYOUT_INVALID,
                f"{where}: descriptor {h.index} of its ticket was not sent ({len(fds)} were)",
            )
        fd = fds[h.index]
        try:
            st = opener.check_fd(fd)
            if h.offset + ref.nbytes > st.st_size:
                raise Refused(f"the file has {st.st_size} bytes, the tensor needs {h.offset + ref.nbytes}")
        except Refused as exc:
            raise ProtocolError(ErrorCode.LAYOUT_INVALID, f"{where} (descriptor {h.index}): {exc}") from None
        file = self._files.get((st.st_dev, st.st_ino))
        if file is None:
            file = self._files[(st.st_dev, st.st_ino)] = SharedFile(fd, f"descriptor {h.index}")
            self._adopted.add(fd)
        file.tensors.append(int(where.rsplit("[", 1)[1].rstrip("]")))
        file.end = max(file.end, h.offset + ref.nbytes)
        return file, h.offset

    def _layers(self, group: GroupLayout) -> list[_Layers]:
        parts: dict[tuple[int, int, int], _Layers] = {}
        for li, s in enumerate(group.layers):
            file, offset = self.tensors[s.tensor]
            part = parts.get((id(file), s.runs, s.run_bytes))
            if part is None:
                part = parts[(id(file), s.runs, s.run_bytes)] = _Layers(file, s.runs, s.run_bytes)
            part.index.append(li)
            part.base.append(offset + s.offset)
            part.block_stride.append(s.block_stride)
            part.run_stride.append(s.run_stride)
            part.tensor.append(s.tensor)
        for part in parts.values():
            part.freeze()
        return list(parts.values())

    # ---- copies ----------------------------------------------------------------------------------
    def store(self, group: int, items: list[CopyItem]) -> None:
        """Engine file -> pool objects."""
        self._copy(group, items, write=False)

    def retrieve(self, group: int, items: list[CopyItem]) -> None:
        """Pool objects -> engine file."""
        self._copy(group, items, write=True)

    def _copy(self, group: int, items: list[CopyItem], write: bool) -> None:
        items = [it for it in items if len(it.ids)]
        if not items:
            return
        if not self._map_tried:  # here, not at REGISTER: building the guarded copy (once) takes a compiler
            self._map_tried = True  # run, which must not hold up the main loop
            for file in self._files.values():
                file.map()
        strides = self.strides[group]
        ids = np.concatenate([it.ids for it in items])
        pos = np.concatenate([it.pos for it in items])
        which = np.repeat(np.arange(len(items)), [len(it.ids) for it in items])
        views = [memoryview(it.view) for it in items]
        bases = np.array([it.view.ctypes.data for it in items], dtype=np.int64)  # for the mapped copy
        for part in self.groups[group]:
            # in batches of blocks (and layers) of at most BATCH_SEGMENTS ranges, in block order
            nl = max(1, min(len(part.index), BATCH_SEGMENTS // part.runs))
            nb = max(1, BATCH_SEGMENTS // (nl * part.runs))
            for b in range(0, len(ids), nb):
                for li in range(0, len(part.index), nl):
                    self._copy_part(
                        part,
                        slice(li, li + nl),
                        ids[b : b + nb],
                        pos[b : b + nb],
                        which[b : b + nb],
                        strides,
                        (views, bases),
                        write,
                    )

    def _copy_part(self, part: _Layers, li: slice, ids, pos, which, strides, bufs, write: bool):
        rb, runs = part.run_bytes, part.runs
        r = np.arange(runs, dtype=np.int64)
        index, base = part.index[li], part.base[li]
        block_stride, run_stride = part.block_stride[li], part.run_stride[li]
        shape = (len(index), len(ids), runs)  # (layer, block, run)
        file_at = (
            base[:, None, None]
            + ids[None, :, None] * block_stride[:, None, None]
            + (r[None, :] * run_stride[:, None])[:, None, :]
        )
        block_at = index[:, None] * strides[0] + pos[None, :] * strides[1]  # GroupLayout.object_strides
        obj_at = block_at[:, :, None] + (r * rb)[None, None, :]
        item = np.broadcast_to(which[None, :, None], shape)
        self._check_size(part, part.tensor[li], file_at, rb)
        for axes in _ORDERS:
            f = file_at.transpose(axes).ravel()
            if len(f) < 2 or bool(np.all(f[1:] >= f[:-1] + rb)):  # disjoint and ascending in this order
                self._io(part, f, obj_at.transpose(axes).ravel(), item.transpose(axes).ravel(), bufs, write)
                return
        f, o, w = file_at.ravel(), obj_at.ravel(), item.ravel()
        order = np.argsort(f, kind="stable")
        if write and not bool(np.all(f[order][1:] >= f[order][:-1] + rb)):
            # overlapping writes: the order of the old gather (item, layer, block, run), last one wins
            layer = np.broadcast_to(np.arange(shape[0])[:, None, None], shape).ravel()
            block = np.broadcast_to(np.arange(shape[1])[None, :, None], shape).ravel()
            order = np.lexsort((np.broadcast_to(r, shape).ravel(), block, layer, w))
        self._io(part, f[order], o[order], w[order], bufs, write)

    def _check_size(self, part: _Layers, tensors: np.ndarray, file_at: np.ndarray, rb: int) -> None:
        need = int(file_at.max()) + rb
        size = os.fstat(part.file.fd).st_size
        if size < need:
            layer = int(np.unravel_index(int(file_at.argmax()), file_at.shape)[0])
            self._shrunk(part, int(tensors[layer]), size, need)

    def _shrunk(self, part: _Layers, tensor: int, size: int, need: int):
        ref = self.layout.tensors[tensor]
        raise ShmCopyError(
            f"layout.tensors[{tensor}] {part.file.path}: the file has {size} bytes, the copy needs {need} "
            f"(the tensor ends at {ref.handle.offset + ref.nbytes}): it shrank after REGISTER"
        )

    def _io(self, part: _Layers, f: np.ndarray, o: np.ndarray, w: np.ndarray, bufs, write: bool) -> None:
        views, bases = bufs  # each item's memoryview, for the syscalls, and its address, for memcpy
        rb, n = part.run_bytes, len(f)
        fcont = np.zeros(n, dtype=bool)
        fcont[1:] = f[1:] == f[:-1] + rb  # continues the previous file range
        ocont = fcont.copy()
        ocont[1:] &= (w[1:] == w[:-1]) & (o[1:] == o[:-1] + rb)  # ... and the previous object range
        starts = np.flatnonzero(~ocont)  # one iovec (one memcpy) each
        lengths = np.diff(starts, append=n) * rb
        at = f[starts]
        if part.file.addr and int((at + lengths).max()) <= part.file.mapped and mapcopy.armed():
            self._mapped(part, at, bases[w[starts]] + o[starts], lengths, write)
            return
        first = ~fcont[starts]  # an iovec that starts a file range starts a syscall, as does every IOV_MAX-th
        call_of = np.cumsum(first) - 1
        nth = np.arange(len(starts)) - np.flatnonzero(first)[call_of]
        calls = np.flatnonzero(first | (nth % IOV_MAX == 0))
        wants = np.add.reduceat(lengths, calls).tolist()
        ats = f[starts[calls]].tolist()
        ends = calls[1:].tolist() + [len(starts)]
        bufs = [
            views[wi][oi : oi + li]
            for wi, oi, li in zip(w[starts].tolist(), o[starts].tolist(), lengths.tolist())
        ]
        fd = part.file.fd
        call = os.pwritev if write else os.preadv
        try:
            if len(calls) == len(bufs):  # one iovec per syscall: the sparse case, kept lean
                for at, want, buf in zip(ats, wants, bufs):
                    done = call(fd, [buf], at)
                    if done != want:
                        self._finish(call, part, fd, [buf], at, want, done)
            else:
                for at, want, k0, k1 in zip(ats, wants, calls.tolist(), ends):
                    done = call(fd, bufs[k0:k1], at)
                    if done != want:
                        self._finish(call, part, fd, bufs[k0:k1], at, want, done)
        except OSError as exc:
            raise ShmCopyError(
                f"{part.file.path} (tensors {part.file.tensors[:8]}): {exc.strerror}"
            ) from None

    def _mapped(self, part: _Layers, at: np.ndarray, obj: np.ndarray, lengths: np.ndarray, write: bool):
        """memcpy of the ranges ``[at, +lengths)`` of the mapped file to or from the object addresses
        ``obj``, in order (so the last of overlapping writes wins)."""
        file_addr = (at + part.file.addr).astype(np.uint64)
        obj, lengths = obj.astype(np.uint64), lengths.astype(np.uint64)
        dst, src = (file_addr, obj) if write else (obj, file_addr)
        done = mapcopy.copy(dst, src, lengths)
        if done != len(dst):  # SIGBUS: the file no longer holds that range
            need = int(at[done] + lengths[done])
            size = os.fstat(part.file.fd).st_size
            if size < need:
                self._shrunk(part, int(part.tensor[0]), size, need)
            raise ShmCopyError(
                f"{part.file.path} (tensors {part.file.tensors[:8]}): a copy {'into' if write else 'from'} "
                f"the file faulted at byte {int(at[done])} though it has {size} bytes (is its tmpfs full?)"
            )

    def _finish(self, call, part: _Layers, fd: int, bufs: list, at: int, want: int, done: int) -> None:
        """A transfer at ``at`` moved ``done`` of ``want`` bytes: the file shrank (ShmCopyError), or
        (a partial transfer of a file still long enough) go on with the rest."""
        while done != want:
            size = os.fstat(fd).st_size
            if done <= 0 or size < at + want:
                self._shrunk(part, int(part.tensor[0]), size, at + want)
            at, want = at + done, want - done
            while done >= len(bufs[0]):
                done -= len(bufs[0])
                bufs = bufs[1:]
            bufs = [bufs[0][done:], *bufs[1:]]
            done = call(fd, bufs, at)

    def close(self) -> None:
        self.groups = []
        for file in self._files.values():
            file.close()
        self._files.clear()
        self.tensors = []
