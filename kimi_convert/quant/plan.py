"""Which type each tensor becomes, and why: the one decision shared by kimi-quantize and the one-pass converter.

Order, per tensor (docs/policy.md):
1. the protections of tensor_map.protection (llama-quantize's own deny list, the K3.1 indexer, MXFP4 experts):
   the tensor keeps its stored type; a rule that names it is reported (an error with --strict);
2. the first matching --tensor-type token, then the first matching policy rule, then the policy's mixture
   (llama-quantize's rules for its file type, quant/mixtures.py) or its default ("keep" = the stored type);
3. llama-quantize's shape fallback (src/llama-quant.cpp tensor_type_fallback, mixtures.FALLBACK) when the row
   length is not a multiple of the target's block: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K/Q3_K -> Q4_0,
   TQ1_0/TQ2_0/Q2_0 -> Q4_0, IQ4_XS and the IQ1-IQ3 types -> IQ4_NL, and F16 when even that does not divide
   it; Q1_0 and NVFP4 have none (refused, as llama-quantize throws).
So `default = "T"` alone is `llama-quantize --pure T` (plus `--tensor-type exps=mxfp4` on MXFP4 experts), and the
mixture of file type F is `llama-quantize F`. A mixture's counters advance in llama-quantize's tensor order, so
with one the tensors are decided in that order (mixtures.llama_order); the plan keeps the file's.

What planning does not check, writing does (`check_can_write`): a target type kimi-quantize cannot write yet,
and an imatrix that a target needs (llama-quantize's tensor_requires_imatrix) and the run lacks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Container, Iterable

from gguf import GGMLQuantizationType as QT

from ..errors import KimiError
from ..gguf_io import QUANT_SIZES, tensor_nbytes
from ..tensor_map import MXFP4_EXPERTS, Protection, protection
from .blocks import block_type, supported_types
from .mixtures import FLOAT_TYPES, Mixture, MixtureError, ModelFacts, fallback_type, llama_order, requires_imatrix
from .policy import Policy, Rule, first_matches, type_name


class QuantizeError(KimiError):
    """The plan cannot be carried out as asked; the message names the tensor."""


class NonFiniteWeightError(QuantizeError):
    """A NaN or an infinity in tensor `name` at `row` (counted across its matrices): refused, not quantized."""

    def __init__(self, message: str, name: str, row: int):
        super().__init__(message)
        self.name, self.row = name, row


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
    needs_imatrix: bool = False    # llama-quantize makes this target only with an imatrix entry
    origin: str = ""               # where the type was chosen: "POLICY_FILE:LINE" of the rule or the default
                                   # ("--tensor-type TOKEN", "mixture Q2_K"); "" for a protection

    @property
    def at(self) -> str:
        """The prefix of an error about the chosen type: "POLICY_FILE:LINE: " (nothing for a protection)."""
        return f"{self.origin}: " if self.origin else ""

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


@dataclass(frozen=True)
class PlanOptions:
    """How a policy is applied: llama-quantize's --allow-requantize (already quantized tensors, the MXFP4
    experts among them, may be quantized again) and our --strict (a rule that names a protected tensor is an
    error). One object from the command line (quant.options.PolicyOptions.plan) to every plan."""
    allow_requantize: bool = False
    strict: bool = False


@dataclass
class QuantPlan:
    decisions: list[Decision]
    conflicts: list[Conflict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    options: PlanOptions = PlanOptions()    # what it was decided with: a budget's choice spends it alike (units.py)

    @property
    def conflict_groups(self) -> list[ConflictGroup]:
        return group_conflicts(self.conflicts)

    @property
    def target_bytes(self) -> int:
        return sum(d.target_bytes for d in self.decisions)

    @property
    def source_bytes(self) -> int:
        return sum(d.source_bytes for d in self.decisions)


def plan_quantization(tensors: Iterable[tuple[str, tuple[int, ...], QT]], policy: Policy,
                      options: PlanOptions = PlanOptions(), *, model: ModelFacts | None = None,
                      imatrix: bool = False) -> QuantPlan:
    """Decide every tensor of (name, numpy shape, stored type); raises QuantizeError for what cannot be done.
    `model` and `imatrix` (whether the run has one) are what a policy's mixture reads besides the tensors."""
    tensors = [(name, tuple(shape), source) for name, shape, source in tensors]
    names = [name for name, _, _ in tensors]
    rules = first_matches(policy.rules, names)    # every pattern in bounded time
    mixture, order = None, range(len(tensors))
    if policy.mixture is not None:
        if model is None:
            raise ValueError(f"{policy.source}: a mixture needs the model's facts (ModelFacts)")
        mixture, order = Mixture.bind(policy.mixture, names, model, imatrix), llama_order(names)
    decided: list = [None] * len(tensors)
    for i in order:
        decided[i] = decide(*tensors[i], policy, options.allow_requantize, rules[names[i]], mixture)
    plan = QuantPlan([d for d, _ in decided], [c for _, c in decided if c is not None], options=options)
    if options.strict and plan.conflicts:
        raise StrictError(plan.conflict_groups)
    requantized = [d for d in plan.decisions if d.requantized]
    if requantized:
        plan.warnings.append(f"{len(requantized)} tensor(s) already quantized are re-quantized (dequantized, then "
                             f"quantized again), e.g. {requantized[0].name} {requantized[0].source.name} -> "
                             f"{requantized[0].target.name}: quantization-aware weights lose accuracy twice")
    return plan


_UNSEARCHED = object()


def decide(name: str, shape: tuple[int, ...], source: QT, policy: Policy, allow_requantize: bool,
           rule: "Rule | None | object" = _UNSEARCHED, mixture: Mixture | None = None
           ) -> tuple[Decision, Conflict | None]:
    """The decision for one tensor; `rule`: its first matching rule, when first_matches has found it already;
    `mixture`: the policy's mixture bound to the file (plan_quantization binds it)."""
    if rule is _UNSEARCHED:
        rule = first_matches(policy.rules, [name])[name]
    guard = protection(name, shape, source == QT.MXFP4)
    if guard is not None and not (guard.kind == MXFP4_EXPERTS and allow_requantize):
        named = rule is not None and rule.target not in (None, source)
        why = f"protected ({guard.kind}): {guard.why}"
        return Decision(name, shape, source, source, why, guard, rule), (Conflict(name, rule, guard) if named else None)
    if rule is not None:
        wanted, why = rule.target, f"rule {rule.describe()}" + (f": {rule.why}" if rule.why else "")
        origin = rule.origin
    elif mixture is not None:
        try:
            wanted, why = mixture.choose(name, shape)
        except MixtureError as e:
            raise QuantizeError(str(e)) from None
        origin = policy.source                      # "mixture Q2_K": llama-quantize's rules, no file
    else:
        wanted, why = policy.default, f"default {type_name(policy.default)} ({policy.default_origin})"
        origin = policy.default_origin
    target = source if wanted is None else wanted
    target, why = _fallback(name, shape, target, why, origin)
    _check_possible(name, source, target, allow_requantize, origin)
    return Decision(name, shape, source, target, why, guard, rule,
                    source != target and (requires_imatrix(name, target, policy.mixture)
                                          or _ggml_needs_imatrix(target)), origin), None


def _ggml_needs_imatrix(target: QT) -> bool:
    """ggml itself makes IQ1_S, IQ2_XXS and IQ2_XS only with importance weights (it asserts them), for every
    tensor: token_embd and output too, which llama-quantize's own rule exempts."""
    return target in supported_types() and block_type(target).ggml_requires_imatrix


def _fallback(name: str, shape: tuple[int, ...], target: QT, why: str, origin: str = "") -> tuple[QT, str]:
    row = shape[-1]
    try:
        fallback = fallback_type(target, row)
    except MixtureError as e:
        at = f"{origin}: " if origin else ""
        raise QuantizeError(f"{at}{name}: row length {row} is not a multiple of the {target.name} block "
                            f"({QUANT_SIZES[target][0]}) and {e}; choose another type for this tensor") from None
    if fallback == target:
        return target, why
    block = QUANT_SIZES[target][0]
    return fallback, f"{why}; row length {row} is not a multiple of {block}: {target.name} -> {fallback.name}, " \
                     f"as llama-quantize falls back"


def _check_possible(name: str, source: QT, target: QT, allow_requantize: bool, origin: str = "") -> None:
    """A float tensor can become any type; a quantized one only itself (a byte copy: MXFP4 experts stay MXFP4,
    even under --allow-requantize), or another type with --allow-requantize."""
    if target == source:
        return
    if source not in FLOAT_TYPES and not allow_requantize:
        at = f"{origin}: " if origin else ""
        raise QuantizeError(f"{at}{name}: is already {source.name}; re-quantizing it to {target.name} needs "
                            f"--allow-requantize (as llama-quantize's)")


# ------------------------------------------------------------------------------------
# what writing needs that a plan does not

def write_blockers(plan: QuantPlan, imatrix: Container[str] | None, imatrix_path: str = "the imatrix") -> list[str]:
    """Why the planned file cannot be written, one line each (empty: it can), in the order writing checks:
    a target kimi-quantize cannot write yet (blocks' registry), a target llama-quantize makes only with an
    imatrix and the run has none, and such targets whose tensors the imatrix has no entry for.
    `imatrix`: the names of the tensors the imatrix has a vector for, or None without one."""
    writable = supported_types()
    out = []
    unwritable = [d for d in plan.decisions if not d.copied and d.target not in writable]
    if unwritable:
        d, also = unwritable[0], {x.target.name for x in unwritable} - {unwritable[0].target.name}
        out.append(f"{d.at}{d.name}: {d.target.name} cannot be written yet ({d.source.name} -> {d.target.name}"
                   + (f"; also {', '.join(sorted(also))}" if also else "") + f"); kimi-quantize writes "
                   f"{', '.join(t.name for t in writable)}")
    needing = [d for d in plan.decisions if d.needs_imatrix]
    if needing and imatrix is None:
        d = needing[0]
        out.append(f"{d.at}{d.name}: {d.target.name} needs an importance matrix (--imatrix FILE), as llama-quantize "
                   f"requires for it ({len(needing)} tensor(s) need one); kimi-imatrix MODEL -f TEXT -o FILE makes "
                   f"one from the checkpoint or the GGUF")
    elif needing:
        missing = [d.name for d in needing if d.name not in imatrix]
        if missing:
            first = next(d for d in needing if d.name not in imatrix)
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            out.append(f"{imatrix_path} has no entry for {len(missing)} tensor(s) whose type needs one, as "
                       f"llama-quantize (or ggml, for IQ1_S, IQ2_XXS, IQ2_XS) requires: {shown} "
                       f"({first.target.name} for {first.name} chosen by {first.origin or 'a protection'})")
    return out


def check_can_write(plan: QuantPlan, imatrix: Container[str] | None, imatrix_path: str = "the imatrix") -> None:
    """Before anything is written: QuantizeError, one line, for the first of write_blockers."""
    blockers = write_blockers(plan, imatrix, imatrix_path)
    if blockers:
        raise QuantizeError(blockers[0])
