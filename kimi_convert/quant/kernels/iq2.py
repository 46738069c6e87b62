"""IQ2_XXS, IQ2_XS, IQ2_S: 2-bit grid i-quants (ggml-quants.c quantize_row_iq2_{xxs,xs,s}_impl).

Each group of 8 values becomes the index of a point of an 8-dimensional lattice grid (256, 512 or 1024 points
whose coordinates are levels 0..2, i.e. 1, 3, 5 times the scale) plus sign bits. The kernels take the grid's
tables (``grids.grid_tables(qtype).arrays``: grid, kmap, neighbour lists) after their data. A group whose
rounded levels are off the grid is moved to the best of its listed neighbours (iq2_find_best_neighbour).

IQ2_XXS and IQ2_XS: ggml asserts an imatrix (there is no quantize_row_*_ref), so there is only an _impl kernel.
IQ2_S runs the same impl without one, with weights 0.25*sigma2 + x^2.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .common import (F32, FLT_MAX, GROUP_MAX_EPS, HALF, INLINE, JIT, NO_WEIGHTS, QK_K, make_qp_quants, nearest_int,
                     put_fp16, weighted_grid_d2_8)

GROUP_MAX_EPS_IQ2_S = F32(1e-8)
KMAXQ = 3               # levels 0..2 per coordinate (grid values 1, 3, 5)
ONE = F32(1.0)
STEP = F32(0.1)
TOP = F32(2 * KMAXQ - 1)   # 2*kMaxQ - 1: the largest grid value, in units of the scale


# ====================================================================================================
# helpers shared by the three types
# ====================================================================================================

@njit(**INLINE)
def _weights(xb, o, qw, sigma2, n, weight, waux):
    """weight[i] = qw[i]*sqrtf(sigma2 + x^2) with an imatrix, else 0.25*sigma2 + x^2 (IQ2_S only); waux =
    sqrtf(weight), the weights of the neighbour search."""
    for i in range(n):
        xi = xb[o + i]
        if qw.shape[0]:
            weight[i] = qw[o + i] * np.sqrt(sigma2 + xi * xi)
        else:
            weight[i] = F32(0.25) * sigma2 + xi * xi
    for i in range(n):
        waux[i] = np.sqrt(weight[i])


@njit(**INLINE)
def _abs_group(xb, o, k, weight, xval, even_parity):
    """xval[8k:8k+8] = |x| of group k and its sign bits (bit i: x_i < 0). With even_parity (IQ2_XXS, IQ2_XS
    store 7 sign bits, the 8th is implied even): an odd count of negatives flips the sign of the element with
    the smallest weight*x^2 instead, in xval (which goes negative) and in the bits."""
    s = 0
    nflip = 0
    for i in range(8):
        v = xb[o + 8 * k + i]
        if v >= 0:
            xval[8 * k + i] = v
        else:
            xval[8 * k + i] = -v
            nflip += 1
            s |= 1 << i
    if even_parity and nflip % 2:
        imin = 0
        v = xb[o + 8 * k]
        mn = weight[8 * k] * v * v
        for i in range(1, 8):
            v = xb[o + 8 * k + i]
            ax = weight[8 * k + i] * v * v
            if ax < mn:
                mn = ax
                imin = i
        xval[8 * k + imin] = -xval[8 * k + imin]
        s ^= 1 << imin
    return s


@njit(**INLINE)
def _max_of(xval, n):
    """MAX over xval[0:n] in ggml's order (the first element, then a > b ? a : b)."""
    mx = xval[0]
    for i in range(1, n):
        mx = mx if mx > xval[i] else xval[i]
    return mx


@njit(**INLINE)
def _levels(xval, k, idd, L):
    """L[8k:8k+8] = clamp(nearest_int(0.5*(id*xval - 1)), 0, 2); returns their packed index u."""
    u = 0
    for i in range(8):
        l = max(0, min(KMAXQ - 1, nearest_int(HALF * (idd * xval[8 * k + i] - ONE))))
        L[8 * k + i] = l
        u |= l << (2 * i)
    return u


@njit(**INLINE)
def _best_neighbour(neighbours, off, grid, xval, waux, k, scale, L):
    """iq2_find_best_neighbour for group k: of the points listed at neighbours[off], the first with the least
    sum waux*(scale*q - xval)^2; its levels go to L[8k:8k+8]. Returns its grid index."""
    best_d2 = FLT_MAX
    gi = -1
    for j in range(1, np.int64(neighbours[off]) + 1):
        p = np.int64(neighbours[off + j])
        d2 = weighted_grid_d2_8(grid, p, xval, 8 * k, waux, 8 * k, scale)
        if d2 < best_d2:
            best_d2 = d2
            gi = p
    for i in range(8):
        L[8 * k + i] = (grid[gi, i] - 1) // 2
    return gi


@njit(**INLINE)
def _project(xval, waux, k, idd, scale, L, grid, kmap, neighbours):
    """Group k's levels at 1/scale = idd onto the grid: (grid index, whether the rounded levels were on it)."""
    u = _levels(xval, k, idd, L)
    gi = np.int64(kmap[u])
    if gi >= 0:
        return gi, True
    return _best_neighbour(neighbours, -gi - 1, grid, xval, waux, k, scale, L), False


@njit(**INLINE)
def _sums(weight, xval, L, n):
    """(sum w*xval*q, sum w*q*q) with q = 2*L + 1, in order."""
    sumqx = F32(0.0)
    sumq2 = F32(0.0)
    for i in range(n):
        w = weight[i]
        q = F32(2 * L[i] + 1)
        sumqx += w * xval[i] * q
        sumq2 += w * q * q
    return sumqx, sumq2


@njit(**INLINE)
def _grid_index(L, k, kmap):
    """kmap at group k's final levels (on the grid by construction; ggml aborts otherwise)."""
    u = 0
    for i in range(8):
        u |= np.int64(L[8 * k + i]) << (2 * i)
    return np.int64(kmap[u])


@njit(**INLINE)
def _sub_scale(idd, scale):
    """The 4-bit sub-block scale: clamp(nearest_int(0.5*(id*scale - 1)), 0, 15)."""
    return max(0, min(15, nearest_int(HALF * (idd * scale - ONE))))


# ====================================================================================================
# IQ2_XXS: 32-value sub-blocks, 4 groups, 8-bit grid indices, 7 sign bits per group, 4-bit scale
# ====================================================================================================

@njit(**INLINE)
def _iq2_xxs_sub_block(xb, o, qw, sigma2, weight, waux, xval, L, Laux, Lqp, signs, grid, kmap, neighbours):
    """One sub-block of 32: (its scale, False if it is skipped as all zero), its levels in L and its sign
    bytes in signs[0:4]."""
    _weights(xb, o, qw, sigma2, 32, weight, waux)
    for k in range(4):
        signs[k] = _abs_group(xb, o, k, weight, xval, True) & 127
    if _max_of(xval, 32) < GROUP_MAX_EPS:
        return F32(0.0), False
    scale = make_qp_quants(32, KMAXQ + 1, xval, Lqp, weight)   # Lqp is uint8, as ggml's cast of L
    eff_max = scale * F32(KMAXQ)
    if eff_max <= 0:
        return F32(0.0), False
    best = F32(0.0)
    accepted = False
    for step in range(-6, 7):
        idd = (TOP + F32(step) * STEP) / eff_max
        this_scale = ONE / idd
        for k in range(4):
            _project(xval, waux, k, idd, this_scale, Laux, grid, kmap, neighbours)
        sumqx, sumq2 = _sums(weight, xval, Laux, 32)
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            scale = sumqx / sumq2
            best = scale * sumqx
            L[:] = Laux
            accepted = True
    if not accepted:
        L[:] = 0        # ggml's L then holds make_qp_quants' levels, all overwritten below (scale > 0)
    if scale > 0:
        idd = ONE / scale
        for k in range(4):
            gi, _ = _project(xval, waux, k, idd, scale, L, grid, kmap, neighbours)
            for i in range(8):
                L[8 * k + i] = (grid[gi, i] - 1) // 2
        sumqx, sumq2 = _sums(weight, xval, L, 32)
        if sumq2 > 0:
            scale = sumqx / sumq2
    if scale < 0:
        scale = -scale
        for k in range(4):
            signs[k] = ~signs[k] & 127
    return scale, True


@njit(**INLINE)
def _iq2_xxs_row(xr, qw, y, grid, kmap, neighbours):
    weight = np.empty(32, np.float32)
    waux = np.empty(32, np.float32)
    xval = np.empty(32, np.float32)
    L = np.zeros(32, np.int8)
    Laux = np.zeros(32, np.int8)
    Lqp = np.zeros(32, np.uint8)
    signs = np.zeros(4, np.int64)
    scales = np.empty(8, np.float32)
    q2 = np.zeros(16, np.uint32)
    for ibl in range(xr.shape[0] // QK_K):
        o = QK_K * ibl
        p = 66 * ibl
        y[p:p + 66] = 0
        q2[:] = 0
        sumx2 = F32(0.0)
        for i in range(QK_K):
            sumx2 += xr[o + i] * xr[o + i]
        sigma2 = sumx2 / F32(QK_K)
        max_scale = F32(0.0)
        for ib in range(8):
            L[:] = 0
            scale, quantized = _iq2_xxs_sub_block(xr, o + 32 * ib, qw, sigma2, weight, waux, xval, L, Laux, Lqp, signs,
                                       grid, kmap, neighbours)
            scales[ib] = scale
            if not quantized:
                continue
            for k in range(4):
                q2[2 * ib] |= np.uint32(_grid_index(L, k, kmap) << (8 * k))
                q2[2 * ib + 1] |= np.uint32(signs[k] << (7 * k))
            max_scale = max_scale if max_scale > scale else scale
        if max_scale == 0:
            continue
        d = max_scale / F32(31)
        put_fp16(y, p, d)
        idd = ONE / d
        for ib in range(8):
            q2[2 * ib + 1] |= np.uint32(_sub_scale(idd, scales[ib]) << 28)
        y[p + 2:p + 66] = q2.view(np.uint8)


@njit(**JIT)
def iq2_xxs_impl_rows(x, qw, out, grid, kmap, neighbours):
    for r in range(x.shape[0]):
        _iq2_xxs_row(x[r], qw, out[r], grid, kmap, neighbours)


# ====================================================================================================
# IQ2_XS and IQ2_S: 16-value sub-blocks, 2 groups, 4-bit scales
# ====================================================================================================

@njit(**INLINE)
def _iq2_16_sub_block(xb, o, qw, sigma2, eps, even_parity, weight, waux, xval, L, Laux, signs, grid, kmap,
                      neighbours):
    """The sub-block of 16 at xb[o] of quantize_row_iq2_xs_impl (even_parity, 7 sign bits) or
    quantize_row_iq2_s_impl (8 sign bits): (its scale, False if skipped as all zero); levels in L, sign
    bytes in signs[0:2]. Seed scale max/5, scan 19 scales, then only the groups that were off the grid are
    projected again at the best scale."""
    _weights(xb, o, qw, sigma2, 16, weight, waux)
    for k in range(2):
        s = _abs_group(xb, o, k, weight, xval, even_parity)
        signs[k] = s & 127 if even_parity else s
    mx = _max_of(xval, 16)
    L[:] = 0
    if mx < eps:
        return F32(0.0), False
    best = F32(0.0)
    scale = mx / TOP
    on_grid0 = True
    on_grid1 = True
    for step in range(-9, 10):
        idd = (TOP + F32(step) * STEP) / mx
        this_scale = ONE / idd
        _, aux0 = _project(xval, waux, 0, idd, this_scale, Laux, grid, kmap, neighbours)
        _, aux1 = _project(xval, waux, 1, idd, this_scale, Laux, grid, kmap, neighbours)
        sumqx, sumq2 = _sums(weight, xval, Laux, 16)
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            scale = sumqx / sumq2
            best = scale * sumqx
            L[:] = Laux
            on_grid0 = aux0
            on_grid1 = aux1
    if (not on_grid0 or not on_grid1) and scale > 0:
        idd = ONE / scale
        if not on_grid0:
            _project(xval, waux, 0, idd, scale, L, grid, kmap, neighbours)
        if not on_grid1:
            _project(xval, waux, 1, idd, scale, L, grid, kmap, neighbours)
        sumqx, sumq2 = _sums(weight, xval, L, 16)
        if sumq2 > 0:
            scale = sumqx / sumq2
    if scale < 0:
        scale = -scale
        for k in range(2):
            signs[k] = ~signs[k] & (127 if even_parity else 255)
    return scale, True


@njit(**INLINE)
def _iq2_xs_row(xr, qw, y, grid, kmap, neighbours):
    weight = np.empty(16, np.float32)
    waux = np.empty(16, np.float32)
    xval = np.empty(16, np.float32)
    L = np.zeros(16, np.int8)
    Laux = np.zeros(16, np.int8)
    signs = np.zeros(2, np.int64)
    scales = np.empty(16, np.float32)
    q2 = np.zeros(32, np.uint16)
    for ibl in range(xr.shape[0] // QK_K):
        o = QK_K * ibl
        p = 74 * ibl
        y[p:p + 74] = 0
        q2[:] = 0
        sumx2 = F32(0.0)
        for i in range(QK_K):
            sumx2 += xr[o + i] * xr[o + i]
        sigma2 = sumx2 / F32(QK_K)
        max_scale = F32(0.0)
        for ib in range(16):
            scale, quantized = _iq2_16_sub_block(xr, o + 16 * ib, qw, sigma2, GROUP_MAX_EPS, True, weight, waux,
                                                 xval, L, Laux, signs, grid, kmap, neighbours)
            scales[ib] = scale
            if not quantized:
                continue
            for k in range(2):
                q2[2 * ib + k] = np.uint16(_grid_index(L, k, kmap) | (signs[k] << 9))
            max_scale = max_scale if max_scale > scale else scale
        if max_scale == 0:
            continue
        d = max_scale / F32(31)
        put_fp16(y, p, d)
        idd = ONE / d
        for ib in range(16):
            l = _sub_scale(idd, scales[ib])
            if ib % 2 == 0:
                y[p + 66 + ib // 2] = l
            else:
                y[p + 66 + ib // 2] |= l << 4
        y[p + 2:p + 66] = q2.view(np.uint8)


@njit(**INLINE)
def _iq2_s_row(xr, qw, y, grid, kmap, neighbours):
    weight = np.empty(16, np.float32)
    waux = np.empty(16, np.float32)
    xval = np.empty(16, np.float32)
    L = np.zeros(16, np.int8)
    Laux = np.zeros(16, np.int8)
    signs = np.zeros(2, np.int64)
    scales = np.empty(16, np.float32)
    for ibl in range(xr.shape[0] // QK_K):
        o = QK_K * ibl
        p = 82 * ibl
        y[p:p + 82] = 0
        sumx2 = F32(0.0)
        for i in range(QK_K):
            sumx2 += xr[o + i] * xr[o + i]
        sigma2 = F32(2.0) * sumx2 / F32(QK_K)
        max_scale = F32(0.0)
        for ib in range(16):
            scale, quantized = _iq2_16_sub_block(xr, o + 16 * ib, qw, sigma2, GROUP_MAX_EPS_IQ2_S, False, weight,
                                                 waux, xval, L, Laux, signs, grid, kmap, neighbours)
            scales[ib] = scale
            if not quantized:
                continue
            for k in range(2):
                gi = _grid_index(L, k, kmap)
                i8 = 2 * ib + k
                y[p + 2 + i8] = gi & 255
                y[p + 66 + i8 // 4] |= (gi >> 8) << (2 * (i8 % 4))
                y[p + 34 + i8] = signs[k]
            max_scale = max_scale if max_scale > scale else scale
        if max_scale == 0:
            continue
        d = max_scale / F32(31)
        put_fp16(y, p, d * F32(0.9875))
        idd = ONE / d
        for ib in range(16):
            l = _sub_scale(idd, scales[ib])
            if ib % 2 == 0:
                y[p + 74 + ib // 2] = l
            else:
                y[p + 74 + ib // 2] |= l << 4


@njit(**JIT)
def iq2_xs_impl_rows(x, qw, out, grid, kmap, neighbours):
    for r in range(x.shape[0]):
        _iq2_xs_row(x[r], qw, out[r], grid, kmap, neighbours)


@njit(**JIT)
def iq2_s_rows(x, out, grid, kmap, neighbours):
    for r in range(x.shape[0]):
        _iq2_s_row(x[r], NO_WEIGHTS, out[r], grid, kmap, neighbours)


@njit(**JIT)
def iq2_s_impl_rows(x, qw, out, grid, kmap, neighbours):
    for r in range(x.shape[0]):
        _iq2_s_row(x[r], qw, out[r], grid, kmap, neighbours)
