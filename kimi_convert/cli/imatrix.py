"""kimi-imatrix: llama-imatrix's importance matrix, computed from the checkpoint (or any kimi-k3 / kimi-k31 GGUF)
one layer at a time (a thin layer over kimi_convert.imatrix).

  kimi-imatrix HF_DIR|MODEL.gguf -f calib.txt -o k3.imatrix.gguf [--ctx 512] [--chunks N] [--device cpu|cuda]
               [--threads N] [--output-format gguf|dat] [--in-file A.gguf ...] [--process-output]
               [--resume] [--dry-run] [--json R] [--force]

Each layer's weights are read once and every token of the text is pushed through them; memory is one layer plus
the tokens' states. The file is the one llama-imatrix writes for the same model and text (docs/commands.md).
"""
from __future__ import annotations

import json
import time
from contextlib import ExitStack, closing
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import Interrupted, KimiError
from .common import (check_count, check_threads, console, debug_option, fail, human, interrupted, interrupts_raise,
                     note, output, parse_size, reading, run_app, show_plan, threads_option, typer_app)

app = typer_app(help=__doc__)


@app.command()
def imatrix(
    model: Path = typer.Argument(..., readable=False, metavar="HF_DIR|MODEL.gguf",
                                 help="the HF checkpoint folder, or a kimi-k3 / kimi-k31 GGUF (any type we read)"),
    text: Path = typer.Option(..., "-f", "--file", readable=False, metavar="calib.txt", help="the calibration text"),
    out: Optional[Path] = typer.Option(None, "-o", "--output", readable=False, metavar="OUT",
                                       help="the imatrix to write (not needed with --dry-run)"),
    ctx: int = typer.Option(512, "--ctx", "-c", metavar="N", help="tokens per chunk (llama-imatrix's -c)"),
    chunks: Optional[int] = typer.Option(None, "--chunks", metavar="N", help="use only the first N chunks"),
    device: str = typer.Option("cpu", "--device", metavar="cpu|cuda", help="where the engine runs (torch)"),
    threads: int = threads_option("CPU threads of the engine"),
    output_format: str = typer.Option("gguf", "--output-format", metavar="gguf|dat",
                                      help="llama-imatrix's GGUF (default) or its legacy .dat"),
    in_file: List[Path] = typer.Option([], "--in-file", readable=False, metavar="A.gguf",
                                       help="add an earlier imatrix of the same model and --ctx (as llama-imatrix)"),
    process_output: bool = typer.Option(False, "--process-output", help="also collect output.weight"),
    resume: bool = typer.Option(False, "--resume", help="continue an interrupted run after its last finished layer"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print what the run would read, hold and take; write "
                                 "nothing (but --json)"),
    json_file: Optional[Path] = typer.Option(None, "--json", readable=False, metavar="R.json",
                                             help="also write the plan (--dry-run) or what the run measured"),
    state_ram: Optional[str] = typer.Option(None, "--state-ram", metavar="SIZE",
                                            help="token states kept in RAM before they spill to disk beside OUT "
                                            "(default: half the available memory)"),
    force: bool = typer.Option(False, "--force", help="overwrite an existing output (and --json); never an input"),
    _debug: bool = debug_option(),
):
    """Compute llama-imatrix's importance matrix of MODEL on the text, one layer at a time.

    \b
    Exit status:
      0      written (with --dry-run: the plan was printed)
      1      bad input or any other error (nothing written)
      2      a usage mistake
      3      not enough free disk
      128+N  ended by signal N (a run with finished layers leaves its resume folder for --resume)
    """
    started, result = time.time(), None
    try:
        with interrupts_raise(), ExitStack() as held:
            ImatrixRun, dry_run_plan = _engine()
            from ..paths import Report, refuse_overlap, report_output
            opts = _options(model, text, out, ctx, chunks, device, threads, output_format, in_file, process_output,
                            resume, force, state_ram, dry_run)
            reading(model)
            run = ImatrixRun(opts, log=note)
            reports = [report_output(json_file)] if json_file else []
            refuse_overlap(run.inputs(), [*(run.outputs() if out else []), *reports])
            report = held.enter_context(closing(Report(json_file, force))) if json_file else None
            plan = dry_run_plan(run)
            if show_plan(plan, report, dry_run):
                return
            result = run.run(on_layer=lambda r, eta: _progress(r, eta, run))
            for c in result.coverage:
                note(c.line())
            if report:
                report.deliver(json.dumps(_measured(result, plan), indent=2) + "\n")
    except KimiError as e:
        fail(e)
    except Interrupted as e:
        interrupted(e, out or model, started, result)
    output.print(str(out), highlight=False)
    console.print(f"{result.entries} entries from {result.tokens:,} tokens ({result.chunks} chunks of {ctx}) in "
                  f"{result.seconds:.1f} s; read {human(result.bytes_read)}, peak RSS {human(result.peak_rss)}",
                  highlight=False)


def _engine():
    """The job and its planner; the engine needs torch, which the plain install does not bring."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise KimiError("kimi-imatrix runs on torch: pip install 'kimi-convert[engine]' (torch==2.13.0)") from None
    from ..imatrix.job import ImatrixRun
    from ..imatrix.plan import dry_run_plan
    return ImatrixRun, dry_run_plan


def _options(model, text, out, ctx, chunks, device, threads, output_format, in_file, process_output, resume, force,
             state_ram, dry_run):
    from ..imatrix.job import ImatrixOptions
    if out is None and not dry_run:
        raise KimiError("give -o OUT (or --dry-run)")
    if output_format not in ("gguf", "dat"):
        raise KimiError(f"--output-format {output_format!r}: must be gguf or dat")
    check_device(device)
    check_count(ctx, "--ctx", 16, 1 << 20, "Kimi-K3's context")
    check_run_numbers(chunks, threads)
    ram = parse_size(state_ram, "--state-ram") if state_ram is not None else None
    return ImatrixOptions(Path(model), Path(text), Path(out) if out else None, ctx, chunks, device, output_format,
                          tuple(Path(p) for p in in_file), process_output, resume, force, ram)


def check_run_numbers(chunks, threads: int) -> None:
    """--chunks and --threads of a streamed run (kimi-imatrix, kimi-verify kld); --threads sets torch's."""
    if chunks is not None:
        check_count(chunks, "--chunks", 1)
    check_threads(threads)
    if threads:
        import torch
        torch.set_num_threads(threads)


def check_device(device: str) -> str:
    """cpu, cuda or cuda:N, and a CUDA device torch can see."""
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise KimiError(f"--device {device!r}: must be cpu or cuda")
    if device != "cpu":
        import torch
        if not torch.cuda.is_available():
            raise KimiError(f"--device {device}: torch sees no CUDA device here")
    return device


def _progress(report, eta: float, run) -> None:
    rate = run.n_tokens / max(report.seconds, 1e-9)
    note(f"layer {report.layer + 1}/{run.cfg.n_layer}: {run.n_tokens:,} tokens in {report.seconds:.1f} s "
         f"({rate:,.0f} tokens/s), read {human(report.bytes_read)}, ETA {eta:,.0f} s")


def _measured(result, plan) -> dict:
    return {"bytes_read": result.bytes_read, "peak_bytes": result.peak_rss,
            "token_state_bytes": plan.token_state_bytes, "seconds": result.seconds, "tokens": result.tokens,
            "chunks": result.chunks, "coverage": [c.__dict__ for c in result.coverage]}


def main() -> None:
    run_app(app, "kimi-imatrix")


if __name__ == "__main__":
    main()
