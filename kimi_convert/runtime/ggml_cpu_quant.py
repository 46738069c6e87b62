"""ggml's CPU products for quantized weights, operation for operation (used by kimi_convert.runtime.ggml_cpu): the
x86-64-v3 build of llama-cpp-python, and at the end wllama's wasm build.

Every kernel below first converts the f32 activation to the weight type's vec_dot type (Q8_0, Q8_1 or Q8_K, by
the x86 rules of arch/x86/quants.c and arch/x86/repack.cpp), then takes exact integer dot products of the codes
(the AVX2 maddubs/madd chains never saturate on these ranges), and only then does float32 arithmetic. The
integer parts are computed here exactly (float64 or int64 hold them without rounding); the float32 part is a
short, fixed sequence of multiplies, FMAs and adds per output, done in the kernel's own order with
correctly rounded float32 results (`fma`, `add` and `to_f32` below). Which kernel runs, and how its lanes split
the integers, is in docs/verification.md §8.4; the sources are ggml/src/ggml-cpu/ of llama-cpp-python 0.3.36.

The 32-blocks with one scale (Q4_0, Q5_0, Q8_0, IQ4_NL, MXFP4) are used through their dequantised values:
d * code is exact in float32, so the float64 products below are the kernels' exact products. The K-quants (and
Q5_1) are decoded from their raw GGUF blocks (uint8 [M, row bytes]) to integer codes, scales and mins.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf.quants import np_roundf

F16, F32, F64, I64 = np.float16, np.float32, np.float64, np.int64
QK = 32           # Q8_0 / Q8_1 block
QK_K = 256        # K-quant and Q8_K block

X86_AVX2, WASM = "x86-avx2", "wasm"   # the targets of kimi_convert.runtime.ggml_cpu

KQUANTS = (QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_XS)
Q0_TYPES = (QT.Q4_0, QT.Q5_0, QT.Q8_0, QT.IQ4_NL)     # one fp16 scale per 32 codes, Q8_0 activation
REPACKED_TYPES = (QT.Q4_0, QT.IQ4_NL, QT.MXFP4, QT.Q4_K)   # ggml_repack_get_optimal_repack_type on AVX2
TILED_MIN_ROWS = 8                                    # ggml_tiled_min_batch
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], I64)


# ------------------------------------------------------------------------------------
# correctly rounded float32 arithmetic

def add(p: np.ndarray, c: np.ndarray) -> np.ndarray:
    """round_f32(p + c) for float64 p that holds an exact value (a product of two float32, an integer) and float32 c.

    This is what an FMA computes when p is its exact product. The float64 sum is rounded once more to float32,
    which is wrong only when it lands exactly on a float32 midpoint (its 29 low mantissa bits 1000...0) while the
    true sum is off it: those cases are found and resolved toward the true value (TwoSum's error term).
    """
    p, c = np.asarray(p, F64), np.asarray(c, F32).astype(F64)
    s = p + c
    r = s.astype(F32)
    suspect = ((s.view(np.uint64) & _LOW29) == _HALF29) | (np.abs(s) < _F32_TINY)
    if suspect.any():
        s, p, c = np.broadcast_arrays(s, p, c)
        b = s - p
        err = (p - (s - b)) + (c - b)                  # s + err == p + c exactly
        other = np.nextafter(r, np.where(s > r, F32(np.inf), F32(-np.inf)).astype(F32))
        tie = suspect & (s != r) & (s == (r.astype(F64) + other.astype(F64)) / 2) & (err != 0)
        r = np.where(tie & (np.sign(err) == np.sign(s - r.astype(F64))), other, r)
    return r.astype(F32)


_LOW29, _HALF29 = np.uint64((1 << 29) - 1), np.uint64(1 << 28)
_F32_TINY = float(np.finfo(F32).tiny)


def fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fmaf(a, b, c) for float32 a, b, c: the float64 product of two float32 is exact."""
    return add(np.asarray(a, F32).astype(F64) * np.asarray(b, F32).astype(F64), c)


def to_f32(i: np.ndarray) -> np.ndarray:
    """_mm256_cvtepi32_ps / (float) int of an integer held exactly in float64: round to nearest even."""
    return np.asarray(i, F64).astype(F32)


def mul(a, b) -> np.ndarray:
    """float32 a * b, rounded once."""
    return (np.asarray(a, F32).astype(F64) * np.asarray(b, F32).astype(F64)).astype(F32)


def hsum8(v: np.ndarray) -> np.ndarray:
    """hsum_float_8 (arch/x86/quants.c) and tinyBLAS's hsum(__m256): lanes l: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))."""
    h = v[..., 4:] + v[..., :4]
    return (h[..., 0] + h[..., 2]) + (h[..., 1] + h[..., 3])


def hsum4(v: np.ndarray) -> np.ndarray:
    """movehl + add, movehdup + add_ss on 4 lanes: (l0+l2) + (l1+l3)."""
    return (v[..., 0] + v[..., 2]) + (v[..., 1] + v[..., 3])


def _fp16(v) -> np.ndarray:
    return np.asarray(v, F32).astype(F16).astype(F32)


# ------------------------------------------------------------------------------------
# activation: f32 -> the vec_dot type

def quantize_q8_0(x: np.ndarray, target: str) -> tuple[np.ndarray, np.ndarray]:
    """(q [..., nb, 32] int64, d [..., nb] the stored fp16 scale as f32) of x [..., K].

    x86 (quantize_row_q8_0 and ggml_quantize_mat_q8_0_4x8 alike): id = 127/max, round half to even;
    the reference (ggml-quants.c, wllama): id = 1/d, roundf (half away from zero)."""
    b = np.ascontiguousarray(x, F32).reshape(*np.shape(x)[:-1], -1, QK)
    amax = np.abs(b).max(-1)
    d = (amax / F32(127)).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        if target == X86_AVX2:
            inv = np.where(amax == 0, F32(0), F32(127) / amax).astype(F32)
            q = np.rint(b * inv[..., None])
        else:
            inv = np.where(d == 0, F32(0), F32(1) / d).astype(F32)
            q = np_roundf(b * inv[..., None])
    return q.astype(I64), _fp16(d)


def quantize_q8_1(x: np.ndarray, target: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q, d, s) of quantize_row_q8_1: the Q8_0 codes and scale, and s = fp16(d * sum q) with the unrounded d."""
    q, d = quantize_q8_0(x, target)
    b = np.ascontiguousarray(x, F32).reshape(*np.shape(x)[:-1], -1, QK)
    d_raw = (np.abs(b).max(-1) / F32(127)).astype(F32)
    return q, d, _fp16(mul(d_raw, q.sum(-1)))


def quantize_q8_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(q [..., nb, 256] int64, d [..., nb] f32) of quantize_row_q8_K_ref (x86 and wllama use the reference): the
    scale is -127/max with max the first element of largest magnitude, q = round-half-even(x * iscale) <= 127.

    The repacked gemm's 4-row quantizer (ggml_quantize_mat_q8_K_4x8) takes +amax whenever it occurs; where that
    differs (+amax and -amax both in a block) it negates the codes and the scale together, which changes no
    product."""
    b = np.ascontiguousarray(x, F32).reshape(*np.shape(x)[:-1], -1, QK_K)
    amax = np.abs(b).max(-1)
    extreme = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)[..., 0]
    with np.errstate(divide="ignore"):
        iscale = np.where(amax == 0, F32(0), F32(-127) / extreme).astype(F32)
        d = np.where(amax == 0, F32(0), F32(1) / np.where(amax == 0, F32(1), iscale)).astype(F32)
    q = np.minimum(np.rint(b * iscale[..., None]), 127)
    return q.astype(I64), d


# ------------------------------------------------------------------------------------
# weights: raw blocks -> integer codes

@dataclass
class KBlocks:
    """A K-quant (or IQ4_XS) row set as the kernels see it, per 256-block b of row m.

    q [M, nb, 256]: the code each kernel multiplies (unsigned for Q2_K/Q4_K/Q5_K/Q6_K, signed for Q3_K/IQ4_XS);
    scale [M, nb, n_sub]: the integer sub-block scales; minimum [M, nb, n_sub] or None; d, dmin [M, nb] f32.
    offset: Q6_K's codes are stored as q + 32 (the value is (q - 32) * scale * d)."""
    qtype: QT
    q: np.ndarray
    scale: np.ndarray
    minimum: np.ndarray | None
    d: np.ndarray
    dmin: np.ndarray | None
    offset: int = 0

    @property
    def sub(self) -> int:
        return QK_K // self.scale.shape[-1]


def _f16_at(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[..., at:at + 2].copy().view(F16)[..., 0].astype(F32)


def _nibbles_k(qs: np.ndarray) -> np.ndarray:
    """[.., 128] bytes -> [.., 256]: per 64 elements, 32 low nibbles then 32 high nibbles (Q4_K, Q5_K)."""
    b = qs.reshape(*qs.shape[:-1], 4, 32).astype(I64)
    return np.stack([b & 15, b >> 4], axis=-2).reshape(*qs.shape[:-1], QK_K)


def _scale_min_k4(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """get_scale_min_k4 over the 12 packed bytes: (scales [.., 8], mins [.., 8])."""
    s = sc.astype(I64)
    lo_s, lo_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_s = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return np.concatenate([lo_s, hi_s], -1), np.concatenate([lo_m, hi_m], -1)


def _bits(h: np.ndarray, shifts) -> np.ndarray:
    return np.stack([(h >> s) & 1 for s in shifts], axis=-2)


def decode_k(raw: np.ndarray, qtype: QT) -> KBlocks:
    """Decode uint8 [M, row bytes] of a K-quant / IQ4_XS tensor (block layouts: ggml-common.h)."""
    from gguf import GGML_QUANT_SIZES  # noqa: PLC0415
    size = GGML_QUANT_SIZES[qtype][1]
    blk = np.ascontiguousarray(raw, np.uint8).reshape(raw.shape[0], -1, size)
    if qtype in (QT.Q4_K, QT.Q5_K):
        d, dmin = _f16_at(blk, 0), _f16_at(blk, 2)
        scale, minimum = _scale_min_k4(blk[..., 4:16])
        q = _nibbles_k(blk[..., -128:])
        if qtype == QT.Q5_K:
            qh = blk[..., 16:48].astype(I64)                                # bit 2j / 2j+1: elements 64j.. / 64j+32..
            q = q + 16 * _bits(qh, range(8)).reshape(q.shape)
        return KBlocks(qtype, q, scale, minimum, d, dmin)
    if qtype == QT.Q6_K:
        ql, qh = blk[..., 0:128].astype(I64), blk[..., 128:192].astype(I64)
        scale = blk[..., 192:208].view(np.int8).astype(I64)
        q = np.empty((*blk.shape[:2], QK_K), I64)
        for h in range(2):
            lo, hi = ql[..., 64 * h:64 * h + 64], qh[..., 32 * h:32 * h + 32]
            base = 128 * h
            q[..., base:base + 32] = (lo[..., :32] & 15) | ((hi & 3) << 4)
            q[..., base + 32:base + 64] = (lo[..., 32:] & 15) | (((hi >> 2) & 3) << 4)
            q[..., base + 64:base + 96] = (lo[..., :32] >> 4) | (((hi >> 4) & 3) << 4)
            q[..., base + 96:base + 128] = (lo[..., 32:] >> 4) | (((hi >> 6) & 3) << 4)
        return KBlocks(qtype, q, scale, None, _f16_at(blk, 208), None, offset=32)
    if qtype == QT.Q3_K:
        hmask, qs, sc = blk[..., 0:32].astype(I64), blk[..., 32:96].astype(I64), blk[..., 96:108].astype(I64)
        low = np.stack([(qs.reshape(*qs.shape[:-1], 2, 32) >> (2 * j)) & 3 for j in range(4)], -2)  # [.., 2, 4, 32]
        high = np.stack([np.stack([(hmask >> (4 * n + j)) & 1 for j in range(4)], -2) for n in range(2)], -3)
        q = (low - 4 * (1 - high)).reshape(*blk.shape[:2], QK_K)
        i = np.arange(16)
        low4 = np.where(i < 8, sc[..., i % 8] & 15, sc[..., i % 8] >> 4)
        scale = (low4 | (((sc[..., 8 + i % 4] >> (2 * (i // 4))) & 3) << 4)) - 32
        return KBlocks(qtype, q, scale, None, _f16_at(blk, 108), None)
    if qtype == QT.Q2_K:
        sc, qs = blk[..., 0:16].astype(I64), blk[..., 16:80].astype(I64)
        q = np.stack([(qs.reshape(*qs.shape[:-1], 2, 32) >> (2 * j)) & 3 for j in range(4)], -2)
        return KBlocks(qtype, q.reshape(*blk.shape[:2], QK_K), sc & 15, sc >> 4, _f16_at(blk, 80), _f16_at(blk, 82))
    if qtype == QT.IQ4_XS:
        sh = blk[..., 2:4].copy().view(np.uint16)[..., 0].astype(I64)
        sl = blk[..., 4:8].astype(I64)
        s = np.arange(8)
        ls = ((sl[..., s // 2] >> (4 * (s % 2))) & 15) | (((sh[..., None] >> (2 * s)) & 3) << 4)
        b = blk[..., 8:136].reshape(*blk.shape[:2], 8, 16).astype(I64)
        q = KVALUES_IQ4NL[np.concatenate([b & 15, b >> 4], -1)].reshape(*blk.shape[:2], QK_K)
        return KBlocks(qtype, q, ls - 32, None, _f16_at(blk, 0), None)
    raise ValueError(f"not a K-quant: {qtype.name}")


def decode_q5_1(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q [M, nb, 32] unsigned 0..31, d, m [M, nb]) of Q5_1 blocks (d, m fp16, qh u32, qs[16])."""
    blk = np.ascontiguousarray(raw, np.uint8).reshape(raw.shape[0], -1, 24)
    qh = blk[..., 4:8].copy().view(np.uint32)[..., 0].astype(I64)
    qs = blk[..., 8:24].astype(I64)
    low = np.concatenate([qs & 15, qs >> 4], -1)
    high = (qh[..., None] >> np.arange(32)) & 1
    return low | (high << 4), _f16_at(blk, 0), _f16_at(blk, 2)


# ------------------------------------------------------------------------------------
# Q8_0-activation kernels of the 32-blocks

def _q0_values(w: np.ndarray) -> np.ndarray:
    """The dequantised values [M, K] as float64 [M, nb, 8 lanes, 4]: d * code is exact (fp16 times a small integer)."""
    return np.asarray(w, F32).astype(F64).reshape(w.shape[0], -1, 8, 4)


def _x_values(x: np.ndarray, target: str) -> np.ndarray:
    q, d = quantize_q8_0(x, target)
    return (q * d[..., None].astype(F64)).astype(F64)                 # [T, nb, 32], exact


def q0_lanes(x: np.ndarray, w: np.ndarray, target: str) -> np.ndarray:
    """[T, M] by the 8-lane Q8_0 kernel: ggml_vec_dot_{q4_0,q5_0,q8_0}_q8_0 and tinyBLAS_Q0_AVX (any of the four).

    Lane p holds the integer sum of elements 4p..4p+3 of each block, times d_w * d_x (exact), accumulated by
    FMA block after block: acc_p = fma(d_w d_x, isum_p, acc_p); the result is hsum8 of the lanes.
    w: the weight's dequantised values [M, K] (Q4_0, Q5_0, Q8_0 or IQ4_NL)."""
    xv = _x_values(x, target).reshape(x.shape[0], -1, 8, 4)
    terms = np.einsum("mble,tble->tmbl", _q0_values(w), xv)           # exact: d_w d_x isum_p
    acc = np.zeros((x.shape[0], w.shape[0], 8), F32)
    for b in range(terms.shape[2]):
        acc = add(terms[:, :, b], acc)
    return hsum8(acc)


def vec_dot_paired(x: np.ndarray, w: np.ndarray, target: str) -> np.ndarray:
    """ggml_vec_dot_iq4_nl_q8_0 / ggml_vec_dot_mxfp4_q8_0, AVX2: even and odd blocks in two 8-lane accumulators,
    added, hsum8; an odd last block is added by the scalar tail sumf += d * isum (compiled as one FMA).
    w: the dequantised values [M, K]."""
    xv = _x_values(x, target).reshape(x.shape[0], -1, 8, 4)
    terms = np.einsum("mble,tble->tmbl", _q0_values(w), xv)
    nb = terms.shape[2]
    acc = [np.zeros((x.shape[0], w.shape[0], 8), F32) for _ in range(2)]
    for b in range(nb - nb % 2):
        acc[b % 2] = add(terms[:, :, b], acc[b % 2])
    out = hsum8(acc[0] + acc[1])
    if nb % 2:
        out = add(terms[:, :, -1].sum(-1), out)                        # d * (sumi1 + sumi2), exact product
    return out


def repacked_q4_b32(x: np.ndarray, w: np.ndarray, target: str) -> np.ndarray:
    """gemv/gemm_q4_b32_8x8_q8_0_lut_avx (Q4_0, IQ4_NL, MXFP4 repacked 8x8): per block an exact integer dot,
    then acc = fma(isum_b, d_w d_x, acc) block after block, for gemv and gemm alike.

    w: the dequantised f32 values [M, K]; code * scale is exact, so sum_j w_j q_j d_x is the FMA's exact product."""
    wv = np.asarray(w, F32).astype(F64).reshape(w.shape[0], -1, QK)
    terms = np.einsum("mbj,tbj->tmb", wv, _x_values(x, target))
    acc = np.zeros((x.shape[0], w.shape[0]), F32)
    for b in range(terms.shape[-1]):
        acc = add(terms[..., b], acc)
    return acc


def vec_dot_q5_1(x: np.ndarray, blocks: tuple[np.ndarray, np.ndarray, np.ndarray], target: str) -> np.ndarray:
    """ggml_vec_dot_q5_1_q8_1, AVX2: acc_p = fma(isum_p, d_x * d_y, acc_p) over blocks (lanes of 4 elements, unsigned
    codes), and a scalar summs += m * s (fp16 x fp16: exact); result hsum8(acc) + summs. blocks: decode_q5_1."""
    q, dw, m = blocks
    qx, dx, sx = quantize_q8_1(x, target)
    isum = np.einsum("mble,tble->tmbl", q.reshape(*q.shape[:2], 8, 4).astype(F64),
                     qx.reshape(*qx.shape[:2], 8, 4).astype(F64))
    acc = np.zeros((x.shape[0], q.shape[0], 8), F32)
    summs = np.zeros((x.shape[0], q.shape[0]), F32)
    for b in range(q.shape[1]):
        dd = mul(dw[None, :, b], dx[:, None, b])                       # exact: fp16 x fp16
        acc = fma(isum[:, :, b], dd[..., None], acc)
        summs = add(m[None, :, b].astype(F64) * sx[:, None, b].astype(F64), summs)
    return hsum8(acc) + summs


# ------------------------------------------------------------------------------------
# Q8_K-activation kernels

def _sub_dots(kb: KBlocks, qx: np.ndarray) -> np.ndarray:
    """[T, M, nb, n_sub]: exact integer dot of each sub-block (weight code times activation code)."""
    n_sub, sub = kb.scale.shape[-1], kb.sub
    w = kb.q.reshape(*kb.q.shape[:2], n_sub, sub).astype(F64)
    a = qx.reshape(*qx.shape[:2], n_sub, sub).astype(F64)
    return np.einsum("mbse,tbse->tmbs", w, a)


def bsums(qx: np.ndarray, width: int) -> np.ndarray:
    """[T, nb, 256 / width]: sums of the activation codes over `width` elements (Q8_K's bsums are 16-wide)."""
    return qx.reshape(*qx.shape[:2], -1, width).sum(-1)


def _s1_s2(kb: KBlocks, qx: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Per 256-block: s1 = sum_s scale_s (q - offset) . y and s2 = sum_s min_s bsum_s (exact integers)."""
    dots = _sub_dots(kb, qx)
    if kb.offset:
        dots = dots - kb.offset * bsums(qx, kb.sub)[:, None]
    s1 = (dots * kb.scale[None].astype(F64)).sum(-1)
    s2 = None
    if kb.minimum is not None:
        s2 = (bsums(qx, kb.sub)[:, None] * kb.minimum[None].astype(F64)).sum(-1)
    return s1, s2


def tiled(x: np.ndarray, kb: KBlocks) -> np.ndarray:
    """ggml_compute_forward_mul_mat_tiled (tiled/, AVX2 microtile), non-repacked K-quants with >= 8 src1 rows:
    per 256-block res = d * f32(s1), res = fma(-dmin, f32(s2), res) when there are mins, buf = fma(res, d_x, buf)."""
    qx, dx = quantize_q8_k(x)
    s1, s2 = _s1_s2(kb, qx)
    buf = np.zeros((x.shape[0], kb.q.shape[0]), F32)
    for b in range(kb.q.shape[1]):
        res = mul(kb.d[None, :, b], to_f32(s1[..., b]))
        if s2 is not None:
            res = fma(-kb.dmin[None, :, b], to_f32(s2[..., b]), res)
        buf = fma(res, dx[:, None, b], buf)
    return buf


def lane_ints(kb: KBlocks, qx: np.ndarray) -> np.ndarray:
    """[T, M, nb, 8] the 8 int32 lanes of the AVX2 K-quant vec_dots: lane p holds elements 4p..4p+3 of every
    32-element chunk, each times its sub-block scale."""
    w = kb.q.reshape(*kb.q.shape[:2], 8, 8, 4).astype(F64)
    a = qx.reshape(*qx.shape[:2], 8, 8, 4).astype(F64)
    dots = np.einsum("mbcle,tbcle->tmbcl", w, a)                      # [T, M, nb, chunk, lane]
    if kb.sub == 32:
        sc = kb.scale[:, :, :, None]                                    # one scale per chunk
    else:
        sc = kb.scale.reshape(*kb.scale.shape[:2], 8, 2)[..., np.arange(8) // 4]   # lanes 0-3 / 4-7: two sub-blocks
    return (dots * sc[None].astype(F64)).sum(-2)


def vec_dot_k(x: np.ndarray, kb: KBlocks) -> np.ndarray:
    """ggml_vec_dot_<type>_q8_K, AVX2, per 256-block: d = f32(y.d * x.d) (and dmin = -f32(y.d * x.dmin)),
    acc_p = fma(d, f32(lane_p), acc_p); then hsum8, plus the type's extra min accumulator."""
    qx, dx = quantize_q8_k(x)
    lanes = lane_ints(kb, qx)
    if kb.offset:                                                       # Q6_K: - 32 (bsum16[2p] sc[2p] + ...)
        pairs = (bsums(qx, 16)[:, None] * kb.scale[None].astype(F64)).reshape(*lanes.shape[:3], 8, 2).sum(-1)
        lanes = lanes - kb.offset * pairs
    n_tok, n_rows, nb = lanes.shape[:3]
    acc = np.zeros((n_tok, n_rows, 8), F32)
    acc_m = np.zeros((n_tok, n_rows, 4), F32)
    summs = np.zeros((n_tok, n_rows), F32)
    for b in range(nb):
        d = mul(dx[:, None, b], kb.d[None, :, b])[..., None]
        if kb.minimum is not None:
            dmin = -mul(dx[:, None, b], kb.dmin[None, :, b])
            mins = bsums(qx, 16)[:, None, b] * kb.minimum[None, :, b].astype(F64) if kb.sub == 16 else \
                bsums(qx, 32)[:, None, b] * kb.minimum[None, :, b].astype(F64)
            if kb.qtype == QT.Q2_K:                     # 8 lanes: m[2p] bsum[2p] + m[2p+1] bsum[2p+1], same acc
                acc = fma(dmin[..., None], to_f32(mins.reshape(n_tok, n_rows, 8, 2).sum(-1)), acc)
            elif kb.qtype == QT.Q4_K:                   # 4 lanes of a second accumulator
                acc_m = fma(dmin[..., None], to_f32(mins.reshape(n_tok, n_rows, 4, 2).sum(-1)), acc_m)
            else:                                       # Q5_K: the scalar summs += dmin * sum (one FMA)
                summs = fma(dmin, to_f32(mins.sum(-1)), summs)
        acc = fma(d, to_f32(lanes[:, :, b]), acc)
    out = hsum8(acc)
    if kb.qtype == QT.Q4_K:
        out = out + hsum4(acc_m)
    elif kb.qtype == QT.Q5_K:
        out = out + summs
    return out


def repacked_q4_k(x: np.ndarray, kb: KBlocks, gemm: bool) -> np.ndarray:
    """ggml_gemv / ggml_gemm_q4_K_8x8_q8_K, AVX2: acc = fma(f32(iacc), d_w * d_x, acc) and accm = fma(f32(imin),
    dmin_w * d_x, accm) -- once per 256-block in the gemv, once per pair of 32-sub-blocks in the gemm -- and the
    result acc - accm."""
    qx, dx = quantize_q8_k(x)
    dots = _sub_dots(kb, qx) * kb.scale[None].astype(F64)               # [T, M, nb, 8]
    mins = bsums(qx, 32)[:, None] * kb.minimum[None].astype(F64)
    group = 2 if gemm else 8
    n_tok, n_rows, nb = dots.shape[:3]
    dots = dots.reshape(n_tok, n_rows, nb, -1, group).sum(-1)
    mins = mins.reshape(n_tok, n_rows, nb, -1, group).sum(-1)
    acc = np.zeros((n_tok, n_rows), F32)
    accm = np.zeros((n_tok, n_rows), F32)
    for b in range(nb):
        ds = mul(kb.d[None, :, b], dx[:, None, b])
        dms = mul(kb.dmin[None, :, b], dx[:, None, b])
        for g in range(dots.shape[3]):
            acc = fma(to_f32(dots[:, :, b, g]), ds, acc)
            accm = fma(to_f32(mins[:, :, b, g]), dms, accm)
    return acc - accm


# ------------------------------------------------------------------------------------
# wllama's llama.cpp b12211 (wasm SIMD128): every matmul is a vec_dot per output (no tinyBLAS, no repacking, no
# tiled path). Its kernels were read from the shipped wllama.wasm (wasm-objdump -d; the function names are in
# the binary): the float work of the 32-block types, Q2_K, Q5_1 and IQ4_XS is the generic C code's (scalar, in
# order, no FMA); F32 (and F16, which multiplies the f32 activation unrounded) runs a 4 x 4-lane SIMD dot.

def wasm_vec_dot_f32(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """[T, M] of b12211's ggml_vec_dot_f32 (and of ggml_vec_dot_f16_f32 below 64 elements): 4 accumulators of 4
    lanes over 16-element steps, acc = acc + x*y (two roundings), (a1+a3) + (a0+a2), lanes ((l0+l1)+l2)+l3, then
    the K % 16 tail added element by element."""
    x, w = np.asarray(x, F32), np.asarray(w, F32)
    n_main = x.shape[-1] - x.shape[-1] % 16
    acc = np.zeros((x.shape[0], w.shape[0], 4, 4), F32)
    for i in range(0, n_main, 16):
        acc = acc + x[:, None, i:i + 16].reshape(x.shape[0], 1, 4, 4) * w[None, :, i:i + 16].reshape(1, -1, 4, 4)
    v = (acc[..., 1, :] + acc[..., 3, :]) + (acc[..., 0, :] + acc[..., 2, :])
    out = ((v[..., 0] + v[..., 1]) + v[..., 2]) + v[..., 3]
    for k in range(n_main, x.shape[-1]):
        out = out + x[:, None, k] * w[None, :, k]
    return out


def wasm_vec_dot_bf16(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The generic ggml_vec_dot_bf16: the exact bf16 x bf16 products summed in double, element by element."""
    p = np.asarray(x, F32).astype(F64)[:, None, :] * np.asarray(w, F32).astype(F64)[None, :, :]
    return np.cumsum(p, axis=-1)[..., -1].astype(F32)


def wasm_q0(x: np.ndarray, w: np.ndarray, qtype: QT) -> np.ndarray:
    """The generic vec_dot of the 32-blocks (Q5_0, Q8_0, IQ4_NL, MXFP4): sumf += isum * d, block after block, with
    the block scale d = d_w d_x exact; Q4_0 rounds twice: sumf += (isum * d_w) * d_x."""
    xq, xd = quantize_q8_0(x, WASM)
    wv = np.asarray(w, F32).astype(F64).reshape(w.shape[0], -1, QK)
    terms = np.einsum("mbj,tbj->tmb", wv, xq.astype(F64))             # d_w * isum, exact
    if qtype == QT.Q4_0:
        terms = terms.astype(F32).astype(F64) * xd[:, None, :].astype(F64)
    else:
        terms = terms * xd[:, None, :].astype(F64)
    terms = terms.astype(F32)
    out = np.zeros(terms.shape[:2], F32)
    for b in range(terms.shape[-1]):
        out = out + terms[..., b]
    return out


def wasm_q5_1(x: np.ndarray, blocks: tuple[np.ndarray, np.ndarray, np.ndarray]) -> np.ndarray:
    """The generic ggml_vec_dot_q5_1_q8_1: sumf += (d_w d_x) * isum + m * s."""
    q, dw, m = blocks
    qx, dx, sx = quantize_q8_1(x, WASM)
    isum = np.einsum("mbj,tbj->tmb", q.astype(F64), qx.astype(F64))
    out = np.zeros(isum.shape[:2], F32)
    for b in range(q.shape[1]):
        a = mul(mul(dw[None, :, b], dx[:, None, b]), to_f32(isum[..., b]))
        out = out + (a + mul(m[None, :, b], sx[:, None, b]))
    return out


def wasm_q2_k(x: np.ndarray, kb: KBlocks) -> np.ndarray:
    """The generic ggml_vec_dot_q2_K_q8_K: sumf += dall * isum - dmin * summs per 256-block."""
    qx, dx = quantize_q8_k(x)
    s1, s2 = _s1_s2(kb, qx)
    out = np.zeros(s1.shape[:2], F32)
    for b in range(s1.shape[-1]):
        dall, dmin = mul(dx[:, None, b], kb.d[None, :, b]), mul(dx[:, None, b], kb.dmin[None, :, b])
        out = out + (mul(dall, to_f32(s1[..., b])) - mul(dmin, to_f32(s2[..., b])))
    return out


def wasm_iq4_xs(x: np.ndarray, kb: KBlocks) -> np.ndarray:
    """The generic ggml_vec_dot_iq4_xs_q8_K: d1 = (d_w d_x) * (ls - 32), sumf += d1 * isum per 32 elements."""
    qx, dx = quantize_q8_k(x)
    dots = _sub_dots(kb, qx)
    out = np.zeros(dots.shape[:2], F32)
    for b in range(dots.shape[2]):
        d4d8 = mul(kb.d[None, :, b], dx[:, None, b])
        for s in range(dots.shape[3]):
            out = out + mul(mul(d4d8, kb.scale[None, :, b, s].astype(F32)), to_f32(dots[:, :, b, s]))
    return out
