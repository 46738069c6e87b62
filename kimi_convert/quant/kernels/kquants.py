"""The K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K: 256-value super-blocks with quantized sub-block scales."""
from __future__ import annotations

import numpy as np
from numba import njit

from .common import (F32, GROUP_MAX_EPS, JIT, NO_WEIGHTS, QK_K, QX_TMP, as_int8, get_fp16, level_f32, make_qkx_quants,
                     make_qp_quants, make_qx_quants, nearest_int, put_fp16, sum_sq)


Q3_LANES = 32          # sub-blocks of 16 values searched side by side: those of two Q3_K super-blocks
_XT, _LT = 0, 16 * Q3_LANES                    # make_q3_quants_lanes' scratch: values, levels (element-major)
_SX, _S2, _LIVE, _CHANGED, _AMAX, _MAX, _ISCALE, _NONZERO = (32 * Q3_LANES + Q3_LANES * q for q in range(8))
Q3_SCRATCH = 40 * Q3_LANES


@njit(**JIT)
def make_q3_quants_lanes(x, xo, L, scales, sc):
    """make_q3_quants(16, 4, x, L, do_rmse=true) for each of the Q3_LANES sub-blocks x[xo + 16j: +16]
    (two super-blocks): weights x*x, up to 5 rounds of coordinate descent. Writes L[16j:16j+16] in [0, 8)
    (all 0 for an all-zero sub-block) and sub-block j's scale to scales[j]. sc: float32 [Q3_SCRATCH].

    ggml searches one sub-block after another, and each step waits on the one before (a division, then the
    sums it may update). The searches are independent, so here they run as lanes (element outer, sub-block
    inner), which vectorizes: each lane does the float32 operations of ggml's search in ggml's order, and
    takes a step only where ggml's would (its branches are the `take` mask). A lane that changed nothing in
    a round stops, as ggml's loop breaks (another round could change nothing either). Every value lives in
    the one scratch array `sc` at fixed offsets, so LLVM can see that the lanes do not overlap; levels are
    kept as float32 (exact: -4..3)."""
    xs = x[xo:xo + 16 * Q3_LANES]
    for j in range(Q3_LANES):
        sc[_AMAX + j] = F32(0.0)
        sc[_MAX + j] = F32(0.0)
        sc[_SX + j] = F32(0.0)
        sc[_S2 + j] = F32(0.0)
    for i in range(16):
        for j in range(Q3_LANES):
            v = xs[16 * j + i]
            sc[_XT + Q3_LANES * i + j] = v
            bigger = abs(v) > sc[_AMAX + j]       # the first strictly largest |x|, as abs_max
            sc[_AMAX + j] = abs(v) if bigger else sc[_AMAX + j]
            sc[_MAX + j] = v if bigger else sc[_MAX + j]
    for j in range(Q3_LANES):
        nonzero = sc[_AMAX + j] >= GROUP_MAX_EPS  # else ggml's "all zero" case
        sc[_NONZERO + j] = F32(1.0) if nonzero else F32(0.0)
        sc[_LIVE + j] = sc[_NONZERO + j]
        sc[_ISCALE + j] = F32(-4.0) / sc[_MAX + j] if nonzero else F32(0.0)
    for i in range(16):
        for j in range(Q3_LANES):
            xi = sc[_XT + Q3_LANES * i + j]
            fl = level_f32(sc[_ISCALE + j] * xi, -4, 3)
            sc[_LT + Q3_LANES * i + j] = fl
            w = xi * xi
            sc[_SX + j] += w * xi * fl
            sc[_S2 + j] += w * fl * fl
    for _ in range(5):
        for j in range(Q3_LANES):
            sc[_CHANGED + j] = F32(0.0)
        for i in range(16):
            for j in range(Q3_LANES):
                xi = sc[_XT + Q3_LANES * i + j]
                w = xi * xi
                li = sc[_LT + Q3_LANES * i + j]
                sumlx = sc[_SX + j]
                suml2 = sc[_S2 + j]
                slx = sumlx - w * xi * li
                sl2 = suml2 - w * li * li
                new_l = level_f32(xi * sl2 / slx, -4, 3)
                slx_new = slx + w * xi * new_l
                sl2_new = sl2 + w * new_l * new_l
                take = (sc[_LIVE + j] != 0) & (slx > 0) & (new_l != li) & (sl2_new > 0) & \
                    (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new)
                sc[_LT + Q3_LANES * i + j] = new_l if take else li
                sc[_SX + j] = slx_new if take else sumlx
                sc[_S2 + j] = sl2_new if take else suml2
                sc[_CHANGED + j] += F32(1.0) if take else F32(0.0)
        live = False
        for j in range(Q3_LANES):
            sc[_LIVE + j] = sc[_LIVE + j] if sc[_CHANGED + j] != 0 else F32(0.0)
            live = live or sc[_LIVE + j] != 0
        if not live:
            break
    for j in range(Q3_LANES):
        zero = sc[_NONZERO + j] == 0
        for i in range(16):
            L[16 * j + i] = 0 if zero else np.int64(sc[_LT + Q3_LANES * i + j]) + 4
        suml2 = sc[_S2 + j]
        scales[j] = F32(0.0) if zero else (sc[_SX + j] / suml2 if suml2 > 0 else F32(0.0))




# ====================================================================================================
# K-quants: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
# ====================================================================================================

# 256-value super-blocks. ``<type>_ref_rows`` mirror ``quantize_row_<type>_ref`` (ggml_quantize_chunk without
# an imatrix), ``<type>_impl_rows`` mirror ``quantize_row_<type>_impl`` (with one). Both search per-sub-block
# scales, quantize the scales themselves, store the fp16 super-scales, and then requantize every value with the
# scales as stored (fp16 re-read), except where a sub-block's scale came out 0: there the levels of the search
# stay.

# --- shared packing ----------------------------------------------------------------------------------

@njit(**JIT)
def _pack_2bit(L, y, p):
    """qs[32h+l] = L[128h+l] | L[128h+32+l]<<2 | L[128h+64+l]<<4 | L[128h+96+l]<<6 (Q2_K, Q3_K low bits)."""
    for h in range(2):
        for l in range(32):
            j = 128 * h + l
            y[p + 32 * h + l] = (L[j] | (L[j + 32] << 2) | (L[j + 64] << 4) | (L[j + 96] << 6)) & 0xFF


# --- Q2_K: 16 sub-blocks of 16, 2-bit levels with a 4-bit scale and min each ------------------------
# block_q2_K: scales[16] (low nibble scale, high nibble min), qs[64], d, dmin

@njit(**JIT)
def _q2_K_requantize(xr, o, y, p, L):
    """Levels with the stored 4-bit scales/mins and the fp16 d, dmin as re-read; then the 2-bit planes."""
    dm = get_fp16(y, p + 80)
    mm = get_fp16(y, p + 82)
    for j in range(16):
        sc = np.int64(y[p + j])
        d = dm * F32(sc & 0xF)
        if d == 0:
            continue
        m = mm * F32(sc >> 4)
        for ii in range(16):
            L[16 * j + ii] = max(0, min(3, nearest_int((xr[o + 16 * j + ii] + m) / d)))
    _pack_2bit(L, y, p + 16)


@njit(**JIT)
def q2_K_ref_rows(x, out):
    n_rows, n = x.shape
    for r in range(n_rows):
        xr = x[r]
        y = out[r]
        L = np.empty(QK_K, np.uint8)
        Laux = np.empty(16, np.uint8)
        w = np.empty(16, np.float32)
        tmp = np.empty(80, np.float32)
        scales = np.empty(16, np.float32)
        mins = np.empty(16, np.float32)
        for i in range(n // QK_K):
            o = QK_K * i
            p = 84 * i
            max_scale = F32(0.0)
            max_min = F32(0.0)
            for j in range(16):
                for l in range(16):
                    w[l] = abs(xr[o + 16 * j + l])
                s, m = make_qkx_quants(16, 3, xr, o + 16 * j, w, L, 16 * j, Laux, F32(-0.5), F32(0.1), 15, True, tmp)
                scales[j] = s
                mins[j] = m
                if s > max_scale:
                    max_scale = s
                if m > max_min:
                    max_min = m
            if max_scale > 0:
                iscale = F32(15.0) / max_scale
                for j in range(16):
                    y[p + j] = nearest_int(iscale * scales[j]) & 0xFF
                put_fp16(y, p + 80, max_scale / F32(15.0))
            else:
                for j in range(16):
                    y[p + j] = 0
                put_fp16(y, p + 80, F32(0.0))
            if max_min > 0:
                iscale = F32(15.0) / max_min
                for j in range(16):
                    y[p + j] |= (nearest_int(iscale * mins[j]) << 4) & 0xFF
                put_fp16(y, p + 82, max_min / F32(15.0))
            else:
                put_fp16(y, p + 82, F32(0.0))
            _q2_K_requantize(xr, o, y, p, L)


@njit(**JIT)
def q2_K_impl_rows(x, qw, out):
    n_rows, n = x.shape
    for r in range(n_rows):
        xr = x[r]
        y = out[r]
        L = np.empty(QK_K, np.uint8)
        Laux = np.empty(16, np.uint8)
        w = np.empty(16, np.float32)
        tmp = np.empty(80, np.float32)
        scales = np.empty(16, np.float32)
        mins = np.empty(16, np.float32)
        sw = np.empty(16, np.float32)
        Ls = np.empty(16, np.uint8)
        Lm = np.empty(16, np.uint8)
        for i in range(n // QK_K):
            o = QK_K * i
            p = 84 * i
            sigma2 = sum_sq(xr, o, QK_K) / F32(QK_K)
            for j in range(16):
                for l in range(16):
                    xv = xr[o + 16 * j + l]
                    w[l] = qw[o + 16 * j + l] * np.sqrt(sigma2 + xv * xv)
                s = F32(0.0)
                for l in range(16):
                    s += w[l]
                sw[j] = s
                scales[j], mins[j] = make_qkx_quants(16, 3, xr, o + 16 * j, w, L, 16 * j, Laux, F32(-0.9), F32(0.05),
                                                     36, False, tmp)
            dm = make_qp_quants(16, 15, scales, Ls, sw)
            mm = make_qp_quants(16, 15, mins, Lm, sw)
            put_fp16(y, p + 80, dm)
            put_fp16(y, p + 82, mm)
            for j in range(16):
                y[p + j] = (Ls[j] | (Lm[j] << 4)) & 0xFF
            _q2_K_requantize(xr, o, y, p, L)


# --- Q3_K: 16 sub-blocks of 16, 3-bit signed levels, 6-bit signed scales -----------------------------
# block_q3_K: hmask[32], qs[64], scales[12], d

@njit(**JIT)
def _q3_K_put_scale(y, s0, j, l):
    """6-bit scale l (0..63) of sub-block j: low 4 bits in scales[j] / scales[j-8] high nibble, top 2 bits
    in scales[8 + j%4] at bit 2*(j/4). scales[] must be zeroed first."""
    if j < 8:
        y[s0 + j] = l & 0xF
    else:
        y[s0 + j - 8] |= (l & 0xF) << 4
    y[s0 + 8 + j % 4] |= (l >> 4) << (2 * (j // 4))


@njit(**JIT)
def _q3_K_finish(xr, o, y, p, L):
    """Requantize with the stored scales and fp16 d, then split off hmask and pack the 2-bit planes.

    One pass over the 256 values in packing order (value j = 32k + m goes to hmask[m] bit k and to
    qs[32(k/4) + m] bits 2(k%4)), each byte built in a register: a requantizing loop that stored L
    (vectorized) and a packing loop that read it back a byte at a time stalled on store forwarding,
    3x slower than ggml's loop."""
    s0 = p + 96
    d_all = get_fp16(y, p + 108)
    ds = np.empty(16, np.float32)
    for j in range(16):
        sc = np.int64(y[s0 + j]) & 0xF if j < 8 else np.int64(y[s0 + j - 8]) >> 4
        sc = as_int8((sc | (((np.int64(y[s0 + 8 + j % 4]) >> (2 * (j // 4))) & 3) << 4)) - 32)
        ds[j] = d_all * F32(sc)
    xs = xr[o:o + QK_K]
    for m in range(32):
        hmask = 0
        low = 0
        high = 0
        for k in range(8):
            j = 32 * k + m
            d = ds[j >> 4]
            # a sub-block whose scale is 0 keeps the levels of the search (ggml: `if (!d) continue;`)
            l = np.int64(L[j]) if d == 0 else max(-4, min(3, nearest_int(xs[j] / d))) + 4
            if l > 3:
                hmask |= 1 << k
                l -= 4
            if k < 4:
                low |= l << (2 * k)
            else:
                high |= l << (2 * (k - 4))
        y[p + m] = hmask
        y[p + 32 + m] = low & 0xFF
        y[p + 64 + m] = high & 0xFF


@njit(**JIT)
def q3_K_ref_rows(x, out):
    """quantize_row_q3_K_ref: the sub-block searches of two super-blocks at a time (make_q3_quants_lanes;
    a row's odd last super-block is searched beside 256 zeros, whose lanes are all-zero sub-blocks)."""
    n_rows, n = x.shape
    per_search = 16 * Q3_LANES // QK_K
    L = np.empty(16 * Q3_LANES, np.int8)
    scales = np.empty(Q3_LANES, np.float32)
    sc = np.empty(Q3_SCRATCH, np.float32)
    padded = np.zeros(16 * Q3_LANES, np.float32)
    for r in range(n_rows):
        xr = x[r]
        y = out[r]
        nb = n // QK_K
        for i0 in range(0, nb, per_search):
            if i0 + per_search <= nb:
                make_q3_quants_lanes(xr, QK_K * i0, L, scales, sc)
            else:
                for k in range(QK_K * (nb - i0)):
                    padded[k] = xr[QK_K * i0 + k]
                make_q3_quants_lanes(padded, 0, L, scales, sc)
            for h in range(min(per_search, nb - i0)):
                _q3_K_block(xr, QK_K * (i0 + h), y, 110 * (i0 + h), L[QK_K * h:QK_K * (h + 1)],
                            scales[16 * h:16 * (h + 1)])


@njit(**JIT)
def _q3_K_block(xr, o, y, p, L, scales):
    """The rest of quantize_row_q3_K_ref for one super-block, once its 16 sub-blocks are searched: the
    6-bit scales, the fp16 d, the requantization and the packing."""
    max_scale = F32(0.0)
    amax = F32(0.0)
    for j in range(16):
        s = scales[j]
        if abs(s) > amax:
            amax = abs(s)
            max_scale = s
    for k in range(12):
        y[p + 96 + k] = 0
    if max_scale != 0:
        iscale = F32(-32.0) / max_scale
        for j in range(16):
            l = max(-32, min(31, as_int8(nearest_int(iscale * scales[j])))) + 32
            _q3_K_put_scale(y, p + 96, j, l)
        put_fp16(y, p + 108, F32(1.0) / iscale)
    else:
        put_fp16(y, p + 108, F32(0.0))
    _q3_K_finish(xr, o, y, p, L)


@njit(**JIT)
def q3_K_impl_rows(x, qw, out):
    n_rows, n = x.shape
    for r in range(n_rows):
        xr = x[r]
        y = out[r]
        L = np.empty(QK_K, np.int8)
        scales = np.empty(16, np.float32)
        w = np.empty(16, np.float32)
        sw = np.empty(16, np.float32)
        Ls = np.empty(16, np.int8)
        tmp = np.empty(QX_TMP, np.float32)
        for i in range(n // QK_K):
            o = QK_K * i
            p = 110 * i
            sigma2 = F32(2.0) * sum_sq(xr, o, QK_K) / F32(QK_K)
            for j in range(16):
                for l in range(16):
                    xv = xr[o + 16 * j + l]
                    w[l] = qw[o + 16 * j + l] * np.sqrt(sigma2 + xv * xv)
                s = F32(0.0)
                for l in range(16):
                    s += w[l]
                sw[j] = s
                scales[j] = make_qx_quants(16, 4, xr, o + 16 * j, L, 16 * j, w, 0, tmp)
            for k in range(12):
                y[p + 96 + k] = 0
            d_block = make_qx_quants(16, 32, scales, 0, Ls, 0, sw, 0, tmp)
            for j in range(16):
                _q3_K_put_scale(y, p + 96, j, np.int64(Ls[j]))
            put_fp16(y, p + 108, d_block)
            _q3_K_finish(xr, o, y, p, L)


# --- Q4_K / Q5_K: 8 sub-blocks of 32, 4/5-bit levels with 6-bit scale and min ------------------------
# block_q4_K: d, dmin, scales[12], qs[128]; block_q5_K: d, dmin, scales[12], qh[32], qs[128]

@njit(**JIT)
def _put_scale_min_k4(y, s0, j, ls, lm):
    """The 6-bit (scale, min) pair of sub-block j in the 12 scale bytes (inverse of get_scale_min_k4)."""
    if j < 4:
        y[s0 + j] = ls & 0xFF
        y[s0 + j + 4] = lm & 0xFF
    else:
        y[s0 + j + 4] = ((ls & 0xF) | ((lm & 0xF) << 4)) & 0xFF
        y[s0 + j - 4] |= ((ls >> 4) << 6) & 0xFF
        y[s0 + j] |= ((lm >> 4) << 6) & 0xFF


@njit(**JIT)
def _get_scale_min_k4(y, s0, j):
    if j < 4:
        return np.int64(y[s0 + j]) & 63, np.int64(y[s0 + j + 4]) & 63
    sc = (np.int64(y[s0 + j + 4]) & 0xF) | ((np.int64(y[s0 + j - 4]) >> 6) << 4)
    m = (np.int64(y[s0 + j + 4]) >> 4) | ((np.int64(y[s0 + j]) >> 6) << 4)
    return sc, m


@njit(**JIT)
def _qk_requantize(xr, o, y, p, nmax, L):
    """Levels with the stored scales: L = clamp(nearest_int((x + dmin*m)/(d*sc)), 0, nmax), per 32."""
    dd = get_fp16(y, p)
    dmin = get_fp16(y, p + 2)
    for j in range(8):
        sc, m = _get_scale_min_k4(y, p + 4, j)
        d = dd * F32(sc)
        if d == 0:
            continue
        dm = dmin * F32(m)
        for ii in range(32):
            L[32 * j + ii] = max(0, min(nmax, nearest_int((xr[o + 32 * j + ii] + dm) / d)))


@njit(**JIT)
def _q4_K_pack(L, y, p):
    for c in range(4):
        for l in range(32):
            y[p + 16 + 32 * c + l] = (L[64 * c + l] | (L[64 * c + 32 + l] << 4)) & 0xFF


@njit(**JIT)
def _q5_K_pack(L, y, p):
    qh = p + 16
    ql = p + 48
    for l in range(32):
        y[qh + l] = 0
    for c in range(4):
        for l in range(32):
            l1 = np.int64(L[64 * c + l])
            if l1 > 15:
                l1 -= 16
                y[qh + l] |= 1 << (2 * c)
            l2 = np.int64(L[64 * c + 32 + l])
            if l2 > 15:
                l2 -= 16
                y[qh + l] |= 2 << (2 * c)
            y[ql + 32 * c + l] = (l1 | (l2 << 4)) & 0xFF


@njit(**JIT)
def _qk_ref_block(xr, o, y, p, nmax, rmin, nstep, L, Laux, w, scales, mins, tmp):
    """quantize_row_q4_K_ref / q5_K_ref for one super-block up to the levels (nmax 15 / 31)."""
    max_scale = F32(0.0)
    max_min = F32(0.0)
    for j in range(8):
        av_x = np.sqrt(sum_sq(xr, o + 32 * j, 32) / F32(32.0))
        for l in range(32):
            w[l] = av_x + abs(xr[o + 32 * j + l])
        s, m = make_qkx_quants(32, nmax, xr, o + 32 * j, w, L, 32 * j, Laux, rmin, F32(0.1), nstep, False, tmp)
        scales[j] = s
        mins[j] = m
        if s > max_scale:
            max_scale = s
        if m > max_min:
            max_min = m
    inv_scale = F32(63.0) / max_scale if max_scale > 0 else F32(0.0)
    inv_min = F32(63.0) / max_min if max_min > 0 else F32(0.0)
    for j in range(8):
        ls = min(63, nearest_int(inv_scale * scales[j]) & 0xFF)  # uint8_t ls = nearest_int(..); MIN(63, ls)
        lm = min(63, nearest_int(inv_min * mins[j]) & 0xFF)
        _put_scale_min_k4(y, p + 4, j, ls, lm)
    put_fp16(y, p, max_scale / F32(63.0))
    put_fp16(y, p + 2, max_min / F32(63.0))
    _qk_requantize(xr, o, y, p, nmax, L)


@njit(**JIT)
def _qk_impl_block(xr, o, qw, y, p, nmax, clamp_levels, L, Laux, w, scales, mins, sw, Ls, Lm, tmp):
    """quantize_row_q4_K_impl / q5_K_impl for one super-block up to the levels. q5_K_impl clamps the scale
    levels to 63 (clamp_levels); q4_K_impl does not (make_qp_quants keeps them <= 63 unless they wrapped)."""
    sigma2 = F32(2.0) * sum_sq(xr, o, QK_K) / F32(QK_K)
    for j in range(8):
        for l in range(32):
            xv = xr[o + 32 * j + l]
            w[l] = qw[o + 32 * j + l] * np.sqrt(sigma2 + xv * xv)
        s = F32(0.0)
        for l in range(32):
            s += w[l]
        sw[j] = s
        scales[j], mins[j] = make_qkx_quants(32, nmax, xr, o + 32 * j, w, L, 32 * j, Laux, F32(-0.9), F32(0.05), 36,
                                             False, tmp)
    d_block = make_qp_quants(8, 63, scales, Ls, sw)
    m_block = make_qp_quants(8, 63, mins, Lm, sw)
    for j in range(8):
        ls = np.int64(Ls[j])
        lm = np.int64(Lm[j])
        if clamp_levels:
            ls = min(63, ls)
            lm = min(63, lm)
        _put_scale_min_k4(y, p + 4, j, ls, lm)
    put_fp16(y, p, d_block)
    put_fp16(y, p + 2, m_block)
    _qk_requantize(xr, o, y, p, nmax, L)


@njit(**JIT)
def q4_K_ref_rows(x, out):
    n_rows, n = x.shape
    for r in range(n_rows):
        L = np.empty(QK_K, np.uint8)
        Laux = np.empty(32, np.uint8)
        w = np.empty(32, np.float32)
        tmp = np.empty(160, np.float32)
        scales = np.empty(8, np.float32)
        mins = np.empty(8, np.float32)
        for i in range(n // QK_K):
            _qk_ref_block(x[r], QK_K * i, out[r], 144 * i, 15, F32(-1.0), 20, L, Laux, w, scales, mins, tmp)
            _q4_K_pack(L, out[r], 144 * i)


@njit(**JIT)
def q5_K_ref_rows(x, out):
    n_rows, n = x.shape
    for r in range(n_rows):
        L = np.empty(QK_K, np.uint8)
        Laux = np.empty(32, np.uint8)
        w = np.empty(32, np.float32)
        tmp = np.empty(160, np.float32)
        scales = np.empty(8, np.float32)
        mins = np.empty(8, np.float32)
        for i in range(n // QK_K):
            _qk_ref_block(x[r], QK_K * i, out[r], 176 * i, 31, F32(-0.5), 15, L, Laux, w, scales, mins, tmp)
            _q5_K_pack(L, out[r], 176 * i)


@njit(**JIT)
def q4_K_impl_rows(x, qw, out):
    n_rows, n = x.shape
    for r in range(n_rows):
        L = np.empty(QK_K, np.uint8)
        Laux = np.empty(32, np.uint8)
        w = np.empty(32, np.float32)
        tmp = np.empty(160, np.float32)
        scales = np.empty(8, np.float32)
        mins = np.empty(8, np.float32)
        sw = np.empty(8, np.float32)
        Ls = np.empty(8, np.uint8)
        Lm = np.empty(8, np.uint8)
        for i in range(n // QK_K):
            _qk_impl_block(x[r], QK_K * i, qw, out[r], 144 * i, 15, False, L, Laux, w, scales, mins, sw, Ls, Lm, tmp)
            _q4_K_pack(L, out[r], 144 * i)


@njit(**JIT)
def q5_K_impl_rows(x, qw, out):
    n_rows, n = x.shape
    for r in range(n_rows):
        L = np.empty(QK_K, np.uint8)
        Laux = np.empty(32, np.uint8)
        w = np.empty(32, np.float32)
        tmp = np.empty(160, np.float32)
        scales = np.empty(8, np.float32)
        mins = np.empty(8, np.float32)
        sw = np.empty(8, np.float32)
        Ls = np.empty(8, np.uint8)
        Lm = np.empty(8, np.uint8)
        for i in range(n // QK_K):
            _qk_impl_block(x[r], QK_K * i, qw, out[r], 176 * i, 31, True, L, Laux, w, scales, mins, sw, Ls, Lm, tmp)
            _q5_K_pack(L, out[r], 176 * i)


# --- Q6_K: 16 sub-blocks of 16, 6-bit signed levels, int8 scales ----------------------------------
# block_q6_K: ql[128], qh[64], scales[16] (int8), d

@njit(**JIT)
def _q6_K_block(xr, o, qw, y, p, L, w, scales, tmp):
    max_scale = F32(0.0)
    max_abs_scale = F32(0.0)
    for ib in range(16):
        for j in range(16):
            xv = xr[o + 16 * ib + j]
            w[j] = qw[o + 16 * ib + j] if qw.shape[0] else xv * xv  # qw raw (impl) or x^2 (ref: qw NULL)
        s = make_qx_quants(16, 32, xr, o + 16 * ib, L, 16 * ib, w, 0, tmp)
        scales[ib] = s
        if abs(s) > max_abs_scale:
            max_abs_scale = abs(s)
            max_scale = s
    if max_abs_scale < GROUP_MAX_EPS:
        for k in range(210):
            y[p + k] = 0
        return
    iscale = F32(-128.0) / max_scale
    put_fp16(y, p + 208, F32(1.0) / iscale)
    dd = get_fp16(y, p + 208)
    for ib in range(16):
        y[p + 192 + ib] = min(127, nearest_int(iscale * scales[ib])) & 0xFF
    for j in range(16):
        d = dd * F32(as_int8(np.int64(y[p + 192 + j])))
        if d == 0:
            continue
        for ii in range(16):
            L[16 * j + ii] = max(-32, min(31, nearest_int(xr[o + 16 * j + ii] / d))) + 32
    for h in range(2):
        ql = p + 64 * h
        qh = p + 128 + 32 * h
        for l in range(32):
            j = 128 * h + l
            q1 = np.int64(L[j])
            q2 = np.int64(L[j + 32])
            q3 = np.int64(L[j + 64])
            q4 = np.int64(L[j + 96])
            y[ql + l] = ((q1 & 0xF) | ((q3 & 0xF) << 4)) & 0xFF
            y[ql + l + 32] = ((q2 & 0xF) | ((q4 & 0xF) << 4)) & 0xFF
            y[qh + l] = ((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)) & 0xFF


@njit(**JIT)
def q6_K_ref_rows(x, out):
    for r in range(x.shape[0]):
        L = np.empty(QK_K, np.int8)
        w = np.empty(16, np.float32)
        scales = np.empty(16, np.float32)
        tmp = np.empty(QX_TMP, np.float32)
        for i in range(x.shape[1] // QK_K):
            _q6_K_block(x[r], QK_K * i, NO_WEIGHTS, out[r], 210 * i, L, w, scales, tmp)


@njit(**JIT)
def q6_K_impl_rows(x, qw, out):
    for r in range(x.shape[0]):
        L = np.empty(QK_K, np.int8)
        w = np.empty(16, np.float32)
        scales = np.empty(16, np.float32)
        tmp = np.empty(QX_TMP, np.float32)
        for i in range(x.shape[1] // QK_K):
            _q6_K_block(x[r], QK_K * i, qw, out[r], 210 * i, L, w, scales, tmp)
