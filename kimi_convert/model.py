"""The one model description: Kimi-K3 / K3.1 hyper-parameters and layer layout.

Built from an HF config.json (converter, reference checks) or from GGUF metadata
(runtime, verifier); `gguf_metadata()` is the inverse of `from_gguf()`, so the
two paths cannot drift apart.
"""
from __future__ import annotations

import json
import math
import struct
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
        from .inputs import read_json        # a regular file only, opened without blocking
        path = Path(hf_dir) / "config.json"
        raw = read_json(path, MAX_CONFIG_BYTES, ConfigError)
        return cls.from_hf(raw, source=str(path))

    @classmethod
    def from_hf(cls, raw: Any, source: str = "config.json") -> "KimiConfig":
        """`raw`, config.json as parsed, checked field by field (ConfigError naming the field)."""
        return _parse_hf(raw, source)

    # --- to / from GGUF ---
    def gguf_metadata(self) -> list[tuple[str, Any, VT, VT | None]]:
        """(key, value, type, array element type) for every architecture key."""
        return _gguf_metadata(self)

    @classmethod
    def from_gguf(cls, fields: dict[str, Any], source: str = "") -> "KimiConfig":
        """From {key: python value} as read from a GGUF file (see gguf_io.open_gguf); `source` (the file)
        starts every error message."""
        return _from_gguf(fields, str(source))


# ------------------------------------------------------------------------------------
# HF parsing: every value read is typed and range-checked, and a bad one is one ConfigError
# naming the file and the field (text_config.num_hidden_layers)

MAX_CONFIG_BYTES = 16 << 20     # the release's config.json is about 7 KB; a file of 16 MiB is not one
# Integer fields become GGUF UINT32 keys, several read into int32 by llama.cpp; 2^31-1 also keeps
# the sums written as keys (key_length = kv_lora_rank + qk_rope_head_dim) inside 32 bits.
MAX_INT = 2**31 - 1
_REQUIRED = object()


class _Fields:
    """One object of config.json (the top level, text_config, linear_attn_config, ...)."""

    def __init__(self, source: str, values: Any, where: str = ""):
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: {where + ' ' if where else ''}must be a JSON object, "
                              f"not {_show(values)}")
        self.source, self.values, self.where = source, values, where

    def fail(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.source}: {self.where + '.' if self.where else ''}{key} {problem}")

    def raw(self, key: str, default: Any = _REQUIRED) -> Any:
        if key in self.values:
            return self.values[key]
        if default is _REQUIRED:
            raise self.fail(key, "is missing")
        return default

    def int(self, key: str, least: int = 1, optional: bool = False) -> int:
        """An integer (not 9.5, "8" or true) in least..MAX_INT; `optional`: absent or null is 0."""
        value = self.raw(key, None if optional else _REQUIRED)
        if optional and value is None:
            return 0
        if type(value) is not int or not least <= value <= MAX_INT:
            raise self.fail(key, f"must be an integer in {least}..{MAX_INT}, not {_show(value)}")
        return value

    def number(self, key: str, *, above: float | None = None, least: float | None = None,
               default: Any = _REQUIRED) -> float:
        """A number that stays finite as the FLOAT32 GGUF stores it (not NaN, 1e39 or "1e-5")."""
        value = self.raw(key, default)
        if type(value) not in (int, float):
            raise self.fail(key, f"must be a number, not {_show(value)}")
        stored = _as_float32(value)
        if not math.isfinite(stored):
            raise self.fail(key, f"must be a finite float32, not {_show(value)}")
        if (above is not None and not stored > above) or (least is not None and not stored >= least):
            bound = f"above {above}" if above is not None else f"at least {least}"
            raise self.fail(key, f"must be {bound}, not {_show(value)}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw(key, default)
        if type(value) is not bool:
            raise self.fail(key, f"must be true or false, not {_show(value)}")
        return value

    def section(self, key: str) -> "_Fields":
        return _Fields(self.source, self.raw(key), f"{self.where}.{key}" if self.where else key)

    def layers(self, key: str, n_layer: int, default: Any = _REQUIRED) -> list[int]:
        """A 1-indexed HF layer list -> sorted 0-based; each layer once, within 1..n_layer."""
        value = self.raw(key, default)
        if type(value) is not list or not all(type(i) is int for i in value):
            raise self.fail(key, f"must be a list of layer numbers, not {_show(value)}")
        bad = [i for i in value if not 1 <= i <= n_layer]
        if bad:
            raise self.fail(key, f"has layers outside 1..{n_layer}: {bad[:8]}{' ...' if len(bad) > 8 else ''}")
        seen: set[int] = set()
        twice = next((i for i in value if i in seen or seen.add(i)), None)
        if twice is not None:
            raise self.fail(key, f"lists layer {twice} more than once")
        return sorted(i - 1 for i in value)


def _as_float32(value: float) -> float:
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:           # beyond float32 (or, an int, beyond float64)
        return math.inf


def _show(value: Any, limit: int = 40) -> str:
    """A value as config.json spells it (null, true, "8", NaN), cut short."""
    text = json.dumps(value, default=repr)
    return text if len(text) <= limit else text[:limit] + "..."


def _parse_hf(raw: Any, source: str) -> KimiConfig:
    top = _Fields(source, raw)
    arch = _architecture(top)
    tc = top.section("text_config")
    lac = tc.section("linear_attn_config")
    n_layer, n_head, n_embd = tc.int("num_hidden_layers"), tc.int("num_attention_heads"), tc.int("hidden_size")
    _require(source, tc.int("num_key_value_heads") == n_head,
             "text_config.num_key_value_heads must equal num_attention_heads (the kv_b split needs it)")
    _require(source, lac.int("num_heads") == n_head,
             "text_config.linear_attn_config.num_heads must equal num_attention_heads")
    _require(source, tc.raw("mla_use_nope") is True, "text_config.mla_use_nope must be true (K3 MLA is NoPE)")
    _require(source, tc.raw("hidden_act") == "situ", f"text_config.hidden_act {_show(tc.raw('hidden_act'))} "
             f"is not 'situ'")
    _require(source, tc.raw("moe_router_activation_func") == "sigmoid",
             f"text_config.moe_router_activation_func {_show(tc.raw('moe_router_activation_func'))} "
             f"is not 'sigmoid'")
    full = lac.layers("full_attn_layers", n_layer)
    kda = lac.layers("kda_layers", n_layer, default=[])
    if kda and sorted(set(full) | set(kda)) != list(range(n_layer)) or set(full) & set(kda):
        raise ConfigError(f"{source}: linear_attn_config kda_layers and full_attn_layers "
                          f"must partition layers 1..{n_layer}")

    rms_eps = tc.number("rms_norm_eps", above=0)
    mxfp4 = _experts_mxfp4(top, tc)
    n_lat = tc.int("routed_expert_hidden_size", least=0, optional=True)
    n_ff_exp = tc.int("moe_intermediate_size")
    if mxfp4 and (n_ff_exp % 32 or (n_lat or n_embd) % 32):
        raise ConfigError(f"{source}: MXFP4 experts need moe_intermediate_size and "
                          f"routed_expert_hidden_size divisible by 32")
    n_expert, n_expert_used = tc.int("num_experts"), tc.int("num_experts_per_token")
    if n_expert_used > n_expert:
        raise tc.fail("num_experts_per_token", f"must be at most num_experts ({n_expert}), not {n_expert_used}")
    n_dense = tc.int("first_k_dense_replace", least=0, optional=True)
    if n_dense > n_layer:
        raise tc.fail("first_k_dense_replace", f"must be at most num_hidden_layers ({n_layer}), not {n_dense}")

    cfg = KimiConfig(
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_vocab=tc.int("vocab_size"),
        n_ctx_train=tc.int("max_position_embeddings", optional=True),
        n_head=n_head,
        rms_eps=rms_eps,
        kda_head_dim=lac.int("head_dim"),
        conv_kernel=lac.int("short_conv_kernel_size"),
        gate_lower_bound=(None if lac.raw("gate_lower_bound", None) is None
                          else lac.number("gate_lower_bound")),
        q_lora_rank=tc.int("q_lora_rank", least=0, optional=True),
        kv_lora_rank=tc.int("kv_lora_rank"),
        qk_nope_head_dim=tc.int("qk_nope_head_dim"),
        qk_rope_head_dim=tc.int("qk_rope_head_dim"),
        v_head_dim=tc.int("v_head_dim"),
        n_ff=tc.int("intermediate_size"),
        n_dense_layers=n_dense,
        n_expert=n_expert,
        n_expert_used=n_expert_used,
        n_expert_shared=tc.int("num_shared_experts"),
        n_ff_exp=n_ff_exp,
        n_latent=n_lat,
        expert_weights_norm=tc.flag("moe_renormalize", True),
        expert_weights_scale=tc.number("routed_scaling_factor", above=0, default=1.0),
        situ_beta=tc.number("activation_situ_beta", above=0),             # runtime.situ divides by it
        situ_linear_beta=tc.number("activation_situ_linear_beta", least=0),  # 0: no clamp of the up path
        attn_res_block_size=tc.int("attn_res_block_size"),
        full_attn_layers=tuple(full),
        indexer=_parse_indexer(tc, full, n_layer, rms_eps) if arch == ARCH_K31 else None,
        experts_mxfp4=mxfp4,
        extra={f"{kind}_token_id": _token_id(top, tc, kind) for kind in ("bos", "eos", "pad")},
    )
    if arch == ARCH_K31 and cfg.q_lora_rank <= 0:
        raise ConfigError(f"{source}: kimi-k31 needs q_lora_rank > 0 (the indexer reads the q latent)")
    return cfg


def _require(source: str, ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(f"{source}: {message}")


def _architecture(top: _Fields) -> str:
    archs = top.raw("architectures", None)
    first = archs[0] if type(archs) is list and archs else None
    if not isinstance(first, str) or first not in HF_ARCHITECTURES:
        raise ConfigError(f"{top.source}: unknown architecture {_show(first)}; "
                          f"expected one of {sorted(HF_ARCHITECTURES)}")
    return HF_ARCHITECTURES[first]


def _experts_mxfp4(top: _Fields, tc: _Fields) -> bool:
    """text_config.quantization_config (where the release has it), else the top level's."""
    for fields in (tc, top):
        if fields.raw("quantization_config", None) is None:
            continue
        q = fields.section("quantization_config")
        if q.values:
            return (q.raw("quant_method", None) == "compressed-tensors"
                    and q.raw("format", None) == "mxfp4-pack-quantized")
    return False


def _token_id(top: _Fields, tc: _Fields, kind: str):
    """text_config's, else the top level's: an id, a list of ids (HF's several eos) or null;
    vocab.py checks them against the vocabulary."""
    key = f"{kind}_token_id"
    fields = tc if key in tc.values else top
    value = fields.raw(key, None)
    ids = value if type(value) is list and value else [value]
    if value is not None and not all(type(i) is int and 0 <= i <= MAX_INT for i in ids):
        raise fields.fail(key, f"must be a token id or a list of them, not {_show(value)}")
    return value


def _parse_indexer(tc: _Fields, full: list[int], n_layer: int, rms_eps: float) -> IndexerConfig:
    if tc.raw("dsa_config", None) is not None:
        dsa = tc.section("dsa_config")
    else:       # DeepSeek-V3.2 style: the index_* keys in text_config itself
        dsa = _Fields(tc.source, {k: tc.values[k] for k in ("index_n_heads", "index_head_dim", "index_topk")
                                  if k in tc.values}, tc.where)
        if not dsa.values:
            raise ConfigError(f"{tc.source}: KimiK31 checkpoint has no text_config.dsa_config")
    keys = {f: next((a for a in aliases if a in dsa.values), None) for f, aliases in DSA_ALIASES.items()}
    sizes = {}
    for f in ("n_head", "head_dim", "top_k"):
        if keys[f] is None:
            raise ConfigError(f"{tc.source}: {dsa.where} needs a positive {'|'.join(DSA_ALIASES[f])}")
        sizes[f] = dsa.int(keys[f])
    if keys["layers"] is not None:
        dsa_layers = dsa.layers(keys["layers"], n_layer)
        if dsa_layers != list(full):
            raise ConfigError(
                f"{tc.source}: dsa_config layer list {sorted(i + 1 for i in dsa_layers)} does not equal "
                f"linear_attn_config.full_attn_layers {sorted(i + 1 for i in full)}")
    return IndexerConfig(n_head=sizes["n_head"], head_dim=sizes["head_dim"], top_k=sizes["top_k"],
                         norm_eps=rms_eps)


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


class _GGUFKeys:
    """The architecture keys of one GGUF, each read typed and range-checked: a bad one is one ConfigError
    naming the file and the key (a string where a count belongs, an array where a float does)."""

    def __init__(self, fields: dict[str, Any], arch: str, source: str):
        self.fields, self.arch, self.where = fields, arch, f"{source}: " if source else ""

    def fail(self, name: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.where}GGUF metadata key {name} {problem}")

    def raw(self, k: str, default: Any = _REQUIRED) -> tuple[str, Any]:
        name = key(k, self.arch)
        if name in self.fields:
            return name, self.fields[name]
        if default is _REQUIRED:
            raise self.fail(name, "is missing")
        return name, default

    def int(self, k: str, default: Any = _REQUIRED, least: int = 1) -> int:
        name, value = self.raw(k, default)
        if type(value) is not int or not least <= value <= MAX_INT:
            raise self.fail(name, f"must be an integer in {least}..{MAX_INT}, not {_show(value)}")
        return value

    def number(self, k: str, default: Any = _REQUIRED, *, above: float | None = None,
               least: float | None = None) -> float:
        name, value = self.raw(k, default)
        if type(value) not in (int, float) or not math.isfinite(value):
            raise self.fail(name, f"must be a finite number, not {_show(value)}")
        if (above is not None and not value > above) or (least is not None and not value >= least):
            raise self.fail(name, f"must be {f'above {above}' if above is not None else f'at least {least}'}, "
                                  f"not {_show(value)}")
        return float(value)

    def flag(self, k: str, default: bool) -> bool:
        name, value = self.raw(k, default)
        if type(value) is not bool:
            raise self.fail(name, f"must be true or false, not {_show(value)}")
        return value

    def per_layer(self, k: str, n_layer: int, default: Any = _REQUIRED) -> list | None:
        name, value = self.raw(k, default)
        if name not in self.fields:         # optional, and absent
            return None
        if type(value) is not list or len(value) != n_layer or not all(type(v) in (int, bool) for v in value):
            raise self.fail(name, f"must be a per-layer array of {n_layer} integers, not {_show(value)}")
        return value


def _from_gguf(f: dict[str, Any], source: str = "") -> KimiConfig:
    arch = f.get("general.architecture")
    if arch not in HF_ARCHITECTURES.values():
        where = f"{source}: " if source else ""
        shown = repr(arch) if len(repr(arch)) <= 60 else repr(arch)[:60] + "..."
        raise ConfigError(f"{where}GGUF architecture {shown} is not kimi-k3 or kimi-k31")
    g = _GGUFKeys(f, arch, source)
    n_layer = g.int(Key.BLOCK_COUNT)
    kv_heads = g.per_layer(Key.HEAD_COUNT_KV, n_layer)
    full = tuple(i for i, h in enumerate(kv_heads) if h)
    indexer = None
    if arch == ARCH_K31:
        types = g.per_layer(Key.INDEXER_TYPES, n_layer, None)
        if types is not None and [bool(t) for i, t in enumerate(types) if i in full] != [True] * len(full):
            raise g.fail(key(Key.INDEXER_TYPES, arch), "must give an indexer to every MLA layer")
        indexer = IndexerConfig(n_head=g.int(Key.INDEXER_HEAD_COUNT), head_dim=g.int(Key.INDEXER_KEY_LENGTH),
                                top_k=g.int(Key.INDEXER_TOP_K),
                                norm_eps=g.number(Key.LAYER_NORM_EPS, g.number(Key.RMS_EPS, above=0), above=0))
    key_mla = g.int(Key.KEY_LENGTH_MLA)
    rope = g.int(Key.ROPE_DIMENSION_COUNT)
    if rope >= key_mla:
        raise g.fail(key(Key.ROPE_DIMENSION_COUNT, arch), f"must be below key_length_mla ({key_mla}), not {rope}")
    n_expert, n_expert_used = g.int(Key.EXPERT_COUNT), g.int(Key.EXPERT_USED_COUNT)
    if n_expert_used > n_expert:
        raise g.fail(key(Key.EXPERT_USED_COUNT, arch), f"must be at most expert_count ({n_expert}), not {n_expert_used}")
    n_dense = g.int(Key.LEADING_DENSE_BLOCK_COUNT, 0, least=0)
    if n_dense > n_layer:
        raise g.fail(key(Key.LEADING_DENSE_BLOCK_COUNT, arch), f"must be at most block_count ({n_layer}), not {n_dense}")
    lb = g.raw(Key.KDA_GATE_LOWER_BOUND, None)[1]
    tokens = f.get("tokenizer.ggml.tokens", [])
    return KimiConfig(
        arch=arch, n_layer=n_layer, n_embd=g.int(Key.EMBEDDING_LENGTH),
        n_vocab=g.int(Key.VOCAB_SIZE, 0, least=0) or (len(tokens) if type(tokens) is list else 0),
        n_ctx_train=g.int(Key.CONTEXT_LENGTH, least=0), n_head=g.int(Key.HEAD_COUNT),
        rms_eps=g.number(Key.RMS_EPS, above=0),
        kda_head_dim=g.int(Key.KDA_HEAD_DIM), conv_kernel=g.int(Key.SSM_CONV_KERNEL),
        gate_lower_bound=None if lb is None else g.number(Key.KDA_GATE_LOWER_BOUND),
        q_lora_rank=g.int(Key.Q_LORA_RANK, 0, least=0), kv_lora_rank=g.int(Key.KV_LORA_RANK),
        qk_nope_head_dim=key_mla - rope, qk_rope_head_dim=rope,
        v_head_dim=g.int(Key.VALUE_LENGTH_MLA),
        n_ff=g.int(Key.FEED_FORWARD_LENGTH), n_dense_layers=n_dense, n_expert=n_expert, n_expert_used=n_expert_used,
        n_expert_shared=g.int(Key.EXPERT_SHARED_COUNT), n_ff_exp=g.int(Key.EXPERT_FEED_FORWARD_LENGTH),
        n_latent=g.int(Key.EXPERT_LATENT_LENGTH, 0, least=0),
        expert_weights_norm=g.flag(Key.EXPERT_WEIGHTS_NORM, False),
        expert_weights_scale=g.number(Key.EXPERT_WEIGHTS_SCALE, 1.0, above=0),
        situ_beta=g.number(Key.SITU_BETA, above=0), situ_linear_beta=g.number(Key.SITU_LINEAR_BETA, least=0),
        attn_res_block_size=g.int(Key.ATTN_RES_BLOCK_SIZE, least=0),      # 0: a plain pre-norm residual
        full_attn_layers=full, indexer=indexer,
    )
