"""Converted fixture files in real llama.cpp builds, position by position, against our runtime.

Bounds (docs/verification.md):
- all-F32 files (F32 conversion of a checkpoint with BF16 experts; F32 KV cache; flash attention off):
  max |logit diff| <= 1e-3 at every position and the same argmax. Measured: ~6e-5 native, ~7e-5 wllama.
- files with MXFP4 or BF16 weights: llama.cpp rounds each matmul input to the weight's dot type
  (Q8_0 / bf16). With `llama_cpp_rounding=True` the runtime does the same and the first positions
  agree to 1e-4 (measured ~5e-6); later positions may drift once one input element lands on the
  other side of a Q8_0/bf16 rounding boundary (a last-bit difference decides it), which then
  propagates through the recurrent state. Without the emulation they are off by whole units.
"""
from __future__ import annotations

import numpy as np
import pytest

from fixtures.make_checkpoint import make_checkpoint
from kimi_convert.convert import build_plan, convert
from kimi_convert.interop import llama_cpp_logits, wllama_hidden_states
from kimi_convert.runtime import Runtime

PROMPT = [int(t) for t in np.random.default_rng(0).integers(0, 700, 32)]   # below the special ids
F32_BOUND = 1e-3


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("interop")
    out = {}
    for arch in ("k3", "k31"):
        for mx in (False, True):
            hf = make_checkpoint(d / f"{arch}-mx{mx}", arch=arch, experts_mxfp4=mx)
            for outtype in ("f32", "bf16"):
                path = d / f"{arch}-mx{mx}-{outtype}.gguf"
                convert(build_plan(hf, outtype), path)
                out[arch, mx, outtype] = path
    return out


def test_llama_cpp_k3_all_f32_every_position(files):
    path = files["k3", False, "f32"]
    ours = Runtime(path).logits(PROMPT)
    theirs = llama_cpp_logits(path, PROMPT)
    assert np.abs(ours - theirs).max() <= F32_BOUND
    assert np.array_equal(ours.argmax(1), theirs.argmax(1))


# BF16 experts (a BF16 file of a BF16-expert checkpoint) are left out: rounding every expert input
# to bf16 (8-bit mantissa) meets a boundary within the first positions on most prompts.
@pytest.mark.parametrize("experts_mxfp4,outtype", [(True, "f32"), (True, "bf16")])
def test_llama_cpp_k3_rounded_weights_match_with_emulation(files, experts_mxfp4, outtype):
    path = files["k3", experts_mxfp4, outtype]
    theirs = llama_cpp_logits(path, PROMPT)
    emulated = Runtime(path, llama_cpp_rounding=True).logits(PROMPT)
    plain = Runtime(path).logits(PROMPT)
    head = slice(0, 8)
    assert np.abs(emulated[head] - theirs[head]).max() <= 1e-4
    assert np.abs(plain - theirs).max() > 100 * np.abs(emulated[head] - theirs[head]).max()


@pytest.mark.parametrize("top_k", [None, 8, 3])
def test_wllama_k31_every_position(files, top_k):
    """llama.cpp b12211 runs our kimi-k31 file; top_k above (file: 2048) and below the prompt length."""
    path = files["k31", False, "f32"]
    overrides = None if top_k is None else {"kimi-k31.attention.indexer.top_k": top_k}
    theirs = wllama_hidden_states(path, PROMPT, kv_overrides=overrides)
    rt = Runtime(path, top_k=top_k)
    ours = rt.hidden(PROMPT)
    assert np.abs(ours - theirs).max() <= F32_BOUND
    output = rt.gf.tensors["output.weight"].to_float32()
    assert np.array_equal((ours @ output.T).argmax(1), (theirs @ output.T).argmax(1))
    if top_k is not None:       # the override really reached llama.cpp: it diverges exactly from top_k on
        dense = wllama_hidden_states(path, PROMPT)
        assert np.abs(theirs[:top_k] - dense[:top_k]).max() == 0
        assert (np.abs(theirs[top_k:] - dense[top_k:]).max(1) > 1e-3).all()


def test_wllama_k31_mxfp4_with_emulation(files):
    path = files["k31", True, "f32"]
    theirs = wllama_hidden_states(path, PROMPT[:8])
    ours = Runtime(path, llama_cpp_rounding=True).hidden(PROMPT[:8])
    assert np.abs(ours - theirs).max() <= 1e-4
