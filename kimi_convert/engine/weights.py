"""Where the streamed engine reads a layer's weights: a kimi-k3 / kimi-k31 GGUF, or the HF checkpoint itself.

Both give the same thing: each GGUF tensor of a layer as float32 in numpy order (the GGUF's shape), with the ggml
type llama.cpp would multiply it as (which decides how the activation is rounded: `ops.vec_dot_round`). From a
checkpoint the values are the converter's (`convert.values`, rounded to the type kimi-convert stores: BF16, F32
for the `f32` rules, MXFP4 experts as they are), so a run from the checkpoint equals a run from its conversion,
and nothing is written.

A layer's tensors are read once, when first used; a routed expert is read when its turn comes and dropped after
(`expert`), so the engine holds one layer's dense weights plus one expert. `bytes_read` counts the bytes taken
from the files: every byte of the text model at most once per run.
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from ..constants import tname
from ..convert import mxfp4
from ..convert.converter import build_plan
from ..convert.values import converted_pieces, expert_values, round_to
from ..errors import CheckpointError
from ..gguf_io import GGUFFile, dequantize, open_gguf
from ..model import KimiConfig
from ..tensor_map import K_B, V_B, gguf_tensors

ROW_SLAB_BYTES = 16 << 20      # bytes of a 2-D tensor dequantized at a time for a row lookup


class WeightSource(Protocol):
    """A model the engine can run: its config, its tensors by GGUF name, the bytes it has read so far."""
    config: KimiConfig
    path: Path
    bytes_read: int

    def names(self) -> frozenset[str]: ...
    def qtype(self, name: str) -> QT: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def nbytes(self, name: str) -> int: ...
    def values(self, name: str) -> np.ndarray: ...
    def expert(self, name: str, e: int) -> np.ndarray: ...
    def rows(self, name: str, ids: np.ndarray) -> np.ndarray: ...


class GGUFSource:
    """A kimi-k3 / kimi-k31 GGUF, ours or llama.cpp's, of any type we read (split files by any part)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        gf = open_gguf(self.path)
        self.config = KimiConfig.from_gguf(gf.fields, gf.paths[0])
        # a tensor stored without its trailing ggml 1-dims (llama-quantize's) is read in our shape
        self.gf: GGUFFile = gf.with_shapes({n: s for n, (_, s) in gguf_tensors(self.config).items()})
        self.fields = gf.fields
        self.bytes_read = 0
        self._names = frozenset(self.gf.tensors)

    def names(self) -> frozenset[str]:
        return self._names

    def qtype(self, name: str) -> QT:
        return self.gf.tensors[name].qtype

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.gf.tensors[name].shape)

    def nbytes(self, name: str) -> int:
        return self.gf.tensors[name].nbytes

    def values(self, name: str) -> np.ndarray:
        t = self.gf.tensors[name]
        self.bytes_read += t.nbytes
        return np.asarray(t.to_float32(), np.float32).reshape(t.shape)

    def expert(self, name: str, e: int) -> np.ndarray:
        t = self.gf.tensors[name]
        raw = t.raw_bytes().reshape(t.shape[0], -1)[e].reshape(t.shape[1], -1)    # one expert's bytes
        self.bytes_read += raw.nbytes
        return decode(raw, t.qtype).reshape(t.shape[1:])

    def rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` of a 2-D tensor (the embedding lookup), read a slab at a time: the whole tensor once."""
        t = self.gf.tensors[name]
        raw = t.raw_bytes().reshape(t.shape[0], -1)
        out = np.empty((len(ids), t.shape[-1]), np.float32)
        step = max(1, ROW_SLAB_BYTES // raw.shape[1])
        for a in range(0, t.shape[0], step):
            hit = np.flatnonzero((ids >= a) & (ids < a + step))
            if len(hit):
                slab = np.asarray(dequantize(raw[a:a + step], t.qtype), np.float32).reshape(-1, t.shape[-1])
                out[hit] = slab[ids[hit] - a]
        self.bytes_read += t.nbytes
        return out


class CheckpointSource:
    """The HF checkpoint (96 shards on the real model), read through the converter's plan: vision dropped,
    MXFP4 experts decoded on the fly, every tensor exactly what kimi-convert would store."""

    def __init__(self, hf_dir: Path):
        self.path = Path(hf_dir)
        self.plan = build_plan(self.path)
        self.config = self.plan.config
        self.by_name = {p.name: p for p in self.plan.tensors}
        self._names = frozenset(self.by_name)     # asked for every tensor a layer touches: made once
        self.bytes_read = 0
        self._kv_b: tuple[str, np.ndarray] | None = None    # kv_b makes attn_k_b and attn_v_b: read it once

    def names(self) -> frozenset[str]:
        return self._names

    def qtype(self, name: str) -> QT:
        return self.by_name[name].qtype

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.by_name[name].shape)

    def nbytes(self, name: str) -> int:
        """Bytes read for the tensor; attn_v_b's source is attn_k_b's, counted (and read) with attn_k_b."""
        p = self.by_name[name]
        if p.rule.transform == V_B:
            return 0
        return sum(s.nbytes for group in p.sources for s in group)

    def values(self, name: str) -> np.ndarray:
        p = self.by_name[name]
        if p.rule.transform in (K_B, V_B):
            return self._kv_b_half(p)
        self.bytes_read += self.nbytes(name)
        flat = np.concatenate([np.asarray(v, np.float32).reshape(-1)
                               for v, _ in converted_pieces(p, self.plan.checkpoint, self.config)])
        return self._stored(flat, p).reshape(p.shape)

    @staticmethod
    def _stored(values: np.ndarray, p) -> np.ndarray:
        """The values as kimi-convert stores them: rounded to BF16 unless they already are (a BF16 source copied,
        which is most of the model: the rounding would cost a fifth of a layer's time for nothing)."""
        exact = all(s.dtype == "BF16" for group in p.sources for s in group) and p.rule.transform.moves_values
        return values if exact else round_to(values, p.qtype)

    def _kv_b_half(self, p) -> np.ndarray:
        """attn_k_b [H, r, d_n] or attn_v_b [H, d_v, r] from the one kv_b_proj read (its transform's half)."""
        src, cfg = p.sources[0][0], self.config
        if self._kv_b is None or self._kv_b[0] != src.name:
            self.bytes_read += src.nbytes
            kv = self.plan.checkpoint.read_f32(src)
            self._kv_b = (src.name, kv)
        return self._stored(np.ascontiguousarray(p.rule.transform.half(self._kv_b[1], cfg)), p)

    def expert(self, name: str, e: int) -> np.ndarray:
        p = self.by_name[name]
        group = p.sources[e]
        self.bytes_read += sum(s.nbytes for s in group)
        if len(group) == 2:                       # MXFP4 (packed codes, E8M0 scales): ggml's blocks, then decoded
            ckpt = self.plan.checkpoint
            return decode(mxfp4.repack(ckpt.read(group[0]), ckpt.read(group[1])), QT.MXFP4)
        return self._stored(expert_values(p, self.plan.checkpoint, e), p).reshape(p.shape[1:])

    def rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` of a 2-D tensor, from the converter's row pieces: the whole tensor read once."""
        p = self.by_name[name]
        out = np.empty((len(ids), p.shape[-1]), np.float32)
        for piece, index in converted_pieces(p, self.plan.checkpoint, self.config):
            piece = self._stored(np.asarray(piece, np.float32), p).reshape(-1, p.shape[-1])
            a = index.start or 0
            hit = np.flatnonzero((ids >= a) & (ids < a + len(piece)))
            out[hit] = piece[ids[hit] - a]
        self.bytes_read += self.nbytes(name)
        return out


def open_source(path: Path) -> WeightSource:
    """A checkpoint folder or a GGUF file (any part of a split one)."""
    path = Path(path)
    return CheckpointSource(path) if path.is_dir() else GGUFSource(path)


class Layer:
    """The tensors of layer il (None: the globals) on a device, read from the source once each."""

    def __init__(self, source: WeightSource, il: int | None, device: torch.device):
        self.source, self.il, self.device = source, il, device
        self._cache: dict[str, torch.Tensor] = {}

    def name(self, template: str) -> str:
        return tname(template, self.il)

    def has(self, template: str) -> bool:
        return self.name(template) in self.source.names()

    def qtype(self, template: str) -> QT:
        return self.source.qtype(self.name(template))

    def __call__(self, template: str) -> torch.Tensor:
        name = self.name(template)
        if name not in self._cache:
            if name not in self.source.names():
                raise CheckpointError(f"{self.source.path}: tensor {name} is missing")
            self._cache[name] = _tensor(self.source.values(name), self.device)
        return self._cache[name]

    def expert(self, template: str, e: int) -> torch.Tensor:
        """Expert e of a stacked tensor, not kept: the caller drops it after its tokens."""
        return _tensor(self.source.expert(self.name(template), int(e)), self.device)

    def drop(self) -> None:
        self._cache.clear()


def decode(raw: np.ndarray, qtype: QT) -> np.ndarray:
    """Stored rows -> float32, as ggml's to_float: the package's compiled dequantizers where it has them (MXFP4,
    whose experts are most of K3's bytes: 5x gguf-py's numpy), gguf-py's otherwise."""
    from ..quant.blocks import dequantize as quant_dequantize, supported_types
    if qtype in supported_types() or qtype == QT.MXFP4:
        return quant_dequantize(np.ascontiguousarray(raw), qtype)
    return np.asarray(dequantize(raw, qtype), np.float32)


def _tensor(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A torch tensor of f32 values; an F32 tensor read straight from the mapped file is copied (read-only)."""
    if not values.flags.writeable:
        values = values.copy()
    return torch.from_numpy(values).to(device)
