"""llama-quantize's named mixtures (quant/mixtures.py) against llama.cpp's own type selection.

- llama.cpp's snapshots (tests/snapshots/*.schema of the pinned tree, unpacked by .ci/install-interop.sh): every
  file type of every model whose rules need no arch-specific branch, type for type;
- llama.cpp's code itself (llama_quant_compute_types through ctypes, src/llama-ext.h) on the real kimi-k3 tensor
  list, for every file type, with K3's facts and with facts that turn the n_expert == 8 and n_gqa() >= 4 rules on.
The byte parity of whole files is tests/test_interop_mixtures.py.
"""
from __future__ import annotations

import re
from dataclasses import replace
from functools import lru_cache

import pytest
from gguf import GGMLQuantizationType as QT

from kimi_convert.fixtures.make_checkpoint import build_config
from kimi_convert.fixtures.real_size import REAL_VISION, real_spec
from kimi_convert.interop import llama_quant_types
from kimi_convert.interop.llama_cpp_convert import upstream_snapshots
from kimi_convert.model import KimiConfig
from kimi_convert.quant.mixtures import FILE_TYPES, ModelFacts
from kimi_convert.quant.plan import plan_quantization
from kimi_convert.quant.policy import mixture_policy
from kimi_convert.tensor_map import gguf_tensor_types

PLANNABLE = [ft for ft in FILE_TYPES.values() if not ft.unavailable]      # all but Q2_0 (gguf 0.19.0 lacks it)

# ------------------------------------------------------------------------------------ the snapshots

# Per snapshot model, the row length (ne0) of each tensor kind that is not n_embd wide, from the model's published
# config (heads x head_dim, FFN and expert widths, MLA ranks, Mamba / gated-delta-net value widths). Only
# ne0 % 256, ne0 % 32 and whether a tensor is 3-D reach the rules. 3-D: the stacked experts and DeepSeek's
# MLA attn_k_b. The tensors are those the snapshot names (every one that differs from the default in some
# file type: all 2-D ones do under MXFP4_MOE, every attn_v-like and ffn_down one under Q2_K, so every counter
# counts the same tensors as upstream's; a 3-D tensor never named reaches no rule that another tensor reads).
ROWS = {
    "deepseek-v3.1": {"attn_q_b": 1536, "attn_k_b": 128, "attn_output": 128 * 128, "ffn_down": 18432,
                      "ffn_down_exps": 2048, "ffn_down_shexp": 2048},
    "gemma-3-4b-it": {"attn_output": 8 * 256, "ffn_down": 10240},
    "glm-4.6v": {"attn_output": 96 * 128, "ffn_down": 10944, "ffn_down_exps": 1408, "ffn_down_shexp": 1408},
    "gpt-oss-120b": {"attn_output": 64 * 64},
    "nvidia-nemotron-3-nano-30b-a3b": {"attn_output": 32 * 128, "ssm_out": 64 * 64, "ffn_down_exps": 1856,
                                       "ffn_down_shexp": 3712},
    "qwen3-0.6b": {"attn_output": 16 * 128, "ffn_down": 3072},
    "qwen3-14b": {"attn_output": 40 * 128, "ffn_down": 17408},
    "qwen3-coder-next": {"attn_output": 16 * 256, "ssm_out": 32 * 128, "ffn_down_exps": 512, "ffn_down_shexp": 512},
    "qwen3.5-397b-a17b": {"attn_output": 32 * 256, "ssm_out": 64 * 128, "ffn_down_exps": 1024,
                          "ffn_down_shexp": 1024},
    "qwen3.6-27b": {"attn_output": 24 * 256, "ssm_out": 48 * 128, "ffn_down": 17408},
    "step-3.5-flash": {"attn_output": 64 * 128, "ffn_down": 11264, "ffn_down_exps": 1280, "ffn_down_shexp": 1280},
}
# LLaMA-3.1-70B's attn_v takes its arch's 70B branch (llama-quant.cpp: model.type == LLM_TYPE_70B), which is not
# ported (it cannot apply to kimi-k3)
ARCH_SPECIFIC = {"meta-llama-3.1-70b-instruct"}


def read_schema(text: str) -> tuple[dict[str, int], dict[str, tuple[QT, dict[str, QT]]]]:
    """The model's header numbers, and per file type: (default type, {tensor: type} of the tensors that differ)."""
    header = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", text.splitlines()[1])}
    sections: dict[str, tuple[QT, dict[str, QT]]] = {}
    current: dict[str, QT] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            ftype, default = re.fullmatch(r"\[(\w+)\] (\w+)", line).groups()
            current = {}
            sections[ftype] = (QT[default.upper()], current)
        else:
            name, qtype = line.rsplit(" ", 1)
            current[name] = QT[qtype.upper()]
    return header, sections


def snapshot_tensors(model: str, header: dict, sections: dict) -> list[tuple[str, tuple[int, ...], QT]]:
    names = sorted({n for _, differing in sections.values() for n in differing})
    out = []
    for name in names:
        kind = re.sub(r"^blk\.\d+\.", "", name).removesuffix(".weight")
        row = ROWS[model].get(kind, header["n_embd"])
        shape = (header["n_head"] if kind.startswith("attn_k_b") else header["n_expert"], 256, row) \
            if kind.endswith("_exps") or kind == "attn_k_b" else (256, row)
        out.append((name, shape, QT.BF16))
    return out


@lru_cache(maxsize=None)
def snapshot(model: str):
    return read_schema((upstream_snapshots() / f"{model}.schema").read_text())


def test_every_snapshot_model_is_compared_or_excused():
    assert {p.stem for p in upstream_snapshots().glob("*.schema")} == set(ROWS) | ARCH_SPECIFIC


@pytest.mark.parametrize("model", sorted(ROWS))
def test_types_equal_llama_cpp_snapshot(model):
    """Every file type of the snapshot, tensor for tensor: its type, from our mixture and fallback."""
    header, sections = snapshot(model)
    tensors = snapshot_tensors(model, header, sections)
    facts = ModelFacts(header["n_layer"], header.get("n_expert", 0),
                       header["n_head"] // header["n_head_kv"] if header["n_head_kv"] else 0)
    # every file type but the aliases, Q1_0 and Q2_0 (test-quant-type-selection.cpp's name table lacks both)
    assert set(sections) == {ft.name for ft in PLANNABLE if not ft.alias_of} - {"Q1_0"}
    wrong = []
    for name, (default, differing) in sections.items():
        ftype = FILE_TYPES[name]
        assert ftype.default == default, name
        for d in plan_quantization(tensors, mixture_policy(ftype), model=facts).decisions:
            assert d.protection is None, d
            want = differing.get(d.name, default)
            if d.target != want:
                wrong.append(f"[{name}] {d.name}: ours {d.target.name}, llama.cpp {want.name} ({d.why})")
    assert not wrong, f"{len(wrong)} differ:\n" + "\n".join(wrong[:20])


# ------------------------------------------------------------------------------------ llama.cpp's code, on K3

@lru_cache(maxsize=1)
def real_k3():
    """The release's config with BF16 experts (MXFP4 ones are protected: nothing to compare) and its tensors."""
    config = replace(KimiConfig.from_hf(build_config(real_spec("k3"), REAL_VISION)), experts_mxfp4=False)
    return config, tuple(gguf_tensor_types(config))


@pytest.mark.parametrize("n_expert,n_head_kv", [(None, 0), (8, 1), (0, 24)],
                         ids=["k3", "8-experts-gqa96", "dense-gqa4"])
def test_types_equal_llama_quant_compute_types_on_real_k3(n_expert, n_head_kv):
    """llama.cpp's own choice (a mock kimi-k3 model, llama_quant_compute_types) for the 2,573 tensors of the real
    K3, every file type; also with 8 experts and n_gqa() 96, and no experts and n_gqa() 4, which turn on the rules
    K3's own facts (896 experts, KDA layer 0: n_gqa() 0) leave off. What llama-quantize may quantize
    (llama_quant_tensor_allows_quantization) is exactly what our protections leave to the policy."""
    config, tensors = real_k3()
    n_expert = config.n_expert if n_expert is None else n_expert
    facts = ModelFacts(config.n_layer, n_expert, config.n_head // n_head_kv if n_head_kv else 0)
    assert (n_expert, n_head_kv) != (config.n_expert, 0) or facts == ModelFacts.of(config)
    theirs = llama_quant_types("kimi-k3", [(n, s) for n, s, _ in tensors], sorted({ft.ftype for ft in PLANNABLE}),
                               n_layer=config.n_layer, n_head=config.n_head, n_head_kv=n_head_kv, n_expert=n_expert)
    wrong = []
    for ftype in PLANNABLE:
        plan = plan_quantization(tensors, mixture_policy(ftype), model=facts)
        ours = {d.name: d for d in plan.decisions if d.protection is None}
        expected = theirs[ftype.ftype]
        assert set(ours) == set(expected), ftype.name
        wrong += [f"[{ftype.name}] {n}: ours {ours[n].target.name}, llama.cpp {QT(t).name} ({ours[n].why})"
                  for n, t in expected.items() if QT(t) != ours[n].target]
    assert not wrong, f"{len(wrong)} differ:\n" + "\n".join(wrong[:20])
