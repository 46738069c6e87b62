"""IQ1_S and IQ1_M: 1.56 and 1.75 bpw, ternary levels {-1, 0, 1} shifted by +-IQ1S_DELTA, projected onto the
2048-point grid ``kgrid_1bit_2048`` (kernels/grids.py; IQ1_M reads IQ1_S's tables, as ggml does).

``quantize_row_iq1_s_impl`` and ``quantize_row_iq1_m_impl`` (ggml-quants.c) find each sub-block's levels by
an exhaustive search of the two boundaries that split its values, sorted, into the three levels: every split
(i1 <= i2) and shift is scored from prefix sums of w*x and w in sorted order. Two things decide the bytes
beyond the arithmetic order:

* the order of equal values. ggml sorts (value, index) pairs with ``qsort`` on the value only; glibc's qsort is
  a merge sort, stable, so equal values keep their index order. IQ1_M's prefix sums are kept per half of its
  16 values, so which splits exist depends on how the equal values of the two halves interleave: a different
  tie order changes its bytes (on dequantized MXFP4 rows, whose blocks are full of ties, most super-blocks).
  ``stable_order`` sorts as glibc does.
* the first best candidate wins (strict ``>``), in ggml's loop order (i1, then i2, then the shift).

How the split search is made fast without changing a float operation: the candidates' sums do not depend on
the running best, so for each i1 those of all i2 are formed in one loop (which vectorizes); then one vector
pass tests them all against the best so far. Only where some candidate passes (a few rows at the start of a
sub-block) are they walked one by one in ggml's order, with ggml's updates; where none passes, ggml's walk
would not have changed the best either.

The neighbour search (``iq1_find_best_neighbour2``) scores a grid point by sum over its 8 coordinates of
w*(scale*xg[level] - x)^2: each term depends on the coordinate and its level (3 values) only, so the 24 terms
are formed once per group and each point's score is the in-order sum of 8 looked-up terms, the same floats.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .common import F32, FLT_MAX, INLINE, JIT, NO_WEIGHTS, QK_K, fp32_to_fp16, nearest_int, put_fp16, sum_sq

IQ1S_DELTA = F32(0.125)
# x_p and x_m: the three level values with the shift +DELTA and -DELTA (exact in float32)
X_P = np.array([-1 + 0.125, 0.125, 1 + 0.125], np.float32)
X_M = np.array([-1 - 0.125, -0.125, 1 - 0.125], np.float32)
GROUP_MAX_EPS_IQ1_S = F32(1e-12)
GROUP_MAX_EPS_IQ1_M = F32(1e-7)
IQ1S_BLOCK = 32                 # values per IQ1_S sub-block
IQ1M_BLOCK = 16
IQ1S_BYTES = 50                 # block_iq1_s: d (fp16), qs[32], qh[8] (uint16)
IQ1M_BYTES = 56                 # block_iq1_m: qs[32], qh[16], scales[8] (4 uint16, the fp16 scale in their top nibbles)
IQ1S_FUDGE = F32(1.125)
IQ1M_FUDGE = F32(1.1125)
# IQ1_M's qh bits of a sub-block's shifts, by its shift combination k (bit 1: first half -DELTA, bit 0: second)
IQ1M_SHIFT_BITS = np.array([0x00, 0x80, 0x08, 0x88], np.int64)


# ====================================================================================================
# shared: the sort and the neighbour search
# ====================================================================================================

@njit(**INLINE)
def stable_order(x, o, n, order):
    """order[0:n] = the indices of x[o:o+n] sorted by value, equal values in index order (glibc's qsort, a
    merge sort, keeps them so). Insertion sort: stable, and fast for n <= 32."""
    xs = x[o:o + n]
    for j in range(n):
        v = xs[j]
        k = j
        while k > 0 and xs[order[k - 1]] > v:
            order[k] = order[k - 1]
            k -= 1
        order[k] = j


@njit(**INLINE)
def best_neighbour(grid, kmap, neighbours, u, x, o, w, wo, scale, xg, err):
    """iq1_find_best_neighbour2 for the off-grid vector ``u``: the listed grid point with the least
    sum of w*(scale*xg[level] - x)^2 over x[o:o+8], weights w[wo:wo+8] (the first of equal ones).
    err: float32 scratch of 24."""
    for i in range(8):
        xi = x[o + i]
        wi = w[wo + i]
        for lv in range(3):
            diff = scale * xg[lv] - xi
            err[3 * i + lv] = wi * diff * diff
    start = -kmap[u] - 1
    best = FLT_MAX
    index = neighbours[start + 1]   # ggml would read out of bounds when no score is < FLT_MAX (inf input)
    for j in range(1, np.int64(neighbours[start]) + 1):
        p = np.int64(neighbours[start + j])
        d2 = F32(0.0)
        for i in range(8):
            d2 += err[3 * i + ((grid[p, i] - 1) >> 1)]
        if d2 < best:
            best = d2
            index = p
    return np.int64(index)


@njit(**INLINE)
def group_index(L, lo, grid, kmap, neighbours, x, o, w, wo, scale, xg, err):
    """The grid point of levels L[lo:lo+8]: kmap's, or the best neighbour if they are off the grid.
    Returns (index, on the grid)."""
    u = 0
    for j in range(8):
        u |= np.int64(L[lo + j]) << (2 * j)
    index = np.int64(kmap[u])
    if index >= 0:
        return index, True
    return best_neighbour(grid, kmap, neighbours, u, x, o, w, wo, scale, xg, err), False


@njit(**INLINE)
def put_u16(y, pos, v):
    y[pos] = v & 0xFF
    y[pos + 1] = (v >> 8) & 0xFF


# ====================================================================================================
# IQ1_S (quantize_row_iq1_s_impl; ggml asserts an imatrix)
# ====================================================================================================

@njit(**INLINE)
def _iq1_s_split(sumx, sumw, tmp):
    """The best (i1, i2, shift) of the 561 splits x 2 shifts of a 32-value sub-block, and its scale,
    from the prefix sums sumx, sumw [33]. shift 0 when no candidate has sumq2 > 0.
    tmp: float32 scratch of 4*33."""
    n = IQ1S_BLOCK
    p0, p1, p2 = X_P[0], X_P[1], X_P[2]
    m0, m1, m2 = X_M[0], X_M[1], X_M[2]
    qxp = tmp[0:33]
    q2p = tmp[33:66]
    qxm = tmp[66:99]
    q2m = tmp[99:132]
    best = -FLT_MAX
    scale = F32(0.0)
    besti1 = -1
    besti2 = -1
    best_shift = 0
    for i1 in range(n + 1):
        ax = sumx[i1] - sumx[0]
        aw = sumw[i1] - sumw[0]
        axp = ax * p0
        axm = ax * m0
        awp = aw * p0 * p0
        awm = aw * m0 * m0
        m = n + 1 - i1
        for t in range(m):
            i2 = i1 + t
            bx = sumx[i2] - sumx[i1]
            cx = sumx[n] - sumx[i2]
            bw = sumw[i2] - sumw[i1]
            cw = sumw[n] - sumw[i2]
            qxp[t] = axp + bx * p1 + cx * p2
            q2p[t] = awp + bw * p1 * p1 + cw * p2 * p2
            qxm[t] = axm + bx * m1 + cx * m2
            q2m[t] = awm + bw * m1 * m1 + cw * m2 * m2
        hits = 0
        for t in range(m):
            hits += ((q2p[t] > 0) & (qxp[t] * qxp[t] > best * q2p[t])) | \
                    ((q2m[t] > 0) & (qxm[t] * qxm[t] > best * q2m[t]))
        if hits == 0:
            continue
        for t in range(m):
            if q2p[t] > 0 and qxp[t] * qxp[t] > best * q2p[t]:
                scale = qxp[t] / q2p[t]
                best = scale * qxp[t]
                besti1 = i1
                besti2 = i1 + t
                best_shift = 1
            if q2m[t] > 0 and qxm[t] * qxm[t] > best * q2m[t]:
                scale = qxm[t] / q2m[t]
                best = scale * qxm[t]
                besti1 = i1
                besti2 = i1 + t
                best_shift = -1
    return besti1, besti2, best_shift, scale


@njit(**INLINE)
def _iq1_s_row(xr, qw, y, grid, kmap, neighbours):
    n = IQ1S_BLOCK
    weight = np.empty(n, np.float32)
    order = np.empty(n, np.int64)
    L = np.empty(n, np.int64)
    sumx = np.empty(n + 1, np.float32)
    sumw = np.empty(n + 1, np.float32)
    tmp = np.empty(4 * (n + 1), np.float32)
    err = np.empty(24, np.float32)
    scales = np.empty(QK_K // n, np.float32)
    shifts = np.empty(QK_K // n, np.int64)
    index = np.empty(4, np.int64)
    for ibl in range(xr.shape[0] // QK_K):
        p = IQ1S_BYTES * ibl
        y[p:p + IQ1S_BYTES] = 0
        o = QK_K * ibl
        sigma2 = F32(2.0) * sum_sq(xr, o, QK_K) / F32(QK_K)
        max_scale = F32(0.0)
        for ib in range(QK_K // n):
            ob = o + n * ib
            for i in range(n):
                xi = xr[ob + i]
                weight[i] = qw[ob + i] * np.sqrt(sigma2 + xi * xi)
            mx = abs(xr[ob])
            for i in range(1, n):
                a = abs(xr[ob + i])
                mx = mx if mx > a else a
            scales[ib] = F32(0.0)
            shifts[ib] = 1
            if mx < GROUP_MAX_EPS_IQ1_S:
                continue
            stable_order(xr, ob, n, order)
            sumx[0] = F32(0.0)
            sumw[0] = F32(0.0)
            for j in range(n):
                i = order[j]
                sumx[j + 1] = sumx[j] + weight[i] * xr[ob + i]
                sumw[j + 1] = sumw[j] + weight[i]
            besti1, besti2, best_shift, scale = _iq1_s_split(sumx, sumw, tmp)
            if besti1 < 0 or besti2 < 0 or best_shift == 0:
                continue
            for j in range(n):
                L[order[j]] = 0 if j < besti1 else (1 if j < besti2 else 2)
            if scale < 0:
                for j in range(n):
                    L[j] = 2 - L[j]
                scale = -scale
                best_shift = -best_shift
            xx = X_P if best_shift == 1 else X_M
            all_on_grid = True
            for k in range(n // 8):
                gi, on_grid = group_index(L, 8 * k, grid, kmap, neighbours, xr, ob + 8 * k, weight, 8 * k,
                                          scale, xx, err)
                index[k] = gi
                all_on_grid = all_on_grid and on_grid
            if not all_on_grid:
                sumqx = F32(0.0)
                sumq2 = F32(0.0)
                for k in range(n // 8):
                    for j in range(8):
                        w = weight[8 * k + j]
                        q = xx[(grid[index[k], j] - 1) >> 1]
                        sumqx += w * q * xr[ob + 8 * k + j]
                        sumq2 += w * q * q
                if sumqx > 0 and sumq2 > 0:
                    scale = sumqx / sumq2
            h = 0
            for k in range(n // 8):
                y[p + 2 + 4 * ib + k] = index[k] & 255
                h |= (index[k] >> 8) << (3 * k)
            put_u16(y, p + 34 + 2 * ib, h)
            scales[ib] = scale
            shifts[ib] = best_shift
            max_scale = max_scale if max_scale > scale else scale
        if max_scale == 0:
            continue
        d = max_scale / F32(15.0)
        put_fp16(y, p, d * IQ1S_FUDGE)
        idd = F32(1.0) / d
        for ib in range(QK_K // n):
            l = max(0, min(7, nearest_int(F32(0.5) * (idd * scales[ib] - F32(1.0)))))
            if shifts[ib] == -1:
                l |= 8
            y[p + 34 + 2 * ib + 1] |= l << 4        # bits 12..15 of qh[ib]


@njit(**JIT)
def iq1_s_impl_rows(x, qw, out, grid, kmap, neighbours):
    for r in range(x.shape[0]):
        _iq1_s_row(x[r], qw, out[r], grid, kmap, neighbours)


# ====================================================================================================
# IQ1_M (quantize_row_iq1_m_impl; without an imatrix the weights are x^2)
# ====================================================================================================

@njit(**INLINE)
def _half_values(k, half):
    """The level values of half ``half`` (0, 1) of an IQ1_M sub-block with shift combination k:
    0 (+, +), 1 (+, -), 2 (-, +), 3 (-, -)."""
    minus = k >= 2 if half == 0 else k % 2 == 1
    return X_M if minus else X_P


@njit(**INLINE)
def _iq1_m_split(px0, px1, pw0, pw1, tmp):
    """The best (i1, i2, k) of the 153 splits x 4 shift combinations of a 16-value sub-block, and its scale,
    from the prefix sums of w*x (px) and w (pw) of each half, in sorted order [17]. ggml rewrites each half's
    3-group sums as total*v[2] - px[i1] - px[i2] (and likewise for w): its operations, in its order.
    k -1 when no candidate has sumq2 > 0. tmp: float32 scratch of 8*17."""
    n = IQ1M_BLOCK
    p2 = X_P[2]
    m2 = X_M[2]
    cp1 = X_P[0] * X_P[0] - X_P[1] * X_P[1]
    cp2 = X_P[1] * X_P[1] - X_P[2] * X_P[2]
    cm1 = X_M[0] * X_M[0] - X_M[1] * X_M[1]
    cm2 = X_M[1] * X_M[1] - X_M[2] * X_M[2]
    tp0 = px0[n] * p2
    tm0 = px0[n] * m2
    tp1 = px1[n] * p2
    tm1 = px1[n] * m2
    wp0 = pw0[n] * p2 * p2
    wm0 = pw0[n] * m2 * m2
    wp1 = pw1[n] * p2 * p2
    wm1 = pw1[n] * m2 * m2
    qx0, qx1, qx2, qx3 = tmp[0:17], tmp[17:34], tmp[34:51], tmp[51:68]
    q20, q21, q22, q23 = tmp[68:85], tmp[85:102], tmp[102:119], tmp[119:136]
    best = -FLT_MAX
    scale = F32(0.0)
    besti1 = -1
    besti2 = -1
    best_k = -1
    for i1 in range(n + 1):
        a0 = px0[i1]
        a1 = px1[i1]
        b0 = pw0[i1]
        b1 = pw1[i1]
        m = n + 1 - i1
        for t in range(m):
            i2 = i1 + t
            sx0 = a0 + px0[i2]
            sx1 = a1 + px1[i2]
            qxp0 = tp0 - sx0
            qxm0 = tm0 - sx0
            qxp1 = tp1 - sx1
            qxm1 = tm1 - sx1
            q2p0 = wp0 + b0 * cp1 + pw0[i2] * cp2
            q2m0 = wm0 + b0 * cm1 + pw0[i2] * cm2
            q2p1 = wp1 + b1 * cp1 + pw1[i2] * cp2
            q2m1 = wm1 + b1 * cm1 + pw1[i2] * cm2
            qx0[t] = qxp0 + qxp1
            qx1[t] = qxp0 + qxm1
            qx2[t] = qxm0 + qxp1
            qx3[t] = qxm0 + qxm1
            q20[t] = q2p0 + q2p1
            q21[t] = q2p0 + q2m1
            q22[t] = q2m0 + q2p1
            q23[t] = q2m0 + q2m1
        hits = 0
        for t in range(m):
            hits += ((q20[t] > 0) & (qx0[t] * qx0[t] > best * q20[t])) | \
                    ((q21[t] > 0) & (qx1[t] * qx1[t] > best * q21[t])) | \
                    ((q22[t] > 0) & (qx2[t] * qx2[t] > best * q22[t])) | \
                    ((q23[t] > 0) & (qx3[t] * qx3[t] > best * q23[t]))
        if hits == 0:
            continue
        for t in range(m):
            for k in range(4):
                sqx = tmp[17 * k + t]
                sq2 = tmp[68 + 17 * k + t]
                if sq2 > 0 and sqx * sqx > best * sq2:
                    scale = sqx / sq2
                    best = scale * sqx
                    besti1 = i1
                    besti2 = i1 + t
                    best_k = k
    return besti1, besti2, best_k, scale


@njit(**INLINE)
def _iq1_m_row(xr, qw, y, grid, kmap, neighbours):
    n = IQ1M_BLOCK
    weight = np.empty(QK_K, np.float32)     # the super-block's, read again by the final scale's fit
    order = np.empty(n, np.int64)
    L = np.empty(n, np.int64)
    px0 = np.empty(n + 1, np.float32)
    px1 = np.empty(n + 1, np.float32)
    pw0 = np.empty(n + 1, np.float32)
    pw1 = np.empty(n + 1, np.float32)
    tmp = np.empty(8 * (n + 1), np.float32)
    err = np.empty(24, np.float32)
    scales = np.empty(QK_K // n, np.float32)
    shifts = np.empty(QK_K // n, np.int64)
    index = np.empty(2, np.int64)
    sc = np.empty(4, np.int64)
    for ibl in range(xr.shape[0] // QK_K):
        p = IQ1M_BYTES * ibl
        y[p:p + IQ1M_BYTES] = 0
        o = QK_K * ibl
        sigma2 = F32(2.0) * sum_sq(xr, o, QK_K) / F32(QK_K)
        for i in range(QK_K):
            xi = xr[o + i]
            weight[i] = qw[o + i] * np.sqrt(sigma2 + xi * xi) if qw.shape[0] else xi * xi
        max_scale = F32(0.0)
        for ib in range(QK_K // n):
            ob = o + n * ib
            wo = n * ib
            mx = abs(xr[ob])
            for i in range(1, n):
                a = abs(xr[ob + i])
                mx = mx if mx > a else a
            scales[ib] = F32(0.0)
            shifts[ib] = 0
            if mx < GROUP_MAX_EPS_IQ1_M:
                continue
            stable_order(xr, ob, n, order)
            px0[0] = F32(0.0)
            px1[0] = F32(0.0)
            pw0[0] = F32(0.0)
            pw1[0] = F32(0.0)
            for j in range(n):
                i = order[j]
                wi = weight[wo + i]
                wx = wi * xr[ob + i]
                if i < n // 2:
                    px0[j + 1] = px0[j] + wx
                    pw0[j + 1] = pw0[j] + wi
                    px1[j + 1] = px1[j]
                    pw1[j + 1] = pw1[j]
                else:
                    px1[j + 1] = px1[j] + wx
                    pw1[j + 1] = pw1[j] + wi
                    px0[j + 1] = px0[j]
                    pw0[j + 1] = pw0[j]
            besti1, besti2, best_k, scale = _iq1_m_split(px0, px1, pw0, pw1, tmp)
            if besti1 < 0 or besti2 < 0 or best_k < 0:
                continue
            for j in range(n):
                L[order[j]] = 0 if j < besti1 else (1 if j < besti2 else 2)
            if scale < 0:
                for j in range(n):
                    L[j] = 2 - L[j]
                scale = -scale
                best_k = 3 - best_k             # both halves' shifts flip
            all_on_grid = True
            for k in range(2):
                gi, on_grid = group_index(L, 8 * k, grid, kmap, neighbours, xr, ob + 8 * k, weight, wo + 8 * k,
                                          scale, _half_values(best_k, k), err)
                index[k] = gi
                all_on_grid = all_on_grid and on_grid
            if not all_on_grid:
                sumqx = F32(0.0)
                sumq2 = F32(0.0)
                for k in range(2):
                    xx = _half_values(best_k, k)
                    for j in range(8):
                        w = weight[wo + 8 * k + j]
                        q = xx[(grid[index[k], j] - 1) >> 1]
                        sumqx += w * q * xr[ob + 8 * k + j]
                        sumq2 += w * q * q
                if sumqx > 0 and sumq2 > 0:
                    scale = sumqx / sumq2
            y[p + 2 * ib] = index[0] & 255
            y[p + 2 * ib + 1] = index[1] & 255
            y[p + 32 + ib] = (index[0] >> 8) | ((index[1] >> 8) << 4)
            scales[ib] = scale
            shifts[ib] = best_k
            max_scale = max_scale if max_scale > scale else scale
        if max_scale == 0:
            continue
        d = max_scale / F32(15.0)
        idd = F32(1.0) / d
        sc[:] = 0
        sumqx = F32(0.0)
        sumq2 = F32(0.0)
        for ib in range(QK_K // n):
            l = max(0, min(7, nearest_int(F32(0.5) * (idd * scales[ib] - F32(1.0)))))
            sc[ib // 4] |= l << (3 * (ib % 4))
            qh = np.int64(y[p + 32 + ib]) | IQ1M_SHIFT_BITS[shifts[ib]]
            y[p + 32 + ib] = qh
            sl = F32(2 * l + 1)
            for k in range(2):
                xx = _half_values(shifts[ib], k)
                gi = np.int64(y[p + 2 * ib + k]) + ((qh << (8 - 4 * k)) & 0x700)
                for j in range(8):
                    w = weight[n * ib + 8 * k + j]
                    q = xx[(grid[gi, j] - 1) >> 1] * sl
                    sumqx += w * q * xr[o + n * ib + 8 * k + j]
                    sumq2 += w * q * q
        if sumq2 > 0:
            d = sumqx / sumq2
        s = fp32_to_fp16(d * IQ1M_FUDGE)
        sc[0] |= (s & 0x000F) << 12
        sc[1] |= (s & 0x00F0) << 8
        sc[2] |= (s & 0x0F00) << 4
        sc[3] |= s & 0xF000
        for i in range(4):
            put_u16(y, p + 48 + 2 * i, sc[i])


@njit(**JIT)
def iq1_m_rows(x, out, grid, kmap, neighbours):
    for r in range(x.shape[0]):
        _iq1_m_row(x[r], NO_WEIGHTS, out[r], grid, kmap, neighbours)


@njit(**JIT)
def iq1_m_impl_rows(x, qw, out, grid, kmap, neighbours):
    for r in range(x.shape[0]):
        _iq1_m_row(x[r], qw, out[r], grid, kmap, neighbours)
