"""The 32-value block types Q8_0, Q4_0, Q5_0, Q4_1, Q5_1, and the float row conversions F16, BF16."""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .common import (F32, FLT_MAX, HALF, INLINE, JIT, abs_max, as_int8, element_ptr, f32_bits, fp32_to_fp16, is_f32_vector,
                     make_qkx_quants, make_qx_quants, put_fp16, roundf, splat, sum_sq)


# ====================================================================================================
# 32-element blocks: Q8_0, Q4_0, Q5_0, Q4_1, Q5_1; float conversions F16, BF16
# ====================================================================================================

# Q8_0/Q4_0/Q5_0 blocks are 32 values with one fp16 scale d; the float types are ggml's row conversions.

@njit(**JIT)
def q8_0_rows(x, out):
    """quantize_row_q8_0_ref: d = amax/127, q = roundf(x/d) with the float32 (unrounded) 1/d."""
    n_rows, n = x.shape
    for r in range(n_rows):
        xr = x[r]
        y = out[r]
        for ib in range(n // 32):
            o = 32 * ib
            amax = F32(0.0)
            for j in range(32):
                v = abs(xr[o + j])
                amax = amax if amax > v else v  # MAX(amax, fabsf(v))
            d = amax / F32(127.0)
            idd = F32(1.0) / d if d != 0 else F32(0.0)
            p = 34 * ib
            put_fp16(y, p, d)
            for j in range(32):
                y[p + 2 + j] = np.int64(roundf(xr[o + j] * idd)) & 0xFF


@intrinsic
def _q4_0_nibbles(typingctx, x, o, idd, y, p):
    """y[p+j] = MIN(15, (int8_t)(x[o+j]*id + 8.5f)) | MIN(15, (int8_t)(x[o+16+j]*id + 8.5f)) << 4 for j < 16, as
    16-lane vector operations and one 16-byte store. LLVM keeps the scalar loop scalar: it cannot tell that y
    does not alias x (see abs_max for what both changes saved). x*id lies in [-8, 8], so the int8 conversion
    cannot wrap; a NaN (or the inf of a subnormal d's inverse) converts to INT_MIN on x86 (cvttps2dq), whose
    low bits are 0, as the scalar C conversion's are."""
    if not (is_f32_vector(x) and idd == types.float32 and isinstance(y, types.Array) and y.dtype == types.uint8
            and y.layout == "C"):
        return None

    def codegen(context, builder, sig, args):
        xv, iv = ir.VectorType(ir.FloatType(), 16), ir.VectorType(ir.IntType(32), 16)
        xp = builder.bitcast(element_ptr(context, builder, sig.args[0], args[0], args[1]), xv.as_pointer())
        scale = splat(builder, args[2], xv)

        def levels(v):
            q = builder.fptosi(builder.fadd(builder.fmul(v, scale), ir.Constant(xv, [8.5] * 16)), iv)
            return builder.select(builder.icmp_signed("<", q, ir.Constant(iv, [15] * 16)), q, ir.Constant(iv, [15] * 16))

        first = levels(builder.load(xp, align=4))
        second = levels(builder.load(builder.gep(xp, [ir.Constant(ir.IntType(64), 1)]), align=4))
        packed = builder.trunc(builder.or_(first, builder.shl(second, ir.Constant(iv, [4] * 16))), ir.VectorType(ir.IntType(8), 16))
        yp = element_ptr(context, builder, sig.args[3], args[3], args[4])
        builder.store(packed, builder.bitcast(yp, packed.type.as_pointer()), align=1)
        return context.get_dummy_value()

    return types.none(x, o, idd, y, p), codegen


@njit(**INLINE)
def _q4_0_ref_block(xr, o, y, p):
    amax, mx = abs_max(xr, o, 32)
    d = mx / F32(-8.0)
    idd = F32(1.0) / d if d != 0 else F32(0.0)
    put_fp16(y, p, d)
    _q4_0_nibbles(xr, o, idd, y, p + 2)


@njit(**JIT)
def q4_0_ref_rows(x, out):
    """quantize_row_q4_0_ref: d = max/-8 (signed max), q = min(15, trunc(x/d + 8.5))."""
    n_rows, n = x.shape
    for r in range(n_rows):
        for ib in range(n // 32):
            _q4_0_ref_block(x[r], 32 * ib, out[r], 18 * ib)


@njit(**INLINE)
def _put_4bit(y, p, L):
    """Q4_0/Q4_1 packing of levels L[0:32] (0..15): y[p+j] = L[j] | L[j+16] << 4, 16 bytes."""
    for j in range(16):
        y[p + j] = (np.int64(L[j]) | (np.int64(L[j + 16]) << 4)) & 0xFF


@njit(**JIT)
def _row_sigma2(xr):
    """sum(x^2)/n_per_row over the whole row (quantize_row_q4_0_impl, q5_0_impl, q4_1_impl, q5_1_impl)."""
    return sum_sq(xr, 0, xr.shape[0]) / F32(xr.shape[0])


@njit(**INLINE)
def _put_5bit(y, p, L):
    """Q5_0/Q5_1 packing of levels L[0:32] (0..31): qh (u32, bit j = bit 4 of element j) at y[p:p+4], then
    qs[j] = low nibble of element j | low nibble of element j+16 << 4 at y[p+4:p+20]."""
    qh = 0
    for j in range(16):
        a = np.int64(L[j])
        b = np.int64(L[j + 16])
        y[p + 4 + j] = ((a & 0x0F) | ((b & 0x0F) << 4)) & 0xFF
        qh |= ((a & 0x10) >> 4) << j
        qh |= ((b & 0x10) >> 4) << (j + 16)
    for k in range(4):
        y[p + k] = (qh >> (8 * k)) & 0xFF


@njit(**JIT)
def q5_0_ref_rows(x, out):
    """quantize_row_q5_0_ref: d = max/-16, q = min(31, trunc(x/d + 16.5))."""
    n_rows, n = x.shape
    for r in range(n_rows):
        xr = x[r]
        y = out[r]
        L = np.empty(32, np.int64)
        for ib in range(n // 32):
            o = 32 * ib
            amax, mx = abs_max(xr, o, 32)
            d = mx / F32(-16.0)
            idd = F32(1.0) / d if d != 0 else F32(0.0)
            p = 22 * ib
            put_fp16(y, p, d)
            for j in range(32):
                L[j] = min(31, as_int8(np.int64(xr[o + j] * idd + F32(16.5)))) & 0xFF  # (uint8_t)MIN(31, (int8_t)..)
            _put_5bit(y, p + 2, L)


@njit(**JIT)
def _q_0_impl_rows(x, qw, out, nmax):
    """quantize_row_q4_0_impl (nmax 8) / q5_0_impl (nmax 16): weights qw*sqrt(sigma2 + x^2),
    make_qx_quants(32, nmax); no requantization."""
    n_rows, n = x.shape
    block_bytes = 18 if nmax == 8 else 22
    for r in range(n_rows):
        xr = x[r]
        y = out[r]
        sigma2 = _row_sigma2(xr)
        w = np.empty(32, np.float32)
        L = np.empty(32, np.int8)
        tmp = np.empty(96, np.float32)
        for ib in range(n // 32):
            o = 32 * ib
            for j in range(32):
                w[j] = qw[o + j] * np.sqrt(sigma2 + xr[o + j] * xr[o + j])
            d = make_qx_quants(32, nmax, xr, o, L, 0, w, 0, tmp)
            p = block_bytes * ib
            put_fp16(y, p, d)
            if nmax == 8:
                _put_4bit(y, p + 2, L)
            else:
                _put_5bit(y, p + 2, L)


@njit(**JIT)
def q4_0_impl_rows(x, qw, out):
    _q_0_impl_rows(x, qw, out, 8)


@njit(**JIT)
def q5_0_impl_rows(x, qw, out):
    _q_0_impl_rows(x, qw, out, 16)


# Q4_1/Q5_1 blocks are 32 values with an fp16 scale d and an fp16 minimum m (value = d*q + m, q unsigned):
# block_q4_1: d, m, qs[16]; block_q5_1: d, m, qh (u32), qs[16].

@njit(**JIT)
def _q_1_ref_rows(x, out, nmax):
    """quantize_row_q4_1_ref (nmax 15) / q5_1_ref (nmax 31): min and max of the block (from FLT_MAX and
    -FLT_MAX, strict compares, so NaN is passed over), d = (max - min)/nmax, fp16 d and m = min stored, and
    q = trunc((x - min)*id + 0.5) with the float32 (unrounded) id = 1/d (0 if d is 0); Q4_1 takes
    MIN(15, (int8_t)q), Q5_1 (uint8_t)q unclamped (a 32 would wrap in the bit fields, as in C)."""
    n_rows, n = x.shape
    block_bytes = 20 if nmax == 15 else 24
    L = np.empty(32, np.int64)
    for r in range(n_rows):
        xr = x[r]
        y = out[r]
        for ib in range(n // 32):
            o = 32 * ib
            mn = FLT_MAX
            mx = -FLT_MAX
            for j in range(32):
                v = xr[o + j]
                if v < mn:
                    mn = v
                if v > mx:
                    mx = v
            d = (mx - mn) / F32(nmax)
            idd = F32(1.0) / d if d != 0 else F32(0.0)
            p = block_bytes * ib
            put_fp16(y, p, d)
            put_fp16(y, p + 2, mn)
            for j in range(32):
                # np.int32 is C's float -> int conversion (NaN and inf give INT_MIN on x86, low byte 0, in C and
                # here alike); the int8_t / uint8_t casts then wrap
                q = np.int64(np.int32((xr[o + j] - mn) * idd + HALF))
                L[j] = (min(15, as_int8(q)) if nmax == 15 else q) & 0xFF
            if nmax == 15:
                _put_4bit(y, p + 4, L)
            else:
                _put_5bit(y, p + 4, L)


@njit(**JIT)
def q4_1_ref_rows(x, out):
    _q_1_ref_rows(x, out, 15)


@njit(**JIT)
def q5_1_ref_rows(x, out):
    _q_1_ref_rows(x, out, 31)


@njit(**JIT)
def _q_1_impl_rows(x, qw, out, nmax):
    """quantize_row_q4_1_impl (nmax 15) / q5_1_impl (nmax 31): weights qw*sqrt(sigma2 + x^2) with sigma2 over
    the whole row, make_qkx3_quants(32, nmax, rmin -0.9, rdelta 0.05, 36 steps, mad=false), fp16 d and
    m = -the_min stored, the levels of the search packed: no requantization with the rounded scales."""
    n_rows, n = x.shape
    block_bytes = 20 if nmax == 15 else 24
    L = np.empty(32, np.uint8)
    Laux = np.empty(32, np.uint8)
    w = np.empty(32, np.float32)
    tmp = np.empty(160, np.float32)
    for r in range(n_rows):
        xr = x[r]
        y = out[r]
        sigma2 = _row_sigma2(xr)
        for ib in range(n // 32):
            o = 32 * ib
            for j in range(32):
                w[j] = qw[o + j] * np.sqrt(sigma2 + xr[o + j] * xr[o + j])
            d, the_min = make_qkx_quants(32, nmax, xr, o, w, L, 0, Laux, F32(-0.9), F32(0.05), 36, False, tmp)
            p = block_bytes * ib
            put_fp16(y, p, d)
            put_fp16(y, p + 2, -the_min)
            if nmax == 15:
                _put_4bit(y, p + 4, L)
            else:
                _put_5bit(y, p + 4, L)


@njit(**JIT)
def q4_1_impl_rows(x, qw, out):
    _q_1_impl_rows(x, qw, out, 15)


@njit(**JIT)
def q5_1_impl_rows(x, qw, out):
    _q_1_impl_rows(x, qw, out, 31)


@njit(**JIT)
def f16_rows(x, out):
    """ggml_fp32_to_fp16_row: ggml_compute_fp32_to_fp16 per element (RNE; NaN -> sign|0x7E00)."""
    n_rows, n = x.shape
    for r in range(n_rows):
        for j in range(n):
            out[r, j] = fp32_to_fp16(x[r, j])


@njit(**JIT)
def bf16_rows(x, out):
    """ggml_fp32_to_bf16_row_ref: round to nearest even on the top 16 bits; NaN kept, forced quiet."""
    n_rows, n = x.shape
    for r in range(n_rows):
        for j in range(n):
            u = np.int64(f32_bits(x[r, j]))
            if (u & 0x7FFFFFFF) > 0x7F800000:
                out[r, j] = (u >> 16) | 64
            else:
                out[r, j] = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16) & 0xFFFF



@njit(**JIT)
def bf16_to_f32_rows(x, out):
    """ggml_bf16_to_fp32_row: the bf16 bits become the top half of the float32 (exact, NaN payload kept)."""
    n_rows, n = x.shape
    for r in range(n_rows):
        for j in range(n):
            out[r, j] = np.uint32(x[r, j]) << np.uint32(16)


@njit(**JIT)
def count_nonfinite_f32(bits, nonfinite):
    """nonfinite[0]: how many of the float32 values (as their bits) are NaN or infinite."""
    n_rows, n = bits.shape
    bad = np.uint32(0)
    for r in range(n_rows):
        for j in range(n):
            bad += np.uint32((bits[r, j] & np.uint32(0x7F800000)) == np.uint32(0x7F800000))
    nonfinite[0] = bad
