"""Logits from native llama.cpp through llama-cpp-python 0.3.36 (the Oct-2026 llama.cpp: knows ``kimi-k3``, not
``kimi-k31``). Installed (compiled, ~3.5 min on 2 cores) by ``.ci/install-interop.sh``.

Settings for tight comparisons: F32 KV cache (``type_k=type_v=0``), flash attention off, an output row for every
position (``logits_all=True``), 2 threads (results are bit-identical for 1 or 2 threads and from run to run).

By default the model runs in this process. A malformed file can make llama.cpp abort (GGML_ASSERT) instead of
failing cleanly, which would kill the caller: pass ``isolated=True`` to run in a child Python process instead
(``llama_cpp_load_error`` does so by default).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ._common import INSTALL_HINT, REPO_ROOT, InteropError, InteropUnavailable, LlamaLoadError

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
GGML_TYPE_F32 = 0

_log_lock = threading.Lock()


def _import_llama_cpp():
    try:
        import llama_cpp  # noqa: PLC0415
    except ImportError as e:
        raise InteropUnavailable(f"llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} is not installed ({e}): {INSTALL_HINT}") from e
    version = getattr(llama_cpp, "__version__", None)
    if version != LLAMA_CPP_PYTHON_VERSION:
        raise InteropUnavailable(f"llama-cpp-python is {version}, need {LLAMA_CPP_PYTHON_VERSION}: {INSTALL_HINT}")
    return llama_cpp


@contextlib.contextmanager
def _captured_llama_log():
    """Route llama.cpp's (and ggml's) log into a list for the duration; restores llama-cpp-python's callback."""
    llama_cpp = _import_llama_cpp()
    from llama_cpp import _logger  # noqa: PLC0415

    lines: list[tuple[int, str]] = []

    @llama_cpp.llama_log_callback
    def _cb(level, text, user_data):  # noqa: ARG001
        try:
            lines.append((int(level), text.decode("utf-8", "replace")))
        except Exception:  # noqa: BLE001 - never raise into C
            pass

    with _log_lock:
        llama_cpp.llama_log_set(_cb, ctypes.c_void_p(0))
        try:
            yield lines
        finally:
            llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


def _error_text(lines: list[tuple[int, str]]) -> str:
    """The error/warning lines of a captured log.

    Levels are ggml.h's of this build: 1 DEBUG, 2 INFO, 3 WARN, 4 ERROR, 5 continuation of the previous line.
    (llama-cpp-python 0.3.36's own _logger still uses the older numbering, so with verbose=False it hides ERRORs.)"""
    out, keep = [], False
    for level, text in lines:
        if level in (3, 4):
            keep = True
        elif level != 5:
            keep = False
        if keep:
            out.append(text)
    text = "".join(out).strip()
    return text or "".join(t for _, t in lines[-30:]).strip() or "(llama.cpp logged no reason)"


def _open(gguf_path, n_ctx: int, kv_overrides: Mapping[str, object] | None, lines):
    llama_cpp = _import_llama_cpp()
    path = str(Path(gguf_path))
    if not Path(path).is_file():
        raise FileNotFoundError(path)
    try:
        return llama_cpp.Llama(
            model_path=path,
            n_ctx=n_ctx,
            n_batch=n_ctx,
            n_ubatch=min(n_ctx, 512),
            logits_all=True,
            type_k=GGML_TYPE_F32,
            type_v=GGML_TYPE_F32,
            flash_attn=False,
            n_threads=2,
            n_threads_batch=2,
            n_gpu_layers=0,
            kv_overrides=dict(kv_overrides) if kv_overrides else None,
            verbose=False,
        )
    except ValueError as e:  # "Failed to load model from file" / "Failed to create llama_context"
        raise LlamaLoadError(path, f"{e}\n{_error_text(lines)}") from None


def llama_cpp_logits(
    gguf_path,
    token_ids: Sequence[int],
    n_ctx: int = 256,
    *,
    kv_overrides: Mapping[str, object] | None = None,
    isolated: bool = False,
) -> np.ndarray:
    """Logits for every position of ``token_ids`` (one forward pass): float32 array [n_tokens, n_vocab].

    Row i is llama.cpp's output after seeing ``token_ids[:i+1]``. ``kv_overrides`` are llama.cpp KV overrides
    (python bool/int/float/str values), e.g. ``{"kimi-k3.expert_used_count": 2}``. Raises LlamaLoadError (with
    llama.cpp's log reason) if the file does not load, InteropUnavailable if llama-cpp-python is missing."""
    ids = [int(t) for t in token_ids]
    if not ids:
        raise ValueError("token_ids is empty")
    if len(ids) > n_ctx:
        raise ValueError(f"{len(ids)} tokens do not fit n_ctx={n_ctx}")
    if isolated:
        return _run_isolated({"op": "logits", "model": str(gguf_path), "ids": ids, "n_ctx": n_ctx,
                              "kv_overrides": dict(kv_overrides or {})})
    with _captured_llama_log() as lines:
        llm = _open(gguf_path, n_ctx, kv_overrides, lines)
        try:
            n_vocab = llm.n_vocab()
            if max(ids) >= n_vocab:
                raise ValueError(f"token id {max(ids)} >= n_vocab {n_vocab}")
            try:
                llm.eval(ids)
            except Exception as e:  # decode failure
                raise InteropError(f"llama.cpp eval failed on {gguf_path}: {e}\n{_error_text(lines)}") from e
            return np.array(llm.scores[: len(ids)], dtype=np.float32, copy=True)
        finally:
            llm.close()


def llama_cpp_load_error(gguf_path, n_ctx: int = 256, *, kv_overrides=None, isolated: bool = True) -> str | None:
    """None if llama-cpp-python's llama.cpp loads the file (model and context), else the reason from its log.

    Runs in a child process by default, so that a llama.cpp abort on a malformed file is reported, not fatal."""
    if isolated:
        out = _run_isolated({"op": "load_error", "model": str(gguf_path), "n_ctx": n_ctx,
                             "kv_overrides": dict(kv_overrides or {})})
        return out
    with _captured_llama_log() as lines:
        try:
            llm = _open(gguf_path, n_ctx, kv_overrides, lines)
        except LlamaLoadError as e:
            return e.reason
        llm.close()
    return None


# --- child-process mode ------------------------------------------------------------------------------------------

def _run_isolated(req: dict):
    _import_llama_cpp()  # fail fast with InteropUnavailable in the parent
    if not Path(req["model"]).is_file():
        raise FileNotFoundError(req["model"])
    with tempfile.TemporaryDirectory(prefix="kimi-llcpp-") as tmp:
        req_path = Path(tmp) / "req.json"
        out_path = Path(tmp) / "out.npy"
        req["out"] = str(out_path)
        req_path.write_text(json.dumps(req))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        proc = subprocess.run([sys.executable, "-m", "kimi_interop.llama_cpp", str(req_path)],
                              capture_output=True, text=True, env=env, timeout=3600)
        if proc.returncode == 0:
            if req["op"] == "logits":
                return np.load(out_path)
            return json.loads(Path(tmp, "result.json").read_text())["error"]
        if proc.returncode == 3:  # clean load failure reported by the child
            reason = json.loads(Path(tmp, "result.json").read_text())["error"]
            if req["op"] == "load_error":
                return reason
            raise LlamaLoadError(req["model"], reason)
        # the child died (llama.cpp abort / segfault): its stderr holds the assert message
        msg = f"llama.cpp crashed (exit {proc.returncode}) on {req['model']}:\n{proc.stderr[-6000:]}"
        if req["op"] == "load_error":
            return msg
        raise InteropError(msg)


def _child_main(req_path: str) -> int:
    req = json.loads(Path(req_path).read_text())
    result_path = Path(req["out"]).with_name("result.json")
    try:
        if req["op"] == "logits":
            logits = llama_cpp_logits(req["model"], req["ids"], req["n_ctx"], kv_overrides=req["kv_overrides"])
            np.save(req["out"], logits)
        else:
            err = llama_cpp_load_error(req["model"], req["n_ctx"], kv_overrides=req["kv_overrides"], isolated=False)
            result_path.write_text(json.dumps({"error": err}))
    except LlamaLoadError as e:
        result_path.write_text(json.dumps({"error": e.reason}))
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1]))


class _TensorOverride(ctypes.Structure):        # struct llama_model_tensor_override (include/llama.h)
    _fields_ = [("pattern", ctypes.c_char_p), ("type", ctypes.c_int)]


class _ImatrixData(ctypes.Structure):           # struct llama_model_imatrix_data
    _fields_ = [("name", ctypes.c_char_p), ("data", ctypes.POINTER(ctypes.c_float)), ("size", ctypes.c_size_t)]


def llama_quantize(src, dst, ftype: int, *, pure: bool = True, threads: int = 2, allow_requantize: bool = False,
                   tensor_types: Sequence[tuple[str, int]] = (), imatrix: Mapping[str, np.ndarray] | None = None
                   ) -> Path:
    """llama-quantize's own code in-process (``llama_model_quantize``): SRC -> DST at llama file type FTYPE.

    ``pure`` is llama-quantize's ``--pure``; ``tensor_types`` its ``--tensor-type REGEX=TYPE`` list (regexes as
    given: the tool lower-cases them before this call); ``imatrix`` the loaded vectors by tensor name, as the
    tool hands them over (the ``quantize.imatrix.*`` keys are the tool's, not this function's). Raises
    InteropError with llama.cpp's log reason when it fails."""
    llama_cpp = _import_llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.pure, params.nthread = int(ftype), bool(pure), int(threads)
    params.allow_requantize = bool(allow_requantize)
    keep = []                                   # the C arrays must outlive the call
    if tensor_types:
        arr = (_TensorOverride * (len(tensor_types) + 1))(
            *[_TensorOverride(pat.encode(), int(t)) for pat, t in tensor_types], _TensorOverride(None, 0))
        keep.append(arr)
        params.tt_overrides = ctypes.cast(arr, type(params.tt_overrides))
    if imatrix:
        vectors = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in imatrix.items()}
        keep.append(vectors)
        arr = (_ImatrixData * (len(vectors) + 1))(
            *[_ImatrixData(k.encode(), v.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), v.size)
              for k, v in vectors.items()], _ImatrixData(None, None, 0))
        keep.append(arr)
        params.imatrix = ctypes.cast(arr, type(params.imatrix))
    with _captured_llama_log() as lines:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0 or not Path(dst).is_file():
        raise InteropError(f"llama_model_quantize failed on {src} (rc {rc}):\n{_error_text(lines)}")
    return Path(dst)


# --- llama-quantize's type selection alone (src/llama-ext.h) -------------------------------------------------------

class _QuantModelDesc(ctypes.Structure):        # struct llama_quant_model_desc (src/llama-ext.h)
    _fields_ = [("architecture", ctypes.c_char_p)] + [(n, ctypes.c_uint32) for n in (
        "n_embd", "n_ff", "n_layer", "n_head", "n_head_kv", "n_expert", "n_embd_head_k", "n_embd_head_v")]


class _GgmlInitParams(ctypes.Structure):        # struct ggml_init_params (ggml.h)
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


# llama-ext.h is C++ (no extern "C"): its functions are exported under their mangled names
_EXT = {
    "model_from_metadata": ("_Z31llama_quant_model_from_metadataPK22llama_quant_model_desc", ctypes.c_void_p,
                            [ctypes.POINTER(_QuantModelDesc)]),
    "init": ("_Z16llama_quant_initPK11llama_modelPK27llama_model_quantize_params", ctypes.c_void_p,
             [ctypes.c_void_p, ctypes.c_void_p]),
    "free": ("_Z16llama_quant_freeP19quantize_state_impl", None, [ctypes.c_void_p]),
    "allows": ("_Z38llama_quant_tensor_allows_quantizationPK19quantize_state_implPK11ggml_tensor", ctypes.c_bool,
               [ctypes.c_void_p, ctypes.c_void_p]),
    "compute_types": ("_Z25llama_quant_compute_typesP19quantize_state_impl11llama_ftypePP11ggml_tensorP9ggml_typem",
                      None, [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p),
                             ctypes.POINTER(ctypes.c_int), ctypes.c_size_t]),
}


_GGML = (("ggml_init", ctypes.c_void_p, [_GgmlInitParams]), ("ggml_free", None, [ctypes.c_void_p]),
         ("ggml_tensor_overhead", ctypes.c_size_t, []),
         ("ggml_new_tensor_4d", ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_int64] * 4),
         ("ggml_set_name", ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]))


def _ext_functions():
    llama_cpp = _import_llama_cpp()
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    llama, ggml = ctypes.CDLL(str(lib_dir / "libllama.so")), ctypes.CDLL(str(lib_dir / "libggml-base.so"))
    out = {}
    for key, (symbol, restype, argtypes) in _EXT.items():
        try:
            f = llama[symbol]
        except AttributeError:
            raise InteropUnavailable(f"libllama.so of llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} does not export "
                                     f"{symbol} (src/llama-ext.h)") from None
        f.restype, f.argtypes = restype, argtypes
        out[key] = f
    for name, restype, argtypes in _GGML:
        f = getattr(ggml, name)
        f.restype, f.argtypes = restype, argtypes
        out[name] = f
    return llama_cpp, out


def _layer(name: str) -> int:
    """sscanf(name, "blk.%d.", &layer), -1 when there is none: the key of llama-quantize's tensor order, as
    test-quant-type-selection.cpp sorts its tensors (written out here, not taken from quant.mixtures.llama_order,
    which this helper exists to check)."""
    m = re.match(r"blk\.\s*([+-]?\d+)", name)
    return int(m[1]) if m else -1


def llama_quant_types(arch: str, tensors: Sequence[tuple[str, Sequence[int]]], ftypes: Sequence[int], *,
                      n_layer: int, n_head: int, n_head_kv: int, n_expert: int, n_embd: int = 0, n_ff: int = 0
                      ) -> dict[int, dict[str, int]]:
    """llama-quantize's own type choice (llama_quant_compute_types, no imatrix) for each file type of `ftypes`:
    {ftype: {tensor name: ggml type id}} over the tensors of (name, numpy shape) that llama-quantize may quantize
    (llama_quant_tensor_allows_quantization), decided in llama-quantize's tensor order (by layer, then by name),
    for a mock model of `arch` with these hyperparameters (llama_quant_model_from_metadata: every layer gets
    n_head and n_head_kv). The counters and categories are those of the tensors given."""
    llama_cpp, f = _ext_functions()
    desc = _QuantModelDesc(arch.encode(), n_embd, n_ff, n_layer, n_head, n_head_kv, n_expert, 0, 0)
    model = f["model_from_metadata"](ctypes.byref(desc))
    if not model:
        raise InteropError(f"llama_quant_model_from_metadata failed for arch {arch}")
    params = llama_cpp.llama_model_quantize_default_params()
    qs = f["init"](model, ctypes.addressof(params))
    ctx = f["ggml_init"](_GgmlInitParams((len(tensors) + 1) * f["ggml_tensor_overhead"](), None, True))
    try:
        made = []
        for name, shape in tensors:
            ne = [*reversed([int(n) for n in shape]), 1, 1, 1][:4]
            t = f["ggml_new_tensor_4d"](ctx, GGML_TYPE_F32, *ne)
            f["ggml_set_name"](t, name.encode())
            if f["allows"](qs, t):
                made.append((name, t))

        made.sort(key=lambda item: (_layer(item[0]), item[0].encode()))
        arr = (ctypes.c_void_p * len(made))(*[t for _, t in made])
        types = (ctypes.c_int * len(made))()
        out = {}
        with _captured_llama_log():         # its fallback warnings, one per tensor
            for ftype in ftypes:
                f["compute_types"](qs, int(ftype), arr, types, len(made))
                out[int(ftype)] = {name: int(types[i]) for i, (name, _) in enumerate(made)}
        return out
    finally:
        f["ggml_free"](ctx)
        f["free"](qs)
        llama_cpp.llama_model_free(ctypes.c_void_p(model))


