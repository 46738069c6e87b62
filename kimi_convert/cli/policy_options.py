"""The policy options kimi-quantize and kimi-convert --policy share: loading the policy and imatrix,
reporting the decisions, the --dry-run table."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

from rich.markup import escape
from rich.table import Table

from ..errors import KimiError
from .common import console, human, note, output, reading

if TYPE_CHECKING:
    from ..quant.imatrix import Imatrix


def load_policy_options(policy: Optional[str], tensor_type: List[str], tensor_type_file: List[Path],
                        imatrix: Optional[Path], *, allow_requantize: bool, plan_only: bool, base: bool = False):
    """(policy, imatrix or None) from --policy, --tensor-type, --tensor-type-file and --imatrix, with the policy's
    requirements checked: kimi-quantize and kimi-convert --policy read them alike, before any heavy work.
    `base`: the policy is a budget's BASE (quant.target), and may be absent (no tensor pinned)."""
    from ..quant.policy import load_policy, tensor_type_rules
    if policy is None:
        if not base:
            raise KimiError("give --policy POLICY (a file or preset: --list-presets), or a budget: "
                            "--target-size SIZE / --target-bpw BPW")
        from ..quant.target.choose import no_base
        pol = no_base()
    else:
        reading(policy)         # and its --tensor-type rules
        pol = load_policy(policy)
    pol = pol.with_tensor_types(tensor_type_rules(tensor_type, tensor_type_file), tensor_type_file)
    for line in pol.check_requirements(imatrix=imatrix is not None, allow_requantize=allow_requantize,
                                       plan_only=plan_only):
        note(line)
    if imatrix is None:
        return pol, None
    reading(imatrix)
    return pol, load_imatrix(imatrix)


def target_options(target_size: Optional[str], target_bpw: Optional[str], gpu_budget: Optional[str],
                   emit_policy: Optional[Path], imatrix: Optional[Path], policy: Optional[str]):
    """The budget options (quant.target.choose.TargetOptions), or None without one; every bad value refused in
    one line before anything is read."""
    from ..quant.target.budget import BudgetError, parse_budget
    from ..quant.target.choose import TargetOptions, check_budget_options
    budget = parse_budget(target_size, target_bpw)
    gpu = None
    if gpu_budget is not None:
        from ..sizes import parse_size
        gpu = parse_size(gpu_budget, "--gpu-budget", BudgetError)
        if gpu <= 0:
            raise BudgetError(f"--gpu-budget {gpu_budget!r}: must be more than 0 bytes")
    check_budget_options(budget, imatrix, gpu)
    if budget is None:
        if emit_policy is not None:
            raise BudgetError("--emit-policy writes the types a budget chose: give --target-size or --target-bpw")
        return None
    return TargetOptions(budget, gpu, emit_policy)


def print_choice(choice, explain: bool) -> None:
    """On stderr: the budget met and the solve's error, lower bound and gap; with --explain, each decision (its
    type, bytes, error and the hull's others)."""
    from ..quant.target.budget import decimal_size
    if explain:
        for line in choice.lines:
            console.print(escape(line), highlight=False)
    console.print(f"budget {decimal_size(choice.budget_bytes)}: chose {decimal_size(choice.nbytes)} "
                  f"(floor {decimal_size(choice.floor)}, ceiling {decimal_size(choice.ceiling)})", highlight=False)
    if choice.solution is not None:
        note(f"solver: {choice.solution.describe()}")

def report_decisions(plan, imat: Imatrix | None) -> None:
    """On stderr: the rules that name protected tensors, the warnings, and the imatrix's coverage."""
    from ..quant.driver import imatrix_coverage
    print_conflicts(plan)
    for w in plan.warnings:
        console.print(f"[yellow]warning:[/] {escape(w)}", highlight=False)
    if imat is not None:
        for line in imatrix_coverage(plan, imat):
            note(line)


def report_write_blockers(plan, imat: Imatrix | None) -> None:
    """With --explain / --dry-run: on stderr, why writing this plan would be refused (quant.plan.write_blockers)."""
    from ..quant.plan import write_blockers
    entries = None if imat is None else {d.name for d in plan.decisions
                                         if d.needs_imatrix and imat.has_vector(d.name, d.shape)}
    for line in write_blockers(plan, entries, imat.path if imat is not None else ""):
        console.print(f"[yellow]note:[/] writing this plan is refused: {escape(line)}", highlight=False)


def load_imatrix(path: Path):
    from ..quant.imatrix import load_imatrix as load
    return load(path)


def print_conflicts(plan) -> None:
    """One note per (rule, protection), the lines --strict refuses with: the tensors it names, the protection
    and why; the rule is not applied to them."""
    for g in plan.conflict_groups:
        console.print(f"[yellow]note:[/] {escape(g.describe())} (not applied to them)", highlight=False)


def print_dry_run_table(plan, title: str):
    """Output bytes and estimated time per class and type, and the total (also kimi-convert --policy --dry-run's)."""
    from ..quant.driver import estimate
    e = estimate(plan)
    t = Table(title=title)
    for col in ("type", "tensors", "bytes", "est. time"):
        t.add_column(col, justify="left" if col == "type" else "right")
    for row in e.rows:
        t.add_row(row.label, str(row.n), human(row.nbytes), _seconds(row.seconds))
    t.add_row("[bold]total", f"[bold]{len(plan.decisions)}", f"[bold]{human(plan.target_bytes)}",
              f"[bold]{_seconds(e.seconds)}")
    output.print(t)
    return e


def _seconds(seconds: float) -> str:
    """An estimated time; n/a for a type that cannot be written yet (no kernel to time)."""
    return "n/a" if seconds != seconds else f"{seconds:.1f} s"
