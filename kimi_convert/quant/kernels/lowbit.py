"""The simple low-bit types, none of which uses an imatrix: Q1_0 (signs, 128-value blocks) and Q2_0 (ternary codes,
64), with one fp16 scale each; TQ1_0 and TQ2_0 (ternary, 256); MXFP4 (E2M1 codes, 32, an E8M0 scale) and NVFP4
(E2M1 codes, 64, four UE4M3 scales). Plus the dequantizers of Q1_0 and Q2_0, which gguf-py lacks.

ggml rounds these with libm calls (roundf, lroundf, log2f: glibc's, on x86-64). roundf is common.roundf; the
integer conversions of their results are written out where ggml's input can make them overflow (NaN, inf, and
values past the block's maximum after a NaN); log2f is glibc's log2f itself (numba calls it for float32)."""
from __future__ import annotations

import numpy as np
from numba import njit

from .common import F32, HALF, INLINE, JIT, QK_K, bits_f32, f32_bits, get_fp16, put_fp16, roundf

_INT_RANGE = F32(2.0**31)      # float32 values whose C (int) conversion is exact are below this in magnitude


# ====================================================================================================
# Q1_0, Q2_0
# ====================================================================================================

@njit(**JIT)
def q1_0_rows(x, out):
    """quantize_row_q1_0_ref: d = fp16(sum|x| / 128), summed in order; bit j of the block is x_j >= 0
    (so -0.0 sets it and NaN does not), element j at bit j%8 of byte j/8."""
    n_rows, n = x.shape
    for r in range(n_rows):
        xr = x[r]
        y = out[r]
        for ib in range(n // 128):
            o = 128 * ib
            xs = xr[o:o + 128]
            s = F32(0.0)
            for j in range(128):
                s += abs(xs[j])
            p = 18 * ib
            put_fp16(y, p, s / F32(128.0))
            for k in range(16):
                byte = 0
                for b in range(8):
                    if xs[8 * k + b] >= 0:
                        byte |= 1 << b
                y[p + 2 + k] = byte


@njit(**JIT)
def q2_0_rows(x, out):
    """quantize_row_q2_0_ref: d = amax (NaN passed over), q = clamp((int)roundf(x/d) + 1, 0, 3) with the float32
    1/d (0 unless d > 0), element j at bits 2(j%4) of byte j/4. |x/d| <= 1, so code 3 (+2d) is never written;
    a NaN or infinite x/d converts to INT_MIN and takes code 0, as in C."""
    n_rows, n = x.shape
    for r in range(n_rows):
        xr = x[r]
        y = out[r]
        for ib in range(n // 64):
            o = 64 * ib
            xs = xr[o:o + 64]
            amax = F32(0.0)
            for j in range(64):
                a = abs(xs[j])
                if a > amax:
                    amax = a
            idd = F32(1.0) / amax if amax > 0 else F32(0.0)
            p = 18 * ib
            put_fp16(y, p, amax)
            for k in range(16):
                byte = 0
                for b in range(4):
                    v = roundf(xs[4 * k + b] * idd)
                    q = 0 if not abs(v) < _INT_RANGE else min(3, max(0, np.int64(v) + 1))
                    byte |= q << (2 * b)
                y[p + 2 + k] = byte


@njit(**JIT)
def q1_0_to_f32_rows(q, out):
    """dequantize_row_q1_0: d where the bit is set, -d where it is not."""
    n_rows, n = out.shape
    for r in range(n_rows):
        qr = q[r]
        y = out[r]
        for ib in range(n // 128):
            p = 18 * ib
            d = get_fp16(qr, p)
            for j in range(128):
                y[128 * ib + j] = d if (qr[p + 2 + j // 8] >> (j % 8)) & 1 else -d


# ggml_e8m0_to_fp32_half of every E8M0 byte (2^(e-128), the subnormals for e < 2 included), and the doubled E2M1 table
_E8M0_HALF = np.where(np.arange(256) < 2, np.uint32(0x00200000) << np.arange(256, dtype=np.uint32),
                      (np.arange(256, dtype=np.uint32) - 1) << np.uint32(23)).astype(np.uint32).view(np.float32)
_MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)


@njit(**JIT)
def mxfp4_to_f32_rows(q, out):
    """dequantize_row_mxfp4: per 17-byte block, kvalues[code] * e8m0_half(e); byte j holds element j (low nibble)
    and j + 16 (high). A table lookup a value: 10-20x gguf-py's numpy (the MXFP4 experts are re-quantized from
    it, and kimi-imatrix multiplies by it)."""
    n_rows, n = out.shape
    for r in range(n_rows):
        qr = q[r]
        y = out[r]
        for ib in range(n // 32):
            p = 17 * ib
            d = _E8M0_HALF[qr[p]]
            for j in range(16):
                b = qr[p + 1 + j]
                y[32 * ib + j] = _MXFP4_VALUES[b & 15] * d
                y[32 * ib + 16 + j] = _MXFP4_VALUES[b >> 4] * d


@njit(**JIT)
def q2_0_to_f32_rows(q, out):
    """dequantize_row_q2_0: (code - 1) * d."""
    n_rows, n = out.shape
    for r in range(n_rows):
        qr = q[r]
        y = out[r]
        for ib in range(n // 64):
            p = 18 * ib
            d = get_fp16(qr, p)
            for j in range(64):
                y[64 * ib + j] = F32(np.int64((qr[p + 2 + j // 4] >> (2 * (j % 4))) & 3) - 1) * d


# ====================================================================================================
# TQ1_0, TQ2_0
# ====================================================================================================

@njit(**INLINE)
def _trit(v):
    """lroundf(v) + 1 modulo 256, all of it ggml's uint8_t packing keeps. glibc's lroundf gives LONG_MIN (0 mod 256)
    for NaN, inf and |v| >= 2^63, and a float32 of magnitude >= 2^31 is a multiple of 256: both leave 1."""
    if not abs(v) < _INT_RANGE:
        return 1
    return (np.int64(roundf(v)) + 1) & 0xFF


@njit(**INLINE)
def _ternary_scale(xs):
    """(d, 1/d) of quantize_row_tq1_0_ref / tq2_0_ref: d = MAX(amax, |x|) over the block in order (a NaN is
    taken, then dropped by the next value), 1/d unless d is 0 (NaN gives NaN)."""
    amax = F32(0.0)
    for j in range(QK_K):
        a = abs(xs[j])
        amax = amax if amax > a else a
    return amax, (F32(1.0) / amax if amax != 0 else F32(0.0))


@njit(**JIT)
def tq1_0_rows(x, out):
    """quantize_row_tq1_0_ref: trits t = lroundf(x*id) + 1 (x*id, not x/d), five a byte as sum t_n 3^(4-n), then
    stored as ceil(q*256/243): bytes 0-31 hold elements m + 32n (n < 5), bytes 32-47 elements 160 + m + 16n, the
    4 qh bytes (48-51) elements 240 + m + 4n (n < 4, times 3); fp16 d at 52."""
    n_rows, n = x.shape
    for r in range(n_rows):
        xr = x[r]
        y = out[r]
        for ib in range(n // QK_K):
            xs = xr[QK_K * ib:QK_K * (ib + 1)]
            d, idd = _ternary_scale(xs)
            p = 54 * ib
            for m in range(32):
                q = 0
                for k in range(5):
                    q = (q * 3 + _trit(xs[m + 32 * k] * idd)) & 0xFF
                y[p + m] = ((q * 256 + 242) // 243) & 0xFF
            for m in range(16):
                q = 0
                for k in range(5):
                    q = (q * 3 + _trit(xs[160 + m + 16 * k] * idd)) & 0xFF
                y[p + 32 + m] = ((q * 256 + 242) // 243) & 0xFF
            for m in range(4):
                q = 0
                for k in range(4):
                    q = (q * 3 + _trit(xs[240 + m + 4 * k] * idd)) & 0xFF
                q = (q * 3) & 0xFF
                y[p + 48 + m] = ((q * 256 + 242) // 243) & 0xFF
            put_fp16(y, p + 52, d)


@njit(**JIT)
def tq2_0_rows(x, out):
    """quantize_row_tq2_0_ref: trits as TQ1_0's, 2 bits each: byte m of each 32 (of 64) holds elements
    m + 32n (n < 4) of its 128 at bits 2n; fp16 d at 64."""
    n_rows, n = x.shape
    for r in range(n_rows):
        xr = x[r]
        y = out[r]
        for ib in range(n // QK_K):
            xs = xr[QK_K * ib:QK_K * (ib + 1)]
            d, idd = _ternary_scale(xs)
            p = 66 * ib
            for half in range(2):
                for m in range(32):
                    q = 0
                    for k in range(4):
                        q |= (_trit(xs[128 * half + m + 32 * k] * idd) & 3) << (2 * k)
                    y[p + 32 * half + m] = q
            put_fp16(y, p + 64, d)


# ====================================================================================================
# MXFP4, NVFP4
# ====================================================================================================

# kvalues_mxfp4[0:8] (ggml-common.h): the E2M1 values doubled; [8:16] are the same negated (index 8 is -0)
E2M1_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12], np.float32)


def _ue4m3_half_table() -> np.ndarray:
    """ggml_ue4m3_to_fp32 of every byte: unsigned E4M3 (bias 7, 3 mantissa bits), halved for the doubled E2M1
    values; 0 and 0x7F decode to 0. Each value is exact in float32."""
    x = np.arange(256)
    exp, man = (x >> 3) & 0xF, x & 7
    raw = np.where(exp == 0, man * 2.0**-9, (1 + man / 8) * 2.0 ** (exp - 7))
    return np.where((x == 0) | (x == 0x7F), 0.0, raw * 0.5).astype(np.float32)


UE4M3_HALF = _ue4m3_half_table()


@njit(**INLINE)
def e2m1_code(x, d):
    """best_index_mxfp4(x, d): the first index i of kvalues_mxfp4 with the least |k_i*d - x|, in float32.

    For x < 0 the negative codes 9-15 give |(-k)d - x| = |k d - |x||, bit for bit, and the positive ones 1-7
    (and -0, code 8) are never strictly nearer than code 0: so the scan over the 8 positive values of |x|
    finds the code, plus 8 for a negative x unless it is 0. NaN never compares less: code 0."""
    a = abs(x)
    best = a                                    # |0*d - x|
    code = 0
    for k in range(1, 8):
        err = abs(E2M1_DOUBLED[k] * d - a)
        if err < best:
            best = err
            code = k
    return code + 8 if x < 0 and code != 0 else code


@njit(**INLINE)
def _abs_max(xs, n):
    """`if (amax < fabsf(x)) amax = fabsf(x)` over xs[0:n]: NaN passed over."""
    amax = F32(0.0)
    for j in range(n):
        a = abs(xs[j])
        if amax < a:
            amax = a
    return amax


@njit(**INLINE)
def e8m0_half(e):
    """ggml_e8m0_to_fp32_half: 2^(e-128), built from its bits (2^-128 and 2^-127 are float32 subnormals)."""
    return bits_f32(np.uint32(0x00200000) << np.uint32(e)) if e < 2 else bits_f32(np.uint32(e - 1) << np.uint32(23))


@njit(**JIT)
def mxfp4_rows(x, out):
    """quantize_row_mxfp4_ref: e = (uint8_t)(floorf(log2f(amax)) - 2 + 127) (0 for amax 0; the float to
    uint8 conversion goes through a 32-bit int, so inf gives 0), d = e8m0_half(e); byte 0 is e, byte 1 + j
    holds the codes of elements j (low nibble) and j + 16."""
    n_rows, n = x.shape
    for r in range(n_rows):
        xr = x[r]
        y = out[r]
        for ib in range(n // 32):
            xs = xr[32 * ib:32 * (ib + 1)]
            amax = _abs_max(xs, 32)
            e = 0
            if amax > 0:
                e = np.int32(np.floor(np.log2(amax)) - F32(2.0) + F32(127.0)) & 0xFF
            d = e8m0_half(e)
            p = 17 * ib
            y[p] = e
            for j in range(16):
                y[p + 1 + j] = e2m1_code(xs[j], d) | (e2m1_code(xs[16 + j], d) << 4)


@njit(**INLINE)
def fp32_to_ue4m3(x):
    """ggml_fp32_to_ue4m3: 0 unless x > 0; clamped to 448; below 2^-6 the subnormal (int)(x*512 + 0.5) in 1..7
    (else 0); otherwise the exponent and top 3 mantissa bits, rounded half up on bit 19 (a carry moves the
    exponent); 0x7E (448) at exponent 15."""
    if not x > 0:
        return 0
    if x > F32(448.0):
        x = F32(448.0)
    bits = np.int64(f32_bits(x))
    exp = ((bits >> 23) & 0xFF) - 127 + 7
    if exp <= 0:
        man = np.int32(x * F32(512.0) + HALF)
        if man > 7:
            man = 7
        return 0 if man < 1 else man
    if exp >= 15:
        return 0x7E
    man = ((bits >> 20) & 7) + ((bits >> 19) & 1)
    if man > 7:
        man = 0
        exp += 1
        if exp >= 15:
            return 0x7E
    return (exp << 3) | man


@njit(**JIT)
def nvfp4_rows(x, out):
    """quantize_row_nvfp4_ref: per 16 values, ue = fp32_to_ue4m3(amax/6) at byte s, d = UE4M3_HALF[ue]; byte
    4 + 8s + j holds the codes of elements j (low nibble) and j + 8 of that 16. The codes of a 16 are found in
    one loop and packed in another: packed as they are found (8 pairs), the search did not vectorize (5x slower)."""
    n_rows, n = x.shape
    codes = np.empty(16, np.uint8)
    for r in range(n_rows):
        xr = x[r]
        y = out[r]
        for ib in range(n // 64):
            p = 36 * ib
            for s in range(4):
                xs = xr[64 * ib + 16 * s:64 * ib + 16 * (s + 1)]
                ue = fp32_to_ue4m3(_abs_max(xs, 16) / F32(6.0))
                d = UE4M3_HALF[ue]
                y[p + s] = ue
                for j in range(16):
                    codes[j] = e2m1_code(xs[j], d)
                for j in range(8):
                    y[p + 4 + 8 * s + j] = codes[j] | (codes[8 + j] << 4)
