"""Converted fixture files in real llama.cpp builds, position by position, against our runtime.

Bounds (docs/verification.md §8):
- all-F32 files (F32 conversion of a checkpoint with BF16 experts; F32 KV cache; flash attention off):
  max |logit diff| <= 1e-3 at every position and the same argmax. Measured: ~6e-5 native, ~7e-5 wllama.
  Nothing is rounded, and no routing decision is closer than 1e-4 (measured 2.8e-4), so no last-bit
  difference can flip a discrete choice: the bound holds on every CPU.
- files with BF16 or MXFP4 weights, against llama-cpp-python as .ci/install-interop.sh pins it (x86-64-v3): the
  runtime with `llama_cpp_rounding=True` rounds each matmul input as that build does and multiplies in its
  order (kimi_convert/runtime/ggml_cpu.py). Every weight matmul's f32 input is compared with the one llama.cpp itself
  used (its eval callback): they agree to 1e-5 of the row's scale (measured <= 3e-6) at every position; where
  that last-bit difference puts a value on the other side of a bf16/Q8_0 rounding boundary, the runtime takes
  llama.cpp's value (kimi_interop/tie_breaks.py), so that one tie break does not derail every later
  position. Then the logits agree to 1e-4 at every position (measured: BF16 files bit for bit, MXFP4 5e-6).
  Without the emulation they are off by whole units.
- wllama (wasm, the same arithmetic on every CPU): `llama_cpp_rounding="wasm"` rounds as it does (reference
  Q8_0 rule); its order is not emulated, and the MXFP4 file agrees to 1e-4 at every position (measured 4e-6).
"""
from __future__ import annotations

import numpy as np
import pytest

from kimi_convert.runtime import ggml_cpu
from kimi_convert.fixtures.make_checkpoint import make_checkpoint
from kimi_convert.convert.converter import build_plan, convert
from kimi_interop import llama_cpp_logits, wllama_hidden_states
from kimi_interop.llama_cpp_trace import llama_cpp_matmul_inputs
from kimi_interop.numeric_paths import llama_cpp_pinned_problem
from kimi_interop.tie_breaks import LlamaCppTieBreaks
from kimi_convert.runtime.forward import Runtime

pytestmark = pytest.mark.interop      # needs the llama.cpp builds (.ci/install-interop.sh)

PROMPT = [int(t) for t in np.random.default_rng(0).integers(0, 700, 32)]   # below the special ids
F32_BOUND = 1e-3
ROUTING_MARGIN = 1e-4      # F32 class margin (verification.md §3): 100x the router's disagreement with llama.cpp
INPUT_REL_BOUND = 1e-5     # f32 matmul inputs, relative to the row's largest magnitude; measured <= 3e-6
ROUNDED_BOUND = 1e-4       # logits of BF16/MXFP4 files with the emulation; measured 0 (BF16) and 5e-6 (MXFP4)
MAX_TIE_BREAKS = 1e-3      # per rounded element; measured 0-13 in 2e5-5e5 (<= 3e-5)


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
    rt = Runtime(path)
    ours = rt.logits(PROMPT)
    theirs = llama_cpp_logits(path, PROMPT)
    assert np.abs(ours - theirs).max() <= F32_BOUND
    assert np.array_equal(ours.argmax(1), theirs.argmax(1))
    kind, layer, position, gap = rt.routing_margins.smallest()
    assert gap > ROUTING_MARGIN, f"{kind} near-tie at layer {layer}, position {position}: {gap:.1e}"


def test_llama_cpp_is_the_pinned_build():
    """The emulation below is of this build's kernels; a -march=native build on an AVX512 CPU runs others."""
    problem = llama_cpp_pinned_problem()
    assert problem is None, problem


def test_llama_cpp_trace_is_the_plain_pass(files):
    """Observing every matmul (one graph split per matmul) computes the same logits, bit for bit."""
    path = files["k3", True, "bf16"]
    assert np.array_equal(llama_cpp_matmul_inputs(path, PROMPT).logits, llama_cpp_logits(path, PROMPT))


# (MXFP4 experts, F32 file): F32 weights, Q8_0-rounded expert inputs; (MXFP4, BF16): bf16-rounded dense inputs
# too; (BF16 experts, BF16 file): every matmul input bf16-rounded, the experts through ggml_vec_dot_bf16.
@pytest.mark.parametrize("experts_mxfp4,outtype", [(True, "f32"), (True, "bf16"), (False, "bf16")])
def test_llama_cpp_k3_rounded_weights_match_with_emulation(files, experts_mxfp4, outtype):
    path = files["k3", experts_mxfp4, outtype]
    theirs = llama_cpp_matmul_inputs(path, PROMPT)
    rt = Runtime(path, llama_cpp_rounding=True)
    ties = LlamaCppTieBreaks(rt.gf, rt.llama_cpp_target, theirs, rel_tol=INPUT_REL_BOUND)
    rt.matmul_hook = ties
    emulated = rt.logits(PROMPT)

    rounded = {name for name, nodes in theirs.inputs.items()
               if name in rt.gf.tensors and ggml_cpu.rounding_block_size(rt.gf.tensors[name].qtype)}
    assert rounded and ties.checked == rounded            # every rounded weight matmul was compared
    assert not ties.mismatches, "\n".join(map(str, ties.mismatches[:5]))
    assert ties.max_rel_diff.max() <= INPUT_REL_BOUND
    assert len(ties.adopted) <= MAX_TIE_BREAKS * ties.n_rounded, "\n".join(map(str, ties.adopted[:5]))
    delta = np.abs(emulated - theirs.logits).max(1)
    table = " ".join(f"{d:.0e}" for d in delta)
    assert delta.max() <= ROUNDED_BOUND, f"per position: {table}; tie breaks: {list(map(str, ties.adopted))}"
    if outtype == "bf16":   # same bf16 inputs, same kernel order: bit for bit (measured 32/32; other orders: 0/32)
        assert np.count_nonzero(delta == 0) >= len(PROMPT) // 2, table

    # Up to the first tie break the emulation needs nothing from llama.cpp; after it, each position is listed.
    alone = np.abs(Runtime(path, llama_cpp_rounding=True).logits(PROMPT) - theirs.logits).max(1)
    first_tie = min((t.position for t in ties.adopted), default=len(PROMPT))
    assert alone[:first_tie].max(initial=0) <= ROUNDED_BOUND, " ".join(f"{d:.0e}" for d in alone)
    print(f"{path.name}: {len(ties.adopted)} tie breaks in {ties.n_rounded} rounded inputs, first at "
          f"{first_tie}; without them, from there: {' '.join(f'{d:.0e}' for d in alone[first_tie:])}")
    # Without the emulation the same file is off by whole units.
    plain = np.abs(Runtime(path).logits(PROMPT) - theirs.logits).max(1)
    assert np.median(plain) > 100 * ROUNDED_BOUND


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
    """wllama's Q8_0 conversion is the reference one (1/d, roundf): with it every position agrees (measured
    4e-6); with the x86 one (127/max, half to even) they part at position 15."""
    path = files["k31", True, "f32"]
    theirs = wllama_hidden_states(path, PROMPT)
    ours = Runtime(path, llama_cpp_rounding=ggml_cpu.WASM).hidden(PROMPT)
    assert np.abs(ours - theirs).max() <= ROUNDED_BOUND
