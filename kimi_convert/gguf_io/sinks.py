"""How tensor data reaches the disk: around the page cache (O_DIRECT, DirectSink) where the file system allows it,
else buffered (BufferedSink); both flush in the background as they go (_Writeback)."""
from __future__ import annotations

import contextlib
import errno
import mmap
import os
import queue
import threading
from typing import Callable

import numpy as np

from ..errors import CheckpointError
from .chunks import Chunk, FileRange, SourceFiles, _bytes_view, _pad, _write_chunk

# how a file system (tmpfs, some FUSE and network ones) or a limit refuses an O_DIRECT open or write
DIRECT_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP)


def open_sink(fout, nbytes: int | None = None) -> "DirectSink | BufferedSink":
    """Tensor data (about `nbytes` of it, if known) goes around the page cache (O_DIRECT) where the file
    system allows it."""
    try:
        return DirectSink(fout, nbytes)
    except OSError as e:            # e.g. tmpfs refuses O_DIRECT with EINVAL
        if e.errno not in DIRECT_REFUSED:
            raise
        return BufferedSink(fout)


class BufferedSink:
    """Plain buffered writes, flushed in the background as they go.

    Both sinks hash what they write into `digest` when the writer sets one (the manifest's per-tensor
    SHA-256), from the bytes on their way to the file: no second pass over the output."""
    HASH_BLOCK = 8 << 20          # a file range is read through a buffer this size when it is hashed
    WRITEBACK = 256 << 20         # flushed in the background after this many bytes (_Writeback)

    def __init__(self, fout, nbytes: int | None = None):
        self.fout = fout
        self.writeback = _Writeback(fout.fileno(), self.WRITEBACK, fout.flush)
        self.digest = None
        self._buf: memoryview | None = None

    def put(self, chunk: Chunk, sources: "SourceFiles") -> int:
        if self.digest is None:
            n = _write_chunk(self.fout, chunk, sources)
        elif isinstance(chunk, FileRange):
            n = self._copy_hashed(chunk, sources.fd(chunk.path))
        else:
            data = _bytes_view(chunk)
            self.digest.update(data)
            n = self.fout.write(data)
        self.writeback.wrote(n)
        return n

    def _copy_hashed(self, r: FileRange, src: int) -> int:
        """A file range read once through a buffer, hashed and written (instead of copy_file_range, which
        never shows the bytes)."""
        if self._buf is None:
            self._buf = memoryview(bytearray(self.HASH_BLOCK))
        offset, left = r.offset, r.length
        while left:
            view = self._buf[:min(left, self.HASH_BLOCK)]
            try:
                n = os.preadv(src, [view], offset)
            except OSError as e:
                raise CheckpointError(f"{r.path}: cannot read ({e.strerror or e})") from None
            if n == 0:
                raise CheckpointError(f"{r.path}: ends before byte {offset + left} (truncated shard?)")
            self.digest.update(view[:n])
            self.fout.write(view[:n])
            offset, left = offset + n, left - n
        return r.length

    def pad(self, align: int) -> None:
        _pad(self.fout, align)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.writeback.__exit__(*exc)


class DirectSink:
    """Tensor data through three page-aligned staging buffers (32 MB, or less for a smaller file:
    stage_size), written with O_DIRECT by an I/O thread while the next buffer fills.

    Buffered writes of a multi-GB file spend most of their time copying into fresh page-cache
    pages (and then reclaiming them); O_DIRECT hands the staging buffer to the disk instead. The
    file offset of the first data byte is rarely page-aligned, so the staging starts with the
    page of header bytes in front of it, and the last partial page is written zero-padded and
    the file truncated back to its length.

    A write that O_DIRECT refuses (EINVAL: a file system that takes the flag at open but not
    the write, or a file size limit that is not a multiple of the page) or cuts short is done
    again, and every later one, with plain buffered writes: they either succeed or fail with
    the real reason (EFBIG, ENOSPC).

    The manifest's hashes are taken by a hashing thread between the two, from each staging buffer
    before it goes to the I/O thread (the tensor bytes of it, in order): filling, hashing and writing
    then overlap, one buffer each. A tensor's `digest` is complete once the sink has closed.
    """
    PAGE = 4096
    STAGE = 32 << 20
    MIN_STAGE = 1 << 20
    BUFFERS = 3

    def __init__(self, fout, nbytes: int | None = None):
        fout.flush()
        self.fout, pos = fout, fout.tell()
        self.fd = os.open(fout.name, os.O_WRONLY | os.O_DIRECT)
        self.direct = True
        self.stage = self.stage_size(nbytes)
        self.writeback = _Writeback(self.fd, self.stage)     # each buffer flushed while the next is made
        self.file_off = pos - pos % self.PAGE          # where the current buffer lands
        self.free: queue.Queue = queue.Queue()
        for _ in range(self.BUFFERS):
            self.free.put(_staging_buffer(self.stage))
        self.todo: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.digest = None                            # set by the writer per tensor: see BufferedSink
        self.segments: list[list] = []                # [digest, start, end] of the tensor bytes in self.buf
        self.buf, self.fill = self.free.get(), 0
        reader = os.open(fout.name, os.O_RDONLY)
        try:
            head = os.pread(reader, pos - self.file_off, self.file_off)
        finally:
            os.close(reader)
        self._stage(memoryview(head), hashed=False)
        self.to_hash: queue.Queue = queue.Queue()
        self.hasher = threading.Thread(target=self._hash, daemon=True)
        self.io = threading.Thread(target=self._io, daemon=True)
        self.hasher.start()
        self.io.start()

    @classmethod
    def stage_size(cls, nbytes: int | None) -> int:
        """The power of two at or under nbytes / 16, from MIN_STAGE to STAGE (STAGE if nbytes is unknown).
        Memory a process touches for the first time is the dear part here: a fresh 32 MB buffer took
        37-62 ms to fill once and 5-7 ms each time after (the 2-core VM), so three of them cost a 0.14 GB
        quantized file 0.15-0.2 s of the writer's core; and the last buffers, written and flushed after the
        last byte is made, take less time the smaller they are."""
        if nbytes is None:
            return cls.STAGE
        return min(cls.STAGE, max(cls.MIN_STAGE, 1 << max(0, (nbytes // 16).bit_length() - 1)))

    @classmethod
    def staging_bytes(cls, nbytes: int) -> int:
        """The staging memory a write of nbytes touches: its buffers, as far as the data fills them."""
        return min(nbytes, cls.BUFFERS * cls.stage_size(nbytes))

    @property
    def position(self) -> int:
        return self.file_off + self.fill

    def put(self, chunk: Chunk, sources: "SourceFiles") -> int:
        if isinstance(chunk, FileRange):
            return self._stage_range(chunk, sources.fd(chunk.path))
        data = _bytes_view(chunk)
        self._stage(data)
        return len(data)

    def pad(self, align: int) -> None:
        if self.position % align:
            self._stage(memoryview(bytes(align - self.position % align)), hashed=False)

    def _stage(self, data: memoryview, hashed: bool = True) -> None:
        while len(data):
            n = min(self.stage - self.fill, len(data))
            # numpy's copy lets go of the GIL (an mmap slice assignment holds it), so the quantizer's
            # threads, which take it back after every kernel call, do not wait on this copy
            np.frombuffer(self.buf, np.uint8, n, self.fill)[:] = np.frombuffer(data, np.uint8, n)
            if hashed:
                self._to_hash(n)
            self.fill += n
            data = data[n:]
            if self.fill == self.stage:
                self._submit()

    def _to_hash(self, n: int) -> None:
        """The n bytes staged at self.fill belong to the current tensor's digest."""
        if self.digest is None:
            return
        if self.segments and self.segments[-1][0] is self.digest and self.segments[-1][2] == self.fill:
            self.segments[-1][2] += n
        else:
            self.segments.append([self.digest, self.fill, self.fill + n])

    def _stage_range(self, r: FileRange, src: int) -> int:
        offset, left = r.offset, r.length
        while left:
            view = memoryview(self.buf)[self.fill:self.fill + min(left, self.stage - self.fill)]
            try:
                n = os.preadv(src, [view], offset)
            except OSError as e:
                raise CheckpointError(f"{r.path}: cannot read ({e.strerror or e})") from None
            finally:
                view.release()
            if n == 0:
                raise CheckpointError(f"{r.path}: ends before byte {offset + left} (truncated shard?)")
            self._to_hash(n)
            self.fill, offset, left = self.fill + n, offset + n, left - n
            if self.fill == self.stage:
                self._submit()
        return r.length

    def _submit(self) -> None:
        if self.error is not None:
            raise self.error
        self.to_hash.put((self.buf, self.fill, self.file_off, self.segments))
        self.file_off += self.fill
        self.buf, self.fill, self.segments = self.free.get(), 0, []

    def _hash(self) -> None:
        """Hash each buffer's tensor bytes (if the writer asked for digests), then hand it on to the I/O thread."""
        while (item := self.to_hash.get()) is not None:
            try:
                if self.error is None:
                    _hash_segments(item[0], item[3])
            except BaseException as e:      # raised in the writer's thread at the next submit
                self.error = e
            self.todo.put(item)
        self.todo.put(None)

    def _io(self) -> None:
        while (item := self.todo.get()) is not None:
            buf, n, offset, _ = item
            try:
                if self.error is None:
                    self._write(buf, n, offset)
                    self.writeback.wrote(n)
            except BaseException as e:      # raised in the writer's thread at the next submit
                self.error = e
            self.free.put(buf)

    def _write(self, buf: mmap.mmap, n: int, offset: int) -> None:
        with memoryview(buf) as view:
            if self.direct:
                length = -(-n // self.PAGE) * self.PAGE       # whole pages; the tail is zeros
                buf[n:length] = bytes(length - n)
                try:
                    if os.pwrite(self.fd, view[:length], offset) == length:
                        return
                except OSError as e:
                    if e.errno not in DIRECT_REFUSED:
                        raise
                self._fall_back_to_buffered()
            _pwrite_all(self.fd, view[:n], offset)

    def _fall_back_to_buffered(self) -> None:
        self.writeback.wait()               # its flush is on the descriptor closed here
        os.close(self.fd)
        self.fd = os.open(self.fout.name, os.O_WRONLY)
        self.direct = False
        self.writeback.fd = self.fd

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        end = self.position
        if exc[0] is None and self.fill:
            self._submit()
        self.to_hash.put(None)              # the hasher passes the end on to the I/O thread
        self.hasher.join()
        self.io.join()
        self.writeback.join()               # before the descriptor is closed, whatever happens
        try:
            if exc[0] is None:
                if self.error is not None:
                    raise self.error
                self.writeback.wait()
                os.ftruncate(self.fd, end)
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
        self.fout.seek(end)


def _staging_buffer(n: int) -> mmap.mmap:
    """n bytes of private anonymous memory, page-aligned, in huge pages where the kernel allows them: 8,192
    page faults to fill a 32 MB buffer become 16, and unmapping it at the end is cheap. (A shared anonymous
    map, mmap's default, is shmem, which takes no huge pages here: unmapping three of them took 30-40 ms
    at the end of every write.)"""
    buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            buf.madvise(mmap.MADV_HUGEPAGE)
    return buf


def _hash_segments(buf: mmap.mmap, segments: list[list]) -> None:
    with memoryview(buf) as view:
        for digest, start, end in segments:
            with view[start:end] as part:
                digest.update(part)             # hashlib lets go of the GIL on large buffers


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of data; a short write is retried, so a full disk ends in its own error."""
    while len(data):
        n = os.pwrite(fd, data, offset)
        if n == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        data, offset = data[n:], offset + n


class _Writeback:
    """Flush to disk in the background every `every` bytes written, so the closing fsync is short and
    dirty data does not pile up: a flush costs about as much per byte whenever it runs (an fdatasync of
    160 MB written with O_DIRECT took 204-272 ms at the end, or 224-287 ms spread over five syncs on a
    thread and then 0 ms at the end, docs/performance.md), so done meanwhile it is off the critical path.
    The final fsync still makes the file durable before its rename. One flush runs at a time; bytes
    written while it runs go into the next. `flush` empties the writer's own buffer first (a file object's)."""

    def __init__(self, fd: int, every: int, flush: Callable[[], None] = lambda: None):
        self.fd, self.every, self.flush = fd, every, flush
        self.pending, self.syncer = 0, None
        self.error: OSError | None = None

    def wrote(self, n: int) -> None:
        self.pending += n
        if self.pending >= self.every and (self.syncer is None or not self.syncer.is_alive()):
            self.flush()
            self.syncer = threading.Thread(target=self._sync, args=(self.fd,), daemon=True)
            self.syncer.start()
            self.pending = 0

    def _sync(self, fd: int) -> None:
        try:
            os.fdatasync(fd)
        except OSError as e:
            # kept for the close: Linux reports a write-back error to a descriptor once, so the closing
            # fsync could succeed after this one failed, and the file would be renamed into place short
            self.error = self.error or e

    def join(self) -> None:
        """Wait for the flush under way (before its descriptor is closed)."""
        if self.syncer is not None:
            self.syncer.join()

    def wait(self) -> None:
        """join(), then raise the error of any flush that failed."""
        self.join()
        if self.error is not None:
            raise self.error

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is not None:
            self.join()
            return
        self.wait()
        self.flush()
        os.fsync(self.fd)
