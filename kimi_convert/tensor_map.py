"""The one table of Kimi-K3 / K3.1 tensors: HF name -> GGUF name, transform, shape.

Read it like llama.cpp's tensor_mapping.py, but for one model family: each Rule says
which HF tensor(s) make which GGUF tensor, on which layers, by which transform, and
what shape the HF side must have given the config. `sanitize` is the name clean-up
step (prefix, vision drop) done before anything is looked up.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator

from gguf import GGMLQuantizationType as QT

from .constants import HF_DROPPED_PREFIXES, HF_TEXT_PREFIX, T, tname
from .convert.transforms import A_LOG, CONV1D, COPY, EXPERTS, K_B, RES_SCORE, V_B, Transform  # noqa: F401
from .model import KimiConfig

Shape = tuple[int, ...]

# transforms (what the converter does to the source bytes): objects of convert/transforms.py, one class each
@dataclass(frozen=True)
class Rule:
    gguf: str                                  # constants.T template
    hf: tuple[str, ...]                        # HF names (after sanitize), "{bid}" for the layer
    when: str                                  # layer predicate, see LAYER_KINDS
    hf_shapes: Callable[[KimiConfig], tuple[Shape, ...]]
    transform: Transform = COPY
    f32: bool = False                          # kept F32 whatever the outtype (llama.cpp does)
    group: str = "other"                       # for the plan summary


LAYER_KINDS: dict[str, Callable[[KimiConfig, int], bool]] = {
    "all": lambda c, il: True,
    "kda": lambda c, il: c.is_kda(il),
    "mla": lambda c, il: c.is_mla(il),
    "indexer": lambda c, il: c.has_indexer(il),
    "dense": lambda c, il: not c.is_moe(il),
    "moe": lambda c, il: c.is_moe(il),
    "moe_latent": lambda c, il: c.is_moe(il) and c.n_latent > 0,
}

L = "model.layers.{bid}."
A = L + "self_attn."
M = L + "block_sparse_moe."


def _r(gguf, hf, when, shapes, transform=COPY, f32=False, group="other"):
    hf = (hf,) if isinstance(hf, str) else hf
    return Rule(gguf, hf, when, shapes, transform, f32, group)


GLOBAL_RULES = [
    _r(T.TOKEN_EMBD, "model.embed_tokens.weight", "global", lambda c: ((c.n_vocab, c.n_embd),), group="embeddings"),
    _r(T.OUTPUT_NORM, "model.norm.weight", "global", lambda c: ((c.n_embd,),), f32=True, group="norms"),
    _r(T.OUTPUT, "lm_head.weight", "global", lambda c: ((c.n_vocab, c.n_embd),), group="embeddings"),
    _r(T.OUTPUT_RES_SCORE, ("model.output_attn_res_norm.weight", "model.output_attn_res_proj.weight"), "global",
       lambda c: ((c.n_embd,), (1, c.n_embd)), RES_SCORE, f32=True, group="residual scores"),
]

LAYER_RULES = [
    # every layer
    _r(T.ATTN_NORM, L + "input_layernorm.weight", "all", lambda c: ((c.n_embd,),), f32=True, group="norms"),
    _r(T.ATTN_RES_SCORE, (L + "self_attention_res_norm.weight", L + "self_attention_res_proj.weight"), "all",
       lambda c: ((c.n_embd,), (1, c.n_embd)), RES_SCORE, f32=True, group="residual scores"),
    # KDA
    _r(T.ATTN_Q, A + "q_proj.weight", "kda", lambda c: ((c.d_inner, c.n_embd),), group="kda"),
    _r(T.ATTN_K, A + "k_proj.weight", "kda", lambda c: ((c.d_inner, c.n_embd),), group="kda"),
    _r(T.ATTN_V, A + "v_proj.weight", "kda", lambda c: ((c.d_inner, c.n_embd),), group="kda"),
    _r(T.SSM_CONV1D_Q, A + "q_conv1d.weight", "kda", lambda c: ((c.d_inner, 1, c.conv_kernel),), CONV1D, True, "kda"),
    _r(T.SSM_CONV1D_K, A + "k_conv1d.weight", "kda", lambda c: ((c.d_inner, 1, c.conv_kernel),), CONV1D, True, "kda"),
    _r(T.SSM_CONV1D_V, A + "v_conv1d.weight", "kda", lambda c: ((c.d_inner, 1, c.conv_kernel),), CONV1D, True, "kda"),
    _r(T.SSM_F_A, A + "f_a_proj.weight", "kda", lambda c: ((c.kda_head_dim, c.n_embd),), group="kda"),
    _r(T.SSM_F_B, A + "f_b_proj.weight", "kda", lambda c: ((c.d_inner, c.kda_head_dim),), group="kda"),
    _r(T.SSM_BETA, A + "b_proj.weight", "kda", lambda c: ((c.n_head, c.n_embd),), group="kda"),
    # A_log: padded with zeros past n_head (96 -> 128 on the real model); any length >= n_head
    _r(T.SSM_A, A + "A_log", "kda", lambda c: ((-c.n_head,),), A_LOG, True, "kda"),
    _r(T.SSM_DT_BIAS, A + "dt_bias", "kda", lambda c: ((c.d_inner,),), f32=True, group="kda"),
    _r(T.SSM_G, A + "g_proj.weight", "kda", lambda c: ((c.d_inner, c.n_embd),), group="kda"),
    _r(T.SSM_NORM, A + "o_norm.weight", "kda", lambda c: ((c.kda_head_dim,),), f32=True, group="norms"),
    _r(T.ATTN_OUT, A + "o_proj.weight", "kda", lambda c: ((c.n_embd, c.d_inner),), group="kda"),
    # MLA (NoPE, gated)
    _r(T.ATTN_Q_A, A + "q_a_proj.weight", "mla", lambda c: ((c.q_lora_rank, c.n_embd),), group="mla"),
    _r(T.ATTN_Q_A_NORM, A + "q_a_layernorm.weight", "mla", lambda c: ((c.q_lora_rank,),), f32=True, group="norms"),
    _r(T.ATTN_Q_B, A + "q_b_proj.weight", "mla",
       lambda c: ((c.n_head * (c.qk_nope_head_dim + c.qk_rope_head_dim), c.q_lora_rank),), group="mla"),
    _r(T.ATTN_KV_A_MQA, A + "kv_a_proj_with_mqa.weight", "mla",
       lambda c: ((c.kv_lora_rank + c.qk_rope_head_dim, c.n_embd),), group="mla"),
    _r(T.ATTN_KV_A_NORM, A + "kv_a_layernorm.weight", "mla", lambda c: ((c.kv_lora_rank,),), f32=True, group="norms"),
    _r(T.ATTN_K_B, A + "kv_b_proj.weight", "mla", _kv_b_shape := (
        lambda c: ((c.n_head * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),)), K_B, group="mla"),
    _r(T.ATTN_V_B, A + "kv_b_proj.weight", "mla", _kv_b_shape, V_B, group="mla"),
    _r(T.ATTN_GATE, A + "g_proj.weight", "mla", lambda c: ((c.n_head * c.v_head_dim, c.n_embd),), group="mla"),
    _r(T.ATTN_OUT, A + "o_proj.weight", "mla", lambda c: ((c.n_embd, c.n_head * c.v_head_dim),), group="mla"),
    # K3.1 lightning indexer
    _r(T.INDEXER_Q_B, A + "indexer.wq_b.weight", "indexer",
       lambda c: ((c.indexer.n_head * c.indexer.head_dim, c.q_lora_rank),), group="indexer"),
    _r(T.INDEXER_K, A + "indexer.wk.weight", "indexer", lambda c: ((c.indexer.head_dim, c.n_embd),), group="indexer"),
    _r(T.INDEXER_PROJ, A + "indexer.weights_proj.weight", "indexer",
       lambda c: ((c.indexer.n_head, c.n_embd),), f32=True, group="indexer"),
    _r(T.INDEXER_K_NORM, A + "indexer.k_norm.weight", "indexer", lambda c: ((c.indexer.head_dim,),), f32=True,
       group="indexer"),
    _r(T.INDEXER_K_NORM_BIAS, A + "indexer.k_norm.bias", "indexer", lambda c: ((c.indexer.head_dim,),), f32=True,
       group="indexer"),
    # FFN input
    _r(T.FFN_NORM, L + "post_attention_layernorm.weight", "all", lambda c: ((c.n_embd,),), f32=True, group="norms"),
    _r(T.FFN_RES_SCORE, (L + "mlp_res_norm.weight", L + "mlp_res_proj.weight"), "all",
       lambda c: ((c.n_embd,), (1, c.n_embd)), RES_SCORE, f32=True, group="residual scores"),
    # dense FFN
    _r(T.FFN_GATE, L + "mlp.gate_proj.weight", "dense", lambda c: ((c.n_ff, c.n_embd),), group="dense ffn"),
    _r(T.FFN_UP, L + "mlp.up_proj.weight", "dense", lambda c: ((c.n_ff, c.n_embd),), group="dense ffn"),
    _r(T.FFN_DOWN, L + "mlp.down_proj.weight", "dense", lambda c: ((c.n_embd, c.n_ff),), group="dense ffn"),
    # latent MoE
    _r(T.FFN_GATE_INP, M + "gate.weight", "moe", lambda c: ((c.n_expert, c.n_embd),), f32=True, group="moe router"),
    _r(T.FFN_EXP_PROBS_B, M + "gate.e_score_correction_bias", "moe", lambda c: ((c.n_expert,),), f32=True,
       group="moe router"),
    _r(T.FFN_ROUTED_DOWN, M + "routed_expert_down_proj.weight", "moe_latent", lambda c: ((c.n_latent, c.n_embd),),
       group="moe latent"),
    _r(T.FFN_ROUTED_NORM, M + "routed_expert_norm.weight", "moe_latent", lambda c: ((c.n_latent,),), f32=True,
       group="norms"),
    _r(T.FFN_ROUTED_UP, M + "routed_expert_up_proj.weight", "moe_latent", lambda c: ((c.n_embd, c.n_latent),),
       group="moe latent"),
    _r(T.FFN_GATE_SHEXP, M + "shared_experts.gate_proj.weight", "moe",
       lambda c: ((c.n_ff_exp * c.n_expert_shared, c.n_embd),), group="shared experts"),
    _r(T.FFN_UP_SHEXP, M + "shared_experts.up_proj.weight", "moe",
       lambda c: ((c.n_ff_exp * c.n_expert_shared, c.n_embd),), group="shared experts"),
    _r(T.FFN_DOWN_SHEXP, M + "shared_experts.down_proj.weight", "moe",
       lambda c: ((c.n_embd, c.n_ff_exp * c.n_expert_shared),), group="shared experts"),
    # routed experts: HF names per expert; {proj} is w1/w2/w3, see expert_sources()
    _r(T.FFN_GATE_EXPS, M + "experts.{e}.w1", "moe", lambda c: ((c.n_ff_exp, c.n_lat),), EXPERTS, group="routed experts"),
    _r(T.FFN_DOWN_EXPS, M + "experts.{e}.w2", "moe", lambda c: ((c.n_lat, c.n_ff_exp),), EXPERTS, group="routed experts"),
    _r(T.FFN_UP_EXPS, M + "experts.{e}.w3", "moe", lambda c: ((c.n_ff_exp, c.n_lat),), EXPERTS, group="routed experts"),
]


def sanitize(hf_name: str) -> str | None:
    """Canonical HF text-model name, or None for tensors we drop (vision, projector)."""
    if hf_name.startswith(HF_DROPPED_PREFIXES):
        return None
    name = hf_name.removeprefix(HF_TEXT_PREFIX)
    if name.startswith("layers."):          # exports without the inner `model.` (vLLM mapper)
        name = "model." + name
    return name


def expert_sources(rule: Rule, bid: int, n_expert: int, mxfp4: bool, prefix: str = "") -> list[tuple[str, ...]]:
    """Per expert: (weight_packed, weight_scale) names, or (weight,) for a BF16 checkpoint; `prefix` +
    the canonical name (HF_TEXT_PREFIX gives the release's spelling). The layer is formatted in once, the
    expert by concatenation: the real model has 494,592 of these names."""
    head, tail = (prefix + rule.hf[0]).format(bid=bid, e="{e}").split("{e}")
    suffixes = (".weight_packed", ".weight_scale") if mxfp4 else (".weight",)
    return [tuple(f"{head}{e}{tail}{s}" for s in suffixes) for e in range(n_expert)]


def gguf_shape(rule: Rule, c: KimiConfig) -> Shape:
    """Numpy-order shape of the GGUF tensor a rule makes: its transform's, from the first source's shape."""
    return rule.transform.gguf_shape(rule.hf_shapes(c)[0], c)


def walk(c: KimiConfig) -> Iterator[tuple[Rule, int | None]]:
    """Every (rule, layer) the architecture implies, in the converted file's order (the embedding, the layers,
    then the output norm, head and score): the one walk over the table that the converter, the one pass, the
    runtime and verification share (layer None for a global rule)."""
    yield GLOBAL_RULES[0], None
    for il in range(c.n_layer):
        for r in LAYER_RULES:
            if LAYER_KINDS[r.when](c, il):
                yield r, il
    for r in GLOBAL_RULES[1:]:
        yield r, None


def gguf_tensors(c: KimiConfig) -> dict[str, tuple[Rule, Shape]]:
    """Every GGUF tensor the architecture implies: name -> (rule, numpy shape), in file order (walk)."""
    return {tname(r.gguf, il): (r, gguf_shape(r, c)) for r, il in walk(c)}


def stored_type(rule: Rule, c: KimiConfig, float_type: QT) -> QT:
    """The type kimi-convert writes a tensor in: MXFP4 experts stay MXFP4, `f32` rules are F32 (as llama.cpp's
    converter keeps them), the rest `float_type` (--outtype)."""
    if rule.transform is EXPERTS and c.experts_mxfp4:
        return QT.MXFP4
    return QT.F32 if rule.f32 else float_type


def gguf_tensor_types(c: KimiConfig, float_type: QT = QT.BF16) -> list[tuple[str, Shape, QT]]:
    """(name, numpy shape, stored type) of every tensor kimi-convert writes for config `c`: the input of
    quant.plan.plan_quantization, so a policy is sized on a config alone, without a file."""
    return [(name, shape, stored_type(rule, c, float_type)) for name, (rule, shape) in gguf_tensors(c).items()]


# ------------------------------------------------------------------------------------
# What quantization may not change: the model's own quantization predicate (as mlx-lm's model
# files state theirs), applied by kimi-quantize before any policy rule.

LLAMA_CPP = "llama.cpp"        # never quantized by llama-quantize either (src/llama-quant.cpp)
INDEXER = "indexer"            # the K3.1 lightning indexer keeps its source type
MXFP4_EXPERTS = "mxfp4"        # quantization-aware experts are copied byte for byte

_INDEXER_MATRICES = tuple("." + t.split(".", 2)[-1] for t in (T.INDEXER_Q_B, T.INDEXER_K, T.INDEXER_PROJ))
_EXPERT_SUFFIXES = tuple(t.split("}", 1)[-1] for t in (T.FFN_GATE_EXPS, T.FFN_UP_EXPS, T.FFN_DOWN_EXPS))


@dataclass(frozen=True)
class Protection:
    kind: str                  # LLAMA_CPP, INDEXER or MXFP4_EXPERTS
    why: str


def ggml_n_dims(shape: Shape) -> int:
    """Dimensions as ggml counts them: trailing 1s of ne (leading 1s of a numpy shape) do not count."""
    n = len(shape)
    while n > 1 and shape[len(shape) - n] == 1:
        n -= 1
    return n


def protection(name: str, shape: Shape, is_mxfp4: bool) -> Protection | None:
    """Why tensor `name` (numpy-order `shape`) must keep its stored type, or None if a policy may choose."""
    if ggml_n_dims(shape) < 2:
        return Protection(LLAMA_CPP, "1-D: llama.cpp never quantizes vectors")
    if not name.endswith("weight"):
        return Protection(LLAMA_CPP, "not a weight: llama.cpp quantizes only *weight tensors")
    for part, what in (("_norm.weight", "a norm"), ("ffn_gate_inp.weight", "the MoE router"),
                       ("ssm_conv1d", "the KDA short convolution")):
        if part in name:
            return Protection(LLAMA_CPP, f"{what}: llama.cpp never quantizes it")
    if name.endswith(_INDEXER_MATRICES):
        return Protection(INDEXER, "the lightning indexer's top-k selection is sensitive to its precision, "
                                   "and llama.cpp loads only F32/F16/BF16 for it")
    if is_mxfp4 and name.endswith(_EXPERT_SUFFIXES):
        return Protection(MXFP4_EXPERTS, "MXFP4 experts are quantization-aware: re-encoding them changes their "
                                         "bytes (only --allow-requantize does, with a warning)")
    return None


def gguf_group(name: str) -> str:
    """The plan-summary class of a GGUF tensor name ("routed experts", "norms", ...), from the table."""
    for pattern, group in _GROUPS:
        if pattern.fullmatch(name):
            return group
    return "other"


def _group_patterns() -> list[tuple[re.Pattern, str]]:
    return [(re.compile(re.escape(r.gguf).replace(re.escape("{bid}"), r"\d+")), r.group)
            for r in GLOBAL_RULES + LAYER_RULES]


_GROUPS = _group_patterns()
