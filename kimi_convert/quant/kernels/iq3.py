"""IQ3_XXS and IQ3_S: 3-bit grid i-quants, 4 values per grid point (quantize_row_iq3_xxs_impl, quantize_iq3_s /
quantize_row_iq3_s_impl in ggml-quants.c).

Both quantize a 256-value super-block as eight sub-blocks of 32: signs apart, each group of 4 magnitudes is
projected onto a grid of 256 (IQ3_XXS) or 512 (IQ3_S) points with coordinates 1, 3, ..., 15, through the
kernels' last arguments ``grid`` (int8 [n_points, 4]), ``kmap`` and ``neighbours`` (kernels/grids.py). Per
sub-block ggml scans candidate scales (31 for IQ3_XXS, 19 for IQ3_S), keeps the one with the best weighted fit,
re-projects with it and refits; the sub-scales become 4-bit multiples of an fp16 super-scale.

How they differ (shared/reference/iq-family.md §1.4): IQ3_XXS stores 7 sign bits per 8 values (an odd count of
negatives flips the value of least w*x^2, so the stored signs have even parity), skips sub-blocks whose maximum is
below 1e-8, assumes groups on the grid before the scan and re-projects only the groups off it; IQ3_S stores all 8
signs, skips only a maximum that is exactly 0 (``!max``: a tiny maximum makes huge or infinite levels, which go
through nearest_int's bit trick and its wrap as in C), assumes every group off the grid and re-projects all.
Without an imatrix both weigh by x^2; with one by qw*sqrt(sigma2 + x^2), sigma2 = 2*sum(x^2)/256.

The scan: ggml tries each candidate scale in turn, then sums its 32 products twice in order, which waits on
every add. Here the levels of all candidates are formed first, stored [value, candidate], so that level rounding,
the packing of the grid index and the two in-order sums run across the candidates (each candidate's sums add
the same float32 products in the same order as ggml's); only the neighbour search of a group off the grid is
per candidate. The candidates are then compared in ggml's order.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .common import F32, FLT_MAX, INLINE, JIT, NO_WEIGHTS, QK_K, nearest_int, put_fp16, weighted_grid_d2_4

K_MAX_Q = 8                         # levels 0..7, coordinates 2l+1
IQ3_XXS_BYTES = 98                  # d, 64 grid indices, 8 x u32 (4 x 7 sign bits | 4-bit scale << 28)
IQ3_S_BYTES = 110                   # d, qs[64], qh[8], signs[32], scales[4]
GROUP_MAX_EPS_IQ3_XXS = F32(1e-8)
XXS_SCAN = 15                       # is = -15..15, step 0.2
S_SCAN = 9                          # is = -9..9, step 0.2
MAX_CANDIDATES = 2 * XXS_SCAN + 1


@njit(**INLINE)
def _best_neighbour(grid, neighbours, start, xval, waux, o, scale):
    """iq3_find_best_neighbour: of the grid ids listed at neighbours[start] (count, ids...), the first with the
    least sum waux*(scale*q - x)^2 over the group xval[o:o+4]. Where none is below FLT_MAX (values so large
    that the sums overflow, |x| > ~1e12) ggml aborts; here the first listed one is taken, a valid block."""
    best_d2 = FLT_MAX
    best = -1
    for j in range(1, np.int64(neighbours[start]) + 1):
        g = np.int64(neighbours[start + j])
        d2 = weighted_grid_d2_4(grid, g, xval, o, waux, o, scale)
        if d2 < best_d2:
            best_d2 = d2
            best = g
    return best if best >= 0 else np.int64(neighbours[start + 1])


@njit(**INLINE)
def _sub_block_weights(xb, xo, qw, sigma2, weight, waux):
    """weight = qw*sqrtf(sigma2 + x^2), or x^2 without an imatrix (qw empty); waux = sqrtf(weight)."""
    for i in range(32):
        xi = xb[xo + i]
        if qw.shape[0]:
            weight[i] = qw[xo + i] * np.sqrt(sigma2 + xi * xi)
        else:
            weight[i] = xi * xi
    for i in range(32):
        waux[i] = np.sqrt(weight[i])


@njit(**INLINE)
def _signs(xb, xo, weight, xval, block_signs, parity):
    """|x| into xval and the sign bits per 8 into block_signs; with ``parity`` (IQ3_XXS) an odd count of
    negatives flips the element of least (w*x)*x back to negative in xval and in the bits, which keep 7."""
    for k in range(4):
        s = 0
        nflip = 0
        for i in range(8):
            v = xb[xo + 8 * k + i]
            if v >= 0:
                xval[8 * k + i] = v
            else:
                xval[8 * k + i] = -v
                nflip += 1
                s |= 1 << i
        if parity:
            if nflip % 2:
                imin = 0
                vmin = weight[8 * k] * xb[xo + 8 * k] * xb[xo + 8 * k]
                for i in range(1, 8):
                    v = xb[xo + 8 * k + i]
                    ax = weight[8 * k + i] * v * v
                    if ax < vmin:
                        vmin = ax
                        imin = i
                xval[8 * k + imin] = -xval[8 * k + imin]
                s ^= 1 << imin
            s &= 127
        block_signs[k] = s


@njit(**INLINE)
def _pack(L, o):
    """The kmap index of the levels L[o:o+4]."""
    return np.int64(L[o]) | (np.int64(L[o + 1]) << 3) | (np.int64(L[o + 2]) << 6) | (np.int64(L[o + 3]) << 9)


@njit(**INLINE)
def _sub_block_scale(xval, weight, waux, n_scan, on_grid_first, reproject_all, L, grid, kmap, neighbours,
                     levels, qs, sums, on_grid_c, on_grid):
    """The scan, re-projection and refit of one sub-block with a non-zero maximum: writes its levels into L and
    returns its scale (before ggml's sign flip of a negative scale).

    levels: int32 [32, >= n_c] (value, candidate); qs, sums: float32 scratch; on_grid_c: bool [8, >= n_c]."""
    mx = xval[0]
    for i in range(1, 32):
        mx = mx if mx > xval[i] else xval[i]
    n_c = 2 * n_scan + 1
    ids = sums[0:n_c]
    this_scales = sums[n_c:2 * n_c]
    sumqx = sums[2 * n_c:3 * n_c]
    sumq2 = sums[3 * n_c:4 * n_c]
    for c in range(n_c):
        ids[c] = (F32(2 * K_MAX_Q - 1) + F32(c - n_scan) * F32(0.2)) / mx
        this_scales[c] = F32(1.0) / ids[c]
    for i in range(32):
        xi = xval[i]
        for c in range(n_c):
            levels[i, c] = max(0, min(K_MAX_Q - 1, nearest_int(F32(0.5) * (ids[c] * xi - F32(1.0)))))
    for k in range(8):
        for c in range(n_c):
            u = levels[4 * k, c] | (levels[4 * k + 1, c] << 3) | (levels[4 * k + 2, c] << 6) \
                | (levels[4 * k + 3, c] << 9)
            on_grid_c[k, c] = kmap[u] >= 0
        for c in range(n_c):
            if not on_grid_c[k, c]:
                u = levels[4 * k, c] | (levels[4 * k + 1, c] << 3) | (levels[4 * k + 2, c] << 6) \
                    | (levels[4 * k + 3, c] << 9)
                g = _best_neighbour(grid, neighbours, -np.int64(kmap[u]) - 1, xval, waux, 4 * k, this_scales[c])
                for i in range(4):
                    levels[4 * k + i, c] = (np.int64(grid[g, i]) - 1) // 2
    for c in range(n_c):
        sumqx[c] = F32(0.0)
        sumq2[c] = F32(0.0)
    for i in range(32):
        w = weight[i]
        wx = w * xval[i]
        for c in range(n_c):
            q = F32(2 * levels[i, c] + 1)
            sumqx[c] += wx * q
            sumq2[c] += w * q * q
    best = F32(0.0)
    scale = mx / F32(2 * K_MAX_Q - 1)
    win = -1
    for c in range(n_c):
        if sumq2[c] > 0 and sumqx[c] * sumqx[c] > best * sumq2[c]:
            scale = sumqx[c] / sumq2[c]
            best = scale * sumqx[c]
            win = c
    if win >= 0:
        for i in range(32):
            L[i] = levels[i, win]
        for k in range(8):
            on_grid[k] = on_grid_c[k, win]
    else:
        for i in range(32):
            L[i] = 0
        for k in range(8):
            on_grid[k] = on_grid_first
    n_off = 0
    for k in range(8):
        if not on_grid[k]:
            n_off += 1
    if n_off > 0 and scale > 0:
        idd = F32(1.0) / scale
        for k in range(8):
            if on_grid[k] and not reproject_all:
                continue
            for i in range(4):
                qs[i] = max(0, min(K_MAX_Q - 1, nearest_int(F32(0.5) * (idd * xval[4 * k + i] - F32(1.0)))))
            u = np.int64(qs[0]) | (np.int64(qs[1]) << 3) | (np.int64(qs[2]) << 6) | (np.int64(qs[3]) << 9)
            g = np.int64(kmap[u])
            if g < 0:
                g = _best_neighbour(grid, neighbours, -g - 1, xval, waux, 4 * k, scale)
            for i in range(4):
                L[4 * k + i] = (np.int64(grid[g, i]) - 1) // 2
        for i in range(32):
            w = weight[i]
            q = F32(2 * L[i] + 1)
            qs[i] = w * xval[i] * q
            qs[32 + i] = w * q * q
        sx = F32(0.0)
        s2 = F32(0.0)
        for i in range(32):
            sx += qs[i]
            s2 += qs[32 + i]
        if s2 > 0:
            scale = sx / s2
    return scale


@njit(**INLINE)
def _super_scale_levels(scales, max_scale, fudge):
    """(fp16 input d*fudge, the 4-bit sub-scale of each sub-block) for super-scale d = max_scale/31."""
    d = max_scale / F32(31.0)
    idd = F32(1.0) / d
    ls = np.empty(8, np.int64)
    for ib in range(8):
        ls[ib] = max(0, min(15, nearest_int(F32(0.5) * (idd * scales[ib] - F32(1.0)))))
    return d * fudge, ls


@njit(**INLINE)
def _iq3_xxs_row(xr, qw, y, grid, kmap, neighbours):
    weight = np.empty(32, np.float32)
    waux = np.empty(32, np.float32)
    xval = np.empty(32, np.float32)
    L = np.zeros(32, np.int64)
    on_grid = np.empty(8, np.bool_)
    block_signs = np.empty(4, np.int64)
    levels = np.empty((32, MAX_CANDIDATES), np.int64)
    on_grid_c = np.empty((8, MAX_CANDIDATES), np.bool_)
    qs = np.empty(64, np.float32)
    sums = np.empty(4 * MAX_CANDIDATES, np.float32)
    scales = np.empty(8, np.float32)
    q3 = np.empty(96, np.uint8)
    signs_words = np.empty(8, np.int64)
    for ibl in range(xr.shape[0] // QK_K):
        o = QK_K * ibl
        p = IQ3_XXS_BYTES * ibl
        q3[:] = 0
        signs_words[:] = 0
        sumx2 = F32(0.0)
        for i in range(QK_K):
            sumx2 += xr[o + i] * xr[o + i]
        sigma2 = F32(2.0) * sumx2 / F32(QK_K)
        max_scale = F32(0.0)
        for ib in range(8):
            xo = o + 32 * ib
            _sub_block_weights(xr, xo, qw, sigma2, weight, waux)
            _signs(xr, xo, weight, xval, block_signs, True)
            mx = xval[0]
            for i in range(1, 32):
                mx = mx if mx > xval[i] else xval[i]
            if mx < GROUP_MAX_EPS_IQ3_XXS:
                scales[ib] = F32(0.0)
                continue
            scale = _sub_block_scale(xval, weight, waux, XXS_SCAN, True, False, L, grid, kmap, neighbours,
                                     levels, qs, sums, on_grid_c, on_grid)
            if scale < 0:
                scale = -scale
                for k in range(4):
                    block_signs[k] = (~block_signs[k]) & 127
            for k in range(8):
                q3[8 * ib + k] = kmap[_pack(L, 4 * k)]
            signs_words[ib] = block_signs[0] | (block_signs[1] << 7) | (block_signs[2] << 14) \
                | (block_signs[3] << 21)
            scales[ib] = scale
            max_scale = max_scale if max_scale > scale else scale
        if max_scale == 0:
            y[p:p + IQ3_XXS_BYTES] = 0
            continue
        d_stored, ls = _super_scale_levels(scales, max_scale, F32(1.0125))
        put_fp16(y, p, d_stored)
        for i in range(64):
            y[p + 2 + i] = q3[i]
        for ib in range(8):
            word = signs_words[ib] | (ls[ib] << 28)
            for b in range(4):
                y[p + 66 + 4 * ib + b] = (word >> (8 * b)) & 0xFF


@njit(**INLINE)
def _iq3_s_row(xr, qw, y, grid, kmap, neighbours):
    weight = np.empty(32, np.float32)
    waux = np.empty(32, np.float32)
    xval = np.empty(32, np.float32)
    L = np.zeros(32, np.int64)
    on_grid = np.empty(8, np.bool_)
    block_signs = np.empty(4, np.int64)
    levels = np.empty((32, MAX_CANDIDATES), np.int64)
    on_grid_c = np.empty((8, MAX_CANDIDATES), np.bool_)
    qs = np.empty(64, np.float32)
    sums = np.empty(4 * MAX_CANDIDATES, np.float32)
    scales = np.empty(8, np.float32)
    for ibl in range(xr.shape[0] // QK_K):
        o = QK_K * ibl
        p = IQ3_S_BYTES * ibl
        y[p:p + IQ3_S_BYTES] = 0
        sumx2 = F32(0.0)
        for i in range(QK_K):
            sumx2 += xr[o + i] * xr[o + i]
        sigma2 = F32(2.0) * sumx2 / F32(QK_K)
        max_scale = F32(0.0)
        n_stored = 0        # ggml's qs and signs pointers advance past stored sub-blocks only (see below)
        for ib in range(8):
            xo = o + 32 * ib
            _sub_block_weights(xr, xo, qw, sigma2, weight, waux)
            _signs(xr, xo, weight, xval, block_signs, False)
            mx = xval[0]
            for i in range(1, 32):
                mx = mx if mx > xval[i] else xval[i]
            if mx == 0:
                scales[ib] = F32(0.0)
                continue
            scale = _sub_block_scale(xval, weight, waux, S_SCAN, False, True, L, grid, kmap, neighbours,
                                     levels, qs, sums, on_grid_c, on_grid)
            if scale < 0:
                scale = -scale
                for k in range(4):
                    block_signs[k] = (~block_signs[k]) & 0xFF
            # a sub-block skipped above (max 0) does not move ggml's qs and signs pointers: the grid indices
            # and signs of the next stored one land in its place, those of the last ones stay 0. qh and
            # the scales are indexed by sub-block.
            qh = 0
            for k in range(8):
                g = np.int64(kmap[_pack(L, 4 * k)])
                y[p + 2 + 8 * n_stored + k] = g & 255
                qh |= (g >> 8) << k
            y[p + 66 + ib] = qh
            for k in range(4):
                y[p + 74 + 4 * n_stored + k] = block_signs[k]
            n_stored += 1
            scales[ib] = scale
            max_scale = max_scale if max_scale > scale else scale
        if max_scale == 0:
            continue
        d_stored, ls = _super_scale_levels(scales, max_scale, F32(1.033))
        put_fp16(y, p, d_stored)
        for j in range(4):
            y[p + 106 + j] = ls[2 * j] | (ls[2 * j + 1] << 4)


@njit(**JIT)
def iq3_xxs_rows(x, out, grid, kmap, neighbours):
    for r in range(x.shape[0]):
        _iq3_xxs_row(x[r], NO_WEIGHTS, out[r], grid, kmap, neighbours)


@njit(**JIT)
def iq3_xxs_impl_rows(x, qw, out, grid, kmap, neighbours):
    for r in range(x.shape[0]):
        _iq3_xxs_row(x[r], qw, out[r], grid, kmap, neighbours)


@njit(**JIT)
def iq3_s_rows(x, out, grid, kmap, neighbours):
    for r in range(x.shape[0]):
        _iq3_s_row(x[r], NO_WEIGHTS, out[r], grid, kmap, neighbours)


@njit(**JIT)
def iq3_s_impl_rows(x, qw, out, grid, kmap, neighbours):
    for r in range(x.shape[0]):
        _iq3_s_row(x[r], qw, out[r], grid, kmap, neighbours)
