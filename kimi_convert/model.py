"""The one model description: Kimi-K3 / K3.1 hyper-parameters and layer layout.

Built from an HF config.json (converter, reference checks) or from GGUF metadata
(runtime, verifier); `gguf_metadata()` is the inverse of `from_gguf()`, so the
two paths cannot drift apart.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gguf import GGUFValueType as VT

from .constants import (ARCH_K31, EXPERT_GATING_SIGMOID, HF_ARCHITECTURES, Key, key)
from .errors import ConfigError

# dsa_config spellings accepted for each field (k31-indexer.md: "decided")
DSA_ALIASES = {
    "n_head": ("index_n_heads", "num_heads", "n_heads", "head_count"),
    "head_dim": ("index_head_dim", "head_dim", "key_length"),
    "top_k": ("index_topk", "topk", "top_k"),
    "layers": ("layers", "dsa_layers", "indexer_layers"),
}


@dataclass(frozen=True)
class IndexerConfig:
    """K3.1 lightning indexer (DSA) on the full-attention layers."""
    n_head: int
    head_dim: int
    top_k: int
    norm_eps: float


@dataclass(frozen=True)
class KimiConfig:
    arch: str
    n_layer: int
    n_embd: int
    n_vocab: int
    n_ctx_train: int
    n_head: int                 # MLA and KDA heads alike
    rms_eps: float
    # KDA
    kda_head_dim: int
    conv_kernel: int
    gate_lower_bound: float | None
    # MLA (NoPE, absorbed in GGUF)
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # FFN / MoE
    n_ff: int                   # dense FFN width
    n_dense_layers: int
    n_expert: int
    n_expert_used: int
    n_expert_shared: int
    n_ff_exp: int
    n_latent: int               # 0 = experts run at n_embd
    expert_weights_norm: bool
    expert_weights_scale: float
    # activation and residuals
    situ_beta: float
    situ_linear_beta: float
    attn_res_block_size: int
    full_attn_layers: tuple[int, ...]   # 0-based MLA layers
    indexer: IndexerConfig | None = None
    experts_mxfp4: bool = False
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # --- layer layout ---
    def is_mla(self, il: int) -> bool:
        return il in self.full_attn_layers

    def is_kda(self, il: int) -> bool:
        return not self.is_mla(il)

    def is_moe(self, il: int) -> bool:
        return il >= self.n_dense_layers

    def has_indexer(self, il: int) -> bool:
        return self.indexer is not None and self.is_mla(il)

    @property
    def d_inner(self) -> int:
        return self.n_head * self.kda_head_dim

    @property
    def n_lat(self) -> int:
        return self.n_latent or self.n_embd

    def with_top_k(self, top_k: int) -> "KimiConfig":
        if self.indexer is None:
            raise ConfigError(f"{self.arch} has no indexer: top_k cannot be set")
        return replace(self, indexer=replace(self.indexer, top_k=top_k))

    # --- from HF ---
    @classmethod
    def from_hf_dir(cls, hf_dir: Path) -> "KimiConfig":
        path = Path(hf_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf(raw, source=str(path))

    @classmethod
    def from_hf(cls, raw: dict, source: str = "config.json") -> "KimiConfig":
        return _parse_hf(raw, source)

    # --- to / from GGUF ---
    def gguf_metadata(self) -> list[tuple[str, Any, VT, VT | None]]:
        """(key, value, type, array element type) for every architecture key."""
        return _gguf_metadata(self)

    @classmethod
    def from_gguf(cls, fields: dict[str, Any]) -> "KimiConfig":
        """From {key: python value} as read from a GGUF file (see gguf_io.open_gguf)."""
        return _from_gguf(fields)


# ------------------------------------------------------------------------------------
# HF parsing

def _parse_hf(raw: dict, source: str) -> KimiConfig:
    archs = raw.get("architectures") or []
    if not archs or archs[0] not in HF_ARCHITECTURES:
        raise ConfigError(f"{source}: unknown architecture {archs[:1] or None}; "
                          f"expected one of {sorted(HF_ARCHITECTURES)}")
    arch = HF_ARCHITECTURES[archs[0]]
    tc = raw.get("text_config")
    if not isinstance(tc, dict):
        raise ConfigError(f"{source}: no text_config object")

    def get(name: str, where: dict = tc, ctx: str = "text_config"):
        if name not in where:
            raise ConfigError(f"{source}: {ctx}.{name} is missing")
        return where[name]

    lac = get("linear_attn_config")
    n_layer = int(get("num_hidden_layers"))
    n_head = int(get("num_attention_heads"))
    _require(source, int(get("num_key_value_heads")) == n_head,
             "num_key_value_heads must equal num_attention_heads (the kv_b split needs it)")
    _require(source, int(get("num_heads", lac, "linear_attn_config")) == n_head,
             "linear_attn_config.num_heads must equal num_attention_heads")
    _require(source, get("mla_use_nope") is True, "mla_use_nope must be true (K3 MLA is NoPE)")
    _require(source, get("hidden_act") == "situ", f"hidden_act {tc.get('hidden_act')!r} is not 'situ'")
    _require(source, get("moe_router_activation_func") == "sigmoid",
             f"moe_router_activation_func {tc.get('moe_router_activation_func')!r} is not 'sigmoid'")

    full = _layer_list(source, get("full_attn_layers", lac, "linear_attn_config"), n_layer,
                       "linear_attn_config.full_attn_layers")
    kda = _layer_list(source, lac.get("kda_layers", []), n_layer, "linear_attn_config.kda_layers")
    if kda and sorted(set(full) | set(kda)) != list(range(n_layer)) or set(full) & set(kda):
        raise ConfigError(f"{source}: linear_attn_config kda_layers and full_attn_layers "
                          f"must partition layers 1..{n_layer}")

    rms_eps = float(get("rms_norm_eps"))
    qcfg = tc.get("quantization_config") or raw.get("quantization_config") or {}
    mxfp4 = (qcfg.get("quant_method") == "compressed-tensors"
             and qcfg.get("format") == "mxfp4-pack-quantized")
    n_lat = int(tc.get("routed_expert_hidden_size") or 0)
    n_ff_exp = int(get("moe_intermediate_size"))
    if mxfp4 and (n_ff_exp % 32 or (n_lat or int(get("hidden_size"))) % 32):
        raise ConfigError(f"{source}: MXFP4 experts need moe_intermediate_size and "
                          f"routed_expert_hidden_size divisible by 32")

    cfg = KimiConfig(
        arch=arch,
        n_layer=n_layer,
        n_embd=int(get("hidden_size")),
        n_vocab=int(get("vocab_size")),
        n_ctx_train=int(tc.get("max_position_embeddings", 0)),
        n_head=n_head,
        rms_eps=rms_eps,
        kda_head_dim=int(get("head_dim", lac, "linear_attn_config")),
        conv_kernel=int(get("short_conv_kernel_size", lac, "linear_attn_config")),
        gate_lower_bound=(None if lac.get("gate_lower_bound") is None
                          else float(lac["gate_lower_bound"])),
        q_lora_rank=int(tc.get("q_lora_rank") or 0),
        kv_lora_rank=int(get("kv_lora_rank")),
        qk_nope_head_dim=int(get("qk_nope_head_dim")),
        qk_rope_head_dim=int(get("qk_rope_head_dim")),
        v_head_dim=int(get("v_head_dim")),
        n_ff=int(get("intermediate_size")),
        n_dense_layers=int(tc.get("first_k_dense_replace", 0)),
        n_expert=int(get("num_experts")),
        n_expert_used=int(get("num_experts_per_token")),
        n_expert_shared=int(get("num_shared_experts")),
        n_ff_exp=n_ff_exp,
        n_latent=n_lat,
        expert_weights_norm=bool(tc.get("moe_renormalize", True)),
        expert_weights_scale=float(tc.get("routed_scaling_factor", 1.0)),
        situ_beta=float(get("activation_situ_beta")),
        situ_linear_beta=float(get("activation_situ_linear_beta")),
        attn_res_block_size=int(get("attn_res_block_size")),
        full_attn_layers=tuple(full),
        indexer=_parse_indexer(source, tc, lac, full, n_layer, rms_eps) if arch == ARCH_K31 else None,
        experts_mxfp4=mxfp4,
        extra={"bos_token_id": tc.get("bos_token_id", raw.get("bos_token_id")),
               "eos_token_id": tc.get("eos_token_id", raw.get("eos_token_id")),
               "pad_token_id": tc.get("pad_token_id", raw.get("pad_token_id"))},
    )
    if arch == ARCH_K31 and cfg.q_lora_rank <= 0:
        raise ConfigError(f"{source}: kimi-k31 needs q_lora_rank > 0 (the indexer reads the q latent)")
    return cfg


def _require(source: str, ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(f"{source}: {message}")


def _layer_list(source: str, one_based: Any, n_layer: int, what: str) -> list[int]:
    """1-indexed HF layer list -> sorted 0-based list, range-checked."""
    if not isinstance(one_based, list) or not all(isinstance(i, int) for i in one_based):
        raise ConfigError(f"{source}: {what} must be a list of layer numbers")
    bad = [i for i in one_based if not 1 <= i <= n_layer]
    if bad:
        raise ConfigError(f"{source}: {what} has layers outside 1..{n_layer}: {bad}")
    return sorted(i - 1 for i in set(one_based))


def _pick(source: str, where: dict, field_name: str, ctx: str):
    for alias in DSA_ALIASES[field_name]:
        if alias in where:
            return where[alias]
    return None


def _parse_indexer(source, tc, lac, full, n_layer, rms_eps) -> IndexerConfig:
    dsa = tc.get("dsa_config")
    if dsa is None:
        dsa = {k: tc[k] for k in ("index_n_heads", "index_head_dim", "index_topk") if k in tc}
        if not dsa:
            raise ConfigError(f"{source}: KimiK31 checkpoint has no text_config.dsa_config")
    values = {f: _pick(source, dsa, f, "dsa_config") for f in DSA_ALIASES}
    for f in ("n_head", "head_dim", "top_k"):
        if not isinstance(values[f], int) or values[f] <= 0:
            raise ConfigError(f"{source}: dsa_config needs a positive {'|'.join(DSA_ALIASES[f])} "
                              f"(got {values[f]!r})")
    if values["layers"] is not None:
        dsa_layers = _layer_list(source, values["layers"], n_layer, "dsa_config layer list")
        if dsa_layers != list(full):
            raise ConfigError(
                f"{source}: dsa_config layer list {sorted(i + 1 for i in dsa_layers)} does not equal "
                f"linear_attn_config.full_attn_layers {sorted(i + 1 for i in full)}")
    return IndexerConfig(n_head=values["n_head"], head_dim=values["head_dim"],
                         top_k=values["top_k"], norm_eps=rms_eps)


# ------------------------------------------------------------------------------------
# GGUF metadata, both directions

def _gguf_metadata(c: KimiConfig) -> list[tuple[str, Any, VT, VT | None]]:
    a = c.arch
    u32, f32, b = VT.UINT32, VT.FLOAT32, VT.BOOL
    kv: list[tuple[str, Any, VT, VT | None]] = [
        (Key.CONTEXT_LENGTH, c.n_ctx_train, u32, None),
        (Key.EMBEDDING_LENGTH, c.n_embd, u32, None),
        (Key.BLOCK_COUNT, c.n_layer, u32, None),
        (Key.FEED_FORWARD_LENGTH, c.n_ff, u32, None),
        (Key.VOCAB_SIZE, c.n_vocab, u32, None),
        (Key.HEAD_COUNT, c.n_head, u32, None),
        # INT32 elements: llama.cpp's converter writes Python int lists so (GGUFValueType.get_type)
        (Key.HEAD_COUNT_KV, [1 if c.is_mla(i) else 0 for i in range(c.n_layer)], VT.ARRAY, VT.INT32),
        (Key.RMS_EPS, c.rms_eps, f32, None),
        (Key.EXPERT_COUNT, c.n_expert, u32, None),
        (Key.EXPERT_USED_COUNT, c.n_expert_used, u32, None),
        (Key.EXPERT_GROUP_USED_COUNT, 1, u32, None),
        (Key.EXPERT_GATING_FUNC, EXPERT_GATING_SIGMOID, u32, None),
        (Key.SSM_CONV_KERNEL, c.conv_kernel, u32, None),
        (Key.KDA_HEAD_DIM, c.kda_head_dim, u32, None),
        (Key.KV_LORA_RANK, c.kv_lora_rank, u32, None),
        (Key.ROPE_DIMENSION_COUNT, c.qk_rope_head_dim, u32, None),
        (Key.KEY_LENGTH, c.kv_lora_rank + c.qk_rope_head_dim, u32, None),
        (Key.VALUE_LENGTH, c.kv_lora_rank, u32, None),
        (Key.KEY_LENGTH_MLA, c.qk_nope_head_dim + c.qk_rope_head_dim, u32, None),
        (Key.VALUE_LENGTH_MLA, c.v_head_dim, u32, None),
        (Key.EXPERT_FEED_FORWARD_LENGTH, c.n_ff_exp, u32, None),
        (Key.EXPERT_SHARED_COUNT, c.n_expert_shared, u32, None),
        (Key.LEADING_DENSE_BLOCK_COUNT, c.n_dense_layers, u32, None),
        (Key.EXPERT_WEIGHTS_SCALE, c.expert_weights_scale, f32, None),
        (Key.EXPERT_WEIGHTS_NORM, c.expert_weights_norm, b, None),
        (Key.SITU_BETA, c.situ_beta, f32, None),
        (Key.SITU_LINEAR_BETA, c.situ_linear_beta, f32, None),
        (Key.ATTN_RES_BLOCK_SIZE, c.attn_res_block_size, u32, None),
    ]
    if c.q_lora_rank:
        kv.append((Key.Q_LORA_RANK, c.q_lora_rank, u32, None))
    if c.gate_lower_bound is not None:
        kv.append((Key.KDA_GATE_LOWER_BOUND, c.gate_lower_bound, f32, None))
    if c.n_latent:
        kv.append((Key.EXPERT_LATENT_LENGTH, c.n_latent, u32, None))
    if c.indexer is not None:
        ix = c.indexer
        kv += [
            (Key.INDEXER_HEAD_COUNT, ix.n_head, u32, None),
            (Key.INDEXER_KEY_LENGTH, ix.head_dim, u32, None),
            (Key.INDEXER_TOP_K, ix.top_k, u32, None),
            (Key.INDEXER_TYPES, [c.has_indexer(i) for i in range(c.n_layer)], VT.ARRAY, VT.BOOL),
            (Key.LAYER_NORM_EPS, ix.norm_eps, f32, None),
        ]
    return [(key(k, a), v, t, s) for k, v, t, s in kv]


def _from_gguf(f: dict[str, Any]) -> KimiConfig:
    arch = f.get("general.architecture")
    if arch not in HF_ARCHITECTURES.values():
        raise ConfigError(f"GGUF architecture {arch!r} is not kimi-k3 or kimi-k31")

    def g(k: str, default: Any = ...):
        name = key(k, arch)
        if name in f:
            return f[name]
        if default is ...:
            raise ConfigError(f"GGUF metadata key {name} is missing")
        return default

    n_layer = int(g(Key.BLOCK_COUNT))
    kv_heads = g(Key.HEAD_COUNT_KV)
    if not isinstance(kv_heads, list) or len(kv_heads) != n_layer:
        raise ConfigError(f"{arch}.attention.head_count_kv must be a per-layer array of {n_layer}")
    full = tuple(i for i, h in enumerate(kv_heads) if h)
    indexer = None
    if arch == ARCH_K31:
        types = g(Key.INDEXER_TYPES, None)
        if types is not None and [bool(t) for i, t in enumerate(types) if i in full] != [True] * len(full):
            raise ConfigError(f"{arch}.attention.indexer.types: every MLA layer must own an indexer")
        indexer = IndexerConfig(n_head=int(g(Key.INDEXER_HEAD_COUNT)), head_dim=int(g(Key.INDEXER_KEY_LENGTH)),
                                top_k=int(g(Key.INDEXER_TOP_K)),
                                norm_eps=float(g(Key.LAYER_NORM_EPS, g(Key.RMS_EPS))))
    key_mla = int(g(Key.KEY_LENGTH_MLA))
    rope = int(g(Key.ROPE_DIMENSION_COUNT))
    lb = g(Key.KDA_GATE_LOWER_BOUND, None)
    return KimiConfig(
        arch=arch, n_layer=n_layer, n_embd=int(g(Key.EMBEDDING_LENGTH)),
        n_vocab=int(g(Key.VOCAB_SIZE, 0)) or len(f.get("tokenizer.ggml.tokens", [])),
        n_ctx_train=int(g(Key.CONTEXT_LENGTH)), n_head=int(g(Key.HEAD_COUNT)),
        rms_eps=float(g(Key.RMS_EPS)),
        kda_head_dim=int(g(Key.KDA_HEAD_DIM)), conv_kernel=int(g(Key.SSM_CONV_KERNEL)),
        gate_lower_bound=None if lb is None else float(lb),
        q_lora_rank=int(g(Key.Q_LORA_RANK, 0)), kv_lora_rank=int(g(Key.KV_LORA_RANK)),
        qk_nope_head_dim=key_mla - rope, qk_rope_head_dim=rope,
        v_head_dim=int(g(Key.VALUE_LENGTH_MLA)),
        n_ff=int(g(Key.FEED_FORWARD_LENGTH)), n_dense_layers=int(g(Key.LEADING_DENSE_BLOCK_COUNT, 0)),
        n_expert=int(g(Key.EXPERT_COUNT)), n_expert_used=int(g(Key.EXPERT_USED_COUNT)),
        n_expert_shared=int(g(Key.EXPERT_SHARED_COUNT)), n_ff_exp=int(g(Key.EXPERT_FEED_FORWARD_LENGTH)),
        n_latent=int(g(Key.EXPERT_LATENT_LENGTH, 0)),
        expert_weights_norm=bool(g(Key.EXPERT_WEIGHTS_NORM, False)),
        expert_weights_scale=float(g(Key.EXPERT_WEIGHTS_SCALE, 1.0)),
        situ_beta=float(g(Key.SITU_BETA)), situ_linear_beta=float(g(Key.SITU_LINEAR_BETA)),
        attn_res_block_size=int(g(Key.ATTN_RES_BLOCK_SIZE)),
        full_attn_layers=full, indexer=indexer,
    )


def a_log_padded_length(n_head: int) -> int:
    """Real checkpoints pad A_log to a multiple of 128 (96 -> 128)."""
    return math.ceil(n_head / 128) * 128
