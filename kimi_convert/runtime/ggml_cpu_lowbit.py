"""ggml's CPU products for the low-bit types, operation for operation: the i-quants on a codebook grid (IQ1_S,
IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S), the ternary TQ1_0 / TQ2_0, the 1-bit Q1_0 and NVFP4 -- on the
x86-64-v3 build of llama-cpp-python (arch/x86/quants.c and tiled/ of ggml-cpu), as kimi_convert.runtime.ggml_cpu_quant
does for the K-quants, whose helpers these kernels share.

Each raw block (uint8 [M, row bytes], layouts of ggml-common.h) is decoded to exact integer codes and scales;
the codebooks and the sign table are gguf-py's (gguf.quants), the format's own tables. On AVX2 none of these
types is repacked and tinyBLAS takes none of them (repack.cpp, llamafile/sgemm.cpp): the grid i-quants run the
tiled kernel with >= 8 src1 rows (tiled/tiled.cpp: the same per-256-block float steps as the K-quants, on the
tile's codes and scale) and their vec_dot otherwise; the others run their vec_dot always. Which kernel runs
where: docs/verification.md §8.4.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import quants as gguf_quants

from . import ggml_cpu_quant as gq
from ..gguf_io.qtypes import Q2_0, QUANT_SIZES
from .ggml_cpu_quant import F32, I64, QK, KBlocks, fma, hsum8, mul, to_f32

GRID_TYPES = (QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS, QT.IQ3_S, QT.IQ1_S, QT.IQ1_M)   # tiled / vec_dot
TERNARY_TYPES = (QT.TQ1_0, QT.TQ2_0)
Q8_K_TYPES = GRID_TYPES + TERNARY_TYPES        # vec_dot_type Q8_K (ggml-cpu.c type_traits_cpu)
Q8_0_TYPES = (QT.Q1_0, Q2_0, QT.NVFP4)        # vec_dot_type Q8_0
LOWBIT_TYPES = Q8_K_TYPES + Q8_0_TYPES

# The power of two each grid type's vec_dot multiplies its sum by last, and tiled/tiled.cpp folds into the
# tile's d (IQ1_*: the ternary codes are stored as 8 * grid + delta there, the delta being 1/8).
GRID_FACTOR = {QT.IQ2_XXS: 0.125, QT.IQ2_XS: 0.125, QT.IQ2_S: 0.125, QT.IQ3_XXS: 0.25, QT.IQ3_S: 1.0,
               QT.IQ1_S: 0.125, QT.IQ1_M: 0.125}
IQ1_DELTA = 0.125                  # IQ1S_DELTA = IQ1M_DELTA
Q1_0_BLOCK, Q2_0_BLOCK, NVFP4_BLOCK = (QUANT_SIZES[t][0] for t in (QT.Q1_0, Q2_0, QT.NVFP4))
assert Q1_0_BLOCK == 4 * QK and Q2_0_BLOCK == NVFP4_BLOCK == 2 * QK   # the Q8_0 blocks their kernels walk per block
TQ1_POW3 = np.array([1, 3, 9, 27, 81], I64)


# ------------------------------------------------------------------------------------
# the format's tables, from gguf-py

def _grid(cls) -> np.ndarray:
    """The codebook of a gguf-py grid class as int64 [entries, values per entry]."""
    cls.init_grid()
    return cls.grid.reshape(cls.grid_shape).astype(I64)


GRIDS = {QT.IQ2_XXS: _grid(gguf_quants.IQ2_XXS), QT.IQ2_XS: _grid(gguf_quants.IQ2_XS),
         QT.IQ2_S: _grid(gguf_quants.IQ2_S), QT.IQ3_XXS: _grid(gguf_quants.IQ3_XXS),
         QT.IQ3_S: _grid(gguf_quants.IQ3_S), QT.IQ1_S: _grid(gguf_quants.IQ1_S)}
GRIDS[QT.IQ1_M] = GRIDS[QT.IQ1_S]
# ksigns_iq2xs: 7 stored sign bits and the parity bit, as +-1 per element [128, 8]
_SIGN_BYTES = np.frombuffer(gguf_quants.IQ2_XXS.ksigns, np.uint8).astype(I64)
KSIGNS = 1 - 2 * ((_SIGN_BYTES[:, None] >> np.arange(8)) & 1)
KVALUES_FP4 = np.array(gguf_quants.NVFP4.kvalues, I64)          # kvalues_mxfp4: e2m1, doubled
UE4M3 = np.asarray(gguf_quants.NVFP4.ue4m3_to_fp32(np.arange(256, dtype=np.uint8)), F32)   # ggml_ue4m3_to_fp32


def _blocks(raw: np.ndarray, qtype: QT) -> np.ndarray:
    size = QUANT_SIZES[qtype][1]
    return np.ascontiguousarray(raw, np.uint8).reshape(raw.shape[0], -1, size)


def _f16(b: np.ndarray) -> np.ndarray:
    """fp16 from two bytes [..., 2] -> f32 [...]."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(F32)


def _u16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<u2").astype(I64)


def _u32(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<u4").astype(I64)


def _sign_bits(b: np.ndarray) -> np.ndarray:
    """+-1 per element from bytes whose bit j signs element j: [..., n] -> [..., n, 8]."""
    return 1 - 2 * ((b[..., None] >> np.arange(8)) & 1)


# ------------------------------------------------------------------------------------
# the grid i-quants

@dataclass
class GridBlocks:
    """A grid i-quant row set per 256-block b of row m: grid [M, nb, 256] the signed codebook values, delta
    [M, nb, 256] the +-1 of IQ1_S / IQ1_M (else None), scale [M, nb, n_sub] the odd integer sub-block scale
    (2 s + 1), d [M, nb] the fp16 scale. The value of an element is d * scale * (grid + delta / 8) * factor."""
    qtype: QT
    grid: np.ndarray
    delta: np.ndarray | None
    scale: np.ndarray
    d: np.ndarray

    @property
    def factor(self) -> float:
        return GRID_FACTOR[self.qtype]

    def vec_dot_blocks(self) -> KBlocks:
        """The codes and scales the AVX2 vec_dot multiplies (grid values; the IQ1 delta is a term of its own)."""
        return KBlocks(self.qtype, self.grid, self.scale, None, self.d, None)

    def tile_blocks(self) -> KBlocks:
        """tiled_unpack_src0's view: d * factor in f32, IQ1's codes 8 * grid + delta."""
        q = self.grid if self.delta is None else 8 * self.grid + self.delta
        return KBlocks(self.qtype, q, self.scale, None, mul(self.d, F32(self.factor)), None)


def _odd(s: np.ndarray) -> np.ndarray:
    return 2 * s + 1


def decode_iq2_xxs(blk: np.ndarray) -> GridBlocks:
    """block_iq2_xxs: d, then per 32 elements 4 grid bytes and a u32 of 4 x 7 sign bits and a 4-bit scale."""
    qs = blk[..., 2:].reshape(*blk.shape[:2], 8, 2, 4)
    aux = _u32(qs[..., 1, :])[..., 0]                                       # [M, nb, 8]
    grid = GRIDS[QT.IQ2_XXS][qs[..., 0, :].astype(I64)]                    # [M, nb, 8, 4, 8]
    signs = KSIGNS[(aux[..., None] >> (7 * np.arange(4))) & 127]
    return GridBlocks(QT.IQ2_XXS, (grid * signs).reshape(*blk.shape[:2], 256), None, _odd(aux >> 28),
                      _f16(blk[..., 0:2]))


def _nibble_scales(sc: np.ndarray) -> np.ndarray:
    """One byte per 32 elements, low nibble for the first 16 -> [.., 16] odd scales."""
    sc = sc.astype(I64)
    return _odd(np.stack([sc & 15, sc >> 4], -1).reshape(*sc.shape[:-1], -1))


def decode_iq2_xs(blk: np.ndarray) -> GridBlocks:
    """block_iq2_xs: d, u16 qs[32] (9-bit grid index, 7-bit sign index), scales[8] (two 4-bit per 32)."""
    q = _u16(blk[..., 2:66].reshape(*blk.shape[:2], 32, 2))[..., 0]
    values = GRIDS[QT.IQ2_XS][q & 511] * KSIGNS[q >> 9]
    return GridBlocks(QT.IQ2_XS, values.reshape(*blk.shape[:2], 256), None, _nibble_scales(blk[..., 66:74]),
                      _f16(blk[..., 0:2]))


def decode_iq2_s(blk: np.ndarray) -> GridBlocks:
    """block_iq2_s: d, qs[32] grid index low bits, signs[32] (one bit per element), qh[8] (2 high index bits
    per 8 elements), scales[8]."""
    lo = blk[..., 2:34].reshape(*blk.shape[:2], 8, 4).astype(I64)
    qh = blk[..., 66:74].astype(I64)
    idx = lo | (((qh[..., None] >> (2 * np.arange(4))) & 3) << 8)
    values = GRIDS[QT.IQ2_S][idx] * _sign_bits(blk[..., 34:66].reshape(*blk.shape[:2], 8, 4).astype(I64))
    return GridBlocks(QT.IQ2_S, values.reshape(*blk.shape[:2], 256), None, _nibble_scales(blk[..., 74:82]),
                      _f16(blk[..., 0:2]))


def decode_iq3_xxs(blk: np.ndarray) -> GridBlocks:
    """block_iq3_xxs: d, qs[64] grid indices (4 values each), then per 32 elements a u32 of 4 x 7 sign bits and
    a 4-bit scale."""
    grid = GRIDS[QT.IQ3_XXS][blk[..., 2:66].astype(I64)].reshape(*blk.shape[:2], 8, 4, 8)
    aux = _u32(blk[..., 66:98].reshape(*blk.shape[:2], 8, 4))[..., 0]
    signs = KSIGNS[(aux[..., None] >> (7 * np.arange(4))) & 127]
    return GridBlocks(QT.IQ3_XXS, (grid * signs).reshape(*blk.shape[:2], 256), None, _odd(aux >> 28),
                      _f16(blk[..., 0:2]))


def decode_iq3_s(blk: np.ndarray) -> GridBlocks:
    """block_iq3_s: d, qs[64] grid index low bytes, qh[8] (bit k: the 9th bit of index k of each 32),
    signs[32], scales[4] (two 4-bit per 64)."""
    lo = blk[..., 2:66].reshape(*blk.shape[:2], 8, 8).astype(I64)
    qh = blk[..., 66:74].astype(I64)
    idx = lo | (((qh[..., None] >> np.arange(8)) & 1) << 8)
    values = GRIDS[QT.IQ3_S][idx].reshape(*blk.shape[:2], 8, 4, 8)
    values = values * _sign_bits(blk[..., 74:106].reshape(*blk.shape[:2], 8, 4).astype(I64))
    sc = blk[..., 106:110].astype(I64)
    scale = _odd(np.stack([sc & 15, sc >> 4], -1).reshape(*blk.shape[:2], 8))
    return GridBlocks(QT.IQ3_S, values.reshape(*blk.shape[:2], 256), None, scale, _f16(blk[..., 0:2]))


def decode_iq1_s(blk: np.ndarray) -> GridBlocks:
    """block_iq1_s: d, qs[32] grid index low bytes, u16 qh[8]: per 32 elements 4 x 3 high index bits, a 3-bit
    scale and the delta's sign."""
    lo = blk[..., 2:34].reshape(*blk.shape[:2], 8, 4).astype(I64)
    qh = _u16(blk[..., 34:50].reshape(*blk.shape[:2], 8, 2))[..., 0]
    idx = lo | (((qh[..., None] >> (3 * np.arange(4))) & 7) << 8)
    grid = GRIDS[QT.IQ1_S][idx].reshape(*blk.shape[:2], 256)
    delta = np.repeat(1 - 2 * ((qh >> 15) & 1), 32, axis=-1)
    return GridBlocks(QT.IQ1_S, grid, delta, _odd((qh >> 12) & 7), _f16(blk[..., 0:2]))


def decode_iq1_m(blk: np.ndarray) -> GridBlocks:
    """block_iq1_m: qs[32], qh[16] (per 8 elements 3 high index bits and the delta's sign), u16 scales[4]: a
    3-bit scale per 16 elements, and the fp16 d in the four top nibbles."""
    lo = blk[..., 0:32].astype(I64)
    h = (blk[..., 32:48].astype(I64)[..., None] >> np.array([0, 4])).reshape(*blk.shape[:2], 32)
    grid = GRIDS[QT.IQ1_M][lo | ((h & 7) << 8)].reshape(*blk.shape[:2], 256)
    delta = np.repeat(1 - 2 * ((h >> 3) & 1), 8, axis=-1)
    sc = _u16(blk[..., 48:56].reshape(*blk.shape[:2], 4, 2))[..., 0]
    scale = _odd(((sc[..., None] >> (3 * np.arange(4))) & 7).reshape(*blk.shape[:2], 16))
    d16 = (sc[..., 0] >> 12) | ((sc[..., 1] >> 8) & 0xF0) | ((sc[..., 2] >> 4) & 0xF00) | (sc[..., 3] & 0xF000)
    return GridBlocks(QT.IQ1_M, grid, delta, scale, d16.astype(np.uint16).view(np.float16).astype(F32))


_GRID_DECODERS = {QT.IQ2_XXS: decode_iq2_xxs, QT.IQ2_XS: decode_iq2_xs, QT.IQ2_S: decode_iq2_s,
                  QT.IQ3_XXS: decode_iq3_xxs, QT.IQ3_S: decode_iq3_s, QT.IQ1_S: decode_iq1_s,
                  QT.IQ1_M: decode_iq1_m}


def decode_grid(raw: np.ndarray, qtype: QT) -> GridBlocks:
    return _GRID_DECODERS[qtype](_blocks(raw, qtype))


def vec_dot_grid(x: np.ndarray, gb: GridBlocks) -> np.ndarray:
    """ggml_vec_dot_<iq>_q8_K, AVX2, [T, M]. Per 256-block d = f32(d_w * d_x) and 8 int32 lanes (elements 4p..4p+3
    of each 32, times the scale of their 16 or 32); acc = fma(d, f32(lane), acc).
    IQ2_*, IQ3_*: factor * hsum8(acc).
    IQ1_S: a scalar acc1 = fma(d, f32(sum_32 delta * scale * bsum), acc1), then hsum8(acc) + 1/8 * acc1.
    IQ1_M: a second 8-lane accumulator of the delta * scale * (sum of 4 activations) lanes, then
    hsum8(acc) + 1/8 * hsum8(acc2)."""
    if gb.qtype == QT.IQ1_S:
        return _vec_dot_iq1_s(x, gb)
    qx, dx = gq.quantize_q8_k(x)
    lanes = gq.lane_ints(gb.vec_dot_blocks(), qx)
    lanes2 = None if gb.delta is None else gq.lane_ints(KBlocks(gb.qtype, gb.delta, gb.scale, None, gb.d, None), qx)
    acc = np.zeros((x.shape[0], gb.d.shape[0], 8), F32)
    acc2 = np.zeros_like(acc)
    for b in range(gb.d.shape[1]):
        d = mul(dx[:, None, b], gb.d[None, :, b])[..., None]
        acc = fma(d, to_f32(lanes[:, :, b]), acc)
        if lanes2 is not None:
            acc2 = fma(d, to_f32(lanes2[:, :, b]), acc2)
    if lanes2 is not None:
        return hsum8(acc) + mul(F32(IQ1_DELTA), hsum8(acc2))
    return mul(F32(gb.factor), hsum8(acc))


def _vec_dot_iq1_s(x: np.ndarray, gb: GridBlocks) -> np.ndarray:
    qx, dx = gq.quantize_q8_k(x)
    lanes = gq.lane_ints(gb.vec_dot_blocks(), qx)
    signed_scale = gb.scale * gb.delta[..., ::32]                               # [M, nb, 8]
    sumi1 = np.einsum("tbs,mbs->tmb", gq.bsums(qx, 32).astype(np.float64), signed_scale.astype(np.float64))
    acc = np.zeros((x.shape[0], gb.d.shape[0], 8), F32)
    acc1 = np.zeros((x.shape[0], gb.d.shape[0]), F32)
    for b in range(gb.d.shape[1]):
        d = mul(dx[:, None, b], gb.d[None, :, b])
        acc = fma(d[..., None], to_f32(lanes[:, :, b]), acc)
        acc1 = fma(d, to_f32(sumi1[:, :, b]), acc1)
    return hsum8(acc) + mul(F32(IQ1_DELTA), acc1)


def tiled_grid(x: np.ndarray, gb: GridBlocks) -> np.ndarray:
    """The tiled kernel (>= 8 src1 rows) on the tile's codes: the K-quants' float steps (ggml_cpu_quant.tiled)."""
    return gq.tiled(x, gb.tile_blocks())


# ------------------------------------------------------------------------------------
# TQ1_0, TQ2_0

@dataclass
class TernaryBlocks:
    """q [M, nb, 256]: the stored code 0..2 (value (q - 1) * d; TQ2_0's 2 bits may also hold 3), d [M, nb]."""
    qtype: QT
    q: np.ndarray
    d: np.ndarray


def _tq1_digits(b: np.ndarray, n_digits: int) -> np.ndarray:
    """Base-3 digits of TQ1_0 bytes, most significant first: ((b * 3^n mod 256) * 3) >> 8 -> [..., n, bytes]."""
    q = (b.astype(I64)[..., None, :] * TQ1_POW3[:n_digits, None]) & 255
    return (q * 3) >> 8


def decode_ternary(raw: np.ndarray, qtype: QT) -> TernaryBlocks:
    """block_tq1_0: qs[48] (5 digits a byte: elements 32n + j of the first 32 bytes, 160 + 16n + j of the next
    16), qh[4] (4 digits: 240 + 4n + j), d. block_tq2_0: qs[64] (2 bits: element 128 h + 32 l + j), d."""
    blk = _blocks(raw, qtype)
    lead = blk.shape[:2]
    if qtype == QT.TQ1_0:
        parts = (_tq1_digits(blk[..., 0:32], 5), _tq1_digits(blk[..., 32:48], 5), _tq1_digits(blk[..., 48:52], 4))
        q = np.concatenate([p.reshape(*lead, -1) for p in parts], -1)
        return TernaryBlocks(qtype, q, _f16(blk[..., 52:54]))
    qs = blk[..., 0:64].reshape(*lead, 2, 1, 32).astype(I64)
    q = (qs >> (2 * np.arange(4))[:, None]) & 3
    return TernaryBlocks(qtype, q.reshape(*lead, 256), _f16(blk[..., 64:66]))


def vec_dot_ternary(x: np.ndarray, tb: TernaryBlocks) -> np.ndarray:
    """ggml_vec_dot_tq{1,2}_0_q8_K, AVX2, [T, M]. The int16 sums pair into 8 int32 lanes: lane p = sum of q * y over
    elements 4p..4p+3 of every 32, minus bsums[2p] + bsums[2p+1] (the activations 32p..32p+31); per 256-block
    d = f32(d_x * d_w) and acc = fma(f32(lane), d, acc) (gcc contracts the mul and the add); hsum8."""
    qx, dx = gq.quantize_q8_k(x)
    ones = np.ones((*tb.d.shape, 8), I64)
    lanes = gq.lane_ints(KBlocks(tb.qtype, tb.q, ones, None, tb.d, None), qx)
    lanes = lanes - gq.bsums(qx, 32)[:, None].astype(np.float64)
    acc = np.zeros((x.shape[0], tb.d.shape[0], 8), F32)
    for b in range(tb.d.shape[1]):
        d = mul(dx[:, None, b], tb.d[None, :, b])[..., None]
        acc = fma(to_f32(lanes[:, :, b]), d, acc)
    return hsum8(acc)


# ------------------------------------------------------------------------------------
# Q1_0 and NVFP4 (Q8_0 activations)

def decode_q1_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """block_q1_0: (signs [M, nb, 128] +-1 -- bit j % 8 of byte j / 8 set is +1 --, d [M, nb] f32)."""
    blk = _blocks(raw, QT.Q1_0)
    signs = -_sign_bits(blk[..., 2:18].astype(I64)).reshape(*blk.shape[:2], Q1_0_BLOCK)
    return signs, _f16(blk[..., 0:2])


def dequantize_q1_0(raw: np.ndarray) -> np.ndarray:
    """dequantize_row_q1_0 (gguf-py has none) of raw blocks [..., row bytes]: d or -d per element, f32."""
    raw = np.asarray(raw, np.uint8)
    signs, d = decode_q1_0(raw.reshape(-1, raw.shape[-1]))
    return np.where(signs > 0, d[..., None], -d[..., None]).astype(F32).reshape(*raw.shape[:-1], -1)


def vec_dot_q1_0(x: np.ndarray, blocks: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """ggml_vec_dot_q1_0_q8_0, AVX2, [T, M]: per 128-block, over its 4 Q8_0 blocks k, 8 lanes (elements 4p..4p+3)
    of exact integer sums s_k; a = d_x0 * f32(s_0), a = fma(d_xk, f32(s_k), a) for k = 1..3; acc = fma(d_w, a,
    acc); hsum8."""
    signs, d = blocks
    qx, dx = gq.quantize_q8_0(x, gq.X86_AVX2)
    n_tok, (n_rows, nb) = x.shape[0], d.shape
    s = np.einsum("mbkle,tbkle->tmbkl", signs.reshape(n_rows, nb, 4, 8, 4).astype(np.float64),
                  qx.reshape(n_tok, nb, 4, 8, 4).astype(np.float64))
    dx = dx.reshape(n_tok, nb, 4)
    acc = np.zeros((n_tok, n_rows, 8), F32)
    for b in range(nb):
        a = mul(dx[:, None, b, 0, None], to_f32(s[:, :, b, 0]))
        for k in range(1, 4):
            a = fma(dx[:, None, b, k, None], to_f32(s[:, :, b, k]), a)
        acc = fma(d[None, :, b, None], a, acc)
    return hsum8(acc)


def decode_q2_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """block_q2_0: (codes [M, nb, 64] in -1..2 -- the 2 bits at (j % 4) * 2 of byte j / 4, minus 1 --, d [M, nb])."""
    blk = _blocks(raw, Q2_0)
    qs = blk[..., 2:18].astype(I64)
    codes = ((qs[..., None] >> np.array([0, 2, 4, 6])) & 3) - 1
    return codes.reshape(*blk.shape[:2], Q2_0_BLOCK), _f16(blk[..., 0:2])


def dequantize_q2_0(raw: np.ndarray) -> np.ndarray:
    """dequantize_row_q2_0 (gguf-py has none) of raw blocks [..., row bytes]: code * d, f32 (exact)."""
    raw = np.asarray(raw, np.uint8)
    codes, d = decode_q2_0(raw.reshape(-1, raw.shape[-1]))
    return (codes * d[..., None]).astype(F32).reshape(*raw.shape[:-1], -1)


def vec_dot_q2_0(x: np.ndarray, blocks: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """ggml_vec_dot_q2_0_q8_0 [T, M]: x86 runs ggml's generic C, with the two FMAs gcc contracts it to
    (libggml-cpu.so: vfmadd231ss): per 64-block, exact integer sums s_k of its 2 Q8_0 blocks,
    a = fma(d_xk, f32(s_k), a) from a = 0, then sum = fma(d_w, a, sum), block after block."""
    codes, d = blocks
    qx, dx = gq.quantize_q8_0(x, gq.X86_AVX2)
    n_tok, (n_rows, nb) = x.shape[0], d.shape
    s = np.einsum("mbke,tbke->tmbk", codes.reshape(n_rows, nb, 2, QK).astype(np.float64),
                  qx.reshape(n_tok, nb, 2, QK).astype(np.float64))
    dx = dx.reshape(n_tok, nb, 2)
    total = np.zeros((n_tok, n_rows), F32)
    for b in range(nb):
        a = mul(dx[:, None, b, 0], to_f32(s[:, :, b, 0]))
        a = fma(dx[:, None, b, 1], to_f32(s[:, :, b, 1]), a)
        total = fma(d[None, :, b], a, total)
    return total


def decode_nvfp4(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """block_nvfp4: (codes [M, nb, 64] kvalues_mxfp4 integers -- per 16, 8 low nibbles then 8 high --,
    scales [M, nb, 4] ggml_ue4m3_to_fp32 of d[4], which includes the 1/2 of the doubled codes)."""
    blk = _blocks(raw, QT.NVFP4)
    qs = blk[..., 4:36].reshape(*blk.shape[:2], 4, 8).astype(I64)
    codes = KVALUES_FP4[np.concatenate([qs & 15, qs >> 4], -1)].reshape(*blk.shape[:2], NVFP4_BLOCK)
    return codes, UE4M3[blk[..., 0:4]]


def vec_dot_nvfp4(x: np.ndarray, blocks: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """ggml_vec_dot_nvfp4_q8_0, AVX2, [T, M]: per 64-block s_j = f32(ue4m3_j * d_x) for its 16-sub-blocks (d_x of
    the Q8_0 block holding them); for each 32-half h, 8 lanes of exact integer sums of 4 elements, lanes 0-3 scaled
    by s_2h, 4-7 by s_2h+1: acc = fma(s, f32(lane), acc), half 0 then half 1; hsum8."""
    codes, scales = blocks
    qx, dx = gq.quantize_q8_0(x, gq.X86_AVX2)
    n_tok, (n_rows, nb) = x.shape[0], scales.shape[:2]
    lanes = np.einsum("mbhle,tbhle->tmbhl", codes.reshape(n_rows, nb, 2, 8, 4).astype(np.float64),
                      qx.reshape(n_tok, nb, 2, 8, 4).astype(np.float64))
    dx = dx.reshape(n_tok, nb, 2)
    acc = np.zeros((n_tok, n_rows, 8), F32)
    for b in range(nb):
        for h in range(2):
            s = mul(scales[None, :, b, 2 * h:2 * h + 2], dx[:, None, b, h, None])       # [T, M, 2]
            acc = fma(np.repeat(s, 4, axis=-1), to_f32(lanes[:, :, b, h]), acc)
    return hsum8(acc)


# ------------------------------------------------------------------------------------
# dispatch

def decode(raw: np.ndarray, qtype: QT):
    """The decoded blocks the kernels below take."""
    if qtype in GRID_TYPES:
        return decode_grid(raw, qtype)
    if qtype in TERNARY_TYPES:
        return decode_ternary(raw, qtype)
    if qtype == QT.Q1_0:
        return decode_q1_0(raw)
    if qtype == Q2_0:
        return decode_q2_0(raw)
    if qtype == QT.NVFP4:
        return decode_nvfp4(raw)
    raise ValueError(f"not a low-bit type: {qtype.name}")


def vec_dot(x: np.ndarray, qtype: QT, blocks) -> np.ndarray:
    """The type's AVX2 vec_dot, [T, M], on decode()'s blocks."""
    if qtype in GRID_TYPES:
        return vec_dot_grid(x, blocks)
    if qtype in TERNARY_TYPES:
        return vec_dot_ternary(x, blocks)
    if qtype == QT.Q1_0:
        return vec_dot_q1_0(x, blocks)
    return vec_dot_q2_0(x, blocks) if qtype == Q2_0 else vec_dot_nvfp4(x, blocks)

