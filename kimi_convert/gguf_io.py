"""The one GGUF streaming layer, shared by the converter, the quantizer and the readers.

Writing: metadata and tensor infos go through gguf's own GGUFWriter (so the header,
KV encoding and split naming are llama.cpp's); tensor data is then streamed chunk by
chunk, so no tensor (a 4.9 GB stacked expert tensor, say) is ever held whole. Files
are written into a hidden temporary folder beside the output and renamed into place
only when every byte is down: an error leaves nothing behind.

Reading: `open_gguf` memory-maps a file or every part of a split file.
"""
from __future__ import annotations

import errno
import mmap
import os
import queue
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Union

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType, GGUFWriter
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize

from .errors import CheckpointError, OutputError

COPY_CHUNK = 64 << 20


def tensor_nbytes(qtype: QT, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of numpy-order `shape` stored as `qtype`."""
    block, size = GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        raise ValueError(f"row length {shape[-1]} is not a multiple of the {qtype.name} block ({block})")
    return int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // block) * size


@dataclass(frozen=True)
class FileRange:
    """Bytes to copy verbatim from a source file (kernel-side where possible)."""
    path: Path
    offset: int
    length: int


Chunk = Union[bytes, bytearray, memoryview, np.ndarray, FileRange]


@dataclass
class OutTensor:
    name: str
    qtype: QT
    shape: tuple[int, ...]            # numpy order: the reverse of ggml's ne
    chunks: Callable[[], Iterable[Chunk]]

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.qtype, self.shape)


def split_paths(out: Path, n_files: int) -> list[Path]:
    """llama.cpp's split naming: OUT-00001-of-00003.gguf."""
    if n_files == 1:
        return [out]
    return [out.with_name(f"{out.stem}-{i + 1:05d}-of-{n_files:05d}.gguf") for i in range(n_files)]


class GGUFStreamWriter:
    """Collects metadata, then writes a (possibly split) GGUF from streamed tensors."""

    def __init__(self, out: Path, arch: str, *, split_max_tensors: int = 0,
                 split_max_size: int = 0, force: bool = False):
        self.out = Path(out)
        self.force = force
        self.tmp_dir = self.out.parent / f".{self.out.name}.partial-{os.getpid()}"
        self.meta = GGUFWriter(self.tmp_dir / self.out.name, arch,
                               split_max_tensors=split_max_tensors, split_max_size=split_max_size)

    def add_kv(self, key: str, value: Any, vtype: GGUFValueType, sub_type: GGUFValueType | None = None):
        self.meta.add_key_value(key, value, vtype, sub_type)

    def plan_files(self, tensors: list[OutTensor]) -> list[list[OutTensor]]:
        """Assign tensors to split files exactly as GGUFWriter will (it decides)."""
        for t in tensors:
            self.meta.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
        by_name = {t.name: t for t in tensors}
        return [[by_name[n] for n in part] for part in self.meta.tensors]

    def write(self, tensors: list[OutTensor], on_bytes: Callable[[int], None] = lambda n: None) -> list[Path]:
        files = self.plan_files(tensors)
        finals = split_paths(self.out, len(files))
        clash = [p for p in finals if p.exists()]
        if clash and not self.force:
            raise OutputError(f"{clash[0]}: already exists (use --force to overwrite)")
        if self.tmp_dir.exists():
            shutil.rmtree(self.tmp_dir)
        self.tmp_dir.mkdir(parents=True)
        try:
            temps = self._write_all(files, on_bytes)
            for tmp, final in zip(temps, finals):
                os.replace(tmp, final)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                raise OutputError(f"{self.out}: disk full while writing ({os.strerror(e.errno)}); "
                                  f"nothing was written") from None
            raise
        finally:
            self._close_quietly()
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
        return finals

    def _close_quietly(self) -> None:
        """Close every part even if flushing one fails (a full disk fails them all)."""
        for f in self.meta.fout or []:
            try:
                f.close()
            except OSError:
                pass
        self.meta.fout = None

    def _write_all(self, files: list[list[OutTensor]], on_bytes) -> list[Path]:
        m = self.meta
        m.write_header_to_file()
        m.write_kv_data_to_file()
        m.write_ti_data_to_file()
        temps = [Path(f.name) for f in m.fout]
        ordered = [(fout, t) for fout, part in zip(m.fout, files) for t in part]
        with SourceFiles() as sources, Prefetch(t for _, t in ordered) as chunks:
            for fout, part in zip(m.fout, files):
                _pad(fout, m.data_alignment)
                with open_sink(fout) as sink:
                    for t in part:
                        written = 0
                        for chunk in chunks.of(t):
                            n = sink.put(chunk, sources)
                            written += n
                            on_bytes(n)
                        if written != t.nbytes:
                            raise CheckpointError(f"{t.name}: produced {written} bytes, expected {t.nbytes}")
                        sink.pad(m.data_alignment)
        return temps


class Prefetch:
    """Runs the tensors' chunk producers (reads, casts, MXFP4 repacks) one step ahead in a thread.

    numpy and file reads release the GIL, so the producer works on the second core while the
    main thread writes; the queue holds at most DEPTH chunks, which bounds the extra memory.
    """
    DEPTH = 3
    _END = object()

    def __init__(self, tensors: Iterable[OutTensor]):
        self.queue: queue.Queue = queue.Queue(self.DEPTH)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(list(tensors),), daemon=True)

    def _run(self, tensors: list[OutTensor]) -> None:
        try:
            for t in tensors:
                for chunk in t.chunks():
                    if not self._put((t.name, chunk)):
                        return
                if not self._put((t.name, self._END)):
                    return
        except BaseException as e:      # handed to the writer, which raises it
            self._put((None, e))

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def of(self, t: OutTensor) -> Iterator[Chunk]:
        while True:
            name, chunk = self.queue.get()
            if name is None:
                raise chunk
            if chunk is self._END:
                return
            assert name == t.name, f"producer at {name}, writer at {t.name}"
            yield chunk

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def open_sink(fout) -> "DirectSink | BufferedSink":
    """Tensor data goes around the page cache (O_DIRECT) where the file system allows it."""
    try:
        return DirectSink(fout)
    except OSError as e:            # e.g. tmpfs refuses O_DIRECT with EINVAL
        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        return BufferedSink(fout)


class BufferedSink:
    """Plain buffered writes, flushed in the background as they go."""

    def __init__(self, fout):
        self.fout = fout
        self.writeback = _Writeback(fout)

    def put(self, chunk: Chunk, sources: "SourceFiles") -> int:
        n = _write_chunk(self.fout, chunk, sources)
        self.writeback.wrote(n)
        return n

    def pad(self, align: int) -> None:
        _pad(self.fout, align)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.writeback.__exit__(*exc)


class DirectSink:
    """Tensor data through 32 MB page-aligned staging buffers, written with O_DIRECT by an I/O
    thread while the next buffer fills.

    Buffered writes of a multi-GB file spend most of their time copying into fresh page-cache
    pages (and then reclaiming them); O_DIRECT hands the staging buffer to the disk instead. The
    file offset of the first data byte is rarely page-aligned, so the staging starts with the
    page of header bytes in front of it, and the last partial page is written zero-padded and
    the file truncated back to its length.
    """
    PAGE = 4096
    STAGE = 32 << 20
    BUFFERS = 3

    def __init__(self, fout):
        fout.flush()
        self.fout, pos = fout, fout.tell()
        self.fd = os.open(fout.name, os.O_WRONLY | os.O_DIRECT)
        self.file_off = pos - pos % self.PAGE          # where the current buffer lands
        self.free: queue.Queue = queue.Queue()
        for _ in range(self.BUFFERS):
            self.free.put(mmap.mmap(-1, self.STAGE))  # anonymous maps are page-aligned
        self.todo: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.buf, self.fill = self.free.get(), 0
        reader = os.open(fout.name, os.O_RDONLY)
        try:
            head = os.pread(reader, pos - self.file_off, self.file_off)
        finally:
            os.close(reader)
        self._stage(memoryview(head))
        self.io = threading.Thread(target=self._io, daemon=True)
        self.io.start()

    @property
    def position(self) -> int:
        return self.file_off + self.fill

    def put(self, chunk: Chunk, sources: "SourceFiles") -> int:
        if isinstance(chunk, FileRange):
            return self._stage_range(chunk, sources.fd(chunk.path))
        if isinstance(chunk, np.ndarray):
            chunk = memoryview(np.ascontiguousarray(chunk)).cast("B")
        self._stage(memoryview(chunk).cast("B"))
        return len(chunk)

    def pad(self, align: int) -> None:
        if self.position % align:
            self._stage(memoryview(bytes(align - self.position % align)))

    def _stage(self, data: memoryview) -> None:
        while len(data):
            n = min(self.STAGE - self.fill, len(data))
            self.buf[self.fill:self.fill + n] = data[:n]
            self.fill += n
            data = data[n:]
            if self.fill == self.STAGE:
                self._submit()

    def _stage_range(self, r: FileRange, src: int) -> int:
        offset, left = r.offset, r.length
        while left:
            view = memoryview(self.buf)[self.fill:self.fill + min(left, self.STAGE - self.fill)]
            n = os.preadv(src, [view], offset)
            view.release()
            if n == 0:
                raise CheckpointError(f"{r.path}: ends before byte {offset + left} (truncated shard?)")
            self.fill, offset, left = self.fill + n, offset + n, left - n
            if self.fill == self.STAGE:
                self._submit()
        return r.length

    def _submit(self) -> None:
        if self.error is not None:
            raise self.error
        self.todo.put((self.buf, self.fill, self.file_off))
        self.file_off += self.fill
        self.buf, self.fill = self.free.get(), 0

    def _io(self) -> None:
        while (item := self.todo.get()) is not None:
            buf, n, offset = item
            try:
                if self.error is None:
                    length = -(-n // self.PAGE) * self.PAGE       # whole pages; the tail is zeros
                    buf[n:length] = bytes(length - n)
                    with memoryview(buf) as view:
                        if os.pwrite(self.fd, view[:length], offset) != length:   # only when out of room
                            raise OSError(errno.ENOSPC, "short write")
            except BaseException as e:      # raised in the writer's thread at the next submit
                self.error = e
            self.free.put(buf)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        end = self.position
        if exc[0] is None and self.fill:
            self._submit()
        self.todo.put(None)
        self.io.join()
        try:
            if exc[0] is None:
                if self.error is not None:
                    raise self.error
                os.ftruncate(self.fd, end)
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
        self.fout.seek(end)


class _Writeback:
    """Flush to disk in the background every WRITEBACK bytes, so the closing fsync is short
    and dirty pages do not pile up; the final fsync makes the file durable before its rename."""
    WRITEBACK = 256 << 20

    def __init__(self, fout):
        self.fout, self.pending, self.syncer = fout, 0, None

    def wrote(self, n: int) -> None:
        self.pending += n
        if self.pending >= self.WRITEBACK and (self.syncer is None or not self.syncer.is_alive()):
            self.fout.flush()
            self.syncer = threading.Thread(target=os.fdatasync, args=(self.fout.fileno(),), daemon=True)
            self.syncer.start()
            self.pending = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.syncer is not None:
            self.syncer.join()
        if exc[0] is None:
            self.fout.flush()
            os.fsync(self.fout.fileno())


def _pad(fout, align: int) -> None:
    pos = fout.tell()
    if pos % align:
        fout.write(b"\0" * (align - pos % align))


class SourceFiles:
    """Open source files once each, for FileRange copies."""

    def __init__(self):
        self.fds: dict[Path, int] = {}

    def fd(self, path: Path) -> int:
        if path not in self.fds:
            self.fds[path] = os.open(path, os.O_RDONLY)
        return self.fds[path]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for fd in self.fds.values():
            os.close(fd)


def _write_chunk(fout, chunk: Chunk, sources: SourceFiles) -> int:
    if isinstance(chunk, FileRange):
        return copy_range(fout, chunk, sources.fd(chunk.path))
    if isinstance(chunk, np.ndarray):
        chunk = memoryview(np.ascontiguousarray(chunk)).cast("B")
    fout.write(chunk)
    return len(chunk)


def copy_range(fout, r: FileRange, src: int) -> int:
    """Copy r.length bytes at r.offset into fout's current position."""
    fout.flush()
    dst = fout.fileno()
    offset, left = r.offset, r.length
    try:
        while left:
            n = os.copy_file_range(src, dst, min(left, 1 << 30), offset)
            if n == 0:
                raise CheckpointError(f"{r.path}: ends before byte {offset + left} (truncated shard?)")
            offset, left = offset + n, left - n
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
        while left:  # the kernel cannot copy between these files: plain reads
            data = os.pread(src, min(left, COPY_CHUNK), offset)
            if not data:
                raise CheckpointError(f"{r.path}: ends before byte {offset + left} (truncated shard?)")
            os.write(dst, data)
            offset, left = offset + len(data), left - len(data)
    fout.seek(0, os.SEEK_END)
    return r.length


# ----------------------------------------------------------------------------------
# reading

_SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass
class GGUFTensor:
    name: str
    qtype: QT
    shape: tuple[int, ...]      # numpy order
    raw: np.ndarray             # the stored bytes/values, memory-mapped
    path: Path
    offset: int                 # absolute byte offset in `path`

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.qtype, self.shape)

    def raw_bytes(self) -> np.ndarray:
        return self.raw.reshape(-1).view(np.uint8)

    def to_float32(self) -> np.ndarray:
        """Dequantised values in numpy shape (gguf.quants does every type we write)."""
        return np.asarray(dequantize(self.raw, self.qtype), dtype=np.float32).reshape(self.shape)


@dataclass
class GGUFFile:
    paths: list[Path]
    fields: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    @property
    def arch(self) -> str:
        return self.fields.get("general.architecture", "")


def gguf_parts(path: Path) -> list[Path]:
    """All files of a split GGUF given any one of them (or the single file)."""
    path = Path(path)
    m = _SPLIT_RE.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p for p in parts if not p.exists()]
    if missing:
        raise CheckpointError(f"{missing[0]}: split part missing")
    return parts


def read_fields(reader: GGUFReader) -> dict[str, Any]:
    out = {}
    for name, f in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        out[name] = f.contents()
    return out


def open_gguf(path: Path) -> GGUFFile:
    """Memory-map a GGUF (all parts of a split one): metadata and tensors by name."""
    parts = gguf_parts(Path(path))
    fields: dict[str, Any] = {}
    tensors: dict[str, GGUFTensor] = {}
    for p in parts:
        try:
            reader = GGUFReader(p, "r")
        except (ValueError, OSError) as e:
            raise CheckpointError(f"{p}: not a readable GGUF file ({e})") from None
        for k, v in read_fields(reader).items():
            fields.setdefault(k, v)
        for t in reader.tensors:
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            tensors[t.name] = GGUFTensor(t.name, QT(t.tensor_type), shape, t.data, p, int(t.data_offset))
    expected = fields.get("split.tensors.count")
    if expected is not None and expected != len(tensors):
        raise CheckpointError(f"{parts[0]}: split.tensors.count is {expected} but the parts hold {len(tensors)}")
    return GGUFFile(parts, fields, tensors)


def iter_chunks_of(t: GGUFTensor, chunk: int = COPY_CHUNK) -> Iterator[FileRange]:
    """A stored tensor as FileRanges (for verbatim copies between GGUF files)."""
    for off in range(0, t.nbytes, chunk):
        yield FileRange(t.path, t.offset + off, min(chunk, t.nbytes - off))
