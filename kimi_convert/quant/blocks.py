"""One class per ggml type, registered by type (as gguf-py's ``gguf/quants.py`` does).

Each class names the ggml function its kernels mirror, for the two paths ``ggml_quantize_chunk`` takes
(ggml.c -> ``quantize_<type>`` in ggml-quants.c): without an imatrix most types run their
``quantize_row_<type>_ref``; with one, their ``quantize_row_<type>_impl``. Q8_0 ignores the imatrix.
IQ4_NL and IQ4_XS always run ``quantize_row_iq4_nl_impl`` with ntry=7 (weights x^2 when there is no imatrix);
``quantize_row_iq4_nl_ref`` (ntry=-1) is a different quantizer that llama-quantize never calls. The low-bit
types TQ1_0, TQ2_0, Q1_0, Q2_0, MXFP4 and NVFP4 ignore the imatrix (Q1_0 and Q2_0 run their _ref row by row).
"""
from __future__ import annotations

import gc
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache, partial
from typing import Callable, ClassVar, Iterable

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import quants as _gguf_quants

from ..cores import default_threads
from ..gguf_io import Q2_0 as _Q2_0
from ..gguf_io import QUANT_SIZES, ggml_type
from ..kernel import Kernel

KERNELS = "kimi_convert.quant.kernels"      # the numba source of the kernels below, a module per family


# the kinds of a grid type's tables, the arguments its kernels take last: grids.GridTables.arrays
GRID_TABLES = ("i8_2d", "i32_1d", "u16_1d")     # grid, kmap, neighbours


def _rows(family: str, name: str, out: str = "u8_2d", tables: tuple[str, ...] = ()) -> Kernel:
    """A kernel ``name(x, out, *tables)`` of ``kernels.<family>``: float32 rows [n_rows, n_per_row] -> their
    bytes (``out``) [n_rows, row bytes], reading the type's ``tables`` (BlockType.tables)."""
    return Kernel(f"{KERNELS}.{family}", name, "f32_2d", out, *tables)


def _weighted(family: str, name: str, tables: tuple[str, ...] = ()) -> Kernel:
    """A kernel ``name(x, qw, out, *tables)``: as _rows, with float32 importance weights [n_per_row]."""
    return Kernel(f"{KERNELS}.{family}", name, "f32_2d", "f32_1d", "u8_2d", *tables)


_BF16_TO_F32 = Kernel(f"{KERNELS}.legacy", "bf16_to_f32_rows", "u16_2d", "u32_2d")
_COUNT_NONFINITE = Kernel(f"{KERNELS}.legacy", "count_nonfinite_f32", "u32_2d", "u32_1d")


def _count_nonfinite(x: np.ndarray) -> int:
    """How many float32 values of the 2-D ``x`` are NaN or infinite (one vectorised pass, no temporary)."""
    n = np.zeros(1, np.uint32)
    _COUNT_NONFINITE(np.ascontiguousarray(x, dtype=np.float32).view(np.uint32), n)
    return int(n[0])

_REGISTRY: dict[QT, type["BlockType"]] = {}


class BlockType:
    """A ggml type: its block geometry, the ggml functions it mirrors and the kernels that do so."""
    qtype: ClassVar[QT]
    block_size: ClassVar[int]
    type_size: ClassVar[int]
    mirrors: ClassVar[str]                      # the ggml function behind ggml_quantize_chunk(..., imatrix=NULL)
    mirrors_imatrix: ClassVar[str | None] = None  # ... and with an imatrix; None: the imatrix is not used
    scale_offsets: ClassVar[tuple[int, ...]] = ()  # byte offsets of the fp16 scales ggml_validate_row_data checks
    e8m0_offsets: ClassVar[tuple[int, ...]] = ()   # ... and of its E8M0 scales (0xFF is invalid)
    _ref: ClassVar[Kernel | None] = None
    _impl: ClassVar[Kernel | None] = None
    ggml_requires_imatrix: ClassVar[bool] = False  # ggml asserts an imatrix (IQ2_XXS, IQ2_XS, IQ1_S): no _ref
    # ggml aborts the process on a NaN or an infinity among the values (IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S: no grid
    # point found, GGML_ASSERT / "Oops ... not on grid"): we refuse it (NonFiniteError). Every other type,
    # IQ1_S, IQ1_M and IQ2_XXS included, writes ggml's bytes for it, as llama-quantize does
    refuses_nonfinite: ClassVar[bool] = False
    # our dequantizer: for the types gguf-py has none of (Q1_0, Q2_0), and for MXFP4, where gguf-py's numpy is slow
    _to_f32: ClassVar[Kernel | None] = None

    def __init_subclass__(cls, qtype: QT, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.qtype = qtype
        cls.block_size, cls.type_size = QUANT_SIZES[qtype]
        assert qtype not in _REGISTRY
        _REGISTRY[qtype] = cls

    @classmethod
    def uses_imatrix(cls) -> bool:
        return cls.mirrors_imatrix is not None

    @classmethod
    def row_size(cls, n_per_row: int) -> int:
        return n_per_row // cls.block_size * cls.type_size

    @classmethod
    def kernel(cls, weighted: bool) -> Kernel | None:
        """The kernel quantize_rows runs: _impl with an imatrix where the type has one, else _ref."""
        return cls._impl if weighted and cls._impl is not None else cls._ref

    @classmethod
    def tables(cls) -> tuple[np.ndarray, ...]:
        """The read-only arrays this type's kernels take after their data, in their kinds' order (a grid type:
        its grid, kmap and neighbour lists, built on first use); none for most types."""
        return ()

    @classmethod
    def quantize_rows(cls, x: np.ndarray, imatrix: np.ndarray | None, out: np.ndarray) -> None:
        """x: float32 [n_rows, n_per_row], C-contiguous, n_per_row a multiple of block_size (checked by the
        caller) -> its bytes into ``out`` [n_rows, row_size], on this thread (the kernels drop the GIL)."""
        if imatrix is not None and cls._impl is not None:
            cls._impl(x, imatrix, out, *cls.tables())
        else:
            cls._ref(x, cls._out_view(out), *cls.tables())

    @classmethod
    def _out_view(cls, out: np.ndarray) -> np.ndarray:
        return out

    @classmethod
    def to_float32(cls, data: np.ndarray, buf: np.ndarray) -> np.ndarray:
        """Stored rows (block bytes, or values) -> float32 [n_rows, n_per_row], as ggml's to_float; into
        ``buf`` where the type can (gguf-py's dequantizers, equal to ggml's, allocate their own)."""
        if cls._to_f32 is not None:
            cls._to_f32(np.ascontiguousarray(data, dtype=np.uint8), buf)
            return buf
        return np.asarray(_gguf_quants.dequantize(data, cls.qtype), dtype=np.float32)


class GridType:
    """Mixin of the grid i-quants (IQ1_S ... IQ3_S: ``class IQ2_XXS(GridType, BlockType, qtype=...)``): their
    kernels take the type's grid tables (kernels/grids.py: grid, kmap, neighbours) after their data, declared
    as ``_rows(..., tables=GRID_TABLES)`` / ``_weighted(..., tables=GRID_TABLES)``."""
    qtype: ClassVar[QT]

    @classmethod
    def tables(cls) -> tuple[np.ndarray, ...]:
        from .kernels import grids      # noqa: PLC0415  (NumPy only; built on first use, then memoized)
        return grids.grid_tables(cls.qtype).arrays


@lru_cache(maxsize=None)
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="kimi-quant")




# --- float types: conversions, not block quantizers (ggml_quantize_chunk's F32/F16/BF16 cases) ---

class F32(BlockType, qtype=QT.F32):
    mirrors = "memcpy"

    @classmethod
    def to_float32(cls, data, buf):
        return data.view(np.float32)

    @classmethod
    def quantize_rows(cls, x, imatrix, out):
        out[:] = x.view(np.uint8)


class F16(BlockType, qtype=QT.F16):
    mirrors = "ggml_fp32_to_fp16_row"
    _ref = _rows("legacy", "f16_rows", "u16_2d")

    @classmethod
    def _out_view(cls, out):
        return out.view(np.uint16)

    @classmethod
    def to_float32(cls, data, buf):
        np.copyto(buf, data.view(np.float16))    # exact, as ggml_fp16_to_fp32
        return buf


class BF16(BlockType, qtype=QT.BF16):
    mirrors = "ggml_fp32_to_bf16_row_ref"
    _ref = _rows("legacy", "bf16_rows", "u16_2d")
    widen = _BF16_TO_F32            # to_float32's kernel (the other types widen in numpy)

    @classmethod
    def _out_view(cls, out):
        return out.view(np.uint16)

    @classmethod
    def to_float32(cls, data, buf):
        # gguf-py's BF16 dequantizer makes three temporaries of the whole chunk; BF16 is what most
        # kimi-quantize inputs hold, so widen in place, in the kernel
        cls.widen(data.view(np.uint16), buf.view(np.uint32))
        return buf


# --- 32-element blocks ---

class Q8_0(BlockType, qtype=QT.Q8_0):
    mirrors = "quantize_row_q8_0_ref"  # quantize_q8_0 ignores quant_weights
    scale_offsets = (0,)
    _ref = _rows("legacy", "q8_0_rows")


class Q4_0(BlockType, qtype=QT.Q4_0):
    mirrors = "quantize_row_q4_0_ref"
    mirrors_imatrix = "quantize_row_q4_0_impl"
    scale_offsets = (0,)
    _ref = _rows("legacy", "q4_0_ref_rows")
    _impl = _weighted("legacy", "q4_0_impl_rows")


class Q5_0(BlockType, qtype=QT.Q5_0):
    mirrors = "quantize_row_q5_0_ref"
    mirrors_imatrix = "quantize_row_q5_0_impl"
    scale_offsets = (0,)
    _ref = _rows("legacy", "q5_0_ref_rows")
    _impl = _weighted("legacy", "q5_0_impl_rows")


class Q4_1(BlockType, qtype=QT.Q4_1):
    mirrors = "quantize_row_q4_1_ref"
    mirrors_imatrix = "quantize_row_q4_1_impl"
    scale_offsets = (0, 2)  # d, m
    _ref = _rows("legacy", "q4_1_ref_rows")
    _impl = _weighted("legacy", "q4_1_impl_rows")


class Q5_1(BlockType, qtype=QT.Q5_1):
    mirrors = "quantize_row_q5_1_ref"
    mirrors_imatrix = "quantize_row_q5_1_impl"
    scale_offsets = (0, 2)  # d, m
    _ref = _rows("legacy", "q5_1_ref_rows")
    _impl = _weighted("legacy", "q5_1_impl_rows")


class IQ4_NL(BlockType, qtype=QT.IQ4_NL):
    mirrors = "quantize_row_iq4_nl_impl (32, ntry=7, weights x^2)"
    mirrors_imatrix = "quantize_row_iq4_nl_impl (32, ntry=7)"
    scale_offsets = (0,)
    _ref = _rows("iq4", "iq4_nl_rows")
    _impl = _weighted("iq4", "iq4_nl_impl_rows")


# --- 256-element super-blocks ---

class Q2_K(BlockType, qtype=QT.Q2_K):
    mirrors = "quantize_row_q2_K_ref"
    mirrors_imatrix = "quantize_row_q2_K_impl"
    scale_offsets = (80, 82)  # d, dmin
    _ref = _rows("kquants", "q2_K_ref_rows")
    _impl = _weighted("kquants", "q2_K_impl_rows")


class Q3_K(BlockType, qtype=QT.Q3_K):
    mirrors = "quantize_row_q3_K_ref"
    mirrors_imatrix = "quantize_row_q3_K_impl"
    scale_offsets = (108,)
    _ref = _rows("kquants", "q3_K_ref_rows")
    _impl = _weighted("kquants", "q3_K_impl_rows")


class Q4_K(BlockType, qtype=QT.Q4_K):
    mirrors = "quantize_row_q4_K_ref"
    mirrors_imatrix = "quantize_row_q4_K_impl"
    scale_offsets = (0, 2)
    _ref = _rows("kquants", "q4_K_ref_rows")
    _impl = _weighted("kquants", "q4_K_impl_rows")


class Q5_K(BlockType, qtype=QT.Q5_K):
    mirrors = "quantize_row_q5_K_ref"
    mirrors_imatrix = "quantize_row_q5_K_impl"
    scale_offsets = (0, 2)
    _ref = _rows("kquants", "q5_K_ref_rows")
    _impl = _weighted("kquants", "q5_K_impl_rows")


class Q6_K(BlockType, qtype=QT.Q6_K):
    mirrors = "quantize_row_q6_K_ref"
    mirrors_imatrix = "quantize_row_q6_K_impl"
    scale_offsets = (208,)
    _ref = _rows("kquants", "q6_K_ref_rows")
    _impl = _weighted("kquants", "q6_K_impl_rows")


class IQ4_XS(BlockType, qtype=QT.IQ4_XS):
    mirrors = "quantize_row_iq4_nl_impl (256/32, ntry=7, weights x^2)"
    mirrors_imatrix = "quantize_row_iq4_nl_impl (256/32, ntry=7)"
    scale_offsets = (0,)
    _ref = _rows("iq4", "iq4_xs_rows")
    _impl = _weighted("iq4", "iq4_xs_impl_rows")


# --- IQ2 family: 2-bit grid i-quants (kernels.iq2; the grid tables as the kernels' last arguments) ---
# ggml asserts an imatrix for IQ2_XXS and IQ2_XS (ggml_quantize_requires_imatrix): they have no _ref.

class IQ2_XXS(GridType, BlockType, qtype=QT.IQ2_XXS):
    mirrors = "none: quantize_row_iq2_xxs_impl asserts quant_weights"
    mirrors_imatrix = "quantize_row_iq2_xxs_impl"
    ggml_requires_imatrix = True
    scale_offsets = (0,)
    _impl = _weighted("iq2", "iq2_xxs_impl_rows", GRID_TABLES)


class IQ2_XS(GridType, BlockType, qtype=QT.IQ2_XS):
    refuses_nonfinite = True
    mirrors = "none: quantize_row_iq2_xs_impl asserts quant_weights"
    mirrors_imatrix = "quantize_row_iq2_xs_impl"
    ggml_requires_imatrix = True
    scale_offsets = (0,)
    _impl = _weighted("iq2", "iq2_xs_impl_rows", GRID_TABLES)


class IQ2_S(GridType, BlockType, qtype=QT.IQ2_S):
    refuses_nonfinite = True
    mirrors = "quantize_row_iq2_s_impl (weights 0.25*sigma2 + x^2)"
    mirrors_imatrix = "quantize_row_iq2_s_impl"
    scale_offsets = (0,)
    _ref = _rows("iq2", "iq2_s_rows", tables=GRID_TABLES)
    _impl = _weighted("iq2", "iq2_s_impl_rows", GRID_TABLES)


# --- IQ3 family: 3-bit grid i-quants, imatrix optional (kernels.iq3) ---

class IQ3_XXS(GridType, BlockType, qtype=QT.IQ3_XXS):
    refuses_nonfinite = True
    mirrors = "quantize_row_iq3_xxs_impl (256, weights x^2)"
    mirrors_imatrix = "quantize_row_iq3_xxs_impl (256)"
    scale_offsets = (0,)
    _ref = _rows("iq3", "iq3_xxs_rows", tables=GRID_TABLES)
    _impl = _weighted("iq3", "iq3_xxs_impl_rows", tables=GRID_TABLES)


class IQ3_S(GridType, BlockType, qtype=QT.IQ3_S):
    refuses_nonfinite = True
    mirrors = "quantize_iq3_s -> quantize_row_iq3_s_impl (32, weights x^2)"
    mirrors_imatrix = "quantize_iq3_s -> quantize_row_iq3_s_impl (32)"
    scale_offsets = (0,)
    _ref = _rows("iq3", "iq3_s_rows", tables=GRID_TABLES)
    _impl = _weighted("iq3", "iq3_s_impl_rows", tables=GRID_TABLES)


# --- low-bit types, none of which uses the imatrix (kernels.lowbit) ---

def _dequantizer(name: str) -> Kernel:
    """A kernel ``name(q, out)``: block bytes [n_rows, row bytes] -> float32 [n_rows, n_per_row]."""
    return Kernel(f"{KERNELS}.lowbit", name, "u8_2d", "f32_2d")


class Q1_0(BlockType, qtype=QT.Q1_0):
    mirrors = "quantize_row_q1_0_ref"  # quantize_q1_0 runs it row by row with quant_weights, unused
    scale_offsets = (0,)
    _ref = _rows("lowbit", "q1_0_rows")
    _to_f32 = _dequantizer("q1_0_to_f32_rows")


class Q2_0(BlockType, qtype=_Q2_0):
    mirrors = "quantize_row_q2_0_ref"  # as Q1_0
    scale_offsets = (0,)
    _ref = _rows("lowbit", "q2_0_rows")
    _to_f32 = _dequantizer("q2_0_to_f32_rows")


class TQ1_0(BlockType, qtype=QT.TQ1_0):
    mirrors = "quantize_row_tq1_0_ref"  # quantize_tq1_0 ignores quant_weights
    scale_offsets = (52,)
    _ref = _rows("lowbit", "tq1_0_rows")


class TQ2_0(BlockType, qtype=QT.TQ2_0):
    mirrors = "quantize_row_tq2_0_ref"  # quantize_tq2_0 ignores quant_weights
    scale_offsets = (64,)
    _ref = _rows("lowbit", "tq2_0_rows")


class MXFP4(BlockType, qtype=QT.MXFP4):
    mirrors = "quantize_row_mxfp4_ref"  # quantize_mxfp4 ignores quant_weights
    e8m0_offsets = (0,)
    _ref = _rows("lowbit", "mxfp4_rows")
    _to_f32 = _dequantizer("mxfp4_to_f32_rows")


class NVFP4(BlockType, qtype=QT.NVFP4):
    mirrors = "quantize_row_nvfp4_ref"  # quantize_nvfp4 ignores quant_weights; every UE4M3 byte is valid to ggml
    _ref = _rows("lowbit", "nvfp4_rows")


# --- IQ1 family: IQ1_S, IQ1_M (kernels.iq1; grid kgrid_1bit_2048, IQ1_M reads IQ1_S's tables) ---

class IQ1_S(GridType, BlockType, qtype=QT.IQ1_S):
    mirrors = "quantize_row_iq1_s_impl"     # ggml asserts quant_weights: no row of it without an imatrix
    mirrors_imatrix = "quantize_row_iq1_s_impl"
    ggml_requires_imatrix = True
    scale_offsets = (0,)
    _impl = _weighted("iq1", "iq1_s_impl_rows", tables=GRID_TABLES)

    @classmethod
    def quantize_rows(cls, x, imatrix, out):
        if imatrix is None:
            raise ValueError("IQ1_S: ggml quantizes it only with an imatrix (quantize_row_iq1_s_impl asserts one)")
        super().quantize_rows(x, imatrix, out)


class IQ1_M(GridType, BlockType, qtype=QT.IQ1_M):
    mirrors = "quantize_row_iq1_m_impl (weights x^2)"
    mirrors_imatrix = "quantize_row_iq1_m_impl"
    _ref = _rows("iq1", "iq1_m_rows", tables=GRID_TABLES)
    _impl = _weighted("iq1", "iq1_m_impl_rows", tables=GRID_TABLES)

    @staticmethod
    def split_fp16_scale(blocks: np.ndarray) -> np.ndarray:
        """The fp16 bits of each block's scale (uint16 [n_blocks]): the top nibbles of its 4 uint16 scales
        (bytes 48..55), low nibble first, as ggml_validate_row_data and dequantize_row_iq1_m read it."""
        sc = np.ascontiguousarray(blocks[:, 48:56]).view("<u2")
        return (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0x00F0) | ((sc[:, 2] >> 4) & 0x0F00) | (sc[:, 3] & 0xF000)


def block_type(qtype: QT) -> type[BlockType]:
    try:
        return _REGISTRY[ggml_type(qtype)]
    except (KeyError, ValueError):
        names = ", ".join(t.name for t in _REGISTRY)
        raise ValueError(f"no quantizer for ggml type {getattr(qtype, 'name', qtype)} (have {names})") from None


def supported_types() -> tuple[QT, ...]:
    return tuple(_REGISTRY)


class StoredType:
    """Rows of a ggml type that is read but never written here (Q8_1, Q8_K, the integer types, F64; re-quantized under
    --allow-requantize): widened to float32 by gguf-py's dequantizer, which equals ggml's to_float."""

    def __init__(self, qtype: QT):
        self.qtype = ggml_type(qtype)
        self.block_size, self.type_size = QUANT_SIZES[self.qtype]

    def to_float32(self, data: np.ndarray, buf: np.ndarray) -> np.ndarray:
        return np.asarray(_gguf_quants.dequantize(data, self.qtype), dtype=np.float32)


def source_type(qtype: QT) -> "type[BlockType] | StoredType":
    """What reads rows stored as ``qtype``: its block type, or a StoredType for a type that is only copied."""
    return _REGISTRY[qtype] if qtype in _REGISTRY else StoredType(qtype)


# --- the API: quantize, dequantize, validate ---

class NonFiniteError(ValueError):
    """A NaN or an infinity among the values to quantize to a type whose ggml quantizer aborts on one
    (BlockType.refuses_nonfinite): ``row`` and ``column`` of the first, counted in quantize's input."""

    def __init__(self, row: int, column: int, value: float, count: int):
        self.what = "nan" if np.isnan(value) else ("-inf" if value < 0 else "inf")
        self.row, self.column, self.count = row, column, count
        super().__init__(f"row {row}, column {column} is {self.what}{self.more}")

    @property
    def more(self) -> str:
        return f" (and {self.count - 1:,} more non-finite values near it)" if self.count > 1 else ""

    @classmethod
    def first(cls, x: np.ndarray, first_row: int, count: int) -> "NonFiniteError":
        r, c = np.argwhere(~np.isfinite(x))[0]
        return cls(first_row + int(r), int(c), float(x[r, c]), count)


class InvalidBlockError(ValueError):
    """Data ggml_validate_row_data rejects: ``block`` is the index of the first bad block (or element)."""

    def __init__(self, qtype: QT, block: int, what: str):
        super().__init__(f"{qtype.name}: found {what} value at block {block}")
        self.qtype, self.block, self.what = qtype, block, what


def row_size(qtype: QT, n_per_row: int) -> int:
    """Bytes of one quantized row; ValueError if n_per_row is not a multiple of the type's block size."""
    bt = block_type(qtype)
    if n_per_row <= 0 or n_per_row % bt.block_size:
        raise ValueError(f"{bt.qtype.name}: row length {n_per_row} is not a positive multiple of {bt.block_size}")
    return bt.row_size(n_per_row)


CACHE_VALUES = 256 << 10      # values a thread widens, then quantizes, at a time (1 MiB of float32): at 32K a
# step, the two kernel calls of each (~8 us together through ctypes) were half of Q4_0's time


def quantize(values: np.ndarray, qtype: QT, imatrix: np.ndarray | None = None, *,
             threads: int | None = None, source: QT = QT.F32) -> np.ndarray:
    """[n_rows, n_per_row] rows -> uint8 [n_rows, row_size]: ggml_quantize_chunk's bytes for these rows.

    ``values``: float32 values, or rows as stored in a GGUF of type ``source`` (block bytes or values); each
    is converted to float32 exactly as ggml's to_float does, CACHE_VALUES at a time on the thread that then
    quantizes them, so the float32 copy of a chunk is never made whole.
    ``imatrix``: float32 [n_per_row] importance weights (one per column), or None. As in ggml it selects the
    ``_impl`` quantizer of the types that have one and is ignored by Q8_0 and the float types.
    ``threads``: rows are quantized on this many threads (default: the CPUs available); the bytes do not
    depend on it. Safe to call from several threads at once."""
    bt, src = block_type(qtype), source_type(source)
    rows = _stored_rows(values, src)
    n_per_row = rows.shape[1] // src.type_size * src.block_size if rows.dtype == np.uint8 else rows.shape[1]
    row_size(bt.qtype, n_per_row)
    if imatrix is None and bt.ggml_requires_imatrix:
        raise ValueError(f"{bt.qtype.name}: ggml quantizes this type only with an imatrix")
    qw = None
    if imatrix is not None and bt.uses_imatrix():
        qw = np.ascontiguousarray(imatrix, dtype=np.float32)
        if qw.shape != (n_per_row,):
            raise ValueError(f"{bt.qtype.name}: imatrix has shape {qw.shape}, rows have {n_per_row} columns")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    out = np.empty((rows.shape[0], bt.row_size(n_per_row)), np.uint8)

    def run(a: int, b: int) -> None:
        step = max(1, CACHE_VALUES // n_per_row)
        buf = np.empty((min(step, b - a), n_per_row), np.float32)
        for r in range(a, b, step):
            e = min(r + step, b)
            x = np.ascontiguousarray(src.to_float32(rows[r:e], buf[:e - r]), dtype=np.float32)
            # one pass over a piece already in cache, against a grid kernel hundreds of times its cost
            if bt.refuses_nonfinite and (nonfinite := _count_nonfinite(x)):
                raise NonFiniteError.first(x, r, nonfinite)
            bt.quantize_rows(x, qw, out[r:e])

    _on_threads(run, rows.shape[0], threads or default_threads(), max(1, CACHE_VALUES // n_per_row))
    return out


def kernels_for(pairs: Iterable[tuple[QT, QT, bool]]) -> list[Kernel]:
    """The kernels that (source, target, with imatrix) conversions run: the source's widening (BF16) and the
    target's quantizer (its _impl with an imatrix, where it has one)."""
    kernels: dict[int, Kernel] = {}
    for source, target, weighted in pairs:
        check = _COUNT_NONFINITE if block_type(target).refuses_nonfinite else None
        for k in (getattr(source_type(source), "widen", None), check, block_type(target).kernel(weighted)):
            if k is not None:
                kernels[id(k)] = k
    return list(kernels.values())


def load_kernels(pairs: Iterable[tuple[QT, QT, bool]]) -> None:
    """Load the kernels of these (source, target, with imatrix) conversions now (numba's import and cache: ~0.2 s,
    or a compile on a cache miss) and build the grid types' tables (0.2 s for all six), then freeze the objects made so far:
    the cyclic collector would otherwise scan them at every full collection and again at exit."""
    pairs = list(pairs)
    for k in kernels_for(pairs):
        k.function()
    for _, target, _ in pairs:
        block_type(target).tables()         # a grid type's tables: built once, before the threads need them
    gc.freeze()


def _stored_rows(values: np.ndarray, src: "type[BlockType] | StoredType") -> np.ndarray:
    """2-D C-contiguous rows: float32 values for F32, else the stored bytes (uint8) or values (f16/bf16 bits)."""
    if src.qtype == QT.F32:
        rows = np.ascontiguousarray(values)
        rows = rows.view(np.float32) if rows.dtype == np.uint8 else rows.astype(np.float32, copy=False)
    else:
        rows = np.ascontiguousarray(values)
        if rows.dtype == np.uint8 and rows.ndim == 2 and rows.shape[1] % src.type_size:
            raise ValueError(f"{src.qtype.name}: {rows.shape[1]} bytes per row is not a multiple of "
                             f"{src.type_size}")
    if rows.ndim != 2:
        raise ValueError(f"values must be 2-D [n_rows, n_per_row], got shape {rows.shape}")
    return rows


def _on_threads(run: Callable[[int, int], None], n_rows: int, threads: int, piece_rows: int = 0) -> None:
    """run(a, b) over the rows on ``threads`` threads at once (the kernels drop the GIL): this thread and
    threads - 1 of the pool. With ``piece_rows``, each thread takes the next piece of that many rows as it
    finishes one, as llama-quantize's workers take chunks from a shared counter, so that a thread the machine
    slows down (another program on its core) does less of the work rather than keeping the others waiting;
    without, each takes one contiguous range. (Waking a thread costs tens of microseconds on a VM, and a chunk
    of 1M values takes 1-2 ms a core: this thread would otherwise only wait.)"""
    threads = max(1, min(threads, n_rows))
    if piece_rows and n_rows > piece_rows * threads:
        starts = iter(range(0, n_rows, piece_rows))     # next() on it is atomic under the GIL

        def take_pieces() -> None:
            for a in starts:
                run(a, min(a + piece_rows, n_rows))
        jobs = [take_pieces] * threads
    else:
        bounds = np.linspace(0, n_rows, threads + 1).astype(int).tolist()
        jobs = [partial(run, a, b) for a, b in zip(bounds, bounds[1:])]
    others = [_pool(threads - 1).submit(job) for job in jobs[1:]]
    try:
        jobs[0]()
    finally:
        errors = [f.exception() for f in others]      # every range is done before this returns
    for e in errors:
        if e is not None:
            raise e


def dequantize(data: np.ndarray, qtype: QT, *, threads: int | None = None) -> np.ndarray:
    """uint8 [n_rows, row_size] (or stored values) -> float32 [n_rows, n_per_row], equal to ggml's to_float,
    on ``threads`` threads (default: the CPUs available). A new array, never a view of ``data``."""
    bt = source_type(qtype)
    rows = _stored_rows(data, bt)
    n_per_row = rows.shape[1] // bt.type_size * bt.block_size if rows.dtype == np.uint8 else rows.shape[1]
    out = np.empty((rows.shape[0], n_per_row), np.float32)

    def run(a: int, b: int) -> None:
        x = bt.to_float32(rows[a:b], out[a:b])
        if x is not out[a:b] and not np.shares_memory(x, out[a:b]):
            out[a:b] = x
    _on_threads(run, rows.shape[0], threads or default_threads())
    return out


def validate_blocks(data: np.ndarray, qtype: QT) -> None:
    """ggml_validate_row_data: raise InvalidBlockError at the first NaN/Inf fp16 scale (d, then dmin, per
    block) or E8M0 scale of 0xFF (MXFP4), or for F16/BF16/F32 data at the first NaN/Inf value (BF16: NaNs
    before infinities, as ggml). NVFP4's UE4M3 scales are all valid to ggml."""
    bt = block_type(qtype)
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
    if raw.size % bt.type_size:
        raise ValueError(f"{bt.qtype.name}: {raw.size} bytes is not a multiple of the block size {bt.type_size}")
    if bt.qtype == QT.F32:
        bits = raw.view(np.uint32)
        _raise_first(bt.qtype, (bits & 0x7F800000) == 0x7F800000, (bits & 0x007FFFFF) != 0)
    elif bt.qtype == QT.BF16:
        mag = raw.view(np.uint16) & 0x7FFF
        nan = mag > 0x7F80
        if nan.any():
            raise InvalidBlockError(bt.qtype, int(np.argmax(nan)), "nan")
        inf = mag == 0x7F80
        if inf.any():
            raise InvalidBlockError(bt.qtype, int(np.argmax(inf)), "inf")
    elif bt.qtype == QT.F16:
        h = raw.view(np.uint16)
        _raise_first(bt.qtype, (h & 0x7C00) == 0x7C00, (h & 0x03FF) != 0)
    else:
        blocks = raw.reshape(-1, bt.type_size)
        for o in bt.e8m0_offsets:                   # (no type has both E8M0 and fp16 scales)
            invalid = blocks[:, o] == 0xFF
            if invalid.any():
                raise InvalidBlockError(bt.qtype, int(np.argmax(invalid)), "invalid e")
        split_scale = getattr(bt, "split_fp16_scale", None)
        if split_scale is not None:                 # IQ1_M: its fp16 scale spread over nibbles
            h = split_scale(blocks)
            _raise_first(bt.qtype, (h & 0x7C00) == 0x7C00, (h & 0x03FF) != 0)
        # an fp16 is Inf or NaN when its exponent bits (0x7C of its high, second byte) are all set; one byte
        # read per scale, and the [n_blocks, n_scales] table (in the order ggml checks them: d before dmin)
        # made only when one is
        if not any(((blocks[:, o + 1] & 0x7C) == 0x7C).any() for o in bt.scale_offsets):
            return
        special = np.stack([(blocks[:, o + 1] & 0x7C) == 0x7C for o in bt.scale_offsets], axis=1)
        if special.any():
            block, k = divmod(int(np.argmax(special.reshape(-1))), len(bt.scale_offsets))
            o = bt.scale_offsets[k]
            nan = bool(blocks[block, o] or blocks[block, o + 1] & 0x03)     # mantissa bits
            raise InvalidBlockError(bt.qtype, block, "nan" if nan else "inf")


def _raise_first(qtype: QT, special: np.ndarray, mantissa: np.ndarray) -> None:
    if special.any():
        i = int(np.argmax(special))
        raise InvalidBlockError(qtype, i, "nan" if mantissa[i] else "inf")
