"""An HF safetensors checkpoint, opened by its headers only.

Every shard header is parsed and checked against the index and the file size before
any tensor byte is read; afterwards tensors are read by byte range (pread), never
memory-mapped, so the resident set does not grow with what has been read.
"""
from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import CheckpointError
from ..gcutil import gc_paused
from ..inputs import open_input, read_input, read_json  # noqa: F401  (open_input, read_input: here before)
from ..paths import Input
from .safetensors_header import DTYPE_BITS, read_header

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# the tokenizer's files (vocab.py reads them; checkpoint_inputs lists them among the inputs)
TIKTOKEN_FILE = "tiktoken.model"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# The real model's index is 59,764,096 bytes (497,220 tensors): 1 GiB is 18 times that, and a
# bigger file, parsed, would take tens of GB of RAM before any check could refuse it.
MAX_INDEX_BYTES = 1 << 30

DTYPE_SIZE = {dtype: bits // 8 for dtype, bits in DTYPE_BITS.items() if bits % 8 == 0}
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


def checkpoint_inputs(hf_dir: Path) -> list[Input]:
    """Every file of the checkpoint `hf_dir` a command reads: config.json, the index, the tokenizer's files
    (vocab.py) and every *.safetensors file there (the index's shards, and any other: no output may replace one
    either), for paths.refuse_overlap. Files that are not there are left to the check that reads them."""
    hf_dir = Path(hf_dir)
    named = [("config.json", "checkpoint's config"), (INDEX_NAME, "checkpoint's index"),
             (TIKTOKEN_FILE, "checkpoint's tokenizer"), (TOKENIZER_CONFIG_FILE, "checkpoint's tokenizer config"),
             (CHAT_TEMPLATE_FILE, "checkpoint's chat template")]
    try:
        shards = sorted(p for p in hf_dir.iterdir() if p.name.endswith(".safetensors"))
    except OSError:
        shards = []
    return [*(Input(hf_dir / name, what) for name, what in named), *(Input(p, "checkpoint shard") for p in shards)]


def is_plain_file_name(name) -> bool:
    """A file name inside the folder: no separator, not '.' or '..', not absolute."""
    return (isinstance(name, str) and name not in ("", ".", "..")
            and not any(c in name for c in ("/", "\\", "\0")))


# --- shard headers ----------------------------------------------------------------------------

def read_shard_header(path: Path, shapes: dict | None = None,
                      missing: str = "shard not found") -> dict[str, SourceTensor]:
    """Every tensor of one shard, its header validated completely (safetensors_header).

    `shapes` (shared across shards) keeps one TensorLayout per distinct (dtype, *dims): the real
    model's 497,220 tensors have 39, so the per-tensor records share them instead of each holding
    its own strings, tuple and ints.
    """
    with open_input(path, missing=missing) as (fd, size):
        base, entries = read_header(fd, size, path, shapes)
    out = {}
    for name, layout, begin in entries:
        out[name] = SourceTensor(name, layout.dtype, layout.shape, path, base + begin, layout.nbytes)
    return out


def _parse_index(index: Path) -> dict:
    """The weight_map of model.safetensors.index.json: {tensor name: shard file name}."""
    doc = read_json(index, MAX_INDEX_BYTES, bad="not a valid index: not JSON")
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict):
        raise CheckpointError(f"{index}: not a valid index: no weight_map object")
    if not wm:
        raise CheckpointError(f"{index}: empty weight_map")
    return wm


class Checkpoint:
    """config.json, the index and every shard header, validated against each other."""

    def __init__(self, hf_dir: Path):
        self.dir = Path(hf_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: not a directory")
        self.tensors: dict[str, SourceTensor] = {}
        with gc_paused():
            weight_map = self._read_index()
            self.shards = sorted(set(weight_map.values()))
            self._read_shards(weight_map)

    def _read_index(self) -> dict[str, str]:
        index = self.dir / INDEX_NAME
        if not os.path.lexists(index):
            if os.path.lexists(self.dir / SINGLE_NAME):
                return {n: SINGLE_NAME for n in read_shard_header(self.dir / SINGLE_NAME)}
            raise CheckpointError(f"{index}: not found (and no {SINGLE_NAME})")
        wm = _parse_index(index)
        shard_names: dict[str, str] = {}
        for name, shard in wm.items():     # one string per shard, not one per tensor
            known = shard_names.get(shard) if type(shard) is str else None
            if known is None:
                known = shard_names[shard] = self._shard_name(index, name, shard)
            wm[name] = known
        return wm

    def _shard_name(self, index: Path, tensor: str, shard) -> str:
        if not isinstance(shard, str):
            raise CheckpointError(f"{index}: tensor {tensor} maps to {shard!r}, not a shard file name")
        if not is_plain_file_name(shard):
            raise CheckpointError(f"{index}: tensor {tensor} maps to {shard!r}, not a plain file name "
                                  f"inside {self.dir} (no folder, '..' or absolute path)")
        return shard

    def _read_shards(self, weight_map: dict[str, str]) -> None:
        """Each header's names are struck off the index as they are found (so the two are never
        both held whole); what is left at the end is indexed but in no shard."""
        shapes: dict = {}
        for shard in self.shards:
            path = self.dir / shard
            found = read_shard_header(path, shapes, missing=f"missing shard (named in {INDEX_NAME})")
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
