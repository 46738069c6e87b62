"""The IQ2 family (IQ2_XXS, IQ2_XS, IQ2_S; kernels/iq2.py) byte for byte against ggml's own quantizer
(ggml_quantize_chunk in llama-cpp-python's libggml-base.so), on the inputs that decide their choices
(shared/reference/iq-family.md §1.4, §1.7): BF16-rounded Student-t rows, dequantized MXFP4 rows (values on the
E2M1 grid: ties everywhere), all-zero, sparse and tiny-maximum sub-blocks around each type's epsilon, with a
random imatrix that has zero columns and with an all-zero one (the eff_max <= 0 guard), and IQ2_S also
without an imatrix. IQ2_XXS and IQ2_XS are ggml's imatrix-only types: without one we refuse, as ggml does.
Fails, never skips, when the library cannot be loaded."""
from __future__ import annotations

import zlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from kimi_interop import ggml_quants as ggml
from kimi_convert.quant import quantize, row_size
from kimi_convert.quant.blocks import block_type
from kimi_convert.quant.kernels.common import make_qp_quants

pytestmark = pytest.mark.interop      # needs the llama.cpp builds (.ci/install-interop.sh)

IQ2 = [QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S]
WIDTH = 512             # two super-blocks a row
F32 = np.float32


def rng_for(name: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(name.encode()))


def imatrix_for(rng) -> np.ndarray:
    """Random positive importance weights with ~10% zero columns."""
    qw = rng.gamma(0.7, 1.0, WIDTH).astype(F32)
    qw[rng.random(WIDTH) < 0.1] = 0
    return qw


def assert_equal_ggml(x: np.ndarray, qtype: QT, imatrix: np.ndarray | None, what: str) -> np.ndarray:
    """Our bytes for rows x are ggml's; returns them."""
    x = np.ascontiguousarray(x, F32)
    ref = ggml.ggml_quantize(x, qtype, imatrix)
    ours = quantize(x, qtype, imatrix)
    if not np.array_equal(ours, ref):
        size = row_size(qtype, 256)
        r, b = (int(v) for v in np.argwhere(ours != ref)[0])
        k = b // size
        raise AssertionError(f"{qtype.name} {what}: row {r} super-block {k} byte {b % size}: "
                             f"ours {ours[r, k * size:(k + 1) * size].tobytes().hex()} "
                             f"ggml {ref[r, k * size:(k + 1) * size].tobytes().hex()}")
    return ours


def bf16_rows(rng, n_rows: int) -> np.ndarray:
    x = (rng.standard_t(5, (n_rows, WIDTH)) * 0.02).astype(F32)
    return (x.view(np.uint32) & 0xFFFF0000).view(F32)


def mxfp4_values(rng, n_rows: int) -> np.ndarray:
    """The values of random MXFP4 rows (weight-like scales), as ggml dequantizes them."""
    n_blocks = n_rows * WIDTH // 32
    blocks = np.empty((n_blocks, 17), np.uint8)
    blocks[:, 0] = rng.integers(112, 128, n_blocks)
    blocks[:, 1:] = rng.integers(0, 256, (n_blocks, 16))
    return ggml.ggml_dequantize(blocks.reshape(n_rows, -1), QT.MXFP4, WIDTH)


def edge_rows(rng, eps: float) -> np.ndarray:
    """All-zero, -0.0, sparse, one-value and tiny-maximum sub-blocks (maxima just below and above eps)."""
    x = (rng.standard_normal((10, WIDTH)) * 0.02).astype(F32)
    x[0] = 0
    x[1] = -0.0
    x[2, :256] = 0                                                  # one zero super-block beside a live one
    x[3:6][rng.random((3, WIDTH)) < 0.95] = 0                       # sparse
    x[6] = 0
    x[6, ::37] = rng.standard_normal(len(x[6, ::37]))               # a few non-zeros, some sub-blocks empty
    x[7, 32:64] = 0                                                 # zero sub-blocks inside live super-blocks
    x[7, 256:272] = 0
    for j, scale in enumerate((0.5, 0.999, 1.001, 2.0, 1e3)):       # tiny maxima around the type's epsilon
        x[8, 32 * j:32 * j + 32] = F32(eps * scale) * rng.uniform(-1, 1, 32).astype(F32)
        x[8, 32 * j] = F32(eps * scale)
    x[9] *= F32(1e-30)
    return x


EPS = {QT.IQ2_XXS: 1e-15, QT.IQ2_XS: 1e-15, QT.IQ2_S: 1e-8}


@pytest.mark.parametrize("qtype", IQ2, ids=lambda t: t.name)
def test_bf16_and_dequantized_mxfp4_rows_with_imatrix(qtype):
    rng = rng_for(f"iq2/{qtype.name}")
    qw = imatrix_for(rng)
    assert_equal_ggml(bf16_rows(rng, 8), qtype, qw, "bf16 values")
    assert_equal_ggml(mxfp4_values(rng, 8), qtype, qw, "dequantized MXFP4")


@pytest.mark.parametrize("qtype", IQ2, ids=lambda t: t.name)
def test_zero_sparse_and_tiny_blocks(qtype):
    rng = rng_for(f"iq2/edges/{qtype.name}")
    assert_equal_ggml(edge_rows(rng, EPS[qtype]), qtype, imatrix_for(rng), "zero/sparse/tiny")


@pytest.mark.parametrize("qtype", IQ2, ids=lambda t: t.name)
def test_all_zero_imatrix(qtype):
    """Every weight 0: IQ2_XXS's seed scale is 0 (eff_max <= 0: the sub-block is skipped, ggml's fix of
    uninitialized L), the others find no candidate and keep max/5 with levels 0."""
    rng = rng_for(f"iq2/zero-imatrix/{qtype.name}")
    x = np.concatenate([bf16_rows(rng, 2), mxfp4_values(rng, 2)])
    qw = np.zeros(WIDTH, F32)
    qw[300:310] = 1                                                 # a few live columns in the second super-block
    assert_equal_ggml(x, qtype, np.zeros(WIDTH, F32), "all-zero imatrix")
    assert_equal_ggml(x, qtype, qw, "imatrix zero but for 10 columns")


def test_iq2_s_without_imatrix():
    rng = rng_for("iq2/s/none")
    assert_equal_ggml(bf16_rows(rng, 8), QT.IQ2_S, None, "bf16 values")
    assert_equal_ggml(mxfp4_values(rng, 8), QT.IQ2_S, None, "dequantized MXFP4")
    assert_equal_ggml(edge_rows(rng, EPS[QT.IQ2_S]), QT.IQ2_S, None, "zero/sparse/tiny")


@pytest.mark.parametrize("qtype", IQ2, ids=lambda t: t.name)
def test_imatrix_requirement_is_ggmls(qtype):
    """IQ2_XXS and IQ2_XS: ggml asserts quant_weights, so there is no kernel without them and quantize refuses."""
    bt = block_type(qtype)
    assert bt.ggml_requires_imatrix == ggml.ggml_quantize_requires_imatrix(qtype)
    assert bt.uses_imatrix()
    x = np.ones((1, 256), F32)
    if bt.ggml_requires_imatrix:
        assert bt._ref is None
        with pytest.raises(ValueError, match="only with an imatrix"):
            quantize(x, qtype)
    else:
        assert quantize(x, qtype).shape == (1, bt.type_size)


def iq2_xxs_xval_and_weights(x: np.ndarray, qw: np.ndarray, sigma2: F32) -> tuple[np.ndarray, np.ndarray]:
    """What quantize_row_iq2_xxs_impl hands make_qp_quants for a sub-block of 32: |x| with, in each group of 8
    holding an odd count of negatives, the element of least weight*x^2 negated; and its weights."""
    w = (qw * np.sqrt(sigma2 + x * x)).astype(F32)
    xval = np.abs(x)
    for k in range(4):
        g = slice(8 * k, 8 * k + 8)
        if (x[g] < 0).sum() % 2:
            i = 8 * k + int(np.argmin(w[g] * x[g] * x[g]))     # the first of the least, as ggml's strict <
            xval[i] = -xval[i]
    return xval, w


def test_iq2_xxs_seed_scale_reads_levels_wrapped_to_uint8():
    """iq-family.md §1.7.4: IQ2_XXS seeds its scan with make_qp_quants(32, 4, xval, (uint8_t*)L, weight), and
    xval holds a negated element in each group with an odd count of negatives (the parity flip): its level -1
    is stored as 255 and read back as 255. In sub-block 5 of this super-block that makes the seed scale 46.8
    instead of 0.0106 (the same search on int8 levels, which keep -1), the scan then runs around another scale,
    and the super-block's bytes change (measured with the kernel built on int8 levels: 14 of 66 bytes differ).
    ggml's bytes are the wrapped seed's."""
    rng = rng_for("iq2/xxs/wrap/0")
    qw = imatrix_for(rng)[:256]
    x = (rng.standard_normal(256) * 0.02).astype(F32)
    sigma2 = F32(0)
    for v in x:
        sigma2 += v * v
    sigma2 /= F32(256)
    xval, w = iq2_xxs_xval_and_weights(x[160:192], qw[160:192], sigma2)
    wrapped = make_qp_quants(32, 4, xval, np.zeros(32, np.uint8), w)
    kept = make_qp_quants(32, 4, xval, np.zeros(32, np.int8), w)
    assert wrapped > 1000 * kept > 0, (wrapped, kept)
    assert_equal_ggml(x[None], QT.IQ2_XXS, qw, "wrapped seed levels")
