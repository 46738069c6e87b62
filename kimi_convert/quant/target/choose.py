"""One run of the target: the BASE plan, its decisions, feasibility, the measured errors, the solve and the
chosen policy. kimi-quantize (and kimi-convert's one pass) call `choose` before they plan or write anything."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from ...gguf_io import GGUFFile
from ...model import KimiConfig
from ..driver import plan_file
from ..plan import PlanOptions, QuantPlan
from ..policy import Policy, parse_policy
from .budget import Budget, BudgetError, check_feasible, decimal_size
from .emit import Chosen, decided_why, policy_text
from .measure import ErrorCache, RowReader, gguf_rows, token_shares, unit_errors
from .prior import shipped_prior
from .solver import Point, Solution, lower_hull, lp_bound_two, solve
from .units import ROUTED_EXPERTS, Decisions, Unit, held, split_decisions

# the costs the budget is spent by: (units, each one's types, each one's weight error per type) -> each one's cost
# per type; with `hull_only` (only the weight errors' hull types are costed) and `describe()` (the header's
# words, None for the weight error's own): prior.RolePrior (the default), prior.WeightErrors, sensitivity.KldCosts
Costs = Callable[[tuple[Unit, ...], list, list], list]


@dataclass
class Choice:
    policy: Policy              # the chosen policy (parsed back from `text`, as --policy CHOSEN.toml reads it)
    text: str                   # its TOML
    budget_bytes: int
    nbytes: int                 # the chosen file's tensor data
    floor: int
    ceiling: int
    lines: list[str] = field(default_factory=list)      # one per decision, for --explain / --dry-run
    solution: Solution | None = None                    # the solve: its error, lower bound and gap
    measure: str = ""                                   # what a decision's cost per type is (the header says it)


def n_weights(gf: GGUFFile) -> int:
    return sum(int(np.prod(t.shape, dtype=np.int64)) for t in gf.tensors.values())


def feasible_decisions(gf: GGUFFile, base: Policy, budget: Budget, imat, options: PlanOptions = PlanOptions(), *,
                       gpu_budget: int | None) -> tuple[Decisions, int]:
    """The decisions of file `gf` and the budget in bytes, after the feasibility checks (headers only)."""
    plan = plan_file(gf, base, options, imatrix=True)
    return check_decisions(plan, n_weights(gf), budget, imat, gpu_budget=gpu_budget)


def check_decisions(plan: QuantPlan, weights: int, budget: Budget, imat, *,
                    gpu_budget: int | None) -> tuple[Decisions, int]:
    """The decisions of the BASE `plan` (of a model of `weights` elements) and the budget in bytes, after the
    feasibility checks: nothing is measured."""
    decisions = split_decisions(plan, lambda d: imat.has_vector(d.name, d.shape))
    nbytes = budget.nbytes(weights)
    check_feasible(budget, nbytes, decisions.floor(), decisions.ceiling(), weights)
    if gpu_budget is not None:
        dense = _dense(decisions)
        spelled = replace(budget, spelled=f"--gpu-budget {decimal_size(gpu_budget)}")
        if gpu_budget < dense.floor():
            check_feasible(spelled, gpu_budget, dense.floor(), dense.ceiling(), weights,
                           "set of non-expert tensors")
    return decisions, nbytes


def choose(gf: GGUFFile, base: Policy, budget: Budget, imat, options: PlanOptions = PlanOptions(), *,
           gpu_budget: int | None = None, threads: int = 1, cache_dir: Path | None = None, inputs=(),
           source: str = "chosen policy", note: Callable[[str], None] = lambda s: None,
           sensitivity: "Costs | None" = None) -> Choice:
    """The chosen policy for GGUF file `gf` (kimi-quantize). `cache_dir`: the measurement cache's folder
    (measure.error_cache_dir(); None: measured errors are kept in memory only); `inputs`: the files the run
    reads, which no cache file replaces; `sensitivity`: the Costs the budget is spent by (None: the role
    prior, as the commands' default)."""
    decisions, budget_bytes = feasible_decisions(gf, base, budget, imat, options,
                                                 gpu_budget=gpu_budget)
    return choose_decided(decisions, budget_bytes, gguf_rows(gf), base, budget, imat,
                          gpu_budget=gpu_budget, threads=threads,
                          cache_dir=cache_dir, inputs=inputs, source=source, note=note,
                          expert_share=expert_share(KimiConfig.from_gguf(gf.fields, gf.paths[0])),
                          sensitivity=sensitivity)


def expert_share(config: KimiConfig) -> float:
    """The share of the tokens a routed expert runs for on average: num_experts_per_tok / num_experts."""
    return config.n_expert_used / config.n_expert if config.n_expert else 1.0


def choose_decided(decisions: Decisions, budget_bytes: int, rows: RowReader, base: Policy, budget: Budget, imat, *,
                   gpu_budget: int | None, threads: int, cache_dir: Path | None,
                   source: str, note: Callable[[str], None], expert_share: float, inputs=(),
                   sensitivity: "Costs | None" = None) -> Choice:
    """Measure, solve and emit, for decisions checked by check_decisions; `rows` reads a tensor's stored rows
    (from a GGUF, or from the converter's producer in kimi-convert's one pass)."""
    cache = ErrorCache(cache_dir, note, inputs)
    vectors: dict[str, np.ndarray | None] = {}

    def vector(name: str):
        if name not in vectors:
            d = next(d for u in decisions.units for d in u.decisions if d.name == name)
            vectors[name] = imat.vector(d.name, d.shape)
        return vectors[name]
    shares = token_shares(imat, expert_share)
    points = []             # per decision, every candidate (bytes, measured error), smallest first
    for u in decisions.units:
        errors = unit_errors(u, rows, vector, cache, threads, shares)
        points.append([Point(t, u.nbytes(t), errors[t]) for t in u.candidates])
        vectors.clear()
    cache.save(note)
    note(f"error measures: {cache.hits} from the cache, {cache.misses} measured"
         + (f" ({cache_dir})" if cache_dir is not None else " (not cached)"))
    costs = sensitivity if sensitivity is not None else shipped_prior()
    types = [[p.qtype for p in (lower_hull(h) if costs.hull_only else h)] for h in points]
    cost = costs(decisions.units, types, [{p.qtype: p.error for p in h} for h in points])
    points = [[Point(t, u.nbytes(t), c[t]) for t in ts] for u, ts, c in zip(decisions.units, types, cost)]
    measure = costs.describe()
    solution = split_solve(decisions, points, budget_bytes, gpu_budget)
    return _choice(decisions, points, solution, budget, budget_bytes, source, base,
                   f"imatrix {imat.path}", expert_share, measure)


def _dense(decisions: Decisions) -> Decisions:
    """The tensors that run for every token: all but the routed experts."""
    return Decisions(tuple(u for u in decisions.units if not u.expert),
                     tuple(d for d in decisions.fixed if not ROUTED_EXPERTS.match(d.name)))


def split_solve(decisions: Decisions, hulls: list, budget_bytes: int, gpu_budget: int | None,
                exact: bool = True) -> Solution:
    """One knapsack over every decision (`hulls`: each decision's candidate points; the choice indexes them);
    with a GPU budget that the non-expert part of it exceeds, the non-expert decisions are solved within the
    GPU budget first and the experts within what is left, and the lower bound is that of both constraints."""
    free = budget_bytes - decisions.fixed_bytes
    joint = solve(hulls, free, exact)
    if gpu_budget is None:
        return joint
    dense_idx = [i for i, u in enumerate(decisions.units) if not u.expert]
    expert_idx = [i for i, u in enumerate(decisions.units) if u.expert]
    dense = _dense(decisions)
    dense_bytes = dense.fixed_bytes + sum(hulls[i][joint.choice[i]].nbytes for i in dense_idx)
    if dense_bytes <= gpu_budget:
        return joint
    expert_floor = sum(hulls[i][0].nbytes for i in expert_idx)
    dense_free = min(gpu_budget, budget_bytes - (decisions.fixed_bytes - dense.fixed_bytes) - expert_floor) \
        - dense.fixed_bytes
    d = solve([hulls[i] for i in dense_idx], dense_free, exact)
    e = solve([hulls[i] for i in expert_idx], free - d.nbytes, exact)
    choice = [0] * len(hulls)
    for i, c in zip(dense_idx, d.choice):
        choice[i] = c
    for i, c in zip(expert_idx, e.choice):
        choice[i] = c
    bound = lp_bound_two(hulls, [not u.expert for u in decisions.units], free, gpu_budget - dense.fixed_bytes)
    return Solution(choice, e.lam, d.nbytes + e.nbytes, d.error + e.error, bound, False)


def _choice(decisions: Decisions, hulls, solution: Solution, budget: Budget, budget_bytes: int, source: str,
            base: Policy, imatrix: str, expert_share: float,
            measure: str | None = None) -> Choice:
    chosen: list[Chosen] = []
    lines = []
    for u, h, i in zip(decisions.units, hulls, solution.choice):
        p = h[i]
        hull = lower_hull(h)
        others = ", ".join(f"{q.qtype.name} {q.error:.3g}" for q in hull if q is not p) or "no other hull point"
        off = "" if any(q is p for q in hull) else " (off the hull: the exact search's)"
        chosen.append(Chosen(u.decisions, p.qtype, p.error, decided_why(p.qtype, p.error, p.nbytes,
                                                                        f"hull: {others}{off}")))
        lines.append(f"{u.key:<40} {p.qtype.name:>7} {decimal_size(p.nbytes):>28}  error {p.error:.4g}  "
                     f"(hull: {others}){off}")
    measure = measure or (f"imatrix-weighted relative error on sampled rows, each matrix weighted by its rows and "
                          f"its share of the tokens (a routed expert's: its imatrix count over a dense tensor's, "
                          f"else {expert_share:.4g})")
    for d in decisions.fixed:
        if not held(d, decisions.allow_requantize):
            chosen.append(Chosen((d,), d.target, None, f"fixed: {d.why}"))
    nbytes = decisions.fixed_bytes + solution.nbytes
    dense = _dense(decisions).fixed_bytes + sum(h[i].nbytes for u, h, i in zip(decisions.units, hulls,
                                                                              solution.choice) if not u.expert)
    types = sorted({t for u in decisions.units for t in u.candidates}, key=int)
    header = [f"{budget.spelled}: {decimal_size(nbytes)} of {decimal_size(budget_bytes)}",
              f"non-expert tensors {decimal_size(dense)}, routed experts {decimal_size(nbytes - dense)}",
              f"candidates: {', '.join(t.name for t in types)}; {imatrix}",
              f"fixed (protected, pinned, no choice): {decimal_size(decisions.fixed_bytes)}; decided: "
              f"{len(decisions.units)} decisions",
              f"solver: {solution.describe()}; the gap is (error - lower bound) / lower bound, the most this "
              f"choice's error can exceed the least any choice within the budget makes",
              f"base: {base.source}; error measure: {measure}"]
    text = policy_text(chosen, header)
    policy = replace(parse_policy(text, source), inputs=base.inputs)
    return Choice(policy, text, budget_bytes, nbytes, decisions.floor(), decisions.ceiling(), lines, solution,
                  measure)


def check_budget_options(budget: Budget | None, imatrix, gpu_budget: int | None) -> None:
    """Before anything is read: a budget needs an imatrix; --gpu-budget needs a budget."""
    if budget is None:
        if gpu_budget is not None:
            raise BudgetError("--gpu-budget splits a --target-size or --target-bpw budget: give one")
        return
    if imatrix is None:
        raise BudgetError(f"{budget.spelled}: needs --imatrix FILE (the error of each type is weighted by it, and "
                          f"the low-bit types need it)")


MEASURES = ("prior", "weights", "kld")      # --sensitivity: what a decision's cost per type is


@dataclass(frozen=True)
class TargetOptions:
    budget: Budget
    gpu_budget: int | None
    emit_policy: Path | None
    measure: str = "prior"      # MEASURES; "kld" is costed by the run (quant.job's SensitivityOptions)

    def prior(self):
        """The Costs of the weight-error measures: the role prior's or the raw errors' (prior.py)."""
        from .prior import WeightErrors, shipped_prior
        return shipped_prior() if self.measure == "prior" else WeightErrors()

    def outputs(self) -> list:
        """The paths a budget run writes besides OUT: the emitted policy. (The measurement cache is the
        user's, shared by every run: measure.error_cache_dir(), never beside OUT.)"""
        from ...paths import report_output
        return [report_output(self.emit_policy, "--emit-policy")] if self.emit_policy is not None else []


def no_base() -> Policy:
    """The BASE of a budget given no --policy: no rule pins anything."""
    return Policy(None, "no --policy", (), "no --policy")
