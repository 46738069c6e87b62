"""The one table of names: architectures, GGUF metadata keys and GGUF tensor names.

gguf 0.19.0 predates Kimi-K3, so the K3/K3.1 names live here, spelled exactly as
llama.cpp's loader reads them (src/llama-arch.cpp). Everything else in the
package refers to these constants instead of repeating strings.
"""
from __future__ import annotations

from gguf import GGMLQuantizationType as QT

# --- architectures ------------------------------------------------------------

ARCH_K3 = "kimi-k3"
ARCH_K31 = "kimi-k31"

# top-level HF `architectures[0]` -> GGUF architecture
HF_ARCHITECTURES = {
    "KimiK3ForConditionalGeneration": ARCH_K3,
    "KimiK31ForConditionalGeneration": ARCH_K31,
}

HF_TEXT_PREFIX = "language_model."
HF_DROPPED_PREFIXES = ("vision_tower.", "mm_projector.")


# --- metadata keys --------------------------------------------------------------
# "{arch}" is replaced by the architecture string; see key() below.

class Key:
    CONTEXT_LENGTH = "{arch}.context_length"
    EMBEDDING_LENGTH = "{arch}.embedding_length"
    BLOCK_COUNT = "{arch}.block_count"
    FEED_FORWARD_LENGTH = "{arch}.feed_forward_length"
    VOCAB_SIZE = "{arch}.vocab_size"
    HEAD_COUNT = "{arch}.attention.head_count"
    HEAD_COUNT_KV = "{arch}.attention.head_count_kv"        # per layer: 0 = KDA, 1 = MLA
    KEY_LENGTH = "{arch}.attention.key_length"              # MLA cache row: kv_lora + rope
    VALUE_LENGTH = "{arch}.attention.value_length"          # kv_lora
    KEY_LENGTH_MLA = "{arch}.attention.key_length_mla"      # nope + rope
    VALUE_LENGTH_MLA = "{arch}.attention.value_length_mla"  # v_head_dim
    Q_LORA_RANK = "{arch}.attention.q_lora_rank"
    KV_LORA_RANK = "{arch}.attention.kv_lora_rank"
    RMS_EPS = "{arch}.attention.layer_norm_rms_epsilon"
    ROPE_DIMENSION_COUNT = "{arch}.rope.dimension_count"
    EXPERT_COUNT = "{arch}.expert_count"
    EXPERT_USED_COUNT = "{arch}.expert_used_count"
    EXPERT_GROUP_USED_COUNT = "{arch}.expert_group_used_count"
    EXPERT_FEED_FORWARD_LENGTH = "{arch}.expert_feed_forward_length"
    EXPERT_SHARED_COUNT = "{arch}.expert_shared_count"
    LEADING_DENSE_BLOCK_COUNT = "{arch}.leading_dense_block_count"
    EXPERT_WEIGHTS_SCALE = "{arch}.expert_weights_scale"
    EXPERT_WEIGHTS_NORM = "{arch}.expert_weights_norm"
    EXPERT_GATING_FUNC = "{arch}.expert_gating_func"
    EXPERT_LATENT_LENGTH = "{arch}.expert_latent_length"
    SSM_CONV_KERNEL = "{arch}.ssm.conv_kernel"
    KDA_HEAD_DIM = "{arch}.kda.head_dim"
    KDA_GATE_LOWER_BOUND = "{arch}.kda.gate_lower_bound"
    SITU_BETA = "{arch}.activation.situ_beta"
    SITU_LINEAR_BETA = "{arch}.activation.situ_linear_beta"
    ATTN_RES_BLOCK_SIZE = "{arch}.attn_res.block_size"
    # K3.1 lightning indexer (llama.cpp b12180+)
    INDEXER_HEAD_COUNT = "{arch}.attention.indexer.head_count"
    INDEXER_KEY_LENGTH = "{arch}.attention.indexer.key_length"
    INDEXER_TOP_K = "{arch}.attention.indexer.top_k"
    INDEXER_TYPES = "{arch}.attention.indexer.types"
    LAYER_NORM_EPS = "{arch}.attention.layer_norm_epsilon"  # indexer key LayerNorm


def key(template: str, arch: str) -> str:
    return template.format(arch=arch)


EXPERT_GATING_SIGMOID = 2  # llama.cpp LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


# --- tensor names ------------------------------------------------------------------
# GGUF names, with "{bid}" for the layer. The HF side of each is in tensor_map.py.

class T:
    TOKEN_EMBD = "token_embd.weight"
    OUTPUT_NORM = "output_norm.weight"
    OUTPUT = "output.weight"
    OUTPUT_RES_SCORE = "output_res_score.weight"
    # every layer
    ATTN_NORM = "blk.{bid}.attn_norm.weight"
    FFN_NORM = "blk.{bid}.ffn_norm.weight"
    ATTN_RES_SCORE = "blk.{bid}.attn_res_score.weight"
    FFN_RES_SCORE = "blk.{bid}.ffn_res_score.weight"
    ATTN_OUT = "blk.{bid}.attn_output.weight"
    # KDA
    ATTN_Q = "blk.{bid}.attn_q.weight"
    ATTN_K = "blk.{bid}.attn_k.weight"
    ATTN_V = "blk.{bid}.attn_v.weight"
    SSM_CONV1D_Q = "blk.{bid}.ssm_conv1d_q.weight"
    SSM_CONV1D_K = "blk.{bid}.ssm_conv1d_k.weight"
    SSM_CONV1D_V = "blk.{bid}.ssm_conv1d_v.weight"
    SSM_F_A = "blk.{bid}.ssm_f_a.weight"
    SSM_F_B = "blk.{bid}.ssm_f_b.weight"
    SSM_BETA = "blk.{bid}.ssm_beta.weight"
    SSM_A = "blk.{bid}.ssm_a"
    SSM_DT_BIAS = "blk.{bid}.ssm_dt.bias"
    SSM_G = "blk.{bid}.ssm_g.weight"
    SSM_NORM = "blk.{bid}.ssm_norm.weight"
    # MLA
    ATTN_Q_A = "blk.{bid}.attn_q_a.weight"
    ATTN_Q_A_NORM = "blk.{bid}.attn_q_a_norm.weight"
    ATTN_Q_B = "blk.{bid}.attn_q_b.weight"
    ATTN_KV_A_MQA = "blk.{bid}.attn_kv_a_mqa.weight"
    ATTN_KV_A_NORM = "blk.{bid}.attn_kv_a_norm.weight"
    ATTN_K_B = "blk.{bid}.attn_k_b.weight"
    ATTN_V_B = "blk.{bid}.attn_v_b.weight"
    ATTN_GATE = "blk.{bid}.attn_gate.weight"
    # K3.1 lightning indexer
    INDEXER_Q_B = "blk.{bid}.indexer.attn_q_b.weight"
    INDEXER_K = "blk.{bid}.indexer.attn_k.weight"
    INDEXER_PROJ = "blk.{bid}.indexer.proj.weight"
    INDEXER_K_NORM = "blk.{bid}.indexer.k_norm.weight"
    INDEXER_K_NORM_BIAS = "blk.{bid}.indexer.k_norm.bias"
    # dense FFN
    FFN_GATE = "blk.{bid}.ffn_gate.weight"
    FFN_UP = "blk.{bid}.ffn_up.weight"
    FFN_DOWN = "blk.{bid}.ffn_down.weight"
    # latent MoE
    FFN_GATE_INP = "blk.{bid}.ffn_gate_inp.weight"
    FFN_EXP_PROBS_B = "blk.{bid}.exp_probs_b.bias"
    FFN_ROUTED_DOWN = "blk.{bid}.ffn_routed_down.weight"
    FFN_ROUTED_NORM = "blk.{bid}.ffn_routed_norm.weight"
    FFN_ROUTED_UP = "blk.{bid}.ffn_routed_up.weight"
    FFN_GATE_SHEXP = "blk.{bid}.ffn_gate_shexp.weight"
    FFN_UP_SHEXP = "blk.{bid}.ffn_up_shexp.weight"
    FFN_DOWN_SHEXP = "blk.{bid}.ffn_down_shexp.weight"
    FFN_GATE_EXPS = "blk.{bid}.ffn_gate_exps.weight"
    FFN_UP_EXPS = "blk.{bid}.ffn_up_exps.weight"
    FFN_DOWN_EXPS = "blk.{bid}.ffn_down_exps.weight"


def tname(template: str, bid: int | None = None) -> str:
    return template.format(bid=bid)


# llama.cpp's loader accepts only these for the indexer matrices (k31-indexer.md)
INDEXER_MATRIX_TYPES = (QT.F32, QT.F16, QT.BF16)
