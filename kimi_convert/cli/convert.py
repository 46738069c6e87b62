"""kimi-convert: HF_DIR -> OUT.gguf in one streaming pass (a thin layer over kimi_convert.convert.converter)."""
from __future__ import annotations

import time
from contextlib import ExitStack, closing
from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table

from ..errors import Interrupted, KimiError
from .common import (check_count, console, debug_option, fail, human, interrupted, interrupts_raise, note, output,
                     parse_size, progress_bar, reading, run_app, typer_app)


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
    resume: bool = typer.Option(False, "--resume", help="keep the finished split parts of an interrupted run of "
                                "the same plan into OUT (each checked against its manifest journal); write the rest"),
    policy: Optional[str] = typer.Option(None, "--policy", metavar="POLICY",
                                         help="quantize in the same pass, exactly as kimi-quantize --policy POLICY "
                                         "would quantize the converted file (a TOML file or a preset)"),
    imatrix: Optional[Path] = typer.Option(None, "--imatrix", readable=False, metavar="FILE",
                                           help="with --policy: llama-imatrix file (GGUF or .dat)"),
    tensor_type: List[str] = typer.Option([], "--tensor-type", metavar="RE=TYPE",
                                          help="with --policy: llama-quantize override, tried before its rules"),
    tensor_type_file: List[Path] = typer.Option([], "--tensor-type-file", readable=False, metavar="F",
                                                help="with --policy: file of RE=TYPE tokens"),
    allow_requantize: bool = typer.Option(False, "--allow-requantize",
                                          help="with --policy: let rules re-quantize the MXFP4 experts"),
    strict: bool = typer.Option(False, "--strict", help="with --policy: a rule that names a protected tensor "
                                "is an error"),
    target_size: Optional[str] = typer.Option(None, "--target-size", metavar="SIZE",
                                              help="quantize in the same pass to fit SIZE, as kimi-quantize "
                                              "--target-size would the converted file (--policy: the BASE)"),
    target_bpw: Optional[str] = typer.Option(None, "--target-bpw", metavar="BPW",
                                             help="the same budget in bits per weight"),
    gpu_budget: Optional[str] = typer.Option(None, "--gpu-budget", metavar="SIZE",
                                             help="with a budget: the non-expert tensors fit SIZE"),
    emit_policy: Optional[Path] = typer.Option(None, "--emit-policy", readable=False, metavar="CHOSEN.toml",
                                               help="with a budget: write the chosen types as a policy file"),
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
    from ..convert.converter import build_plan, convert as run, plan_policy, run_inputs
    from ..gguf_io import check_split_max_size, output_lock, written_paths
    from ..paths import Report, refuse_overlap
    started, result, one = time.time(), None, None
    try:
        with interrupts_raise(), ExitStack() as held:
            max_size = 0
            if split_max_size is not None:
                max_size = parse_size(split_max_size)
                check_split_max_size(max_size, split_max_size)
            check_count(split_max_tensors, "--split-max-tensors", 0)
            from .policy_options import target_options
            target = target_options(target_size, target_bpw, gpu_budget, emit_policy, imatrix, policy)
            quant_options = _policy_options(policy, tensor_type, tensor_type_file, imatrix, allow_requantize,
                                            strict, dry_run, target is not None)    # their errors come first
            inputs = run_inputs(hf_dir, *(quant_options or ()))
            refuse_overlap(inputs, [*written_paths(out), *(target.outputs() if target else [])])
            emitted = (held.enter_context(closing(Report(emit_policy, force, "--emit-policy")))
                       if emit_policy is not None else None)
            if not dry_run:             # a second run into OUT refuses before reading 96 shard headers
                held.enter_context(output_lock(out))
            reading(hf_dir)
            plan = build_plan(hf_dir, outtype)
            if quant_options is not None:
                from .policy_options import report_decisions, report_write_blockers
                pol, imat = quant_options
                if target is not None:
                    choice = choose_in_pass(plan, pol, imat, target, allow_requantize=allow_requantize,
                                            inputs=inputs)
                    pol = choice.policy
                one = plan_policy(plan, pol, imatrix=imat, allow_requantize=allow_requantize, strict=strict)
                report_decisions(one.plan, imat)
                for line in one.notes:
                    note(line)
                if dry_run:
                    report_write_blockers(one.plan, imat)
            if dry_run:
                if emitted:
                    emitted.deliver(choice.text)
                return dry_run_plan(plan, out, split_max_tensors, max_size, force, one)
            total = plan.total_bytes if one is None else sum(one.sizes)
            console.print(f"{plan.config.arch}: {len(plan.tensors)} tensors, {human(total)} -> {out}"
                          + (f" (policy {one.policy.source})" if one else ""), highlight=False)
            with progress_bar(total) as advance:
                result = run(plan, out, split_max_tensors=split_max_tensors, split_max_size=max_size,
                             force=force, on_bytes=advance, log=note, quant=one, resume=resume)
            if emitted:             # after OUT: a failed run leaves no policy of a file that is not there
                emitted.deliver(choice.text)
    except KimiError as e:
        fail(e)
    except Interrupted as e:
        interrupted(e, out, started, result)
    print_result(result, one)


def choose_in_pass(plan, base, imat, target, *, allow_requantize: bool, inputs=()):
    """--target-size in the one pass: kimi-quantize's choice for the converted file, its rows cut from the
    converter's own producers (quant.target.streamed)."""
    from ..convert.converter import plan_policy, producers, row_reader
    from ..quant.blocks import default_threads
    from ..quant.target.choose import check_decisions, choose_decided, expert_share
    from ..quant.target.measure import error_cache_dir
    from ..quant.target.streamed import producer_rows
    import numpy as np
    base_plan = plan_policy(plan, base, imatrix=imat, allow_requantize=allow_requantize).plan
    weights = sum(int(np.prod(t.shape, dtype=np.int64)) for t in plan.tensors)
    decisions, budget_bytes = check_decisions(base_plan, weights, target.budget, imat,
                                              allow_requantize=allow_requantize, gpu_budget=target.gpu_budget)
    rows = producer_rows(producers(plan), row_reader(plan))
    choice = choose_decided(decisions, budget_bytes, rows, base, target.budget, imat,
                            allow_requantize=allow_requantize, gpu_budget=target.gpu_budget,
                            threads=default_threads(), cache_dir=error_cache_dir(), inputs=inputs,
                            source=str(target.emit_policy or "the chosen policy"), note=note,
                            expert_share=expert_share(plan.config))
    from .policy_options import print_choice
    print_choice(choice, False)
    return choice


def _policy_options(policy, tensor_type, tensor_type_file, imatrix, allow_requantize, strict, dry_run,
                    budget: bool = False):
    """(policy, imatrix) read as kimi-quantize reads them, or None without --policy (its options then refused);
    `budget`: a --target-size / --target-bpw run, whose --policy is an optional BASE."""
    if policy is None and not budget:
        given = [flag for flag, value in (("--imatrix", imatrix), ("--tensor-type", tensor_type),
                                          ("--tensor-type-file", tensor_type_file),
                                          ("--allow-requantize", allow_requantize), ("--strict", strict)) if value]
        if given:
            raise KimiError(f"{given[0]} applies to quantization: give --policy POLICY too")
        return None
    from .policy_options import load_policy_options
    return load_policy_options(policy, tensor_type, tensor_type_file, imatrix, allow_requantize=allow_requantize,
                               plan_only=dry_run, base=budget)


def dry_run_plan(plan, out: Path, split_max_tensors: int, split_max_size: int, force: bool, one=None) -> None:
    """What the run would check and do (convert.preflight), on stdout; a short disk exits 3.
    With --policy (`one`), the table is kimi-quantize --dry-run's, for the quantized output."""
    from ..convert.converter import preflight
    from ..gguf_io import check_free_disk
    pre = preflight(plan, out, split_max_tensors=split_max_tensors, split_max_size=split_max_size, force=force,
                    quant=one)
    print_plan(plan, pre, one)
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
