"""The decisions a budget is spent on, and the candidate types of each.

A decision is a set of tensors that get one type: the routed experts of a layer are one tensor per projection in
GGUF, and `ffn_gate_exps` and `ffn_up_exps` of a layer share a decision (llama.cpp's fused MoE wants them alike);
every other tensor is a decision of its own. Fixed, with their bytes taken out of the budget: the tensors a
protection keeps (the plan's protections) and those a rule of the --policy BASE (or a --tensor-type) names.

Candidates: every type the block registry writes (blocks.supported_types(), so types added later join) whose
blocks divide every row of the decision (no shape fallback is left to the plan), and which llama-quantize would
make here (a type that needs an imatrix only for tensors the imatrix has a vector for); plus keeping the stored
type (MXFP4 experts as they are). A candidate that is at least as large as the stored type is dropped: keeping
costs no more and loses nothing.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from gguf import GGMLQuantizationType as QT

from ...gguf_io import QUANT_SIZES, tensor_nbytes
from ...tensor_map import MXFP4_EXPERTS
from ..blocks import block_type, supported_types
from ..mixtures import FLOAT_TYPES, requires_imatrix
from ..plan import Decision, QuantPlan

ROUTED_EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")


@dataclass(frozen=True)
class Unit:
    """One decision: its tensors (the plan's decisions), its key ("blk.3.ffn_gate_up_exps" or the tensor's
    name) and its candidate types, smallest first (the stored type among them when it may be kept)."""
    key: str
    decisions: tuple[Decision, ...]
    candidates: tuple[QT, ...]

    @property
    def expert(self) -> bool:
        return ROUTED_EXPERTS.match(self.decisions[0].name) is not None

    @property
    def source(self) -> QT:
        return self.decisions[0].source

    def nbytes(self, qtype: QT) -> int:
        return sum(tensor_nbytes(qtype, d.shape) for d in self.decisions)

    @property
    def n_weights(self) -> int:
        return sum(_count(d.shape) for d in self.decisions)


@dataclass(frozen=True)
class Decisions:
    """The plan split into what the solver decides (`units`) and what it does not (`fixed`), with the plan's
    allow_requantize (whether the MXFP4 experts are free)."""
    units: tuple[Unit, ...]
    fixed: tuple[Decision, ...]
    allow_requantize: bool = False

    @property
    def fixed_bytes(self) -> int:
        return sum(d.target_bytes for d in self.fixed)

    def floor(self) -> int:
        return self.fixed_bytes + sum(u.nbytes(u.candidates[0]) for u in self.units)

    def ceiling(self) -> int:
        return self.fixed_bytes + sum(u.nbytes(u.candidates[-1]) for u in self.units)


def held(d: Decision, allow_requantize: bool) -> bool:
    """Whether a protection keeps `d` as stored (plan.decide: --allow-requantize frees the MXFP4 experts)."""
    return d.protection is not None and not (d.protection.kind == MXFP4_EXPERTS and allow_requantize)


def unit_key(name: str) -> str:
    m = ROUTED_EXPERTS.match(name)
    if m is None:
        return name
    return f"blk.{m[1]}.ffn_{'gate_up' if m[2] in ('gate', 'up') else 'down'}_exps"


def split_decisions(plan: QuantPlan, has_vector) -> Decisions:
    """`plan`: the BASE policy's plan (its allow_requantize frees the MXFP4 experts); `has_vector(decision)`:
    whether the imatrix has a vector for it."""
    allow_requantize = plan.options.allow_requantize
    fixed, groups = [], {}
    for d in plan.decisions:
        if held(d, allow_requantize) or d.rule is not None:
            fixed.append(d)
        else:
            groups.setdefault(unit_key(d.name), []).append(d)
    units = []
    for key, ds in groups.items():
        cands = candidates(ds, has_vector, allow_requantize)
        if len(cands) <= 1:     # nothing to choose: kept as stored
            fixed += [replace(d, target=d.source, why="kept: no other type fits its rows") for d in ds]
            continue
        units.append(Unit(key, tuple(ds), cands))
    order = {d.name: i for i, d in enumerate(plan.decisions)}
    fixed.sort(key=lambda d: order[d.name])
    return Decisions(tuple(units), tuple(fixed), allow_requantize)


def candidates(ds: list[Decision], has_vector, allow_requantize: bool) -> tuple[QT, ...]:
    """The types the decision of tensors `ds` may take, by bytes (then type number, for a fixed order)."""
    source = ds[0].source
    mixed_sources = any(d.source != source for d in ds)
    keep_bytes = None if mixed_sources else sum(d.source_bytes for d in ds)
    may_convert = source in FLOAT_TYPES or allow_requantize
    found = [] if mixed_sources else [source]
    for t in supported_types() if may_convert else ():
        if t == source or any(d.shape[-1] % QUANT_SIZES[t][0] for d in ds):
            continue
        if any((requires_imatrix(d.name, t, None) or block_type(t).ggml_requires_imatrix) and not has_vector(d)
               for d in ds):
            continue
        if keep_bytes is not None and sum(tensor_nbytes(t, d.shape) for d in ds) >= keep_bytes:
            continue
        found.append(t)
    return tuple(sorted(found, key=lambda t: (sum(tensor_nbytes(t, d.shape) for d in ds), int(t))))


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
