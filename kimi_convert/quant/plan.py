"""Which type each tensor becomes, and why: the one decision shared by kimi-quantize and the one-pass converter.

Order, per tensor (docs/policy.md):
1. the protections of tensor_map.protection (llama-quantize's own deny list, the K3.1 indexer, MXFP4 experts):
   the tensor keeps its stored type; a rule that names it is reported (an error with --strict);
2. the first matching --tensor-type token, then the first matching policy rule, then the policy's default
   ("keep" = the stored type);
3. llama-quantize's shape fallback (src/llama-quant.cpp tensor_type_fallback) when the row length is not a
   multiple of the target's block: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K/Q3_K/TQ1_0/TQ2_0/Q2_0 -> Q4_0,
   IQ4_XS -> IQ4_NL, and F16 when even that does not divide it; Q1_0 and NVFP4 have none (refused, as
   llama-quantize throws).
So `default = "T"` alone is `llama-quantize --pure T` (plus `--tensor-type exps=mxfp4` on MXFP4 experts).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from gguf import GGMLQuantizationType as QT

from ..errors import KimiError
from ..gguf_io import Q2_0, QUANT_SIZES, tensor_nbytes
from ..tensor_map import MXFP4_EXPERTS, Protection, protection
from .policy import Policy, Rule, first_matches, type_name

FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)
# llama-quantize's shape fallback (tensor_type_fallback); 32-block types have no smaller block to go to, and
# the other types it does not list (Q1_0, NVFP4) make it throw "no tensor type fallback is defined"
FALLBACK = {QT.Q2_K: QT.Q4_0, QT.Q3_K: QT.Q4_0, QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0,
            QT.IQ4_XS: QT.IQ4_NL, QT.TQ1_0: QT.Q4_0, QT.TQ2_0: QT.Q4_0, Q2_0: QT.Q4_0}


class QuantizeError(KimiError):
    """The plan cannot be carried out as asked; the message names the tensor."""


@dataclass(frozen=True)
class Decision:
    name: str
    shape: tuple[int, ...]         # numpy order
    source: QT
    target: QT
    why: str                       # the rule (file:line), default, protection or fallback that decided
    protection: Protection | None = None
    rule: Rule | None = None

    @property
    def copied(self) -> bool:
        return self.source == self.target

    @property
    def requantized(self) -> bool:
        return not self.copied and self.source not in FLOAT_TYPES

    @property
    def source_bytes(self) -> int:
        return tensor_nbytes(self.source, self.shape)

    @property
    def target_bytes(self) -> int:
        return tensor_nbytes(self.target, self.shape)


@dataclass(frozen=True)
class Conflict:
    """A rule that names a protected tensor: it is not applied, and it is reported."""
    tensor: str
    rule: Rule
    protection: Protection

    def describe(self) -> str:
        return (f"{self.tensor}: rule {self.rule.describe()} is not applied: protected ({self.protection.kind}): "
                f"{self.protection.why}")


@dataclass
class QuantPlan:
    decisions: list[Decision]
    conflicts: list[Conflict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def target_bytes(self) -> int:
        return sum(d.target_bytes for d in self.decisions)

    @property
    def source_bytes(self) -> int:
        return sum(d.source_bytes for d in self.decisions)


def plan_quantization(tensors: Iterable[tuple[str, tuple[int, ...], QT]], policy: Policy, *,
                      allow_requantize: bool = False, strict: bool = False) -> QuantPlan:
    """Decide every tensor of (name, numpy shape, stored type); raises QuantizeError for what cannot be done."""
    plan = QuantPlan([])
    tensors = list(tensors)
    rules = first_matches(policy.rules, [name for name, _, _ in tensors])    # every pattern in bounded time
    for name, shape, source in tensors:
        d, conflict = decide(name, tuple(shape), source, policy, allow_requantize, rules[name])
        plan.decisions.append(d)
        if conflict is not None:
            plan.conflicts.append(conflict)
    if strict and plan.conflicts:
        raise QuantizeError(f"--strict: {plan.conflicts[0].describe()} ({len(plan.conflicts)} such rule matches)")
    requantized = [d for d in plan.decisions if d.requantized]
    if requantized:
        plan.warnings.append(f"{len(requantized)} tensor(s) already quantized are re-quantized (dequantized, then "
                             f"quantized again), e.g. {requantized[0].name} {requantized[0].source.name} -> "
                             f"{requantized[0].target.name}: quantization-aware weights lose accuracy twice")
    return plan


_UNSEARCHED = object()


def decide(name: str, shape: tuple[int, ...], source: QT, policy: Policy, allow_requantize: bool,
           rule: "Rule | None | object" = _UNSEARCHED) -> tuple[Decision, Conflict | None]:
    """The decision for one tensor; `rule`: its first matching rule, when first_matches has found it already."""
    if rule is _UNSEARCHED:
        rule = first_matches(policy.rules, [name])[name]
    guard = protection(name, shape, source == QT.MXFP4)
    if guard is not None and not (guard.kind == MXFP4_EXPERTS and allow_requantize):
        named = rule is not None and rule.target not in (None, source)
        why = f"protected ({guard.kind}): {guard.why}"
        return Decision(name, shape, source, source, why, guard, rule), (Conflict(name, rule, guard) if named else None)
    if rule is not None:
        wanted, why = rule.target, f"rule {rule.describe()}" + (f": {rule.why}" if rule.why else "")
    else:
        wanted, why = policy.default, f"default {type_name(policy.default)} ({policy.default_origin})"
    target = source if wanted is None else wanted
    target, why = _fallback(name, shape, target, why)
    _check_possible(name, source, target, allow_requantize)
    return Decision(name, shape, source, target, why, guard, rule), None


def _fallback(name: str, shape: tuple[int, ...], target: QT, why: str) -> tuple[QT, str]:
    row, block = shape[-1], QUANT_SIZES[target][0]
    if row % block == 0:
        return target, why
    if target not in FALLBACK and block > 32:
        raise QuantizeError(f"{name}: row length {row} is not a multiple of the {target.name} block ({block}) "
                            f"and {target.name} has no fallback type (llama-quantize: \"no tensor type fallback "
                            f"is defined for type {target.name.lower()}\"); choose another type for this tensor")
    fallback = FALLBACK.get(target, target)
    if row % QUANT_SIZES[fallback][0]:
        fallback = QT.F16
    return fallback, f"{why}; row length {row} is not a multiple of {block}: {target.name} -> {fallback.name}, " \
                     f"as llama-quantize falls back"


def _check_possible(name: str, source: QT, target: QT, allow_requantize: bool) -> None:
    """A float tensor can become any type; a quantized one only itself (a byte copy: MXFP4 experts stay MXFP4,
    even under --allow-requantize), or another type with --allow-requantize."""
    if target == source:
        return
    if source not in FLOAT_TYPES and not allow_requantize:
        raise QuantizeError(f"{name}: is already {source.name}; re-quantizing it to {target.name} needs "
                            f"--allow-requantize (as llama-quantize's)")
