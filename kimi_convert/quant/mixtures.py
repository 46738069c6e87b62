"""llama-quantize's named mixtures (`llama-quantize IN OUT Q4_K_M`) as policies: the one table of them.

A file type of llama-quantize (tools/quantize/quantize.cpp, QUANT_OPTIONS) is a default tensor type plus rules
that give some tensors more or fewer bits. They are src/llama-quant.cpp's `llama_tensor_get_type_impl`,
written here as one short function per tensor category, in its order, with its conditions:

- the category is the first of `category`'s name tests (tensor_get_category);
- the rules read a few model facts (`ModelFacts`: n_layer, n_expert, n_gqa() of layer 0), whether an imatrix
  is given, and counters that llama-quantize advances in its own tensor order (`llama_order`: by layer, then by
  name) each time the mixture decides an attn_v-like, ffn_down, ffn_gate or ffn_up tensor. A tensor that a
  protection or a --tensor-type token decides never reaches the mixture and advances no counter, as a
  --tensor-type match in llama-quantize;
- after them, llama-quantize's shape fallback (`FALLBACK`, tensor_type_fallback), which quant/plan.py applies
  to every decision, and `requires_imatrix` (tensor_requires_imatrix).

Arch-specific branches are not ported: Falcon, GLM5-Next, BailingMoE3 and LLaMA-70B (a `model.type` test)
never apply to kimi-k3 / kimi-k31. The ATTENTION_QKV branch is unreachable upstream (attn_qkv is attn_v-like,
decided first) and is not ported either.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Sequence

from gguf import GGMLQuantizationType as QT

from ..errors import KimiError
from ..gguf_io.qtypes import FILE_TYPES_BY_NAME, QUANT_SIZES, TYPES_BY_NAME

if TYPE_CHECKING:
    from ..model import KimiConfig

FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)


def _types(*names: str) -> tuple[QT, ...]:
    """The ggml types of these names (gguf_io.qtypes: gguf's, and Q2_0, which gguf 0.19.0 lacks)."""
    return tuple(TYPES_BY_NAME[n] for n in names)


# tensor_type_fallback: the type a tensor gets when its row length (ne0) is not a multiple of the target's block.
# A target of 32 or fewer values a block stays (F16 if even that does not divide the row); Q1_0 (128) and
# NVFP4 (64) have no fallback: llama-quantize stops with an error.
FALLBACK = {
    **dict.fromkeys(_types("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS"), QT.IQ4_NL),
    **dict.fromkeys(_types("Q2_0", "Q2_K", "Q3_K", "TQ1_0", "TQ2_0"), QT.Q4_0),
    QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0,
}

# tensor_requires_imatrix: targets that llama-quantize refuses to make without importance weights (Q2_K only in
# a Q2_K_S file); output.weight and the token embeddings never need them
NEEDS_IMATRIX = (QT.IQ3_XXS, QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ1_M, QT.IQ1_S)
TOKEN_EMBD_NAMES = ("token_embd.weight", "per_layer_token_embd.weight")
OUTPUT_NAME = "output.weight"


class MixtureError(KimiError):
    """A mixture cannot decide a tensor as llama-quantize would (it stops there too); the message names it."""


# ------------------------------------------------------------------------------------
# the file types

@dataclass(frozen=True)
class FileType:
    """One of llama-quantize's file types: its name, its `general.file_type` id and its default tensor type
    (llama_ftype_get_default_type)."""
    name: str
    ftype: int
    default: QT
    what: str
    alias_of: str = ""              # "Q4_K" is "Q4_K_M" (llama-quantize lists both)

    @property
    def rules(self) -> str:
        """The name the rules test: an alias decides as the file type it names."""
        return self.alias_of or self.name

    @property
    def quantized(self) -> bool:
        """llama-quantize applies --tensor-type, the mixture and the fallback only when the default type is a
        quantized one (not F32/F16/BF16)."""
        return self.default not in FLOAT_TYPES


def _file_type(name: str, default: str, what: str, alias_of: str = "") -> FileType:
    key = "ALL_F32" if name == "F32" else f"MOSTLY_{alias_of or name}"
    return FileType(name, int(FILE_TYPES_BY_NAME[key]), TYPES_BY_NAME[default], what, alias_of)


# In llama-quantize's --help order. `what` is ours: what the rules below do to a K3 file.
FILE_TYPES: dict[str, FileType] = {ft.name: ft for ft in (
    _file_type("Q1_0", "Q1_0", "Q1_0 (1.125 bpw); output Q6_K"),
    _file_type("Q2_0", "Q2_0", "Q2_0 (2.25 bpw); output Q6_K, token_embd Q4_K"),
    _file_type("Q4_0", "Q4_0", "Q4_0; output Q6_K; with an imatrix, ffn_down of the first n/8 layers Q4_1"),
    _file_type("Q4_1", "Q4_1", "Q4_1; output Q6_K"),
    _file_type("MXFP4_MOE", "MXFP4", "3-D tensors (experts, MLA attn_k_b/attn_v_b) MXFP4, the others Q8_0"),
    _file_type("Q5_0", "Q5_0", "Q5_0; output Q6_K; with an imatrix, ffn_down of the first n/8 layers Q5_1"),
    _file_type("Q5_1", "Q5_1", "Q5_1; output Q6_K"),
    _file_type("IQ2_XXS", "IQ2_XXS", "IQ2_XXS; output Q5_K, token_embd Q2_K, attn_v Q4_K, the first n/8 "
                                     "ffn_down Q2_K"),
    _file_type("IQ2_XS", "IQ2_XS", "IQ2_XS; output Q5_K, token_embd Q2_K, attn_v Q4_K, the first n/8 "
                                   "ffn_down Q2_K"),
    _file_type("IQ2_S", "IQ2_XS", "IQ2_XS; output Q5_K, token_embd and attn_output IQ3_S, attn_v Q4_K, the "
                                  "first n/8 ffn_down IQ3_S"),
    _file_type("IQ2_M", "IQ2_S", "IQ2_S; output Q5_K, token_embd and attn_output IQ3_S, attn_v Q4_K, the "
                                 "first n/8 ffn_down IQ3_S"),
    _file_type("IQ1_S", "IQ1_S", "IQ1_S; output Q5_K, token_embd Q2_K, attn_v Q4_K, attn_output IQ2_XXS, "
                                 "the first n/8 ffn_down Q2_K"),
    _file_type("IQ1_M", "IQ1_M", "IQ1_M; output Q5_K, token_embd Q2_K, attn_v Q4_K, attn_output IQ2_XXS, "
                                 "the first n/8 ffn_down Q2_K"),
    _file_type("TQ1_0", "TQ1_0", "TQ1_0 (ternary); output Q6_K, token_embd Q4_K"),
    _file_type("TQ2_0", "TQ2_0", "TQ2_0 (ternary); output Q6_K, token_embd Q4_K"),
    _file_type("Q2_K", "Q2_K", "Q2_K; output Q6_K; attn_v, attn_output and ffn_down Q3_K"),
    _file_type("Q2_K_S", "Q2_K", "Q2_K; output Q6_K; ffn_down of the first n/8 layers Q4_K"),
    _file_type("IQ3_XXS", "IQ3_XXS", "IQ3_XXS; output Q5_K; token_embd and attn_output IQ3_S; attn_q/attn_k "
                                     "IQ2_S; without an imatrix attn_v IQ3_S, ffn_down Q4_K/Q3_K"),
    _file_type("IQ3_S", "IQ3_S", "IQ3_S; output Q6_K"),
    _file_type("IQ3_M", "IQ3_S", "IQ3_S; output Q6_K; attn_v and attn_output Q4_K, the first n/8 ffn_down Q4_K"),
    _file_type("Q3_K", "Q3_K", "Q3_K_M", alias_of="Q3_K_M"),
    _file_type("IQ3_XS", "IQ3_S", "IQ3_S; output Q6_K; attn_q/attn_k IQ3_XXS, ffn_gate/ffn_up of the middle "
                                  "layers IQ3_XXS"),
    _file_type("Q3_K_S", "Q3_K", "Q3_K; output Q6_K"),
    _file_type("Q3_K_M", "Q3_K", "Q3_K; output Q6_K; attn_v Q5_K for the first 2, then Q4_K; attn_output Q4_K; "
                                 "ffn_down Q5_K for the first n/16 layers, then Q4_K"),
    _file_type("Q3_K_L", "Q3_K", "Q3_K; output Q6_K; attn_v, attn_output and ffn_down Q5_K"),
    _file_type("IQ4_NL", "IQ4_NL", "IQ4_NL; output Q6_K; without an imatrix, ffn_down of the first n/8 layers "
                                   "Q5_K"),
    _file_type("IQ4_XS", "IQ4_XS", "IQ4_XS; output Q6_K; without an imatrix, ffn_down of the first n/8 layers "
                                   "Q5_K"),
    _file_type("Q4_K", "Q4_K", "Q4_K_M", alias_of="Q4_K_M"),
    _file_type("Q4_K_S", "Q4_K", "Q4_K; output Q6_K; attn_v Q5_K for the first 4; ffn_down of the first n/8 "
                                 "layers Q5_K"),
    _file_type("Q4_K_M", "Q4_K", "Q4_K; output Q6_K; attn_v and ffn_down Q6_K where use_more_bits"),
    _file_type("Q5_K", "Q5_K", "Q5_K_M", alias_of="Q5_K_M"),
    _file_type("Q5_K_S", "Q5_K", "Q5_K; output Q6_K"),
    _file_type("Q5_K_M", "Q5_K", "Q5_K; output Q6_K; attn_v and ffn_down Q6_K where use_more_bits"),
    _file_type("Q6_K", "Q6_K", "Q6_K everywhere a type may change"),
    _file_type("Q8_0", "Q8_0", "Q8_0 everywhere a type may change"),
    _file_type("F16", "F16", "F16 for every tensor llama-quantize may change (no rules)"),
    _file_type("BF16", "BF16", "BF16 for every tensor llama-quantize may change (no rules)"),
    _file_type("F32", "F32", "F32 for every tensor llama-quantize may change (no rules)"),
)}

# the ftype of a pure policy (`default = "Q4_K"`): the file type of that name, as llama-quantize reads "Q4_K"
PURE_FILE_TYPE = {ft.default: ft.ftype for ft in FILE_TYPES.values() if ft.default.name == ft.name}


def requires_imatrix(name: str, target: QT, ftype: FileType | None) -> bool:
    """tensor_requires_imatrix: llama-quantize refuses to make `target` for `name` without an imatrix."""
    if name in TOKEN_EMBD_NAMES or name == OUTPUT_NAME:
        return False
    return target in NEEDS_IMATRIX or (target == QT.Q2_K and ftype is not None and ftype.rules == "Q2_K_S")


def fallback_type(target: QT, row: int) -> QT:
    """tensor_type_fallback: `target` when rows of `row` values fit its blocks, else its fallback (F16 when the
    fallback's blocks do not fit either). MixtureError for Q1_0 and NVFP4, which have none."""
    block = QUANT_SIZES[target][0]
    if row % block == 0:
        return target
    if target not in FALLBACK and block > 32:
        raise MixtureError(f"{target.name} has no fallback type (llama-quantize: \"no tensor type fallback is "
                           f"defined for type {target.name.lower()}\")")
    fallback = FALLBACK.get(target, target)
    return QT.F16 if row % QUANT_SIZES[fallback][0] else fallback


# ------------------------------------------------------------------------------------
# what the rules read

@dataclass(frozen=True)
class ModelFacts:
    """The hyperparameters llama_tensor_get_type_impl reads (llama_hparams)."""
    n_layer: int        # n_layer_all: block_count, the size of every layer counter
    n_expert: int       # expert_count
    n_gqa: int          # n_gqa() of layer 0: head_count / head_count_kv, 0 when head_count_kv is 0 (KDA)

    @classmethod
    def of(cls, c: "KimiConfig") -> "ModelFacts":
        """A kimi-k3 / kimi-k31 model: head_count_kv is 0 on a KDA layer, 1 on an MLA one (model.py writes it)."""
        kv_heads = 0 if c.is_kda(0) else 1
        return cls(c.n_layer, c.n_expert, c.n_head // kv_heads if kv_heads else 0)


# tensor_get_category: exact names first, then the first substring found, in this order
OUTPUT, TOKEN_EMBD, OTHER = "output", "token_embd", "other"
ATTN_QKV, ATTN_KV_B, ATTN_V, ATTN_K, ATTN_Q, ATTN_OUTPUT = ("attn_qkv", "attn_kv_b", "attn_v", "attn_k", "attn_q",
                                                           "attn_output")
FFN_UP, FFN_GATE, FFN_DOWN = "ffn_up", "ffn_gate", "ffn_down"
_SUBSTRINGS = ((f"{ATTN_QKV}.weight", ATTN_QKV), (f"{ATTN_KV_B}.weight", ATTN_KV_B), (f"{ATTN_V}.weight", ATTN_V),
               (f"{ATTN_K}.weight", ATTN_K), (f"{ATTN_Q}.weight", ATTN_Q), (f"{ATTN_OUTPUT}.weight", ATTN_OUTPUT),
               (FFN_UP, FFN_UP), (FFN_GATE, FFN_GATE), (FFN_DOWN, FFN_DOWN))
ATTN_V_LIKE = (ATTN_V, ATTN_QKV, ATTN_KV_B)      # category_is_attn_v: more sensitive to quantization


def category(name: str) -> str:
    if name == OUTPUT_NAME:
        return OUTPUT
    if name in TOKEN_EMBD_NAMES:
        return TOKEN_EMBD
    return next((cat for part, cat in _SUBSTRINGS if part in name), OTHER)


_LAYER = re.compile(r"blk\.\s*([+-]?\d+)")      # sscanf(name, "blk.%d.", ...)


def layer_of(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m[1]) if m else None


def llama_order(names: Sequence[str]) -> list[int]:
    """The indices of `names` in llama-quantize's order (llama_model_loader's weight_name_comparer: by layer,
    tensors outside any layer first, then by name), the order its counters advance in."""
    def key(i: int) -> tuple[int, bytes]:
        layer = layer_of(names[i])
        return (-1 if layer is None else layer, names[i].encode())
    return sorted(range(len(names)), key=key)


def use_more_bits(i: int, n: int) -> bool:
    """The first and last eighth of the layers, and every third one between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


# ftype groups the rules test
LOW_BIT = ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M")     # the IQ1/IQ2 branch
OUTPUT_Q5_K = ("IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M")
TOKEN_EMBD_TYPE = {**dict.fromkeys(("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M"), QT.Q2_K),
                   **dict.fromkeys(("IQ2_S", "IQ2_M", "IQ3_XXS"), QT.IQ3_S),
                   **dict.fromkeys(("TQ1_0", "TQ2_0", "Q2_0"), QT.Q4_K)}
ATTN_Q_TYPE = {"IQ3_XS": QT.IQ3_XXS, "IQ3_XXS": QT.IQ2_S}          # attn_q, and attn_k unless 8 experts
ATTN_OUTPUT_TYPE = {"Q2_K": QT.Q3_K, "IQ3_XXS": QT.IQ3_S, "Q3_K_M": QT.Q4_K, "Q3_K_L": QT.Q5_K, "IQ3_M": QT.Q4_K}
ATTN_OUTPUT_8_EXPERTS_Q5_K = ("Q2_K", "IQ3_XS", "IQ3_XXS", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ3_S",
                              "IQ3_M", "IQ4_XS")

Choice = tuple[QT, str]         # a type and the rule that chose it


@dataclass
class Mixture:
    """A file type bound to one file's tensors and model (llama-quantize's quantize_state_impl): `choose`
    decides one tensor and advances the counters, so call it in `llama_order`, once per tensor that
    reaches the mixture."""
    ftype: FileType
    facts: ModelFacts
    has_imatrix: bool
    n_attention_wv: int             # attn_v-like tensors in the file (every one counts, protected or not)
    tied_embeddings: bool           # no output.weight: token_embd is the output too
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys((ATTN_V, FFN_DOWN, FFN_GATE, FFN_UP), 0))

    @classmethod
    def bind(cls, ftype: FileType, names: Iterable[str], facts: ModelFacts, has_imatrix: bool) -> "Mixture":
        names = list(names)
        return cls(ftype, facts, has_imatrix, sum(category(n) in ATTN_V_LIKE for n in names),
                   OUTPUT_NAME not in names)

    def choose(self, name: str, shape: tuple[int, ...]) -> Choice:
        """The type llama_tensor_get_type_impl gives `name` (numpy `shape`) and the rule that did, before the
        shape fallback."""
        if not self.ftype.quantized:
            return self.ftype.default, (f"llama-quantize {self.ftype.name}: every tensor it may change is "
                                        f"{self.ftype.default.name} (a float file type has no rules)")
        target, why = self._impl(name, shape, category(name))
        return target, f"llama-quantize {self.ftype.rules}: {why}"

    # --- llama_tensor_get_type_impl, branch by branch ---

    def _impl(self, name: str, shape: tuple[int, ...], cat: str) -> Choice:
        ft = self.ftype.rules
        if cat == OUTPUT or (self.tied_embeddings and cat == TOKEN_EMBD):
            return self._output(shape[-1])
        if ft == "MXFP4_MOE":
            ne2 = shape[-3] if len(shape) > 2 else 1
            return (QT.MXFP4, f"{cat}, 3-D (ne[2] = {ne2}): MXFP4") if ne2 > 1 else (QT.Q8_0, f"{cat}, not 3-D: Q8_0")
        if cat == TOKEN_EMBD:
            return self._rule(cat, TOKEN_EMBD_TYPE.get(ft), "token_embd")
        if ft in LOW_BIT:
            return self._low_bit(name, cat)
        if cat in ATTN_V_LIKE:
            return self._attn_v(cat)
        if cat == ATTN_K:
            if self.facts.n_expert == 8:
                return QT.Q8_0, "attn_k, 8 experts"
            return self._rule(cat, ATTN_Q_TYPE.get(ft), "attn_k")
        if cat == ATTN_Q:
            return self._rule(cat, ATTN_Q_TYPE.get(ft), "attn_q")
        if cat == FFN_DOWN:
            return self._ffn_down(name)
        if cat == ATTN_OUTPUT:
            if self.facts.n_expert == 8:
                return self._rule(cat, QT.Q5_K if ft in ATTN_OUTPUT_8_EXPERTS_Q5_K else None, "attn_output, 8 experts")
            return self._rule(cat, ATTN_OUTPUT_TYPE.get(ft), "attn_output")
        if cat in (FFN_GATE, FFN_UP):
            return self._ffn_gate_up(name, cat)
        return self._default(cat)

    def _default(self, cat: str) -> Choice:
        what = "other (no rule)" if cat == OTHER else cat
        return self.ftype.default, f"{what}: the default {self.ftype.default.name}"

    def _rule(self, cat: str, target: QT | None, why: str) -> Choice:
        return (target, why) if target is not None else self._default(cat)

    def _output(self, row: int) -> Choice:
        ft, default = self.ftype.rules, self.ftype.default
        what = "output" if not self.tied_embeddings else "output (token_embd, tied)"
        if ft == "MXFP4_MOE":
            return QT.Q8_0, f"{what} under MXFP4_MOE: Q8_0"
        if row % QUANT_SIZES[default][0]:
            return QT.Q8_0, f"{what}, rows of {row} do not fit {default.name} blocks: Q8_0"
        if ft in OUTPUT_Q5_K:
            return QT.Q5_K, f"{what}: Q5_K"
        if default != QT.Q8_0:
            return QT.Q6_K, f"{what}: Q6_K"
        return default, f"{what}: stays Q8_0"

    def _count(self, counter: str) -> int:
        """The counter's value for this tensor, then advanced (llama-quantize's ++qs.i_...)."""
        i = self.counters[counter]
        self.counters[counter] = i + 1
        return i

    def _layer(self, name: str, counter: str) -> tuple[int, int]:
        """layer_info: (layer, n_layer) of an ffn tensor: its blk.N with more than one expert (experts need not
        be consecutive), else the counter; the counter advances either way."""
        i, n = self._count(counter), self.facts.n_layer
        if max(1, self.facts.n_expert) > 1:
            i = layer_of(name)
            if i is None:
                raise MixtureError(f"{name}: no layer number (blk.N.) for llama-quantize's {self.ftype.name} rules")
            if not 0 <= i < n:
                raise MixtureError(f"{name}: layer {i} is not in [0, {n}) ({self.ftype.name} rules)")
        return i, n

    def _low_bit(self, name: str, cat: str) -> Choice:
        """The IQ1/IQ2 branch: ffn_down by its raw counter, even with experts."""
        ft, f = self.ftype.rules, self.facts
        iq3 = ft in ("IQ2_S", "IQ2_M")
        if cat in ATTN_V_LIKE:
            self._count(ATTN_V)
            facts = f"(n_gqa() {f.n_gqa}, n_expert {f.n_expert})"
            if f.n_gqa >= 4 or f.n_expert >= 4:
                return QT.Q4_K, f"{cat}, n_gqa() >= 4 or n_expert >= 4 {facts}"
            return (QT.IQ3_S if iq3 else QT.Q2_K), f"{cat}, n_gqa() < 4 and n_expert < 4 {facts}"
        if f.n_expert == 8 and cat == ATTN_K:
            return QT.Q4_K, "attn_k, 8 experts"
        if cat == FFN_DOWN:
            i, n = self._count(FFN_DOWN), f.n_layer
            if i < n // 8:
                return (QT.IQ3_S if iq3 else QT.Q2_K), f"ffn_down #{i} (counter) < n_layer/8 = {n // 8}"
            return self._default(cat)
        if cat == ATTN_OUTPUT:
            if f.n_expert == 8:
                return QT.Q5_K, "attn_output, 8 experts"
            if ft in ("IQ1_S", "IQ1_M"):
                return QT.IQ2_XXS, "attn_output"
            return self._rule(cat, QT.IQ3_S if iq3 else None, "attn_output")
        return self._default(cat)

    def _attn_v(self, cat: str) -> Choice:
        ft, f, imatrix = self.ftype.rules, self.facts, self.has_imatrix
        i, n = self._count(ATTN_V), self.n_attention_wv
        gqa4 = f.n_gqa >= 4
        target, why = None, cat
        if ft == "Q2_K":
            target, why = (QT.Q4_K if gqa4 else QT.Q3_K), f"{cat}, n_gqa() {f.n_gqa}" + (" >= 4" if gqa4 else " < 4")
        elif ft == "Q2_K_S" and gqa4:
            target, why = QT.Q4_K, f"{cat}, n_gqa() {f.n_gqa} >= 4"
        elif ft == "IQ3_XXS":
            target = QT.Q4_K if gqa4 else QT.IQ3_XXS if imatrix else QT.IQ3_S
            why = f"{cat}, n_gqa() {f.n_gqa} >= 4" if gqa4 else f"{cat}, {'with' if imatrix else 'no'} imatrix"
        elif ft in ("IQ3_XS", "IQ3_S") and gqa4:
            target, why = QT.Q4_K, f"{cat}, n_gqa() {f.n_gqa} >= 4"
        elif ft == "IQ3_M":
            target = QT.Q4_K
        elif ft == "Q3_K_M":
            target, why = (QT.Q5_K, f"{cat} #{i} < 2") if i < 2 else (QT.Q4_K, f"{cat} #{i} >= 2")
        elif ft == "Q3_K_L":
            target = QT.Q5_K
        elif ft in ("IQ4_NL", "IQ4_XS") and gqa4:
            target, why = QT.Q5_K, f"{cat}, n_gqa() {f.n_gqa} >= 4"
        elif ft in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, n):
            target, why = QT.Q6_K, f"{cat}, use_more_bits({cat} {i} of {n})"
        elif ft == "Q4_K_S" and i < 4:
            target, why = QT.Q5_K, f"{cat} #{i} < 4"
        if f.n_expert == 8:
            target, why = QT.Q8_0, f"{cat}, 8 experts"
        return self._rule(cat, target, why)

    def _ffn_down(self, name: str) -> Choice:
        ft, f, imatrix = self.ftype.rules, self.facts, self.has_imatrix
        i, n = self._layer(name, FFN_DOWN)
        first8, at = i < n // 8, f"layer {i} of {n}"
        target, why = None, ""
        if ft == "Q2_K":
            target, why = QT.Q3_K, "ffn_down"
        elif ft == "Q2_K_S":
            target, why = (QT.Q4_K if first8 else None), f"ffn_down, {at} < n/8"
        elif ft == "IQ3_XXS" and not imatrix:
            target, why = (QT.Q4_K, f"ffn_down, no imatrix, {at} < n/8") if first8 else \
                (QT.Q3_K, f"ffn_down, no imatrix, {at} >= n/8")
        elif ft == "Q3_K_M":
            # upstream: Q3_K unless use_more_bits only on Falcon; every other arch gets Q4_K past n/16
            target, why = (QT.Q5_K, f"ffn_down, {at} < n/16") if i < n // 16 else (QT.Q4_K, f"ffn_down, {at} >= n/16")
        elif ft == "IQ3_M" and (first8 or (f.n_expert == 8 and use_more_bits(i, n))):
            target, why = QT.Q4_K, f"ffn_down, {at} < n/8" if first8 else f"ffn_down, 8 experts, use_more_bits({at})"
        elif ft == "Q3_K_L":
            target, why = QT.Q5_K, "ffn_down"
        elif ft == "Q4_K_M":
            target, why = (QT.Q6_K if use_more_bits(i, n) else None), f"ffn_down, use_more_bits({at})"
        elif first8 and ft in ("IQ4_NL", "IQ4_XS") and not imatrix:
            target, why = QT.Q5_K, f"ffn_down, no imatrix, {at} < n/8"
        elif ft == "Q5_K_M" and use_more_bits(i, n):
            target, why = QT.Q6_K, f"ffn_down, use_more_bits({at})"
        elif ft == "Q4_K_S" and first8:
            target, why = QT.Q5_K, f"ffn_down, {at} < n/8"
        elif ft in ("Q4_0", "Q5_0") and imatrix and first8:
            target, why = (QT.Q4_1 if ft == "Q4_0" else QT.Q5_1), f"ffn_down, with an imatrix, {at} < n/8"
        return self._rule(FFN_DOWN, target, why)

    def _ffn_gate_up(self, name: str, cat: str) -> Choice:
        i, n = self._layer(name, cat)
        if self.ftype.rules == "IQ3_XS" and n // 8 <= i < 7 * n // 8:
            return QT.IQ3_XXS, f"{cat}, layer {i} of {n} in [n/8, 7n/8)"
        return self._default(cat)
