"""Real llama.cpp builds load what kimi-convert writes (fail, never skip, if they are missing).

- kimi-k3: llama.cpp of Oct 2026 via llama-cpp-python 0.3.36 (built from source by .ci/run).
- kimi-k31: llama.cpp b12211, the WebAssembly build in @wllama/wllama 3.13.0 under Node 26.
Numerical agreement with our runtime is tested in the verification tests; here: loads and runs.
"""
from __future__ import annotations

import numpy as np
import pytest

from kimi_interop.llama_cpp import llama_cpp_load_error, llama_cpp_logits
from kimi_interop.wllama import wllama_hidden_states, wllama_load_error

pytestmark = pytest.mark.interop      # needs the llama.cpp builds (.ci/install-interop.sh)

TOKENS = [17, 300, 42, 511, 7, 90, 640, 12]


@pytest.mark.parametrize("outtype", ["bf16", "f32"])
def test_llama_cpp_loads_k3(converted, outtype):
    path = converted("k3", outtype)
    assert llama_cpp_load_error(path) is None
    logits = llama_cpp_logits(path, TOKENS)
    assert logits.shape == (len(TOKENS), 1024)
    assert np.isfinite(logits).all() and logits.std() > 0


def test_llama_cpp_split_file_loads(tmp_path, k3_dir):
    from kimi_convert.convert.converter import build_plan, convert
    res = convert(build_plan(k3_dir, "f32"), tmp_path / "k3.gguf", split_max_tensors=80)
    assert len(res.paths) == 3
    assert llama_cpp_load_error(res.paths[0]) is None


@pytest.mark.parametrize("outtype", ["bf16", "f32"])
def test_wllama_loads_k31(converted, outtype):
    path = converted("k31", outtype)
    assert wllama_load_error(path) is None
    hidden = wllama_hidden_states(path, TOKENS[:4])
    assert hidden.shape == (4, 96) and np.isfinite(hidden).all()


def test_llama_cpp_rejects_what_it_should(converted):
    """The Oct-2026 build does not know kimi-k31: our K3.1 file must not pretend to be kimi-k3."""
    assert "kimi-k31" in (llama_cpp_load_error(converted("k31")) or "")
