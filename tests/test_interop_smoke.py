"""Smoke test of the two real llama.cpp builds used to check our GGUF files (kimi_interop).

It needs no converter: it writes a tiny standard `llama`-arch GGUF (random F32 weights, a tiny byte-level gpt2
vocab) with gguf-py, runs it in llama-cpp-python 0.3.36 (native) and in wllama 3.13.0 (wasm under Node 26), and
checks that logits agree. The builds come from `bash .ci/install-interop.sh`; when they are missing these tests
FAIL (InteropUnavailable), they never skip.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

try:
    import kimi_interop  # noqa: F401
except ImportError:  # running without the repo root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gguf  # noqa: E402

from kimi_interop import (  # noqa: E402
    InteropUnavailable,
    LlamaLoadError,
    llama_cpp_load_error,
    llama_cpp_logits,
    wllama_hidden_states,
    wllama_load_error,
)
from kimi_interop import wllama as wllama_mod  # noqa: E402

pytestmark = pytest.mark.interop      # needs the llama.cpp builds (.ci/install-interop.sh)

TOKENS = [5, 72, 101, 108, 256, 257, 32, 258, 0, 33, 200, 7]


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def write_tiny_llama(path, *, arch: str = "llama", seed: int = 0, n_embd: int = 64, n_head: int = 4,
                     n_head_kv: int = 2, n_layer: int = 2, n_ff: int = 128) -> np.ndarray:
    """Write a tiny random F32 `llama` GGUF; returns output.weight as numpy [n_vocab, n_embd]."""
    rng = np.random.default_rng(seed)
    b2u = _bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)] + ["ab", "cd", "Ġa", "<|endoftext|>"]
    n_vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-random-llama")
    w.add_context_length(256)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * (n_vocab - 1) + [gguf.TokenType.CONTROL])
    w.add_token_merges(["a b", "c d", "Ġ a"])
    w.add_bos_token_id(n_vocab - 1)
    w.add_eos_token_id(n_vocab - 1)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)

    def t(name, *shape, norm=False):
        if norm:
            a = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            a = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        w.add_tensor(name, a)
        return a

    hd = n_embd // n_head
    t("token_embd.weight", n_vocab, n_embd)
    for i in range(n_layer):
        t(f"blk.{i}.attn_norm.weight", n_embd, norm=True)
        t(f"blk.{i}.attn_q.weight", n_embd, n_embd)
        t(f"blk.{i}.attn_k.weight", n_head_kv * hd, n_embd)
        t(f"blk.{i}.attn_v.weight", n_head_kv * hd, n_embd)
        t(f"blk.{i}.attn_output.weight", n_embd, n_embd)
        t(f"blk.{i}.ffn_norm.weight", n_embd, norm=True)
        t(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        t(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        t(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    t("output_norm.weight", n_embd, norm=True)
    out = t("output.weight", n_vocab, n_embd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("interop") / "tiny-llama-f32.gguf"
    out_w = write_tiny_llama(path)
    # the writer's array must be what the file holds
    reader = gguf.GGUFReader(str(path))
    stored = next(np.array(t.data) for t in reader.tensors if t.name == "output.weight")
    np.testing.assert_array_equal(stored, out_w)
    return path, out_w


def test_llama_cpp_logits_shape_and_determinism(tiny):
    path, out_w = tiny
    a = llama_cpp_logits(path, TOKENS)
    b = llama_cpp_logits(path, TOKENS)
    assert a.shape == (len(TOKENS), out_w.shape[0]) and a.dtype == np.float32
    assert np.isfinite(a).all() and np.abs(a).max() > 0.1
    np.testing.assert_array_equal(a, b)  # llama.cpp is bit-reproducible
    # row i only depends on the prefix: logits of a shorter prompt are the first rows
    np.testing.assert_allclose(llama_cpp_logits(path, TOKENS[:5]), a[:5], atol=1e-5, rtol=0)


def test_wllama_agrees_with_llama_cpp_python(tiny):
    path, out_w = tiny
    ref = llama_cpp_logits(path, TOKENS)
    hidden = wllama_hidden_states(path, TOKENS)
    assert hidden.shape == (len(TOKENS), out_w.shape[1])
    logits = hidden @ out_w.T
    np.testing.assert_allclose(logits, ref, atol=1e-4, rtol=0)
    assert np.abs(_log_softmax(logits) - _log_softmax(ref)).max() < 1e-4


def test_both_accept_the_file_and_report_why_they_refuse_another(tiny, tmp_path):
    path, _ = tiny
    assert llama_cpp_load_error(path) is None
    assert wllama_load_error(path) is None
    bogus = tmp_path / "unknown-arch.gguf"
    write_tiny_llama(bogus, arch="kimi-k99")
    reason = llama_cpp_load_error(bogus)
    assert reason and "unknown model architecture" in reason and "kimi-k99" in reason
    reason = wllama_load_error(bogus)
    assert reason and "unknown model architecture" in reason and "kimi-k99" in reason
    with pytest.raises(LlamaLoadError, match="unknown model architecture"):
        llama_cpp_logits(bogus, [1, 2])
    with pytest.raises(LlamaLoadError, match="unknown model architecture"):
        wllama_hidden_states(bogus, [1, 2])


def test_kv_overrides_reach_both_builds(tiny):
    """Both builds apply llama.cpp KV overrides at load (wllama needs a terminator entry, added by the runner)."""
    path, out_w = tiny
    base = llama_cpp_logits(path, TOKENS[:6])
    over = {"llama.rope.freq_base": 50.0}
    ref = llama_cpp_logits(path, TOKENS[:6], kv_overrides=over)
    np.testing.assert_array_equal(ref[0], base[0])  # RoPE does nothing at position 0
    assert np.abs(ref[1:] - base[1:]).max() > 1e-3
    logits = wllama_hidden_states(path, TOKENS[:6], kv_overrides=over) @ out_w.T
    np.testing.assert_allclose(logits, ref, atol=1e-4, rtol=0)


def test_missing_wllama_install_is_an_error_not_a_skip(tiny, tmp_path, monkeypatch):
    path, _ = tiny
    monkeypatch.setenv("KIMI_INTEROP_DIR", str(tmp_path / "nothing-here"))
    monkeypatch.delenv("KIMI_NODE", raising=False)
    with pytest.raises(InteropUnavailable, match="install-interop"):
        wllama_hidden_states(path, [1, 2])
    assert wllama_mod.InteropUnavailable is InteropUnavailable
