"""IQ1_S and IQ1_M byte for byte against ggml's own quantizer (ggml_quantize_chunk in llama-cpp-python's
libggml-base.so), on the inputs that decide their searches (shared/reference/iq-family.md §1.5, §1.7): BF16
weights, dequantized MXFP4 rows (few distinct values: ties in every sub-block), zero, sparse and tiny blocks at
both sides of each type's GROUP_MAX_EPS, with an imatrix (10% zero columns) and an all-zero one; IQ1_M also
without. The hazards: glibc's stable tie order (IQ1_M's bytes change under another), no FMA contraction.
Fails, never skips, when the library cannot be loaded."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from numba import njit
from test_quant_lowbit import WIDTH, mxfp4_values, rng_for

from kimi_interop import ggml_quants as ggml
from kimi_convert.quant import InvalidBlockError, quantize, validate_blocks
from kimi_convert.quant.blocks import block_type
from kimi_convert.quant.kernels import iq1
from kimi_convert.quant.kernels.common import JIT

IQ1 = [QT.IQ1_S, QT.IQ1_M]
EPS = {QT.IQ1_S: 1e-12, QT.IQ1_M: 1e-7}       # GROUP_MAX_EPS_IQ1_S, _M (ggml-quants.c)


def importance(rng) -> np.ndarray:
    im = rng.lognormal(0.0, 1.0, WIDTH).astype(np.float32)
    im[rng.random(WIDTH) < 0.1] = 0.0
    return im


def bf16_rows(rng, n_rows: int) -> np.ndarray:
    x = (rng.standard_t(5, (n_rows, WIDTH)) * 0.02).astype(np.float32)
    return (x.view(np.uint32) & 0xFFFF0000).view(np.float32)


def edge_rows(rng, qtype) -> np.ndarray:
    """Rows of 3 super-blocks: zero, sparse, constant, +-1 patterns, and sub-blocks whose maximum lies just
    below and just above the type's epsilon (the all-zero path and the search on tiny values)."""
    eps = np.float32(EPS[qtype])
    x = np.zeros((8, WIDTH), np.float32)
    x[1, ::37] = 1.0                                        # sparse: a few non-zeros per sub-block
    x[2, 5] = -3e-3                                         # one non-zero in a super-block
    x[3, :256] = 0.5                                        # constant
    x[4] = np.tile(np.array([1, -1, 0, 0.5], np.float32), WIDTH // 4)
    x[5] = rng.standard_normal(WIDTH).astype(np.float32) * eps * 4   # around eps: some sub-blocks below it
    x[6] = np.nextafter(eps, np.float32(0)) * np.sign(rng.standard_normal(WIDTH)).astype(np.float32)
    x[7] = np.nextafter(eps, np.float32(1)) * np.sign(rng.standard_normal(WIDTH)).astype(np.float32)
    x[6:8, 300:400] = 0.0
    return x


def assert_equal_ggml(x: np.ndarray, qtype, imatrix, what: str) -> None:
    x = np.ascontiguousarray(x, np.float32)
    ref = ggml.ggml_quantize(x, qtype, imatrix)
    ours = quantize(x, qtype, imatrix, threads=2)
    if not np.array_equal(ours, ref):
        size = block_type(qtype).type_size
        diff = (ours != ref).reshape(-1, size).any(axis=1)
        k = int(np.argmax(diff))
        raise AssertionError(f"{qtype.name} {what}: {int(diff.sum())} of {diff.size} blocks differ, first {k}: "
                             f"ours {ours.reshape(-1, size)[k].tobytes().hex()} "
                             f"ggml {ref.reshape(-1, size)[k].tobytes().hex()}")


def weightings(qtype, rng):
    yield "imatrix", importance(rng)
    yield "zero imatrix", np.zeros(WIDTH, np.float32)
    if qtype == QT.IQ1_M:
        yield "no imatrix", None


@pytest.mark.interop
@pytest.mark.parametrize("qtype", IQ1, ids=lambda t: t.name)
def test_bf16_rows(qtype):
    rng = rng_for(f"iq1/bf16/{qtype.name}")
    x = bf16_rows(rng, 8)
    for what, im in weightings(qtype, rng):
        assert_equal_ggml(x, qtype, im, f"bf16, {what}")


@pytest.mark.interop
@pytest.mark.parametrize("qtype", IQ1, ids=lambda t: t.name)
def test_dequantized_mxfp4_rows(qtype):
    rng = rng_for(f"iq1/mxfp4/{qtype.name}")
    x = mxfp4_values(rng, 16)
    for what, im in weightings(qtype, rng):
        assert_equal_ggml(x, qtype, im, f"dequantized MXFP4, {what}")


@pytest.mark.interop
@pytest.mark.parametrize("qtype", IQ1, ids=lambda t: t.name)
def test_zero_sparse_and_tiny_blocks(qtype):
    rng = rng_for(f"iq1/edge/{qtype.name}")
    x = edge_rows(rng, qtype)
    for what, im in weightings(qtype, rng):
        assert_equal_ggml(x, qtype, im, f"edge blocks, {what}")


@pytest.mark.interop
def test_iq1_s_requires_an_imatrix_as_ggml():
    assert ggml.ggml_quantize_requires_imatrix(QT.IQ1_S)
    assert block_type(QT.IQ1_S).ggml_requires_imatrix
    assert not ggml.ggml_quantize_requires_imatrix(QT.IQ1_M)
    assert not getattr(block_type(QT.IQ1_M), "ggml_requires_imatrix", False)
    with pytest.raises(ValueError, match="IQ1_S: ggml quantizes this type only with an imatrix"):
        quantize(np.ones((1, 256), np.float32), QT.IQ1_S)


# --- the tie order: glibc's qsort is stable; IQ1_M's bytes depend on it ---

@njit(**JIT)
def reversed_ties_order(x, o, n, order):
    """A sort by value that puts equal values in decreasing index order (what another libc's qsort may do)."""
    xs = x[o:o + n]
    for j in range(n):
        v = xs[j]
        k = j
        while k > 0 and xs[order[k - 1]] >= v:
            order[k] = order[k - 1]
            k -= 1
        order[k] = j


@njit(**JIT)
def iq1_m_rows_reversed_ties(x, qw, out, grid, kmap, neighbours):
    levels, head = iq1.point_levels(grid)
    for r in range(x.shape[0]):
        iq1._iq1_m_row(x[r], qw, out[r], grid, levels, head, kmap, neighbours, reversed_ties_order)


def test_stable_order_is_numpys_stable_argsort():
    rng = rng_for("iq1/sort")
    x = rng.integers(-3, 4, 32 * 64).astype(np.float32)
    x[::7] = -0.0                               # -0.0 and 0.0 compare equal, in C and here
    order = np.empty(32, np.int64)
    for o in range(0, x.size, 32):
        iq1.stable_order(x, o, 32, order)
        assert np.array_equal(order, np.argsort(x[o:o + 32], kind="stable"))
        reversed_ties_order(x, o, 32, order)
        assert np.array_equal(x[o + order], np.sort(x[o:o + 32]))       # a sort, with the ties the other way


@pytest.mark.interop
def test_iq1_m_bytes_depend_on_the_tie_order_on_dequantized_mxfp4():
    """The kernel with ties in reverse index order differs from ggml (and from ours) on most super-blocks of
    dequantized MXFP4 rows, with and without an imatrix: the stable order is what makes ours equal."""
    rng = rng_for("iq1/ties")
    x = mxfp4_values(rng, 8)
    tables = block_type(QT.IQ1_M).tables()
    for im in (importance(rng), None):
        ref = ggml.ggml_quantize(x, QT.IQ1_M, im)
        assert np.array_equal(quantize(x, QT.IQ1_M, im), ref)
        other = np.empty_like(ref)
        iq1_m_rows_reversed_ties(x, np.zeros(0, np.float32) if im is None else im, other, *tables)
        changed = (other != ref).reshape(-1, 56).any(axis=1)
        assert changed.mean() > 0.5, changed.mean()


# --- no FMA: ggml-base is built for baseline x86-64, where a*b + c is rounded twice ---

@njit(**JIT)
def _mul_add(a, b, c):
    return a * b + c


def test_multiply_add_is_not_fused():
    a = np.float32(1 + 2.0**-12)
    c = -np.float32(1 + 2.0**-11)
    # a*a = 1 + 2^-11 + 2^-24 exactly; rounded to float32 the 2^-24 is lost (a tie, to even), fused it stays
    assert _mul_add(a, a, c) == (a * a) + c == np.float32(0.0)


# --- validation: IQ1_S's fp16 d at offset 0, as ggml_validate_row_data reads it ---

@pytest.mark.interop
def test_iq1_s_scale_validated_as_ggml():
    rng = rng_for("iq1/validate")
    q = quantize(bf16_rows(rng, 1), QT.IQ1_S, importance(rng)).reshape(-1, 50).copy()
    assert ggml.ggml_validate_row_data(q, QT.IQ1_S)
    validate_blocks(q, QT.IQ1_S)
    q[1, 0:2] = (0x00, 0x7C)                       # +inf in block 1's d
    assert not ggml.ggml_validate_row_data(q, QT.IQ1_S)
    with pytest.raises(InvalidBlockError, match="inf value at block 1"):
        validate_blocks(q, QT.IQ1_S)


@pytest.mark.interop
def test_iq1_m_split_scale_validated_as_ggml():
    """IQ1_M's fp16 scale lies in the top nibbles of scales[8]: an inf or NaN there is refused, as ggml does."""
    rng = rng_for("iq1/validate-m")
    q = quantize(bf16_rows(rng, 1), QT.IQ1_M).reshape(-1, 56).copy()
    assert ggml.ggml_validate_row_data(q, QT.IQ1_M)
    validate_blocks(q, QT.IQ1_M)
    for fp16, what in ((0x7C00, "inf"), (0x7E00, "nan")):
        bad = q.copy()
        sc = bad[:, 48:56].view("<u2")
        sc[2] &= 0x0FFF
        sc[2] |= np.array([(fp16 >> 4 * k & 0xF) << 12 for k in range(4)], np.uint16)
        assert not ggml.ggml_validate_row_data(bad, QT.IQ1_M)
        with pytest.raises(InvalidBlockError, match=f"{what} value at block 2"):
            validate_blocks(bad, QT.IQ1_M)
