"""Reading GGUF files: `open_gguf` memory-maps a file or every part of a split file."""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Union

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize

from ..errors import CheckpointError
from .writer import COPY_CHUNK, FileRange, tensor_nbytes

_SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

Shape = tuple[int, ...]
ValueTypes = tuple[GGUFValueType, Union[GGUFValueType, None]]     # (type, array element type)


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

    def as_shape(self, shape: Shape) -> "GGUFTensor":
        """The same stored tensor seen with `shape`, which must be `same_shape` as its own."""
        shape = tuple(int(x) for x in shape)
        if shape == self.shape:
            return self
        if not same_shape(self.shape, shape):
            raise ValueError(f"{self.name}: shape {list(self.shape)} is not {list(shape)}")
        # only leading 1s differ, so the last axis (values, or bytes per row) stays as stored
        return replace(self, shape=shape, raw=self.raw.reshape(shape[:-1] + self.raw.shape[-1:]))


@dataclass
class GGUFFile:
    paths: list[Path]
    fields: dict[str, Any]
    tensors: dict[str, GGUFTensor]
    types: dict[str, ValueTypes] = field(default_factory=dict)     # how each field is stored

    @property
    def arch(self) -> str:
        return self.fields.get("general.architecture", "")

    def with_shapes(self, shapes: dict[str, Shape]) -> "GGUFFile":
        """This file with every tensor that is `same_shape` as its entry in `shapes` given exactly
        that shape; any other tensor keeps its stored shape, for the caller to judge."""
        tensors = {name: t.as_shape(shapes[name]) if name in shapes and same_shape(t.shape, shapes[name]) else t
                   for name, t in self.tensors.items()}
        return replace(self, tensors=tensors)


class _Reader(GGUFReader):
    """gguf's reader, with a clear error for a file that ends before its header says it does.

    gguf's own reader slices the memory map past the end and fails later, in a numpy reshape
    ("cannot reshape array of size ..."), which does not say what is wrong.
    """

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        for f in fields:
            _, name, _, dims, raw_type, offset = f.parts
            try:
                block, size = GGML_QUANT_SIZES[QT(int(raw_type[0]))]
            except (ValueError, KeyError):
                continue                        # an unknown type: gguf's reader names it
            end = int(start_offs) + int(offset[0]) + int(np.prod(dims, dtype=np.int64)) * size // block
            if end > len(self.data):
                raise _Truncated(f"truncated: tensor {bytes(name).decode('utf-8', 'replace')} ends at byte "
                                 f"{end}, the file has {len(self.data)} bytes")
        super()._build_tensors(start_offs, fields)

    def _get(self, offset: int, dtype, count: int = 1, override_order=None):
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            raise _Truncated(f"truncated: the header goes on past byte {len(self.data)}, the end of the file")
        return super()._get(offset, dtype, count, override_order)


class _Truncated(ValueError):
    pass


def read_gguf(path: Path) -> GGUFReader:
    """gguf's reader over one file; an unreadable file is a CheckpointError that says why."""
    try:
        if Path(path).stat().st_size == 0:
            raise CheckpointError(f"{path}: empty file, not a GGUF")
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise CheckpointError(f"{path}: not a GGUF file (it does not start with the GGUF magic)")
        return _Reader(path, "r")
    except _Truncated as e:
        raise CheckpointError(f"{path}: {e}") from None
    except (ValueError, KeyError, IndexError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from None


def read_fields(reader: GGUFReader) -> dict[str, Any]:
    out = {}
    for name, f in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        out[name] = f.contents()
    return out


def read_types(reader: GGUFReader) -> dict[str, ValueTypes]:
    out = {}
    for name, f in reader.fields.items():
        if not name.startswith("GGUF."):
            main = GGUFValueType(f.types[0])
            out[name] = (main, GGUFValueType(f.types[-1]) if main == GGUFValueType.ARRAY else None)
    return out


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


def open_gguf(path: Path) -> GGUFFile:
    """Memory-map a GGUF (all parts of a split one): metadata and tensors by name."""
    parts = gguf_parts(Path(path))
    fields: dict[str, Any] = {}
    types: dict[str, ValueTypes] = {}
    tensors: dict[str, GGUFTensor] = {}
    for p in parts:
        reader = read_gguf(p)
        for k, v in read_fields(reader).items():
            fields.setdefault(k, v)
        for k, v in read_types(reader).items():
            types.setdefault(k, v)
        for t in reader.tensors:
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            tensors[t.name] = GGUFTensor(t.name, QT(t.tensor_type), shape, t.data, p, int(t.data_offset))
    expected = fields.get("split.tensors.count")
    if expected is not None and expected != len(tensors):
        raise CheckpointError(f"{parts[0]}: split.tensors.count is {expected} but the parts hold {len(tensors)}")
    return GGUFFile(parts, fields, tensors, types)


def iter_chunks_of(t: GGUFTensor, chunk: int = COPY_CHUNK) -> Iterator[FileRange]:
    """A stored tensor as FileRanges (for verbatim copies between GGUF files)."""
    for off in range(0, t.nbytes, chunk):
        yield FileRange(t.path, t.offset + off, min(chunk, t.nbytes - off))
