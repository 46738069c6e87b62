"""Which type each tensor becomes, and why: the one decision shared by kimi-quantize and the one-pass converter.

Order, per tensor (docs/policy.md):
1. the protections of tensor_map.protection (llama-quantize's own deny list, the K3.1 indexer, MXFP4 experts):
   the tensor keeps its stored type; a rule that names it is reported (an error with --strict);
2. the first matching --tensor-type token, then the first matching policy rule, then the policy's default
   ("keep" = the stored type);
3. llama-quantize's shape fallback (src/llama-quant.cpp tensor_type_fallback) when the row length is not a
   multiple of the target's block: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K/Q3_K -> Q4_0,
   IQ4_XS -> IQ4_NL, and F16 when even that does not divide it.
So `default = "T"` alone is `llama-quantize --pure T` (plus `--tensor-type exps=mxfp4` on MXFP4 experts).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from ..errors import KimiError
from ..gguf_io import tensor_nbytes
from ..tensor_map import MXFP4_EXPERTS, Protection, protection
from .policy import Policy, Rule, first_matches, type_name

FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)
# llama-quantize's shape fallback (tensor_type_fallback); 32-block types have no smaller block to go to
FALLBACK = {QT.Q2_K: QT.Q4_0, QT.Q3_K: QT.Q4_0, QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0,
            QT.IQ4_XS: QT.IQ4_NL}


class QuantizeError(KimiError):
    """The plan cannot be carried out as asked; the message names the tensor."""


class StrictError(QuantizeError):
    """--strict and rules that name protected tensors: the message names every rule; `details` holds one line per
    rule and protection (ConflictGroup.describe), which the commands print before their error line."""

    def __init__(self, groups: list["ConflictGroup"]):
        rules = list(dict.fromkeys(g.rule.describe() for g in groups))
        kinds = ", ".join(dict.fromkeys(g.protection.kind for g in groups))
        super().__init__(f"--strict: {len(rules)} rule(s) name protected tensors ({kinds}): {'; '.join(rules)}; "
                         f"nothing is written")
        self.groups = groups
        self.details = [g.describe() for g in groups]


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


SHOWN_NAMES = 3         # tensor names a conflict line shows; the count says how many more


@dataclass(frozen=True)
class ConflictGroup:
    """Every tensor one rule names that one protection keeps: a line of the report."""
    rule: Rule
    protection: Protection
    tensors: tuple[str, ...]

    def describe(self) -> str:
        names = ", ".join(self.tensors[:SHOWN_NAMES])
        more = len(self.tensors) - SHOWN_NAMES
        return (f"rule {self.rule.describe()} names {len(self.tensors)} protected tensor(s): {names}"
                f"{f' and {more} more' if more > 0 else ''}; protected ({self.protection.kind}): "
                f"{self.protection.why}")


def group_conflicts(conflicts: Iterable[Conflict]) -> list[ConflictGroup]:
    """The conflicts by (rule, protection), in the order each group first appears (the file's tensor order)."""
    groups: dict[tuple[Rule, Protection], list[str]] = {}
    for c in conflicts:
        groups.setdefault((c.rule, c.protection), []).append(c.tensor)
    return [ConflictGroup(rule, guard, tuple(names)) for (rule, guard), names in groups.items()]


@dataclass
class QuantPlan:
    decisions: list[Decision]
    conflicts: list[Conflict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def conflict_groups(self) -> list[ConflictGroup]:
        return group_conflicts(self.conflicts)

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
        raise StrictError(plan.conflict_groups)
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
    target, why = _fallback(shape, target, why)
    _check_possible(name, source, target, allow_requantize)
    return Decision(name, shape, source, target, why, guard, rule), None


def _fallback(shape: tuple[int, ...], target: QT, why: str) -> tuple[QT, str]:
    row, block = shape[-1], GGML_QUANT_SIZES[target][0]
    if row % block == 0:
        return target, why
    fallback = FALLBACK.get(target, target)
    if row % GGML_QUANT_SIZES[fallback][0]:
        fallback = QT.F16
    return fallback, f"{why}; row length {row} is not a multiple of {block}: {target.name} -> {fallback.name}, " \
                     f"as llama-quantize falls back"


def _check_possible(name: str, source: QT, target: QT, allow_requantize: bool) -> None:
    if target == source:
        return
    if target == QT.MXFP4:
        raise QuantizeError(f"{name}: MXFP4 is only kept, never made: the tensor is {source.name} "
                            f"(choose another type, or keep)")
    if source not in FLOAT_TYPES and not allow_requantize:
        raise QuantizeError(f"{name}: is already {source.name}; re-quantizing it to {target.name} needs "
                            f"--allow-requantize (as llama-quantize's)")
