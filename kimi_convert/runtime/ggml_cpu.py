"""ggml's CPU matrix products, computed in ggml's own order, so that a non-F32 file can be compared with
llama.cpp position by position (`Runtime(path, llama_cpp_rounding=...)`).

Two targets, named after the builds the interop tests run:

* ``X86_AVX2`` -- llama-cpp-python 0.3.36 as `.ci/install-interop.sh` builds it: x86-64-v3 (AVX2, FMA, F16C),
  tinyBLAS (GGML_LLAMAFILE), weight repacking (GGML_CPU_REPACK) and the tiled K-quant matmul on, no AVX512/AMX.
  On every CPU it runs the paths below (sources: ggml/src/ggml-cpu/ of the sdist). Each is a fixed sequence of
  IEEE-754 single operations, and this module performs the same operations in the same order:

  - the activation is first converted to the weight type's vec_dot type (ggml-cpu.c type traits): bf16 / fp16 by
    round-to-nearest-even for BF16 / F16 weights; Q8_0 for the 32-blocks and MXFP4, by arch/x86/quants.c
    `quantize_row_q8_0` (d = max/127 stored as fp16, q = round-half-even(x * (127/max)) -- not the reference 1/d
    and roundf); Q8_1 for Q5_1; Q8_K (the reference quantize_row_q8_K) for the K-quants and IQ4_XS;
  - BF16/F16/F32: `mul_mat` with >= 2 tokens, K % 8 == 0 and M % 4 == 0 goes to tinyBLAS (llamafile/sgemm.cpp):
    per output, 8 lanes, lane j sums elements j, j+8, ... one FMA at a time, then (l0+l4 + l2+l6) + (l1+l5 + l3+l7);
    otherwise, and in `mul_mat_id`, `ggml_vec_dot_*` (vec.cpp): 4x8 lanes over 32-wide steps,
    ((c1+c3)+(c2+c4)), an 8-lane sum, and the K % 32 tail in double (bf16, f16) or in f32 FMAs (f32);
  - quantized weights: which kernel runs depends on the type, on whether llama.cpp repacked the tensor
    (`is_repacked`) and on the number of rows (`quantized_path`); the kernels are in kimi_convert/runtime/ggml_cpu_quant.py,
    and those of the low-bit types (IQ1_*, IQ2_*, IQ3_*, TQ1_0, TQ2_0, Q1_0, NVFP4) in kimi_convert/runtime/ggml_cpu_lowbit.py.

  A bf16 x bf16 or fp16 x fp16 product is exact in f32, so FMA and multiply-add agree there; every other FMA is
  computed exactly (float64 product, correctly rounded sum: ggml_cpu_quant.add).

* ``WASM`` -- wllama's llama.cpp b12211 (wasm SIMD128): no tinyBLAS, no repacking, no tiled path; every product
  is a vec_dot per output. The activation is converted with the reference Q8_0 (1/d, roundf), Q8_K and bf16
  rules; an F16 weight multiplies the f32 activation unrounded (its vec_dot is ggml_vec_dot_f16_f32). The kernels
  of F32, F16 (K < 64), BF16, the 32-blocks, Q5_1, Q2_K and IQ4_XS are emulated from the shipped wllama.wasm
  (ggml_cpu_quant.wasm_*); Q3_K..Q6_K's SIMD128 kernels and the low-bit types' kernels are not: their products
  are float64, rounded once.

Cost: T x M x K products per matmul, computed in row chunks -- meant for fixture-sized files.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from gguf import GGMLQuantizationType as QT

from . import ggml_cpu_lowbit as lowbit
from . import ggml_cpu_quant as gq
from ..convert.checkpoint import bf16_to_f32, f32_to_bf16
from ..gguf_io import dequantize
from .ggml_cpu_quant import WASM, X86_AVX2

F32, F64 = np.float32, np.float64

TARGETS = (X86_AVX2, WASM)     # llama-cpp-python as .ci/install-interop.sh pins it; wllama

Q8_0_BLOCK = gq.QK
TINYBLAS_LANES = 8         # tinyBLAS<8, __m256, ...>: KN for f32, bf16 and f16 on AVX2
VEC_DOT_STEP = 32          # GGML_F32_STEP / the bf16 loop: 4 registers of 8 lanes
PRODUCT_CHUNK = 1 << 22    # elements of T x M_chunk x K held at a time

FLOAT_TYPES = (QT.F32, QT.BF16, QT.F16)
_Q8_0_DOT = {QT.Q4_0, QT.Q5_0, QT.Q8_0, QT.MXFP4, QT.IQ4_NL, *lowbit.Q8_0_TYPES}
_Q8_1_DOT = {QT.Q4_1, QT.Q5_1}           # Q8_1: the Q8_0 codes and scale, plus s = d * sum(q)
_Q8_K_DOT = {QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_XS, *lowbit.Q8_K_TYPES}
MUL_MAT, MUL_MAT_ID = "mul_mat", "mul_mat_id"
TILED_TYPES = (*gq.KQUANTS, *lowbit.GRID_TYPES)                    # tiled/tiled.cpp ggml_tiled_supported
VEC_DOT_ONLY_TYPES = (QT.Q5_1, QT.MXFP4, *lowbit.TERNARY_TYPES, *lowbit.Q8_0_TYPES)   # no tinyBLAS, tiled, repack


# ------------------------------------------------------------------------------------
# the weight operand

@dataclass
class WeightRows:
    """Rows of a weight as ggml multiplies them: the type, the raw GGUF blocks uint8 [M, row bytes] (a view of the
    file), K, and whether llama.cpp holds the whole tensor in its CPU_REPACK buffer (`is_repacked`)."""
    qtype: QT
    raw: np.ndarray
    k: int
    repacked: bool = False
    _values: np.ndarray | None = field(default=None, repr=False)
    _blocks: object = field(default=None, repr=False)

    @classmethod
    def from_values(cls, values: np.ndarray, qtype: QT) -> "WeightRows":
        """F32 / BF16 / F16 rows given by their (exactly representable) f32 values."""
        values = np.asarray(values, F32)
        dtype = {QT.F32: F32, QT.F16: np.float16}.get(qtype)
        raw = f32_to_bf16(values) if qtype == QT.BF16 else values.astype(dtype)
        return cls(qtype, np.ascontiguousarray(raw).view(np.uint8).reshape(values.shape[0], -1), values.shape[1])

    @property
    def n_rows(self) -> int:
        return self.raw.shape[0]

    def values(self) -> np.ndarray:
        """The dequantised f32 values [M, K] (ggml's to_float, bit for bit)."""
        if self._values is None:
            v = self.raw.view(F32) if self.qtype == QT.F32 else dequantize(self.raw, self.qtype)
            self._values = np.asarray(v, F32).reshape(self.n_rows, self.k)
        return self._values

    def blocks(self):
        """The integer codes and scales (K-quants: ggml_cpu_quant.KBlocks; Q5_1: decode_q5_1; the low-bit types:
        ggml_cpu_lowbit.decode), decoded once."""
        if self._blocks is None:
            if self.qtype in lowbit.LOWBIT_TYPES:
                self._blocks = lowbit.decode(self.raw, self.qtype)
            elif self.qtype == QT.Q5_1:
                self._blocks = gq.decode_q5_1(self.raw)
            else:
                self._blocks = gq.decode_k(self.raw, self.qtype)
        return self._blocks


def is_repacked(qtype: QT, shape: tuple[int, ...], op: str) -> bool:
    """Whether llama.cpp (x86 AVX2) puts this weight in its CPU_REPACK buffer: a type with an 8x8 layout whose
    ne[1] (numpy shape[-2]) is a multiple of 8, used by MUL_MAT as a 2-D tensor or by MUL_MAT_ID as a 3-D one
    (repack.cpp extra_buffer_type::supports_op and ggml_repack_get_optimal_repack_type)."""
    dims = 2 if op == MUL_MAT else 3
    return qtype in gq.REPACKED_TYPES and len(shape) == dims and shape[-2] % 8 == 0


# ------------------------------------------------------------------------------------
# activation conversion (from_float of the vec_dot type)

def to_bf16(x: np.ndarray) -> np.ndarray:
    """ggml_compute_fp32_to_bf16: round to nearest even (as f32 values)."""
    return bf16_to_f32(f32_to_bf16(x)).reshape(np.shape(x))


def quantize_q8_0(x: np.ndarray, target: str) -> tuple[np.ndarray, np.ndarray]:
    """(q [..., nb, 32], d [..., nb]) of x [..., K] by the target's Q8_0 rule (see ggml_cpu_quant.quantize_q8_0)."""
    return gq.quantize_q8_0(x, target)


def vec_dot_input(x: np.ndarray, weight_type: QT, target: str) -> np.ndarray:
    """x as the values ggml's mul_mat multiplies against a weight of this type."""
    if weight_type == QT.BF16:
        return to_bf16(x)
    if weight_type == QT.F16:
        return np.asarray(x, F32) if target == WASM else np.asarray(x, F32).astype(np.float16).astype(F32)
    if weight_type in _Q8_0_DOT or weight_type in _Q8_1_DOT:
        q, d = gq.quantize_q8_0(x, target)
        return (q * d[..., None]).astype(F32).reshape(np.shape(x))
    if weight_type in _Q8_K_DOT:
        q, d = gq.quantize_q8_k(x)
        return (q * d[..., None]).astype(F32).reshape(np.shape(x))
    return np.asarray(x, F32)


def same_conversion(a: np.ndarray, b: np.ndarray, weight_type: QT, target: str) -> np.ndarray:
    """[T, K] bool: where two activations convert to the same vec_dot values -- and, for Q8_1, the same block sum
    s = fp16(d * sum q), which Q5_1's kernel uses besides the codes."""
    same = vec_dot_input(a, weight_type, target) == vec_dot_input(b, weight_type, target)
    if weight_type in _Q8_1_DOT:
        s_same = gq.quantize_q8_1(a, target)[2] == gq.quantize_q8_1(b, target)[2]
        same &= np.repeat(s_same, Q8_0_BLOCK, axis=-1).reshape(same.shape)
    return same


def rounding_block_size(weight_type: QT, target: str = X86_AVX2) -> int:
    """How many activation elements one conversion decision covers: 0 for none (f32, and f16 on wasm), 1 for
    bf16/f16, else the block (32 for Q8_0/Q8_1, 256 for Q8_K)."""
    if weight_type == QT.F32 or (weight_type == QT.F16 and target == WASM):
        return 0
    if weight_type in (QT.BF16, QT.F16):
        return 1
    return gq.QK_K if weight_type in _Q8_K_DOT else Q8_0_BLOCK


# ------------------------------------------------------------------------------------
# summation orders of the float weights

def _lane_sums(products: np.ndarray, lanes: int, fma: bool) -> np.ndarray:
    """[..., K] -> [..., lanes]: lane j adds elements j, j+lanes, ... in order (K % lanes == 0).

    bf16/f16 products are exact in f32 and are added in f32; f32 products (fma=True) are float64 and each step
    is one FMA (ggml_cpu_quant.add: the correctly rounded acc + exact product).
    """
    groups = products.reshape(*products.shape[:-1], -1, lanes)
    acc = groups[..., 0, :].astype(F32)
    for g in range(1, groups.shape[-2]):
        acc = gq.add(groups[..., g, :], acc) if fma else acc + groups[..., g, :]
    return acc


def _sum_8_lanes_hadd(acc: np.ndarray) -> np.ndarray:
    """GGML_F32x8_REDUCE's tail: t = lo128 + hi128, then two hadds: (t0 + t1) + (t2 + t3)."""
    t = acc[..., :4] + acc[..., 4:]
    return (t[..., 0] + t[..., 1]) + (t[..., 2] + t[..., 3])


def _products(x: np.ndarray, w: np.ndarray, fma: bool) -> np.ndarray:
    """[T, M, K] elementwise products (float64 when they are not exact in f32)."""
    dt = F64 if fma else F32
    return x.astype(dt)[:, None, :] * w.astype(dt)[None, :, :]


def _tinyblas(p: np.ndarray, fma: bool) -> np.ndarray:
    return gq.hsum8(_lane_sums(p, TINYBLAS_LANES, fma))


def _vec_dot_registers(p: np.ndarray, fma: bool) -> tuple[np.ndarray, np.ndarray]:
    """The 4 x 8-lane registers over the 32-steps, combined ((c1+c3)+(c2+c4)) -> [..., 8], and the K % 32 tail."""
    n_main = p.shape[-1] - p.shape[-1] % VEC_DOT_STEP
    if not n_main:
        return np.zeros((*p.shape[:-1], 8), F32), p
    regs = _lane_sums(p[..., :n_main], VEC_DOT_STEP, fma).reshape(*p.shape[:-1], 4, 8)
    return (regs[..., 0, :] + regs[..., 2, :]) + (regs[..., 1, :] + regs[..., 3, :]), p[..., n_main:]


def _double_tail(total: np.ndarray, tail: np.ndarray) -> np.ndarray:
    out = total.astype(F64)
    for k in range(tail.shape[-1]):
        out += tail[..., k]
    return out.astype(F32)


def _vec_dot_bf16(p: np.ndarray) -> np.ndarray:
    """ggml_vec_dot_bf16, AVX2: 4 registers x 8 lanes over 32-steps, hsum8, the tail added in double."""
    c, tail = _vec_dot_registers(p, fma=False)
    return _double_tail(gq.hsum8(c), tail)


def _vec_dot_f16(p: np.ndarray) -> np.ndarray:
    """ggml_vec_dot_f16, AVX2 + F16C: the registers as for bf16, GGML_F32x8_REDUCE, the tail added in double."""
    c, tail = _vec_dot_registers(p, fma=False)
    return _double_tail(_sum_8_lanes_hadd(c), tail)


def _vec_dot_f32(p: np.ndarray) -> np.ndarray:
    """ggml_vec_dot_f32, AVX2: 4 registers x 8 FMA lanes, GGML_F32x8_REDUCE, the tail in f32 FMAs."""
    c, tail = _vec_dot_registers(p, fma=True)
    out = _sum_8_lanes_hadd(c)
    for k in range(tail.shape[-1]):
        out = gq.add(tail[..., k], out)
    return out


_VEC_DOT = {QT.F32: _vec_dot_f32, QT.BF16: _vec_dot_bf16, QT.F16: _vec_dot_f16}


def _chunked(x: np.ndarray, w: np.ndarray, kernel) -> np.ndarray:
    """kernel(x, w_rows) over row chunks of w, so that T x M_chunk x K stays below PRODUCT_CHUNK."""
    rows = max(1, PRODUCT_CHUNK // max(1, x.shape[0] * x.shape[1]))
    return np.concatenate([kernel(x, w[a:a + rows]) for a in range(0, w.shape[0], rows)], axis=-1)


def _float_mul_mat(xr: np.ndarray, w: WeightRows, tiny: bool) -> np.ndarray:
    fma = w.qtype == QT.F32
    if tiny:
        return _chunked(xr, w.values(), lambda a, b: _tinyblas(_products(a, b, fma), fma))
    return _chunked(xr, w.values(), lambda a, b: _VEC_DOT[w.qtype](_products(a, b, fma)))


# ------------------------------------------------------------------------------------
# quantized weights: which kernel

def quantized_path(w: WeightRows, n_rows: int, op: str) -> str:
    """The x86 kernel ggml runs for a quantized weight, given the number of src1 rows it multiplies at once (the
    tokens of a mul_mat; for mul_mat_id, the rows routed to that expert):

    - repacked (Q4_0, IQ4_NL, MXFP4, Q4_K with ne[1] % 8 == 0): "gemm" for the first T - T % 4 rows of a mul_mat
      with T > 3, "gemv" for the others and for every mul_mat_id row;
    - K-quants and the grid i-quants (IQ1_*, IQ2_*, IQ3_*) otherwise: "tiled" with >= 8 rows (tiled/tiled.cpp,
      also per expert in mul_mat_id), else "vec_dot";
    - Q4_0 / Q5_0 / Q8_0 / IQ4_NL otherwise: "tinyblas" (tinyBLAS_Q0_AVX) for a mul_mat with >= 2 rows, else
      "vec_dot"; Q5_1, MXFP4, TQ1_0, TQ2_0, Q1_0 and NVFP4: "vec_dot" always."""
    if w.repacked:
        return "gemm" if op == MUL_MAT and n_rows > 3 else "gemv"
    if w.qtype in TILED_TYPES:
        return "tiled" if n_rows >= gq.TILED_MIN_ROWS else "vec_dot"
    if w.qtype in gq.Q0_TYPES and op == MUL_MAT and n_rows >= 2:
        return "tinyblas"
    if w.qtype in gq.Q0_TYPES or w.qtype in VEC_DOT_ONLY_TYPES:
        return "vec_dot"
    # Q4_1 is the one type kimi-quantize can write whose x86 kernels are not emulated (docs/verification.md §8.4)
    raise ValueError(f"llama_cpp_rounding: ggml's x86 product for {w.qtype.name} weights is not emulated")


def _quantized(x: np.ndarray, w: WeightRows, path: str) -> np.ndarray:
    t = w.qtype
    if path in ("gemm", "gemv"):
        if t == QT.Q4_K:
            return gq.repacked_q4_k(x, w.blocks(), gemm=path == "gemm")
        return gq.repacked_q4_b32(x, w.values(), X86_AVX2)
    if t in lowbit.LOWBIT_TYPES:
        return lowbit.tiled_grid(x, w.blocks()) if path == "tiled" else lowbit.vec_dot(x, t, w.blocks())
    if path == "tiled":
        return gq.tiled(x, w.blocks())
    if t in gq.KQUANTS:
        return gq.vec_dot_k(x, w.blocks())
    if t in (QT.IQ4_NL, QT.MXFP4) and path == "vec_dot":
        return gq.vec_dot_paired(x, w.values(), X86_AVX2)
    if t == QT.Q5_1:
        return gq.vec_dot_q5_1(x, w.blocks(), X86_AVX2)
    return gq.q0_lanes(x, w.values(), X86_AVX2)


def _quantized_mul_mat(x: np.ndarray, w: WeightRows) -> np.ndarray:
    n_tok = x.shape[0]
    path = quantized_path(w, n_tok, MUL_MAT)
    if path != "gemm" or w.qtype != QT.Q4_K or n_tok % 4 == 0:
        return _quantized(x, w, path)
    n_gemm = n_tok - n_tok % 4          # the Q4_K gemm's last rows go to the gemv (another float order)
    return np.concatenate([_quantized(x[:n_gemm], w, "gemm"), _quantized(x[n_gemm:], w, "gemv")])


# ------------------------------------------------------------------------------------
# the ops

def mul_mat(x: np.ndarray, w: WeightRows, target: str, *, src1_contiguous: bool = True) -> np.ndarray:
    """ggml_mul_mat(W, x) -> [T, M] for x [T, K] (f32) and the weight rows W [M, K].

    src1_contiguous: whether ggml's src1 is a contiguous tensor (a permuted view is not); it decides whether
    an F32 weight can take tinyBLAS, which reads src1 in place.
    """
    x = np.asarray(x, F32)
    if target == WASM:
        return _wasm(x, w)
    if w.qtype in FLOAT_TYPES:
        n_tok, k = x.shape
        fma = w.qtype == QT.F32
        tiny = n_tok >= 2 and k % TINYBLAS_LANES == 0 and w.n_rows % 4 == 0 and (src1_contiguous or not fma)
        return _float_mul_mat(vec_dot_input(x, w.qtype, target), w, tiny)
    return _quantized_mul_mat(x, w)


def mul_mat_id(x: np.ndarray, w: WeightRows, target: str, *, expert_rows: int | None = None) -> np.ndarray:
    """The rows of ggml_mul_mat_id that one expert computes: [n, M] for x [n, K] and the expert's rows W [M, K].
    Every row is computed on its own, as ggml does (vec_dot, gemv, or the tiled kernel per row);
    expert_rows: how many rows of the batch llama.cpp routes to this expert (its cne1, default n), which picks the
    tiled kernel for a K-quant expert with >= 8 of them."""
    x = np.asarray(x, F32).reshape(-1, w.k)
    if target == WASM:
        return _wasm(x, w)
    if w.qtype in FLOAT_TYPES:
        return _float_mul_mat(vec_dot_input(x, w.qtype, target), w, tiny=False)
    return _quantized(x, w, quantized_path(w, len(x) if expert_rows is None else expert_rows, MUL_MAT_ID))


def mul_mat_id_row(x: np.ndarray, w: WeightRows, target: str, *, expert_rows: int = 1) -> np.ndarray:
    """One (token, expert) row of ggml_mul_mat_id: [M] for x [K]."""
    return mul_mat_id(np.reshape(x, (1, -1)), w, target, expert_rows=expert_rows)[0]


def _wasm(x: np.ndarray, w: WeightRows) -> np.ndarray:
    """wllama b12211's vec_dot for this weight type (see the module doc); float64 where it is not emulated."""
    t = w.qtype
    if t == QT.F32 or (t == QT.F16 and w.k < 64):
        return _chunked(x, w.values(), gq.wasm_vec_dot_f32)
    if t == QT.BF16:
        return _chunked(to_bf16(x), w.values(), gq.wasm_vec_dot_bf16)
    if t in gq.Q0_TYPES or t == QT.MXFP4:
        return gq.wasm_q0(x, w.values(), t)
    if t == QT.Q5_1:
        return gq.wasm_q5_1(x, w.blocks())
    if t == QT.Q2_K:
        return gq.wasm_q2_k(x, w.blocks())
    if t == QT.IQ4_XS:
        return gq.wasm_iq4_xs(x, w.blocks())
    return _f64_product(vec_dot_input(x, t, WASM), w.values())


def _f64_product(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x @ w.T in float64, rounded once: where no kernel is emulated, at least the same f32 on every CPU
    (OpenBLAS's sgemm kernels, chosen per CPU, differ in the last bit)."""
    return (x.astype(F64) @ w.astype(F64).T).astype(F32)
