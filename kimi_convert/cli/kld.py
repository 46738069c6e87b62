"""kimi-verify kld: llama-perplexity's KL divergence of a file against a base, each model run layer by layer.

  kimi-verify kld BASE QUANT.gguf -f text.txt [--ctx 512] [--chunks N] [--device cpu|cuda] [--json R]
  kimi-verify kld BASE --save-base base.kld -f text.txt     (then: kimi-verify kld base.kld QUANT.gguf)

BASE is the HF checkpoint, a GGUF, or a base file (llama-perplexity's --kl-divergence-base format, ours or its).
The report is llama-perplexity's, under its labels (kimi_convert/kld).
"""
from __future__ import annotations

import json
import time
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Optional

import typer

from ..errors import Interrupted, KimiError
from .common import (check_count, console, fail, human, interrupted, interrupts_raise, note, output, parse_size,
                     reading, show_plan, threads_option)
from .imatrix import check_device, check_run_numbers


def kld_cmd(
    base: Path = typer.Argument(..., readable=False, metavar="BASE",
                                help="HF checkpoint folder, GGUF, or a base file (--save-base / llama-perplexity's)"),
    quant: Optional[Path] = typer.Argument(None, readable=False, metavar="QUANT.gguf",
                                           help="the file to measure (any kimi-k3 / kimi-k31 GGUF we read)"),
    text: Optional[Path] = typer.Option(None, "-f", "--file", readable=False, metavar="text.txt",
                                        help="the evaluation text (not needed with a base file: its tokens are in it)"),
    ctx: Optional[int] = typer.Option(None, "--ctx", "-c", metavar="N", help="tokens per chunk (default 512, or "
                                      "the base file's); the second half of each chunk is scored"),
    chunks: Optional[int] = typer.Option(None, "--chunks", metavar="N", help="use only the first N chunks"),
    device: str = typer.Option("cpu", "--device", metavar="cpu|cuda", help="where the engine runs (torch)"),
    threads: int = threads_option("CPU threads of the engine"),
    save_base: Optional[Path] = typer.Option(None, "--save-base", readable=False, metavar="F",
                                             help="also keep the base's log-probabilities in F (llama-perplexity's "
                                             "--kl-divergence-base file)"),
    json_file: Optional[Path] = typer.Option(None, "--json", readable=False, metavar="R.json",
                                             help="also write the statistics (or the dry run's plan) as JSON"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print what the run would read, hold and take; write "
                                 "nothing (but --json)"),
    state_ram: Optional[str] = typer.Option(None, "--state-ram", metavar="SIZE",
                                            help="token states kept in RAM before they spill to disk"),
    force: bool = typer.Option(False, "--force", help="overwrite an existing --save-base or --json (never an input)"),
):
    """The KL divergence of QUANT against BASE on a text, as llama-perplexity --kl-divergence computes it.

    \b
    Exit status: 0 measured (or the base file written), 1 bad input or any error (nothing left behind),
    2 a usage mistake, 128+N ended by signal N.
    """
    started, result = time.time(), None
    try:
        with interrupts_raise(), ExitStack() as held:
            KldRun, KldOptions, plan_of = _engine()
            from ..paths import Report, refuse_overlap, report_output
            opts = KldOptions(Path(base), Path(quant) if quant else None, Path(text) if text else None, ctx, chunks,
                              check_device(device), Path(save_base) if save_base else None, force,
                              parse_size(state_ram, "--state-ram") if state_ram is not None else None)
            _check_numbers(ctx, chunks, threads)
            reading(base)
            run = KldRun(opts, log=note)
            reports = [report_output(json_file)] if json_file else []
            refuse_overlap(run.inputs(), [*run.outputs(), *reports])
            report = held.enter_context(closing(Report(json_file, force))) if json_file else None
            plan = plan_of(run)
            if show_plan(plan, report, dry_run):
                return
            result = run.run(on_layer=_progress(run), on_chunk=_chunk_printer())
            _print_result(run, result)
            if report:
                report.deliver(json.dumps(_measured(result, plan), indent=2) + "\n")
    except KimiError as e:
        fail(e)
    except Interrupted as e:
        interrupted(e, quant or base, started, result)


def _engine():
    try:
        import torch  # noqa: F401
    except ImportError:
        raise KimiError("kimi-verify kld runs on torch: pip install 'kimi-convert[engine]' (torch==2.13.0)") from None
    from ..kld.job import KldOptions, KldRun
    from ..kld.plan import kld_plan
    return KldRun, KldOptions, kld_plan


def _check_numbers(ctx, chunks, threads) -> None:
    if ctx is not None:
        check_count(ctx, "--ctx", 8, 1 << 20, "Kimi-K3's context")
    check_run_numbers(chunks, threads)


def _progress(run):
    def show(which: str, report) -> None:
        n = run.ids.size
        note(f"{which} layer {report.layer + 1}: {n:,} tokens in {report.seconds:.1f} s "
             f"({n / max(report.seconds, 1e-9):,.0f} tokens/s), read {human(report.bytes_read)}")
    return show


def _chunk_printer():
    from ..kld.stats import CHUNK_HEADER
    first = [True]

    def show(line: str) -> None:
        if first[0]:
            output.print("\n" + CHUNK_HEADER, highlight=False, markup=False)
            first[0] = False
        output.print(line, highlight=False, markup=False)
    return show


def _print_result(run, result) -> None:
    from ..kld.stats import report_lines
    if result.base_ppl is not None:
        ppl, unc = result.base_ppl
        output.print(f"Final estimate: PPL = {ppl:.4f} +/- {unc:.5f}", highlight=False, markup=False)
    if run.opts.save_base:
        output.print(str(run.opts.save_base), highlight=False)
    if result.summary is not None:
        output.print("", highlight=False)
        for line in report_lines(result.summary):
            output.print(line, highlight=False, markup=False)
    console.print(f"{result.chunks} chunks of {result.ctx} in {result.seconds:.1f} s; read "
                  f"{human(sum(p.bytes_read for p in result.passes))}, peak RSS {human(result.peak_rss)}",
                  highlight=False)


def _measured(result, plan) -> dict:
    out = {"bytes_read": sum(p.bytes_read for p in result.passes), "peak_bytes": result.peak_rss,
           "seconds": result.seconds, "chunks": result.chunks, "ctx": result.ctx,
           "token_state_bytes": plan.token_state_bytes,
           "passes": [{"model": str(p.model), "seconds": p.seconds, "bytes_read": p.bytes_read}
                      for p in result.passes]}
    if result.base_ppl is not None:
        out["base_ppl"], out["base_ppl_unc"] = result.base_ppl
    if result.summary is not None:
        out["statistics"] = result.summary
    return out
