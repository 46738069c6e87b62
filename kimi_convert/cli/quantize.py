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

from ..errors import Interrupted, KimiError
from .common import (check_count, console, debug_option, fail, human, interrupted, interrupts_raise, note, output,
                     parse_size, progress_bar, reading, run_app, typer_app)
from .policy_options import (load_policy_options, print_choice, print_dry_run_table, report_decisions,
                             report_write_blockers, target_options)


app = typer_app(help=__doc__)
# an OS thread each; far above the CPUs of any machine this runs on, and below what a process may start
MAX_THREADS = 1024


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
    target_size: Optional[str] = typer.Option(None, "--target-size", metavar="SIZE",
                                              help="choose every free tensor's type so that the tensor data "
                                              "fits SIZE (600G = 600GB = 600e9 bytes; 558GiB in powers of "
                                              "1024); needs --imatrix"),
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
    sensitivity: str = typer.Option("weights", "--sensitivity", metavar="weights|kld",
                                    help="with a budget: what a decision's cost per type is: the imatrix-weighted "
                                    "weight error (default), or the output's KL divergence measured end to end "
                                    "with the decision alone quantized (needs --sensitivity-text; torch)"),
    sensitivity_text: Optional[Path] = typer.Option(None, "--sensitivity-text", readable=False, metavar="TEXT",
                                                    help="the text --sensitivity kld runs (chunks of 128 tokens)"),
    sensitivity_chunks: int = typer.Option(16, "--sensitivity-chunks", metavar="N",
                                           help="chunks of 128 tokens --sensitivity kld runs (default 16)"),
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
    from ..gguf_io import check_split_max_size, open_gguf, output_lock, written_paths
    from ..paths import Input, Report, refuse_overlap, report_output
    from ..quant.driver import plan_file, quantize_file, run_inputs
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
            check_sensitivity(sensitivity, sensitivity_text, sensitivity_chunks, target)
            pol, imat = load_policy_options(policy, tensor_type, tensor_type_file, imatrix,
                                            allow_requantize=allow_requantize, plan_only=explain or dry_run,
                                            base=target is not None)
            inputs = run_inputs(src, pol, imat) + ([Input(sensitivity_text, "--sensitivity-text")]
                                                   if sensitivity_text else [])
            refuse_overlap(inputs, [*(written_paths(out) if out is not None else []),
                                    *([report_output(json_file)] if json_file else []),
                                    *(target.outputs() if target else [])])
            report = held.enter_context(closing(Report(json_file, force))) if json_file is not None else None
            emitted = (held.enter_context(closing(Report(emit_policy, force, "--emit-policy")))
                       if emit_policy is not None else None)
            if not (explain or dry_run):        # a second run into OUT refuses before reading IN
                held.enter_context(output_lock(out))
            reading(src)
            gf = open_gguf(src)
            choice = None
            if target is not None:
                costs = kld_costs(src, imat, sensitivity_text, sensitivity_chunks) if sensitivity == "kld" else None
                choice = choose_types(gf, pol, imat, target, allow_requantize=allow_requantize, threads=threads,
                                      inputs=inputs, sensitivity=costs)
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


def choose_types(gf, base, imat, target, *, allow_requantize: bool, threads: int, inputs, sensitivity=None):
    from ..quant.blocks import default_threads
    from ..quant.target.choose import choose
    from ..quant.target.measure import error_cache_dir
    return choose(gf, base, target.budget, imat, allow_requantize=allow_requantize, gpu_budget=target.gpu_budget,
                  threads=threads or default_threads(), cache_dir=error_cache_dir(), inputs=inputs,
                  source=str(target.emit_policy or "the chosen policy"), note=note, sensitivity=sensitivity)


SENSITIVITY_CTX = 128


def check_sensitivity(sensitivity: str, text: Optional[Path], chunks: int, target) -> None:
    if sensitivity not in ("weights", "kld"):
        raise KimiError(f"--sensitivity {sensitivity!r}: must be weights or kld")
    if sensitivity == "kld" and target is None:
        raise KimiError("--sensitivity kld chooses types for a budget: give --target-size or --target-bpw")
    if sensitivity == "kld" and text is None:
        raise KimiError("--sensitivity kld needs --sensitivity-text TEXT (the tokens it measures on)")
    if sensitivity != "kld" and text is not None:
        raise KimiError("--sensitivity-text is read by --sensitivity kld only")
    check_count(chunks, "--sensitivity-chunks", 1, 1 << 16)


def kld_costs(src: Path, imat, text: Path, chunks: int):
    """Each decision's measured KL cost (quant.target.sensitivity), on the streamed engine (torch)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise KimiError("--sensitivity kld runs the model on torch: pip install 'kimi-convert[engine]'") from None
    from ..engine.tokens import chunk_tokens, model_tokenizer, text_tokens
    from ..quant.target.sensitivity import KldCosts, Sensitivity, sensitivity_cache_dir
    reading(text)
    tok = model_tokenizer(src)
    ids = chunk_tokens(text_tokens(text, tok), SENSITIVITY_CTX, chunks, tok.bos_id if tok.add_bos else None, text,
                       "--sensitivity kld")
    return KldCosts(Sensitivity(src, ids, imat, cache_dir=sensitivity_cache_dir(), note=note), text, note)


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
