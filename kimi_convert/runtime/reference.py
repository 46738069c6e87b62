"""Reference forward pass of Kimi-K3 / Kimi-K3.1-Pro, read straight from the Hugging Face checkpoint.

This is the "what the original checkpoint computes" side of `kimi-verify`. It deliberately shares no code
with the GGUF path: it reads `config.json` (nested `text_config`), `model.safetensors.index.json` and the
shards with `safetensors.safe_open(..., framework="pt")`, uses HF tensor names and HF semantics (un-absorbed
MLA, compressed-tensors MXFP4 experts, separate `*_res_norm` / `*_res_proj`), and computes everything in
float32 with weights upcast from bf16. A bug shared by the converter and this file would therefore have to
be written twice.

Where llama.cpp and the HF code disagree (see k3-gguf-and-math.md §4.1) we follow llama.cpp, because the
verifier compares against a llama.cpp-semantics runtime:
  * every RMSNorm uses `rms_norm_eps` (HF uses 1e-6 for q_a/kv_a; `hf_mla_eps=True` restores that),
  * the KDA q/k L2 norm is x / sqrt(sum x^2 + rms_norm_eps),
  * the residual / AttnRes stream stays in float32 (HF rounds it to bf16).

A quantized GGUF is checked against this reference run on the file's own weights: `weight_overrides`
hands the model, per HF tensor name, the values to use instead of the stored ones (kimi-verify passes the
file's dequantized tensors, mapped back to HF names and layout). Everything else is read from the checkpoint.

Public API: `ReferenceModel`, `dequantize_mxfp4`, `E2M1_VALUES`.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.nn.functional as F
from safetensors import safe_open

from .margins import RoutingMargins

__all__ = ["ReferenceModel", "dequantize_mxfp4", "E2M1_VALUES", "ReferenceConfig"]

# Checkpoints up to this size are decoded once and kept (fixtures, small slices); bigger ones are
# re-read per layer so that a 1.5 TB model never sits in memory as fp32.
_AUTO_CACHE_BYTES = 4 << 30


# ----------------------------------------------------------------------------------------------------
# MXFP4 (compressed-tensors "mxfp4-pack-quantized")

# E2M1 code -> value. Codes 8..15 are the sign-flipped 0..7.
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    """Decode `weight_packed` U8 [rows, cols/2] + `weight_scale` U8 [rows, cols/32] to float32 [rows, cols].

    Element 2i of a row is the low nibble of byte i, element 2i+1 the high nibble. Each run of 32
    consecutive inputs shares one E8M0 scale byte b meaning 2^(b-127) (b = 255 is NaN in E8M0).
    """
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise TypeError(f"MXFP4 tensors must be uint8, got {packed.dtype} / {scale.dtype}")
    if packed.dim() != 2:
        raise ValueError(f"weight_packed must be 2-D, got shape {tuple(packed.shape)}")
    rows, cols = packed.shape[0], packed.shape[1] * 2
    if cols % group_size or tuple(scale.shape) != (rows, cols // group_size):
        raise ValueError(f"weight_scale shape {tuple(scale.shape)} does not fit packed {tuple(packed.shape)}")
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(rows, cols).long()
    values = E2M1_VALUES[codes]
    # Powers of two computed in float64 are exact; the cast keeps them exact down to 2^-127 (subnormal).
    factor = torch.pow(torch.tensor(2.0, dtype=torch.float64), scale.to(torch.float64) - 127.0)
    factor = torch.where(scale == 255, torch.tensor(float("nan"), dtype=torch.float64), factor)
    factor = factor.to(torch.float32)
    return (values.view(rows, cols // group_size, group_size) * factor.unsqueeze(-1)).reshape(rows, cols)


# ----------------------------------------------------------------------------------------------------
# Checkpoint access

_LAYER_RE = re.compile(r"^(?:language_model\.)?(?:model\.)?layers\.(\d+)\.(.+)$")
_GLOBAL_RE = re.compile(r"^(?:language_model\.)?(?:model\.)?(embed_tokens\.weight|norm\.weight|output_attn_res.+)$")
_LM_HEAD_RE = re.compile(r"^(?:language_model\.)?lm_head\.weight$")
_EXPERT_RE = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(w[123])\.(weight|weight_packed|weight_scale)$")


def _canonical_suffix(suffix: str) -> str:
    """Fold the spellings other exporters use onto the HF release names."""
    suffix = suffix.replace("e_score_correction.bias", "e_score_correction_bias")  # llama.cpp-filtered form
    # mlxcel's legacy `self_attention_res.proj_weight` / `.norm_weight` (also mlp_res, output_attn_res).
    suffix = re.sub(r"_res\.(proj|norm)_weight$", r"_res_\1.weight", suffix)
    return suffix


# HF tensor name -> rows (a slice, or None for all) of the float32 values to use instead of the stored tensor,
# in the stored tensor's shape (a numpy array or a tensor). An MXFP4 expert is named by its `weight_packed`
# and stands for the decoded matrix [rows, cols].
WeightOverrides = Mapping[str, Callable[[slice | None], object]]


class _Checkpoint:
    """Name-resolving, lazily-opening reader over the safetensors shards."""

    def __init__(self, hf_dir: str, overrides: WeightOverrides | None = None):
        self.dir = hf_dir
        self.overrides = dict(overrides or {})
        index_path = os.path.join(hf_dir, "model.safetensors.index.json")
        if os.path.exists(index_path):
            with open(index_path) as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
        else:  # un-sharded export: every *.safetensors in the directory
            weight_map = {}
            for fn in sorted(os.listdir(hf_dir)):
                if fn.endswith(".safetensors"):
                    with safe_open(os.path.join(hf_dir, fn), framework="pt") as f:
                        for k in f.keys():
                            weight_map[k] = fn
            if not weight_map:
                raise FileNotFoundError(f"no model.safetensors.index.json or *.safetensors in {hf_dir}")
        self.weight_map = weight_map
        self.nbytes = sum(os.path.getsize(os.path.join(hf_dir, s)) for s in set(weight_map.values()))
        self._handles: dict[str, object] = {}

        # canonical name -> stored name. Layer tensors go to layers[i][suffix], experts to experts[i][(e, w)].
        self.globals: dict[str, str] = {}
        self.layers: dict[int, dict[str, str]] = {}
        self.experts: dict[int, dict[tuple[int, str], dict[str, str]]] = {}
        for name in weight_map:
            if m := _LAYER_RE.match(name):
                il, suffix = int(m.group(1)), _canonical_suffix(m.group(2))
                if em := _EXPERT_RE.match(suffix):
                    slot = self.experts.setdefault(il, {}).setdefault((int(em.group(1)), em.group(2)), {})
                    self._put(slot, em.group(3), name)
                else:
                    self._put(self.layers.setdefault(il, {}), suffix, name)
            elif m := _GLOBAL_RE.match(name):
                self._put(self.globals, _canonical_suffix(m.group(1)), name)
            elif _LM_HEAD_RE.match(name):
                self._put(self.globals, "lm_head.weight", name)
            # anything else (vision_tower.*, mm_projector.*) is not part of the text model

    @staticmethod
    def _put(table: dict, key: str, name: str) -> None:
        if key in table and table[key] != name:
            raise ValueError(f"tensor {key!r} is stored twice: {table[key]!r} and {name!r}")
        table[key] = name

    def _file(self, name: str):
        shard = self.weight_map[name]
        if shard not in self._handles:
            path = os.path.join(self.dir, shard)
            if not os.path.exists(path):
                raise FileNotFoundError(f"shard {shard} (holding {name}) is missing from {self.dir}")
            self._handles[shard] = safe_open(path, framework="pt")
        return self._handles[shard]

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """Stored tensor (or its override); float types come back as float32, U8 stays U8."""
        if name in self.overrides:
            return torch.as_tensor(self.overrides[name](rows), dtype=torch.float32)
        f = self._file(name)
        t = f.get_tensor(name) if rows is None else f.get_slice(name)[rows]
        return t if t.dtype == torch.uint8 else t.to(torch.float32)


# ----------------------------------------------------------------------------------------------------
# Config


def _first(d: dict, keys: tuple[str, ...]):
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    return None


@dataclass
class ReferenceConfig:
    hidden_size: int
    n_layers: int
    rms_norm_eps: float
    attn_res_block_size: int
    # attention layout (0-based)
    mla_layers: frozenset[int]
    dsa_layers: frozenset[int]
    # MLA
    n_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # KDA
    kda_heads: int
    kda_head_dim: int
    gate_lower_bound: float | None
    # FFN / MoE
    situ_beta: float
    situ_linear_beta: float | None
    n_experts_per_tok: int
    renormalize: bool
    routed_scaling_factor: float
    # K3.1 lightning indexer
    index_n_heads: int | None
    index_head_dim: int | None
    index_topk: int | None
    architecture: str

    @classmethod
    def from_hf(cls, raw: dict) -> "ReferenceConfig":
        tc = raw.get("text_config") or raw
        arch = (raw.get("architectures") or tc.get("architectures") or ["?"])[0]
        n_layers = tc["num_hidden_layers"]

        lac = tc.get("linear_attn_config") or {}
        full = lac.get("full_attn_layers")
        if full is None:
            full = [i + 1 for i in range(n_layers) if (i + 1) not in set(lac.get("kda_layers") or [])]
        mla = frozenset(int(i) - 1 for i in full)  # HF lists are 1-indexed
        kda = set(range(n_layers)) - mla
        if lac.get("kda_layers") is not None and set(int(i) - 1 for i in lac["kda_layers"]) != kda:
            raise ValueError("linear_attn_config: kda_layers and full_attn_layers do not partition the layers")

        if tc.get("hidden_act", "situ") != "situ":
            raise ValueError(f"hidden_act {tc.get('hidden_act')!r}: only 'situ' is Kimi-K3")
        if tc.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            raise ValueError("moe_router_activation_func must be 'sigmoid'")
        if not tc.get("mla_use_nope", True):
            raise ValueError("mla_use_nope=false (RoPE MLA) is not Kimi-K3")
        if (_first(tc, ("num_expert_group", "n_group")) or 1) > 1:
            raise ValueError("group-limited routing (num_expert_group > 1) is not Kimi-K3")

        # K3.1 lightning indexer. `text_config.dsa_config` (or top-level `dsa_config`), else DeepSeek-style
        # index_* keys directly in text_config. Never read a bare `top_k` from text_config: that is
        # PretrainedConfig generation noise (top_k: 50).
        dsa = tc.get("dsa_config") or raw.get("dsa_config")
        if dsa is None and "index_topk" in tc:
            dsa = {k: tc[k] for k in ("index_n_heads", "index_head_dim", "index_topk") if k in tc}
        ih = id_ = itopk = None
        dsa_layers: frozenset[int] = frozenset()
        if dsa is not None:
            ih = _first(dsa, ("index_n_heads", "num_heads", "n_heads", "head_count"))
            id_ = _first(dsa, ("index_head_dim", "head_dim", "key_length"))
            itopk = _first(dsa, ("index_topk", "topk", "top_k"))
            if ih is None or id_ is None or itopk is None:
                raise ValueError(f"dsa_config lacks head count, head dim or top_k: {dsa}")
            layers = _first(dsa, ("layers", "dsa_layers", "indexer_layers"))
            dsa_layers = frozenset(int(i) - 1 for i in layers) if layers is not None else mla
            if dsa_layers != mla:
                raise ValueError(
                    f"dsa_config layers {sorted(i + 1 for i in dsa_layers)} must equal full_attn_layers "
                    f"{sorted(i + 1 for i in mla)} (1-indexed)"
                )
        elif "K31" in arch:
            raise ValueError(f"{arch} checkpoint without dsa_config / index_* keys")

        lb = tc.get("activation_situ_linear_beta")
        return cls(
            hidden_size=tc["hidden_size"],
            n_layers=n_layers,
            rms_norm_eps=float(tc.get("rms_norm_eps", 1e-5)),
            attn_res_block_size=int(tc.get("attn_res_block_size") or 0),
            mla_layers=mla,
            dsa_layers=dsa_layers,
            n_heads=tc["num_attention_heads"],
            q_lora_rank=tc.get("q_lora_rank"),
            kv_lora_rank=tc.get("kv_lora_rank", 0),
            qk_nope_head_dim=tc.get("qk_nope_head_dim", 0),
            qk_rope_head_dim=tc.get("qk_rope_head_dim", 0),
            v_head_dim=tc.get("v_head_dim", 0),
            kda_heads=int(lac.get("num_heads") or tc["num_attention_heads"]),
            kda_head_dim=int(lac.get("head_dim") or 0),
            gate_lower_bound=lac.get("gate_lower_bound"),
            situ_beta=float(tc.get("activation_situ_beta", 1.0)),
            situ_linear_beta=None if lb is None or lb <= 0 else float(lb),
            n_experts_per_tok=int(_first(tc, ("num_experts_per_token", "num_experts_per_tok")) or 0),
            renormalize=_first(tc, ("moe_renormalize", "norm_topk_prob")) in (None, True),
            routed_scaling_factor=float(tc.get("routed_scaling_factor") or 1.0),
            index_n_heads=ih,
            index_head_dim=id_,
            index_topk=itopk,
            architecture=arch,
        )


# ----------------------------------------------------------------------------------------------------
# Building blocks (one function per block type; x is always [T, ...] float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)
    return (x - mu) * torch.rsqrt(var + eps) * weight + bias


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    # llama.cpp's form: x / sqrt(sum x^2 + eps), eps = rms_norm_eps (FLA uses 1e-6; negligible).
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def situ(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """SiTU: beta*tanh(g/beta)*sigmoid(g) * U, U = lb*tanh(u/lb) (soft-clipped up branch) when lb > 0."""
    gate = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    up = u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta)
    return gate * up


def attn_res_mix(banked: list[torch.Tensor], current: torch.Tensor, score: torch.Tensor, eps: float) -> torch.Tensor:
    """Block attention residual read: softmax over sources of <RMSNorm(v_j), score>, summed over the RAW v_j.

    `banked` are the sealed block sums (oldest first), `current` the running partial sum. The scores see
    normalised sources so that one big block cannot dominate by scale alone; the mix itself is unnormalised.
    """
    if not banked:
        return current
    v = torch.stack(banked + [current])  # [m+1, T, H]
    s = (rms_norm(v, None, eps) * score).sum(-1)  # [m+1, T]
    p = torch.softmax(s, dim=0)
    return (p.unsqueeze(-1) * v).sum(0)


def short_conv_silu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv (zero history) then SiLU. x [T, C], w [C, 1, K]: y_t = sum_j w[:, j] x_{t-K+1+j}."""
    w = w.reshape(w.shape[0], -1)
    T, K = x.shape[0], w.shape[1]
    xp = torch.cat([x.new_zeros(K - 1, x.shape[1]), x], dim=0)
    y = sum(w[:, j] * xp[j : j + T] for j in range(K))
    return F.silu(y)


def kda_attention(h: torch.Tensor, w: dict, cfg: ReferenceConfig) -> torch.Tensor:
    """Kimi Delta Attention: gated delta rule with a per-channel (key-axis) decay, in HF weight form."""
    T = h.shape[0]
    H, D, eps = cfg.kda_heads, cfg.kda_head_dim, cfg.rms_norm_eps
    if not D:
        D = w["self_attn.q_proj.weight"].shape[0] // H
    q = short_conv_silu(h @ w["self_attn.q_proj.weight"].T, w["self_attn.q_conv1d.weight"]).view(T, H, D)
    k = short_conv_silu(h @ w["self_attn.k_proj.weight"].T, w["self_attn.k_conv1d.weight"]).view(T, H, D)
    v = short_conv_silu(h @ w["self_attn.v_proj.weight"].T, w["self_attn.v_conv1d.weight"]).view(T, H, D)
    q, k = l2_norm(q, eps), l2_norm(k, eps)

    # Decay gate (log-space, per head and key channel). A_log is stored padded (e.g. 96 heads -> 128):
    # only the first H entries are real.
    u = (h @ w["self_attn.f_a_proj.weight"].T) @ w["self_attn.f_b_proj.weight"].T + w["self_attn.dt_bias"]
    u = u.view(T, H, D)
    a = torch.exp(w["self_attn.A_log"].reshape(-1)[:H]).view(1, H, 1)
    if cfg.gate_lower_bound is not None:
        g = cfg.gate_lower_bound * torch.sigmoid(a * u)  # in (lb, 0): a bounded swap, not a clamp
    else:
        g = -a * F.softplus(u)
    beta = torch.sigmoid(h @ w["self_attn.b_proj.weight"].T)  # [T, H]

    # Recurrence. S[h] is D x D with rows = key channel, columns = value channel.
    S = h.new_zeros(H, D, D)
    o = h.new_empty(T, H, D)
    alpha = torch.exp(g)
    for t in range(T):
        S = alpha[t].unsqueeze(-1) * S  # decay along the key axis
        pred = torch.einsum("hij,hi->hj", S, k[t])  # S^T k: what the memory recalls for k_t
        delta = beta[t].unsqueeze(-1) * (v[t] - pred)
        S = S + k[t].unsqueeze(-1) * delta.unsqueeze(1)  # rank-1 write k delta^T
        o[t] = torch.einsum("hij,hi->hj", S, q[t]) / math.sqrt(D)

    o = rms_norm(o, w["self_attn.o_norm.weight"], eps).reshape(T, H * D)
    o = o * torch.sigmoid(h @ w["self_attn.g_proj.weight"].T)
    return o @ w["self_attn.o_proj.weight"].T


def lightning_indexer(
    h: torch.Tensor, c_q: torch.Tensor, w: dict, cfg: ReferenceConfig, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K3.1 DSA key selection. Returns (allowed [T, T] bool, margin [T] float; NaN where all keys are kept).

    No RoPE and no Hadamard: K3.1's indexer is NoPE, and a Hadamard rotation is orthonormal (q.k unchanged).
    """
    T = h.shape[0]
    HI, DI = cfg.index_n_heads, cfg.index_head_dim
    q_i = (c_q @ w["self_attn.indexer.wq_b.weight"].T).view(T, HI, DI)
    k_i = layer_norm(
        h @ w["self_attn.indexer.wk.weight"].T,
        w["self_attn.indexer.k_norm.weight"],
        w["self_attn.indexer.k_norm.bias"],
        cfg.rms_norm_eps,  # dsa_config declares no eps; the model's rms_norm_eps is used (k31-indexer.md)
    )  # [T, DI], one key head shared by all indexer heads
    head_w = (h @ w["self_attn.indexer.weights_proj.weight"].T) / math.sqrt(DI * HI)  # [T, HI]
    score = torch.einsum("th,ths->ts", head_w, torch.relu(torch.einsum("thd,sd->ths", q_i, k_i)))
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    score = score.masked_fill(~causal, float("-inf"))

    # Stable descending sort: ties go to the earlier position, deterministically.
    sorted_score, order = torch.sort(score, dim=-1, descending=True, stable=True)
    n_keep = torch.clamp(torch.arange(T) + 1, max=top_k)  # min(top_k, t+1)
    keep_sorted = torch.arange(T).unsqueeze(0) < n_keep.unsqueeze(1)
    allowed = torch.zeros(T, T, dtype=torch.bool).scatter(1, order, keep_sorted) & causal

    margin = torch.full((T,), float("nan"))
    for t in range(top_k, T):  # only where t+1 > top_k is something rejected
        margin[t] = sorted_score[t, top_k - 1] - sorted_score[t, top_k]
    return allowed, margin


def mla_attention(
    h: torch.Tensor,
    w: dict,
    cfg: ReferenceConfig,
    *,
    mla_eps: float,
    dsa_top_k: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Un-absorbed NoPE MLA with sigmoid output gate; with `dsa_top_k`, masked to the indexer's selection."""
    T = h.shape[0]
    nh, dn, dr, dv, kr = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank

    c_q = None
    if "self_attn.q_a_proj.weight" in w:
        c_q = rms_norm(h @ w["self_attn.q_a_proj.weight"].T, w["self_attn.q_a_layernorm.weight"], mla_eps)
        q = c_q @ w["self_attn.q_b_proj.weight"].T
    else:
        q = h @ w["self_attn.q_proj.weight"].T
    q = q.view(T, nh, dn + dr)

    ckv = h @ w["self_attn.kv_a_proj_with_mqa.weight"].T  # [T, kr + dr]
    c = rms_norm(ckv[:, :kr], w["self_attn.kv_a_layernorm.weight"], mla_eps)
    k_pe = ckv[:, kr:]  # NoPE: the "rope" slice is used as is, never rotated

    kv_b = w["self_attn.kv_b_proj.weight"].view(nh, dn + dv, kr)  # rows per head: [k_nope(dn); v(dv)]
    k_nope = torch.einsum("hdr,sr->shd", kv_b[:, :dn], c)
    v = torch.einsum("hdr,sr->shd", kv_b[:, dn:], c)
    k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(T, nh, dr)], dim=-1)  # [T, nh, dn+dr]

    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    margin = None
    if dsa_top_k is not None:
        if c_q is None:
            raise ValueError("a DSA layer needs the q-LoRA latent (q_lora_rank > 0)")
        allowed, margin = lightning_indexer(h, c_q, w, cfg, dsa_top_k)

    att = torch.einsum("thd,shd->hts", q, k) / math.sqrt(dn + dr)
    att = torch.softmax(att.masked_fill(~allowed, float("-inf")), dim=-1)
    o = torch.einsum("hts,shd->thd", att, v).reshape(T, nh * dv)
    o = o * torch.sigmoid(h @ w["self_attn.g_proj.weight"].T)  # gate reads the normed layer input
    return o @ w["self_attn.o_proj.weight"].T, margin


def dense_ffn(x: torch.Tensor, w: dict, cfg: ReferenceConfig, prefix: str = "mlp.") -> torch.Tensor:
    g = x @ w[prefix + "gate_proj.weight"].T
    u = x @ w[prefix + "up_proj.weight"].T
    return situ(g, u, cfg.situ_beta, cfg.situ_linear_beta) @ w[prefix + "down_proj.weight"].T


def latent_moe(x: torch.Tensor, w: dict, cfg: ReferenceConfig, expert) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid-routed latent MoE + shared experts. `expert(e)` -> (w1 gate, w3 up, w2 down) in float32.

    Returns (y [T, H], margin [T]) where margin = biased score of the k-th pick - best rejected biased score.
    """
    T = x.shape[0]
    k = cfg.n_experts_per_tok
    scores = torch.sigmoid(x @ w["block_sparse_moe.gate.weight"].T)  # [T, E], router on the full-width x
    biased = scores + w["block_sparse_moe.gate.e_score_correction_bias"]  # bias steers selection only
    sorted_biased, order = torch.sort(biased, dim=-1, descending=True, stable=True)
    sel = order[:, :k]  # [T, k]
    if biased.shape[1] > k:
        margin = sorted_biased[:, k - 1] - sorted_biased[:, k]
    else:
        margin = torch.full((T,), float("inf"))
    weights = scores.gather(1, sel)
    if cfg.renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    weights = weights * cfg.routed_scaling_factor

    z = x @ w["block_sparse_moe.routed_expert_down_proj.weight"].T if (
        "block_sparse_moe.routed_expert_down_proj.weight" in w) else x
    y = z.new_zeros(z.shape)
    for e in torch.unique(sel).tolist():  # ascending expert id: a fixed summation order per token
        w1, w3, w2 = expert(e)  # decoded once per layer call, dropped after use
        for t, slot in (sel == e).nonzero().tolist():
            # One token at a time on purpose: a GEMM over the gathered tokens can round a row differently
            # depending on how many other tokens picked e, which would break exact causality.
            zt = z[t : t + 1]
            out = situ(zt @ w1.T, zt @ w3.T, cfg.situ_beta, cfg.situ_linear_beta) @ w2.T
            y[t] += weights[t, slot] * out[0]
    if "block_sparse_moe.routed_expert_norm.weight" in w:
        y = rms_norm(y, w["block_sparse_moe.routed_expert_norm.weight"], cfg.rms_norm_eps)
    if "block_sparse_moe.routed_expert_up_proj.weight" in w:
        y = y @ w["block_sparse_moe.routed_expert_up_proj.weight"].T

    if "block_sparse_moe.shared_experts.gate_proj.weight" in w:
        y = y + dense_ffn(x, w, cfg, prefix="block_sparse_moe.shared_experts.")  # on the un-projected x
    return y, margin


# ----------------------------------------------------------------------------------------------------
# The model


class ReferenceModel:
    """Kimi-K3 / K3.1-Pro forward pass straight from an HF checkpoint directory.

    Args:
        hf_dir: directory with config.json, model.safetensors.index.json (or *.safetensors) and the shards.
        top_k_override: replace the DSA indexer's top_k (K3.1 only).
        hf_mla_eps: use HF's eps=1e-6 for the q_a / kv_a RMSNorms. Default False = rms_norm_eps, as llama.cpp.
        use_indexer: False runs K3.1's DSA layers as plain dense causal MLA (indexer ignored).
        cache_weights: keep decoded fp32 weights between calls. None = only for checkpoints <= 4 GiB.
        weight_overrides: HF name -> rows of float32 values used instead of that stored tensor (see
            WeightOverrides); every name must be a tensor of the checkpoint.

    After each forward, `last_routing_margins` is a RoutingMargins (runtime.margins, as the runtime's):
        .moe {layer: float32 [T]}, .dsa {layer: float32 [T]}   (0-based layer ids)
    "moe": biased score of the k-th selected expert minus the best rejected one (inf if nothing is rejected);
    "dsa": indexer score of the top_k-th kept key minus the best dropped one, NaN where t+1 <= top_k.
    Small margins flag positions where a selection can flip under rounding.
    """

    def __init__(
        self,
        hf_dir: str,
        *,
        top_k_override: int | None = None,
        hf_mla_eps: bool = False,
        use_indexer: bool = True,
        cache_weights: bool | None = None,
        weight_overrides: WeightOverrides | None = None,
    ):
        self.hf_dir = str(hf_dir)
        with open(os.path.join(self.hf_dir, "config.json")) as f:
            self.raw_config = json.load(f)
        self.cfg = ReferenceConfig.from_hf(self.raw_config)
        self.ckpt = _Checkpoint(self.hf_dir, weight_overrides)
        unknown = sorted(set(self.ckpt.overrides) - set(self.ckpt.weight_map))
        if unknown:
            raise KeyError(f"weight_overrides: {unknown[0]!r} is not a tensor of {self.hf_dir}")
        self.mla_eps = 1e-6 if hf_mla_eps else self.cfg.rms_norm_eps
        if top_k_override is not None and top_k_override < 1:
            raise ValueError("top_k_override must be >= 1")
        self.top_k = top_k_override if top_k_override is not None else self.cfg.index_topk
        self.use_indexer = use_indexer
        self.cache_weights = self.ckpt.nbytes <= _AUTO_CACHE_BYTES if cache_weights is None else cache_weights
        self._layer_cache: dict[int, dict] = {}
        self._expert_cache: dict[tuple[int, int], tuple] = {}
        self._global_cache: dict[str, torch.Tensor] = {}
        self.last_routing_margins = RoutingMargins()
        missing = [i for i in range(self.cfg.n_layers) if i not in self.ckpt.layers]
        if missing:
            raise ValueError(f"no tensors for layers {missing} in {self.hf_dir}")

    @property
    def is_k31(self) -> bool:
        return bool(self.cfg.dsa_layers)

    @property
    def vocab_size(self) -> int:
        return self.ckpt._file(self.ckpt.globals["lm_head.weight"]).get_slice(
            self.ckpt.globals["lm_head.weight"]).get_shape()[0]

    # -- weight loading ------------------------------------------------------------------------------

    def _global(self, key: str) -> torch.Tensor:
        if key not in self.ckpt.globals:
            raise KeyError(f"tensor {key!r} not found in {self.hf_dir}")
        if key in self._global_cache:
            return self._global_cache[key]
        t = self.ckpt.read(self.ckpt.globals[key])
        if self.cache_weights:
            self._global_cache[key] = t
        return t

    def _layer(self, il: int) -> dict:
        """All non-expert tensors of layer il, float32, keyed by HF suffix, plus the fused AttnRes scores."""
        if il in self._layer_cache:
            return self._layer_cache[il]
        w = {suffix: self.ckpt.read(name) for suffix, name in self.ckpt.layers[il].items()}
        if self.cfg.attn_res_block_size > 0:
            for kind in ("self_attention", "mlp"):
                w[f"{kind}_res_score"] = _fused_res_score(w, f"{kind}_res_", il)
        if self.cache_weights:
            self._layer_cache[il] = w
        return w

    def _expert(self, il: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1 gate, w3 up, w2 down) of one routed expert, decoded from MXFP4 (or read if stored dense)."""
        if (il, e) in self._expert_cache:
            return self._expert_cache[(il, e)]
        table = self.ckpt.experts.get(il, {})
        mats = []
        for wk in ("w1", "w3", "w2"):
            names = table.get((e, wk))
            if names is None:
                raise KeyError(f"layer {il}: expert {e} {wk} not in checkpoint")
            if names.get("weight_packed") in self.ckpt.overrides:     # the decoded matrix, given
                mats.append(self.ckpt.read(names["weight_packed"]))
            elif "weight_packed" in names:
                if "weight_scale" not in names:
                    raise KeyError(f"layer {il}: expert {e} {wk}.weight_scale missing")
                mats.append(dequantize_mxfp4(self.ckpt.read(names["weight_packed"]),
                                             self.ckpt.read(names["weight_scale"])))
            else:
                mats.append(self.ckpt.read(names["weight"]))
        out = tuple(mats)
        if self.cache_weights:
            self._expert_cache[(il, e)] = out
        return out

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows; read row by row unless cached, so the [V, H] table is never upcast whole."""
        if self.cache_weights:
            return self._global("embed_tokens.weight")[ids]
        name = self.ckpt.globals["embed_tokens.weight"]
        rows = {i: self.ckpt.read(name, slice(i, i + 1))[0] for i in torch.unique(ids).tolist()}
        return torch.stack([rows[i] for i in ids.tolist()])

    def _lm_head(self, y: torch.Tensor) -> torch.Tensor:
        if self.cache_weights:
            return y @ self._global("lm_head.weight").T
        name = self.ckpt.globals["lm_head.weight"]
        V, chunk = self.vocab_size, 16384
        return torch.cat([y @ self.ckpt.read(name, slice(s, min(s + chunk, V))).T for s in range(0, V, chunk)], 1)

    # -- forward ------------------------------------------------------------------------------------

    @torch.no_grad()
    def _forward(self, token_ids: list[int], keep_layers: bool = False):
        cfg, eps, B = self.cfg, self.cfg.rms_norm_eps, self.cfg.attn_res_block_size
        ids = torch.as_tensor(list(token_ids), dtype=torch.long)
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError("token_ids must be a non-empty list of ints")
        margins = RoutingMargins(n_tokens=len(ids))
        per_layer = []

        P = self._embed(ids)  # running block sum; starts as the embedding
        banked: list[torch.Tensor] = []  # sealed block sums b_0 (= embedding), b_1, ...
        for il in range(cfg.n_layers):
            w = self._layer(il)
            # Read before seal: the pre-attention mix sees P as its "current" source, then P is banked.
            a = attn_res_mix(banked, P, w.get("self_attention_res_score"), eps)
            seal = B > 0 and il % B == 0
            if seal:
                banked.append(P)
            h = rms_norm(a, w["input_layernorm.weight"], eps)

            if il in cfg.mla_layers:
                dsa_top_k = self.top_k if (il in cfg.dsa_layers and self.use_indexer) else None
                o, m = mla_attention(h, w, cfg, mla_eps=self.mla_eps, dsa_top_k=dsa_top_k)
                if m is not None:
                    margins.dsa[il] = m.numpy()
            else:
                o = kda_attention(h, w, cfg)
            P = o if seal else P + o  # a new block's sum restarts from the attention output

            f = attn_res_mix(banked, P, w.get("mlp_res_score"), eps)
            h2 = rms_norm(f, w["post_attention_layernorm.weight"], eps)
            if "block_sparse_moe.gate.weight" in w:
                ff, m = latent_moe(h2, w, cfg, lambda e, il=il: self._expert(il, e))
                margins.moe[il] = m.numpy()
            else:
                ff = dense_ffn(h2, w, cfg)
            P = P + ff
            if keep_layers:
                per_layer.append(P.clone())

        out_score = None
        if B > 0:
            out_score = _fused_res_score(
                {k: self._global(k) for k in ("output_attn_res_norm.weight", "output_attn_res_proj.weight")},
                "output_attn_res_", None)
        y = attn_res_mix(banked, P, out_score, eps)
        y = rms_norm(y, self._global("norm.weight"), eps)
        self.last_routing_margins = margins
        return y, per_layer

    def hidden_states(self, token_ids: list[int], *, all_layers: bool = False):
        """Final normed hidden state [T, H] (the lm_head input).

        With all_layers=True returns (final, [P after layer 0, ..., P after layer L-1]) where P is the
        running (partial block) residual sum at the end of each layer, i.e. llama.cpp's per-layer output.
        """
        y, per_layer = self._forward(token_ids, keep_layers=all_layers)
        return (y, per_layer) if all_layers else y

    @torch.no_grad()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits for every position, float32 [T, vocab]."""
        y, _ = self._forward(token_ids)
        return self._lm_head(y)


def _fused_res_score(w: dict, prefix: str, il: int | None) -> torch.Tensor:
    """AttnRes score vector = RMSNorm weight * projection row (HF keeps them as two tensors)."""
    norm, proj = w.get(prefix + "norm.weight"), w.get(prefix + "proj.weight")
    if norm is None or proj is None:
        where = f"layer {il}" if il is not None else "model"
        raise KeyError(f"{where}: {prefix}norm.weight / {prefix}proj.weight missing (attn_res_block_size > 0)")
    return norm * proj.reshape(-1)
