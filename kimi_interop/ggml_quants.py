"""ggml's own quantizers, called in-process through ctypes, as the reference for ``kimi_convert.quant``.

llama-cpp-python 0.3.36 ships ``llama_cpp/lib/libggml-base.so``, built from the same Oct-2026 ggml as the
``llama_model_quantize`` it wraps, and that library exports ``ggml_quantize_chunk`` (the entry point
llama-quantize calls per row chunk), the ``dequantize_row_*`` functions and ``ggml_validate_row_data``.
The library is loaded without importing the ``llama_cpp`` Python package. ctypes drops the GIL around
each foreign call, so ``threads=2`` really runs two chunks at once.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT

from ._common import INSTALL_HINT, InteropUnavailable

LLAMA_CPP_PYTHON_VERSION = "0.3.36"

_f32p = ctypes.POINTER(ctypes.c_float)
_init_lock = threading.Lock()


def ggml_base_path() -> Path:
    """Where llama-cpp-python's libggml-base.so is; InteropUnavailable if it is not installed (or another version)."""
    try:
        version = importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        raise InteropUnavailable(
            f"llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} is not installed: {INSTALL_HINT}") from None
    if version != LLAMA_CPP_PYTHON_VERSION:
        raise InteropUnavailable(f"llama-cpp-python is {version}, need {LLAMA_CPP_PYTHON_VERSION}: {INSTALL_HINT}")
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise InteropUnavailable(f"llama_cpp package not found: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / "lib" / "libggml-base.so"
    if not path.is_file():
        raise InteropUnavailable(f"{path} is missing: {INSTALL_HINT}")
    return path


@lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    path = ggml_base_path()
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise InteropUnavailable(f"cannot load {path}: {e}") from e
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, _f32p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_int64, _f32p]
    lib.ggml_quantize_init.restype = None
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.ggml_validate_row_data.restype = ctypes.c_bool
    lib.ggml_validate_row_data.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    return lib


def _ptr(a: np.ndarray | None):
    return None if a is None else a.ctypes.data_as(_f32p)


def ggml_row_size(qtype: QT, n_per_row: int) -> int:
    return int(_lib().ggml_row_size(int(qtype), n_per_row))


def ggml_quantize_requires_imatrix(qtype: QT) -> bool:
    """``ggml_quantize_requires_imatrix``: the types ggml refuses to quantize without one (IQ2_XXS, IQ2_XS, IQ1_S)."""
    return bool(_lib().ggml_quantize_requires_imatrix(int(qtype)))


def ggml_quantize(values: np.ndarray, qtype: QT, imatrix: np.ndarray | None = None, *, threads: int = 1) -> np.ndarray:
    """``ggml_quantize_chunk(qtype, values, dst, ...)`` over all rows: uint8 [n_rows, row bytes].

    With ``threads`` > 1 the rows are split into that many chunks (as llama-quantize does), each one
    ``ggml_quantize_chunk`` call with its own ``start``, run in parallel Python threads."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if values.ndim != 2:
        raise ValueError(f"values must be 2-D [n_rows, n_per_row], got shape {values.shape}")
    n_rows, n_per_row = values.shape
    if imatrix is not None:
        imatrix = np.ascontiguousarray(imatrix, dtype=np.float32)
        if imatrix.shape != (n_per_row,):
            raise ValueError(f"imatrix shape {imatrix.shape} does not match n_per_row {n_per_row}")
    lib = _lib()
    with _init_lock:  # ggml_quantize_init fills the IQ grids once; not thread-safe before that
        lib.ggml_quantize_init(int(qtype))
    row_size = ggml_row_size(qtype, n_per_row)
    out = np.empty((n_rows, row_size), np.uint8)
    bounds = np.linspace(0, n_rows, max(1, min(threads, n_rows)) + 1).astype(np.int64)

    def run(r0: int, r1: int) -> None:
        written = lib.ggml_quantize_chunk(int(qtype), _ptr(values), out.ctypes.data, r0 * n_per_row, r1 - r0,
                                          n_per_row, _ptr(imatrix))
        assert written == (r1 - r0) * row_size, (written, r1 - r0, row_size)

    chunks = [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    if len(chunks) <= 1:
        for a, b in chunks:
            run(a, b)
    else:
        with ThreadPoolExecutor(len(chunks)) as pool:
            list(pool.map(lambda c: run(*c), chunks))
    return out


def _dequantize_fn(qtype: QT):
    lib = _lib()
    if qtype == QT.F16:
        fn = lib.ggml_fp16_to_fp32_row
    elif qtype == QT.BF16:
        fn = lib.ggml_bf16_to_fp32_row
    else:
        name = qtype.name.lower().replace("_k", "_K")  # ggml spells them dequantize_row_q4_K, ..._iq4_xs
        fn = getattr(lib, f"dequantize_row_{name}")
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, _f32p, ctypes.c_int64]
    return fn


def ggml_dequantize(data: np.ndarray, qtype: QT, n_per_row: int) -> np.ndarray:
    """ggml's ``dequantize_row_<type>`` (or fp16/bf16 row conversion) of uint8 [n_rows, row bytes]: float32."""
    data = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, ggml_row_size(qtype, n_per_row))
    out = np.empty((data.shape[0], n_per_row), np.float32)
    if qtype == QT.F32:
        out[...] = data.view(np.float32)
        return out
    _dequantize_fn(qtype)(data.ctypes.data, _ptr(out), out.size)
    return out


def ggml_validate_row_data(data: np.ndarray, qtype: QT) -> bool:
    """``ggml_validate_row_data(type, data, nbytes)``: False on NaN/Inf scales (ggml prints the reason)."""
    data = np.ascontiguousarray(data, dtype=np.uint8)
    return bool(_lib().ggml_validate_row_data(int(qtype), data.ctypes.data, data.nbytes))

