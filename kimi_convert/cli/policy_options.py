"""The policy options kimi-quantize and kimi-convert --policy share: loading the policy and imatrix,
reporting the decisions, the --dry-run table."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.markup import escape
from rich.table import Table

from .common import console, human, note, output

if TYPE_CHECKING:
    from ..quant.imatrix import Imatrix


# --- the options kimi-quantize and kimi-convert share, declared once -------------------------------------

def imatrix_option():
    return typer.Option(None, "--imatrix", readable=False, metavar="FILE", help="llama-imatrix file (GGUF or .dat)")


def tensor_type_option():
    return typer.Option([], "--tensor-type", metavar="RE=TYPE",
                        help="llama-quantize override, tried before the policy's rules")


def tensor_type_file_option():
    return typer.Option([], "--tensor-type-file", readable=False, metavar="F",
                        help="file of RE=TYPE tokens (white-space separated)")


def allow_requantize_option():
    return typer.Option(False, "--allow-requantize",
                        help="let rules re-quantize already quantized tensors (MXFP4 experts)")


def strict_option():
    return typer.Option(False, "--strict", help="a rule that names a protected tensor is an error")


def target_size_option():
    return typer.Option(None, "--target-size", metavar="SIZE",
                        help="choose every free tensor's type so that the tensor data fits SIZE (600G = 600GB = "
                        "600e9 bytes; 558GiB in powers of 1024); needs --imatrix; --policy is then the BASE")


def target_bpw_option():
    return typer.Option(None, "--target-bpw", metavar="BPW", help="the same budget in bits per weight, e.g. 2.5")


def gpu_budget_option():
    return typer.Option(None, "--gpu-budget", metavar="SIZE",
                        help="with a budget: the tensors that run for every token (all but the routed experts) fit "
                        "SIZE, the experts the rest")


def emit_policy_option():
    return typer.Option(None, "--emit-policy", readable=False, metavar="CHOSEN.toml",
                        help="with a budget: write the chosen types as a policy file (--policy CHOSEN.toml makes "
                        "the same file)")


def resume_option():
    return typer.Option(False, "--resume", help="keep the finished split parts of an interrupted run of the same "
                        "plan into OUT (each checked against its manifest journal); write the rest")


def sensitivity_option(kld: bool = True):
    """--sensitivity: what a budget spends its bytes by (quant/target/prior.py, sensitivity.py)."""
    return typer.Option("prior", "--sensitivity", metavar="prior|weights" + ("|kld" if kld else ""),
                        help="with a budget: a decision's cost per type: its imatrix-weighted weight error times its "
                        "role's KLD / weight error measured on the trained K3 fixture (prior, default), the weight "
                        "error alone (weights)" + (", or the output's KL divergence measured end to end with the "
                        "decision alone quantized (kld: needs --sensitivity-text; torch)" if kld else ""))


def target_options(target_size: Optional[str], target_bpw: Optional[str], gpu_budget: Optional[str],
                   emit_policy: Optional[Path], imatrix: Optional[Path], policy: Optional[str],
                   sensitivity: str = "prior"):
    """The budget options (quant.target.choose.TargetOptions), or None without one; every bad value refused in
    one line before anything is read."""
    from ..quant.target.budget import BudgetError, parse_budget
    from ..quant.target.choose import MEASURES, TargetOptions, check_budget_options
    if sensitivity not in MEASURES:
        raise BudgetError(f"--sensitivity {sensitivity!r}: must be one of {', '.join(MEASURES)}")
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
        if sensitivity != "prior":
            raise BudgetError(f"--sensitivity {sensitivity} chooses types for a budget: give --target-size or "
                              f"--target-bpw")
        return None
    return TargetOptions(budget, gpu, emit_policy, sensitivity)


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
    note(f"cost of a type: {choice.measure}")


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
