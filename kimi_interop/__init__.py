"""Run our GGUF files in two real llama.cpp builds, for tests.

* :func:`llama_cpp_logits` / :func:`llama_cpp_load_error` -- llama-cpp-python 0.3.36 (native llama.cpp of
  Oct 2026: knows ``kimi-k3``, not ``kimi-k31``), in-process.
* :func:`llama_quantize` -- llama-quantize's code (``llama_model_quantize``) from the same build, in-process;
  :func:`llama_quant_types` -- its type choice alone (``llama_quant_compute_types``, src/llama-ext.h).
* :func:`upstream_convert` -- llama.cpp's own ``convert_hf_to_gguf.py`` from the same Oct-2026 tree (``kimi-k3``),
  in a child process, as the reference for what a converter writes.
* :func:`wllama_hidden_states` / :func:`wllama_load_error` -- @wllama/wllama 3.13.0 (llama.cpp b12211 as wasm64 +
  JSPI: knows ``kimi-k3`` and ``kimi-k31``) under the Node.js 26 that ``.ci/install-interop.sh`` puts in ``.interop/``
  (or ``$KIMI_INTEROP_DIR``). Gives final normed hidden states; logits = ``output.weight @ hidden``.

Both raise :class:`InteropUnavailable` when their build is not installed (run ``bash .ci/install-interop.sh``) and
:class:`LlamaLoadError` (with llama.cpp's own log reason) when llama.cpp refuses a file.
"""

from ._common import InteropError, InteropUnavailable, LlamaLoadError, interop_dir

__all__ = [
    "InteropError",
    "InteropUnavailable",
    "LlamaLoadError",
    "interop_dir",
    "llama_cpp_logits",
    "llama_cpp_load_error",
    "llama_quant_types",
    "llama_quantize",
    "upstream_convert",
    "wllama_hidden_states",
    "wllama_load_error",
    "wllama_run",
]


def __getattr__(name):  # lazy: importing the package must not import llama_cpp or start node
    if name in ("llama_cpp_logits", "llama_cpp_load_error", "llama_quantize", "llama_quant_types"):
        from . import llama_cpp as _m

        return getattr(_m, name)
    if name == "upstream_convert":
        from . import llama_cpp_convert as _m

        return _m.upstream_convert
    if name in ("wllama_hidden_states", "wllama_load_error", "wllama_run"):
        from . import wllama as _m

        return getattr(_m, name)
    raise AttributeError(name)
