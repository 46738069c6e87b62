"""Writing importance matrices as llama-imatrix writes them (tools/imatrix/imatrix.cpp `save_imatrix` and
`save_imatrix_legacy`), and adding earlier files to them as its `--in-file` does (`load_imatrix`).

GGUF (the default): keys `general.type` = "imatrix", `imatrix.datasets` (ARRAY of STRING: the --in-file
datasets, then the text file as given), `imatrix.chunk_count` and `imatrix.chunk_size` (UINT32), in that order
and no other (no `general.architecture`); then per weight W, in name order (C++ std::sort: bytes), `W.in_sum2`
F32 [n_counts, ne0] (numpy order) and `W.counts` F32 [n_counts, 1], every entry written even without data.
The file goes through the project's one GGUF writer (temporary name, renamed at the end, never over an input).

.dat (`--output-format dat`): i32 n_entries; per entry (name order, entries without any data skipped) i32 len,
name, i32 ncall = ceil(max count / chunk_size), i32 nval, f32 values = sum / count x ncall, or ncall for an
expert with count 0; then i32 chunk_count, i32 len, the last dataset.
"""
from __future__ import annotations

import math
import os
import struct
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from .collect import Entry
from ..gguf_io import GGUFStreamWriter, OutTensor
from ..paths import Input
from ..quant.imatrix import (COUNTS_SUFFIX, KEY_CHUNK_COUNT, KEY_CHUNK_SIZE, KEY_DATASETS, SUMS_SUFFIX,
                             ImatrixError, load_imatrix)

GGUF, DAT = "gguf", "dat"


def chunk_count(entries: dict[str, Entry], chunk_size: int) -> int:
    """imatrix.cpp's m_last_chunk: the largest count of any matrix over the chunk size."""
    most = max((float(e.counts.max()) for e in entries.values() if e.counts.size), default=0.0)
    return int(most // chunk_size)


def add_in_files(entries: dict[str, Entry], paths: Iterable[Path], chunk_size: int) -> list[str]:
    """Add earlier imatrix files to `entries` as --in-file does; returns their datasets, in order.

    A GGUF's raw sums and counts add as they are; a .dat's means are turned back into sums (x chunk_size, its
    counts ncall x chunk_size). A file whose entry has another size than ours is refused, naming both."""
    datasets: list[str] = []
    for path in paths:
        im = load_imatrix(path)
        if im.format == GGUF and im.chunk_size != chunk_size:
            raise ImatrixError(f"{path}: chunk size {im.chunk_size}, this run's is {chunk_size} (--ctx): "
                               f"the counts would not add up")
        for name in im.names:
            sums, counts = im.raw(name)
            if im.format == DAT:
                sums, counts = sums * np.float32(chunk_size), counts * chunk_size
            add_entry(entries, name, Entry(sums.astype(np.float64), counts.astype(np.float64)), path)
        datasets += [d.decode("utf-8", "replace") for d in im.datasets]
    return datasets


def add_entry(entries: dict[str, Entry], name: str, new: Entry, path) -> None:
    have = entries.get(name)
    if have is None:
        entries[name] = new
        return
    if have.sums.size != new.sums.size:
        raise ImatrixError(f"{path}: entry {name} has {new.sums.size} values, this model's has {have.sums.size} "
                           f"(an imatrix of another model?)")
    if have.counts.size == 1 and new.counts.size > 1:       # broadcast one count over the matrices
        have.counts = np.full(new.counts.size, have.counts[0])
        have.sums = have.sums.reshape(new.counts.size, -1)
    elif new.counts.size == 1 and have.counts.size > 1:
        new = Entry(new.sums.reshape(have.counts.size, -1), np.full(have.counts.size, new.counts[0]))
    if have.counts.size != new.counts.size:
        raise ImatrixError(f"{path}: entry {name} has {new.counts.size} counts, this model's has {have.counts.size}")
    have.sums = have.sums.reshape(new.sums.shape) + new.sums
    have.counts = have.counts + new.counts


def write_gguf(out: Path, entries: dict[str, Entry], *, datasets: list[str], chunk_size: int, force: bool,
               reads: Iterable[Input] = (), log: Callable[[str], None] = lambda s: None) -> None:
    w = GGUFStreamWriter(out, "imatrix", force=force, tool="kimi-imatrix", manifest=False, reads=reads, log=log)
    w.meta.kv_data[0].clear()          # llama-imatrix writes no general.architecture: only these four keys
    w.add_kv("general.type", "imatrix", VT.STRING)
    w.add_kv(KEY_DATASETS, list(datasets), VT.ARRAY, VT.STRING)
    w.add_kv(KEY_CHUNK_COUNT, chunk_count(entries, chunk_size), VT.UINT32)
    w.add_kv(KEY_CHUNK_SIZE, chunk_size, VT.UINT32)
    tensors = []
    for name in sorted(entries, key=lambda n: n.encode()):
        e = entries[name]
        sums = np.ascontiguousarray(e.sums.reshape(e.counts.size, -1), np.float32)
        counts = np.ascontiguousarray(e.counts.reshape(-1, 1), np.float32)
        tensors += [OutTensor(name + SUMS_SUFFIX, QT.F32, sums.shape, lambda a=sums: [a]),
                    OutTensor(name + COUNTS_SUFFIX, QT.F32, counts.shape, lambda a=counts: [a])]
    w.write(tensors)


def dat_bytes(entries: dict[str, Entry], *, dataset: str, chunk_size: int) -> bytes:
    out = bytearray()
    n = 0
    for name in sorted(entries, key=lambda n: n.encode()):
        e = entries[name]
        if not (e.counts > 0).any():
            continue                   # "has no data - skipping"
        ncall = int(math.ceil(float(e.counts.max()) / chunk_size))
        sums = e.sums.reshape(e.counts.size, -1).astype(np.float32)
        counts = e.counts.astype(np.float32)[:, None]
        empty = counts == 0
        values = np.where(empty, np.float32(1), sums) / np.where(empty, np.float32(1), counts) * np.float32(ncall)
        raw = name.encode()
        out += struct.pack("<i", len(raw)) + raw + struct.pack("<ii", ncall, sums.size)
        out += np.ascontiguousarray(values, "<f4").tobytes()
        n += 1
    ds = dataset.encode()
    return struct.pack("<i", n) + bytes(out) + struct.pack("<ii", chunk_count(entries, chunk_size), len(ds)) + ds


def write_dat(out: Path, entries: dict[str, Entry], *, dataset: str, chunk_size: int, force: bool,
              reads: Iterable[Input] = ()) -> None:
    from ..paths import Output, refuse_overlap
    refuse_overlap(list(reads), [Output(out, "the imatrix")])
    if out.exists() and not force:
        raise ImatrixError(f"{out}: exists (use --force to replace it)")
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        tmp.write_bytes(dat_bytes(entries, dataset=dataset, chunk_size=chunk_size))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
