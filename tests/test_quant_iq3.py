"""IQ3_XXS and IQ3_S (kernels.iq3) byte for byte against ggml's own quantizer (ggml_quantize_chunk in
llama-cpp-python's libggml-base.so), with and without an imatrix (ggml allows both), on BF16-rounded Student-t
rows, dequantized MXFP4 rows (values on the E2M1 grid: heavy ties), zero, sparse and tiny-maximum blocks, a real
imatrix (~10% zero columns) and an all-zero one; and one test per hazard of shared/reference/iq-family.md §1.7
that applies to these types, each on data where a port without the handling writes other bytes. Fails, never
skips, when the library cannot be loaded."""
from __future__ import annotations

import zlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from kimi_interop import ggml_quants as ggml
from kimi_convert.quant import quantize, validate_blocks
from kimi_convert.quant.blocks import block_type
from kimi_convert.quant.kernels import grids

IQ3 = [QT.IQ3_XXS, QT.IQ3_S]
WIDTH = 512                     # two super-blocks
WEIGHTS = ["none", "imatrix", "zero imatrix"]
SUB_BLOCK = 32
XXS_SIGNS = 2 + 64              # IQ3_XXS: d, 64 grid indices, then 8 u32 of 4 x 7 sign bits | scale << 28
S_QS, S_SIGNS = 2, 2 + 64 + 8   # IQ3_S: d, qs[64], qh[8], signs[32], scales[4]


def rng_for(name: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(name.encode()))


def importance(kind: str, rng: np.random.Generator) -> np.ndarray | None:
    if kind == "none":
        return None
    if kind == "zero imatrix":
        return np.zeros(WIDTH, np.float32)
    qw = rng.lognormal(0.0, 1.0, WIDTH).astype(np.float32)
    qw[rng.random(WIDTH) < 0.1] = 0.0
    return qw


def assert_equal_ggml(x: np.ndarray, qtype: QT, qw: np.ndarray | None, what: str) -> np.ndarray:
    """Our bytes for rows x are ggml's; returns them."""
    x = np.ascontiguousarray(x, np.float32)
    ref = ggml.ggml_quantize(x, qtype, qw)
    ours = quantize(x, qtype, qw)
    if not np.array_equal(ours, ref):
        size = block_type(qtype).type_size
        r, b = (int(v) for v in np.argwhere(ours != ref)[0])
        k = b // size
        raise AssertionError(f"{qtype.name} {what}: row {r} super-block {k}: x {x[r, 256 * k:256 * k + 32]}...\n"
                             f"ours {ours[r, k * size:(k + 1) * size].tobytes().hex()}\n"
                             f"ggml {ref[r, k * size:(k + 1) * size].tobytes().hex()}")
    return ours


def bf16_rows(rng, n_rows: int) -> np.ndarray:
    x = (rng.standard_t(5, (n_rows, WIDTH)) * 0.02).astype(np.float32)
    return (x.view(np.uint32) & 0xFFFF0000).view(np.float32)


def mxfp4_values(rng, n_rows: int) -> np.ndarray:
    """The values of random MXFP4 rows (every code, -0 included; scales around a weight's, a few tiny), as ggml
    dequantizes them: what a re-quantized MXFP4 expert holds."""
    n_blocks = n_rows * WIDTH // 32
    blocks = np.empty((n_blocks, 17), np.uint8)
    blocks[:, 0] = rng.integers(112, 128, n_blocks)
    blocks[::37, 0] = rng.choice(np.array([0, 1, 2, 100], np.uint8), size=blocks[::37, 0].shape)
    blocks[:, 1:] = rng.integers(0, 256, (n_blocks, 16))
    return ggml.ggml_dequantize(blocks.reshape(n_rows, -1), QT.MXFP4, WIDTH)


def sub_block_scaled(rng, n_rows: int, scales) -> np.ndarray:
    """Normal rows whose every sub-block of 32 is scaled by one of ``scales``, picked at random."""
    x = rng.standard_normal((n_rows, WIDTH)).astype(np.float32)
    pick = np.asarray(scales, np.float32)[rng.integers(0, len(scales), (n_rows, WIDTH // SUB_BLOCK))]
    return (x * np.repeat(pick, SUB_BLOCK, axis=1)).astype(np.float32)


@pytest.mark.interop
@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("qtype", IQ3, ids=lambda t: t.name)
def test_bf16_and_dequantized_mxfp4_rows(qtype, weights):
    rng = rng_for(f"iq3/{qtype.name}/{weights}")
    qw = importance(weights, rng)
    q = assert_equal_ggml(bf16_rows(rng, 12), qtype, qw, "bf16 values")
    validate_blocks(q, qtype)
    assert ggml.ggml_validate_row_data(q, qtype)
    assert_equal_ggml(mxfp4_values(rng, 12), qtype, qw, "dequantized MXFP4")


@pytest.mark.interop
@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("qtype", IQ3, ids=lambda t: t.name)
def test_zero_sparse_and_tiny_blocks(qtype, weights):
    rng = rng_for(f"iq3/edges/{qtype.name}/{weights}")
    qw = importance(weights, rng)
    zero = np.zeros((2, WIDTH), np.float32)
    zero[1, 256:] = -0.0
    assert not quantize(zero, qtype, qw).any()
    assert_equal_ggml(zero, qtype, qw, "zero")
    sparse = np.zeros((8, WIDTH), np.float32)
    for r in range(8):          # 1 to 6 non-zeros per super-block: most sub-blocks all zero
        for k in range(WIDTH // 256):
            n = int(rng.integers(1, 7))
            sparse[r, 256 * k + rng.integers(0, 256, n)] = rng.standard_normal(n) * 0.05
    assert_equal_ggml(sparse, qtype, qw, "sparse")
    # sub-block maxima from ordinary down to denormal, mixed within super-blocks (sigma2 is the super-block's)
    tiny = sub_block_scaled(rng, 8, [0.02, 1e-6, 3e-9, 1e-12, 1e-20, 1e-30, 3e-39, 1e-41, 0.0])
    assert_equal_ggml(tiny, qtype, qw, "tiny maxima")
    ties = np.repeat(rng.integers(-3, 4, (4, WIDTH // 4)).astype(np.float32), 4, axis=1)
    assert_equal_ggml(ties, qtype, qw, "integer ties")


@pytest.mark.interop
def test_iq3_xxs_skips_sub_blocks_below_its_own_eps():
    """IQ3_XXS leaves a sub-block whose maximum is below 1e-8 (GROUP_MAX_EPS_IQ3_XXS, not the 1e-15 of the
    other types) unquantized: no grid indices, no signs. A 3e-9 sub-block is above the common eps."""
    rng = rng_for("iq3/xxs-eps")
    x = rng.standard_normal((1, WIDTH)).astype(np.float32) * np.float32(0.02)
    x[0, 32:64] = rng.standard_normal(32).astype(np.float32) * np.float32(1e-9)
    assert np.abs(x[0, 32:64]).max() < 1e-8 and np.abs(x[0, 32:64]).min() > 1e-15
    q = assert_equal_ggml(x, QT.IQ3_XXS, None, "sub-block below eps")[0]
    assert not q[2 + 8:2 + 16].any()                                             # its 8 grid indices
    assert int.from_bytes(q[XXS_SIGNS + 4:XXS_SIGNS + 8].tobytes(), "little") & 0x0FFFFFFF == 0   # its signs
    assert q[XXS_SIGNS + 8:XXS_SIGNS + 12].any()                                 # the next one's are written


@pytest.mark.interop
def test_iq3_s_quantizes_any_nonzero_maximum():
    """IQ3_S skips only a sub-block whose maximum is exactly 0 (``!max``): one with maximum 1e-12, which every
    eps guard of ggml would skip, gets its grid indices and signs."""
    rng = rng_for("iq3/s-max")
    x = rng.standard_normal((1, 256)).astype(np.float32) * np.float32(1e-12)
    q = assert_equal_ggml(np.pad(x, ((0, 0), (0, WIDTH - 256))), QT.IQ3_S, None, "maximum 1e-12")[0]
    assert q[S_QS:S_QS + 64].any() and q[S_SIGNS:S_SIGNS + 32].any()


@pytest.mark.interop
def test_iq3_s_nearest_int_bit_trick_on_an_infinite_inverse_scale():
    """A denormal sub-block maximum: no scan candidate is accepted (x^2 underflows, so every weight is 0) and
    ggml re-projects with id = 1/(max/15) = inf. nearest_int(0.5*(inf*x - 1)) is its bit trick on inf:
    -4194304, clamped to level 0, so every group maps to the grid point of levels 0,0,0,0 (id 0). rint(inf)
    clamped would be level 7, and the vector 7,7,7,7 is off the grid and does not list point 0: a port with
    rint stores other grid indices."""
    rng = rng_for("iq3/s-inf")
    x = np.zeros((1, WIDTH), np.float32)
    x[0, :256] = (rng.standard_normal(256) * 1e-40).astype(np.float32)
    mx = np.float32(np.abs(x[0, :32]).max())
    with np.errstate(divide="ignore", over="ignore"):
        assert np.isinf(np.float32(1.0) / (mx / np.float32(15.0)))
    q = assert_equal_ggml(x, QT.IQ3_S, None, "denormal maximum")[0]
    tables = grids.grid_tables(QT.IQ3_S)
    assert tables.kmap[0] == 0 and not q[S_QS:S_QS + 8].any() and not q[2 + 64] & 1
    u7 = grids.pack(np.full(4, 7), 3)
    assert tables.kmap[u7] < 0 and 0 not in tables.neighbour_list(int(u7))
    assert q[S_SIGNS:S_SIGNS + 4].any()      # the sub-block was quantized, not skipped


@pytest.mark.interop
def test_iq3_s_zero_sub_block_shifts_the_next_ones_grid_indices_and_signs():
    """ggml's IQ3_S advances its qs and signs pointers only past the sub-blocks it quantizes: after an all-zero
    sub-block the next one's grid indices and signs are written into the zero one's place (and the last place
    stays 0), while qh and the scales are indexed by sub-block. Indexing by sub-block would write other bytes."""
    rng = rng_for("iq3/s-shift")
    x = np.zeros((1, WIDTH), np.float32)
    x[0, 32:256] = rng.standard_normal(224).astype(np.float32) * np.float32(0.02)     # sub-block 0 all zero
    q = assert_equal_ggml(x, QT.IQ3_S, None, "zero first sub-block")[0]
    assert q[S_SIGNS:S_SIGNS + 4].any() and not q[S_SIGNS + 28:S_SIGNS + 32].any()
    assert not q[S_QS + 56:S_QS + 64].any() and q[S_QS:S_QS + 8].any()


@pytest.mark.parametrize("qtype", IQ3, ids=lambda t: t.name)
def test_imatrix_is_used(qtype):
    """Both types weigh by the imatrix when given one (and by x^2 without): the bytes differ."""
    rng = rng_for(f"iq3/uses/{qtype.name}")
    x = bf16_rows(rng, 2)
    assert block_type(qtype).uses_imatrix()
    assert not np.array_equal(quantize(x, qtype, importance("imatrix", rng)), quantize(x, qtype, None))
