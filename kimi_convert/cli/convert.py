"""kimi-convert: HF_DIR -> OUT.gguf in one streaming pass (a thin layer over kimi_convert.convert.converter)."""
from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table

from ..errors import Interrupted, KimiError
from .common import (check_count, check_threads, console, debug_option, fail, human, interrupted, interrupts_raise,
                     note, output, parse_size, progress_bar, reading, run_app, threads_option, typer_app)
from .policy_options import (allow_requantize_option, emit_policy_option, gpu_budget_option, imatrix_option,
                             resume_option, sensitivity_option, strict_option, target_bpw_option,
                             target_size_option, tensor_type_file_option, tensor_type_option)


convert_app = typer_app(help=__doc__)


@convert_app.command()
def convert(
    hf_dir: Path = typer.Argument(..., readable=False, metavar="HF_DIR",
                                  help="Kimi-K3 / K3.1-Pro checkpoint folder (config.json, shards, index)"),
    out: Path = typer.Argument(..., readable=False, metavar="OUT.gguf",
                               help="output .gguf (split parts get -00001-of-0000N.gguf)"),
    outtype: str = typer.Option("bf16", help="bf16 (source bytes copied) or f32; MXFP4 experts stay MXFP4"),
    split_max_size: Optional[str] = typer.Option(
        None, metavar="SIZE", help="max bytes per split file, e.g. 50G or 50GB; at least 1M "
                                "(K, M, G, T: powers of 1000; KiB..TiB: 1024)"),
    split_max_tensors: int = typer.Option(0, help="max tensors per split file"),
    dry_run: bool = typer.Option(False, "--dry-run", help="check everything the run checks, print the plan "
                                 "and exit"),
    force: bool = typer.Option(False, "--force", help="overwrite an existing output"),
    resume: bool = resume_option(),
    policy: Optional[str] = typer.Option(None, "--policy", metavar="POLICY",
                                         help="quantize in the same pass, exactly as kimi-quantize --policy POLICY "
                                         "would quantize the converted file (a TOML file or a preset)"),
    imatrix: Optional[Path] = imatrix_option(),
    tensor_type: List[str] = tensor_type_option(),
    tensor_type_file: List[Path] = tensor_type_file_option(),
    allow_requantize: bool = allow_requantize_option(),
    strict: bool = strict_option(),
    target_size: Optional[str] = target_size_option(),
    target_bpw: Optional[str] = target_bpw_option(),
    gpu_budget: Optional[str] = gpu_budget_option(),
    emit_policy: Optional[Path] = emit_policy_option(),
    sensitivity: str = sensitivity_option(kld=False),
    threads: int = threads_option("threads that repack the experts, quantize and hash"),
    _debug: bool = debug_option(),
):
    """Convert a Kimi-K3 / K3.1-Pro HF checkpoint to GGUF in one streaming pass (quantized with --policy).

    \b
    Exit status:
      0      written (with --dry-run: the run would go ahead)
      1      bad input or any other error
      2      a usage mistake (unknown option, missing argument, a value that is not a number)
      3      not enough free disk (tensor bytes + 64 MiB), before writing or while writing
      128+N  ended by signal N (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP); nothing written
    """
    from ..convert.job import ConvertJob
    started, result, job = time.time(), None, None
    try:
        with interrupts_raise(), ExitStack() as held:
            opts = _options(hf_dir, out, outtype, split_max_size, split_max_tensors, dry_run, force, resume, policy,
                            imatrix, tensor_type, tensor_type_file, allow_requantize, strict, target_size,
                            target_bpw, gpu_budget, emit_policy, sensitivity, threads)
            job = ConvertJob(opts, note=note, reading=reading).open(held)
            one = job.quantize()
            if one is not None:
                report_quantization(job)
            if dry_run:
                return dry_run_plan(job)
            console.print(f"{job.plan.config.arch}: {len(job.plan.tensors)} tensors, {human(job.total_bytes)} -> "
                          f"{out}" + (f" (policy {one.policy.source})" if one else ""), highlight=False)
            with progress_bar(job.total_bytes) as advance:
                result = job.write(advance)
    except KimiError as e:
        fail(e)
    except Interrupted as e:
        interrupted(e, out, started, result)
    print_result(result, job.one)


def _options(hf_dir, out, outtype, split_max_size, split_max_tensors, dry_run, force, resume, policy, imatrix,
             tensor_type, tensor_type_file, allow_requantize, strict, target_size, target_bpw, gpu_budget,
             emit_policy, sensitivity, threads):
    """The command line as one ConvertOptions, every value checked (one line each) before anything is read."""
    from ..convert.job import ConvertOptions
    from ..gguf_io import check_split_max_size
    from ..quant.options import PolicyOptions
    from .policy_options import target_options
    max_size = 0
    if split_max_size is not None:
        max_size = parse_size(split_max_size)
        check_split_max_size(max_size, split_max_size)
    check_count(split_max_tensors, "--split-max-tensors", 0)
    check_threads(threads)
    if sensitivity == "kld":
        raise KimiError("--sensitivity kld runs the converted model: convert, then kimi-quantize --target-size "
                        "--sensitivity kld")
    if sensitivity not in ("prior", "weights"):
        raise KimiError(f"--sensitivity {sensitivity!r}: must be prior or weights")
    target = target_options(target_size, target_bpw, gpu_budget, emit_policy, imatrix, policy, sensitivity)
    quant = PolicyOptions(policy, imatrix, tuple(tensor_type), tuple(tensor_type_file), allow_requantize, strict,
                          target)
    return ConvertOptions(hf_dir, out, quant, outtype, max_size, split_max_tensors, threads, force, resume, dry_run)


def report_quantization(job) -> None:
    """On stderr: a budget's choice, the one pass's rule conflicts, warnings and imatrix coverage, its notes, and
    (a dry run) why a write would be refused."""
    from .policy_options import print_choice, report_decisions, report_write_blockers
    if job.choice is not None:
        print_choice(job.choice, False)
    report_decisions(job.one.plan, job.imatrix)
    for line in job.one.notes:
        note(line)
    if job.opts.dry_run:
        report_write_blockers(job.one.plan, job.imatrix)


def dry_run_plan(job) -> None:
    """What the run would check and do (convert.preflight), on stdout; a short disk exits 3. With --policy, the
    table is kimi-quantize --dry-run's, for the quantized output."""
    from ..gguf_io import check_free_disk
    pre = job.dry_run()
    print_plan(job.plan, pre, job.one)
    check_free_disk(pre.room)


def print_plan(plan, pre, one=None) -> None:
    if one is None:
        total, ram, kind = plan.total_bytes, plan.peak_ram_estimate, f"output type {plan.outtype}"
        t = Table(title=f"{plan.config.arch}: {plan.config.n_layer} layers, plan for {pre.finals[0].name}")
        for col in ("class", "tensors", "bytes"):
            t.add_column(col, justify="right" if col != "class" else "left")
        for group, (n, b) in sorted(plan.by_group().items(), key=lambda kv: -kv[1][1]):
            t.add_row(group, str(n), human(b))
        t.add_row("[bold]total", f"[bold]{len(plan.tensors)}", f"[bold]{human(plan.total_bytes)}")
        output.print(t)
    else:
        from ..convert.converter import one_pass_peak_ram
        from .policy_options import print_dry_run_table
        total, ram = sum(one.sizes), one_pass_peak_ram(plan, one)
        kind = f"output type {plan.outtype}, quantized by {one.policy.source} ({human(plan.total_bytes)} unquantized)"
        print_dry_run_table(one.plan, f"{plan.config.arch}: {plan.config.n_layer} layers, one-pass plan for "
                                      f"{pre.finals[0].name}")
    room = pre.room
    output.print(
        f"{kind}; tensor data {total:,} bytes; split files: {len(pre.finals)}; "
        f"dropped (vision/projector): {len(plan.dropped)} tensors, {human(sum(x.nbytes for x in plan.dropped))}; "
        f"estimated peak RAM {human(ram)}; free disk {human(room.free)} for "
        f"{human(room.need)} ({'enough' if room.enough else 'NOT ENOUGH'})", highlight=False)
    for p in pre.finals:
        if p.exists():
            output.print(f"--force: overwrites {p}", highlight=False, markup=False)
    for p in pre.stale:
        output.print(f"removes {p}: a partial output of process {p.name.rsplit('-', 1)[1]}, which is gone",
                     highlight=False, markup=False)


def print_result(r, one=None) -> None:
    for p in r.paths:
        print(p)
    quantized = "" if one is None else \
        f" ({sum(not d.copied for d in one.plan.decisions)} quantized by {one.policy.source})"
    console.print(f"wrote {r.n_tensors} tensors{quantized}, {human(r.n_bytes)} in {r.seconds:.1f} s "
                  f"({human(r.throughput)}/s), {len(r.paths)} file(s); peak RSS {human(r.peak_rss)}; "
                  f"dropped {r.dropped} vision/projector tensors ({human(r.dropped_bytes)})", highlight=False)


def convert_main() -> None:
    run_app(convert_app, "kimi-convert")
