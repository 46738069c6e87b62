"""The file's weights for the reference: a quantized file's tensors dequantized, in checkpoint names."""
from __future__ import annotations

from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as QT

from ..convert.checkpoint import SourceTensor
from ..gguf_io import GGUFFile, GGUFTensor, same_shape
from ..tensor_map import CONV1D, COPY, EXPERTS, K_B, V_B
from .tensors import _gguf_values, is_quantized

# ------------------------------------------------------------------------------------
# the file's weights, for the reference (quantized files)

def file_weights(plan, gf: GGUFFile) -> dict[str, Callable[[slice | None], np.ndarray]]:
    """HF name -> rows of the file's values of that weight, dequantized and mapped back to the HF name and
    layout (inverting the plan's transform), for every weight whose values in the file are not the
    checkpoint's (quantized, or stored in a narrower float type): ReferenceModel's weight_overrides."""
    out: dict[str, Callable] = {}
    kv_b: dict[SourceTensor, dict[str, GGUFTensor]] = {}
    for p in plan.tensors:
        t = gf.tensors.get(p.name)
        if t is None or not same_shape(t.shape, p.shape) or not _lossy(p, t):
            continue
        t, tr, src = t.as_shape(p.shape), p.rule.transform, p.sources[0][0]
        if tr == EXPERTS:                # expert e: the GGUF's matrix e, in the HF layout already
            out |= {group[0].name: _rows_of(t, e) for e, group in enumerate(p.sources)}
        elif tr in (K_B, V_B):           # both halves of one kv_b
            kv_b.setdefault(src, {})[tr] = t
        elif tr == COPY and len(p.shape) == 2:
            out[src.name] = _rows_of(t, None)
        elif tr in (COPY, CONV1D):
            out[src.name] = lambda rows, t=t, shape=src.shape: _gguf_values(t).reshape(shape)[_all(rows)]
        # RES_SCORE (norm * proj) and A_LOG (-exp) have no HF tensor of their own; F32 in every file
    for src, halves in kv_b.items():
        out[src.name] = lambda rows, src=src, halves=halves: _kv_b_values(src, halves, plan)[_all(rows)]
    return out


def _lossy(p, t: GGUFTensor) -> bool:
    """The file holds other values than the checkpoint: quantized (F16 included), or BF16 rounded from an
    F32 or F16 source (MXFP4 codes times powers of two are BF16 values)."""
    if is_quantized(p, t):
        return True
    return t.qtype == QT.BF16 and any(s.dtype not in ("BF16", "U8") for group in p.sources for s in group)


def _all(rows: slice | None) -> slice:
    return slice(None) if rows is None else rows


def _rows_of(t: GGUFTensor, expert: int | None) -> Callable[[slice | None], np.ndarray]:
    """Rows of a 2-D tensor, or of expert `expert` of a stacked one, dequantized (only those rows)."""
    if expert is None:
        return lambda rows: _gguf_values(t, _all(rows))
    return lambda rows: _gguf_values(t, expert)[_all(rows)]


def _kv_b_values(src: SourceTensor, halves: dict[str, GGUFTensor], plan) -> np.ndarray:
    """kv_b [H*(d_n+d_v), r] with its k rows from attn_k_b (H, r, d_n) and its v rows from attn_v_b (H, d_v, r)
    where the file's differ; the other half from the checkpoint."""
    cfg = plan.config
    dn, dv, r = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    kv = plan.checkpoint.read_f32(src).reshape(cfg.n_head, dn + dv, r).copy()
    if K_B in halves:
        kv[:, :dn, :] = _gguf_values(halves[K_B]).reshape(cfg.n_head, r, dn).transpose(0, 2, 1)
    if V_B in halves:
        kv[:, dn:, :] = _gguf_values(halves[V_B]).reshape(cfg.n_head, dv, r)
    return kv.reshape(src.shape)
