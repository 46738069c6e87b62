"""A NumPy runtime that executes a kimi-k3 / kimi-k31 GGUF the way llama.cpp's graph does.

The spec is k3-gguf-and-math.md §3 (forward pass) and k31-indexer.md (the K3.1 lightning
indexer). Every value is float32, like ggml's CPU ops with an f32 KV cache. The reductions
that ggml sums in double (RMSNorm's mean of squares, softmax and row sums), exp/log/tanh and
the products that involve no weight are computed in float64 and rounded once, so that they
give the same f32 on every CPU (see `exp`). Activations are not rounded to the weights'
vec_dot type (bf16/q8_0), so on non-F32 files llama.cpp differs by that rounding;
`llama_cpp_rounding` turns on that rounding and ggml's summation order for the weight
matmuls (kimi_convert/runtime/ggml_cpu.py).

Memory: the file stays memory-mapped and every weight is dequantised when it is used and
dropped right after (`Weights`). Token embeddings are read row by row, `output` in row
chunks, and of the routed experts only the selected ones, one expert at a time. So a slice
of the real model runs in the RAM of its largest tensor plus activations.

Layout: the sequence is processed layer by layer (all T positions per layer); the KDA
recurrence is a per-token loop vectorised over heads.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Protocol

import numpy as np

from . import ggml_cpu
from ..constants import T, tname
from ..errors import CheckpointError
from ..gguf_io import GGUFFile, dequantize, open_gguf
from ..model import KimiConfig
from ..tensor_map import gguf_tensors
from .margins import RoutingMargins

F32, F64 = np.float32, np.float64
OUTPUT_CHUNK_ROWS = 8192       # rows of `output` / vocab dequantised at a time


# ------------------------------------------------------------------------------------
# primitive ops, with ggml's CPU semantics
#
# exp, log, tanh and the products that involve no weight (attention, the KDA state, the indexer) are
# computed in float64 and rounded once to f32. numpy's float32 SIMD kernels and OpenBLAS's sgemm are picked
# per CPU at run time and differ in the last bit between CPUs; rounded from float64, the f32 result is the
# same on every CPU unless the float64 value lies within ~1e-16 (relative) of an f32 rounding midpoint.

def exp(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.exp(np.asarray(x, F64)).astype(F32)


def tanh(x: np.ndarray) -> np.ndarray:
    return np.tanh(np.asarray(x, F64)).astype(F32)


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b of f32 activations, as f32 (see above)."""
    return (np.asarray(a, F64) @ np.asarray(b, F64)).astype(F32)


def rms_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) over the last axis; ggml sums the f32 squares in double."""
    sq = (x * x).astype(np.float64).sum(-1, keepdims=True)
    mean = (sq / x.shape[-1]).astype(F32)
    return x * (F32(1) / np.sqrt(mean + F32(eps)))


def layer_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """(x - mean) / sqrt(var + eps) over the last axis (LLM_NORM, no affine part)."""
    xc = x - x.mean(-1, keepdims=True, dtype=np.float64).astype(F32)
    var = (xc * xc).mean(-1, keepdims=True, dtype=np.float64).astype(F32)
    return xc * (F32(1) / np.sqrt(var + F32(eps)))


def l2_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(sum x^2 + eps); llama.cpp builds it as rms_norm(x, eps/n) / sqrt(n)."""
    n = x.shape[-1]
    return rms_norm(x, eps / n) * F32(1 / math.sqrt(n))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return F32(1) / (F32(1) + exp(-x))


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def softplus(x: np.ndarray) -> np.ndarray:
    """ggml_softplus: log(1 + exp(x)), and x itself above 20 (where they agree in f32)."""
    return np.where(x > 20, x, np.log((F32(1) + exp(x)).astype(F64))).astype(F32)


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis; -inf entries get probability 0. The sum is in double, as in ggml."""
    e = exp(x - x.max(-1, keepdims=True))
    total = e.sum(-1, keepdims=True, dtype=np.float64)
    return e * (1.0 / total).astype(F32)


# ------------------------------------------------------------------------------------
# weights: dequantised on use, never kept

class Weights:
    """The tensors of one layer (or the globals when il is None), read from the mmapped file.

    `w(T.X)` dequantises the whole tensor to f32 (numpy order, see §0); `w.expert(T.X, e)`
    dequantises only expert e of a stacked expert tensor. Nothing is cached: the caller drops
    the array after use, so peak RAM is the largest tensor in use, not the layer.
    """

    def __init__(self, gf: GGUFFile, il: int | None = None, loaded: set | None = None,
                 llama_cpp_target: str | None = None, hook: "MatmulHook | None" = None):
        self.gf, self.il = gf, il
        self.loaded_experts = loaded if loaded is not None else set()
        self.llama_cpp_target = llama_cpp_target
        self.hook = hook

    def matmul(self, template: str, x: np.ndarray, *, rows: slice | None = None, head: int | None = None,
               src1_contiguous: bool = True) -> np.ndarray:
        """ggml_mul_mat(W, x) = x @ W.T for x [T, K]; W is the tensor, its `rows`, or head `head` of a 3-D tensor
        (attn_k_b / attn_v_b: ggml multiplies all heads in one op, head by head), in numpy order.

        With a llama.cpp target, in that build's rounding and summation order (ggml_cpu.mul_mat), from the raw
        blocks of the file. The hook sees the head as its key (0 otherwise).
        """
        if self.hook is not None:
            x = self.hook(self.name(template), head or 0, x)
        if self.llama_cpp_target is None:
            w = self.rows(template, rows) if rows is not None else self(template)
            return x @ (w if head is None else w[head]).T
        return ggml_cpu.mul_mat(x, self.operand(template, rows=rows, head=head), self.llama_cpp_target,
                                src1_contiguous=src1_contiguous)

    def operand(self, template: str, *, rows: slice | None = None, head: int | None = None,
                expert: int | None = None) -> ggml_cpu.WeightRows:
        """The raw blocks of the tensor (or of its rows, a head, an expert) as ggml_cpu multiplies them."""
        t = self.tensor(template)
        raw = _outer_slices(t)
        if expert is not None or head is not None:
            raw = raw[expert if expert is not None else head].reshape(t.shape[1], -1)
        elif rows is not None:
            raw = raw[rows]
        op = ggml_cpu.MUL_MAT_ID if expert is not None else ggml_cpu.MUL_MAT
        return ggml_cpu.WeightRows(t.qtype, raw, t.shape[-1], ggml_cpu.is_repacked(t.qtype, t.shape, op))

    def expert_operand(self, template: str, e: int):
        """Expert e as expert_matmul takes it: f32 values, or its raw blocks with a llama.cpp target."""
        if self.llama_cpp_target is None:
            return self.expert(template, e)
        self.loaded_experts.add((self.il, int(e)))
        return self.operand(template, expert=e)

    def expert_matmul(self, template: str, w, x: np.ndarray, positions: np.ndarray, expert: int) -> np.ndarray:
        """The rows of ggml_mul_mat_id that go to one expert: [n, M] for the tokens `positions` with inputs x [n, K]
        and the expert's matrix w (from expert_operand). Each row is its own product (one mat-vec per token, so that
        a result does not depend on which other tokens chose the expert); with a llama.cpp target, by that build's
        mul_mat_id kernel, which for some types depends on how many rows the expert gets."""
        if self.hook is not None:
            x = np.stack([self.hook(self.name(template), (int(t), int(expert)), row) for t, row in zip(positions, x)])
        if self.llama_cpp_target is None:
            return np.stack([w @ row for row in x])
        return ggml_cpu.mul_mat_id(x, w, self.llama_cpp_target, expert_rows=len(positions))

    def name(self, template: str) -> str:
        return tname(template, self.il)

    def has(self, template: str) -> bool:
        return self.name(template) in self.gf.tensors

    def tensor(self, template: str):
        name = self.name(template)
        try:
            return self.gf.tensors[name]
        except KeyError:
            raise CheckpointError(f"tensor {name} is missing") from None

    def __call__(self, template: str) -> np.ndarray:
        return self.tensor(template).to_float32()

    def expert(self, template: str, e: int) -> np.ndarray:
        """Expert e of an (E, rows, cols) tensor: each expert's bytes are one contiguous slice."""
        t = self.tensor(template)
        self.loaded_experts.add((self.il, int(e)))
        raw = _outer_slices(t)[e].reshape(t.shape[1], -1)           # bytes of one row per line
        return np.asarray(dequantize(raw, t.qtype), dtype=F32).reshape(t.shape[1:])

    def rows(self, template: str, ids) -> np.ndarray:
        """Rows `ids` (indices or a slice) of a 2-D tensor, without dequantising the rest."""
        t = self.tensor(template)
        raw = _outer_slices(t)[ids if isinstance(ids, slice) else np.asarray(ids, dtype=np.int64)]
        return np.asarray(dequantize(raw, t.qtype), dtype=F32).reshape(-1, t.shape[-1])


def _outer_slices(t) -> np.ndarray:
    """The mmapped bytes of t as [shape[0], bytes per outer index]; slicing reads only those bytes."""
    return t.raw_bytes().reshape(t.shape[0], -1)


def linear(w: Weights, template: str, x: np.ndarray) -> np.ndarray:
    """ggml_mul_mat(W, x): y = W_np @ x, for every row of x."""
    return w.matmul(template, x)


# ------------------------------------------------------------------------------------
# block attention residuals (§3.2)

def attn_res_mix(stack: list[np.ndarray], cur: np.ndarray, score_w: np.ndarray, eps: float) -> np.ndarray:
    """mix(cur, w): softmax over the sources of RMSNorm(v).w, then the sum of the RAW sources.

    Sources are the banked blocks (oldest first) and the current partial sum; with nothing
    banked the stream passes through.
    """
    if not stack:
        return cur
    src = np.stack(stack + [cur], axis=1)                                   # [T, m+1, n_embd]
    scores = (rms_norm(src, eps) * score_w).sum(-1, dtype=np.float64).astype(F32)
    p = softmax(scores)                                                     # [T, m+1]
    out = np.zeros_like(cur)
    for j, v in enumerate(stack):                 # hc_pre over the stack, then + cur * p_cur
        out = out + v * p[:, j:j + 1]
    return out + cur * p[:, -1:]


# ------------------------------------------------------------------------------------
# KDA (§3.4)

def short_conv_silu(x: np.ndarray, conv_w: np.ndarray) -> np.ndarray:
    """Causal depthwise conv with a zero initial state, then SiLU.

    conv_w is numpy (1, C, 1, K) or (C, 1, K): element [.., c, .., j] is tap j of channel c,
    and tap j multiplies the input K-1-j tokens back.
    """
    n_tok, C = x.shape
    w = conv_w.reshape(C, -1)
    K = w.shape[1]
    xp = np.concatenate([np.zeros((K - 1, C), F32), x])
    y = np.zeros_like(x)
    for j in range(K):
        y = y + xp[j:j + n_tok] * w[:, j]
    return silu(y)


def kda_gate(h: np.ndarray, w: Weights, cfg: KimiConfig) -> np.ndarray:
    """Per-channel log-decay g [T, H, D] (§3.4 step 5). ssm_a stores -exp(A_log)."""
    H, D = cfg.n_head, cfg.kda_head_dim
    u = linear(w, T.SSM_F_B, linear(w, T.SSM_F_A, h)) + w(T.SSM_DT_BIAS)
    A = w(T.SSM_A).reshape(1, H, 1)
    if cfg.gate_lower_bound is not None:          # K3: an activation swap into (lb, 0), not a clamp
        return F32(cfg.gate_lower_bound) * sigmoid(-(u.reshape(-1, H, D) * A))
    return softplus(u).reshape(-1, H, D) * A       # kimi-linear: -exp(A_log) * softplus(u)


def delta_rule(q, k, v, g, beta) -> np.ndarray:
    """The gated delta rule, token by token, all heads at once. q,k,v,g: [T,H,D]; beta: [T,H].

    S[h] is D x D (row = key index, column = value index), S_0 = 0:
      S <- diag(exp g) S;  delta = beta (v - S^T k);  S += k delta^T;  o = S^T q / sqrt(D).
    """
    n_tok, H, D = q.shape
    S = np.zeros((H, D, D), F32)
    out = np.empty_like(v)
    scale = F32(1 / math.sqrt(D))
    alpha = exp(g)
    for t in range(n_tok):
        S = S * alpha[t][:, :, None]                                # decay along the key axis
        kS = matmul(k[t][:, None, :], S)[:, 0]                      # S^T k  [H, D]
        delta = (v[t] - kS) * beta[t][:, None]
        S = S + k[t][:, :, None] * delta[:, None, :]
        out[t] = matmul(q[t][:, None, :], S)[:, 0] * scale
    return out


def kda(h: np.ndarray, w: Weights, cfg: KimiConfig) -> np.ndarray:
    """Kimi Delta Attention on the normed input h [T, n_embd] -> [T, n_embd]."""
    H, D, eps = cfg.n_head, cfg.kda_head_dim, cfg.rms_eps
    heads = lambda x: x.reshape(-1, H, D)
    q = heads(short_conv_silu(linear(w, T.ATTN_Q, h), w(T.SSM_CONV1D_Q)))
    k = heads(short_conv_silu(linear(w, T.ATTN_K, h), w(T.SSM_CONV1D_K)))
    v = heads(short_conv_silu(linear(w, T.ATTN_V, h), w(T.SSM_CONV1D_V)))
    q, k = l2_norm(q, eps), l2_norm(k, eps)
    g = kda_gate(h, w, cfg)
    beta = sigmoid(linear(w, T.SSM_BETA, h))
    o = rms_norm(delta_rule(q, k, v, g, beta), eps) * w(T.SSM_NORM)       # per-head norm, shared weight
    gated = o * sigmoid(heads(linear(w, T.SSM_G, h)))                     # full-rank output gate
    return linear(w, T.ATTN_OUT, gated.reshape(len(h), H * D))


# ------------------------------------------------------------------------------------
# MLA, NoPE, absorbed (§3.5), and the K3.1 lightning indexer (k31-indexer.md)

def q_latent(h: np.ndarray, w: Weights, cfg: KimiConfig) -> np.ndarray | None:
    """c_q = RMSNorm(W_qa h) * q_a_norm, or None when the layer has no q-LoRA."""
    if not w.has(T.ATTN_Q_A_NORM):
        return None
    return rms_norm(linear(w, T.ATTN_Q_A, h), cfg.rms_eps) * w(T.ATTN_Q_A_NORM)


def causal_mask(n_tok: int) -> np.ndarray:
    return np.tril(np.ones((n_tok, n_tok), dtype=bool))


def lightning_indexer(h: np.ndarray, c_q: np.ndarray, w: Weights, cfg: KimiConfig,
                      top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Which earlier tokens each query keeps: (keep [T, T] bool, margin [T]).

    score(t,s) = sum_h w_h(t) relu(q_I,h(t) . k_I(s)) over s <= t (no RoPE); the
    min(top_k, t+1) best are kept. margin[t] is the gap between the last kept and the
    best dropped score (NaN when nothing is dropped), to flag near-ties.
    """
    ix = cfg.indexer
    n_tok = len(h)
    q = linear(w, T.INDEXER_Q_B, c_q).reshape(n_tok, ix.n_head, ix.head_dim)
    k = layer_norm(linear(w, T.INDEXER_K, h), ix.norm_eps) * w(T.INDEXER_K_NORM) + w(T.INDEXER_K_NORM_BIAS)
    wts = linear(w, T.INDEXER_PROJ, h) * F32(1 / math.sqrt(ix.head_dim * ix.n_head))
    dots = np.maximum(matmul(q.transpose(1, 0, 2), k.T), F32(0))          # [H_I, T, T]
    score = np.zeros((n_tok, n_tok), F32)
    for hh in range(ix.n_head):                      # sequential over heads, as the fused op sums
        score = score + dots[hh] * wts[:, hh:hh + 1]
    score = np.where(causal_mask(n_tok), score, F32(-np.inf))
    return select_top_k(score, top_k)


def select_top_k(score: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Keep the top_k highest finite scores per row (stable order on exact ties)."""
    n_tok = len(score)
    order = np.argsort(-score, axis=1, kind="stable")
    keep = np.zeros_like(score, dtype=bool)
    margin = np.full(n_tok, np.nan, F32)
    for t in range(n_tok):
        n_keep = min(top_k, t + 1)
        keep[t, order[t, :n_keep]] = True
        if n_keep < t + 1:
            margin[t] = score[t, order[t, n_keep - 1]] - score[t, order[t, n_keep]]
    return keep, margin


def mla(h: np.ndarray, w: Weights, cfg: KimiConfig, c_q: np.ndarray | None,
        keep: np.ndarray) -> np.ndarray:
    """Multi-head latent attention in the absorbed form over the cache rows [c_s; kp_s].

    keep [T, T] is the set of visible cells (causal, or the indexer's choice within it).
    """
    n_tok, H, r = len(h), cfg.n_head, cfg.kv_lora_rank
    d_n, d_r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    q = linear(w, T.ATTN_Q_B, c_q) if c_q is not None else linear(w, T.ATTN_Q, h)
    q = q.reshape(n_tok, H, d_n + d_r).transpose(1, 0, 2)                 # [H, T, d_n+d_r]
    ckv = linear(w, T.ATTN_KV_A_MQA, h)
    c = rms_norm(ckv[:, :r], cfg.rms_eps) * w(T.ATTN_KV_A_NORM)           # latent, normed
    kp = ckv[:, r:]                                                         # NoPE: not rotated
    # attn_k_b [H, r, d_n]; ggml's src1 is a permuted view of q
    qa = np.stack([w.matmul(T.ATTN_K_B, q[h, :, :d_n], head=h, src1_contiguous=False) for h in range(H)])
    Q = np.concatenate([qa, q[:, :, d_n:]], axis=-1)
    K = np.concatenate([c, kp], axis=-1)                                    # the single KV head
    scores = matmul(Q, K.T) * F32(1 / math.sqrt(d_n + d_r))
    p = softmax(np.where(keep, scores, F32(-np.inf)))                       # [H, T, T]
    u = matmul(p, c)                                                        # V = the latent itself
    o = np.stack([w.matmul(T.ATTN_V_B, u[h], head=h) for h in range(H)]).transpose(1, 0, 2)   # attn_v_b [H, d_v, r]
    o = o.reshape(n_tok, H * cfg.v_head_dim)
    if w.has(T.ATTN_GATE):                        # the gate reads the normed layer input
        o = o * sigmoid(linear(w, T.ATTN_GATE, h))
    return linear(w, T.ATTN_OUT, o)


# ------------------------------------------------------------------------------------
# FFN (§3.3, §3.7, §3.8)

def situ(g: np.ndarray, u: np.ndarray, beta: float, linear_beta: float) -> np.ndarray:
    """beta tanh(g/beta) sigma(g) * U, U = lb tanh(u/lb) when lb > 0 (else u)."""
    a = tanh(g * F32(1 / beta)) * F32(beta) * sigmoid(g)
    if linear_beta > 0:
        u = tanh(u * F32(1 / linear_beta)) * F32(linear_beta)
    return a * u


def dense_ffn(x: np.ndarray, w: Weights, cfg: KimiConfig) -> np.ndarray:
    act = situ(linear(w, T.FFN_GATE, x), linear(w, T.FFN_UP, x), cfg.situ_beta, cfg.situ_linear_beta)
    return linear(w, T.FFN_DOWN, act)


def moe_route(x: np.ndarray, w: Weights, cfg: KimiConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(selected [T,k], weights [T,k], margin [T]) from the full-width input.

    The bias chooses the experts but the weights are the unbiased sigmoid scores.
    margin = k-th selected minus best rejected biased score (NaN if every expert is used).
    """
    k = cfg.n_expert_used
    s = sigmoid(linear(w, T.FFN_GATE_INP, x))
    biased = s + w(T.FFN_EXP_PROBS_B)
    order = np.argsort(-biased, axis=1, kind="stable")
    sel = order[:, :k]
    ranked = np.take_along_axis(biased, order, axis=1)
    margin = ranked[:, k - 1] - ranked[:, k] if k < cfg.n_expert else np.full(len(x), np.nan, F32)
    wts = np.take_along_axis(s, sel, axis=1)
    if cfg.expert_weights_norm:
        wts = wts / np.maximum(wts.sum(1, keepdims=True, dtype=np.float64).astype(F32), F32(6.103515625e-5))
    if cfg.expert_weights_scale not in (0.0, 1.0):
        wts = wts * F32(cfg.expert_weights_scale)
    return sel, wts, margin


def routed_experts(z: np.ndarray, sel: np.ndarray, wts: np.ndarray, w: Weights, cfg: KimiConfig) -> np.ndarray:
    """sum_slot w * down_e situ(gate_e z, up_e z), dequantising each selected expert once.

    Each token is a separate mat-vec (Weights.expert_matmul) so that its result does not depend on
    which other tokens chose the same expert (BLAS rounding varies with the batch size).
    """
    n_tok, k = sel.shape
    per_slot = np.zeros((k, n_tok, w.tensor(T.FFN_DOWN_EXPS).shape[1]), F32)
    for e in np.unique(sel):
        gate, up, down = (w.expert_operand(n, e) for n in (T.FFN_GATE_EXPS, T.FFN_UP_EXPS, T.FFN_DOWN_EXPS))
        tokens, slots = np.nonzero(sel == e)
        act = situ(w.expert_matmul(T.FFN_GATE_EXPS, gate, z[tokens], tokens, e),
                   w.expert_matmul(T.FFN_UP_EXPS, up, z[tokens], tokens, e), cfg.situ_beta, cfg.situ_linear_beta)
        per_slot[slots, tokens] = w.expert_matmul(T.FFN_DOWN_EXPS, down, act, tokens, e) * wts[tokens, slots][:, None]
        del gate, up, down
    y = per_slot[0]
    for j in range(1, k):                          # added slot by slot, as ggml aggregates
        y = y + per_slot[j]
    return y


def latent_moe(x: np.ndarray, w: Weights, cfg: KimiConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Latent MoE on the ffn-normed x -> (y [T, n_embd], routing margin [T], selected [T, k])."""
    sel, wts, margin = moe_route(x, w, cfg)
    z = linear(w, T.FFN_ROUTED_DOWN, x) if w.has(T.FFN_ROUTED_DOWN) else x
    y = routed_experts(z, sel, wts, w, cfg)
    if w.has(T.FFN_ROUTED_NORM):
        y = rms_norm(y, cfg.rms_eps) * w(T.FFN_ROUTED_NORM)
    if w.has(T.FFN_ROUTED_UP):
        y = linear(w, T.FFN_ROUTED_UP, y)
    if w.has(T.FFN_GATE_SHEXP):                   # shared experts read the un-projected x
        sh = situ(linear(w, T.FFN_GATE_SHEXP, x), linear(w, T.FFN_UP_SHEXP, x),
                  cfg.situ_beta, cfg.situ_linear_beta)
        y = y + linear(w, T.FFN_DOWN_SHEXP, sh)
    return y, margin, sel


# ------------------------------------------------------------------------------------
# the runtime

class MatmulHook(Protocol):
    """Sees (and may replace) the f32 input x of every weight matmul before it is rounded and multiplied.

    name is the GGUF tensor; key is 0, the head (attn_k_b / attn_v_b), or (position, expert) for a routed
    expert's row. Used to compare the runtime with llama.cpp's own matmul inputs
    (kimi_interop.tie_breaks).
    """

    def __call__(self, name: str, key: int | tuple[int, int], x: np.ndarray) -> np.ndarray: ...


class Runtime:
    """Executes a kimi-k3 / kimi-k31 GGUF file; see the module docstring."""

    def __init__(self, path, *, top_k: int | None = None, llama_cpp_rounding: bool | str = False,
                 matmul_hook: MatmulHook | None = None):
        """top_k overrides the file's indexer top_k; matmul_hook sees every weight matmul's input.

        llama_cpp_rounding computes the weight matmuls as a llama.cpp build does, to compare a BF16, MXFP4
        or quantized file with it position by position: True or ggml_cpu.X86_AVX2 for llama-cpp-python as
        .ci/install-interop.sh pins it (activation rounding, the kernel it picks and its arithmetic),
        ggml_cpu.WASM for wllama (its rounding, and the arithmetic of the kernels read from its wasm). See
        kimi_convert/runtime/ggml_cpu.py."""
        target = ggml_cpu.X86_AVX2 if llama_cpp_rounding is True else llama_cpp_rounding or None
        if target is not None and target not in ggml_cpu.TARGETS:
            raise ValueError(f"llama_cpp_rounding must be a bool or one of {ggml_cpu.TARGETS}, not {llama_cpp_rounding!r}")
        self.llama_cpp_target = target
        self.matmul_hook = matmul_hook
        self.path = Path(path)
        gf = open_gguf(self.path)
        cfg = KimiConfig.from_gguf(gf.fields, gf.paths[0])
        # a tensor stored without its trailing ggml 1-dims (llama-quantize's) is read in our shape
        self.gf = gf.with_shapes({name: shape for name, (_, shape) in gguf_tensors(cfg).items()})
        self.cfg = cfg.with_top_k(top_k) if top_k is not None else cfg
        self.routing_margins = RoutingMargins()
        self.loaded_experts: set[tuple[int, int]] = set()

    # --- public API ---
    def logits(self, token_ids) -> np.ndarray:
        """[T, n_vocab] float32 logits for every position."""
        y = self.hidden(token_ids)
        out = self.gf.tensors[T.OUTPUT]
        logits = np.empty((len(y), out.shape[0]), F32)
        w = self.weights(None)
        for a in range(0, out.shape[0], OUTPUT_CHUNK_ROWS):
            rows = slice(a, min(a + OUTPUT_CHUNK_ROWS, out.shape[0]))
            logits[:, rows] = w.matmul(T.OUTPUT, y, rows=rows)
        return logits

    def hidden(self, token_ids) -> np.ndarray:
        """[T, n_embd] final normed hidden state (what `output` multiplies; wllama's embedding)."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0 or ids.min() < 0 or ids.max() >= self.gf.tensors[T.TOKEN_EMBD].shape[0]:
            raise ValueError(f"token ids must be non-empty and in [0, {self.gf.tensors[T.TOKEN_EMBD].shape[0]})")
        self.routing_margins = RoutingMargins(n_tokens=len(ids))
        self.loaded_experts = set()
        return self._forward(ids)

    # --- the layer loop with block attention residuals (§3.2) ---
    def _forward(self, ids: np.ndarray) -> np.ndarray:
        cfg, eps, B = self.cfg, self.cfg.rms_eps, self.cfg.attn_res_block_size
        g = self.weights(None)
        P = g.rows(T.TOKEN_EMBD, ids)              # the running partial sum, starts at the embedding
        stack: list[np.ndarray] = []               # banked (completed) blocks
        for il in range(cfg.n_layer):
            w = self.weights(il)
            a = attn_res_mix(stack, P, w(T.ATTN_RES_SCORE), eps) if B else P
            reset = B > 0 and il % B == 0
            if reset:
                stack.append(P)                    # bank the raw P, then restart the block sum
            o = self.attention_block(il, rms_norm(a, eps) * w(T.ATTN_NORM))
            P = o if reset else P + o
            f = attn_res_mix(stack, P, w(T.FFN_RES_SCORE), eps) if B else P
            P = P + self.ffn_block(il, rms_norm(f, eps) * w(T.FFN_NORM))
        y = attn_res_mix(stack, P, g(T.OUTPUT_RES_SCORE), eps) if B else P
        return rms_norm(y, eps) * g(T.OUTPUT_NORM)

    def weights(self, il: int | None) -> Weights:
        return Weights(self.gf, il, self.loaded_experts, self.llama_cpp_target, self.matmul_hook)

    def attention_block(self, il: int, h: np.ndarray) -> np.ndarray:
        """KDA or MLA (+ indexer) on the attention-normed input h."""
        cfg, w = self.cfg, self.weights(il)
        if cfg.is_kda(il):
            return kda(h, w, cfg)
        c_q = q_latent(h, w, cfg)
        keep = causal_mask(len(h))
        if cfg.has_indexer(il):
            keep, self.routing_margins.dsa[il] = lightning_indexer(h, c_q, w, cfg, cfg.indexer.top_k)
            self.routing_margins.kept[il] = keep
        return mla(h, w, cfg, c_q, keep)

    def ffn_block(self, il: int, x: np.ndarray) -> np.ndarray:
        cfg, w = self.cfg, self.weights(il)
        if not cfg.is_moe(il):
            return dense_ffn(x, w, cfg)
        y, self.routing_margins.moe[il], self.routing_margins.experts[il] = latent_moe(x, w, cfg)
        return y

    # --- reporting ---
    def estimate_ram_bytes(self, n_tokens: int = 64) -> int:
        """Upper bound of the RAM a run needs beyond the mmapped file.

        The largest layer's f32 weights (counting one routed expert, the only one held at a
        time) or the largest global chunk, plus the activations of n_tokens positions.
        """
        c, T_ = self.cfg, n_tokens
        per_layer = [0] * c.n_layer
        for name, t in self.gf.tensors.items():
            if not name.startswith("blk."):
                continue
            n = int(np.prod(t.shape)) * 4
            if name.endswith("_exps.weight"):
                n //= t.shape[0]
            per_layer[int(name.split(".")[1])] += n
        out = self.gf.tensors[T.OUTPUT].shape
        weights = max(per_layer + [min(out[0], OUTPUT_CHUNK_ROWS) * out[1] * 4])
        width = max(c.n_embd, c.d_inner, c.n_ff, c.n_ff_exp * max(c.n_expert_shared, 1),
                    c.n_head * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim + c.kv_lora_rank))
        n_banks = c.n_layer // c.attn_res_block_size + 2 if c.attn_res_block_size else 1
        acts = 4 * T_ * (c.n_embd * (n_banks + 4) + 8 * width + c.n_vocab)
        acts += 4 * c.n_head * (c.kda_head_dim ** 2 + 3 * T_ * T_)                 # KDA state, MLA scores
        acts += 4 * c.n_expert_used * T_ * c.n_lat + 4 * T_ * c.n_expert * 3        # expert slots, router
        if c.indexer:
            acts += 4 * c.indexer.n_head * T_ * T_ * 2
        return int(weights + acts)

    def describe(self) -> str:
        """One line per layer kind, plus the sizes that matter for a run."""
        c = self.cfg
        kinds = []
        for il in range(c.n_layer):
            att = "MLA+DSA" if c.has_indexer(il) else "MLA" if c.is_mla(il) else "KDA"
            kinds.append(f"{il}:{att}/{'MoE' if c.is_moe(il) else 'dense'}")
        qtypes = sorted({t.qtype.name for t in self.gf.tensors.values()})
        lines = [f"{self.path.name}: {c.arch}, {c.n_layer} layers, n_embd {c.n_embd}, vocab {c.n_vocab}, "
                 f"tensor types {'/'.join(qtypes)}",
                 f"  layers: {' '.join(kinds)}",
                 f"  attn_res block {c.attn_res_block_size}, experts {c.n_expert_used}/{c.n_expert} "
                 f"(latent {c.n_lat}, ff {c.n_ff_exp}, shared {c.n_expert_shared})"
                 + (f", indexer top_k {c.indexer.top_k} ({c.indexer.n_head}x{c.indexer.head_dim})"
                    if c.indexer else ""),
                 f"  estimated RAM for 64 tokens: {self.estimate_ram_bytes(64) / 2**30:.2f} GiB"]
        return "\n".join(lines)
