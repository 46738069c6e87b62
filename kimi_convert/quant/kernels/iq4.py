"""IQ4_NL and IQ4_XS: non-linear 4-bit codes (kvalues_iq4nl) with 32-value blocks."""
from __future__ import annotations

import numpy as np
from numba import njit

from .common import (F32, GROUP_MAX_EPS, INLINE, JIT, NO_WEIGHTS, QK_K, abs_max, nearest_int, put_fp16, sum_sq)

# kvalues_iq4nl (ggml-common.h), as float32 so that `x - value` is computed in float as in C
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


# ====================================================================================================
# IQ4_NL, IQ4_XS
# ====================================================================================================

# quantize_row_iq4_nl_impl with ntry=7: non-linear 4-bit codes (kvalues_iq4nl). IQ4_NL is the impl with
# super_block_size = block_size = 32 (one fp16 scale per 32 values); IQ4_XS with super_block_size 256 and
# block_size 32 (an fp16 super-scale and 6-bit signed sub-scales). Without an imatrix the weights are x^2
# (ggml_quantize_chunk calls the same impl with quant_weights NULL).

NTRY = 7
_KVALUES_STEP = np.diff(KVALUES_IQ4NL).astype(np.float32)  # kvalues[k+1] - kvalues[k], integers


@njit(**INLINE)
def nearest_iq4nl(x):
    """(best_index_int8(16, kvalues_iq4nl, x), kvalues_iq4nl[that index]) without branches on the data.

    ggml's binary search ends on the mu with kvalues[mu-1] <= x < kvalues[mu]; counting the interior values
    <= x gives mu-1 just the same, and summing the integer steps gives kvalues[mu-1] and kvalues[mu] exactly.
    The tie rule (x - lo < hi - x ? lo : hi, in float32), the clamps at both ends and NaN (which ggml's search
    walks up to index 15) are ggml's. Loops of these vectorize; the binary search's branches did not."""
    lo = KVALUES_IQ4NL[0]
    hi = KVALUES_IQ4NL[1]
    c = 0
    for k in range(1, 15):
        if KVALUES_IQ4NL[k] <= x:
            lo += _KVALUES_STEP[k - 1]
            hi += _KVALUES_STEP[k]
            c += 1
    up = not (x - lo < hi - x)
    index = c + 1 if up else c
    value = hi if up else lo
    if x <= KVALUES_IQ4NL[0]:
        index = 0
        value = KVALUES_IQ4NL[0]
    if x >= KVALUES_IQ4NL[15] or x != x:
        index = 15
        value = KVALUES_IQ4NL[15]
    return index, value


@njit(**INLINE)
def _iq4_sums(xr, o, w, idd, tmp):
    """(sum w*q*x, sum w*q*q) over the group for the codes q nearest to idd*x: products in one loop, in-order
    sums in another (ggml's w*q*x is (w*q)*x)."""
    for j in range(32):
        xj = xr[o + j]
        q = nearest_iq4nl(idd * xj)[1]
        wq = w[j] * q
        tmp[j] = wq * xj
        tmp[32 + j] = wq * q
    sumqx = F32(0.0)
    sumq2 = F32(0.0)
    for j in range(32):
        sumqx += tmp[j]
        sumq2 += tmp[32 + j]
    return sumqx, sumq2


@njit(**INLINE)
def _group_scale(xr, o, w, tmp):
    """The per-32 scale search of quantize_row_iq4_nl_impl (ntry > 0) on xr[o:o+32], weights w[0:32].
    The codes it finds are never stored: both types requantize with the final scale."""
    amax, mx = abs_max(xr, o, 32)
    if amax < GROUP_MAX_EPS:
        return F32(0.0)
    d = -mx / KVALUES_IQ4NL[0]
    sumqx, sumq2 = _iq4_sums(xr, o, w, F32(1.0) / d, tmp)
    d = sumqx / sumq2 if sumq2 > 0 else F32(0.0)
    best = d * sumqx
    for itry in range(-NTRY, NTRY + 1):
        sumqx, sumq2 = _iq4_sums(xr, o, w, F32(itry - 127) / mx, tmp)  # (itry + values[0]) is an int in C
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            d = sumqx / sumq2
            best = d * sumqx
    return d


@njit(**INLINE)
def _group_weights(xr, o, qw, sigma2, w):
    """weight[j] = qw[j]*sqrtf(sigma2 + x^2), or x^2 without an imatrix (qw empty)."""
    for j in range(32):
        xj = xr[o + j]
        if qw.shape[0]:
            w[j] = qw[o + j] * np.sqrt(sigma2 + xj * xj)
        else:
            w[j] = xj * xj


@njit(**INLINE)
def _put_codes(xr, o, scale, y, p):
    """Codes nearest to (1/scale)*x (0 if scale is 0), packed q4[j] = L[j] | L[j+16] << 4 (16 bytes)."""
    inv = F32(1.0) / scale if scale != 0 else F32(0.0)
    for j in range(16):
        y[p + j] = nearest_iq4nl(inv * xr[o + j])[0] | (nearest_iq4nl(inv * xr[o + 16 + j])[0] << 4)


@njit(**INLINE)
def _iq4_nl_row(xr, qw, y):
    w = np.empty(32, np.float32)
    tmp = np.empty(64, np.float32)
    for ib in range(xr.shape[0] // 32):
        o = 32 * ib
        sigma2 = sum_sq(xr, o, 32) * F32(2.0 / 32)
        _group_weights(xr, o, qw, sigma2, w)
        d = _group_scale(xr, o, w, tmp)
        p = 18 * ib
        put_fp16(y, p, d)
        _put_codes(xr, o, d, y, p + 2)  # with the unrounded float32 scale, as ggml


@njit(**INLINE)
def _iq4_xs_row(xr, qw, y):
    w = np.empty(32, np.float32)
    tmp = np.empty(64, np.float32)
    scales = np.empty(8, np.float32)
    for ibl in range(xr.shape[0] // QK_K):
        o = QK_K * ibl
        sigma2 = sum_sq(xr, o, QK_K) * F32(2.0 / QK_K)
        max_scale = F32(0.0)
        amax_scale = F32(0.0)
        for ib in range(8):
            _group_weights(xr, o + 32 * ib, qw, sigma2, w)
            d = _group_scale(xr, o + 32 * ib, w, tmp)
            scales[ib] = d
            if abs(d) > amax_scale:
                amax_scale = abs(d)
                max_scale = d
        p = 136 * ibl
        d = -max_scale / F32(32.0)
        put_fp16(y, p, d)
        idd = F32(1.0) / d if d != 0 else F32(0.0)
        scales_h = 0
        for ib in range(8):
            l = max(-32, min(31, nearest_int(idd * scales[ib])))
            _put_codes(xr, o + 32 * ib, d * F32(l), y, p + 8 + 16 * ib)
            l += 32
            if ib % 2 == 0:
                y[p + 4 + ib // 2] = l & 0xF
            else:
                y[p + 4 + ib // 2] |= (l & 0xF) << 4
            scales_h |= (l >> 4) << (2 * ib)
        y[p + 2] = scales_h & 0xFF
        y[p + 3] = scales_h >> 8


@njit(**JIT)
def iq4_nl_rows(x, out):
    for r in range(x.shape[0]):
        _iq4_nl_row(x[r], NO_WEIGHTS, out[r])


@njit(**JIT)
def iq4_nl_impl_rows(x, qw, out):
    for r in range(x.shape[0]):
        _iq4_nl_row(x[r], qw, out[r])


@njit(**JIT)
def iq4_xs_rows(x, out):
    for r in range(x.shape[0]):
        _iq4_xs_row(x[r], NO_WEIGHTS, out[r])


@njit(**JIT)
def iq4_xs_impl_rows(x, qw, out):
    for r in range(x.shape[0]):
        _iq4_xs_row(x[r], qw, out[r])
