"""llama-cpp-python's own ggml CPU kernels, called through ctypes, as the reference for ``kimi_convert.runtime.ggml_cpu``.

``llama_cpp/lib/libggml-cpu.so`` (the pinned x86-64-v3 build, docs/verification.md §8.3) exports the type traits
(``ggml_get_type_traits_cpu``: each type's vec_dot and its activation quantizer), the repacked gemv/gemm kernels
with their 4-row activation quantizers, the ``repack`` functions, and ``ggml_graph_compute_with_ctx``. So every
matmul path the runtime emulates can be run here on the same inputs:

* :func:`vec_dot` -- one row: the type's from_float, then its vec_dot (the path of a single token, of
  ``mul_mat_id`` rows, and of batches below the tinyBLAS / tiled thresholds);
* :func:`mul_mat` -- ``ggml_mul_mat`` in a CPU graph, as ``ggml_compute_forward_mul_mat`` dispatches it (tiled
  K-quants, tinyBLAS, vec_dot) for weights in ordinary memory;
* :func:`repacked_mul_mat` -- a weight repacked as in the CPU_REPACK buffer and multiplied by the exported gemm (rows
  in groups of 4) and gemv (the rest, or every row when ``gemv_only``), as ``forward_mul_mat(_id)`` does.

The libraries are loaded without importing the ``llama_cpp`` Python package.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

import numpy as np
from gguf import GGMLQuantizationType as QT

from .ggml_quants import _lib as _base_lib
from .ggml_quants import ggml_base_path, ggml_row_size

_vp, _f32p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_float)
FROM_FLOAT = ctypes.CFUNCTYPE(None, _vp, _vp, ctypes.c_int64)
VEC_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, _f32p, ctypes.c_size_t, _vp, ctypes.c_size_t, _vp,
                           ctypes.c_size_t, ctypes.c_int)

# the repacked layouts the x86 build picks (repack.cpp ggml_repack_get_optimal_repack_type), as C++ template names
_REPACK = {QT.Q4_0: ("10block_q4_0", "q4_0_8x8_q8_0", "q8_0_4x8", QT.Q8_0),
           QT.IQ4_NL: ("12block_iq4_nl", "iq4_nl_8x8_q8_0", "q8_0_4x8", QT.Q8_0),
           QT.MXFP4: ("11block_mxfp4", "mxfp4_8x8_q8_0", "q8_0_4x8", QT.Q8_0),
           QT.Q4_K: ("10block_q4_K", "q4_K_8x8_q8_K", "q8_K_4x8", QT.Q8_K)}


class _TypeTraitsCpu(ctypes.Structure):            # struct ggml_type_traits_cpu (ggml-cpu.h)
    _fields_ = [("from_float", FROM_FLOAT), ("vec_dot", VEC_DOT), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


class _InitParams(ctypes.Structure):               # struct ggml_init_params (ggml.h)
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", _vp), ("no_alloc", ctypes.c_bool)]


@lru_cache(maxsize=1)
def _cpu_lib() -> ctypes.CDLL:
    base = _base_lib()
    lib = ctypes.CDLL(str(ggml_base_path().with_name("libggml-cpu.so")))
    lib.ggml_cpu_init.restype = None
    lib.ggml_cpu_init()
    lib.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_TypeTraitsCpu)
    lib.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    lib.ggml_graph_compute_with_ctx.argtypes = [_vp, _vp, ctypes.c_int]
    base.ggml_init.restype = _vp
    base.ggml_init.argtypes = [_InitParams]
    base.ggml_free.argtypes = [_vp]
    base.ggml_new_tensor_2d.restype = _vp
    base.ggml_new_tensor_2d.argtypes = [_vp, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    base.ggml_mul_mat.restype = _vp
    base.ggml_mul_mat.argtypes = [_vp, _vp, _vp]
    base.ggml_new_graph.restype = _vp
    base.ggml_new_graph.argtypes = [_vp]
    base.ggml_build_forward_expand.argtypes = [_vp, _vp]
    base.ggml_get_data.restype = _vp
    base.ggml_get_data.argtypes = [_vp]
    return lib


def _traits(qtype) -> _TypeTraitsCpu:
    return _cpu_lib().ggml_get_type_traits_cpu(int(qtype)).contents


def _f32(a) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32)


def quantize_activation(x: np.ndarray, weight_type: QT) -> np.ndarray:
    """The bytes ggml's from_float writes for x [K] against a weight of this type (its vec_dot type)."""
    x = _f32(x)
    dot_type = _traits(weight_type).vec_dot_type
    out = np.zeros(ggml_row_size(QT(dot_type), x.size), np.uint8)
    _traits(dot_type).from_float(x.ctypes.data, out.ctypes.data, x.size)
    return out


def vec_dot(raw_row: np.ndarray, weight_type: QT, x: np.ndarray) -> float:
    """ggml's vec_dot of one weight row (its raw bytes) with the activation x [K], converted as ggml does."""
    raw_row = np.ascontiguousarray(raw_row, np.uint8)
    xq = quantize_activation(x, weight_type)
    s = ctypes.c_float()
    _traits(weight_type).vec_dot(int(np.size(x)), ctypes.byref(s), 0, raw_row.ctypes.data, 0, xq.ctypes.data, 0, 1)
    return float(np.float32(s.value))


def mul_mat(raw: np.ndarray, weight_type: QT, x: np.ndarray, n_threads: int = 2) -> np.ndarray:
    """ggml_mul_mat(W, x) -> [T, M] computed by the CPU backend, W given as raw rows uint8 [M, row bytes]."""
    lib, base = _cpu_lib(), _base_lib()
    x = _f32(np.atleast_2d(x))
    raw = np.ascontiguousarray(raw, np.uint8)
    (n_tok, k), n_rows = x.shape, raw.shape[0]
    mem = raw.nbytes + x.nbytes * 2 + 4 * n_tok * n_rows + (64 << 20)
    ctx = base.ggml_init(_InitParams(mem, None, False))
    try:
        w = base.ggml_new_tensor_2d(ctx, int(weight_type), k, n_rows)
        a = base.ggml_new_tensor_2d(ctx, int(QT.F32), k, n_tok)
        ctypes.memmove(base.ggml_get_data(w), raw.ctypes.data, raw.nbytes)
        ctypes.memmove(base.ggml_get_data(a), x.ctypes.data, x.nbytes)
        out = base.ggml_mul_mat(ctx, w, a)
        graph = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(graph, out)
        if lib.ggml_graph_compute_with_ctx(ctx, graph, n_threads) != 0:
            raise RuntimeError("ggml_graph_compute_with_ctx failed")
        return np.ctypeslib.as_array(ctypes.cast(base.ggml_get_data(out), _f32p), (n_tok, n_rows)).copy()
    finally:
        base.ggml_free(ctx)


def repacked_mul_mat(raw: np.ndarray, weight_type: QT, x: np.ndarray, *, gemv_only: bool = False) -> np.ndarray:
    """[T, M]: W repacked 8x8 (as llama.cpp's CPU_REPACK buffer holds it) times x, by ggml's gemm for the first
    T - T % 4 rows (4-row quantizer) and gemv for the others -- or gemv for every row (``gemv_only``, mul_mat_id)."""
    lib, base = _cpu_lib(), _base_lib()
    block, kernel, mat, dot_type = _REPACK[weight_type]
    x = _f32(np.atleast_2d(x))
    raw = np.ascontiguousarray(raw, np.uint8)
    (n_tok, k), n_rows = x.shape, raw.shape[0]
    ctx = base.ggml_init(_InitParams(raw.nbytes + (1 << 20), None, False))
    try:
        w = base.ggml_new_tensor_2d(ctx, int(weight_type), k, n_rows)
        repack = getattr(lib, f"_ZN4ggml3cpu6repack6repackI{block}Ll8ELl8EEEiP11ggml_tensorPKvm")
        repack.argtypes, repack.restype = [_vp, _vp, ctypes.c_size_t], ctypes.c_int
        if repack(w, raw.ctypes.data, raw.nbytes) != 0:
            raise RuntimeError(f"repack of {weight_type.name} failed")
        gemm, gemv = getattr(lib, f"ggml_gemm_{kernel}"), getattr(lib, f"ggml_gemv_{kernel}")
        quantize_mat = getattr(lib, f"ggml_quantize_mat_{mat}")
        for fn in (gemm, gemv):
            fn.argtypes, fn.restype = [ctypes.c_int, _f32p, ctypes.c_size_t, _vp, _vp, ctypes.c_int, ctypes.c_int], None
        quantize_mat.argtypes, quantize_mat.restype = [_vp, _vp, ctypes.c_int64], None
        row_bytes = ggml_row_size(dot_type, k)
        out = np.zeros((n_tok, n_rows), np.float32)
        n_gemm = 0 if gemv_only or n_tok < 4 else n_tok - n_tok % 4
        if n_gemm:
            xq = np.zeros(n_gemm * row_bytes, np.uint8)
            for r in range(0, n_gemm, 4):
                quantize_mat(x[r:r + 4].ctypes.data, xq[r * row_bytes:].ctypes.data, k)
            gemm(k, out.ctypes.data_as(_f32p), n_rows, base.ggml_get_data(w), xq.ctypes.data, n_gemm, n_rows)
        for r in range(n_gemm, n_tok):
            xq = quantize_activation(x[r], weight_type)
            row = out[r]
            gemv(k, row.ctypes.data_as(_f32p), n_rows, base.ggml_get_data(w), xq.ctypes.data, 1, n_rows)
        return out
    finally:
        base.ggml_free(ctx)
