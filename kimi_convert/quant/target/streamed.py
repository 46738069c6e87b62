"""Sampled rows of the tensors kimi-convert is about to write, for `kimi-convert --target-size`'s one pass.

The converter makes a tensor as a stream (onepass.StreamedRows: the stored rows kimi-quantize would read from
the converted file), so a tensor's sampled rows are cut from its stream, read once in order, the rows between
them dropped a chunk at a time (never the tensor whole). Measuring so reads the decided tensors (the routed
experts: nearly all of the checkpoint) once more before the pass that writes them; the rows are the bytes the
converted file would hold, so the choice is the one kimi-quantize makes on that file.
"""
from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from ...gguf_io import Chunk
from ..driver import CHUNK_VALUES
from ..onepass import StreamedRows
from ..plan import Decision
from .measure import RowReader


def producer_rows(producers: dict[str, Callable[[], Iterable[Chunk]]]) -> RowReader:
    """`producers`: each tensor's producer, by name (the converter's, as convert() makes them)."""
    def read(d: Decision, groups: list[list[int]]) -> list[np.ndarray]:
        stream = StreamedRows(d.name, producers[d.name], d.source, d.shape)
        step = max(1, CHUNK_VALUES // d.shape[-1])
        at, out = 0, []
        for rows in groups:
            picked = []
            for r in rows:
                while at < r:                   # the rows before it, dropped a chunk at a time
                    b = min(r, at + step)
                    stream(at, b)
                    at = b
                picked.append(np.array(stream(r, r + 1)))
                at = r + 1
            out.append(np.concatenate(picked))
        return out
    return read
