"""The streamed engine: the model run layer by layer over every token at once, not token by token.

One layer's weights are read (`weights.Layer`), every calibration token is pushed through that layer, and the
layer is dropped; the tokens' states (the residual stream and the banked AttnRes blocks, `states.TokenStates`)
carry the run to the next layer. So the model is read once, whatever the number of tokens, and memory is one
layer's dense weights, one routed expert, and the states.

The math is the runtime's (kimi_convert/runtime/forward.py: llama.cpp's graph, k3-gguf-and-math.md §3 and
k31-indexer.md) on torch, batched over chunks. Each chunk is its own sequence, as llama-imatrix and
llama-perplexity clear the cache between chunks. A layer runs in two phases:
- attention, a slab of chunks at a time (the KDA recurrence and the T x T attention are per sequence);
- FFN over all tokens, the routed experts grouped by expert: each expert is read once and multiplies, in one
  product, every token routed to it in every chunk.

Every weight product goes through `Products`, which shows its f32 input to the statistics (`Stats`: the
importance matrix of kimi-imatrix) and multiplies with llama.cpp's activation rounding (`ops.vec_dot_round`).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
import torch

from . import ops
from .states import TokenStates
from .weights import Layer, WeightSource
from ..constants import T
from ..model import KimiConfig


class Stats(Protocol):
    """What a run observes: the f32 input of every weight product, before ggml rounds it."""

    def dense(self, name: str, x: torch.Tensor) -> None: ...                 # x [N, K]
    def heads(self, name: str, x: torch.Tensor) -> None: ...                 # x [N, H, K], one matrix per head
    def expert(self, name: str, e: int, x: torch.Tensor) -> None: ...        # x [n, K], tokens routed to e


class Products:
    """The weight products of one layer (ggml_mul_mat / mul_mat_id) as llama.cpp computes them."""

    def __init__(self, w: Layer, stats: Stats | None, rounding: bool = True):
        self.w, self.stats = w, stats
        self.round = ops.vec_dot_round if rounding else (lambda x, qtype: x)
        # llama.cpp's default KV cache (llama-imatrix, llama-perplexity: -ctk f16) holds the MLA latent and key
        # in f16; its CPU flash attention reads them widened to f32 and computes in f32 (ops.cpp, the tiled path)
        self.cache = (lambda x: x.to(torch.float16).to(ops.F32)) if rounding else (lambda x: x)

    def linear(self, template: str, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] @ W.T for W [M, K] (numpy order)."""
        flat = x.reshape(-1, x.shape[-1])
        if self.stats is not None:
            self.stats.dense(self.w.name(template), flat)
        y = self.round(flat, self.w.qtype(template)) @ self.w(template).T
        return y.reshape(*x.shape[:-1], -1)

    def per_head(self, template: str, x: torch.Tensor) -> torch.Tensor:
        """x [N, H, K] by W [H, M, K] head by head (attn_k_b, attn_v_b: one 3-D weight) -> [N, H, M]."""
        if self.stats is not None:
            self.stats.heads(self.w.name(template), x)
        xr = self.round(x, self.w.qtype(template))
        return torch.einsum("nhk,hmk->nhm", xr, self.w(template))

    def expert(self, template: str, e: int, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The rows of mul_mat_id that go to expert e: x [n, K] @ W_e.T."""
        if self.stats is not None:
            self.stats.expert(self.w.name(template), e, x)
        return self.round(x, self.w.qtype(template)) @ weight.T


# ------------------------------------------------------------------------------------
# block attention residuals (§3.2)

def attn_res_mix(stack: list[torch.Tensor], cur: torch.Tensor, score_w: torch.Tensor, eps: float) -> torch.Tensor:
    """Softmax over the sources of RMSNorm(v).w, then the sum of the raw sources (banked blocks, then cur)."""
    if not stack:
        return cur
    src = torch.stack(stack + [cur], dim=-2)                                  # [..., m+1, n_embd]
    p = torch.softmax((ops.rms_norm(src, eps) * score_w).sum(-1), dim=-1)     # [..., m+1]
    out = torch.zeros_like(cur)
    for j, v in enumerate(stack):
        out = out + v * p[..., j:j + 1]
    return out + cur * p[..., -1:]


# ------------------------------------------------------------------------------------
# KDA (§3.4)

def short_conv_silu(x: torch.Tensor, conv_w: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv per sequence (zero initial state), then SiLU. x [B, T, C]; tap j is K-1-j back."""
    n_tok, C = x.shape[1], x.shape[2]
    w = conv_w.reshape(C, -1)
    K = w.shape[1]
    xp = torch.cat([x.new_zeros(x.shape[0], K - 1, C), x], dim=1)
    y = torch.zeros_like(x)
    for j in range(K):
        y = y + xp[:, j:j + n_tok] * w[:, j]
    return torch.nn.functional.silu(y)


def delta_rule(q, k, v, g, beta) -> torch.Tensor:
    """The gated delta rule per sequence, token by token, every sequence and head at once. q,k,v,g [B,T,H,D]."""
    B, n_tok, H, D = q.shape
    S = q.new_zeros(B, H, D, D)
    out = torch.empty_like(v)
    alpha = torch.exp(g)
    scale = 1 / math.sqrt(D)
    for t in range(n_tok):
        S = S * alpha[:, t].unsqueeze(-1)                                   # decay along the key axis
        kS = torch.einsum("bhk,bhkv->bhv", k[:, t], S)                      # S^T k
        delta = (v[:, t] - kS) * beta[:, t].unsqueeze(-1)
        S = S + k[:, t].unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], S) * scale
    return out


DELTA_CHUNK = 32        # tokens a chunk of the chunkwise delta rule solves at once (see delta_rule_chunked)
EXP_RANGE = 60.0        # |log-decay| from a chunk's middle within which e^(+-x) factors stay far inside float32


def delta_rule_chunked(q, k, v, g, beta, chunk: int = DELTA_CHUNK) -> torch.Tensor:
    """delta_rule's output, C tokens at a time as matrix products (the state S0 carried between chunks).

    Within a chunk, with b_t = the cumulative log-decay sum_{s<=t} g_s (per key channel):
      S'_t^T k_t = S0^T (e^{b_t} k_t) + sum_{s<t} A_ts delta_s,   A_ts = sum_c k_t,c k_s,c e^{b_t,c - b_s,c}
    so (I + diag(beta) A) delta = beta (V - (e^b * K) S0): one unit lower-triangular solve; then
      o_t = S0^T (e^{b_t} q_t) + sum_{s<=t} P_ts delta_s,  P_ts = sum_c q_t,c k_s,c e^{b_t,c - b_s,c}
      S_C = e^{b_C} * S0 + (K * e^{b_C - b})^T delta.
    A and P are products of (K e^{b - r}) and (K e^{r - b}) around the chunk's middle r while every |b - r| is
    within EXP_RANGE (K3's gate is bounded below: 32 tokens stay within it); a chunk of stronger decay takes the
    C x C x D form whose exponents are all <= 0. Equal to the token loop up to float order (tests/test_engine.py)."""
    B, n_tok, H, D = q.shape
    q, k, v, g, beta = (x.transpose(1, 2) for x in (q, k, v, g, beta))          # [B, H, T, ...]
    S = q.new_zeros(B, H, D, v.shape[-1])
    out = torch.empty_like(v)
    scale = 1 / math.sqrt(D)
    for a in range(0, n_tok, chunk):
        qc, kc, vc, bc = (x[:, :, a:a + chunk] for x in (q, k, v, beta))
        b = torch.cumsum(g[:, :, a:a + chunk], dim=2)                           # [B, H, C, D]
        A, P = _chunk_products(qc, kc, b)
        eb = torch.exp(b)
        rhs = bc.unsqueeze(-1) * (vc - (eb * kc) @ S)
        M = torch.eye(b.shape[2], dtype=q.dtype, device=q.device) + bc.unsqueeze(-1) * A
        delta = torch.linalg.solve_triangular(M, rhs, upper=False, unitriangular=True)
        out[:, :, a:a + chunk] = ((eb * qc) @ S + P @ delta) * scale
        last = b[:, :, -1:]                                                      # [B, H, 1, D]
        S = torch.exp(last).transpose(-1, -2) * S + (kc * torch.exp(last - b)).transpose(-1, -2) @ delta
    return out.transpose(1, 2)


def _chunk_products(qc, kc, b) -> tuple[torch.Tensor, torch.Tensor]:
    """(A strictly lower, P lower) of delta_rule_chunked, [B, H, C, C]."""
    r = b[:, :, b.shape[2] // 2:b.shape[2] // 2 + 1]
    if float((b - r).abs().max()) <= EXP_RANGE:
        k_out = (kc * torch.exp(r - b)).transpose(-1, -2)                      # the source side, e^(r - b_s)
        return ((kc * torch.exp(b - r)) @ k_out).tril(-1), ((qc * torch.exp(b - r)) @ k_out).tril()
    decay = torch.exp((b.unsqueeze(3) - b.unsqueeze(2)).clamp(max=0))        # [B, H, t, s, D]
    A = (kc.unsqueeze(3) * kc.unsqueeze(2) * decay).sum(-1).tril(-1)
    P = (qc.unsqueeze(3) * kc.unsqueeze(2) * decay).sum(-1).tril()
    return A, P


def kda(h: torch.Tensor, mm: Products, cfg: KimiConfig) -> torch.Tensor:
    """Kimi Delta Attention on the normed input h [B, T, n_embd]."""
    w, H, D, eps = mm.w, cfg.n_head, cfg.kda_head_dim, cfg.rms_eps
    heads = lambda x: x.reshape(*x.shape[:2], H, D)
    q = heads(short_conv_silu(mm.linear(T.ATTN_Q, h), w(T.SSM_CONV1D_Q)))
    k = heads(short_conv_silu(mm.linear(T.ATTN_K, h), w(T.SSM_CONV1D_K)))
    v = heads(short_conv_silu(mm.linear(T.ATTN_V, h), w(T.SSM_CONV1D_V)))
    q, k = ops.l2_norm(q, eps), ops.l2_norm(k, eps)
    u = mm.linear(T.SSM_F_B, mm.linear(T.SSM_F_A, h)) + w(T.SSM_DT_BIAS)
    A = w(T.SSM_A).reshape(H, 1)
    if cfg.gate_lower_bound is not None:          # K3: an activation swap into (lb, 0), not a clamp
        g = cfg.gate_lower_bound * torch.sigmoid(-(heads(u) * A))
    else:
        g = heads(ops.softplus(u)) * A
    beta = torch.sigmoid(mm.linear(T.SSM_BETA, h))
    o = ops.rms_norm(delta_rule_chunked(q, k, v, g, beta), eps) * w(T.SSM_NORM)
    gated = o * torch.sigmoid(heads(mm.linear(T.SSM_G, h)))
    return mm.linear(T.ATTN_OUT, gated.reshape(*h.shape[:2], H * D))


# ------------------------------------------------------------------------------------
# MLA, NoPE, absorbed (§3.5), and the K3.1 lightning indexer

def causal(n_tok: int, device) -> torch.Tensor:
    return torch.ones(n_tok, n_tok, dtype=torch.bool, device=device).tril()


def lightning_indexer(h, c_q, mm: Products, cfg: KimiConfig) -> torch.Tensor:
    """keep [B, T, T]: the min(top_k, t+1) earlier tokens of best score sum_h w_h relu(q_h . k) (no RoPE)."""
    ix, w = cfg.indexer, mm.w
    B, n_tok = h.shape[:2]
    q = mm.linear(T.INDEXER_Q_B, c_q).reshape(B, n_tok, ix.n_head, ix.head_dim)
    k = ops.layer_norm(mm.linear(T.INDEXER_K, h), ix.norm_eps) * w(T.INDEXER_K_NORM) + w(T.INDEXER_K_NORM_BIAS)
    wts = mm.linear(T.INDEXER_PROJ, h) * (1 / math.sqrt(ix.head_dim * ix.n_head))
    score = (torch.relu(torch.einsum("bthd,bsd->bhts", q, k)) * wts.permute(0, 2, 1).unsqueeze(-1)).sum(1)
    mask = causal(n_tok, h.device)
    score = score.masked_fill(~mask, float("-inf"))
    if ix.top_k >= n_tok:
        return mask.expand(B, n_tok, n_tok)
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :ix.top_k]
    keep = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, order, True)
    return keep & mask


def mla(h: torch.Tensor, mm: Products, cfg: KimiConfig) -> torch.Tensor:
    """Multi-head latent attention, absorbed, over the cache rows [c_s; kp_s] of each sequence."""
    w = mm.w
    B, n_tok = h.shape[:2]
    H, r, d_n, d_r = cfg.n_head, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    c_q = None
    if w.has(T.ATTN_Q_A_NORM):
        c_q = ops.rms_norm(mm.linear(T.ATTN_Q_A, h), cfg.rms_eps) * w(T.ATTN_Q_A_NORM)
        q = mm.linear(T.ATTN_Q_B, c_q)
    else:
        q = mm.linear(T.ATTN_Q, h)
    q = q.reshape(B * n_tok, H, d_n + d_r)
    keep = lightning_indexer(h, c_q, mm, cfg) if cfg.indexer is not None and w.has(T.INDEXER_Q_B) \
        else causal(n_tok, h.device).expand(B, n_tok, n_tok)
    ckv = mm.linear(T.ATTN_KV_A_MQA, h)
    c = ops.rms_norm(ckv[..., :r], cfg.rms_eps) * w(T.ATTN_KV_A_NORM)      # latent, normed
    kp = ckv[..., r:]                                                       # NoPE: not rotated
    qa = mm.per_head(T.ATTN_K_B, q[..., :d_n].contiguous())                 # [N, H, r]
    Q = torch.cat([qa, q[..., d_n:]], dim=-1).reshape(B, n_tok, H, r + d_r)
    K = mm.cache(torch.cat([c, kp], dim=-1))                                # the single KV head, as cached
    V = K[..., :r]                                                          # V = the latent itself
    scores = torch.einsum("bthd,bsd->bhts", Q, K) * (1 / math.sqrt(d_n + d_r))
    p = torch.softmax(scores.masked_fill(~keep.unsqueeze(1), float("-inf")), dim=-1)
    u = torch.einsum("bhts,bsr->bthr", p, V).reshape(B * n_tok, H, r)
    o = mm.per_head(T.ATTN_V_B, u.contiguous()).reshape(B, n_tok, H * cfg.v_head_dim)
    if w.has(T.ATTN_GATE):                        # the gate reads the normed layer input
        o = o * torch.sigmoid(mm.linear(T.ATTN_GATE, h))
    return mm.linear(T.ATTN_OUT, o)


# ------------------------------------------------------------------------------------
# FFN (§3.3, §3.7, §3.8)

def dense_ffn(x: torch.Tensor, mm: Products, cfg: KimiConfig) -> torch.Tensor:
    act = ops.situ(mm.linear(T.FFN_GATE, x), mm.linear(T.FFN_UP, x), cfg.situ_beta, cfg.situ_linear_beta)
    return mm.linear(T.FFN_DOWN, act)


def route(x: torch.Tensor, mm: Products, cfg: KimiConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(selected [N, k], weights [N, k]): the bias chooses, the unbiased sigmoid scores weigh."""
    s = torch.sigmoid(mm.linear(T.FFN_GATE_INP, x))
    biased = s + mm.w(T.FFN_EXP_PROBS_B)
    sel = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :cfg.n_expert_used]
    wts = torch.gather(s, 1, sel)
    if cfg.expert_weights_norm:
        wts = wts / torch.clamp(wts.double().sum(1, keepdim=True).float(), min=6.103515625e-5)
    if cfg.expert_weights_scale not in (0.0, 1.0):
        wts = wts * cfg.expert_weights_scale
    return sel, wts


def routed_experts(z: torch.Tensor, sel: torch.Tensor, wts: torch.Tensor, mm: Products,
                   cfg: KimiConfig) -> torch.Tensor:
    """sum over slots of w * down_e SiTU(gate_e z, up_e z); each expert read once, for all its tokens (the
    (token, slot) pairs sorted by expert once, then taken a run at a time)."""
    y = torch.zeros(z.shape[0], mm.w.source.shape(mm.w.name(T.FFN_DOWN_EXPS))[1], device=z.device)
    k = sel.shape[1]
    order = torch.argsort(sel.reshape(-1), stable=True)
    counts = torch.bincount(sel.reshape(-1), minlength=cfg.n_expert).tolist()
    start = 0
    for e, n in enumerate(counts):
        if n:
            pairs = order[start:start + n]
            tokens, slots = pairs // k, pairs % k
            y.index_add_(0, tokens, expert_ffn(mm, e, z[tokens], cfg) * wts[tokens, slots].unsqueeze(-1))
        start += n
    return y


def expert_ffn(mm: Products, e: int, x: torch.Tensor, cfg: KimiConfig) -> torch.Tensor:
    """Routed expert e on its tokens' inputs x [n, n_lat]: down_e SiTU(gate_e x, up_e x)."""
    gate = mm.expert(T.FFN_GATE_EXPS, e, mm.w.expert(T.FFN_GATE_EXPS, e), x)
    up = mm.expert(T.FFN_UP_EXPS, e, mm.w.expert(T.FFN_UP_EXPS, e), x)
    act = ops.situ(gate, up, cfg.situ_beta, cfg.situ_linear_beta)
    return mm.expert(T.FFN_DOWN_EXPS, e, mm.w.expert(T.FFN_DOWN_EXPS, e), act)


# ------------------------------------------------------------------------------------
# the run

@dataclass
class LayerReport:
    """What one layer did: the bytes it read and the seconds it took."""
    layer: int
    bytes_read: int
    seconds: float = 0.0


@dataclass
class Engine:
    """Runs token chunks through a model, layer by layer. `stats` sees every weight product's input."""
    source: WeightSource
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    stats: Stats | None = None
    slab_tokens: int = 4096          # tokens in one attention slab (whole chunks)
    rounding: bool = True            # llama.cpp's activation rounding before each weight product (ops)
    routed: bool = True              # False: the routed experts are skipped (the dry run times the rest alone)

    @property
    def cfg(self) -> KimiConfig:
        return self.source.config

    def embed(self, ids: np.ndarray, states: TokenStates) -> None:
        """The residual stream starts at the token embeddings (ids [C, T])."""
        rows = self.source.rows(T.TOKEN_EMBD, ids.reshape(-1).astype(np.int64))
        states.set_stream(rows)

    def layer(self, il: int, states: TokenStates) -> LayerReport:
        cfg, B = self.cfg, self.cfg.attn_res_block_size
        before, started = self.source.bytes_read, time.perf_counter()
        w = Layer(self.source, il, self.device)
        mm = Products(w, self.stats, self.rounding)
        reset = B > 0 and il % B == 0
        if reset:
            states.bank_stream()                  # bank the raw P, then restart the block sum
        ffn_in = torch.empty(states.n_tokens, cfg.n_embd, device=self.device)
        for rows in states.slabs(self.slab_tokens):
            P, stack = states.stream(rows, self.device), states.banks(rows, self.device)
            before_bank = stack[:-1] if reset else stack
            a = attn_res_mix(before_bank, P, w(T.ATTN_RES_SCORE), cfg.rms_eps) if B else P
            h = (ops.rms_norm(a, cfg.rms_eps) * w(T.ATTN_NORM)).reshape(-1, states.ctx, cfg.n_embd)
            o = (kda(h, mm, cfg) if cfg.is_kda(il) else mla(h, mm, cfg)).reshape(P.shape)
            P = o if reset else P + o
            f = attn_res_mix(stack, P, w(T.FFN_RES_SCORE), cfg.rms_eps) if B else P
            ffn_in[rows] = ops.rms_norm(f, cfg.rms_eps) * w(T.FFN_NORM)
            states.set_stream(P, rows)
        self.ffn(il, ffn_in, states, mm)
        w.drop()
        return LayerReport(il, self.source.bytes_read - before, time.perf_counter() - started)

    def ffn(self, il: int, x: torch.Tensor, states: TokenStates, mm: Products) -> None:
        """P += FFN(x) over all tokens."""
        cfg = self.cfg
        if not cfg.is_moe(il):
            for rows in states.slabs(self.slab_tokens):
                states.add_stream(dense_ffn(x[rows], mm, cfg), rows)
            return
        sel, wts = route(x, mm, cfg)
        z = mm.linear(T.FFN_ROUTED_DOWN, x) if mm.w.has(T.FFN_ROUTED_DOWN) else x
        y = routed_experts(z, sel, wts, mm, cfg) if self.routed else torch.zeros_like(z)
        del z
        if mm.w.has(T.FFN_ROUTED_NORM):
            y = ops.rms_norm(y, cfg.rms_eps) * mm.w(T.FFN_ROUTED_NORM)
        if mm.w.has(T.FFN_ROUTED_UP):
            y = mm.linear(T.FFN_ROUTED_UP, y)
        if mm.w.has(T.FFN_GATE_SHEXP):                   # shared experts read the un-projected x
            sh = ops.situ(mm.linear(T.FFN_GATE_SHEXP, x), mm.linear(T.FFN_UP_SHEXP, x),
                          cfg.situ_beta, cfg.situ_linear_beta)
            y = y + mm.linear(T.FFN_DOWN_SHEXP, sh)
        states.add_stream(y)

    def head(self) -> Layer:
        """The global tensors (final AttnRes, norm, `output`), read once however many slabs use them."""
        return Layer(self.source, None, self.device)

    def final_hidden(self, states: TokenStates, rows: slice, g: Layer | None = None) -> torch.Tensor:
        """The final normed hidden state of `rows` (what `output` multiplies)."""
        g = g if g is not None else self.head()
        P, stack = states.stream(rows, self.device), states.banks(rows, self.device)
        y = attn_res_mix(stack, P, g(T.OUTPUT_RES_SCORE), self.cfg.rms_eps) if self.cfg.attn_res_block_size else P
        return ops.rms_norm(y, self.cfg.rms_eps) * g(T.OUTPUT_NORM)

    def logits(self, h: torch.Tensor, head: Layer) -> torch.Tensor:
        """The logits of final hidden states h [n, n_embd]: llama.cpp's last product (the embedding when tied)."""
        return Products(head, self.stats, self.rounding).linear(T.OUTPUT if head.has(T.OUTPUT) else T.TOKEN_EMBD, h)

    def run(self, ids: np.ndarray, states: TokenStates, on_layer: Callable[[LayerReport], None] | None = None,
            start: int = 0) -> None:
        """Every layer from `start` (a resumed run has its states already), reporting each."""
        if start == 0:
            self.embed(ids, states)
        for il in range(start, self.cfg.n_layer):
            report = self.layer(il, states)
            if on_layer is not None:
                on_layer(report)
