"""kimi_convert.runtime.ggml_cpu against ggml's x86-64-v3 kernels (docs/verification.md §8).

Float weights: against scalar restatements of the C code. Quantized weights: against the compiled kernels of
the pinned llama-cpp-python build itself, called through ctypes (kimi_interop/ggml_cpu_kernels.py):
its vec_dot, its CPU graph's mul_mat (tinyBLAS, tiled) and its repacked gemm/gemv -- bit for bit, on weights
quantized by ggml. These fail, not skip, when llama-cpp-python is missing.

The data span ~2^16 in magnitude, so that a different summation order gives different bits; each test checks
that it does, so a kernel with the right values but the wrong order cannot pass.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from kimi_convert.runtime import ggml_cpu
from kimi_convert.runtime import ggml_cpu_quant as gq
from kimi_interop import ggml_cpu_kernels as ggml
from kimi_interop.ggml_quants import ggml_quantize
from kimi_convert.runtime.forward import Runtime

F32 = np.float32
X86 = ggml_cpu.X86_AVX2
QUANTIZED = [QT.Q8_0, QT.Q4_0, QT.Q5_0, QT.Q5_1, QT.IQ4_NL, QT.MXFP4, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K,
             QT.IQ4_XS]
M_ROWS = 24


def wide(rng, shape) -> np.ndarray:
    return (rng.standard_normal(shape) * np.exp2(rng.integers(-8, 8, shape))).astype(F32)


def wide_bf16(rng, shape) -> np.ndarray:
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-10, 10, shape))
    return ggml_cpu.to_bf16(x.astype(F32))


def f64_product(x, w: ggml_cpu.WeightRows) -> np.ndarray:
    """The same rounded inputs multiplied in float64 and rounded once: the right values in another order."""
    return (ggml_cpu.vec_dot_input(x, w.qtype, X86).astype(np.float64) @ w.values().astype(np.float64).T).astype(F32)


@pytest.fixture(scope="module", params=QUANTIZED, ids=lambda t: t.name)
def quantized(request):
    """(type, raw rows, activations [10, K]): K has an odd number of 32-blocks (the paired vec_dots' scalar tail)
    where the type allows it."""
    qtype = request.param
    rng = np.random.default_rng(int(qtype))
    k = 512 if qtype in gq.KQUANTS else 288
    return qtype, ggml_quantize(wide(rng, (M_ROWS, k)), qtype), wide(rng, (10, k))


# ------------------------------------------------------------------------------------
# quantized weights, against the compiled kernels

@pytest.mark.interop
def test_vec_dot_is_ggmls(quantized):
    """One row at a time (mul_mat_id rows, a single token): the type's from_float and vec_dot."""
    qtype, raw, x = quantized
    w = ggml_cpu.WeightRows(qtype, raw, x.shape[1])
    theirs = np.array([[ggml.vec_dot(raw[m], qtype, row) for m in range(M_ROWS)] for row in x], F32)
    ours = ggml_cpu.mul_mat_id(x, w, X86, expert_rows=1)
    assert np.array_equal(ours, theirs), np.abs(ours - theirs).max()
    assert not np.array_equal(ours, f64_product(x, w))


@pytest.mark.interop
@pytest.mark.parametrize("n_tok", [10, 5, 1])
def test_mul_mat_is_ggmls(quantized, n_tok):
    """ggml_mul_mat on weights in ordinary memory: tinyBLAS_Q0 (32-blocks, >= 2 rows), the tiled kernel (K-quants,
    >= 8 rows) or vec_dot, as ggml_compute_forward_mul_mat picks them."""
    qtype, raw, x = quantized
    w = ggml_cpu.WeightRows(qtype, raw, x.shape[1])
    theirs = ggml.mul_mat(raw, qtype, x[:n_tok])
    ours = ggml_cpu.mul_mat(x[:n_tok], w, X86)
    path = ggml_cpu.quantized_path(w, n_tok, ggml_cpu.MUL_MAT)
    assert np.array_equal(ours, theirs), (path, np.abs(ours - theirs).max())


@pytest.mark.interop
@pytest.mark.parametrize("qtype", sorted(gq.REPACKED_TYPES), ids=lambda t: t.name)
def test_repacked_gemm_and_gemv_are_ggmls(qtype):
    """The CPU_REPACK layouts: mul_mat of 10 rows = gemm for 8 (4-row quantizer) + gemv for 2; mul_mat_id: gemv.
    Row 1 has -amax before +amax in its first block, where the two Q8_K quantizers take opposite signs (the codes
    and the scale negated together: the same products)."""
    rng = np.random.default_rng(7)
    k = 512
    raw = ggml_quantize(wide(rng, (M_ROWS, k)), qtype)
    x = wide(rng, (10, k))
    x[1, 0] = -2 * np.abs(x[1, :256]).max()
    x[1, 9] = -x[1, 0]
    w = ggml_cpu.WeightRows(qtype, raw, k, repacked=True)
    assert np.array_equal(ggml_cpu.mul_mat(x, w, X86), ggml.repacked_mul_mat(raw, qtype, x))
    assert np.array_equal(ggml_cpu.mul_mat_id(x, w, X86), ggml.repacked_mul_mat(raw, qtype, x, gemv_only=True))
    if qtype == QT.Q4_K:     # gemm and gemv accumulate in other groups: the split at T - T % 4 is visible
        assert not np.array_equal(gq.repacked_q4_k(x, w.blocks(), True), gq.repacked_q4_k(x, w.blocks(), False))


@pytest.mark.interop
@pytest.mark.parametrize("k", [16, 72])
def test_f16_weight_is_ggmls(k):
    """F16 (kimi-quantize's fallback for 16-wide rows): fp16 activation, tinyBLAS<8> for a batch, vec_dot_f16 for
    one row (4 x 8 lanes, GGML_F32x8_REDUCE, the K % 32 tail in double)."""
    rng = np.random.default_rng(k)
    w = ggml_cpu.WeightRows.from_values(wide(rng, (M_ROWS, k)).astype(np.float16).astype(F32), QT.F16)
    x = wide(rng, (10, k))
    assert np.array_equal(ggml_cpu.mul_mat(x, w, X86), ggml.mul_mat(w.raw, QT.F16, x))
    theirs = np.array([[ggml.vec_dot(w.raw[m], QT.F16, row) for m in range(M_ROWS)] for row in x], F32)
    assert np.array_equal(ggml_cpu.mul_mat_id(x, w, X86), theirs)
    assert not np.array_equal(ggml_cpu.mul_mat(x, w, X86), f64_product(x, w))


def test_fma_is_correctly_rounded_at_a_float64_midpoint():
    """1 + 2^-24 (1 + 2^-40): rounding the float64 sum (1 + 2^-24, an f32 midpoint) to f32 gives 1.0 (even); the
    true sum is above the midpoint, so an FMA gives 1 + 2^-23."""
    p = np.array([2.0 ** -24 * (1 + 2.0 ** -40), 2.0 ** -24 * (1 - 2.0 ** -40)])
    assert (p + 1).astype(F32).tolist() == [1.0, 1.0]
    assert gq.add(p, np.ones(2, F32)).tolist() == [np.float32(1 + 2.0 ** -23), 1.0]


# ------------------------------------------------------------------------------------
# float weights, against scalar restatements of the C code

def tinyblas_scalar(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """llamafile/sgemm.cpp tinyBLAS<8>: lane j accumulates k = j, j+8, ...; hsum = (l0+l4 + l2+l6) + (l1+l5 + l3+l7)."""
    out = np.empty((len(x), len(w)), F32)
    for t in range(len(x)):
        for m in range(len(w)):
            lanes = [F32(0)] * 8
            for k in range(x.shape[1]):
                lanes[k % 8] = F32(lanes[k % 8] + F32(x[t, k] * w[m, k]))
            v = [F32(lanes[i + 4] + lanes[i]) for i in range(4)]
            out[t, m] = F32(F32(v[0] + v[2]) + F32(v[1] + v[3]))
    return out


def vec_dot_bf16_scalar(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """vec.cpp ggml_vec_dot_bf16, AVX2: registers c1..c4 of 8 lanes over 32-steps, c = (c1+c3)+(c2+c4), the
    8-lane sum as above, then the K % 32 tail added in double."""
    n_main = x.shape[1] - x.shape[1] % 32
    out = np.empty((len(x), len(w)), F32)
    for t in range(len(x)):
        for m in range(len(w)):
            c = [[F32(0)] * 8 for _ in range(4)]
            for k in range(n_main):
                r, lane = (k % 32) // 8, k % 8
                c[r][lane] = F32(c[r][lane] + F32(x[t, k] * w[m, k]))
            lanes = [F32(F32(c[0][i] + c[2][i]) + F32(c[1][i] + c[3][i])) for i in range(8)]
            v = [F32(lanes[i + 4] + lanes[i]) for i in range(4)]
            total = float(F32(F32(v[0] + v[2]) + F32(v[1] + v[3])))
            for k in range(n_main, x.shape[1]):
                total += float(F32(x[t, k] * w[m, k]))
            out[t, m] = F32(total)
    return out


def test_bf16_mul_mat_is_tinyblas_order_for_a_batch():
    rng = np.random.default_rng(1)
    x, w = wide_bf16(rng, (3, 64)), wide_bf16(rng, (8, 64))
    got = ggml_cpu.mul_mat(x, ggml_cpu.WeightRows.from_values(w, QT.BF16), X86)
    assert np.array_equal(got, tinyblas_scalar(x, w))
    assert not np.array_equal(got, (x @ w.T).astype(F32))          # the order is visible in these data


def test_bf16_single_token_and_experts_are_vec_dot_order_with_a_double_tail():
    rng = np.random.default_rng(2)
    x, w = wide_bf16(rng, (1, 72)), wide_bf16(rng, (6, 72))          # 64 in registers + 8 in double
    want = vec_dot_bf16_scalar(x, w)
    rows = ggml_cpu.WeightRows.from_values(w, QT.BF16)
    assert np.array_equal(ggml_cpu.mul_mat(x, rows, X86), want)      # 1 token: no tinyBLAS
    assert np.array_equal(ggml_cpu.mul_mat_id_row(x[0], rows, X86), want[0])
    assert not np.array_equal(want, tinyblas_scalar(x, w))


def test_f32_weight_with_a_permuted_input_skips_tinyblas():
    """ggml_mul_mat reads an F32 src1 in place: a permuted view (attn_k_b's q) goes to vec_dot_f32."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((4, 32)) * np.exp2(rng.integers(-10, 10, (4, 32)))).astype(F32)
    w = (rng.standard_normal((8, 32)) * np.exp2(rng.integers(-10, 10, (8, 32)))).astype(F32)
    rows = ggml_cpu.WeightRows.from_values(w, QT.F32)
    tiny = ggml_cpu.mul_mat(x, rows, X86)
    vec = ggml_cpu.mul_mat(x, rows, X86, src1_contiguous=False)
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    assert np.abs(tiny - exact).max() <= 1e-6 * np.abs(x).max() * np.abs(w).max() * 32
    assert not np.array_equal(tiny, vec)


def test_x86_q8_0_rounds_half_to_even_and_the_reference_away_from_zero():
    # block max 127 -> d = 1, id = 1: 2.5 is a tie; x86 (127/max, round half even) gives 2, ggml-quants.c's
    # reference (1/d, roundf) gives 3; wllama's build is compared with the latter
    x = np.zeros(32, F32)
    x[0], x[1], x[2] = 127, 2.5, -3.5
    q_x86, d_x86 = ggml_cpu.quantize_q8_0(x, X86)
    q_ref, d_ref = ggml_cpu.quantize_q8_0(x, ggml_cpu.WASM)
    assert d_x86[0] == d_ref[0] == 1
    assert q_x86[0, :3].tolist() == [127, 2, -4] and q_ref[0, :3].tolist() == [127, 3, -4]


def test_wasm_f16_weight_multiplies_the_activation_unrounded():
    """wllama b12211's F16 vec_dot is ggml_vec_dot_f16_f32: the f32 activation as it is (x86 rounds it to fp16)."""
    x = np.array([[1 + 2.0 ** -20] * 16], F32)
    w = ggml_cpu.WeightRows.from_values(np.ones((4, 16), F32), QT.F16)
    assert ggml_cpu.mul_mat(x, w, ggml_cpu.WASM)[0, 0] == F32(16 * (1 + 2.0 ** -20))
    assert ggml_cpu.mul_mat(x, w, X86)[0, 0] == 16


def test_runtime_rejects_an_unknown_llama_cpp_target(tmp_path):
    with pytest.raises(ValueError, match="llama_cpp_rounding must be"):
        Runtime(tmp_path / "missing.gguf", llama_cpp_rounding="avx512")
