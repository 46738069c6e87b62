"""ggml's CPU matrix products, computed in ggml's own order, so that a non-F32 file can be compared with
llama.cpp position by position (`Runtime(path, llama_cpp_rounding=...)`).

Two targets, named after the builds the interop tests run:

* ``X86_AVX2`` -- llama-cpp-python 0.3.36 as `.ci/install-interop.sh` builds it: x86-64-v3 (AVX2, FMA, F16C),
  tinyBLAS (GGML_LLAMAFILE) and weight repacking (GGML_CPU_REPACK) on, no AVX512/AMX. On every CPU it runs
  the paths below (sources: ggml/src/ggml-cpu/ of the sdist). Each is a fixed sequence of IEEE-754 single
  operations, and this module performs the same operations in the same order:

  - the activation is first converted to the weight type's vec_dot type (ggml-cpu.c type traits): bf16 by
    round-to-nearest-even for BF16 weights; Q8_0 for MXFP4, by arch/x86/quants.c `quantize_row_q8_0`
    (d = max/127 stored as fp16, q = round-half-even(x * (127/max)) -- not the reference 1/d and roundf);
  - `mul_mat` with >= 2 tokens, K % 8 == 0 and M % 4 == 0 goes to tinyBLAS (llamafile/sgemm.cpp): per
    output, 8 lanes, lane j sums elements j, j+8, ... one FMA at a time, then (l0+l4 + l2+l6) + (l1+l5 + l3+l7);
  - otherwise, and in `mul_mat_id` for unrepacked experts, `ggml_vec_dot_*` (vec.cpp): for bf16, 4x8 lanes over
    32-wide steps, ((c1+c3)+(c2+c4)) then the same 8-lane sum, and the K % 32 tail in double; for f32, 4x8 FMA
    lanes, ((c1+c3)+(c2+c4)), then (l0+l4 + l1+l5) + (l2+l6 + l3+l7), the tail in f32 FMAs;
  - repacked MXFP4 experts (arch/x86/repack.cpp gemv, M % 8 == 0): per 32-block an exact integer dot of the
    codes with the Q8_0 ints, then acc = fma(isum, 2^(e-128) * d_x, acc) block after block.

  A bf16 x bf16 product is exact in f32, so FMA and multiply-add agree there; an f32 x f32 FMA is computed
  in float64 (exact product) and rounded once -- it can differ from a hardware FMA only through double
  rounding, when the float64 sum lands on an f32 midpoint (not observed; below 1e-8 per operation).

* ``WASM`` -- wllama's llama.cpp b12211 (wasm SIMD, no tinyBLAS): the activation is converted with the
  reference Q8_0 (1/d, roundf) and bf16 rules, and the product is a float32 matmul in numpy's order. Its
  summation order is not emulated.

Other weight types (Q8_0, K-quants, ...) get the conversion of their vec_dot type and numpy's summation:
their kernels (AVX2 vec_dot_*_q8_*, tinyBLAS Q0, the tiled K-quant path) are not emulated here.

Cost: T x M x K products per matmul, computed in row chunks -- meant for fixture-sized files.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf.quants import np_roundf

from .checkpoint import bf16_to_f32, f32_to_bf16

F32, F64 = np.float32, np.float64

X86_AVX2 = "x86-avx2"      # llama-cpp-python, as .ci/install-interop.sh pins it
WASM = "wasm"              # wllama
TARGETS = (X86_AVX2, WASM)

Q8_0_BLOCK = 32
TINYBLAS_LANES = 8         # tinyBLAS<8, __m256, ...>: KN for f32 and bf16 on AVX2
VEC_DOT_STEP = 32          # GGML_F32_STEP / the bf16 loop: 4 registers of 8 lanes
PRODUCT_CHUNK = 1 << 22    # elements of T x M_chunk x K held at a time

_Q8_0_DOT = {QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.MXFP4, QT.IQ4_NL}
_Q8_K_DOT = {QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_XS, QT.IQ2_XXS, QT.IQ2_XS,
             QT.IQ2_S, QT.IQ3_XXS, QT.IQ3_S, QT.IQ1_S, QT.IQ1_M}


# ------------------------------------------------------------------------------------
# activation conversion (from_float of the vec_dot type)

def to_bf16(x: np.ndarray) -> np.ndarray:
    """ggml_compute_fp32_to_bf16: round to nearest even (as f32 values)."""
    return bf16_to_f32(f32_to_bf16(x)).reshape(np.shape(x))


def quantize_q8_0(x: np.ndarray, target: str) -> tuple[np.ndarray, np.ndarray]:
    """(q [..., nb, 32] integer-valued f32, d [..., nb, 1] the fp16 scale as f32) of x [..., K]."""
    b = np.ascontiguousarray(x, F32).reshape(*np.shape(x)[:-1], -1, Q8_0_BLOCK)
    amax = np.abs(b).max(-1, keepdims=True)
    d = (amax / F32(127)).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        if target == X86_AVX2:          # arch/x86/quants.c: id = 127/max, _mm256_round_ps (half to even)
            inv = np.where(amax == 0, F32(0), F32(127) / amax).astype(F32)
            q = np.rint(b * inv)
        else:                           # ggml-quants.c reference: id = 1/d, roundf (half away from zero)
            inv = np.where(d == 0, F32(0), F32(1) / d).astype(F32)
            q = np_roundf(b * inv)
    return q.astype(F32), d.astype(np.float16).astype(F32)


def vec_dot_input(x: np.ndarray, weight_type: QT, target: str) -> np.ndarray:
    """x as the values ggml's mul_mat multiplies against a weight of this type."""
    if weight_type == QT.BF16:
        return to_bf16(x)
    if weight_type == QT.F16:
        return np.asarray(x, F32).astype(np.float16).astype(F32)
    if weight_type in _Q8_0_DOT:
        q, d = quantize_q8_0(x, target)
        return (q * d).reshape(np.shape(x))
    if weight_type in _Q8_K_DOT:
        return q8_k_roundtrip(x)
    return np.asarray(x, F32)


def rounding_block_size(weight_type: QT) -> int:
    """How many activation elements one conversion decision covers: 0 for f32 (none), 1 for bf16/f16, else
    the block (32 for Q8_0, 256 for Q8_K)."""
    if weight_type == QT.F32:
        return 0
    if weight_type in (QT.BF16, QT.F16):
        return 1
    return 256 if weight_type in _Q8_K_DOT else Q8_0_BLOCK


def q8_k_roundtrip(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q8_K: per 256, scale by the signed extreme, round to int8, f32 scale."""
    b = np.ascontiguousarray(x, F32).reshape(-1, 256)
    extreme = np.take_along_axis(b, np.abs(b).argmax(axis=1)[:, None], axis=1)
    with np.errstate(divide="ignore"):
        iscale = np.where(extreme == 0, F32(0), F32(-127) / extreme).astype(F32)
    q = np.minimum(np.rint(b * iscale), 127)
    d = np.where(iscale == 0, F32(0), F32(1) / np.where(iscale == 0, F32(1), iscale)).astype(F32)
    return (q * d).astype(F32).reshape(np.shape(x))


# ------------------------------------------------------------------------------------
# summation orders

def _lane_sums(products: np.ndarray, lanes: int, fma: bool) -> np.ndarray:
    """[..., K] -> [..., lanes]: lane j adds elements j, j+lanes, ... in order (K % lanes == 0).

    bf16 products are exact in f32 and are added in f32; f32 products (fma=True) are float64 and each step
    rounds acc + product once, as an FMA does.
    """
    groups = products.reshape(*products.shape[:-1], -1, lanes)
    acc = groups[..., 0, :].astype(F32)
    for g in range(1, groups.shape[-2]):
        acc = (acc.astype(F64) + groups[..., g, :]).astype(F32) if fma else acc + groups[..., g, :]
    return acc


def _sum_8_lanes_tinyblas(acc: np.ndarray) -> np.ndarray:
    """hsum(__m256): v = hi128 + lo128, then (v0 + v2) + (v1 + v3)."""
    v = acc[..., 4:] + acc[..., :4]
    return (v[..., 0] + v[..., 2]) + (v[..., 1] + v[..., 3])


def _sum_8_lanes_hadd(acc: np.ndarray) -> np.ndarray:
    """GGML_F32x8_REDUCE's tail: t = lo128 + hi128, then two hadds: (t0 + t1) + (t2 + t3)."""
    t = acc[..., :4] + acc[..., 4:]
    return (t[..., 0] + t[..., 1]) + (t[..., 2] + t[..., 3])


def _products(x: np.ndarray, w: np.ndarray, fma: bool) -> np.ndarray:
    """[T, M, K] elementwise products (float64 when they are not exact in f32)."""
    dt = F64 if fma else F32
    return x.astype(dt)[:, None, :] * w.astype(dt)[None, :, :]


def _tinyblas(p: np.ndarray, fma: bool) -> np.ndarray:
    return _sum_8_lanes_tinyblas(_lane_sums(p, TINYBLAS_LANES, fma))


def _vec_dot_bf16(p: np.ndarray) -> np.ndarray:
    """ggml_vec_dot_bf16, AVX2: 4 registers x 8 lanes over 32-steps, the tail added in double."""
    n_main = p.shape[-1] - p.shape[-1] % VEC_DOT_STEP
    out = np.zeros(p.shape[:-1], F64)
    if n_main:
        regs = _lane_sums(p[..., :n_main], VEC_DOT_STEP, fma=False).reshape(*p.shape[:-1], 4, 8)
        c = (regs[..., 0, :] + regs[..., 2, :]) + (regs[..., 1, :] + regs[..., 3, :])
        out += _sum_8_lanes_tinyblas(c)
    for k in range(n_main, p.shape[-1]):
        out += p[..., k]
    return out.astype(F32)


def _vec_dot_f32(p: np.ndarray) -> np.ndarray:
    """ggml_vec_dot_f32, AVX2: 4 registers x 8 FMA lanes, GGML_F32x8_REDUCE, the tail in f32 FMAs."""
    n_main = p.shape[-1] - p.shape[-1] % VEC_DOT_STEP
    out = np.zeros(p.shape[:-1], F32)
    if n_main:
        regs = _lane_sums(p[..., :n_main], VEC_DOT_STEP, fma=True).reshape(*p.shape[:-1], 4, 8)
        out = _sum_8_lanes_hadd((regs[..., 0, :] + regs[..., 2, :]) + (regs[..., 1, :] + regs[..., 3, :]))
    for k in range(n_main, p.shape[-1]):
        out = (out.astype(F64) + p[..., k]).astype(F32)
    return out


def _chunked(x: np.ndarray, w: np.ndarray, kernel) -> np.ndarray:
    """kernel(x, w_rows) over row chunks of w, so that T x M_chunk x K stays below PRODUCT_CHUNK."""
    rows = max(1, PRODUCT_CHUNK // max(1, x.shape[0] * x.shape[1]))
    return np.concatenate([kernel(x, w[a:a + rows]) for a in range(0, w.shape[0], rows)], axis=-1)


# ------------------------------------------------------------------------------------
# the ops

def mul_mat(x: np.ndarray, w: np.ndarray, weight_type: QT, target: str, *,
            src1_contiguous: bool = True) -> np.ndarray:
    """ggml_mul_mat(W, x) -> [T, M] for x [T, K] (f32) and W [M, K] (its dequantised f32 values).

    src1_contiguous: whether ggml's src1 is a contiguous tensor (a permuted view is not); it decides whether
    an F32 weight can take tinyBLAS, which reads src1 in place.
    """
    x = np.asarray(x, F32)
    xr = vec_dot_input(x, weight_type, target)
    if target != X86_AVX2 or weight_type not in (QT.F32, QT.BF16):
        return (xr @ w.T).astype(F32)
    n_tok, k = x.shape
    fma = weight_type == QT.F32
    tiny = n_tok >= 2 and k % TINYBLAS_LANES == 0 and w.shape[0] % 4 == 0 and (src1_contiguous or not fma)
    if tiny:
        return _chunked(xr, w, lambda a, b: _tinyblas(_products(a, b, fma), fma))
    vec_dot = _vec_dot_f32 if fma else _vec_dot_bf16
    return _chunked(xr, w, lambda a, b: vec_dot(_products(a, b, fma)))


def mul_mat_id_row(x: np.ndarray, w: np.ndarray, weight_type: QT, target: str) -> np.ndarray:
    """One (token, expert) row of ggml_mul_mat_id: [M] for x [K] and the expert's W [M, K].

    MXFP4 experts with M % 8 == 0 live in the repack buffer (x86 gemv); others use vec_dot row by row.
    """
    x = np.asarray(x, F32).reshape(1, -1)
    if target == X86_AVX2 and weight_type == QT.MXFP4 and w.shape[0] % 8 == 0:
        return _repacked_gemv_mxfp4(x, w)[0]
    if target == X86_AVX2 and weight_type in (QT.F32, QT.BF16):
        fma = weight_type == QT.F32
        p = _products(vec_dot_input(x, weight_type, target), w, fma)
        return (_vec_dot_f32(p) if fma else _vec_dot_bf16(p))[0]
    return (vec_dot_input(x, weight_type, target) @ w.T)[0].astype(F32)


def _repacked_gemv_mxfp4(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """gemv_q4_b32_8x8_q8_0_lut_avx for MXFP4: acc = fma(isum_b, 2^(e_b-128) * d_b, acc) over blocks b.

    w's dequantised values are code * 2^(e-128) with integer codes, so sum_j w_j q_j is isum_b * 2^(e-128)
    exactly in float64, and times d_b (fp16) it stays exact: each block term is the FMA's exact product.
    """
    q, d = quantize_q8_0(x, X86_AVX2)                                  # [1, nb, 32], [1, nb, 1]
    wb = w.astype(F64).reshape(w.shape[0], -1, Q8_0_BLOCK)            # [M, nb, 32]
    terms = np.einsum("mbj,tbj->tmb", wb, q.astype(F64)) * d[..., 0].astype(F64)[:, None, :]
    acc = terms[..., 0].astype(F32)
    for b in range(1, terms.shape[-1]):
        acc = (acc.astype(F64) + terms[..., b]).astype(F32)
    return acc
