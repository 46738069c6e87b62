"""The low-bit types Q1_0, Q2_0, TQ1_0, TQ2_0, MXFP4 and NVFP4 byte for byte against ggml's own quantizer
(ggml_quantize_chunk in llama-cpp-python's libggml-base.so), on the inputs that decide their rounding
(shared/reference/iq-family.md §1.3, §1.7): dequantized MXFP4 rows (values on the E2M1 grid, heavy ties),
exact ties of roundf/lroundf and of the E2M1 code search, UE4M3 scales over every code (subnormals, the half-up
rounding, the 448 clamp), E8M0 exponents at every power of two, -0.0, NaN/inf, zero and sparse blocks. None of
these types uses the imatrix: it must change nothing. The broad distributions and row lengths are
tests/test_quant_kernels.py's (its BLOCK_TYPES include these types); whole files are in tests/test_quantize.py.
Fails, never skips, when the library cannot be loaded."""
from __future__ import annotations

import zlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from kimi_convert.gguf_io import Q2_0
from kimi_interop import ggml_quants as ggml
from kimi_convert.quant import InvalidBlockError, quantize, row_size, validate_blocks
from kimi_convert.quant.blocks import block_type

pytestmark = pytest.mark.interop      # needs the llama.cpp builds (.ci/install-interop.sh)

LOW_BIT = [QT.Q1_0, Q2_0, QT.TQ1_0, QT.TQ2_0, QT.MXFP4, QT.NVFP4]
WIDTH = 768                     # a whole number of blocks of every type (64, 128, 256, 32)
E2M1_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)   # kvalues_mxfp4


def rng_for(name: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(name.encode()))


def assert_equal_ggml(x: np.ndarray, qtype, what: str) -> np.ndarray:
    """Our bytes for rows x are ggml's; returns them."""
    x = np.ascontiguousarray(x, np.float32)
    ref = ggml.ggml_quantize(x, qtype)
    ours = quantize(x, qtype)
    if not np.array_equal(ours, ref):
        size = row_size(qtype, block_type(qtype).block_size)
        r, b = (int(v) for v in np.argwhere(ours != ref)[0])
        k = b // size
        raise AssertionError(f"{qtype.name} {what}: row {r} block {k}: x {x[r, k * 64:(k + 1) * 64]} "
                             f"ours {ours[r, k * size:(k + 1) * size].tobytes().hex()} "
                             f"ggml {ref[r, k * size:(k + 1) * size].tobytes().hex()}")
    return ours


def tile(values: np.ndarray, width: int = WIDTH) -> np.ndarray:
    """1-D values -> rows of `width`, padded with zeros."""
    v = np.asarray(values, np.float32).reshape(-1)
    out = np.zeros(-(-v.size // width) * width, np.float32)
    out[:v.size] = v
    return out.reshape(-1, width)


def mxfp4_rows(rng, n_rows: int, extremes: bool = True) -> np.ndarray:
    """Random MXFP4 rows of WIDTH: every code, -0 included; scales around a weight's and, with `extremes`, a few
    at the ends of E8M0."""
    n_blocks = n_rows * WIDTH // 32
    blocks = np.empty((n_blocks, 17), np.uint8)
    blocks[:, 0] = rng.integers(112, 128, n_blocks)
    if extremes:
        blocks[::97, 0] = rng.choice(np.array([0, 1, 2, 200, 254], np.uint8), size=blocks[::97, 0].shape)
    blocks[:, 1:] = rng.integers(0, 256, (n_blocks, 16))
    return blocks.reshape(n_rows, -1)


def mxfp4_values(rng, n_rows: int) -> np.ndarray:
    """The values of random MXFP4 rows, as ggml dequantizes them: what a re-quantized MXFP4 expert holds."""
    return ggml.ggml_dequantize(mxfp4_rows(rng, n_rows), QT.MXFP4, WIDTH)


@pytest.mark.parametrize("qtype", LOW_BIT, ids=lambda t: t.name)
def test_bf16_and_dequantized_mxfp4_rows(qtype):
    rng = rng_for(f"mxfp4/{qtype.name}")
    bf16 = (rng.standard_t(5, (32, WIDTH)) * 0.02).astype(np.float32)
    bf16 = (bf16.view(np.uint32) & 0xFFFF0000).view(np.float32)
    assert_equal_ggml(bf16, qtype, "bf16 values")
    assert_equal_ggml(mxfp4_values(rng, 64), qtype, "dequantized MXFP4")


def test_mxfp4_reencoded_from_its_values_keeps_the_values_not_the_bytes():
    """MXFP4 -> values -> MXFP4 as ggml does it (weight-like scales): the same values, but not the same bytes
    (-0 becomes 0, and a block without a code of magnitude 12 gets a smaller exponent). This is why MXFP4 experts
    are copied, never re-encoded."""
    stored = mxfp4_rows(rng_for("reencode"), 16, extremes=False)
    values = ggml.ggml_dequantize(stored, QT.MXFP4, WIDTH)
    again = assert_equal_ggml(values, QT.MXFP4, "re-encoded")
    assert np.array_equal(ggml.ggml_dequantize(again, QT.MXFP4, WIDTH), values)
    same = (again.reshape(-1, 17) == stored.reshape(-1, 17)).all(axis=1)
    assert 0 < same.mean() < 0.5, same.mean()


@pytest.mark.parametrize("qtype", LOW_BIT, ids=lambda t: t.name)
def test_zero_sparse_and_constant_blocks(qtype):
    rng = rng_for(f"sparse/{qtype.name}")
    x = rng.standard_normal((24, WIDTH)).astype(np.float32)
    x[0] = 0                                                   # all-zero rows
    x[1] = -0.0
    x[2:8][rng.random((6, WIDTH)) < 0.95] = 0                  # sparse
    x[8:12] = np.repeat(rng.standard_normal((4, WIDTH // 16)), 16, axis=1)    # constant groups of 16
    x[12] = 0
    x[12, ::64] = rng.standard_normal(WIDTH // 64)             # one value a block
    x[13:16] = np.abs(x[13:16])                                # one-signed
    x[16:18] = -np.abs(x[16:18])
    x[18, :128] = 0
    x[18, 128:] = np.sign(x[18, 128:])                         # +-1 only
    assert_equal_ggml(x, qtype, "zero/sparse/constant")


@pytest.mark.parametrize("qtype", LOW_BIT, ids=lambda t: t.name)
def test_nonfinite_and_extreme_magnitudes(qtype):
    """NaN and inf where each quantizer treats them differently: TQ's MAX takes a NaN and drops it at the next
    value (so values before it exceed the scale and their lroundf wraps the packed trits), Q2_0/MXFP4/NVFP4 pass
    NaN over, inf scales give 1/d = 0 (and inf*0 = NaN), scales below 2^-128 give 1/d = inf, and MXFP4's
    exponent of a subnormal or inf maximum wraps through the 32-bit conversion."""
    rng = rng_for(f"nonfinite/{qtype.name}")
    x = (rng.standard_normal((40, WIDTH)) * 0.02).astype(np.float32)
    for r, block in enumerate(range(0, WIDTH, 256)):
        x[r, block + 255] = np.nan                             # the last value of a TQ block
        x[r, block + 100] = np.nan                             # mid-block, then...
        x[r, block + 101:block + 256] *= 1e-6                  # ... a scale far below the values before it
        x[r, block + 7] = 1e30
    x[3, 5] = np.inf
    x[4, 70] = -np.inf
    x[5, ::3] = np.nan
    x[6, :] = np.nan
    x[7, :] = np.inf
    x[8] *= np.float32(1e-38)                                  # scales below 2^-126, subnormal
    x[9] *= np.float32(1e-44)
    x[10] = np.float32(2.0**-149) * rng.integers(-3, 4, WIDTH)  # the smallest subnormals
    x[11] = np.float32(2.0**-126) * (1 + rng.random(WIDTH))    # MXFP4: e = (uint8)(-1) = 255
    x[12] *= np.float32(1e36)                                  # fp16 scales overflow to inf
    x[13] = np.float32(3.4e38) * np.sign(x[13])
    x[14, 64:128] = np.inf
    x[14, 128:192] = -np.inf
    assert_equal_ggml(x, qtype, "NaN/inf/extremes")


@pytest.mark.parametrize("qtype", LOW_BIT, ids=lambda t: t.name)
def test_negative_zero(qtype):
    x = np.full((2, WIDTH), -0.0, np.float32)
    x[1, 1::2] = 0.0
    x[1, ::7] = -1.0
    ours = assert_equal_ggml(x, qtype, "-0.0")
    if qtype == QT.Q1_0:                # x >= 0 holds for -0.0: every sign bit set, d = 0
        assert ours[0].reshape(-1, 18)[:, 2:].min() == 0xFF and not ours[0].reshape(-1, 18)[:, :2].any()


@pytest.mark.parametrize("qtype", [Q2_0, QT.TQ1_0, QT.TQ2_0], ids=lambda t: t.name)
def test_rounding_ties_of_the_ternary_types(qtype):
    """x*id exactly +-0.5 (roundf/lroundf round away from zero) and just beside it, for scales whose inverse is
    exact (powers of two) and inexact (3, 5, 7: id = 1/d rounded, then x*id rounded)."""
    rows = []
    for amax in (1.0, 2.0, 0.25, 3.0, 5.0, 7.0, 0.3, 1e-3):
        a = np.float32(amax)
        half = a / np.float32(2)
        row = np.array([a, -a, half, -half, np.nextafter(half, 0), np.nextafter(half, a), -np.nextafter(half, a),
                        a / np.float32(3), 0.0, -0.0] * 80, np.float32)[:WIDTH]
        row[::64] = a                   # every Q2_0 block (and TQ block) has this maximum
        rows.append(row)
    assert_equal_ggml(np.stack(rows), qtype, "ties")


def test_q2_0_never_writes_code_3():
    """q = roundf(x/amax) + 1 <= 2: the format's +2d code is never produced (by ggml or here)."""
    rng = rng_for("q2_0 codes")
    x = np.concatenate([rng.standard_normal((32, WIDTH)).astype(np.float32), mxfp4_values(rng, 32)])
    q = assert_equal_ggml(x, Q2_0, "codes").reshape(-1, 18)[:, 2:]
    codes = np.stack([(q >> s) & 3 for s in (0, 2, 4, 6)])
    assert set(np.unique(codes)) == {0, 1, 2}


def test_e2m1_code_ties():
    """Values exactly halfway between two doubled E2M1 values, times the block's scale, and one ulp on either
    side: ggml's scan keeps the first (lower) code of a tie; for negative values the negative codes."""
    mids = (E2M1_DOUBLED[1:8] + E2M1_DOUBLED[:7]) / 2
    for qtype, group in ((QT.MXFP4, 32), (QT.NVFP4, 16)):
        rows = []
        for scale in (2.0**-3, 1.0, 2.0**5):
            d = np.float32(scale)
            vals = np.concatenate([m * d + np.array([0, 0, 0], np.float32) for m in mids]).astype(np.float32)
            vals[1::3] = np.nextafter(vals[1::3], np.float32(0))
            vals[2::3] = np.nextafter(vals[2::3], np.float32(np.inf))
            body = np.resize(np.concatenate([vals, -vals]), WIDTH).reshape(-1, group)
            body[:, 0] = 12 * d            # the maximum: MXFP4 e = log2(12 d) - 2, NVFP4 ue(2d) exact, d' = d
            rows.append(body.reshape(-1))
        assert_equal_ggml(np.stack(rows), qtype, "E2M1 ties")


def _ue4m3_values() -> np.ndarray:
    """Every finite UE4M3 value (codes 1..0x7E): subnormals m*2^-9, normals (1 + m/8)*2^(e-7)."""
    codes = np.arange(1, 0x7F)
    exp, man = codes >> 3, codes & 7
    return np.where(exp == 0, man * 2.0**-9, (1 + man / 8) * 2.0 ** (exp - 7)).astype(np.float32)


def test_nvfp4_scale_rounding_every_code():
    """amax/6 on every UE4M3 value, on every midpoint between neighbours (ggml rounds half up on bit 19, not to
    even), one ulp either side of those, at the subnormal boundary 2^-6 and its (int)(x*512 + 0.5) steps, at
    the 448 clamp and beyond (inf): each as the maximum of one 16-value group. The scale bytes written must
    cover every code the tests claim: the subnormals 1..7, the carry into the next exponent, and 0x7E."""
    v = _ue4m3_values().astype(np.float64)
    mids = (v[1:] + v[:-1]) / 2
    targets = np.concatenate([v, mids, [2.0**-6, 2.0**-10, 2.0**-11, 448.0, 449.0, 480.0, 1e4, 1e30]])
    scales = np.float32(targets)
    scales = np.concatenate([scales, np.nextafter(scales, np.float32(0)), np.nextafter(scales, np.float32(np.inf))])
    amax = np.concatenate([scales * np.float32(6), [np.inf, np.float32(3.4e38), np.float32(1e-30)]]).astype(np.float32)
    rng = rng_for("ue4m3")
    groups = (rng.uniform(-1, 1, (amax.size, 16)) * amax[:, None]).astype(np.float32)
    groups[:, 0] = np.where(np.arange(amax.size) % 2, amax, -amax)
    x = tile(groups)
    ours = assert_equal_ggml(x, QT.NVFP4, "UE4M3 scales")
    written = set(np.unique(ours.reshape(-1, 36)[:, :4]).tolist())
    assert set(range(1, 8)) <= written and 0x7E in written and 0 in written
    assert len(written) >= 120, sorted(set(range(0x7F)) - written)


def test_mxfp4_exponent_at_every_power_of_two():
    """floorf(log2f(amax)) at 2^k and one ulp below, k from the smallest subnormal to the largest float: the
    exponent byte, including (uint8_t)(-1) = 255 for amax in [2^-126, 2^-125) and the wrap of subnormals."""
    k = np.arange(-149, 128)
    powers = np.ldexp(np.float32(1), k).astype(np.float32)
    amax = np.concatenate([powers, np.nextafter(powers, np.float32(0)), powers * np.float32(1.5),
                           [np.float32(3.4028235e38)]]).astype(np.float32)
    amax = amax[amax > 0]
    groups = np.zeros((amax.size, 32), np.float32)
    groups[:, 0] = amax
    groups[:, 1] = -amax / np.float32(3)
    groups[:, 2] = amax / np.float32(7)
    ours = assert_equal_ggml(tile(groups), QT.MXFP4, "E8M0 exponents")
    e = set(np.unique(ours.reshape(-1, 17)[:, 0]).tolist())
    assert {0, 255, 252} <= e and len(e) > 250


@pytest.mark.parametrize("qtype", LOW_BIT, ids=lambda t: t.name)
def test_imatrix_changes_nothing(qtype):
    """ggml ignores quant_weights for all six (Q1_0 and Q2_0 take them row by row and drop them): the bytes with
    an imatrix (positive, or with zero columns and a whole zero block) are those without, on both sides."""
    rng = rng_for(f"imatrix/{qtype.name}")
    x = np.concatenate([rng.standard_normal((8, WIDTH)).astype(np.float32), mxfp4_values(rng, 8)])
    positive = rng.lognormal(0, 1, WIDTH).astype(np.float32)
    zeros = positive.copy()
    zeros[rng.random(WIDTH) < 0.3] = 0
    zeros[:256] = 0
    plain = quantize(x, qtype)
    assert not block_type(qtype).uses_imatrix() and block_type(qtype).mirrors_imatrix is None
    for im in (positive, zeros):
        assert np.array_equal(quantize(x, qtype, im), plain)
        assert np.array_equal(ggml.ggml_quantize(x, qtype, im), plain)


def test_validate_e8m0_and_ue4m3_scales_as_ggml():
    """ggml_validate_row_data: an MXFP4 block with the E8M0 byte 0xFF is invalid ("found invalid e value"); every
    UE4M3 byte of NVFP4 is valid, 0xFF and 0x7F included."""
    rng = rng_for("validate")
    q = quantize(rng.standard_normal((3, WIDTH)).astype(np.float32), QT.MXFP4)
    validate_blocks(q, QT.MXFP4)
    assert ggml.ggml_validate_row_data(q, QT.MXFP4)
    blocks = q.reshape(-1, 17).copy()
    blocks[:, 0] = 0xFE
    assert ggml.ggml_validate_row_data(blocks, QT.MXFP4)
    validate_blocks(blocks, QT.MXFP4)
    blocks[37, 0] = blocks[50, 0] = 0xFF
    assert not ggml.ggml_validate_row_data(blocks, QT.MXFP4)
    with pytest.raises(InvalidBlockError, match="invalid e value at block 37") as err:
        validate_blocks(blocks, QT.MXFP4)
    assert (err.value.block, err.value.what) == (37, "invalid e")

    q = quantize(rng.standard_normal((3, WIDTH)).astype(np.float32), QT.NVFP4).reshape(-1, 36)
    for byte in (0xFF, 0x7F, 0x80, 0xFE):
        q[:, :4] = byte
        assert ggml.ggml_validate_row_data(q, QT.NVFP4)
        validate_blocks(q, QT.NVFP4)


def test_mxfp4_tiny_maximum_is_invalid_in_both():
    """A block whose maximum is in [2^-126, 2^-125) gets the exponent (uint8_t)(-1) = 0xFF from ggml, which its
    own validation then refuses: kimi-quantize refuses it the same way."""
    x = tile(np.full(32, 2.0**-126 * 1.5, np.float32), 32)
    q = assert_equal_ggml(x, QT.MXFP4, "tiny maximum")
    assert q[0, 0] == 0xFF and not ggml.ggml_validate_row_data(q, QT.MXFP4)
    with pytest.raises(InvalidBlockError):
        validate_blocks(q, QT.MXFP4)
