"""Block quantizers (kimi_convert.quant) byte for byte against ggml's own, in-process.

The reference is ``ggml_quantize_chunk`` from llama-cpp-python's libggml-base.so (the code llama-quantize
runs), called through kimi_interop.ggml_quants. If that library cannot be loaded every test here
fails (InteropUnavailable); none is skipped.

Inputs cover what decides ggml's branches: sign and magnitude of the first absolute maximum, all-zero and
constant groups, outliers, values below GROUP_MAX_EPS and fp16-subnormal scales, fp16 overflow of scales,
exact rounding ties of nearest_int/roundf and of the IQ4 code table, bf16-exact weights, NaN/inf inputs, and
importance weights that are positive or partly zero.
"""
from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from kimi_convert.gguf_io import Q2_0, QUANT_SIZES
from kimi_interop import ggml_quants as ggml
from kimi_convert.quant import InvalidBlockError, dequantize, quantize, row_size, validate_blocks

LOW_BIT_TYPES = [QT.Q1_0, Q2_0, QT.TQ1_0, QT.TQ2_0, QT.MXFP4, QT.NVFP4]     # none uses the imatrix
BLOCK_TYPES = [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.IQ4_NL,
               QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_XS, *LOW_BIT_TYPES]
FLOAT_TYPES = [QT.F32, QT.F16, QT.BF16]
ROW_LENGTHS = {32: (32, 96, 256, 3584, 7168),
               64: (64, 192, 512, 3584, 7168),
               128: (128, 384, 512, 3584, 7168),
               256: (256, 512, 768, 3584, 7168)}    # 256 and 768: a Q3_K search beside zeros
VALUES_PER_CASE = 16384


def row_lengths(qtype: QT) -> tuple[int, ...]:
    return ROW_LENGTHS[QT_BLOCK[qtype]]


def to_bf16_exact(x: np.ndarray) -> np.ndarray:
    bits = x.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).view(np.float32)


def _ties(rng, shape):
    """Groups whose scale makes x/d land exactly on .5 (nearest_int, roundf) or on IQ4 code midpoints."""
    n = shape[1]
    x = np.empty(shape, np.float32)
    halves = rng.integers(-120, 120, size=shape) + 0.5
    x[...] = halves / 127.0
    x[:, ::32] = 1.0                     # Q8_0: d = 1/127 -> x*id lands near k + 0.5
    iq4 = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
    mids = (iq4[1:] + iq4[:-1]) / 2
    if shape[0] > 1:
        x[1] = rng.choice(np.concatenate([mids, iq4]), size=n)
        x[1, ::32] = -127.0              # IQ4: d = 1, codes on exact midpoints
    if shape[0] > 2:
        x[2] = rng.integers(-16, 16, size=n) + 0.5
        x[2, ::16] = -16.0               # Q5_0/Q3_K-like exact grids
    for row, top in ((3, 31), (4, 15)):  # Q5_1 / Q4_1: min 0 and max `top` per block give d = 1 exactly,
        if shape[0] > row:               # so (x - min)*id + 0.5 and nearest_int land on whole numbers / halves
            x[row] = rng.integers(0, top, size=n) + 0.5
            x[row, ::32] = 0.0
            x[row, 1::32] = top
    return x


def _constant_groups(rng, shape):
    v = rng.standard_normal((shape[0], shape[1] // 16)).astype(np.float32)
    v[:, ::3] *= -1
    v[:, 1::5] = 0
    return np.repeat(v, 16, axis=1)


def _outliers(rng, shape):
    x = rng.standard_normal(shape).astype(np.float32) * 0.02
    hit = rng.random(shape) < 1 / 64
    x[hit] *= rng.choice(np.array([-1e3, 1e3, 50.0], np.float32), size=int(hit.sum()))
    return x


def _tiny(rng, shape):
    """Per-row magnitudes from fp16-normal scales down to below GROUP_MAX_EPS and float32 subnormals."""
    mags = np.array([1e-3, 1e-5, 1e-7, 1e-9, 3e-13, 1e-16, 1e-30, 1e-40], np.float32)
    return (rng.standard_normal(shape) * mags[np.arange(shape[0]) % len(mags), None]).astype(np.float32)


def _large(rng, shape):
    """Magnitudes whose scales overflow fp16 (d -> inf), as llama-quantize would then refuse."""
    mags = np.array([1e3, 6e4, 1e6, 1e9], np.float32)
    return (rng.standard_normal(shape) * mags[np.arange(shape[0]) % len(mags), None]).astype(np.float32)


def _sparse(rng, shape):
    x = rng.standard_normal(shape).astype(np.float32)
    x[rng.random(shape) < 0.7] = 0
    g = x.reshape(shape[0], -1, 16)
    g[:, ::4] = 0                                          # all-zero sub-blocks
    g[:, 1::4] = np.abs(g[:, 1::4]) + 0.01                 # one-signed sub-blocks
    g[:, 2::4] = -np.abs(g[:, 2::4]) - 0.01
    return x


def _nonfinite(rng, shape):
    """NaN and +-inf among normal values (llama-quantize would refuse most results; the bytes still agree)."""
    x = rng.standard_normal(shape).astype(np.float32)
    hit = rng.random(shape) < 0.01
    x[hit] = rng.choice(np.array([np.nan, np.inf, -np.inf], np.float32), size=int(hit.sum()))
    x[0, :40] = np.nan
    return x


DISTRIBUTIONS = {
    "normal": lambda rng, s: rng.standard_normal(s).astype(np.float32),
    "student_t2": lambda rng, s: rng.standard_t(2, size=s).astype(np.float32),
    "cauchy_clipped": lambda rng, s: np.clip(rng.standard_cauchy(s), -1e4, 1e4).astype(np.float32),
    "uniform": lambda rng, s: rng.uniform(-1, 1, s).astype(np.float32),
    "zeros": lambda rng, s: np.zeros(s, np.float32),
    "constant_groups": _constant_groups,
    "outliers": _outliers,
    "bf16_weights": lambda rng, s: to_bf16_exact(rng.standard_normal(s) * 0.02),
    "tiny": _tiny,
    "large": _large,
    "sparse_one_signed": _sparse,
    "ties": _ties,
    "nonfinite": _nonfinite,
}


def imatrices(rng, n: int) -> dict[str, np.ndarray | None]:
    positive = rng.lognormal(0.0, 1.0, n).astype(np.float32)
    with_zeros = positive.copy()
    with_zeros[rng.random(n) < 0.3] = 0
    with_zeros[:min(n, 32)] = 0            # a whole block without weight
    return {"none": None, "positive": positive, "with_zeros": with_zeros}


def first_difference(ours: np.ndarray, ref: np.ndarray, qtype: QT) -> str:
    r, b = (int(v) for v in np.argwhere(ours != ref)[0])
    size = row_size(qtype, QT_BLOCK[qtype])
    blk = b // size
    return (f"row {r} block {blk}: ours {ours[r, blk * size:(blk + 1) * size].tobytes().hex()} "
            f"ggml {ref[r, blk * size:(blk + 1) * size].tobytes().hex()}")


QT_BLOCK = {t: QUANT_SIZES[t][0] for t in BLOCK_TYPES + FLOAT_TYPES}


@pytest.mark.interop
def test_ggml_library_loads():
    path = ggml.ggml_base_path()
    assert path.name == "libggml-base.so" and path.parent.name == "lib" and path.parent.parent.name == "llama_cpp"
    assert ggml.ggml_row_size(QT.Q4_K, 7168) == row_size(QT.Q4_K, 7168) == 7168 // 256 * 144


@pytest.mark.interop
@pytest.mark.parametrize("dist", list(DISTRIBUTIONS))
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_bytes_equal_ggml(qtype, dist):
    rng = np.random.default_rng(zlib.crc32(f"{qtype.name}/{dist}".encode()))
    failures = []
    for n in row_lengths(qtype):
        x = DISTRIBUTIONS[dist](rng, (max(2, VALUES_PER_CASE // n), n))
        for im_name, im in imatrices(rng, n).items():
            ref = ggml.ggml_quantize(x, qtype, im)
            ours = quantize(x, qtype, im)
            assert ours.shape == ref.shape and ours.dtype == np.uint8
            if not np.array_equal(ours, ref):
                failures.append(f"n={n} imatrix={im_name}: {first_difference(ours, ref, qtype)}")
    assert not failures, f"{qtype.name}/{dist}:\n" + "\n".join(failures)


@pytest.mark.interop       # runs test_bytes_equal_ggml & co. (ggml's own quantizers) in a child
def test_vector_kernels_equal_ggml_as_avx2_code(tmp_path):
    """The kernels written as LLVM vector operations (common.py: abs_max's search, weighted_grid_d2; Q4_0's
    levels) are lowered to other instructions on a CPU without AVX-512. Built for haswell (AVX2 only) in a
    fresh cache, they still give ggml's bytes: Q4_0 (32-wide search and levels), Q5_0 and Q6_K (16-wide
    search) on every input above, IQ2_XXS (8-wide d2) and IQ3_S (4-wide) on their BF16 and MXFP4 rows."""
    tests = Path(__file__).parent
    selected = [f"{__file__}::test_bytes_equal_ggml[{t}-{dist}]" for t in ("Q4_0", "Q5_0", "Q6_K") for dist in DISTRIBUTIONS]
    selected += [f"{tests / 'test_quant_iq2.py'}::test_bf16_and_dequantized_mxfp4_rows_with_imatrix[IQ2_XXS]",
                 f"{tests / 'test_quant_iq3.py'}::test_bf16_and_dequantized_mxfp4_rows[IQ3_S-imatrix]",
                 f"{tests / 'test_quant_iq3.py'}::test_bf16_and_dequantized_mxfp4_rows[IQ3_S-none]"]
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES="",
               KIMI_CONVERT_KERNEL_CACHE=str(tmp_path / "kernels"), NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", *selected],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert f"{len(selected)} passed" in run.stdout, run.stdout[-500:]


@pytest.mark.interop
@pytest.mark.parametrize("qtype", FLOAT_TYPES, ids=lambda t: t.name)
def test_float_types_equal_ggml(qtype):
    """F32 copy, F16 (RNE, overflow to inf, NaN -> sign|0x7E00) and BF16 (RNE, NaN kept and made quiet)."""
    rng = np.random.default_rng(7)
    specials = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFBFFFFF, 0x7FA00000, 0x7F800000, 0xFF800000,
                         0x80000000, 0x00000001, 0x00800000, 0x477FF000, 0x477FEFFF, 0x47800000, 0x33000000,
                         0x33000001, 0x3F808000, 0x3F818000, 0x7F7FFFFF], np.uint32).view(np.float32)
    for dist in ("normal", "tiny", "large", "bf16_weights", "ties"):
        x = DISTRIBUTIONS[dist](rng, (8, 256))
        x.reshape(-1)[: specials.size] = specials
        ref = ggml.ggml_quantize(x, qtype)
        ours = quantize(x, qtype, rng.random(256).astype(np.float32))  # imatrix is ignored here, as in ggml
        assert np.array_equal(ours, ref), f"{qtype.name}/{dist}: {first_difference(ours, ref, qtype)}"


@pytest.mark.interop
@pytest.mark.parametrize("qtype", BLOCK_TYPES + FLOAT_TYPES, ids=lambda t: t.name)
def test_dequantize_equals_ggml(qtype):
    rng = np.random.default_rng(3)
    n = 96 if QT_BLOCK[qtype] <= 32 else 512
    x = np.concatenate([DISTRIBUTIONS[d](rng, (4, n)) for d in ("normal", "outliers", "tiny", "sparse_one_signed")])
    q = quantize(x, qtype)
    ours = dequantize(q, qtype)
    ref = ggml.ggml_dequantize(q, qtype, n)
    assert ours.shape == ref.shape == x.shape
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))


def test_threads_do_not_change_bytes():
    rng = np.random.default_rng(11)
    x = rng.standard_normal((37, 768)).astype(np.float32)
    im = rng.random(768).astype(np.float32)
    for qtype in (QT.Q4_K, QT.IQ4_XS, QT.Q5_0):
        assert np.array_equal(quantize(x, qtype, im, threads=1), quantize(x, qtype, im, threads=2))


def _break_scale(q: np.ndarray, qtype: QT, block: int, offset: int, bits: int) -> np.ndarray:
    q = q.copy().reshape(-1)
    size = row_size(qtype, QT_BLOCK[qtype])
    q[block * size + offset: block * size + offset + 2] = np.array([bits], np.uint16).view(np.uint8)
    return q


# byte offsets of the fp16 scales in each block (ggml-common.h): d, then dmin where there is one (MXFP4's E8M0
# and NVFP4's UE4M3 scales: tests/test_quant_lowbit.py)
SCALE_OFFSETS = {QT.Q8_0: (0,), QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2), QT.IQ4_NL: (0,),
                 QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,),
                 QT.IQ4_XS: (0,), QT.Q1_0: (0,), Q2_0: (0,), QT.TQ1_0: (52,), QT.TQ2_0: (64,)}
FP16_SCALED = [t for t in BLOCK_TYPES if t in SCALE_OFFSETS]


@pytest.mark.interop
@pytest.mark.parametrize("qtype", FP16_SCALED, ids=lambda t: t.name)
def test_validate_blocks_as_ggml(qtype):
    rng = np.random.default_rng(5)
    q = quantize(rng.standard_normal((3, 512)).astype(np.float32), qtype)
    validate_blocks(q, qtype)
    assert ggml.ggml_validate_row_data(q, qtype)
    n_blocks = q.size // row_size(qtype, QT_BLOCK[qtype])
    for offset in SCALE_OFFSETS[qtype]:
        for bits, what in ((0x7C00, "inf"), (0xFC00, "inf"), (0x7E00, "nan"), (0x7C01, "nan")):
            block = int(rng.integers(n_blocks))
            bad = _break_scale(q, qtype, block, offset, bits)
            assert not ggml.ggml_validate_row_data(bad, qtype)
            with pytest.raises(InvalidBlockError) as err:
                validate_blocks(bad, qtype)
            assert (err.value.block, err.value.what) == (block, what)


@pytest.mark.interop
def test_validate_blocks_floats_as_ggml():
    x = np.ones(64, np.float32)
    for qtype, bad_values, what in ((QT.F32, (np.inf, -np.inf), "inf"), (QT.F32, (np.nan,), "nan"),
                                    (QT.F16, (np.inf,), "inf"), (QT.F16, (np.nan,), "nan"),
                                    (QT.BF16, (-np.inf,), "inf"), (QT.BF16, (np.nan,), "nan")):
        for v in bad_values:
            y = x.copy()
            y[17] = v
            q = quantize(y[None], qtype)
            assert not ggml.ggml_validate_row_data(q, qtype)
            with pytest.raises(InvalidBlockError) as err:
                validate_blocks(q, qtype)
            assert (err.value.block, err.value.what) == (17, what)
        validate_blocks(quantize(x[None], qtype), qtype)


@pytest.mark.interop
def test_overflowing_scale_is_invalid_in_both():
    """A block whose scale overflows fp16 is written as inf by ggml too, and then refused by validation."""
    x = np.full((1, 256), 1e9, np.float32)
    for qtype in FP16_SCALED:
        q = quantize(x, qtype)
        assert np.array_equal(q, ggml.ggml_quantize(x, qtype)), qtype.name
        assert not ggml.ggml_validate_row_data(q, qtype), qtype.name
        with pytest.raises(InvalidBlockError):
            validate_blocks(q, qtype)


@pytest.mark.interop
def test_any_layout_and_dtype_of_input():
    """Strided or float64 input is quantized as its float32 C-contiguous copy would be."""
    rng = np.random.default_rng(13)
    wide = rng.standard_normal((6, 1024))
    x = wide[:, ::2]
    assert np.array_equal(quantize(x, QT.Q6_K), ggml.ggml_quantize(np.ascontiguousarray(x, np.float32), QT.Q6_K))


def test_bad_arguments():
    x = np.zeros((2, 96), np.float32)
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(x, QT.Q4_K)
    with pytest.raises(ValueError, match="imatrix has shape"):
        quantize(x, QT.Q4_0, np.ones(95, np.float32))
    with pytest.raises(ValueError, match="no quantizer for ggml type I8"):     # a type no kernel writes
        quantize(x, QT.I8)
    with pytest.raises(ValueError, match="2-D"):
        quantize(np.zeros(96, np.float32), QT.Q8_0)


@pytest.mark.interop
@pytest.mark.parametrize("source", [QT.BF16, QT.F16, QT.F32, QT.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_K, QT.IQ4_XS], ids=lambda t: t.name)
def test_stored_rows_quantize_as_their_float32_values(source, qtype):
    """quantize(stored rows, source=T) widens each few rows on the quantizing thread: the bytes must be those
    of quantizing the rows' float32 values (ggml's to_float, then ggml_quantize_chunk), for any thread count."""
    rng = np.random.default_rng(7)
    x = DISTRIBUTIONS["normal"](rng, (300, 512))            # rows > CACHE_VALUES // 512: several steps
    stored = quantize(x, source)
    values = ggml.ggml_dequantize(stored, source, 512)
    weights = rng.random(512).astype(np.float32)
    for imatrix in (None, weights):
        ref = ggml.ggml_quantize(values, qtype, imatrix)
        for threads in (1, 2, 3):
            ours = quantize(stored, qtype, imatrix, threads=threads, source=source)
            assert np.array_equal(ours, ref), f"{source.name}->{qtype.name} threads={threads}"


@pytest.mark.interop
def test_mxfp4_rows_requantize_as_their_values():
    """MXFP4 is only read (experts under --allow-requantize): its rows widen through gguf-py's dequantizer."""
    from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize
    x = DISTRIBUTIONS["normal"](np.random.default_rng(8), (64, 512))
    stored = gguf_quantize(x, QT.MXFP4)
    values = gguf_dequantize(stored, QT.MXFP4)
    assert np.array_equal(dequantize(stored, QT.MXFP4), values)
    assert np.array_equal(quantize(stored, QT.Q2_K, source=QT.MXFP4), ggml.ggml_quantize(values, QT.Q2_K))


def test_numba_start_hides_scipy_only_while_it_fills_the_registries():
    """numba_start hides scipy.linalg from numba's BLAS probe; afterwards an import of it must work as usual."""
    import importlib.util
    import sys

    from kimi_convert import numba_start
    numba_start.start()
    assert sys.modules.get("scipy.linalg", "absent") is not None       # no None left behind to break imports
    if importlib.util.find_spec("scipy") is not None:
        import scipy.linalg  # noqa: F401
