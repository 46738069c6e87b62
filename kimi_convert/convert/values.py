"""The values of a converted tensor, computed from the checkpoint alone: what kimi-convert writes, as f32.

Shared by verification (every tensor compared with these, bit for bit) and the streamed engine (kimi-imatrix
runs the model from the checkpoint on exactly the values the converted file would hold).
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np
from gguf import GGMLQuantizationType as QT

from . import mxfp4
from .checkpoint import NUMPY_DTYPE, Checkpoint, SourceTensor, bf16_to_f32, f32_to_bf16, to_f32
from .converter import ssm_a
from ..model import KimiConfig
from ..tensor_map import A_LOG, CONV1D, COPY, EXPERTS, K_B, RES_SCORE, V_B

CHUNK_ELEMS = 1 << 22            # elements produced at a time (16 MiB of f32)


def round_to(values: np.ndarray, qtype: QT) -> np.ndarray:
    """What the converter storing f32 `values` as `qtype` gives back: RNE for BF16, the values otherwise
    (F32, and MXFP4, whose repack keeps the checkpoint's codes)."""
    return bf16_to_f32(f32_to_bf16(values)) if qtype == QT.BF16 else values


def source_rows(src: SourceTensor, ckpt: Checkpoint, a: int, b: int) -> np.ndarray:
    row = src.nbytes // src.shape[0]
    raw = ckpt.read_raw(src, a * row, (b - a) * row)
    return to_f32(np.frombuffer(raw, dtype=NUMPY_DTYPE[src.dtype]), src.dtype)


def converted_pieces(p, ckpt: Checkpoint, cfg: KimiConfig) -> Iterator[tuple[np.ndarray, Any]]:
    """(the f32 values the converter computes, in GGUF layout, before rounding to its output type; the index
    of the GGUF tensor's stored rows they stand for) of one planned tensor, in pieces bounded in size."""
    tr = p.rule.transform
    if tr in (COPY, CONV1D):
        src = p.sources[0][0]
        if len(src.shape) < 2 or tr == CONV1D:
            yield ckpt.read_f32(src).reshape(-1), slice(None)
            return
        n_rows = src.shape[0]
        per = max(1, CHUNK_ELEMS // max(1, int(np.prod(src.shape[1:]))))
        for a in range(0, n_rows, per):
            b = min(n_rows, a + per)
            yield source_rows(src, ckpt, a, b), slice(a, b)
    elif tr == RES_SCORE:
        norm, proj = (ckpt.read_f32(s).reshape(-1) for s in p.sources[0])
        yield norm.astype(np.float32) * proj.astype(np.float32), slice(None)
    elif tr == A_LOG:
        yield ssm_a(ckpt.read_f32(p.sources[0][0]), cfg.n_head), slice(None)
    elif tr in (K_B, V_B):
        src = p.sources[0][0]
        kv = ckpt.read_f32(src).reshape(cfg.n_head, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        part = (kv[:, :cfg.qk_nope_head_dim, :].transpose(0, 2, 1) if tr == K_B
                else kv[:, cfg.qk_nope_head_dim:, :])
        yield np.ascontiguousarray(part).reshape(-1), slice(None)
    elif tr == EXPERTS:
        for e, group in enumerate(p.sources):
            if len(group) == 2:          # compressed-tensors MXFP4, decoded by its own definition
                exp = mxfp4.decode_compressed(ckpt.read(group[0]), ckpt.read(group[1]))
            else:
                exp = ckpt.read_f32(group[0])
            yield exp.reshape(-1), e
    else:
        raise AssertionError(f"unknown transform {tr}")


def expert_values(p, ckpt: Checkpoint, e: int) -> np.ndarray:
    """Expert e of a stacked expert tensor [rows, cols], f32: MXFP4 decoded by its own definition (+0 for -0, as
    ggml's table has no -0), a float checkpoint's expert as stored."""
    group = p.sources[e]
    if len(group) == 2:
        return mxfp4.decode_compressed(ckpt.read(group[0]), ckpt.read(group[1])) + np.float32(0)
    return ckpt.read_f32(group[0])
