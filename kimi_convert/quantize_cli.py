"""kimi-quantize: per-tensor policy quantization of a kimi-k3 / kimi-k31 GGUF (a thin layer over kimi_convert.quant).

  kimi-quantize --policy POLICY IN.gguf OUT.gguf [--imatrix FILE] [--tensor-type RE=TYPE ...]
                [--tensor-type-file F] [--explain] [--dry-run] [--strict] [--allow-requantize]
                [--threads N] [--force] [--keep-split | --split-max-size S] [--json REPORT.json]
  kimi-quantize --target-size 600G IN.gguf OUT.gguf --imatrix FILE [--policy BASE] [--gpu-budget 80G]
                [--emit-policy CHOSEN.toml] ...     (or --target-bpw 2.5)

POLICY is a TOML file, a shipped preset name (lower case: q8_0, k3-q4) or a llama-quantize file type (upper case:
Q4_K_M, IQ2_XXS), whose mixture then decides (docs/policy.md); `kimi-quantize --list-presets` lists both kinds.
"""
from __future__ import annotations

import json
import time
from contextlib import ExitStack, closing
from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape
from rich.table import Table

from .cli import (check_count, console, debug_option, fail, human, interrupted, interrupts_raise, note, output,
                  parse_size, progress_bar, reading, run_app, typer_app)
from .errors import Interrupted, KimiError

app = typer_app(help=__doc__)
# an OS thread each; far above the CPUs of any machine this runs on, and below what a process may start
MAX_THREADS = 1024


def list_presets(value: bool) -> None:
    """--list-presets: each shipped preset, what it does and what it requires; then llama-quantize's file types,
    what their mixture does, and whether kimi-quantize can write it yet; then exit."""
    if not value:
        return
    from .quant.blocks import supported_types
    from .quant.mixtures import FILE_TYPES
    from .quant.policy import load_policy, preset_names
    show = lambda line: output.print(line, highlight=False, markup=False)       # noqa: E731
    show("presets (ours, lower case):")
    for name in preset_names():
        pol = load_policy(name)
        needs = f"  (requires: {', '.join(pol.requires)})" if pol.requires else ""
        show(f"  {name:<10}  {pol.description}{needs}")
    show("llama-quantize's mixtures (its file types, upper case; the file `llama-quantize IN OUT NAME` writes, "
         "with our protections):")
    for ft in FILE_TYPES.values():
        needs = load_policy(ft.name).requires
        state = ("  (requires: imatrix)" if needs else "") + \
                ("" if ft.default in supported_types() else f"  (cannot write {ft.default.name} yet)")
        what = f"alias of {ft.alias_of}" if ft.alias_of else ft.what
        show(f"  {ft.name:<10}  file type {ft.ftype}: {what}{state}")
    raise typer.Exit()


@app.command()
def quantize(
    ctx: typer.Context,
    src: Path = typer.Argument(..., readable=False, metavar="IN.gguf",
                               help="a kimi-k3 / kimi-k31 GGUF (any part of a split file)"),
    out: Optional[Path] = typer.Argument(None, readable=False, metavar="OUT.gguf",
                                         help="the quantized file (not needed with --dry-run or --explain)"),
    policy: Optional[str] = typer.Option(None, "--policy", metavar="POLICY",
                                         help="policy TOML file or preset name (see --list-presets); with "
                                         "--target-size, the BASE whose rules pin the tensors they name"),
    target_size: Optional[str] = typer.Option(None, "--target-size", metavar="SIZE",
                                              help="choose every free tensor's type so that the tensor data "
                                              "fits SIZE (K/M/G/T: powers of 1000), e.g. 600G; needs --imatrix"),
    target_bpw: Optional[str] = typer.Option(None, "--target-bpw", metavar="BPW",
                                             help="the same budget in bits per weight, e.g. 2.5"),
    gpu_budget: Optional[str] = typer.Option(None, "--gpu-budget", metavar="SIZE",
                                             help="with a budget: the tensors that run for every token (all but "
                                             "the routed experts) fit SIZE, the experts the rest"),
    emit_policy: Optional[Path] = typer.Option(None, "--emit-policy", readable=False, metavar="CHOSEN.toml",
                                               help="with a budget: write the chosen types as a policy file "
                                               "(--policy CHOSEN.toml makes the same file)"),
    imatrix: Optional[Path] = typer.Option(None, "--imatrix", readable=False, metavar="FILE",
                                           help="llama-imatrix file (GGUF or .dat)"),
    tensor_type: List[str] = typer.Option([], "--tensor-type", metavar="RE=TYPE",
                                          help="llama-quantize override, tried before the policy's rules"),
    tensor_type_file: List[Path] = typer.Option([], "--tensor-type-file", readable=False, metavar="F",
                                                help="file of RE=TYPE tokens (white-space separated)"),
    explain: bool = typer.Option(False, "--explain", help="print every tensor's decision and why, then exit"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print sizes, time and RAM estimates, then exit"),
    strict: bool = typer.Option(False, "--strict", help="a rule that names a protected tensor is an error"),
    allow_requantize: bool = typer.Option(False, "--allow-requantize",
                                          help="let rules re-quantize already quantized tensors (MXFP4 experts)"),
    threads: int = typer.Option(0, "--threads", metavar="N", help="quantizer threads (default: all cores)"),
    force: bool = typer.Option(False, "--force", help="overwrite an existing output (and --json report); never an "
                               "input"),
    resume: bool = typer.Option(False, "--resume", help="keep the finished split parts of an interrupted run of "
                                "the same plan into OUT (each checked against its manifest journal); write the rest"),
    keep_split: bool = typer.Option(False, "--keep-split", help="one output file per input split file"),
    split_max_size: Optional[str] = typer.Option(None, "--split-max-size", metavar="SIZE",
                                                 help="max bytes per output file, e.g. 50G"),
    json_file: Optional[Path] = typer.Option(None, "--json", readable=False, metavar="REPORT.json",
                                             help="also write the plan as JSON"),
    _presets: bool = typer.Option(False, "--list-presets", is_eager=True, callback=list_presets,
                                  help="list the shipped presets and exit"),
    _debug: bool = debug_option(),
):
    """Quantize IN.gguf by POLICY into OUT.gguf, in one streaming pass.

    \b
    Exit status:
      0      written (with --dry-run / --explain: the plan was printed)
      1      bad input or any other error (nothing written)
      2      a usage mistake (unknown option, missing argument, a value that is not a number)
      3      not enough free disk for the output (+ 64 MiB)
      128+N  ended by signal N; nothing written
    """
    from .gguf_io import check_split_max_size, open_gguf, output_lock, written_paths
    from .paths import Report, refuse_overlap, report_output
    from .quant.driver import plan_file, quantize_file, run_inputs
    started, result = time.time(), None
    if policy is None and target_size is None and target_bpw is None:
        # a usage mistake (exit 2), as the required option it was before budgets came
        from typer._click.exceptions import UsageError
        raise UsageError("Missing option '--policy' (or a budget: --target-size SIZE / --target-bpw BPW)", ctx)
    try:
        with interrupts_raise(), ExitStack() as held:
            if keep_split and split_max_size is not None:
                raise KimiError("--keep-split and --split-max-size exclude each other")
            if not (explain or dry_run) and out is None:
                raise KimiError("give OUT.gguf (or --dry-run / --explain)")
            max_size = 0
            if split_max_size is not None:          # given, even as '': a size it must be
                max_size = parse_size(split_max_size)
                check_split_max_size(max_size, split_max_size)
            check_count(threads, "--threads", 0, MAX_THREADS, "one OS thread each; 0 is all cores")
            target = target_options(target_size, target_bpw, gpu_budget, emit_policy, imatrix, policy)
            pol, imat = load_policy_options(policy, tensor_type, tensor_type_file, imatrix,
                                            allow_requantize=allow_requantize, plan_only=explain or dry_run,
                                            base=target is not None)
            cache = target and target.cache_path(out)
            refuse_overlap(run_inputs(src, pol, imat), [*(written_paths(out) if out is not None else []),
                                                        *([report_output(json_file)] if json_file else []),
                                                        *(target.outputs(out) if target else [])])
            report = held.enter_context(closing(Report(json_file, force))) if json_file is not None else None
            emitted = (held.enter_context(closing(Report(emit_policy, force, "--emit-policy")))
                       if emit_policy is not None else None)
            if not (explain or dry_run):        # a second run into OUT refuses before reading IN
                held.enter_context(output_lock(out))
            reading(src)
            gf = open_gguf(src)
            choice = None
            if target is not None:
                choice = choose_types(gf, pol, imat, target, allow_requantize=allow_requantize, threads=threads,
                                      cache=cache)
                pol = choice.policy
            plan = plan_file(gf, pol, allow_requantize=allow_requantize, strict=strict, imatrix=imat is not None)
            report_decisions(plan, imat)
            if explain or dry_run:
                report_write_blockers(plan, imat)
                if explain:
                    print_explain(plan, pol)
                if dry_run:
                    print_dry_run(plan)
                if choice is not None:
                    print_choice(choice, explain)
                if report:
                    report.deliver(json_report(plan, pol))
                if emitted:
                    emitted.deliver(choice.text)
                return
            with progress_bar(plan.target_bytes) as advance:
                result = quantize_file(src, out, pol, imatrix=imat, allow_requantize=allow_requantize,
                                       strict=strict, force=force, split_max_size=max_size, keep_split=keep_split,
                                       threads=threads, on_bytes=advance, log=note, resume=resume,
                                       reports=[*([(report, json_report(plan, pol))] if report else []),
                                                *([(emitted, choice.text)] if emitted else [])])
            if choice is not None:
                print_choice(choice, False)
            for line in result.notes:
                note(line)
    except KimiError as e:
        fail(e)
    except Interrupted as e:
        interrupted(e, out or src, started, result)
    for p in result.paths:
        output.print(str(p), highlight=False)
    console.print(f"wrote {len(plan.decisions)} tensors ({sum(not d.copied for d in plan.decisions)} quantized), "
                  f"{human(plan.target_bytes)} ({plan.target_bytes / max(plan.source_bytes, 1):.1%} of the input) "
                  f"in {result.seconds:.1f} s", highlight=False)


def load_policy_options(policy: Optional[str], tensor_type: List[str], tensor_type_file: List[Path],
                        imatrix: Optional[Path], *, allow_requantize: bool, plan_only: bool, base: bool = False):
    """(policy, imatrix or None) from --policy, --tensor-type, --tensor-type-file and --imatrix, with the policy's
    requirements checked: kimi-quantize and kimi-convert --policy read them alike, before any heavy work.
    `base`: the policy is a budget's BASE (quant.target), and may be absent (no tensor pinned)."""
    from .quant.policy import load_policy, tensor_type_rules
    if policy is None:
        if not base:
            raise KimiError("give --policy POLICY (a file or preset: --list-presets), or a budget: "
                            "--target-size SIZE / --target-bpw BPW")
        from .quant.target.choose import no_base
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
    from .quant.target.budget import BudgetError, parse_budget
    from .quant.target.choose import TargetOptions, check_budget_options
    budget = parse_budget(target_size, target_bpw)
    gpu = None
    if gpu_budget is not None:
        gpu = parse_size(gpu_budget, "--gpu-budget")
        if gpu <= 0:
            raise BudgetError(f"--gpu-budget {gpu_budget!r}: must be more than 0 bytes")
    check_budget_options(budget, imatrix, gpu)
    if budget is None:
        if emit_policy is not None:
            raise BudgetError("--emit-policy writes the types a budget chose: give --target-size or --target-bpw")
        return None
    return TargetOptions(budget, gpu, emit_policy)


def choose_types(gf, base, imat, target, *, allow_requantize: bool, threads: int, cache):
    from .quant.blocks import default_threads
    from .quant.target.choose import choose
    return choose(gf, base, target.budget, imat, allow_requantize=allow_requantize, gpu_budget=target.gpu_budget,
                  threads=threads or default_threads(), cache_path=cache,
                  source=str(target.emit_policy or "the chosen policy"), note=note)


def print_choice(choice, explain: bool) -> None:
    """On stderr: the budget met; with --explain, each decision (its type, bytes, error and the hull's others)."""
    from .quant.target.budget import decimal_size
    if explain:
        for line in choice.lines:
            console.print(escape(line), highlight=False)
    console.print(f"budget {decimal_size(choice.budget_bytes)}: chose {decimal_size(choice.nbytes)} "
                  f"(floor {decimal_size(choice.floor)}, ceiling {decimal_size(choice.ceiling)})", highlight=False)


def report_decisions(plan, imat) -> None:
    """On stderr: the rules that name protected tensors, the warnings, and the imatrix's coverage."""
    from .quant.driver import imatrix_coverage
    print_conflicts(plan)
    for w in plan.warnings:
        console.print(f"[yellow]warning:[/] {escape(w)}", highlight=False)
    if imat is not None:
        for line in imatrix_coverage(plan, imat):
            note(line)


def report_write_blockers(plan, imat) -> None:
    """With --explain / --dry-run: on stderr, why writing this plan would be refused (quant.plan.write_blockers)."""
    from .quant.plan import write_blockers
    entries = None if imat is None else {d.name for d in plan.decisions
                                         if d.needs_imatrix and imat.has_vector(d.name, d.shape)}
    for line in write_blockers(plan, entries, getattr(imat, "path", "")):
        console.print(f"[yellow]note:[/] writing this plan is refused: {escape(line)}", highlight=False)


def load_imatrix(path: Path):
    from .quant.imatrix import load_imatrix as load
    return load(path)


def print_conflicts(plan) -> None:
    """One note per (rule, protection), the lines --strict refuses with: the tensors it names, the protection
    and why; the rule is not applied to them."""
    for g in plan.conflict_groups:
        console.print(f"[yellow]note:[/] {escape(g.describe())} (not applied to them)", highlight=False)


def print_explain(plan, pol) -> None:
    """One line per tensor (plain text: greppable, and never wrapped in a pipe)."""
    requires = f" (requires: {', '.join(pol.requires)})" if pol.requires else ""
    output.print(f"# {pol.source}" + (f": {pol.description}" if pol.description else "") + requires,
                 highlight=False, markup=False)
    width = max(len(d.name) for d in plan.decisions)
    for d in plan.decisions:
        output.print(f"{d.name:<{width}}  {d.source.name:>6} -> {d.target.name:<6} {human(d.target_bytes):>10}  "
                     f"{d.why}", highlight=False, markup=False)


def print_dry_run(plan) -> None:
    e = print_dry_run_table(plan, "kimi-quantize plan")
    output.print(f"input {human(plan.source_bytes)} ({plan.source_bytes:,} bytes) -> output {human(plan.target_bytes)} "
                 f"({plan.target_bytes:,} bytes of tensor data); estimated peak RAM "
                 f"{human(e.peak_ram)}; time from this machine's measured kernel speed ({e.basis})", highlight=False)


def print_dry_run_table(plan, title: str):
    """Output bytes and estimated time per class and type, and the total (also kimi-convert --policy --dry-run's)."""
    from .quant.driver import estimate
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


def json_report(plan, pol) -> str:
    """The --json report: the plan, every tensor's decision."""
    rows = [{"tensor": d.name, "shape": list(d.shape), "from": d.source.name, "to": d.target.name,
             "bytes": d.target_bytes, "why": d.why, "protection": d.protection.kind if d.protection else None}
            for d in plan.decisions]
    report = {"policy": pol.source, "input_bytes": plan.source_bytes, "output_bytes": plan.target_bytes,
              "tensors": rows, "conflicts": [c.describe() for c in plan.conflicts], "warnings": plan.warnings}
    return json.dumps(report, indent=2) + "\n"


def main() -> None:
    run_app(app, "kimi-quantize")
