"""Reading GGUF files: `open_gguf` memory-maps a file or every part of a split file.

The parser is ours, not gguf-py's `GGUFReader`: that one raises IndexError, KeyError or
UnicodeDecodeError on damaged files, allocates an array before it checks its length against the
file, and builds a numpy object per string (17-31 s and 595 MiB for the real K3's header). Ours
returns the same values for every file both accept (tests/test_gguf_reader.py checks it) and turns
every fault into one CheckpointError line naming the file and the key, tensor or field:
- every count and length is checked against the bytes left before anything is read or allocated;
- GGUF versions 2 and 3 only, little-endian (as llama.cpp); keys non-empty, unique, valid UTF-8;
  known value types; no arrays of arrays (llama.cpp refuses them); string values and every element of a
  string array valid UTF-8 (GGUF strings are UTF-8), each checked as it is decoded: a fault names the key, the
  element, the bad byte and its file offset;
- `general.alignment`, if present, a UINT32 power of two;
- tensor names unique (in all parts of a split file), valid UTF-8, shorter than 64 bytes (ggml's
  GGML_MAX_NAME); n_dims 1..4; dims positive with a product within int64; known ggml types; rows
  a whole number of blocks; data offsets aligned; tensors packed in info order, each padded to the
  alignment (as llama.cpp's gguf.cpp requires), and every one inside the file.

Tensor data stay on disk: `GGUFTensor.raw` is made on first use, a view of one memory map per part.
"""
from __future__ import annotations

import contextlib
import math
import mmap
import os
import re
import stat
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Union

import numpy as np
from gguf import GGUF_DEFAULT_ALIGNMENT, GGUFValueType
from gguf import GGMLQuantizationType as QT
from gguf import quants as gguf_quants

from ..errors import CheckpointError
from ..paths import Input
from ..gcutil import gc_paused        # full collections over 500k new objects find nothing
from .qtypes import Q2_0, QUANT_SIZES, TYPES_BY_ID
from .chunks import COPY_CHUNK, FileRange, tensor_nbytes

VT = GGUFValueType
_SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

Shape = tuple[int, ...]
ValueTypes = tuple[GGUFValueType, Union[GGUFValueType, None]]     # (type, array element type)

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4                    # GGML_MAX_DIMS
MAX_NAME = 64                   # GGML_MAX_NAME: a tensor name takes at most 63 bytes
INT64_MAX = (1 << 63) - 1
MIN_KV_BYTES = 8 + 1 + 4 + 1    # key length, a 1-byte key, value type, a 1-byte value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8       # name length (empty name), n_dims, one dim, type, offset
# llama-quantize cuts these C strings at 127 bytes, which can split a UTF-8 sequence (quant/imatrix.py)
CUT_STRING_KEYS = ("quantize.imatrix.file", "quantize.imatrix.dataset")

_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_SCALAR = {t: struct.Struct(f) for t, f in {
    VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I", VT.INT32: "<i",
    VT.FLOAT32: "<f", VT.UINT64: "<Q", VT.INT64: "<q", VT.FLOAT64: "<d"}.items()}
_ELEMENT = {t: np.dtype(d) for t, d in {       # array elements; BOOL as bytes, any non-zero one is true
    VT.UINT8: "<u1", VT.INT8: "<i1", VT.UINT16: "<u2", VT.INT16: "<i2", VT.UINT32: "<u4", VT.INT32: "<i4",
    VT.FLOAT32: "<f4", VT.BOOL: "u1", VT.UINT64: "<u8", VT.INT64: "<i8", VT.FLOAT64: "<f8"}.items()}
_VALUE_TYPES = {int(t): t for t in VT}
# the types whose stored values gguf's reader (and so ours) gives as typed arrays; the rest as bytes
_TYPED = {QT.F16: np.float16, QT.F32: np.float32, QT.F64: np.float64, QT.I8: np.int8, QT.I16: np.int16,
          QT.I32: np.int32, QT.I64: np.int64}


def same_shape(stored: Shape, expected: Shape) -> bool:
    """Equal up to leading 1s in numpy order, i.e. trailing 1-dimensions in ggml order.

    A GGUF tensor header holds ggml_n_dims(t) dimensions, which leaves out trailing ne of 1:
    llama-quantize writes our conv [ne 4, 1, 256, 1] as [4, 1, 256]. llama.cpp's loader reads
    both as the same tensor, and so must we.
    """
    return _without_leading_ones(stored) == _without_leading_ones(expected)


def _without_leading_ones(shape: Shape) -> Shape:
    shape = tuple(int(x) for x in shape)
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape


class _MappedPart:
    """One file's memory map, shared by its tensors; the numpy view over it is made on first use."""
    __slots__ = ("path", "_map", "_bytes")

    def __init__(self, path: Path, mapped: mmap.mmap):
        self.path, self._map, self._bytes = path, mapped, None

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        if self._bytes is None:
            self._bytes = np.frombuffer(self._map, dtype=np.uint8)      # read-only, like the map
        return self._bytes[offset:offset + nbytes]


def dequantize(raw: np.ndarray, qtype: QT) -> np.ndarray:
    """ggml's to_float (dequantize_row_<type>) of raw blocks [..., row bytes]: gguf.quants, bit for bit with ggml
    for every type it has (tests/test_ggml_cpu.py), and Q1_0 and Q2_0, which it lacks, from ggml_cpu_lowbit."""
    if qtype in (QT.Q1_0, Q2_0):
        from ..runtime.ggml_cpu_lowbit import dequantize_q1_0, dequantize_q2_0  # noqa: PLC0415 (its grid tables: 0.1 s)
        return dequantize_q1_0(raw) if qtype == QT.Q1_0 else dequantize_q2_0(raw)
    return gguf_quants.dequantize(raw, qtype)


@dataclass(slots=True)
class GGUFTensor:
    name: str
    qtype: QT
    shape: tuple[int, ...]      # numpy order
    path: Path
    offset: int                 # absolute byte offset in `path`
    _part: _MappedPart = field(repr=False, compare=False)
    _raw: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def raw(self) -> np.ndarray:
        """The stored values (F16, F32, F64 and the integer types) or bytes per row (every other type),
        memory-mapped and read-only, as gguf's reader gives them."""
        if self._raw is None:
            data = self._part.view(self.offset, self.nbytes)
            typed = _TYPED.get(self.qtype)
            if typed is not None:
                self._raw = data.view(typed).reshape(self.shape)
            else:
                block, size = QUANT_SIZES[self.qtype]
                self._raw = data.reshape(self.shape[:-1] + (self.shape[-1] // block * size,))
        return self._raw

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.qtype, self.shape)

    @property
    def row_nbytes(self) -> int:
        """Bytes of one stored row (the last axis)."""
        return tensor_nbytes(self.qtype, self.shape[-1:])

    def read_rows(self, a: int, b: int, buf: np.ndarray) -> np.ndarray:
        """Stored rows [a, b) (rows counted over every axis but the last) as raw gives them, read with pread
        into the caller's uint8 ``buf`` of at least (b - a) * row_nbytes bytes, which it reuses: the process's
        memory stays flat however big the file, where every page read through the memory map would count in
        its RSS until the kernel reclaims it."""
        n = (b - a) * self.row_nbytes
        view = memoryview(buf.reshape(-1)[:n])
        with open(self.path, "rb", buffering=0) as f:
            got = 0
            while got < n:
                k = os.preadv(f.fileno(), [view[got:]], self.offset + a * self.row_nbytes + got)
                if k == 0:
                    raise CheckpointError(f"{self.path}: ends inside tensor {self.name} (truncated file?)")
                got += k
        rows = buf.reshape(-1)[:n].reshape(b - a, self.row_nbytes)
        typed = _TYPED.get(self.qtype)
        return rows.view(typed) if typed is not None else rows

    def raw_bytes(self) -> np.ndarray:
        return self.raw.reshape(-1).view(np.uint8)

    def to_float32(self) -> np.ndarray:
        """Dequantised values in numpy shape (`dequantize`)."""
        return np.asarray(dequantize(self.raw, self.qtype), dtype=np.float32).reshape(self.shape)

    def as_shape(self, shape: Shape) -> "GGUFTensor":
        """The same stored tensor seen with `shape`, which must be `same_shape` as its own."""
        shape = tuple(int(x) for x in shape)
        if shape == self.shape:
            return self
        if not same_shape(self.shape, shape):
            raise ValueError(f"{self.name}: shape {list(self.shape)} is not {list(shape)}")
        # only leading 1s differ, so the last axis (values, or bytes per row) stays as stored
        return replace(self, shape=shape)


@dataclass(frozen=True)
class GGUFPart:
    """How one file of a GGUF is laid out."""
    path: Path
    size: int                   # bytes
    version: int
    alignment: int
    data_offset: int            # where the data section starts
    n_tensors: int


@dataclass
class GGUFFile:
    paths: list[Path]
    fields: dict[str, Any]
    tensors: dict[str, GGUFTensor]
    types: dict[str, ValueTypes] = field(default_factory=dict)     # how each field is stored
    parts: list[GGUFPart] = field(default_factory=list)

    @property
    def arch(self) -> str:
        return self.fields.get("general.architecture", "")

    def with_shapes(self, shapes: dict[str, Shape]) -> "GGUFFile":
        """This file with every tensor that is `same_shape` as its entry in `shapes` given exactly
        that shape; any other tensor keeps its stored shape, for the caller to judge."""
        tensors = {name: t.as_shape(shapes[name]) if name in shapes and same_shape(t.shape, shapes[name]) else t
                   for name, t in self.tensors.items()}
        return replace(self, tensors=tensors)


# ------------------------------------------------------------------------------------------ parsing

class _Fault(Exception):
    """A fault in the file; read_gguf puts the path in front."""


def _shown(name: str, limit: int = 80) -> str:
    """A key or tensor name fit for a one-line message."""
    short = name if len(name) <= limit else name[:limit] + "..."
    return short if short.isprintable() else repr(short)


class _Cursor:
    """Reads a GGUF header front to back; every read is checked against the bytes left first."""
    __slots__ = ("buf", "pos", "size")

    def __init__(self, buf, size: int):
        self.buf, self.pos, self.size = buf, 0, size

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise _Fault(f"truncated: {what} needs {n} bytes at offset {self.pos}, "
                         f"the file ends at byte {self.size}")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def raw_string(self, what: str) -> bytes:
        n = self.u64(f"{what} (its length)")
        self.need(n, what)
        s = self.buf[self.pos:self.pos + n]
        self.pos += n
        return s


def _utf8(raw: bytes, what: str, offset: int) -> str:
    """raw (read from file offset `offset`) as text; a fault names what it is and where the bad byte is."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _Fault(f"{what} is not valid UTF-8 ({_bad_byte(raw, e, offset)})") from None


def _bad_byte(raw: bytes, e: UnicodeDecodeError, offset: int) -> str:
    return f"{e.reason}: byte 0x{raw[e.start]:02x} at byte {e.start} of it, file offset {offset + e.start}"


def _read_header(cur: _Cursor) -> tuple[int, int, int]:
    """(version, tensor count, key count)."""
    if cur.size < 4 or cur.buf[:4] != GGUF_MAGIC:
        raise _Fault("not a GGUF file (it does not start with the GGUF magic)")
    cur.pos = 4
    version = cur.u32("the version")
    if version not in SUPPORTED_VERSIONS:
        hint = " (a big-endian file? only little-endian ones are read, as llama.cpp does)" \
            if version & 0xFFFF == 0 else ""
        raise _Fault(f"GGUF version {version}{hint}: only versions 2 and 3 are supported")
    n_tensors = cur.u64("the tensor count")
    n_kv = cur.u64("the key count")
    for count, what, least in ((n_kv, "keys", MIN_KV_BYTES), (n_tensors, "tensors", MIN_TENSOR_INFO_BYTES)):
        if count * least > cur.size - cur.pos:
            raise _Fault(f"truncated, or a damaged count: the header counts {count} {what}, which the "
                         f"{cur.size - cur.pos} bytes left cannot hold (each takes at least {least})")
    return version, n_tensors, n_kv


def _read_kvs(cur: _Cursor, n_kv: int) -> tuple[dict[str, Any], dict[str, ValueTypes]]:
    fields: dict[str, Any] = {}
    types: dict[str, ValueTypes] = {}
    for i in range(n_kv):
        where = f"key {i + 1} of {n_kv}"
        raw = cur.raw_string(f"{where}: the name")
        key = _utf8(raw, f"{where}: the name", cur.pos - len(raw))
        if not key:
            raise _Fault(f"{where}: the name is empty")
        if key in fields:
            raise _Fault(f"key {_shown(key)}: appears twice")
        where = f"key {_shown(key)}"
        vtype = _value_type(cur.u32(f"{where}: the value type"), where)
        if vtype == VT.ARRAY:
            element = _value_type(cur.u32(f"{where}: the array's element type"), where)
            if element == VT.ARRAY:
                raise _Fault(f"{where}: an array of arrays (llama.cpp refuses it)")
            n = cur.u64(f"{where}: the array length")
            fields[key] = _read_array(cur, element, n, where)
            types[key] = (VT.ARRAY, element)
        else:
            fields[key] = _read_scalar(cur, vtype, where, key)
            types[key] = (vtype, None)
    return fields, types


def _value_type(raw: int, where: str) -> VT:
    vtype = _VALUE_TYPES.get(raw)
    if vtype is None:
        raise _Fault(f"{where}: unknown value type {raw}")
    return vtype


def _read_scalar(cur: _Cursor, vtype: VT, where: str, key: str) -> Any:
    if vtype == VT.STRING:
        raw = cur.raw_string(f"{where}: the string")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if key in CUT_STRING_KEYS and e.end == len(raw) and e.reason == "unexpected end of data":
                return raw              # cut inside its last character: kept as the bytes it is
            raise _Fault(f"{where}: the string is not valid UTF-8 ({_bad_byte(raw, e, cur.pos - len(raw))})") \
                from None
    if vtype == VT.BOOL:
        cur.need(1, f"{where}: the value")
        cur.pos += 1
        return cur.buf[cur.pos - 1] != 0
    s = _SCALAR[vtype]
    cur.need(s.size, f"{where}: the value")
    (v,) = s.unpack_from(cur.buf, cur.pos)
    cur.pos += s.size
    return v


def _read_array(cur: _Cursor, element: VT, n: int, where: str) -> list:
    if element == VT.STRING:
        return _read_strings(cur, n, where)
    dtype = _ELEMENT[element]
    left = cur.size - cur.pos
    if n * dtype.itemsize > left:
        raise _Fault(f"{where}: an array of {n} {element.name} needs {n * dtype.itemsize} bytes, "
                     f"{left} are left (truncated, or a damaged length)")
    values = np.frombuffer(cur.buf, dtype=dtype, count=n, offset=cur.pos)
    cur.pos += n * dtype.itemsize
    return (values != 0).tolist() if element == VT.BOOL else values.tolist()


def _read_strings(cur: _Cursor, n: int, where: str) -> list[str]:
    """An array of strings, in one tight loop (the K3 vocabulary holds 163,840 tokens and as many merges)."""
    buf, pos, size = cur.buf, cur.pos, cur.size
    if n * 8 > size - pos:
        raise _Fault(f"{where}: an array of {n} strings needs at least {n * 8} bytes, "
                     f"{size - pos} are left (truncated, or a damaged length)")
    out: list[str] = []
    append, unpack = out.append, _U64.unpack_from
    for i in range(n):
        if size - pos < 8:
            cur.pos = pos
            cur.need(8, f"{where}: string {i + 1} of {n} (its length)")
        (length,) = unpack(buf, pos)
        pos += 8
        if length > size - pos:
            cur.pos = pos
            cur.need(length, f"{where}: string {i + 1} of {n}")
        raw = buf[pos:pos + length]
        pos += length
        try:
            append(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise _Fault(f"{where}: element {i} (string {i + 1} of {n}) is not valid UTF-8 "
                         f"({_bad_byte(raw, e, pos - length)})") from None
    cur.pos = pos
    return out


def _alignment(fields: dict[str, Any], types: dict[str, ValueTypes]) -> int:
    if "general.alignment" not in fields:
        return GGUF_DEFAULT_ALIGNMENT
    if types["general.alignment"] != (VT.UINT32, None):
        raise _Fault(f"key general.alignment: stored as {types['general.alignment'][0].name}, it must be UINT32")
    align = fields["general.alignment"]
    if align == 0 or align & (align - 1):
        raise _Fault(f"key general.alignment: {align} is not a power of two")
    return align


# name -> (type, numpy shape, offset in the data section, bytes)
_Infos = dict[str, tuple[QT, Shape, int, int]]
_DIMS_TYPE_OFFSET = {n: struct.Struct(f"<{n}QIQ") for n in range(1, MAX_DIMS + 1)}
_TYPE_SIZES = {raw: (qtype, *QUANT_SIZES[qtype]) for raw, qtype in TYPES_BY_ID.items()}


def _read_tensor_infos(cur: _Cursor, n_tensors: int, alignment: int) -> _Infos:
    """Every tensor info, in one tight loop (a file can hold 497,220 of them): the common case costs a few
    comparisons, and any fault goes to `_tensor_fault` for its message."""
    buf, pos, size = cur.buf, cur.pos, cur.size
    unpack_u64, unpack_u32, layouts, type_sizes = _U64.unpack_from, _U32.unpack_from, _DIMS_TYPE_OFFSET, _TYPE_SIZES
    infos: _Infos = {}
    for i in range(n_tensors):
        if size - pos < 8:
            cur.pos = pos
            cur.need(8, f"tensor {i + 1} of {n_tensors}: the name (its length)")
        (length,) = unpack_u64(buf, pos)
        if length > size - pos - 8:
            cur.pos = pos + 8
            cur.need(length, f"tensor {i + 1} of {n_tensors}: the name")
        raw = buf[pos + 8:pos + 8 + length]
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _Fault(f"tensor {i + 1} of {n_tensors}: the name is not valid UTF-8 "
                         f"({_bad_byte(raw, e, pos + 8)})") from None
        pos += 8 + length
        if name in infos:
            raise _Fault(f"tensor {_shown(name)}: appears twice")
        if length >= MAX_NAME:
            raise _Fault(f"tensor {_shown(name)}: the name takes {length} bytes, ggml allows at most {MAX_NAME - 1}")
        if size - pos < 4:
            cur.pos = pos
            cur.need(4, f"tensor {_shown(name)}: n_dims")
        (n_dims,) = unpack_u32(buf, pos)
        layout = layouts.get(n_dims)
        if layout is None:
            raise _Fault(f"tensor {_shown(name)}: n_dims is {n_dims}, it must be 1..{MAX_DIMS}")
        if size - pos - 4 < layout.size:
            cur.pos = pos + 4
            cur.need(layout.size, f"tensor {_shown(name)}: the dims, type and offset")
        values = layout.unpack_from(buf, pos + 4)
        pos += 4 + layout.size
        dims, raw_type, offset = values[:n_dims], values[n_dims], values[n_dims + 1]
        n_elements = math.prod(dims)
        sizes = type_sizes.get(raw_type)
        # a dim beyond int64 (negative to ggml) makes the product too large, unless another dim is 0
        if sizes is None or 0 in dims or n_elements > INT64_MAX or dims[0] % sizes[1] or offset % alignment:
            _tensor_fault(name, dims, raw_type, offset, alignment)
        qtype, block, type_size = sizes
        infos[name] = (qtype, dims[::-1], offset, n_elements // block * type_size)
    cur.pos = pos
    return infos


def _tensor_fault(name: str, dims: tuple[int, ...], raw_type: int, offset: int, alignment: int) -> None:
    """Raise the first thing wrong with this tensor info."""
    where = f"tensor {_shown(name)}"
    if not all(1 <= d <= INT64_MAX for d in dims):
        raise _Fault(f"{where}: dims {list(dims)}: every dim must be a positive int64")
    if math.prod(dims) > INT64_MAX:
        raise _Fault(f"{where}: dims {list(dims)} hold {math.prod(dims)} elements, more than an int64 counts")
    if raw_type not in _TYPE_SIZES:
        raise _Fault(f"{where}: unknown ggml type {raw_type}")
    qtype, block, _ = _TYPE_SIZES[raw_type]
    if dims[0] % block:
        raise _Fault(f"{where}: rows of {dims[0]} values are not a whole number of {qtype.name} blocks of {block}")
    raise _Fault(f"{where}: data offset {offset} is not a multiple of the alignment {alignment}")


def _check_ranges(infos: _Infos, data_offset: int, size: int, alignment: int) -> None:
    """Tensors packed as llama.cpp's loader requires: in info order, each at the running sum of the sizes
    before it, each padded to the alignment (so no gap and no overlap), and every one inside the file."""
    expected = 0
    for name, (_, _, offset, nbytes) in infos.items():
        if offset != expected:
            raise _Fault(f"tensor {_shown(name)}: data offset {offset}, expected {expected} "
                         f"(tensors must be packed in order, each padded to the alignment)")
        if data_offset + offset + nbytes > size:
            start, end = data_offset + offset, data_offset + offset + nbytes
            if start >= size:
                raise _Fault(f"truncated: tensor {_shown(name)} starts at byte {start}, the file has {size} bytes")
            raise _Fault(f"truncated: tensor {_shown(name)} ends at byte {end}, the file has {size} bytes "
                         f"({end - size} missing)")
        expected = offset + -(-nbytes // alignment) * alignment


def _parse(path: Path, mapped, size: int) -> GGUFFile:
    with gc_paused():
        return _parse_all(path, mapped, size)


def _parse_all(path: Path, mapped, size: int) -> GGUFFile:
    cur = _Cursor(mapped, size)
    version, n_tensors, n_kv = _read_header(cur)
    fields, types = _read_kvs(cur, n_kv)
    alignment = _alignment(fields, types)
    infos = _read_tensor_infos(cur, n_tensors, alignment)
    data_offset = -(-cur.pos // alignment) * alignment
    _check_ranges(infos, data_offset, size, alignment)
    part = _MappedPart(path, mapped)
    tensors = {name: GGUFTensor(name, qtype, shape, path, data_offset + offset, part)
               for name, (qtype, shape, offset, _) in infos.items()}
    layout = GGUFPart(path, size, version, alignment, data_offset, n_tensors)
    return GGUFFile([path], fields, tensors, types, [layout])


def _map_file(path: Path) -> tuple[mmap.mmap, int]:
    """A read-only map of a regular file (a FIFO would block, a folder cannot be read)."""
    try:
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):
            raise CheckpointError(f"{path}: a folder, not a GGUF file")
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path}: not a regular file, not a GGUF")
        if st.st_size == 0:
            raise CheckpointError(f"{path}: empty file, not a GGUF")
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), st.st_size
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror or e})") from None


def read_gguf(path: Path) -> GGUFFile:
    """One GGUF file (one part of a split one, if so): its keys, their types, its layout and its tensors.
    A damaged file is a CheckpointError that names it and what is wrong."""
    path = Path(path)
    mapped, size = _map_file(path)
    try:
        return _parse(path, mapped, size)
    except _Fault as e:
        fault = str(e)
    with contextlib.suppress(BufferError):      # a view still held somewhere keeps the map open
        mapped.close()
    raise CheckpointError(f"{path}: {fault}")  # raised outside the handler: no frame of the parse kept


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


def gguf_inputs(path: Path) -> list[Input]:
    """The files a command that reads the GGUF `path` reads (every part of a split set), for
    paths.refuse_overlap; a set with a part missing is left to open_gguf to refuse."""
    try:
        parts = gguf_parts(Path(path))
    except CheckpointError:
        parts = [Path(path)]
    return [Input(p, "input GGUF" if len(parts) == 1 else "split part of the input") for p in parts]


def open_gguf(path: Path) -> GGUFFile:
    """Memory-map a GGUF (all parts of a split one): metadata and tensors by name. Keys come from
    the first part that has them; a tensor name in two parts is an error."""
    parts = gguf_parts(Path(path))
    gf = read_gguf(parts[0])
    for p in parts[1:]:
        more = read_gguf(p)
        for k, v in more.fields.items():
            if k not in gf.fields:
                gf.fields[k], gf.types[k] = v, more.types[k]
        for name, t in more.tensors.items():
            if name in gf.tensors:
                raise CheckpointError(f"{p}: tensor {_shown(name)}: also in {gf.tensors[name].path.name}")
            gf.tensors[name] = t
        gf.parts += more.parts
    gf.paths = parts
    expected = gf.fields.get("split.tensors.count")
    if expected is not None and expected != len(gf.tensors):
        raise CheckpointError(f"{parts[0]}: split.tensors.count is {expected} but the parts hold {len(gf.tensors)}")
    return gf


def iter_chunks_of(t: GGUFTensor, chunk: int = COPY_CHUNK) -> Iterator[FileRange]:
    """A stored tensor as FileRanges (for verbatim copies between GGUF files)."""
    for off in range(0, t.nbytes, chunk):
        yield FileRange(t.path, t.offset + off, min(chunk, t.nbytes - off))
