"""The streamed engine (kimi_convert/engine): the same model from the checkpoint and from its GGUF, the runtime's
math layer by layer, ggml's activation rounding, and llama-imatrix's statistics of every product."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from kimi_convert.engine import ops
from kimi_convert.engine.forward import Engine
from kimi_convert.engine.states import TokenStates
from kimi_convert.engine.weights import open_source
from kimi_convert.imatrix.collect import ImatrixStats
from kimi_convert.runtime import ggml_cpu
from kimi_convert.runtime.forward import Runtime

CTX, CHUNKS = 24, 3


@pytest.fixture(scope="module", params=["k3", "k31"])
def model(request, k3_dir, k31_dir, converted):
    return (k3_dir if request.param == "k3" else k31_dir), converted(request.param)


def ids_for(n_vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, min(n_vocab, 700), size=(CHUNKS, CTX))


def run(path: Path, ids: np.ndarray, rounding: bool = True, slab: int = CTX):
    src = open_source(path)
    states = TokenStates(*ids.shape, src.config.n_embd)
    stats = ImatrixStats(src.config.n_expert)
    engine = Engine(src, stats=stats, slab_tokens=slab, rounding=rounding)
    engine.run(ids, states)
    return engine.final_hidden(states, slice(None)).numpy(), stats.take(), src


def test_checkpoint_and_gguf_give_the_same_run(model):
    hf, gguf = model
    ids = ids_for(open_source(gguf).config.n_vocab)
    h_hf, e_hf, src_hf = run(hf, ids)
    h_gg, e_gg, _ = run(gguf, ids)
    assert np.array_equal(h_hf, h_gg)
    assert sorted(e_hf) == sorted(e_gg)
    for name in e_hf:
        assert np.array_equal(e_hf[name].sums, e_gg[name].sums), name
        assert np.array_equal(e_hf[name].counts, e_gg[name].counts), name


def test_slabs_do_not_change_the_result(model):
    _, gguf = model
    ids = ids_for(open_source(gguf).config.n_vocab, seed=1)
    h1, e1, _ = run(gguf, ids, slab=CTX)
    h3, e3, _ = run(gguf, ids, slab=CHUNKS * CTX)
    np.testing.assert_allclose(h1, h3, rtol=0, atol=1e-5)


def test_engine_is_the_runtime_chunk_by_chunk(model):
    """Without ggml's rounding, every chunk's final hidden state is the NumPy runtime's on that chunk alone."""
    _, gguf = model
    ids = ids_for(open_source(gguf).config.n_vocab, seed=2)
    h, _, _ = run(gguf, ids, rounding=False)
    rt = Runtime(gguf)
    for c in range(CHUNKS):
        ref = rt.hidden(ids[c])
        np.testing.assert_allclose(h[c * CTX:(c + 1) * CTX], ref, rtol=0, atol=2e-4 * np.abs(ref).max())


def test_statistics_are_the_sums_of_squares_of_every_product_input(model):
    """llama-imatrix's statistics, from the runtime's own products (its matmul hook sees each weight's input):
    dense sums and counts per tensor, per head for attn_k_b/attn_v_b, per expert for the routed experts."""
    _, gguf = model
    ids = ids_for(open_source(gguf).config.n_vocab, seed=3)
    _, got, src = run(gguf, ids, rounding=False)
    want: dict[str, list] = {}

    def hook(name, key, x):
        if not name.startswith("blk."):
            return x
        e = want.setdefault(name, [None, None])
        x = np.asarray(x, np.float64)
        if isinstance(key, tuple):                          # (position, expert): one routed row
            n_exp = src.config.n_expert
            if e[0] is None:
                e[0], e[1] = np.zeros((n_exp, x.shape[-1])), np.zeros(n_exp)
            e[0][key[1]] += x * x
            e[1][key[1]] += 1
        else:
            heads = src.shape(name)[0] if name.endswith(("attn_k_b.weight", "attn_v_b.weight")) else 1
            if e[0] is None:
                e[0], e[1] = np.zeros((heads, x.shape[-1])), np.zeros(1)
            e[0][key] += (x * x).sum(0)
            e[1][0] += len(x) if key == 0 else 0
        return x.astype(np.float32)

    rt = Runtime(gguf, matmul_hook=hook)
    for c in range(CHUNKS):
        rt.hidden(ids[c])
    assert sorted(got) == sorted(want)
    for name, (sums, counts) in want.items():
        np.testing.assert_array_equal(got[name].counts, counts, err_msg=name)
        np.testing.assert_allclose(got[name].sums.reshape(sums.shape), sums, rtol=2e-3, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("qtype", [QT.BF16, QT.F16, QT.Q8_0, QT.MXFP4, QT.Q4_K, QT.IQ2_XXS, QT.F32])
def test_activation_rounding_is_ggml_cpu_s(qtype):
    x = np.random.default_rng(4).standard_normal((7, 512)).astype(np.float32) * 3
    x[0, :40] = 0                                          # an all-zero block
    got = ops.vec_dot_round(torch.from_numpy(x), qtype).numpy()
    want = ggml_cpu.vec_dot_input(x, qtype, ggml_cpu.X86_AVX2)
    np.testing.assert_array_equal(got, want)


def test_states_spill_to_disk_beyond_the_budget(model, tmp_path):
    _, gguf = model
    ids = ids_for(open_source(gguf).config.n_vocab, seed=5)
    h_ram, e_ram, src = run(gguf, ids)
    states = TokenStates(*ids.shape, src.config.n_embd, ram_budget=ids.size * src.config.n_embd * 4,
                         spill_dir=tmp_path)
    engine = Engine(open_source(gguf), slab_tokens=CTX)
    engine.run(ids, states)
    assert states.n_banks >= 1 and sorted(p.name for p in tmp_path.iterdir())   # banks went to disk
    assert np.array_equal(engine.final_hidden(states, slice(None)).numpy(), h_ram)


def test_mxfp4_experts_are_the_format_s_values_from_both_sources(k3_dir, converted):
    """An MXFP4 expert from the checkpoint (repacked, then ggml's dequantizer) and from the GGUF (the compiled
    dequantizer) is the compressed-tensors definition decoded, and gguf-py's (= ggml's) decoding of the blocks."""
    import gguf.quants
    from kimi_convert.convert import mxfp4
    hf, gg = open_source(k3_dir), open_source(converted("k3"))
    name = "blk.1.ffn_down_exps.weight"
    p = hf.by_name[name]
    ckpt = hf.plan.checkpoint
    for e in (0, p.shape[0] - 1):
        want = mxfp4.decode_compressed(ckpt.read(p.sources[e][0]), ckpt.read(p.sources[e][1])) + np.float32(0)
        assert np.array_equal(hf.expert(name, e), want) and np.array_equal(gg.expert(name, e), want)
        t = gg.gf.tensors[name]
        raw = t.raw_bytes().reshape(t.shape[0], -1)[e].reshape(t.shape[1], -1)
        assert np.array_equal(gg.expert(name, e), gguf.quants.dequantize(raw, QT.MXFP4).reshape(t.shape[1:]))


@pytest.mark.parametrize("n_tok,lower_bound", [(37, -5.0), (70, -40.0)])
def test_chunkwise_delta_rule_is_the_token_loop(n_tok, lower_bound):
    """The chunked solve against the recurrence as written, on K3's bounded gate and on a decay strong enough
    (40 a token) that the chunks take the form whose exponents are all <= 0; lengths not a multiple of a chunk."""
    from kimi_convert.engine.forward import delta_rule, delta_rule_chunked
    g = torch.Generator().manual_seed(7)
    B, H, D = 2, 3, 16
    q, k = (torch.nn.functional.normalize(torch.randn(B, n_tok, H, D, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(B, n_tok, H, D, generator=g)
    gate = lower_bound * torch.sigmoid(torch.randn(B, n_tok, H, D, generator=g))
    beta = torch.sigmoid(torch.randn(B, n_tok, H, generator=g))
    want = delta_rule(q, k, v, gate, beta)
    torch.testing.assert_close(delta_rule_chunked(q, k, v, gate, beta), want, rtol=0, atol=1e-6)
