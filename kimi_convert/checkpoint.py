"""An HF safetensors checkpoint, opened by its headers only.

Every shard header is parsed and checked against the index and the file size before
any tensor byte is read; afterwards tensors are read by byte range (pread), never
memory-mapped, so the resident set does not grow with what has been read.
"""
from __future__ import annotations

import gc
import json
import math
import mmap
import os
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER = 512 << 20   # the real index-sized headers are a few MB; this rejects garbage lengths

DTYPE_SIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "U8": 1, "I8": 1, "I32": 4, "I64": 8,
              "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1, "U16": 2, "I16": 2, "U32": 4}
DTYPE_NAMES = {k: k for k in DTYPE_SIZE}     # one shared string object per dtype
NUMPY_DTYPE = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "U8": np.uint8,
               "I8": np.int8, "I32": np.int32, "I64": np.int64, "F64": np.float64}


@dataclass(frozen=True, slots=True)
class SourceTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    path: Path
    offset: int       # absolute byte offset in the shard
    nbytes: int

    def describe(self) -> str:
        return f"{self.name} ({self.dtype} {list(self.shape)} in {self.path.name})"


def read_shard_header(path: Path, shapes: dict | None = None) -> dict[str, SourceTensor]:
    """Parse and bounds-check one safetensors header.

    `shapes` (shared across shards) maps (dtype, *dims) to one (dtype, shape, nbytes) record:
    the real model's 497,220 tensors have 39 distinct ones, so the per-tensor records share
    them instead of each holding its own strings, tuple and ints.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: corrupt safetensors header (file too short)")
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER, size - 8):
                raise CheckpointError(f"{path}: corrupt safetensors header (length {n} > file)")
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: shard not found") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e.__class__.__name__})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not an object)")
    base = 8 + n
    shapes = {} if shapes is None else shapes
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        out[name] = _source_tensor(path, name, info, base, size, shapes)
    return out


def _source_tensor(path: Path, name: str, info, base: int, size: int, shapes: dict) -> SourceTensor:
    try:
        key = (info["dtype"], *info["shape"])
        begin, end = info["data_offsets"]
        known = shapes.get(key)
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}: corrupt safetensors header entry for tensor {name}") from None
    if known is None:
        known = shapes[key] = _shape_record(path, name, info)
    dtype, shape, nbytes = known
    try:
        if end - begin != nbytes or begin < 0:
            raise CheckpointError(f"{path}: tensor {name} spans {end - begin} bytes but "
                                  f"{dtype}{list(shape)} needs {nbytes}")
    except TypeError:
        raise CheckpointError(f"{path}: corrupt safetensors header entry for tensor {name}") from None
    if base + end > size:
        raise CheckpointError(f"{path}: truncated shard: tensor {name} ends at byte {base + end}, "
                              f"file has {size}")
    return SourceTensor(name, dtype, shape, path, base + begin, nbytes)


def _shape_record(path: Path, name: str, info: dict) -> tuple[str, tuple[int, ...], int]:
    dtype = info["dtype"]
    try:
        shape = tuple(int(x) for x in info["shape"])
    except (TypeError, ValueError):
        raise CheckpointError(f"{path}: corrupt safetensors header entry for tensor {name}") from None
    if dtype not in DTYPE_SIZE:
        raise CheckpointError(f"{path}: tensor {name} has unknown dtype {dtype}")
    return DTYPE_NAMES[dtype], shape, math.prod(shape) * DTYPE_SIZE[dtype]


@contextmanager
def _gc_paused():
    """Hundreds of thousands of long-lived records trigger repeated full collections that find
    nothing to free (a third of the load time of the real model's index); pause them meanwhile."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class Checkpoint:
    """config.json, the index and every shard header, validated against each other."""

    def __init__(self, hf_dir: Path):
        self.dir = Path(hf_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: not a directory")
        self.tensors: dict[str, SourceTensor] = {}
        with _gc_paused():
            weight_map = self._read_index()
            self.shards = sorted(set(weight_map.values()))
            self._read_shards(weight_map)

    def _read_index(self) -> dict[str, str]:
        index = self.dir / INDEX_NAME
        if not index.exists():
            if (self.dir / SINGLE_NAME).exists():
                return {n: SINGLE_NAME for n in read_shard_header(self.dir / SINGLE_NAME)}
            raise CheckpointError(f"{index}: not found (and no {SINGLE_NAME})")
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{index}: not a valid index ({e.__class__.__name__})") from None
        if not isinstance(wm, dict) or not wm:
            raise CheckpointError(f"{index}: empty weight_map")
        shard_names: dict[str, str] = {}
        for name, shard in wm.items():     # one string per shard, not one per tensor
            if not isinstance(shard, str):
                raise CheckpointError(f"{index}: tensor {name} maps to {shard!r}, not a shard file name")
            wm[name] = shard_names.setdefault(shard, shard)
        return wm

    def _read_shards(self, weight_map: dict[str, str]) -> None:
        """Each header's names are struck off the index as they are found (so the two are never
        both held whole); what is left at the end is indexed but in no shard."""
        shapes: dict = {}
        for shard in self.shards:
            path = self.dir / shard
            if not path.exists():
                raise CheckpointError(f"{path}: missing shard (named in {INDEX_NAME})")
            found = read_shard_header(path, shapes)
            for name in found:
                listed = weight_map.pop(name, None)
                if listed is None and name in self.tensors:
                    listed = self.tensors[name].path.name
                if listed != shard:
                    where = f"indexed in {listed}" if listed else f"not in {INDEX_NAME}"
                    raise CheckpointError(f"{path}: tensor {name} is in this shard but {where}")
            self.tensors.update(found)
        for name, shard in weight_map.items():
            raise CheckpointError(f"{self.dir / shard}: tensor {name} is in {INDEX_NAME} "
                                  f"but not in its shard")

    @property
    def shard_paths(self) -> list[Path]:
        return [self.dir / s for s in self.shards]

    # --- reading tensor bytes ---

    def read_raw(self, t: SourceTensor, offset: int = 0, length: int | None = None) -> bytes:
        length = t.nbytes - offset if length is None else length
        with open(t.path, "rb", buffering=0) as f:
            data = os.pread(f.fileno(), length, t.offset + offset)
        if len(data) != length:
            raise CheckpointError(f"{t.path}: truncated shard: tensor {t.name} cut short")
        return data

    def map(self, t: SourceTensor) -> np.ndarray:
        """The tensor as a read-only view of the page cache (no copy), for large streamed reads.

        Only the tensor's own pages are mapped; they are unmapped when the array is dropped,
        so the resident set stays at the tensors in use.
        """
        start = t.offset - t.offset % mmap.ALLOCATIONGRANULARITY
        with open(t.path, "rb", buffering=0) as f:
            if os.fstat(f.fileno()).st_size < t.offset + t.nbytes:    # a short map would SIGBUS
                raise CheckpointError(f"{t.path}: truncated shard: tensor {t.name} cut short")
            view = mmap.mmap(f.fileno(), t.offset + t.nbytes - start, offset=start, access=mmap.ACCESS_READ)
        data = np.frombuffer(view, dtype=NUMPY_DTYPE[t.dtype], offset=t.offset - start,
                             count=t.nbytes // DTYPE_SIZE[t.dtype])
        return data.reshape(t.shape)

    def will_need(self, t: SourceTensor) -> None:
        """Start reading t from disk in the background (the experts are read out of file order)."""
        fd = os.open(t.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, t.offset, t.nbytes, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)

    def read(self, t: SourceTensor) -> np.ndarray:
        """The tensor in its stored dtype (BF16 as uint16 bit patterns)."""
        return np.frombuffer(self.read_raw(t), dtype=NUMPY_DTYPE[t.dtype]).reshape(t.shape)

    def read_f32(self, t: SourceTensor) -> np.ndarray:
        return to_f32(self.read(t), t.dtype)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round to nearest even, as torch and ggml do; NaN stays NaN."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def to_f32(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return bf16_to_f32(values)
    return values.astype(np.float32)
