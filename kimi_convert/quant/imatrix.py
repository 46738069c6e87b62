"""Importance matrices written by llama-imatrix, turned into the vectors llama-quantize hands its quantizers.

Both formats that llama-quantize accepts are read (tools/quantize/quantize.cpp `load_imatrix`, over
common/imatrix-loader.cpp); a file that does not start with the GGUF magic is taken for the legacy one,
as llama.cpp does when `gguf_init_from_file` fails.
- GGUF (`general.type` "imatrix", keys `imatrix.datasets`, `imatrix.chunk_count`, `imatrix.chunk_size`):
  per weight W, `W.in_sum2` F32 numpy [n_mat, ne0] (the sum of x^2 over the tokens, per input column and
  matrix) and `W.counts` F32 [n_mat] (tokens seen per matrix; one count for a dense tensor).
- legacy `.dat`: i32 n_entries; per entry i32 len, name[len], i32 ncall, i32 nval, f32 values[nval];
  then optionally i32 chunk_count, i32 len, dataset[len].

The importance vector of W, n_mat*ne0 float32 values of which matrix (expert) e uses [e*ne0:(e+1)*ne0],
with the float32 operations of llama.cpp so that the quantized bytes come out equal:
- GGUF: in_sum2[e] / float(lround(counts[e])), and 1.0 (neutral) for every matrix whose rounded count is 0:
  an expert that no token was routed to is quantized as if every column mattered equally;
- .dat: values / float(ncall), or the values as stored when ncall <= 0. The .dat writer stores an expert
  without data as 1*ncall, so it reads back as 1.0 too.

Values stay on disk until a tensor asks for them (a K3 imatrix is about 3.4 GB); the load reads every entry
once to check it (llama-quantize refuses non-finite values anywhere in the file before it starts) and keeps
only offsets and counts.
"""
from __future__ import annotations

import math
import os
import re
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable, Iterable, Union

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType

from ..constants import T
from ..errors import CheckpointError, KimiError
from ..gguf_io import GGUFFile, GGUFTensor, read_gguf

Shape = tuple[int, ...]
MetaValue = Union[str, bytes, int]          # bytes only for a string cut inside a UTF-8 sequence

GGUF_MAGIC = b"GGUF"
KEY_DATASETS = "imatrix.datasets"
KEY_CHUNK_COUNT = "imatrix.chunk_count"
KEY_CHUNK_SIZE = "imatrix.chunk_size"
SUMS_SUFFIX = ".in_sum2"
COUNTS_SUFFIX = ".counts"
# llama-quantize quantizes these without importance weights when the sizes differ, instead of failing
# (src/llama-quant.cpp tensor_name_match_token_embd): llama-imatrix never collects them (GET_ROWS)
TOKEN_EMBD_NAMES = (T.TOKEN_EMBD, "per_layer_token_embd.weight")
META_STR_MAX = 127                          # quantize.cpp: strncpy(kvo.val_str, s, 127)
_MAX_COUNT = 2.0 ** 63                      # lround into int64
_I32 = struct.Struct("<i")
_F32 = np.dtype("<f4")
_LAYER = re.compile(r"^blk\.(\d+)\.")


class ImatrixError(KimiError):
    """An imatrix file is not one, is damaged, or does not fit the model; the message names file and entry."""


@dataclass(frozen=True)
class _Entry:
    offset: int                 # absolute byte offset of the stored float32 values
    size: int                   # n_mat * ne0
    counts: np.ndarray | None   # GGUF: float32(lround(count)) per matrix; None for .dat
    ncall: int = 0              # .dat: the divisor


@dataclass(frozen=True)
class CoverageRow:
    """How much data one tensor's entry holds. `without_data` counts the matrices (experts) whose count is 0,
    which get 1.0; it is None when the file has no entry for the tensor or is a .dat (no per-expert counts)."""
    tensor: str
    layer: int | None
    matrices: int               # ne2: experts of a stacked tensor, 1 for a 2-D one
    found: bool
    without_data: int | None
    per_matrix: bool = False    # the entry has one count per matrix (a stacked expert tensor in a GGUF imatrix)


class Imatrix:
    """A loaded imatrix: `names`, `vector()`, `metadata()`, `coverage()`; build it with `load_imatrix`."""

    def __init__(self, path: str, fmt: str, entries: dict[str, _Entry], datasets: list[bytes],
                 chunk_count: int, chunk_size: int):
        self.path = path                # as the user spelled it: it goes into quantize.imatrix.file
        self.format = fmt               # "gguf" or "dat"
        self.datasets = datasets        # raw bytes, first one into quantize.imatrix.dataset
        self.chunk_count = chunk_count  # as llama.cpp's int32
        self.chunk_size = chunk_size
        self._entries = entries

    @property
    def names(self) -> list[str]:
        return sorted(self._entries)

    def vector(self, name: str, shape: Shape, on_skip: Callable[[str], None] | None = None) -> np.ndarray | None:
        """The importance vector for tensor `name` of numpy `shape` (float32, ne0*ne2 values; matrix e uses
        `expert_slice(v, shape, e)`), or None when llama-quantize would quantize it without one: no entry
        ("did not find weights"), or a token embedding whose size differs. `on_skip` gets the reason.
        Call it only for tensors that are quantized: llama-quantize looks entries up for those alone."""
        if not self.has_vector(name, shape, on_skip):
            return None
        with open(self.path, "rb") as f:
            return self._values(f, name, self._entries[name])

    def has_vector(self, name: str, shape: Shape, on_skip: Callable[[str], None] | None = None) -> bool:
        """Whether `vector(name, shape)` gives a vector, with its checks and notes, without reading the values:
        a plan checks every tensor before any data is read, and reads each vector only when its turn comes."""
        entry = self._entries.get(name)
        if entry is None:
            _note(on_skip, f"did not find weights for {name}")
            return False
        want = _ne0(shape) * _ne2(shape)
        if entry.size != want:
            what = (f"imatrix entry {name} has {entry.size} values, tensor {name} {list(shape)} needs "
                    f"{want} ({_ne0(shape)} columns x {_ne2(shape)} matrices)")
            if name in TOKEN_EMBD_NAMES:
                _note(on_skip, f"{what}: quantized without it, as llama-quantize does")
                return False
            raise ImatrixError(f"{self.path}: {what}")
        return True

    def usage(self, name: str, shape: Shape) -> np.ndarray | None:
        """Per matrix (expert) of a stacked tensor, the share of the calibration tokens routed through it: its
        count over the tokens a dense tensor saw (the largest single count in the file). None where the file
        does not say: a .dat, no entry, one count for the whole tensor, or no dense entry to compare with."""
        entry = self._entries.get(name)
        if entry is None or entry.counts is None or entry.counts.size == 1 or entry.counts.size != _ne2(shape):
            return None
        tokens = self._dense_tokens
        return entry.counts.astype(np.float64) / tokens if tokens > 0 else None

    @cached_property
    def _dense_tokens(self) -> float:
        return max((float(e.counts[0]) for e in self._entries.values()
                    if e.counts is not None and e.counts.size == 1), default=0.0)

    def metadata(self) -> list[tuple[str, MetaValue, GGUFValueType]]:
        """The keys llama-quantize adds to its output, in its order (each set last, after general.file_type)."""
        out: list[tuple[str, MetaValue, GGUFValueType]] = [
            ("quantize.imatrix.file", _c_string(os.fsencode(self.path)), GGUFValueType.STRING)]
        if self.datasets:
            out.append(("quantize.imatrix.dataset", _c_string(self.datasets[0]), GGUFValueType.STRING))
        out.append(("quantize.imatrix.entries_count", len(self._entries), GGUFValueType.UINT32))
        if self.chunk_count > 0:
            out.append(("quantize.imatrix.chunks_count", self.chunk_count, GGUFValueType.UINT32))
        return out

    def coverage(self, tensors: Iterable[tuple[str, Shape]]) -> list[CoverageRow]:
        """One row per (name, numpy shape) of the tensors to quantize: how many of its matrices (experts)
        had no tokens."""
        rows = []
        for name, shape in tensors:
            entry = self._entries.get(name)
            n_mat = _ne2(shape)
            zeros, per_matrix = None, False
            if entry is not None and entry.counts is not None:
                counts = entry.counts
                per_matrix = counts.size > 1
                # a dense 3-D weight has one count for all its matrices
                zeros = int(np.count_nonzero(counts == 0)) * (1 if per_matrix else n_mat)
            m = _LAYER.match(name)
            rows.append(CoverageRow(name, int(m[1]) if m else None, n_mat, entry is not None, zeros, per_matrix))
        return rows

    def raw(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(sums [n_counts, ne0], counts [n_counts]) as stored: what llama-imatrix --in-file adds to its own.
        GGUF: in_sum2 and the lround-ed counts; .dat: the stored means x ncall and [ncall] (one count)."""
        entry = self._entries[name]
        with open(self.path, "rb") as f:
            sums = _read_f32(f, entry.offset, entry.size, self.path, name)
        if entry.counts is None:
            return sums.reshape(1, -1), np.array([entry.ncall], np.float64)
        return sums.reshape(entry.counts.size, -1), entry.counts.astype(np.float64)

    def _values(self, f, name: str, entry: _Entry) -> np.ndarray:
        sums = _read_f32(f, entry.offset, entry.size, self.path, name)
        if entry.counts is None:
            # quantize.cpp: float / int64_t converts ncall to float first
            return sums / np.float32(entry.ncall) if entry.ncall > 0 else sums
        m = sums.reshape(entry.counts.size, -1)
        seen = entry.counts > 0
        np.divide(m, entry.counts[:, None], out=m, where=seen[:, None])
        m[~seen] = 1.0
        return sums

    def _check_finite(self) -> None:
        """llama-quantize checks every loaded value (src/llama-quant.cpp) before it quantizes anything.
        A finite value divided by a count >= 1 stays finite, so checking the stored values of the matrices
        that are divided (not those replaced by 1.0) is the same check, without the division."""
        with open(self.path, "rb") as f:
            for name, entry in self._entries.items():
                sums = _read_f32(f, entry.offset, entry.size, self.path, name)
                if entry.counts is not None:
                    sums = sums.reshape(entry.counts.size, -1)
                    sums[entry.counts == 0] = 0.0          # these become 1.0: llama.cpp never sees them
                bad = np.flatnonzero(~np.isfinite(sums.reshape(-1)))
                if bad.size:
                    where = _position(int(bad[0]), entry)
                    raise ImatrixError(f"{self.path}: entry {name}: value {where} is {sums.flat[bad[0]]} "
                                       f"(not finite)")


def expert_slice(vector: np.ndarray, shape: Shape, e: int) -> np.ndarray:
    """The part of `vector` that matrix (expert) `e` of a tensor of numpy `shape` is quantized with."""
    ne0 = _ne0(shape)
    return vector[e * ne0:(e + 1) * ne0]


def coverage_lines(rows: Iterable[CoverageRow]) -> list[str]:
    """For printing: per layer, each stacked tensor and how many of its experts had no data (quantized with
    1.0); a dense 3-D tensor only when it had no data. Then the tensors without an entry (quantized without
    importance weights)."""
    by_layer: dict[int, list[str]] = {}
    unknown, missing = 0, []
    for r in rows:
        if not r.found:
            missing.append(r.tensor)
        elif r.matrices > 1 and r.without_data is None:
            unknown += 1
        elif r.matrices > 1 and (r.per_matrix or r.without_data):
            short = r.tensor if r.layer is None else r.tensor.split(".", 2)[2]
            by_layer.setdefault(-1 if r.layer is None else r.layer, []).append(
                f"{short} {r.without_data}/{r.matrices}")
    lines = [f"{'global' if k < 0 else f'blk.{k}'}: experts without data: " + ", ".join(v)
             for k, v in sorted(by_layer.items())]
    if unknown:
        lines.append(f"experts without data: unknown for {unknown} stacked tensors (a .dat imatrix has no "
                     f"per-expert counts)")
    if missing:
        lines.append(f"no imatrix entry ({len(missing)}, quantized without importance weights): "
                     + ", ".join(missing))
    return lines


def load_imatrix(path: str | os.PathLike) -> Imatrix:
    """Read and check an imatrix in either format. Pass the path as the user typed it: llama-quantize
    records that string in quantize.imatrix.file."""
    from ..inputs import open_input      # a regular file only: a FIFO would block every read forever
    spelled = os.fspath(path)
    with open_input(Path(spelled), ImatrixError, missing="cannot read the imatrix (No such file or directory)") \
            as (fd, _):
        try:
            is_gguf = os.pread(fd, 4, 0) == GGUF_MAGIC
        except OSError as e:
            raise ImatrixError(f"{spelled}: cannot read the imatrix ({e.strerror})") from None
    im = _load_gguf(spelled) if is_gguf else _load_dat(spelled)
    im._check_finite()
    return im


# ---------------------------------------------------------------------------------------------- GGUF

def _load_gguf(path: str) -> Imatrix:
    try:
        gf = read_gguf(Path(path))
    except CheckpointError as e:
        raise ImatrixError(str(e)) from None
    fields, types = gf.fields, gf.types
    gtype = _gguf_str(gf, "general.type")
    if gtype is not None and gtype != "imatrix":
        raise ImatrixError(f"{path}: not an imatrix (general.type is {gtype!r})")
    missing = [k for k in (KEY_DATASETS, KEY_CHUNK_COUNT, KEY_CHUNK_SIZE) if k not in fields]
    if missing:
        raise ImatrixError(f"{path}: not an imatrix: {', '.join(missing)} missing (llama-quantize refuses it too)")
    if not gf.tensors:
        raise ImatrixError(f"{path}: no data (the imatrix has no tensors)")
    if types[KEY_DATASETS] != (GGUFValueType.ARRAY, GGUFValueType.STRING):
        raise ImatrixError(f"{path}: {KEY_DATASETS} is {_type_name(types[KEY_DATASETS])}, expected ARRAY[STRING]")
    datasets = [d.encode() for d in fields[KEY_DATASETS]]
    chunk_count = _gguf_u32(path, gf, KEY_CHUNK_COUNT)
    chunk_size = _gguf_u32(path, gf, KEY_CHUNK_SIZE)

    pairs: dict[str, dict[str, GGUFTensor]] = {}
    for t in gf.tensors.values():
        for suffix in (SUMS_SUFFIX, COUNTS_SUFFIX):
            if t.name.endswith(suffix) and len(t.name) > len(suffix):
                pairs.setdefault(t.name[:-len(suffix)], {})[suffix] = t
    if not pairs:
        raise ImatrixError(f"{path}: no imatrix entries (no tensor is named W{SUMS_SUFFIX} / W{COUNTS_SUFFIX})")
    entries = {name: _gguf_entry(path, name, p) for name, p in sorted(pairs.items())}
    # llama.cpp keeps chunk_count in an int32
    return Imatrix(path, "gguf", entries, datasets, chunk_count - (1 << 32) if chunk_count >= 1 << 31 else chunk_count,
                   chunk_size)


def _gguf_entry(path: str, name: str, pair: dict[str, GGUFTensor]) -> _Entry:
    sums, counts = pair.get(SUMS_SUFFIX), pair.get(COUNTS_SUFFIX)
    if sums is None or counts is None:
        have, lack = (SUMS_SUFFIX, COUNTS_SUFFIX) if counts is None else (COUNTS_SUFFIX, SUMS_SUFFIX)
        raise ImatrixError(f"{path}: entry {name} has {name}{have} but no {name}{lack}")
    for t in (sums, counts):
        if t.qtype != QT.F32:
            raise ImatrixError(f"{path}: {t.name} is {t.qtype.name}, an imatrix tensor must be F32")
    n_sums, n_counts = math.prod(sums.shape), math.prod(counts.shape)      # the reader makes every dim >= 1
    if n_sums // sums.shape[-1] != n_counts:
        raise ImatrixError(f"{path}: entry {name}: {name}{SUMS_SUFFIX} {list(sums.shape)} does not match "
                           f"{name}{COUNTS_SUFFIX} {list(counts.shape)} (one count per row of sums)")
    raw = np.asarray(counts.raw, dtype=_F32).reshape(-1).astype(np.float64)
    bad = np.flatnonzero(~(np.isfinite(raw) & (raw >= 0) & (raw < _MAX_COUNT)))
    if bad.size:
        raise ImatrixError(f"{path}: {name}{COUNTS_SUFFIX}: count {int(bad[0])} is {raw[bad[0]]} "
                           f"(a token count must be finite and >= 0)")
    # common/imatrix-loader.cpp reads counts with std::lround (half away from zero), quantize.cpp divides by
    # (float) of it; c + 0.5 is exact in float64 for every float32 c < 2^52, and the result fits a float32
    rounded = np.floor(raw + 0.5).astype(np.float32)
    return _Entry(sums.offset, n_sums, rounded)


def _gguf_str(gf: GGUFFile, key: str) -> str | None:
    if key not in gf.fields:
        return None
    vtype = gf.types[key]
    return gf.fields[key] if vtype == (GGUFValueType.STRING, None) else f"<{_type_name(vtype)}>"


def _gguf_u32(path: str, gf: GGUFFile, key: str) -> int:
    if gf.types[key] != (GGUFValueType.UINT32, None):
        raise ImatrixError(f"{path}: {key} is {_type_name(gf.types[key])}, expected UINT32")
    return gf.fields[key]


def _type_name(vtype: tuple) -> str:
    main, element = vtype
    return main.name if element is None else f"{main.name}[{element.name}]"


# ---------------------------------------------------------------------------------------------- .dat

class _Cursor:
    """Reads a .dat front to back; every length is checked against the bytes left before it is used."""

    def __init__(self, f, path: str):
        self.f, self.path = f, path
        self.size = os.fstat(f.fileno()).st_size
        self.pos = 0

    @property
    def left(self) -> int:
        return self.size - self.pos

    def take(self, n: int, what: str) -> bytes:
        if n > self.left:
            raise ImatrixError(f"{self.path}: truncated: {what} needs {n} bytes at offset {self.pos}, "
                               f"{self.left} left")
        self.f.seek(self.pos)
        data = self.f.read(n)
        self.pos += n
        return data

    def i32(self, what: str) -> int:
        return _I32.unpack(self.take(4, what))[0]


def _load_dat(path: str) -> Imatrix:
    with open(path, "rb") as f:
        cur = _Cursor(f, path)
        if cur.size == 0:
            raise ImatrixError(f"{path}: empty file, not an imatrix")
        n_entries = cur.i32("the entry count")
        min_entry = 4 + 1 + 4 + 4 + 4              # len, a 1-byte name, ncall, nval, one value
        if n_entries < 1:
            raise ImatrixError(f"{path}: no data (the entry count is {n_entries})")
        if n_entries * min_entry > cur.left:
            raise ImatrixError(f"{path}: not an imatrix: it says {n_entries} entries, which "
                               f"{cur.left} bytes cannot hold (neither a GGUF nor a legacy .dat)")
        entries: dict[str, _Entry] = {}
        for i in range(1, n_entries + 1):
            name, entry = _dat_entry(cur, i)
            if name in entries:
                raise ImatrixError(f"{path}: entry {i} ({name}) appears twice")
            entries[name] = entry
        chunk_count, datasets = _dat_trailer(cur)
    return Imatrix(path, "dat", entries, datasets, chunk_count, 0)


def _dat_entry(cur: _Cursor, i: int) -> tuple[str, _Entry]:
    n = cur.i32(f"entry {i}: the name length")
    if n < 1 or n > cur.left:
        raise ImatrixError(f"{cur.path}: entry {i}: name length {n} is not in 1..{cur.left} (bytes left)")
    raw = cur.take(n, f"entry {i}: the name")
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        name = ""
    if not name or "\0" in name:
        raise ImatrixError(f"{cur.path}: entry {i}: the name {raw[:60]!r} is not a tensor name")
    ncall = cur.i32(f"entry {name}: ncall")
    nval = cur.i32(f"entry {name}: the value count")
    if nval < 1:
        raise ImatrixError(f"{cur.path}: entry {name}: the value count is {nval}")
    if nval * 4 > cur.left:
        raise ImatrixError(f"{cur.path}: entry {name}: {nval} values do not fit the {cur.left} bytes left "
                           f"(truncated or not an imatrix)")
    entry = _Entry(cur.pos, nval, None, ncall)
    cur.pos += nval * 4
    return name, entry


def _dat_trailer(cur: _Cursor) -> tuple[int, list[bytes]]:
    """The optional i32 chunk count, then i32 len and the dataset name (llama-imatrix always writes both)."""
    if cur.left == 0:
        return 0, []
    chunk_count = cur.i32("the trailer's chunk count")
    datasets = []
    if cur.left:
        n = cur.i32("the trailer's dataset name length")
        if n < 0 or n > cur.left:
            raise ImatrixError(f"{cur.path}: truncated: the dataset name length {n} is not in 0..{cur.left}")
        name = cur.take(n, "the dataset name").split(b"\0")[0]   # llama.cpp reads it as a C string
        if name:
            datasets.append(name)
    if cur.left:
        raise ImatrixError(f"{cur.path}: {cur.left} unexpected bytes after the dataset name at offset {cur.pos}")
    return chunk_count, datasets


# ---------------------------------------------------------------------------------------------- helpers

def _read_f32(f, offset: int, count: int, path: str, name: str) -> np.ndarray:
    f.seek(offset)
    values = np.fromfile(f, dtype=_F32, count=count)
    if values.size != count:
        raise ImatrixError(f"{path}: truncated: entry {name} has {values.size} of its {count} values")
    return values.astype(np.float32, copy=False)


def _c_string(raw: bytes) -> MetaValue:
    """What strncpy(dst, s, 127) leaves: up to the first NUL, at most 127 bytes (maybe mid UTF-8 sequence)."""
    cut = raw.split(b"\0")[0][:META_STR_MAX]
    try:
        return cut.decode("utf-8")
    except UnicodeDecodeError:
        return cut


def _position(i: int, entry: _Entry) -> str:
    if entry.counts is None or entry.counts.size == 1:
        return str(i)
    ne0 = entry.size // entry.counts.size
    return f"{i} (matrix {i // ne0}, column {i % ne0})"


def _note(on_skip: Callable[[str], None] | None, message: str) -> None:
    if on_skip is not None:
        on_skip(message)


def _ne0(shape: Shape) -> int:
    return int(shape[-1])


def _ne2(shape: Shape) -> int:
    return int(shape[-3]) if len(shape) >= 3 else 1
