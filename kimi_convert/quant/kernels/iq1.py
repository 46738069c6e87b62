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
    merge sort, keeps them so). Each value's place is its rank: the values below it, and the equal ones
    before it (one pass over all pairs, which vectorizes). With a NaN the ranks need not be a permutation:
    then an insertion sort, stable and treating NaN as equal to all, as ggml's comparison does."""
    xs = x[o:o + n]
    nan = False
    for i in range(n):
        v = xs[i]
        nan |= v != v
        rank = np.int32(0)
        for j in range(i):
            rank += np.int32(xs[j] <= v)
        for j in range(i, n):
            rank += np.int32(xs[j] < v)
        order[rank] = i
    if nan:
        for j in range(n):
            v = xs[j]
            k = j
            while k > 0 and xs[order[k - 1]] > v:
                order[k] = order[k - 1]
                k -= 1
            order[k] = j


@njit(**INLINE)
def point_levels(grid):
    """(levels, head): each grid point's 8 levels (pg[i] - 1)/2, uint8 [n_points, 8], and the base-3 number
    of its first 4, int64 [n_points] (its entry in best_neighbour's table of head sums)."""
    n_points = grid.shape[0]
    levels = np.empty((n_points, 8), np.uint8)
    head = np.empty(n_points, np.int64)
    for p in range(n_points):
        for i in range(8):
            levels[p, i] = (grid[p, i] - 1) >> 1
        head[p] = levels[p, 0] + 3 * levels[p, 1] + 9 * levels[p, 2] + 27 * levels[p, 3]
    return levels, head


@njit(**INLINE)
def best_neighbour(levels, head, kmap, neighbours, u, x, o, w, wo, scale, xg, err):
    """iq1_find_best_neighbour2 for the off-grid vector ``u``: the listed grid point with the least
    d2 = sum over i < 8 of w*(scale*xg[level_i] - x_i)^2, x = x[o:o+8], w = w[wo:wo+8] (the first of equal
    ones). Each term is err[3*i + level]; ggml adds a point's 8 terms in order from 0, so the sum of the
    first 4 is one of 81 values, tabulated once (err[24:105], indexed by ``head``), and each point adds its
    last 4 terms to it. err: float32 scratch of 105."""
    for i in range(8):
        xi = x[o + i]
        wi = w[wo + i]
        for lv in range(3):
            diff = scale * xg[lv] - xi
            err[3 * i + lv] = wi * diff * diff
    sums = err[24:105]                          # sums[l0 + 3*l1 + 9*l2 + 27*l3]
    for l0 in range(3):
        sums[l0] = F32(0.0) + err[l0]
    for i in range(1, 4):
        stride = 3 ** i
        for lv in range(2, -1, -1):             # from the top: the lower part is read before it is replaced
            for c in range(stride):
                sums[lv * stride + c] = sums[c] + err[3 * i + lv]
    start = -kmap[u] - 1
    best = FLT_MAX
    index = np.int64(neighbours[start + 1])     # ggml would read out of bounds when no d2 < FLT_MAX (inf input)
    for j in range(1, np.int64(neighbours[start]) + 1):
        p = neighbours[start + j]
        lp = levels[p]
        d2 = sums[head[p]]
        d2 += err[12 + lp[4]]
        d2 += err[15 + lp[5]]
        d2 += err[18 + lp[6]]
        d2 += err[21 + lp[7]]
        if d2 < best:
            best = d2
            index = np.int64(p)
    return index


@njit(**INLINE)
def group_index(L, lo, levels, head, kmap, neighbours, x, o, w, wo, scale, xg, err):
    """The grid point of levels L[lo:lo+8]: kmap's, or the best neighbour if they are off the grid.
    Returns (index, on the grid)."""
    u = 0
    for j in range(8):
        u |= np.int64(L[lo + j]) << (2 * j)
    index = np.int64(kmap[u])
    if index >= 0:
        return index, True
    return best_neighbour(levels, head, kmap, neighbours, u, x, o, w, wo, scale, xg, err), False


@njit(**INLINE)
def put_u16(y, pos, v):
    y[pos] = v & 0xFF
    y[pos + 1] = (v >> 8) & 0xFF


# ====================================================================================================
# IQ1_S (quantize_row_iq1_s_impl; ggml asserts an imatrix)
# ====================================================================================================

@njit(**INLINE)
def _first_pass_s(qxp, q2p, qxm, q2m, t0, m, best):
    """The first t in [t0, m) where one of the two shifts' candidates passes ggml's test against ``best``,
    else m. (A min over all t, without an early exit, so that it vectorizes.)"""
    first = m
    for t in range(t0, m):
        ok = ((q2p[t] > 0) & (qxp[t] * qxp[t] > best * q2p[t])) | ((q2m[t] > 0) & (qxm[t] * qxm[t] > best * q2m[t]))
        first = min(first, t if ok else m)
    return first


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
        t = _first_pass_s(qxp, q2p, qxm, q2m, 0, m, best)
        while t < m:
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
            t = _first_pass_s(qxp, q2p, qxm, q2m, t + 1, m, best)
    return besti1, besti2, best_shift, scale


@njit(**INLINE)
def _iq1_s_row(xr, qw, y, grid, levels, head, kmap, neighbours):
    n = IQ1S_BLOCK
    weight = np.empty(n, np.float32)
    order = np.empty(n, np.int64)
    L = np.empty(n, np.int64)
    sumx = np.empty(n + 1, np.float32)
    sumw = np.empty(n + 1, np.float32)
    tmp = np.empty(4 * (n + 1), np.float32)
    err = np.empty(105, np.float32)
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
                gi, on_grid = group_index(L, 8 * k, levels, head, kmap, neighbours, xr, ob + 8 * k, weight, 8 * k,
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
    levels, head = point_levels(grid)
    for r in range(x.shape[0]):
        _iq1_s_row(x[r], qw, out[r], grid, levels, head, kmap, neighbours)


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
def _iq1_m_split(px0, px1, pw0, pw1):
    """The best (i1, i2, k) of the 153 splits x 4 shift combinations of a 16-value sub-block, and its scale,
    from the prefix sums of w*x (px) and w (pw) of each half, in sorted order [17]. ggml rewrites each half's
    3-group sums as total*v[2] - px[i1] - px[i2] (and likewise for w): its operations, in its order; the
    terms of i1 alone are formed once per i1. k -1 when no candidate has sumq2 > 0.

    A plain walk: here the best improves at most steps of the first rows (about 30 times per sub-block), so
    the screening of _iq1_s_split would rescreen after nearly every step, and cost more than it saves."""
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
    best = -FLT_MAX
    scale = F32(0.0)
    besti1 = -1
    besti2 = -1
    best_k = -1
    for i1 in range(n + 1):
        a0 = px0[i1]
        a1 = px1[i1]
        hp0 = wp0 + pw0[i1] * cp1
        hm0 = wm0 + pw0[i1] * cm1
        hp1 = wp1 + pw1[i1] * cp1
        hm1 = wm1 + pw1[i1] * cm1
        for i2 in range(i1, n + 1):
            sx0 = a0 + px0[i2]
            sx1 = a1 + px1[i2]
            qxp0 = tp0 - sx0
            qxm0 = tm0 - sx0
            qxp1 = tp1 - sx1
            qxm1 = tm1 - sx1
            q2p0 = hp0 + pw0[i2] * cp2
            q2m0 = hm0 + pw0[i2] * cm2
            q2p1 = hp1 + pw1[i2] * cp2
            q2m1 = hm1 + pw1[i2] * cm2
            for k in range(4):
                qx0 = qxp0 if k < 2 else qxm0
                q20 = q2p0 if k < 2 else q2m0
                sqx = qx0 + (qxp1 if k % 2 == 0 else qxm1)
                sq2 = q20 + (q2p1 if k % 2 == 0 else q2m1)
                if sq2 > 0 and sqx * sqx > best * sq2:
                    scale = sqx / sq2
                    best = scale * sqx
                    besti1 = i1
                    besti2 = i2
                    best_k = k
    return besti1, besti2, best_k, scale


@njit(**INLINE)
def _iq1_m_row(xr, qw, y, grid, levels, head, kmap, neighbours, sort):
    """One row of quantize_row_iq1_m_impl; ``sort`` orders a sub-block's values (stable_order, glibc's; a
    parameter so that a test can show that another tie order changes the bytes)."""
    n = IQ1M_BLOCK
    weight = np.empty(QK_K, np.float32)     # the super-block's, read again by the final scale's fit
    order = np.empty(n, np.int64)
    L = np.empty(n, np.int64)
    px0 = np.empty(n + 1, np.float32)
    px1 = np.empty(n + 1, np.float32)
    pw0 = np.empty(n + 1, np.float32)
    pw1 = np.empty(n + 1, np.float32)
    err = np.empty(105, np.float32)
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
            sort(xr, ob, n, order)
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
            besti1, besti2, best_k, scale = _iq1_m_split(px0, px1, pw0, pw1)
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
                gi, on_grid = group_index(L, 8 * k, levels, head, kmap, neighbours, xr, ob + 8 * k, weight, wo + 8 * k,
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
    levels, head = point_levels(grid)
    for r in range(x.shape[0]):
        _iq1_m_row(x[r], NO_WEIGHTS, out[r], grid, levels, head, kmap, neighbours, stable_order)


@njit(**JIT)
def iq1_m_impl_rows(x, qw, out, grid, kmap, neighbours):
    levels, head = point_levels(grid)
    for r in range(x.shape[0]):
        _iq1_m_row(x[r], qw, out[r], grid, levels, head, kmap, neighbours, stable_order)
