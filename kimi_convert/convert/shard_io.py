"""Tensor bytes read from the shards into reusable page-aligned buffers, for the converter's MXFP4 experts.

Each expert matrix (weight_packed and its weight_scale, 5.85 MB at the real widths) is read with one preadv
into a buffer its thread keeps, instead of being memory-mapped: a map faults every 64 KiB in, and its
munmap, once per expert, interrupts every core the process runs on to flush their TLBs. The read starts at
the page boundary below the tensor, into a page-aligned buffer, so the kernel copies whole pages from the
page cache. The arrays returned are views of the buffer: valid until the same thread reads again.
"""
from __future__ import annotations

import mmap
import os
import threading
from typing import Sequence

import numpy as np

from .checkpoint import NUMPY_DTYPE, SourceTensor
from ..errors import CheckpointError

PAGE = mmap.PAGESIZE

_local = threading.local()


def read_tensors(tensors: Sequence[SourceTensor], fds: Sequence[int]) -> list[np.ndarray]:
    """Each tensor (read from the open shard fds[i]) as an array of its dtype and shape, in this thread's
    buffer. Tensors stored back to back in one shard (an expert's packed codes and its scales) are one read."""
    spans = _spans(tensors, fds)
    buf = _buffer(sum(_whole_pages(_span_bytes(span)) for _, span in spans))
    views, at = [], 0
    for fd, span in spans:
        start = span[0].offset - span[0].offset % PAGE
        n = _span_bytes(span)
        _read_exact(fd, buf[at:at + n], start, span)
        for t in span:
            begin = at + t.offset - start
            views.append(buf[begin:begin + t.nbytes].view(NUMPY_DTYPE[t.dtype]).reshape(t.shape))
        at += _whole_pages(n)
    return views


def _spans(tensors: Sequence[SourceTensor], fds: Sequence[int]) -> list[tuple[int, list[SourceTensor]]]:
    """The tensors grouped into runs that lie back to back in one file, in the order given."""
    spans: list[tuple[int, list[SourceTensor]]] = []
    for t, fd in zip(tensors, fds, strict=True):
        last = spans[-1][1][-1] if spans else None
        if last is not None and spans[-1][0] == fd and last.offset + last.nbytes == t.offset:
            spans[-1][1].append(t)
        else:
            spans.append((fd, [t]))
    return spans


def _span_bytes(span: list[SourceTensor]) -> int:
    """Bytes read for a span: from the page boundary below its first tensor to the end of its last."""
    return span[-1].offset + span[-1].nbytes - (span[0].offset - span[0].offset % PAGE)


def _whole_pages(n: int) -> int:
    return -(-n // PAGE) * PAGE


def _buffer(nbytes: int) -> np.ndarray:
    """This thread's read buffer, page-aligned (an anonymous map), grown when a read needs more."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < nbytes:
        buf = _local.buf = np.frombuffer(mmap.mmap(-1, _whole_pages(nbytes)), np.uint8)
    return buf


def _read_exact(fd: int, view: np.ndarray, offset: int, span: list[SourceTensor]) -> None:
    got, n = 0, view.size
    mem = memoryview(view)
    while got < n:
        try:
            k = os.preadv(fd, [mem[got:]], offset + got)
        except OSError as e:
            raise CheckpointError(f"{span[0].path}: cannot read tensor {span[0].name} "
                                  f"({e.strerror or e})") from None
        if k == 0:
            cut = next(t for t in span if t.offset + t.nbytes > offset + got)
            raise CheckpointError(f"{cut.path}: truncated shard: tensor {cut.name} cut short")
        got += k
