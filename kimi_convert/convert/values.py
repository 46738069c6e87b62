"""The values of a converted tensor, computed from the checkpoint alone: what kimi-convert writes, as f32.

Shared by verification (every tensor compared with these, bit for bit) and the streamed engine (kimi-imatrix
runs the model from the checkpoint on exactly the values the converted file would hold).
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np
from gguf import GGMLQuantizationType as QT

from . import mxfp4
from .checkpoint import Checkpoint, bf16_to_f32, f32_to_bf16
from ..model import KimiConfig


def round_to(values: np.ndarray, qtype: QT) -> np.ndarray:
    """What the converter storing f32 `values` as `qtype` gives back: RNE for BF16, the values otherwise
    (F32, and MXFP4, whose repack keeps the checkpoint's codes)."""
    return bf16_to_f32(f32_to_bf16(values)) if qtype == QT.BF16 else values


def converted_pieces(p, ckpt: Checkpoint, cfg: KimiConfig) -> Iterator[tuple[np.ndarray, Any]]:
    """(the f32 values the converter computes, in GGUF layout, before rounding to its output type; the index
    of the GGUF tensor's stored rows they stand for) of one planned tensor, in pieces bounded in size: its
    transform's (transforms.py)."""
    return p.rule.transform.pieces(p, ckpt, cfg)


def expert_values(p, ckpt: Checkpoint, e: int) -> np.ndarray:
    """Expert e of a stacked expert tensor [rows, cols], f32: MXFP4 decoded by its own definition (+0 for -0, as
    ggml's table has no -0), a float checkpoint's expert as stored."""
    group = p.sources[e]
    if len(group) == 2:
        return mxfp4.decode_compressed(ckpt.read(group[0]), ckpt.read(group[1])) + np.float32(0)
    return ckpt.read_f32(group[0])
