"""kimi_convert.runtime.forward: properties of the NumPy execution of kimi-k3 / kimi-k31 GGUF files.

The GGUF files are written here with gguf's GGUFWriter, the names of constants.py and the
metadata of KimiConfig.gguf_metadata(), so these tests do not depend on the converter.
Every weight is drawn from a seed derived from its tensor name, so files of different
configurations (K3 vs K3.1, attn-res on/off, F32 vs BF16 vs Q8_0) share identical weights.
"""
from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize

from kimi_convert.runtime import forward as rt
from kimi_convert.constants import ARCH_K3, ARCH_K31, Key, T, key, tname
from kimi_convert.model import IndexerConfig, KimiConfig
from kimi_convert.runtime.forward import Runtime

SEQ = [5, 17, 3, 88, 41, 41, 9, 60, 2, 77, 31, 14]


# ------------------------------------------------------------------------------------
# tiny model files

def tiny_config(arch: str = ARCH_K31, *, block: int = 2, top_k: int = 4, gate_lb: float | None = -5.0) -> KimiConfig:
    """4 layers: KDA+dense, KDA+MoE, KDA+MoE, MLA(+DSA)+MoE; 8 experts, 2 used, MXFP4."""
    return KimiConfig(
        arch=arch, n_layer=4, n_embd=64, n_vocab=96, n_ctx_train=4096, n_head=4, rms_eps=1e-5,
        kda_head_dim=32, conv_kernel=4, gate_lower_bound=gate_lb,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_ff=96, n_dense_layers=1, n_expert=8, n_expert_used=2, n_expert_shared=1, n_ff_exp=32, n_latent=32,
        expert_weights_norm=True, expert_weights_scale=2.5, situ_beta=4.0, situ_linear_beta=2.0,
        attn_res_block_size=block, full_attn_layers=(3,),
        indexer=IndexerConfig(n_head=4, head_dim=16, top_k=top_k, norm_eps=1e-5) if arch == ARCH_K31 else None,
        experts_mxfp4=True)


def tensor_shapes(c: KimiConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the file, numpy order (k3-gguf-and-math.md §2)."""
    E, H, D, di = c.n_embd, c.n_head, c.kda_head_dim, c.d_inner
    r, dn, dr, dv = c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    s = {T.TOKEN_EMBD: (c.n_vocab, E), T.OUTPUT_NORM: (E,), T.OUTPUT: (c.n_vocab, E)}
    if c.attn_res_block_size:
        s[T.OUTPUT_RES_SCORE] = (E,)
    for il in range(c.n_layer):
        b = {T.ATTN_NORM: (E,), T.FFN_NORM: (E,)}
        if c.attn_res_block_size:
            b |= {T.ATTN_RES_SCORE: (E,), T.FFN_RES_SCORE: (E,)}
        if c.is_kda(il):
            b |= {T.ATTN_Q: (di, E), T.ATTN_K: (di, E), T.ATTN_V: (di, E),
                  T.SSM_CONV1D_Q: (1, di, 1, c.conv_kernel), T.SSM_CONV1D_K: (1, di, 1, c.conv_kernel),
                  T.SSM_CONV1D_V: (1, di, 1, c.conv_kernel), T.SSM_F_A: (D, E), T.SSM_F_B: (di, D),
                  T.SSM_BETA: (H, E), T.SSM_A: (H,), T.SSM_DT_BIAS: (di,), T.SSM_G: (di, E),
                  T.SSM_NORM: (D,), T.ATTN_OUT: (E, di)}
        else:
            b |= {T.ATTN_Q_A: (c.q_lora_rank, E), T.ATTN_Q_A_NORM: (c.q_lora_rank,),
                  T.ATTN_Q_B: (H * (dn + dr), c.q_lora_rank), T.ATTN_KV_A_MQA: (r + dr, E),
                  T.ATTN_KV_A_NORM: (r,), T.ATTN_K_B: (H, r, dn), T.ATTN_V_B: (H, dv, r),
                  T.ATTN_GATE: (H * dv, E), T.ATTN_OUT: (E, H * dv)}
            if c.has_indexer(il):
                ix = c.indexer
                b |= {T.INDEXER_Q_B: (ix.n_head * ix.head_dim, c.q_lora_rank), T.INDEXER_K: (ix.head_dim, E),
                      T.INDEXER_K_NORM: (ix.head_dim,), T.INDEXER_K_NORM_BIAS: (ix.head_dim,),
                      T.INDEXER_PROJ: (ix.n_head, E)}
        if not c.is_moe(il):
            b |= {T.FFN_GATE: (c.n_ff, E), T.FFN_UP: (c.n_ff, E), T.FFN_DOWN: (E, c.n_ff)}
        else:
            F, L, S = c.n_ff_exp, c.n_lat, c.n_ff_exp * c.n_expert_shared
            b |= {T.FFN_GATE_INP: (c.n_expert, E), T.FFN_EXP_PROBS_B: (c.n_expert,),
                  T.FFN_GATE_EXPS: (c.n_expert, F, L), T.FFN_UP_EXPS: (c.n_expert, F, L),
                  T.FFN_DOWN_EXPS: (c.n_expert, L, F), T.FFN_ROUTED_DOWN: (L, E), T.FFN_ROUTED_UP: (E, L),
                  T.FFN_ROUTED_NORM: (L,), T.FFN_GATE_SHEXP: (S, E), T.FFN_UP_SHEXP: (S, E),
                  T.FFN_DOWN_SHEXP: (E, S)}
        s |= {tname(k, il): v for k, v in b.items()}
    return s


def make_weights(c: KimiConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights; each tensor's values depend only on (seed, name, shape)."""
    out = {}
    for name, shape in tensor_shapes(c).items():
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        x = rng.standard_normal(shape)
        if name.endswith("ssm_a"):
            x = -np.exp(rng.uniform(-1.5, 1.0, shape))             # -exp(A_log)
        elif name.endswith(("_norm.weight", "k_norm.weight")) and len(shape) == 1:
            x = 1 + 0.2 * x
        elif name.endswith("res_score.weight"):                   # mix scores of O(1): soft, not one-hot
            x = 0.1 * x
        elif name.endswith(("ssm_dt.bias", "exp_probs_b.bias", "k_norm.bias")):
            x = 0.3 * x
        elif "ssm_conv1d" in name:
            x = 0.5 * x
        elif name == T.TOKEN_EMBD:
            pass
        else:
            x = x / math.sqrt(shape[-1])                             # unit-gain matrices
        x = x.astype(np.float32)
        if name.endswith("_exps.weight"):                           # the values an MXFP4 file holds
            x = dequantize(quantize(x, QT.MXFP4), QT.MXFP4).reshape(shape).astype(np.float32)
        out[name] = x
    return out


def qtype_for(name: str, x: np.ndarray, mode: str) -> QT:
    """F32 file with MXFP4 experts, or its BF16 / Q8_0 variant, or all-F32 ('f32-experts')."""
    if name.endswith("_exps.weight"):
        return QT.F32 if mode == "f32-experts" else QT.MXFP4
    kept_f32 = (x.ndim == 1 or "ssm_conv1d" in name or name.endswith("ffn_gate_inp.weight")
                or name.endswith("indexer.proj.weight"))
    if mode == "bf16" and not kept_f32:
        return QT.BF16
    if mode == "q8_0" and not kept_f32 and x.ndim == 2 and x.shape[-1] % 32 == 0 and "indexer" not in name:
        return QT.Q8_0
    return QT.F32


def write_gguf(path, c: KimiConfig, weights: dict[str, np.ndarray], mode: str = "f32"):
    w = GGUFWriter(str(path), c.arch)
    for k, v, vt, sub in c.gguf_metadata():
        w.add_key_value(k, v, vt, sub)
    w.add_string("tokenizer.ggml.model", "no_vocab")                # vocab size comes from vocab_size
    for name in tensor_shapes(c):
        x, qt = weights[name], qtype_for(name, weights[name], mode)
        if qt == QT.F32:
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, quantize(x, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """name -> GGUF path, made on demand and kept for the module."""
    d = tmp_path_factory.mktemp("runtime")
    cache = {}

    def get(name: str):
        if name not in cache:
            arch, block, mode, lb = {
                "k31": (ARCH_K31, 2, "f32", -5.0), "k3": (ARCH_K3, 2, "f32", -5.0),
                "k3-b0": (ARCH_K3, 0, "f32", -5.0), "k3-softplus": (ARCH_K3, 2, "f32", None),
                "k31-bf16": (ARCH_K31, 2, "bf16", -5.0), "k31-q8_0": (ARCH_K31, 2, "q8_0", -5.0),
                "k3-f32-experts": (ARCH_K3, 2, "f32-experts", -5.0),
                "k3-softplus-f32-experts": (ARCH_K3, 2, "f32-experts", None),
                "k3-b0-f32-experts": (ARCH_K3, 0, "f32-experts", -5.0),
                "k31-f32-experts": (ARCH_K31, 2, "f32-experts", -5.0)}[name]
            c = tiny_config(arch, block=block, gate_lb=lb)
            cache[name] = write_gguf(d / f"{name}.gguf", c, make_weights(c), mode)
        return cache[name]

    return get


# ------------------------------------------------------------------------------------
# whole-model properties

def test_causality(files):
    """Logits at t depend only on tokens <= t, through KDA, MLA, the indexer and the MoE."""
    r = Runtime(files("k31"), top_k=3)
    a = r.logits(SEQ)
    changed = SEQ[:7] + [(x + 11) % 96 for x in SEQ[7:]]
    b = r.logits(changed)
    assert a.shape == (len(SEQ), 96) and a.dtype == np.float32
    np.testing.assert_array_equal(b[:7], a[:7])
    assert np.abs(b[7:] - a[7:]).max(axis=1).min() > 1e-4


def test_k31_top_k_covering_the_sequence_is_dense_mla(files):
    """top_k >= T: bit-identical to the same weights as kimi-k3 (no indexer). top_k=2: identical at 0,1 only."""
    dense = Runtime(files("k3")).logits(SEQ)
    for k in (len(SEQ), len(SEQ) + 5, 4096):
        np.testing.assert_array_equal(Runtime(files("k31"), top_k=k).logits(SEQ), dense)
    r = Runtime(files("k31"), top_k=2)
    sparse = r.logits(SEQ)
    np.testing.assert_array_equal(sparse[:2], dense[:2])
    assert np.abs(sparse[2:] - dense[2:]).max(axis=1).min() > 1e-4
    gaps = r.routing_margins.dsa[3]
    assert np.isnan(gaps[:2]).all() and (gaps[2:] >= 0).all()


def test_file_top_k_is_used_and_overridable(files):
    assert Runtime(files("k31")).cfg.indexer.top_k == 4
    assert Runtime(files("k31"), top_k=7).cfg.indexer.top_k == 7
    np.testing.assert_array_equal(Runtime(files("k31")).logits(SEQ), Runtime(files("k31"), top_k=4).logits(SEQ))


def test_hidden_is_what_output_multiplies(files):
    r = Runtime(files("k31"))
    h = r.hidden(SEQ)
    out = r.gf.tensors[T.OUTPUT].to_float32()
    np.testing.assert_allclose(r.logits(SEQ), h @ out.T, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["bf16", "q8_0"])
def test_quantized_file_runs_exactly_its_dequantised_values(files, tmp_path, mode):
    """The runtime computes in f32 on dequantised weights: a BF16 / Q8_0 file gives bit-identical
    logits to an F32 file holding the values it dequantises to."""
    q = Runtime(files(f"k31-{mode}"))
    c = q.cfg
    values = {n: t.to_float32() for n, t in q.gf.tensors.items()}
    assert {q.gf.tensors[T.ATTN_Q.format(bid=0)].qtype, q.gf.tensors[T.TOKEN_EMBD].qtype} == {QT[mode.upper()]}
    f32 = Runtime(write_gguf(tmp_path / "deq.gguf", c, values, "f32"))
    np.testing.assert_array_equal(q.logits(SEQ), f32.logits(SEQ))


# Stated tolerance: per-position relative L2 error of the logits against the F32 file, at the
# positions before the first discrete choice (expert or indexer top-k) that differs. Measured on
# this random 4-layer fixture, where each layer amplifies a perturbation about 2-4x: BF16 <= 0.035
# and Q8_0 <= 0.065 over 4 weight seeds (llama.cpp's own doc expects ~1e-2 for BF16 on real models).
QUANT_TOL = {"bf16": 0.05, "q8_0": 0.10}


@pytest.mark.parametrize("mode", ["bf16", "q8_0"])
def test_quantized_files_track_f32(files, mode):
    ref_rt, q_rt = Runtime(files("k31")), Runtime(files(f"k31-{mode}"))
    ref, got = ref_rt.logits(SEQ), q_rt.logits(SEQ)
    n_same = ref_rt.routing_margins.same_choices_until(q_rt.routing_margins)
    assert n_same >= 4, "the fixture flips a routing choice too early for a precision check"
    err = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)
    assert 0 < err[:n_same].max() < QUANT_TOL[mode], f"{mode}: relative errors {np.round(err, 4)}"
    assert (got[:n_same].argmax(1) == ref[:n_same].argmax(1)).mean() >= 0.75


def test_only_selected_experts_are_dequantised(files):
    r = Runtime(files("k31"))
    r.logits(SEQ[:1])
    per_layer = {il: {e for l, e in r.loaded_experts if l == il} for il in (1, 2, 3)}
    assert all(len(v) == 2 for v in per_layer.values()), per_layer      # n_expert_used of 8
    r.logits(SEQ)
    assert {l for l, _ in r.loaded_experts} == {1, 2, 3}


@pytest.mark.parametrize("qt", [QT.MXFP4, QT.Q8_0, QT.BF16, QT.F16, QT.Q4_K, QT.Q6_K, QT.IQ4_NL, QT.IQ4_XS])
def test_expert_and_row_slices_match_the_whole_tensor(tmp_path, qt):
    """Per-expert / per-row dequantisation of the mmapped bytes equals slicing the full dequantisation."""
    from gguf import GGML_QUANT_SIZES
    from kimi_convert.gguf_io import open_gguf
    block, size = GGML_QUANT_SIZES[qt]
    cols = 256 if block > 1 else 64
    rng = np.random.default_rng(1)
    if qt == QT.F16:
        data, raw = rng.standard_normal((3, 4, cols)).astype(np.float16), None
    else:
        data = rng.integers(0, 256, (3, 4, cols // block * size), dtype=np.uint8)
        if qt == QT.MXFP4:
            data[..., ::size] = rng.integers(100, 140, data[..., ::size].shape)   # sane E8M0 scales
        raw = qt
    w = GGUFWriter(str(tmp_path / "t.gguf"), ARCH_K3)
    w.add_tensor("blk.0.ffn_gate_exps.weight", data, raw_dtype=raw)
    w.add_tensor("token_embd.weight", data[0], raw_dtype=raw)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    gf = open_gguf(tmp_path / "t.gguf")
    with np.errstate(all="ignore"):
        whole = gf.tensors["blk.0.ffn_gate_exps.weight"].to_float32()
        ws = rt.Weights(gf, 0)
        for e in range(3):
            np.testing.assert_array_equal(ws.expert(T.FFN_GATE_EXPS, e), whole[e])
        np.testing.assert_array_equal(rt.Weights(gf).rows(T.TOKEN_EMBD, [2, 0]), whole[0][[2, 0]])
        np.testing.assert_array_equal(rt.Weights(gf).rows(T.TOKEN_EMBD, slice(1, 3)), whole[0][1:3])


# ------------------------------------------------------------------------------------
# layers against independent float64 references

def _f64(r: Runtime, il: int):
    ws = r.weights(il)
    return lambda t: ws(t).astype(np.float64)


def _rand_h(n_tok: int, n_embd: int, seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n_tok, n_embd)).astype(np.float32)


def _sig(x):
    return 1 / (1 + np.exp(-x))


def _rms(x, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


@pytest.mark.parametrize("name", ["k3", "k3-softplus"])
def test_kda_matches_closed_form_recurrence(files, name):
    """S_t = (I - beta k k^T) diag(alpha_t) S_{t-1} + beta k v^T, written out in float64."""
    r = Runtime(files(name))
    c, W, il = r.cfg, _f64(r, 1), 1
    H, D, K, eps = c.n_head, c.kda_head_dim, c.conv_kernel, c.rms_eps
    h32 = _rand_h(16, c.n_embd)
    h = h32.astype(np.float64)
    n = len(h)

    def conv(x, w):                  # y_t[c] = sum_j w[c, j] x_{t-K+1+j}[c], zero history
        w = w.reshape(-1, K)
        y = np.zeros_like(x)
        for t in range(n):
            for j in range(K):
                s = t - K + 1 + j
                if s >= 0:
                    y[t] += w[:, j] * x[s]
        return y * _sig(y)

    q = conv(h @ W(T.ATTN_Q).T, W(T.SSM_CONV1D_Q)).reshape(n, H, D)
    k = conv(h @ W(T.ATTN_K).T, W(T.SSM_CONV1D_K)).reshape(n, H, D)
    v = conv(h @ W(T.ATTN_V).T, W(T.SSM_CONV1D_V)).reshape(n, H, D)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + eps)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + eps)
    u = (h @ W(T.SSM_F_A).T @ W(T.SSM_F_B).T + W(T.SSM_DT_BIAS)).reshape(n, H, D)
    a = -W(T.SSM_A)[None, :, None]                                  # exp(A_log)
    if c.gate_lower_bound is not None:
        g = c.gate_lower_bound * _sig(a * u)
    else:
        g = -a * np.log1p(np.exp(u))
    beta = _sig(h @ W(T.SSM_BETA).T)
    o = np.zeros((n, H, D))
    for hh in range(H):
        S = np.zeros((D, D))
        for t in range(n):
            kk = k[t, hh][:, None]
            S = (np.eye(D) - beta[t, hh] * kk @ kk.T) @ np.diag(np.exp(g[t, hh])) @ S \
                + beta[t, hh] * kk @ v[t, hh][None, :]
            o[t, hh] = S.T @ q[t, hh] / math.sqrt(D)
    o = _rms(o, eps) * W(T.SSM_NORM) * _sig((h @ W(T.SSM_G).T).reshape(n, H, D))
    ref = o.reshape(n, H * D) @ W(T.ATTN_OUT).T

    got = rt.kda(h32, r.weights(il), c)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def _mla_unabsorbed(r: Runtime, il: int, h: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """HF's form: k_h = [Wk_h c; kp], v_h = Wv_h c, softmax(q.k / sqrt(d_n+d_r)) v, in float64."""
    c, W = r.cfg, _f64(r, il)
    H, rk, dn, dr, dv, eps = c.n_head, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.rms_eps
    h = h.astype(np.float64)
    cq = _rms(h @ W(T.ATTN_Q_A).T, eps) * W(T.ATTN_Q_A_NORM)
    q = (cq @ W(T.ATTN_Q_B).T).reshape(len(h), H, dn + dr)
    ckv = h @ W(T.ATTN_KV_A_MQA).T
    lat, kp = _rms(ckv[:, :rk], eps) * W(T.ATTN_KV_A_NORM), ckv[:, rk:]
    kb, vb = W(T.ATTN_K_B), W(T.ATTN_V_B)                           # (H, r, d_n), (H, d_v, r)
    out = np.zeros((len(h), H, dv))
    for hh in range(H):
        keys = np.concatenate([lat @ kb[hh], kp], axis=1)          # Wk_h c = k_b[h]^T c
        vals = lat @ vb[hh].T
        s = q[:, hh] @ keys.T / math.sqrt(dn + dr)
        s = np.where(keep, s, -np.inf)
        p = np.exp(s - s.max(1, keepdims=True))
        out[:, hh] = (p / p.sum(1, keepdims=True)) @ vals
    o = out.reshape(len(h), H * dv) * _sig(h @ W(T.ATTN_GATE).T)
    return o @ W(T.ATTN_OUT).T


def test_mla_absorbed_equals_unabsorbed(files):
    r = Runtime(files("k31"))
    il, h = 3, _rand_h(14, r.cfg.n_embd, seed=5)
    w = r.weights(il)
    causal = rt.causal_mask(len(h))
    sparse = causal & (np.random.default_rng(2).random(causal.shape) < 0.6) | np.eye(len(h), dtype=bool)
    for keep in (causal, sparse):
        got = rt.mla(h, w, r.cfg, rt.q_latent(h, w, r.cfg), keep)
        ref = _mla_unabsorbed(r, il, h, keep)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_lightning_indexer_selection(files):
    """The kept set is the top min(k, t+1) of sum_h w_h relu(q_h.k_s) (float64), never a future token."""
    r = Runtime(files("k31"))
    c, W, il = r.cfg, _f64(r, 3), 3
    ix, h = c.indexer, _rand_h(12, c.n_embd, seed=7)
    w = r.weights(il)
    keep, gap = rt.lightning_indexer(h, rt.q_latent(h, w, c), w, c, 3)
    h64 = h.astype(np.float64)
    cq = _rms(h64 @ W(T.ATTN_Q_A).T, c.rms_eps) * W(T.ATTN_Q_A_NORM)
    q = (cq @ W(T.INDEXER_Q_B).T).reshape(len(h), ix.n_head, ix.head_dim)
    kx = h64 @ W(T.INDEXER_K).T
    kx = (kx - kx.mean(1, keepdims=True)) / np.sqrt(kx.var(1, keepdims=True) + ix.norm_eps)
    kx = kx * W(T.INDEXER_K_NORM) + W(T.INDEXER_K_NORM_BIAS)
    wt = h64 @ W(T.INDEXER_PROJ).T
    score = np.einsum("th,ths->ts", wt, np.maximum(np.einsum("thd,sd->ths", q, kx), 0))
    assert not (keep & ~rt.causal_mask(len(h))).any()
    for t in range(len(h)):
        assert keep[t].sum() == min(3, t + 1)
        if t >= 3:
            s = score[t, : t + 1]
            assert set(np.flatnonzero(keep[t])) == set(np.argsort(-s)[:3])
            top = np.sort(s)[::-1]
            scale = 1 / math.sqrt(ix.head_dim * ix.n_head)
            assert gap[t] == pytest.approx((top[2] - top[3]) * scale, rel=1e-4, abs=1e-6)


def test_attn_res_with_block_size_0_is_a_plain_pre_norm_residual(files):
    r = Runtime(files("k3-b0"))
    c, eps = r.cfg, r.cfg.rms_eps
    g = r.weights(None)
    x = g(T.TOKEN_EMBD)[SEQ]
    for il in range(c.n_layer):
        w = r.weights(il)
        x = x + r.attention_block(il, rt.rms_norm(x, eps) * w(T.ATTN_NORM))
        x = x + r.ffn_block(il, rt.rms_norm(x, eps) * w(T.FFN_NORM))
    ref = rt.rms_norm(x, eps) * g(T.OUTPUT_NORM)
    np.testing.assert_allclose(r.hidden(SEQ), ref, rtol=1e-6, atol=1e-6)


def test_attn_res_schedule_matches_hf_walk(files):
    """B=2 over 4 layers: banks at il=0 (the embedding) and il=2; independent float64 mixing."""
    r = Runtime(files("k3"))
    c, eps = r.cfg, r.cfg.rms_eps
    g = r.weights(None)

    def mix(sources, w):               # softmax over RMSNorm(v).w, sum of the raw sources
        v = np.stack(sources).astype(np.float64)                # [m, T, E]
        s = (_rms(v, eps) * w).sum(-1)
        p = np.exp(s - s.max(0))
        p = p / p.sum(0)
        return (p[..., None] * v).sum(0).astype(np.float32)

    blocks, partial = [], g(T.TOKEN_EMBD)[SEQ]
    for il in range(c.n_layer):
        w = r.weights(il)
        a = mix(blocks + [partial], w(T.ATTN_RES_SCORE)) if blocks else partial
        sealed = il % c.attn_res_block_size == 0
        if sealed:
            blocks.append(partial)
        o = r.attention_block(il, rt.rms_norm(a, eps) * w(T.ATTN_NORM))
        partial = o if sealed else partial + o
        f = mix(blocks + [partial], w(T.FFN_RES_SCORE))
        partial = partial + r.ffn_block(il, rt.rms_norm(f, eps) * w(T.FFN_NORM))
    assert len(blocks) == 2
    ref = rt.rms_norm(mix(blocks + [partial], g(T.OUTPUT_RES_SCORE)), eps) * g(T.OUTPUT_NORM)
    np.testing.assert_allclose(r.hidden(SEQ), ref, rtol=1e-4, atol=1e-4)


def test_attn_res_mix_scores_normalised_sums_raw():
    """Scaling a banked source leaves its weight unchanged (scores are RMS-normalised) but scales its share."""
    rng = np.random.default_rng(0)
    v, cur = (rng.standard_normal((3, 16)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal(16).astype(np.float32)
    one = rt.attn_res_mix([v], cur, w, 1e-5)
    hundred = rt.attn_res_mix([100 * v], cur, w, 1e-5)
    sv = (rt.rms_norm(v, 1e-5) * w).sum(-1)
    sc = (rt.rms_norm(cur, 1e-5) * w).sum(-1)
    p = np.exp(sv) / (np.exp(sv) + np.exp(sc))
    np.testing.assert_allclose(hundred - one, 99 * p[:, None] * v, rtol=1e-4, atol=1e-4)
    assert rt.attn_res_mix([], cur, w, 1e-5) is cur


def test_latent_moe_routing_rules(files):
    """Selection by sigmoid + bias, weights unbiased sigmoid renormalised then scaled; margins reported."""
    r = Runtime(files("k31"))
    c, il = r.cfg, 2
    x = _rand_h(10, c.n_embd, seed=9)
    w = r.weights(il)
    sel, wts, gap = rt.moe_route(x, w, c)
    s = _sig(x.astype(np.float64) @ w(T.FFN_GATE_INP).T.astype(np.float64))
    biased = s + w(T.FFN_EXP_PROBS_B)
    for t in range(len(x)):
        assert set(sel[t]) == set(np.argsort(-biased[t])[:2])
        ref = s[t, sel[t]] / s[t, sel[t]].sum() * c.expert_weights_scale
        np.testing.assert_allclose(wts[t], ref, rtol=1e-5)
        srt = np.sort(biased[t])[::-1]
        assert gap[t] == pytest.approx(srt[1] - srt[2], abs=1e-5)
    # the whole latent MoE against a float64 sum over the selected experts
    y, _, chosen = rt.latent_moe(x, w, c)
    np.testing.assert_array_equal(chosen, sel)
    W = _f64(r, il)
    z = x.astype(np.float64) @ W(T.FFN_ROUTED_DOWN).T

    def situ64(g, u):
        return c.situ_beta * np.tanh(g / c.situ_beta) * _sig(g) * c.situ_linear_beta * np.tanh(u / c.situ_linear_beta)

    gate, up, down = W(T.FFN_GATE_EXPS), W(T.FFN_UP_EXPS), W(T.FFN_DOWN_EXPS)
    ref = np.zeros((len(x), c.n_lat))
    for t in range(len(x)):
        for e, we in zip(sel[t], wts[t]):
            ref[t] += we * down[e] @ situ64(gate[e] @ z[t], up[e] @ z[t])
    ref = _rms(ref, c.rms_eps) * W(T.FFN_ROUTED_NORM) @ W(T.FFN_ROUTED_UP).T
    xs = x.astype(np.float64)
    ref += situ64(xs @ W(T.FFN_GATE_SHEXP).T, xs @ W(T.FFN_UP_SHEXP).T) @ W(T.FFN_DOWN_SHEXP).T
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_situ():
    g = np.array([-30, -1, 0, 0.5, 3, 40], np.float32)
    u = np.array([-100, 2, 1, -0.5, 50, 1], np.float32)
    got = rt.situ(g, u, 4.0, 25.0)
    ref = 4 * np.tanh(g / 4.0) * _sig(g.astype(np.float64)) * 25 * np.tanh(u / 25.0)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(rt.situ(g, u, 4.0, 0.0), 4 * np.tanh(g / 4.0) * _sig(g.astype(np.float64)) * u,
                               rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------
# reporting

def test_margins_estimate_and_describe(files):
    r = Runtime(files("k31"))
    r.logits(SEQ)
    m = r.routing_margins
    assert set(m.moe) == {1, 2, 3} and set(m.dsa) == {3}
    assert all(v.shape == (len(SEQ),) and (v >= 0).all() for v in m.moe.values())
    kind, il, t, gap = m.smallest()
    assert kind in ("moe", "dsa") and gap >= 0
    est = r.estimate_ram_bytes()
    biggest = max(int(np.prod(t.shape)) * 4 for n, t in r.gf.tensors.items() if "_exps" not in n)
    assert biggest < est < 50 * 2**20
    text = r.describe()
    assert "kimi-k31" in text and "3:MLA+DSA/MoE" in text and "0:KDA/dense" in text


def test_kimi_k3_file_rejects_top_k(files):
    from kimi_convert.errors import ConfigError
    with pytest.raises(ConfigError):
        Runtime(files("k3"), top_k=4)


def test_bad_token_ids(files):
    with pytest.raises(ValueError):
        Runtime(files("k3")).logits([0, 96])


# ------------------------------------------------------------------------------------
# against llama.cpp itself (kimi_interop; install with `bash .ci/install-interop.sh`).
# Files are all-F32 (experts too): llama.cpp quantises activations to Q8_0 in front of MXFP4
# experts and to bf16 in front of BF16 weights, which this runtime deliberately does not do.
# Measured agreement: max |diff| <= 1e-5 on logits of magnitude ~4 (native) and <= 6e-6 on
# hidden states (wllama), so 1e-4 of the scale leaves room for other CPUs' SIMD paths.

def _interop(fn_name: str):
    """A missing build raises InteropUnavailable: the test fails, it never skips."""
    import kimi_interop as interop
    return getattr(interop, fn_name)


@pytest.mark.interop
@pytest.mark.parametrize("name", ["k3-f32-experts", "k3-softplus-f32-experts", "k3-b0-f32-experts"])
def test_matches_native_llama_cpp(files, name):
    """kimi-k3 in llama.cpp (llama-cpp-python 0.3.36, F32 cache, no flash attention): every position's logits."""
    seq = SEQ + SEQ[::-1]
    r = Runtime(files(name))
    ours = r.logits(seq)
    assert r.routing_margins.smallest()[3] > 1e-5          # no near-tie that could flip between the two
    theirs = _interop("llama_cpp_logits")(files(name), seq, n_ctx=64)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4 * np.abs(theirs).max())


@pytest.mark.interop
@pytest.mark.parametrize("top_k", [2, 5, 64])
def test_matches_wllama_kimi_k31(files, top_k):
    """kimi-k31 in llama.cpp b12211 (wllama): final hidden states with the indexer keeping top_k tokens."""
    seq = SEQ + SEQ[::-1]
    r = Runtime(files("k31-f32-experts"), top_k=top_k)
    ours = r.hidden(seq)
    assert r.routing_margins.smallest()[3] > 1e-5
    theirs = _interop("wllama_hidden_states")(files("k31-f32-experts"), seq,
                                              kv_overrides={key(Key.INDEXER_TOP_K, ARCH_K31): top_k})
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4 * np.abs(theirs).max())
