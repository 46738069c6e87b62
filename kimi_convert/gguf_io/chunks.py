"""The bytes a GGUF writer streams: tensor sizes, chunks (arrays, buffers, ranges of a source file copied
verbatim) and the copy of a file range. The reader shares these (FileRange, tensor_nbytes, COPY_CHUNK)."""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np
from gguf import GGMLQuantizationType as QT

from ..errors import CheckpointError
from .qtypes import QUANT_SIZES

COPY_CHUNK = 64 << 20


def tensor_nbytes(qtype: QT, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of numpy-order `shape` stored as `qtype`."""
    block, size = QUANT_SIZES[qtype]
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
            try:
                self.fds[path] = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise CheckpointError(f"{path}: cannot open ({e.strerror or e})") from None
        return self.fds[path]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for fd in self.fds.values():
            os.close(fd)


def _bytes_view(chunk) -> memoryview:
    """The bytes of an array or buffer chunk, without a copy when it is contiguous."""
    if isinstance(chunk, np.ndarray):
        chunk = np.ascontiguousarray(chunk)
    return memoryview(chunk).cast("B")


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
