"""kimi_convert.runtime.ggml_cpu_lowbit against the pinned x86-64-v3 build's own code (docs/verification.md §8.4): the
low-bit types' dequantization against ggml's dequantize_row_*, their products against ggml's vec_dot and its CPU
graph's mul_mat (tiled for the grid i-quants with >= 8 rows), bit for bit (-0 is not +0). The weights are
quantized by ggml itself (ggml_quantize_chunk, with an imatrix where ggml requires one), from four kinds of rows:
wide-range values, a bf16 checkpoint's, dequantized MXFP4 blocks, and sparse rows with all-zero blocks, at widths
256 to 7168. These fail, not skip, when llama-cpp-python is missing.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize

from kimi_convert.runtime import ggml_cpu
from kimi_convert.runtime import ggml_cpu_lowbit as lowbit
from kimi_convert.gguf_io import dequantize
from kimi_interop import ggml_cpu_kernels as ggml
from kimi_interop.ggml_quants import ggml_dequantize, ggml_quantize, ggml_quantize_requires_imatrix

F32 = np.float32
X86 = ggml_cpu.X86_AVX2
M_ROWS = 16                          # one tiled microtile of weight rows
N_TOK = 20                           # > 16: the tiled kernel's wide path; its first 8 / 1 rows the narrow one
WIDTHS = {"wide": 256, "sparse": 1280, "mxfp4": 2048, "bf16": 7168}


def _wide(rng, shape) -> np.ndarray:
    return (rng.standard_normal(shape) * np.exp2(rng.integers(-8, 8, shape))).astype(F32)


def _rows(kind: str, rng, k: int) -> np.ndarray:
    """M_ROWS weight rows of one kind."""
    if kind == "wide":
        return _wide(rng, (M_ROWS, k))
    if kind == "bf16":
        return ggml_cpu.to_bf16((rng.standard_normal((M_ROWS, k)) * 0.02).astype(F32))
    if kind == "mxfp4":                           # random MXFP4 blocks (codes and exponents), dequantized
        blocks = rng.integers(0, 256, (M_ROWS * k // 32, 17), dtype=np.uint8)
        blocks[:, 0] = rng.integers(118, 130, len(blocks))
        return np.asarray(gguf_dequantize(blocks, QT.MXFP4), F32).reshape(M_ROWS, k)
    w = _wide(rng, (M_ROWS, k)) * (rng.random((M_ROWS, k)) < 0.1)        # 90 % zeros ...
    w.reshape(M_ROWS, -1, 256)[:, ::2] = 0                               # ... and every other 256 all zero
    return w.astype(F32)


def bit_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """The same float32 bits (-0 is not +0)."""
    return np.array_equal(np.asarray(a, F32).view(np.uint32), np.asarray(b, F32).view(np.uint32))


CASES = [(t, kind) for t in lowbit.LOWBIT_TYPES for kind in WIDTHS]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0].name}-{c[1]}")
def case(request):
    """(type, kind, raw rows quantized by ggml, activations [N_TOK, K])."""
    qtype, kind = request.param
    k = WIDTHS[kind]
    rng = np.random.default_rng([int(qtype), k])
    imatrix = rng.uniform(0.1, 2.0, k).astype(F32) if ggml_quantize_requires_imatrix(qtype) else None
    raw = ggml_quantize(_rows(kind, rng, k), qtype, imatrix)
    return qtype, kind, raw, _wide(rng, (N_TOK, k))


@pytest.mark.interop
def test_dequantize_is_ggmls(case):
    qtype, _, raw, x = case
    assert bit_equal(dequantize(raw, qtype).reshape(M_ROWS, -1), ggml_dequantize(raw, qtype, x.shape[1]))


@pytest.mark.interop
def test_vec_dot_is_ggmls(case):
    """One activation row at a time (a single token, a mul_mat_id row): the Q8_K / Q8_0 conversion and vec_dot."""
    qtype, kind, raw, x = case
    w = ggml_cpu.WeightRows(qtype, raw, x.shape[1])
    x = x[:3]
    theirs = np.array([[ggml.vec_dot(raw[m], qtype, row) for m in range(M_ROWS)] for row in x], F32)
    ours = ggml_cpu.mul_mat_id(x, w, X86, expert_rows=1)
    assert bit_equal(ours, theirs), np.abs(ours - theirs).max()
    if kind == "wide":                    # the same rounded inputs in another order give other bits
        exact = ggml_cpu.vec_dot_input(x, qtype, X86).astype(np.float64) @ w.values().astype(np.float64).T
        assert not np.array_equal(ours, exact.astype(F32))


@pytest.mark.interop
@pytest.mark.parametrize("n_tok", [1, 8, N_TOK])
def test_mul_mat_is_ggmls(case, n_tok):
    """ggml_mul_mat in a CPU graph: tiled (grid i-quants, >= 8 rows) or vec_dot, as ggml_compute_forward_mul_mat
    picks them."""
    qtype, _, raw, x = case
    w = ggml_cpu.WeightRows(qtype, raw, x.shape[1])
    ours = ggml_cpu.mul_mat(x[:n_tok], w, X86)
    theirs = ggml.mul_mat(raw, qtype, x[:n_tok])
    assert bit_equal(ours, theirs), (ggml_cpu.quantized_path(w, n_tok, ggml_cpu.MUL_MAT),
                                          np.abs(ours - theirs).max())


@pytest.mark.interop
@pytest.mark.parametrize("qtype", lowbit.GRID_TYPES, ids=lambda t: t.name)
def test_grid_types_take_the_tiled_kernel_from_8_rows(qtype):
    """The tiled kernel and vec_dot order the same integers differently: at 8 rows ggml's result is the tiled one."""
    rng = np.random.default_rng(int(qtype))
    raw = ggml_quantize(_wide(rng, (M_ROWS, 512)), qtype, rng.uniform(0.1, 2.0, 512).astype(F32))
    x = _wide(rng, (8, 512))
    w = ggml_cpu.WeightRows(qtype, raw, 512)
    blocks = w.blocks()
    tiled, vec = lowbit.tiled_grid(x, blocks), lowbit.vec_dot(x, qtype, blocks)
    assert not np.array_equal(tiled, vec)
    assert np.array_equal(ggml.mul_mat(raw, qtype, x), tiled)
    assert ggml_cpu.quantized_path(w, 8, ggml_cpu.MUL_MAT) == "tiled"
    assert ggml_cpu.quantized_path(w, 7, ggml_cpu.MUL_MAT_ID) == "vec_dot"


def test_q1_0_is_not_in_gguf_py():
    """gguf_io.dequantize fills the one type gguf-py 0.19 cannot dequantize (so gguf-py's stays the source for the
    rest); when gguf-py gains it, this fails and ours can go."""
    with pytest.raises(NotImplementedError):
        gguf_dequantize(np.zeros((1, 18), np.uint8), QT.Q1_0)
