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

import time
from contextlib import ExitStack
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import Interrupted, KimiError
from .common import (check_count, check_threads, console, debug_option, fail, human, interrupted, interrupts_raise,
                     note, output, parse_size, progress_bar, reading, run_app, threads_option, typer_app)
from .policy_options import (allow_requantize_option, emit_policy_option, gpu_budget_option, imatrix_option,
                             resume_option, sensitivity_option, strict_option, target_bpw_option, target_size_option,
                             tensor_type_file_option, tensor_type_option)
from .policy_options import print_choice, print_dry_run_table, report_decisions, report_write_blockers, target_options


app = typer_app(help=__doc__)
# an OS thread each; far above the CPUs of any machine this runs on, and below what a process may start


def list_presets(value: bool) -> None:
    """--list-presets: each shipped preset, what it does and what it requires; then llama-quantize's file types,
    what their mixture does, and whether kimi-quantize can write it yet; then exit."""
    if not value:
        return
    from ..quant.blocks import supported_types
    from ..quant.mixtures import FILE_TYPES
    from ..quant.policy import load_policy, preset_names
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
    target_size: Optional[str] = target_size_option(),
    target_bpw: Optional[str] = target_bpw_option(),
    gpu_budget: Optional[str] = gpu_budget_option(),
    emit_policy: Optional[Path] = emit_policy_option(),
    imatrix: Optional[Path] = imatrix_option(),
    sensitivity: str = sensitivity_option(),
    sensitivity_text: Optional[Path] = typer.Option(None, "--sensitivity-text", readable=False, metavar="TEXT",
                                                    help="the text --sensitivity kld runs (chunks of 128 tokens)"),
    sensitivity_chunks: int = typer.Option(16, "--sensitivity-chunks", metavar="N",
                                           help="chunks of 128 tokens --sensitivity kld runs (default 16)"),
    sensitivity_layers: int = typer.Option(4, "--sensitivity-layers", metavar="N",
                                           help="--sensitivity kld measures the decisions of N layers of each kind "
                                           "(evenly spread) and scales the others' weight errors by what those "
                                           "measured, per role and type; 0: every layer (default 4)"),
    tensor_type: List[str] = tensor_type_option(),
    tensor_type_file: List[Path] = tensor_type_file_option(),
    explain: bool = typer.Option(False, "--explain", help="print every tensor's decision and why, then exit"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print sizes, time and RAM estimates, then exit"),
    strict: bool = strict_option(),
    allow_requantize: bool = allow_requantize_option(),
    threads: int = threads_option("quantizer and hashing threads"),
    force: bool = typer.Option(False, "--force", help="overwrite an existing output (and --json report); never an "
                               "input"),
    resume: bool = resume_option(),
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
    from ..quant.job import QuantizeJob
    started, result = time.time(), None
    if policy is None and target_size is None and target_bpw is None:
        # a usage mistake (exit 2), as the required option it was before budgets came
        from typer._click.exceptions import UsageError
        raise UsageError("Missing option '--policy' (or a budget: --target-size SIZE / --target-bpw BPW)", ctx)
    try:
        with interrupts_raise(), ExitStack() as held:
            opts = _options(src, out, policy, imatrix, tensor_type, tensor_type_file, strict, allow_requantize,
                            target_size, target_bpw, gpu_budget, emit_policy, sensitivity, sensitivity_text,
                            sensitivity_chunks, sensitivity_layers, threads, force, resume, keep_split,
                            split_max_size, json_file, explain or dry_run)
            job = QuantizeJob(opts, note=note, reading=reading).open(held)
            choice = job.choose()
            plan = job.plan
            report_decisions(plan, job.imatrix)
            if opts.plan_only:
                print_plan_only(job, explain, dry_run)
                return
            with progress_bar(plan.target_bytes) as advance:
                result = job.write(advance)
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


def _options(src, out, policy, imatrix, tensor_type, tensor_type_file, strict, allow_requantize, target_size,
             target_bpw, gpu_budget, emit_policy, sensitivity, sensitivity_text, sensitivity_chunks, sensitivity_layers,
             threads, force, resume, keep_split, split_max_size, json_file, plan_only: bool):
    """The command line as one QuantizeOptions, every value checked (one line each) before anything is read."""
    from ..gguf_io import check_split_max_size
    from ..quant.job import QuantizeOptions, SensitivityOptions
    from ..quant.options import PolicyOptions
    if keep_split and split_max_size is not None:
        raise KimiError("--keep-split and --split-max-size exclude each other")
    if not plan_only and out is None:
        raise KimiError("give OUT.gguf (or --dry-run / --explain)")
    max_size = 0
    if split_max_size is not None:          # given, even as '': a size it must be
        max_size = parse_size(split_max_size)
        check_split_max_size(max_size, split_max_size)
    check_threads(threads)
    target = target_options(target_size, target_bpw, gpu_budget, emit_policy, imatrix, policy, sensitivity)
    check_sensitivity(sensitivity, sensitivity_text, sensitivity_chunks)
    check_count(sensitivity_layers, "--sensitivity-layers", 0, 1 << 16)
    quant = PolicyOptions(policy, imatrix, tuple(tensor_type), tuple(tensor_type_file), allow_requantize, strict,
                          target)
    sens = (SensitivityOptions(sensitivity_text, sensitivity_chunks, sensitivity_layers)
            if sensitivity == "kld" else None)
    return QuantizeOptions(src, out, quant, sens, threads, force, resume, keep_split, max_size, json_file, plan_only)


def print_plan_only(job, explain: bool, dry_run: bool) -> None:
    """--explain / --dry-run: why a write would be refused, the decisions or the plan's table, the budget's
    choice; then the reports."""
    report_write_blockers(job.plan, job.imatrix)
    if explain:
        print_explain(job.plan, job.policy)
    if dry_run:
        print_dry_run(job.plan)
    if job.choice is not None:
        print_choice(job.choice, explain)
    job.deliver_reports()


def check_sensitivity(sensitivity: str, text: Optional[Path], chunks: int) -> None:
    """--sensitivity's companions (its value and its need of a budget: target_options)."""
    if sensitivity == "kld" and text is None:
        raise KimiError("--sensitivity kld needs --sensitivity-text TEXT (the tokens it measures on)")
    if sensitivity != "kld" and text is not None:
        raise KimiError("--sensitivity-text is read by --sensitivity kld only")
    check_count(chunks, "--sensitivity-chunks", 1, 1 << 16)


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


def main() -> None:
    run_app(app, "kimi-quantize")
