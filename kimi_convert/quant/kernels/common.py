"""What every kernel family shares: ggml's float helpers (fp16, nearest_int, roundf), the scale searches
(make_qx_quants, make_qkx_quants, make_qp_quants) and the numba settings (JIT, INLINE)."""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

F32 = np.float32
GROUP_MAX_EPS = F32(1e-15)
_NEAREST_INT_MAGIC = F32(12582912.0)  # 1.5 * 2**23
_FP16_SCALE_TO_INF = F32(2.0**112)
_FP16_SCALE_TO_ZERO = F32(2.0**-110)
_FP16_EXP_SCALE = F32(2.0**-112)
HALF = F32(0.5)
FLT_MAX = F32(np.finfo(np.float32).max)

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
    denormalized = bits_f32((two_w >> 17) | (126 << 23)) - HALF
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


def is_f32_vector(x):
    """A C-contiguous 1-D float32 array, whose elements the vector intrinsics load through its data pointer."""
    return isinstance(x, types.Array) and x.dtype == types.float32 and x.ndim == 1 and x.layout == "C"


def element_ptr(context, builder, arytype, ary, index):
    """LLVM pointer to the element at flat ``index`` of a C-contiguous array. The vector intrinsics load and
    store whole blocks through it without bounds checks, as numba's own indexing does (its default): every
    caller passes a block offset inside the row."""
    data = context.make_array(arytype)(context, builder, value=ary).data
    if index.type.width < 64:
        index = builder.sext(index, ir.IntType(64))
    return builder.gep(data, [index])


def declare(builder, name, ret, *args):
    """An LLVM intrinsic by its full name (llvmlite's declare_intrinsic knows no vector types)."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def splat(builder, value, vtype):
    """The vector of type ``vtype`` whose every lane is ``value``."""
    one = builder.insert_element(ir.Constant(vtype, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(ir.IntType(32), vtype.count), [0] * vtype.count))


def _first_abs_max_index(width):
    @intrinsic
    def first_abs_max_index(typingctx, x, o):
        """The index in [0, width) of the first largest |x[o+i]|, NaNs counted as 0, in vector operations:
        a max reduction, then the lowest set bit of the mask of lanes equal to it. LLVM does not vectorize
        the scalar search (a branch per element, its result depending on the order). With _q4_0_nibbles this
        took the Q4_0 kernel from 1.25x ggml's time to 0.35x, and Q5_0's from 0.76x to 0.40-0.54x."""
        if not (is_f32_vector(x) and isinstance(o, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            f32, mask = ir.FloatType(), ir.IntType(width)
            vec = ir.VectorType(f32, width)
            v = builder.load(builder.bitcast(element_ptr(context, builder, sig.args[0], *args), vec.as_pointer()), align=4)
            a = builder.call(declare(builder, f"llvm.fabs.v{width}f32", vec, vec), [v])
            a = builder.select(builder.fcmp_unordered("uno", v, v), ir.Constant(vec, [0.0] * width), a)
            # no NaN is left, so the reduction may take any order (max is exact)
            m = builder.call(declare(builder, f"llvm.vector.reduce.fmax.v{width}f32", f32, vec), [a], fastmath=("nnan",))
            lanes = builder.bitcast(builder.fcmp_ordered("==", a, splat(builder, m, vec)), mask)
            first = builder.call(declare(builder, f"llvm.cttz.i{width}", mask, mask, ir.IntType(1)),
                                 [lanes, ir.Constant(ir.IntType(1), 0)])
            return builder.zext(first, ir.IntType(64))

        return types.int64(x, o), codegen
    return first_abs_max_index


_first_abs_max_index16 = _first_abs_max_index(16)
_first_abs_max_index32 = _first_abs_max_index(32)


def _weighted_grid_d2(width):
    @intrinsic
    def weighted_grid_d2(typingctx, grid, g, x, xo, w, wo, scale):
        """sum over i < width of w[wo+i] * diff * diff, diff = scale*grid[g, i] - x[xo+i], added in order from 0
        (the d2 of ggml's iq2/iq3_find_best_neighbour). The products are formed as one vector, the sum stays
        sequential: the scalar loop cost 55 instructions a neighbour, in the loop where IQ2_XXS spends half
        its time."""
        if not (isinstance(grid, types.Array) and grid.dtype == types.int8 and grid.ndim == 2 and grid.layout == "C"
                and is_f32_vector(x) and is_f32_vector(w) and scale == types.float32):
            return None

        def codegen(context, builder, sig, args):
            grid_v, g_v, x_v, xo_v, w_v, wo_v, scale_v = args
            f32, vec = ir.FloatType(), ir.VectorType(ir.FloatType(), width)
            bytes_ = ir.VectorType(ir.IntType(8), width)
            g64 = g_v if g_v.type.width == 64 else builder.sext(g_v, ir.IntType(64))
            row = element_ptr(context, builder, sig.args[0], grid_v, builder.mul(g64, ir.Constant(ir.IntType(64), width)))
            q = builder.sitofp(builder.load(builder.bitcast(row, bytes_.as_pointer()), align=1), vec)

            def load(arytype, ary, o):
                return builder.load(builder.bitcast(element_ptr(context, builder, arytype, ary, o), vec.as_pointer()), align=4)

            diff = builder.fsub(builder.fmul(splat(builder, scale_v, vec), q), load(sig.args[2], x_v, xo_v))
            terms = builder.fmul(builder.fmul(load(sig.args[4], w_v, wo_v), diff), diff)
            d2 = ir.Constant(f32, 0.0)
            for i in range(width):
                d2 = builder.fadd(d2, builder.extract_element(terms, ir.Constant(ir.IntType(32), i)))
            return d2

        return types.float32(grid, g, x, xo, w, wo, scale), codegen
    return weighted_grid_d2


weighted_grid_d2_8 = _weighted_grid_d2(8)
weighted_grid_d2_4 = _weighted_grid_d2(4)


@njit(**INLINE)
def abs_max(x, o, n):
    """(amax, max): the first element with the strictly largest |x| in x[o:o+n], and its signed value; (0, 0)
    when every |x| is 0 or NaN (ggml: if (amax < fabsf(v)) { amax = fabsf(v); max = v; } from 0)."""
    if n == 32 or n == 16:  # every caller's block width; a constant once inlined
        i = o + (_first_abs_max_index32(x, o) if n == 32 else _first_abs_max_index16(x, o))
        ax = abs(x[i])
        return (ax, x[i]) if ax > 0 else (F32(0.0), F32(0.0))
    amax = F32(0.0)
    mx = F32(0.0)
    for i in range(o, o + n):
        if abs(x[i]) > amax:
            amax = abs(x[i])
            mx = x[i]
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


@njit(**JIT)
def make_qkx_quants(n, nmax, x, xo, w, L, lo, Laux, rmin, rdelta, nstep, use_mad, tmp):
    """make_qkx2_quants and make_qkx3_quants (with weights): they differ only in the degenerate test
    (max == min vs max <= min), which cannot tell apart once min is clamped to <= 0 -- min <= x[0] <= max.
    Asymmetric levels L[lo:lo+n] in [0, nmax] (uint8); returns (scale, the_min) with the_min = -min.

    tmp: float32 scratch of >= 5n; per candidate the products are formed in one loop and summed in order in
    another (see make_qx_quants). ggml's w*l*l and w*l*x are (w*l)*l and (w*l)*x, so w*l is formed once.
    A candidate whose levels equal the one before it is skipped: the sums, scale, min and error depend on the
    levels alone, so ggml computes the previous candidate's error again, which is not below the best (the best
    is that error or smaller), and changes nothing. On bf16-like weights about half of Q2_K's candidates
    repeat (two thirds with an imatrix's finer steps), a fifth of Q4_K's and Q5_K's."""
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
        changed = 0
        for i in range(n):
            l = max(0, min(nmax, nearest_int(iscale * tmp[i])))
            changed |= l ^ Laux[i]
            Laux[i] = l
        if step > 0 and changed == 0:
            continue  # the previous candidate's levels: its sums, scale, min and error again, never below best
        for i in range(n):
            l = Laux[i]
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
