"""What every weight matmul of llama-cpp-python's llama.cpp receives, observed with ggml's eval callback.

`llama_cpp_matmul_inputs(path, ids)` runs one forward pass over ``ids`` with the settings of
:func:`kimi_interop.llama_cpp.llama_cpp_logits` and records, for every GGML_OP_MUL_MAT and
GGML_OP_MUL_MAT_ID node, its f32 activation (src1, before ggml converts it to the weight's vec_dot type), the
expert ids of a MUL_MAT_ID, and the logits of the pass. The interop tests compare these with the runtime's own
matmul inputs (`Runtime.matmul_trace`): the first position at which the two round an input differently (a
value on the other side of a bf16/Q8_0 rounding boundary) or route a token to other experts is observed, not
guessed (docs/verification.md §8).

The callback asks for every matmul node, so the scheduler evaluates the graph one matmul at a time; the nodes
and their arithmetic are the same (the test checks that the logits equal llama_cpp_logits' bit for bit).
The load log also says which weights llama.cpp repacked into its CPU_REPACK buffer (other kernels run on them,
kimi_convert/runtime/ggml_cpu.py `is_repacked`): `LlamaCppTrace.repacked`.
"""
from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from . import llama_cpp as _llama
from ._common import InteropError, LlamaLoadError

GGML_MAX_DIMS, GGML_MAX_SRC, GGML_MAX_OP_PARAMS, GGML_MAX_NAME = 4, 10, 64, 64
GGML_TYPE_F32, GGML_TYPE_I32 = 0, 26


class GgmlTensor(ctypes.Structure):
    """struct ggml_tensor of the ggml in llama-cpp-python 0.3.36 (ggml/include/ggml.h)."""


GgmlTensor._fields_ = [
    ("type", ctypes.c_int), ("buffer", ctypes.c_void_p),
    ("ne", ctypes.c_int64 * GGML_MAX_DIMS), ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
    ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)), ("flags", ctypes.c_int32),
    ("src", ctypes.POINTER(GgmlTensor) * GGML_MAX_SRC), ("view_src", ctypes.POINTER(GgmlTensor)),
    ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * GGML_MAX_NAME),
    ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


@dataclass
class MatmulInput:
    """One matmul node: x is src1 in numpy order ([ne3, ne2, ne1, ne0]); ids [T, n_used] for MUL_MAT_ID."""
    x: np.ndarray
    ids: np.ndarray | None = None


@dataclass
class LlamaCppTrace:
    inputs: dict[str, list[MatmulInput]]    # weight tensor name -> its matmul nodes, in graph order
    logits: np.ndarray                      # [T, n_vocab]
    repacked: set[str] = field(default_factory=set)   # weights in the CPU_REPACK buffer (repack.cpp's debug log)


_REPACK_LOG = re.compile(r"repack tensor (\S+) with")


def _read(t: GgmlTensor, dtype) -> np.ndarray:
    """A copy of a host tensor's data, honouring its strides (views, permutes)."""
    ne, nb = list(t.ne), list(t.nb)
    size = sum((n - 1) * s for n, s in zip(ne, nb)) + np.dtype(dtype).itemsize
    buf = (ctypes.c_char * size).from_address(t.data)
    return np.ndarray(shape=ne[::-1], dtype=dtype, buffer=buf, strides=nb[::-1]).copy()


def _op_ids() -> tuple[int, int]:
    lib = ctypes.CDLL(str(Path(_llama._import_llama_cpp().__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_op_name.restype = ctypes.c_char_p
    names = {}
    for i in range(256):
        name = lib.ggml_op_name(i)
        if name is None:
            break
        names[name.decode()] = i
    return names["MUL_MAT"], names["MUL_MAT_ID"]


def llama_cpp_matmul_inputs(gguf_path, token_ids: Sequence[int], n_ctx: int = 256) -> LlamaCppTrace:
    """Run ``token_ids`` through llama.cpp once and record every weight matmul's f32 input (see module doc)."""
    llama_cpp = _llama._import_llama_cpp()
    ids = [int(t) for t in token_ids]
    if not ids or len(ids) > n_ctx:
        raise ValueError(f"need 1..{n_ctx} token ids, got {len(ids)}")
    mul_mat, mul_mat_id = _op_ids()
    inputs: dict[str, list[MatmulInput]] = {}
    errors: list[str] = []

    @llama_cpp.ggml_backend_sched_eval_callback
    def observe(tensor_p, ask, user_data):  # noqa: ARG001
        try:
            t = ctypes.cast(tensor_p, ctypes.POINTER(GgmlTensor)).contents
            if t.op not in (mul_mat, mul_mat_id):
                return not ask          # ask: not wanted; else: keep going
            if ask:
                return True
            weight, x = t.src[0].contents, t.src[1].contents
            if x.type == GGML_TYPE_F32:
                rec = MatmulInput(_read(x, np.float32))
                if t.op == mul_mat_id:
                    rec.ids = _read(t.src[2].contents, np.int32).reshape(-1, t.src[2].contents.ne[0])
                inputs.setdefault(weight.name.decode(), []).append(rec)
        except Exception as e:  # noqa: BLE001 - never raise into C
            errors.append(repr(e))
        return True

    path = str(Path(gguf_path))
    with _llama._captured_llama_log() as lines:
        model = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
        if not model:
            raise LlamaLoadError(path, _llama._error_text(lines))
        try:
            cp = llama_cpp.llama_context_default_params()
            cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_ctx, min(n_ctx, 512)
            cp.n_threads = cp.n_threads_batch = 2
            cp.type_k = cp.type_v = _llama.GGML_TYPE_F32
            cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
            cp.cb_eval, cp.cb_eval_user_data = observe, None
            ctx = llama_cpp.llama_init_from_model(model, cp)
            if not ctx:
                raise LlamaLoadError(path, _llama._error_text(lines))
            try:
                logits = _decode_all(llama_cpp, ctx, model, ids)
            finally:
                llama_cpp.llama_free(ctx)
        finally:
            llama_cpp.llama_model_free(model)
        if errors:
            raise InteropError(f"reading llama.cpp's matmul inputs failed: {errors[0]}")
    repacked = {m.group(1) for _, text in lines for m in _REPACK_LOG.finditer(text)}
    return LlamaCppTrace(inputs, logits, repacked)


def _decode_all(llama_cpp, ctx, model, ids: list[int]) -> np.ndarray:
    """One llama_decode of ids at positions 0.., with an output row for every position."""
    batch = llama_cpp.llama_batch_init(len(ids), 0, 1)
    try:
        for i, tok in enumerate(ids):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, i, 1, 1
            batch.seq_id[i][0] = 0
        batch.n_tokens = len(ids)
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise InteropError("llama_decode failed")
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        return np.array([np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), (n_vocab,))
                         for i in range(len(ids))], dtype=np.float32)
    finally:
        llama_cpp.llama_batch_free(batch)
