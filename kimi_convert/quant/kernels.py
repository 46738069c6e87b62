"""ggml's block quantizers (ggml/src/ggml-quants.c, ggml-impl.h, ggml.c) in numba, bit for bit.

Every ``<type>_rows(x, [qw,] out)`` fills ``out[r]`` with the bytes ggml writes for row ``x[r]``
(float32 [n_rows, n_per_row] -> uint8 [n_rows, row bytes]; ``qw`` the importance weights of the columns).
The kernels release the GIL (``nogil``); ``blocks`` runs row ranges on threads. All of them live in this one
module because numba's cache is keyed on the source of the file that defines a function, not on the files
of the functions it calls: split over modules, an edit to a shared helper would leave stale compiled callers.

Rules that keep the bytes equal to ggml's:

* float32 everywhere, each expression evaluated in the order ggml writes it (``w*x*l`` is ``(w*x)*l``), sums
  sequential. Every integer that meets a float is converted with ``F32(...)`` first: numba would otherwise
  promote the operation to float64, where C converts the int to float. (``nearest_int`` only accepts float32,
  so a stray float64 there fails to compile.)
* No fastmath: without it numba marks no float operation ``contract``/``reassoc``, so LLVM neither fuses
  ``a*b+c`` into an FMA nor reorders sums. That matches ggml-base as llama-cpp-python builds it: ggml-quants.c
  is compiled with -O3 and no -march (the ISA flags go to ggml-cpu only), i.e. for baseline x86-64 with SSE2,
  which has no FMA instruction, so GCC's default -ffp-contract=fast has nothing to contract (objdump of
  libggml-base.so shows no vfmadd and no VEX-encoded instruction at all). A build of ggml-base with FMA
  enabled (or aarch64 GCC, which contracts by default) could round differently; the tests would show it.
* Where ggml sums products in a loop, the products are formed in one loop (which LLVM vectorizes) and summed
  in order in a second: the same float32 operations, 2-4x faster than one loop.
* ``error_model="numpy"``: division by zero gives inf/nan as in C instead of raising.
* C truth tests on floats (``d ? 1/d : 0``) are ``!= 0`` tests, true for NaN, and ``MAX(a, b)`` is
  ``a > b ? a : b``: both are written out as such so NaN input flows the same way. Float-to-int conversions
  of NaN give INT_MIN on x86, in C and here alike.
* Stores into ggml's ``uint8_t``/``int8_t`` fields wrap modulo 256, as C does.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

F32 = np.float32
GROUP_MAX_EPS = F32(1e-15)
_NEAREST_INT_MAGIC = F32(12582912.0)  # 1.5 * 2**23
_FP16_SCALE_TO_INF = F32(2.0**112)
_FP16_SCALE_TO_ZERO = F32(2.0**-110)
_FP16_EXP_SCALE = F32(2.0**-112)
_HALF = F32(0.5)
_FLT_MAX = F32(np.finfo(np.float32).max)

# kvalues_iq4nl (ggml-common.h), as float32 so that `x - value` is computed in float as in C
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)

JIT = dict(cache=True, error_model="numpy", nogil=True)
# small helpers are inlined at numba level: numba compiles each function into its own LLVM module and the
# calls between them are not inlined by LLVM, which cost up to 2.5x in the 32-block kernels
INLINE = dict(JIT, inline="always")
QK_K = 256
NO_WEIGHTS = np.zeros(0, np.float32)  # stands for quant_weights == NULL


@intrinsic
def f32_bits(typingctx, x):
    """The IEEE bits of a float32, as uint32 (C: memcpy into an int)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def bits_f32(typingctx, u):
    """The float32 whose IEEE bits are the low 32 bits of ``u``."""
    if not isinstance(u, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = args[0]
        if v.type.width > 32:
            v = builder.trunc(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())

    return types.float32(u), codegen


@intrinsic
def level_f32(typingctx, f, lo, hi):
    """float32(MAX(lo, MIN(hi, nearest_int(f)))) in 32-bit integer operations: the same value as
    nearest_int and the clamp, in a form LLVM vectorizes (numba would widen the integers to 64 bits, and
    AVX2 has no 64-bit integer to float conversion)."""
    if f != types.float32 or not isinstance(lo, types.Integer) or not isinstance(hi, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        bits = builder.bitcast(builder.fadd(args[0], ir.Constant(ir.FloatType(), 12582912.0)), i32)
        i = builder.sub(builder.and_(bits, ir.Constant(i32, 0x007FFFFF)), ir.Constant(i32, 0x00400000))
        lo32, hi32 = (builder.trunc(a, i32) if a.type.width > 32 else a for a in args[1:])
        i = builder.select(builder.icmp_signed(">", i, hi32), hi32, i)
        i = builder.select(builder.icmp_signed("<", i, lo32), lo32, i)
        return builder.sitofp(i, ir.FloatType())

    return types.float32(types.float32, lo, hi), codegen


@njit(**INLINE)
def nearest_int(f):
    """ggml's nearest_int: round half to even through the 1.5*2^23 trick (also for |f| > 2^22, where it wraps)."""
    i = np.int64(f32_bits(f + _NEAREST_INT_MAGIC))
    return (i & 0x007FFFFF) - 0x00400000


@njit(**INLINE)
def fp32_to_fp16(f):
    """ggml_compute_fp32_to_fp16 (ggml-impl.h): IEEE round to nearest even, NaN -> sign|0x7E00. Returns the bits."""
    base = (abs(f) * _FP16_SCALE_TO_INF) * _FP16_SCALE_TO_ZERO
    w = np.int64(f32_bits(f))
    shl1_w = (w + w) & 0xFFFFFFFF
    sign = w & 0x80000000
    bias = shl1_w & 0xFF000000
    if bias < 0x71000000:
        bias = 0x71000000
    base = bits_f32((bias >> 1) + 0x07800000) + base
    bits = np.int64(f32_bits(base))
    exp_bits = (bits >> 13) & 0x00007C00
    mantissa_bits = bits & 0x00000FFF
    nonsign = exp_bits + mantissa_bits
    return (sign >> 16) | (0x7E00 if shl1_w > 0xFF000000 else nonsign)


@njit(**INLINE)
def fp16_to_fp32(h):
    """ggml_compute_fp16_to_fp32 (ggml-impl.h) of fp16 bits ``h``."""
    w = np.int64(h) << 16
    sign = w & 0x80000000
    two_w = (w + w) & 0xFFFFFFFF
    normalized = bits_f32((two_w >> 4) + (0xE0 << 23)) * _FP16_EXP_SCALE
    denormalized = bits_f32((two_w >> 17) | (126 << 23)) - _HALF
    if two_w < (1 << 27):
        return bits_f32(sign | np.int64(f32_bits(denormalized)))
    return bits_f32(sign | np.int64(f32_bits(normalized)))


@njit(**INLINE)
def put_fp16(out, pos, f):
    """Store fp16(f) little-endian at out[pos:pos+2]."""
    h = fp32_to_fp16(f)
    out[pos] = h & 0xFF
    out[pos + 1] = h >> 8


@njit(**INLINE)
def get_fp16(buf, pos):
    """GGML_FP16_TO_FP32 of the fp16 stored at buf[pos:pos+2] (ggml re-reads its scales after rounding)."""
    return fp16_to_fp32(np.int64(buf[pos]) | (np.int64(buf[pos + 1]) << 8))


@njit(**INLINE)
def roundf(v):
    """C roundf (half away from zero) of a float32; in float64, where |v| + 0.5 is exact."""
    a = np.floor(abs(np.float64(v)) + 0.5)
    return -a if v < 0 else a


@njit(**INLINE)
def as_int8(v):
    """C conversion of an int to int8_t (wraps)."""
    return ((v + 128) & 0xFF) - 128


@njit(**INLINE)
def sum_sq(x, o, n):
    """Sequential sum of x[o+i]^2, i < n."""
    xs = x[o:o + n]
    s = F32(0.0)
    for i in range(n):
        s += xs[i] * xs[i]
    return s


@njit(**INLINE)
def abs_max(x, o, n):
    """(amax, max): the first element with the strictly largest |x| in x[o:o+n], and its signed value."""
    xs = x[o:o + n]
    amax = F32(0.0)
    mx = F32(0.0)
    for i in range(n):
        ax = abs(xs[i])
        if ax > amax:
            amax = ax
            mx = xs[i]
    return amax, mx


QX_CANDIDATES = 19     # make_qx_quants' scales: -nmax/max, then the 18 steps -(nmax + 0.1*step)/max, step != 0
QX_TMP = 3 * QX_CANDIDATES


@njit(**JIT)
def make_qx_quants(n, nmax, x, xo, L, lo, w, wo, tmp):
    """make_qx_quants(n, nmax, x, L, rmse_type=1, qw) with explicit weights w[wo:wo+n] (ggml passes x*x
    for qw == NULL, which callers put into w). Writes L[lo:lo+n] in [0, 2*nmax), returns the scale.

    tmp: float32 scratch of >= QX_TMP. ggml tries its 19 scales one after another, each a loop of two
    sequential sums (sum w*x*l, sum w*l*l), which waits on the latency of every add. Here the 19 sums of
    each kind are formed side by side (element outer, scale inner): each scale's sum still adds the same
    float32 products in the same order, and the inner loop vectorizes across scales. Then the scales are
    compared in ggml's order; the levels of the one that wins (the last improvement) are written once.
    (w*x)*l is ggml's w*x*l, (w*l)*l its w*l*l."""
    amax, mx = abs_max(x, xo, n)
    if amax < GROUP_MAX_EPS:
        for i in range(n):
            L[lo + i] = 0
        return F32(0.0)
    iscale = tmp[0:QX_CANDIDATES]
    sumlx = tmp[QX_CANDIDATES:2 * QX_CANDIDATES]
    suml2 = tmp[2 * QX_CANDIDATES:3 * QX_CANDIDATES]
    iscale[0] = F32(-nmax) / mx
    for c in range(1, QX_CANDIDATES):
        step = c - 10 if c < 10 else c - 9
        iscale[c] = -(F32(nmax) + F32(0.1) * F32(step)) / mx
    for c in range(QX_CANDIDATES):
        sumlx[c] = F32(0.0)
        suml2[c] = F32(0.0)
    xs, ws, Ls = x[xo:xo + n], w[wo:wo + n], L[lo:lo + n]
    for i in range(n):
        xi = xs[i]
        wi = ws[i]
        wx = wi * xi
        for c in range(QX_CANDIDATES):
            fl = F32(max(-nmax, min(nmax - 1, nearest_int(iscale[c] * xi))))
            sumlx[c] += wx * fl
            suml2[c] += wi * fl * fl
    scale = sumlx[0] / suml2[0] if suml2[0] != 0 else F32(0.0)
    best = scale * sumlx[0]
    win = 0
    for c in range(1, QX_CANDIDATES):
        if suml2[c] > 0 and sumlx[c] * sumlx[c] > best * suml2[c]:
            scale = sumlx[c] / suml2[c]
            best = scale * sumlx[c]
            win = c
    for i in range(n):
        Ls[i] = nmax + max(-nmax, min(nmax - 1, nearest_int(iscale[win] * xs[i])))
    return scale


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


@njit(**JIT)
def make_qkx_quants(n, nmax, x, xo, w, L, lo, Laux, rmin, rdelta, nstep, use_mad, tmp):
    """make_qkx2_quants and make_qkx3_quants (with weights): they differ only in the degenerate test
    (max == min vs max <= min), which cannot tell apart once min is clamped to <= 0 -- min <= x[0] <= max.
    Asymmetric levels L[lo:lo+n] in [0, nmax] (uint8); returns (scale, the_min) with the_min = -min.

    tmp: float32 scratch of >= 5n; per candidate the products are formed in one loop and summed in order in
    another (see make_qx_quants). ggml's w*l*l and w*l*x are (w*l)*l and (w*l)*x, so w*l is formed once."""
    mn = x[xo]
    mx = x[xo]
    sum_w = w[0]
    sum_x = sum_w * x[xo]
    for i in range(1, n):
        xi = x[xo + i]
        if xi < mn:
            mn = xi
        if xi > mx:
            mx = xi
        wi = w[i]
        sum_w += wi
        sum_x += wi * xi
    if mn > 0:
        mn = F32(0.0)
    if mx <= mn:
        for i in range(n):
            L[lo + i] = 0
        return F32(0.0), -mn
    r0 = F32(rmin)  # callers pass float32 already; this keeps a stray float64 from leaking in
    dr = F32(rdelta)
    iscale = F32(nmax) / (mx - mn)
    scale = F32(1.0) / iscale
    for i in range(n):
        tmp[i] = x[xo + i] - mn  # x - min, as long as min stays
    for i in range(n):
        l = max(0, min(nmax, nearest_int(iscale * tmp[i])))
        L[lo + i] = l
        Laux[i] = l
    best_error = _qkx_error(n, x, xo, w, Laux, scale, mn, use_mad, tmp)
    for step in range(nstep + 1):
        iscale = (r0 + dr * F32(step) + F32(nmax)) / (mx - mn)
        for i in range(n):
            l = max(0, min(nmax, nearest_int(iscale * tmp[i])))
            Laux[i] = l
            wl = w[i] * F32(l)
            tmp[n + i] = wl
            tmp[2 * n + i] = wl * F32(l)
            tmp[3 * n + i] = wl * x[xo + i]
        sum_l = F32(0.0)
        sum_l2 = F32(0.0)
        sum_xl = F32(0.0)
        for i in range(n):
            sum_l += tmp[n + i]
            sum_l2 += tmp[2 * n + i]
            sum_xl += tmp[3 * n + i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min = F32(0.0)
                this_scale = sum_xl / sum_l2
            cur_error = _qkx_error(n, x, xo, w, Laux, this_scale, this_min, use_mad, tmp)
            if cur_error < best_error:
                for i in range(n):
                    L[lo + i] = Laux[i]
                best_error = cur_error
                scale = this_scale
                mn = this_min  # ggml's later candidates are taken relative to this new min
                for i in range(n):
                    tmp[i] = x[xo + i] - mn
    return scale, -mn


@njit(**INLINE)
def _qkx_error(n, x, xo, w, Lq, scale, mn, use_mad, tmp):
    """sum of w * err(scale*L + min - x), err = |d| (use_mad) or d*d, summed in order; uses tmp[4n:5n]."""
    for i in range(n):
        diff = scale * F32(Lq[i]) + mn - x[xo + i]
        tmp[4 * n + i] = w[i] * (abs(diff) if use_mad else diff * diff)
    err = F32(0.0)
    for i in range(n):
        err += tmp[4 * n + i]
    return err


@njit(**JIT)
def make_qp_quants(n, nmax, x, L, qw):
    """make_qp_quants(n, nmax, x, L, quant_weights): unsigned levels for the sub-block scales/mins of the
    imatrix K-quants. L is uint8 as in ggml, so a negative nearest_int wraps and is used wrapped."""
    mx = F32(0.0)
    for i in range(n):
        mx = mx if mx > x[i] else x[i]
    if mx < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return F32(0.0)
    iscale = F32(nmax) / mx
    for i in range(n):
        L[i] = nearest_int(iscale * x[i]) & 0xFF
    scale = F32(1.0) / iscale
    best_mse = F32(0.0)
    for i in range(n):
        diff = x[i] - scale * F32(L[i])
        best_mse += qw[i] * diff * diff
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = (F32(0.1) * F32(step) + F32(nmax)) / mx
        scale_is = F32(1.0) / iscale_is
        mse = F32(0.0)
        for i in range(n):
            l = min(nmax, nearest_int(iscale_is * x[i]))
            diff = x[i] - scale_is * F32(l)
            mse += qw[i] * diff * diff
        if mse < best_mse:
            best_mse = mse
            iscale = iscale_is
    sumlx = F32(0.0)
    suml2 = F32(0.0)
    for i in range(n):
        l = min(nmax, nearest_int(iscale * x[i]))
        L[i] = l & 0xFF
        fl = F32(l)
        sumlx += qw[i] * x[i] * fl
        suml2 += qw[i] * fl * fl
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            wi = qw[i]
            li = F32(L[i])
            slx = sumlx - wi * x[i] * li
            sl2 = suml2 - wi * li * li
            if slx > 0 and sl2 > 0:
                new_l = min(nmax, nearest_int(x[i] * sl2 / slx))
                if new_l != L[i]:
                    fn = F32(new_l)
                    slx += wi * x[i] * fn
                    sl2 += wi * fn * fn
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l & 0xFF
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    return sumlx / suml2 if suml2 > 0 else F32(0.0)


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


@njit(**INLINE)
def _q4_0_ref_block(xr, o, y, p):
    amax, mx = abs_max(xr, o, 32)
    d = mx / F32(-8.0)
    idd = F32(1.0) / d if d != 0 else F32(0.0)
    put_fp16(y, p, d)
    for j in range(16):
        # MIN(15, (int8_t)(x*id + 8.5f)): x*id lies in [-8, 8], so the int8 conversion cannot wrap; a NaN
        # gives INT_MIN on x86 either way, whose low byte is 0 as in C
        q0 = min(np.int32(15), np.int32(xr[o + j] * idd + F32(8.5)))
        q1 = min(np.int32(15), np.int32(xr[o + 16 + j] * idd + F32(8.5)))
        y[p + 2 + j] = np.uint8((q0 | (q1 << 4)) & 0xFF)


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
            mn = _FLT_MAX
            mx = -_FLT_MAX
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
                q = np.int64(np.int32((xr[o + j] - mn) * idd + _HALF))
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
