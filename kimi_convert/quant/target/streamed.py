"""Sampled rows of the tensors kimi-convert is about to write, for `kimi-convert --target-size`'s one pass.

A row of a copied, cast or stacked-expert tensor is read from the checkpoint alone (converter.row_reader: one
pread, two for an MXFP4 expert's codes and scales, then the same cast or repack the converter makes), so
measuring reads a few rows of each expert, not the checkpoint: the routed experts, nearly all of its bytes,
are read once, by the pass that writes them. The few tensors whose rows are only made whole (the converter's
RES_SCORE, A_LOG, K_B and V_B transforms; small) are cut from their producer's stream (onepass.StreamedRows),
read once in order, the rows between the sampled ones dropped a chunk at a time. Either way the rows are the
bytes the converted file would hold, so the choice is the one kimi-quantize makes on that file
(tests/test_target_size.py checks both against the converted file's rows).
"""
from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from ...gguf_io import Chunk
from ..driver import CHUNK_VALUES
from ..onepass import StreamedRows
from ..plan import Decision
from .measure import RowReader


def producer_rows(producers: dict[str, Callable[[], Iterable[Chunk]]],
                  read_row: Callable[[str, int], np.ndarray | None] = lambda name, row: None) -> RowReader:
    """`producers`: each tensor's producer, by name (the converter's, as convert() makes them); `read_row`:
    one stored row of a tensor read directly, or None where its rows come only from the producer."""
    def read(d: Decision, groups: list[list[int]]) -> list[np.ndarray]:
        if not groups or not groups[0] or read_row(d.name, groups[0][0]) is None:
            return _streamed(d, producers[d.name], groups)
        return [np.stack([read_row(d.name, r) for r in rows]) for rows in groups]
    return read


def _streamed(d: Decision, produce: Callable[[], Iterable[Chunk]], groups: list[list[int]]) -> list[np.ndarray]:
    stream = StreamedRows(d.name, produce, d.source, d.shape)
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
