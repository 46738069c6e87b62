"""Command-line entry points: thin typer wrappers over the library."""
from __future__ import annotations

import glob
import os
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)
from rich.table import Table

from .errors import Interrupted, KimiError

# soft_wrap: a line is never broken at rich's 80 columns when the output is a pipe or a file
console = Console(stderr=True, soft_wrap=True)      # progress, notes and errors
output = Console(soft_wrap=True)                    # what a command produces: paths, plans, reports


def typer_app(**settings) -> typer.Typer:
    """Plain help text: typer's rich help prints `<bool>` after every flag (--help included)."""
    return typer.Typer(add_completion=False, rich_markup_mode=None, **settings)


def fail(e: Exception) -> None:
    console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False)
    raise typer.Exit(getattr(e, "exit_code", 1))


INTERRUPTS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextmanager
def interrupts_raise():
    """SIGTERM and SIGHUP end the command as Ctrl-C does, by an exception (errors.Interrupted), so
    that the writer's cleanup runs. One signal is enough: more are ignored while it unwinds. A signal
    ignored from the start stays ignored (nohup's SIGHUP, SIGINT in a background job)."""
    def on_signal(signum, frame):
        for s in INTERRUPTS:
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum)
    previous = {s: signal.getsignal(s) for s in INTERRUPTS}
    for s, handler in previous.items():
        if handler != signal.SIG_IGN:
            signal.signal(s, on_signal)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def check_report_path(path: Path) -> None:
    """The report can be written to `path`: a file (new or not) in an existing, writable folder."""
    folder = path.parent
    if path.is_dir():
        raise KimiError(f"{path}: is a folder; --json takes a file name")
    if not folder.is_dir():
        raise KimiError(f"{path}: cannot write the report: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise KimiError(f"{path}: cannot write the report: permission denied")


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def parse_size(text: str) -> int:
    """'50G', '900M', '1T' or bytes -> bytes (llama.cpp's --split-max-size spelling)."""
    units = {"K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4}
    text = text.strip().upper()
    try:
        if text[-1:] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise KimiError(f"--split-max-size {text!r}: use a number with K, M, G or T") from None


# --------------------------------------------------------------------------------------
# kimi-convert

convert_app = typer_app(help=__doc__)


@convert_app.command()
def convert(
    hf_dir: Path = typer.Argument(..., metavar="HF_DIR",
                                  help="Kimi-K3 / K3.1-Pro checkpoint folder (config.json, shards, index)"),
    out: Path = typer.Argument(..., metavar="OUT.gguf",
                               help="output .gguf (split parts get -00001-of-0000N.gguf)"),
    outtype: str = typer.Option("bf16", help="bf16 (source bytes copied) or f32; MXFP4 experts stay MXFP4"),
    split_max_size: Optional[str] = typer.Option(
        None, metavar="SIZE", help="max bytes per split file, e.g. 50G; at least 1M (K, M, G, T: powers of 1000)"),
    split_max_tensors: int = typer.Option(0, help="max tensors per split file"),
    dry_run: bool = typer.Option(False, "--dry-run", help="check everything the run checks, print the plan "
                                 "and exit"),
    force: bool = typer.Option(False, "--force", help="overwrite an existing output"),
):
    """Convert a Kimi-K3 / K3.1-Pro HF checkpoint to GGUF in one streaming pass.

    \b
    Exit status:
      0      written (with --dry-run: the run would go ahead)
      1      bad input or any other error
      3      not enough free disk (tensor bytes + 64 MiB), before writing or while writing
      128+N  ended by signal N (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP); nothing written
    """
    from .convert import build_plan, convert as run
    from .gguf_io import check_split_max_size
    started, result = time.time(), None
    try:
        with interrupts_raise():
            max_size = 0
            if split_max_size is not None:
                max_size = parse_size(split_max_size)
                check_split_max_size(max_size, split_max_size)
            plan = build_plan(hf_dir, outtype)
            if dry_run:
                return dry_run_plan(plan, out, split_max_tensors, max_size, force)
            console.print(f"{plan.config.arch}: {len(plan.tensors)} tensors, {human(plan.total_bytes)} "
                          f"-> {out}", highlight=False)
            with progress_bar(plan.total_bytes) as advance:
                result = run(plan, out, split_max_tensors=split_max_tensors, split_max_size=max_size,
                             force=force, on_bytes=advance, log=note)
    except KimiError as e:
        fail(e)
    except OSError as e:        # one the library did not name (a file it cannot read, say): still one line
        fail(KimiError(f"{e.filename or out}: {e.strerror or e}"))
    except Interrupted as e:
        interrupted(e, out, started, result)
    print_result(result)


def note(text: str) -> None:
    console.print(text, highlight=False, markup=False)


def interrupted(e: Interrupted, out: Path, started: float, result) -> None:
    if result is not None or _written_since(out, started):       # the signal came after the commit
        what = f" after {out} was complete"
    else:
        what = "; nothing was written"
    console.print(f"[bold red]error:[/] {escape(str(out))}: interrupted by {e.name}{what}", highlight=False)
    raise typer.Exit(e.exit_code)


def _written_since(out: Path, since: float) -> bool:
    parts = [out, *out.parent.glob(glob.escape(out.stem) + "-*-of-*.gguf")]
    return any(p.is_file() and p.stat().st_mtime >= since for p in parts)


def dry_run_plan(plan, out: Path, split_max_tensors: int, split_max_size: int, force: bool) -> None:
    """What the run would check and do (convert.preflight), on stdout; a short disk exits 3."""
    from .convert import preflight
    from .gguf_io import check_free_disk
    pre = preflight(plan, out, split_max_tensors=split_max_tensors, split_max_size=split_max_size, force=force)
    print_plan(plan, pre, split_max_tensors, split_max_size)
    check_free_disk(pre.room)


def print_plan(plan, pre, split_max_tensors: int, split_max_size: int) -> None:
    t = Table(title=f"{plan.config.arch}: {plan.config.n_layer} layers, plan for {pre.finals[0].name}")
    for col in ("class", "tensors", "bytes"):
        t.add_column(col, justify="right" if col != "class" else "left")
    for group, (n, b) in sorted(plan.by_group().items(), key=lambda kv: -kv[1][1]):
        t.add_row(group, str(n), human(b))
    t.add_row("[bold]total", f"[bold]{len(plan.tensors)}", f"[bold]{human(plan.total_bytes)}")
    output.print(t)
    room = pre.room
    output.print(
        f"output type {plan.outtype}; tensor data {plan.total_bytes:,} bytes; split files: {len(pre.finals)}; "
        f"dropped (vision/projector): {len(plan.dropped)} tensors, {human(sum(x.nbytes for x in plan.dropped))}; "
        f"estimated peak RAM {human(plan.peak_ram_estimate)}; free disk {human(room.free)} for "
        f"{human(room.need)} ({'enough' if room.enough else 'NOT ENOUGH'})", highlight=False)
    for p in pre.finals:
        if p.exists():
            output.print(f"--force: overwrites {p}", highlight=False, markup=False)
    for p in pre.stale:
        output.print(f"removes {p}: a partial output of process {p.name.rsplit('-', 1)[1]}, which is gone",
                     highlight=False, markup=False)


class progress_bar:
    """A bar on a terminal; nothing in a pipe or a log (rich would leave an empty line there)."""

    def __init__(self, total: int):
        self.total = total
        self.bar = Progress(TextColumn("writing"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                            TimeRemainingColumn(), console=console, disable=not console.is_terminal)

    def __enter__(self):
        self.bar.start()
        task = self.bar.add_task("write", total=self.total)
        return lambda n: self.bar.advance(task, n)

    def __exit__(self, *exc):
        self.bar.stop()


def print_result(r) -> None:
    for p in r.paths:
        print(p)
    console.print(f"wrote {r.n_tensors} tensors, {human(r.n_bytes)} in {r.seconds:.1f} s "
                  f"({human(r.throughput)}/s), {len(r.paths)} file(s); peak RSS {human(r.peak_rss)}; "
                  f"dropped {r.dropped} vision/projector tensors ({human(r.dropped_bytes)})", highlight=False)


def convert_main() -> None:
    convert_app(prog_name="kimi-convert")
