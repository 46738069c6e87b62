"""Command-line entry points: thin typer wrappers over the library."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)
from rich.table import Table

from .errors import KimiError

console = Console(stderr=True)


def fail(e: Exception) -> None:
    console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
    raise typer.Exit(1)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def parse_size(text: str | None) -> int:
    """'50G', '900M', '1T' or bytes -> bytes (llama.cpp's --split-max-size spelling)."""
    if not text:
        return 0
    units = {"K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4}
    text = text.strip().upper()
    try:
        if text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise KimiError(f"--split-max-size {text!r}: use a number with K, M, G or T") from None


# --------------------------------------------------------------------------------------
# kimi-convert

convert_app = typer.Typer(add_completion=False, help=__doc__)


@convert_app.command()
def convert(
    hf_dir: Path = typer.Argument(..., help="Kimi-K3 / K3.1-Pro checkpoint folder (config.json, shards, index)"),
    out: Path = typer.Argument(..., help="output .gguf (split parts get -00001-of-0000N.gguf)"),
    outtype: str = typer.Option("bf16", help="bf16 (source bytes copied) or f32; MXFP4 experts stay MXFP4"),
    split_max_size: Optional[str] = typer.Option(None, help="max bytes per split file, e.g. 50G"),
    split_max_tensors: int = typer.Option(0, help="max tensors per split file"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the plan and exit"),
    force: bool = typer.Option(False, "--force", help="overwrite an existing output"),
):
    """Convert a Kimi-K3 / K3.1-Pro HF checkpoint to GGUF in one streaming pass."""
    from .convert import build_plan, check_free_disk, convert as run
    try:
        plan = build_plan(hf_dir, outtype)
        max_size = parse_size(split_max_size)
        if dry_run:
            print_plan(plan, out, split_max_tensors, max_size)
            check_free_disk(plan, out)
            return
        console.print(f"{plan.config.arch}: {len(plan.tensors)} tensors, {human(plan.total_bytes)} "
                      f"-> {out}", highlight=False)
        with progress_bar(plan.total_bytes) as advance:
            result = run(plan, out, split_max_tensors=split_max_tensors, split_max_size=max_size,
                         force=force, on_bytes=advance)
    except KimiError as e:
        fail(e)
    print_result(result)


def print_plan(plan, out: Path, split_max_tensors: int, split_max_size: int) -> None:
    import shutil
    t = Table(title=f"{plan.config.arch}: {plan.config.n_layer} layers, plan for {out.name}")
    for col in ("class", "tensors", "bytes"):
        t.add_column(col, justify="right" if col != "class" else "left")
    for group, (n, b) in sorted(plan.by_group().items(), key=lambda kv: -kv[1][1]):
        t.add_row(group, str(n), human(b))
    t.add_row("[bold]total", f"[bold]{len(plan.tensors)}", f"[bold]{human(plan.total_bytes)}")
    console.print(t)
    free = shutil.disk_usage(out.parent if out.parent.exists() else Path(".")).free
    console.print(
        f"output type {plan.outtype}; split files: {plan.n_files(split_max_tensors, split_max_size)}; "
        f"dropped (vision/projector): {len(plan.dropped)} tensors, {human(sum(x.nbytes for x in plan.dropped))}; "
        f"estimated peak RAM {human(plan.peak_ram_estimate)}; free disk {human(free)} "
        f"({'enough' if free > plan.total_bytes else 'NOT ENOUGH'})", highlight=False)


class progress_bar:
    def __init__(self, total: int):
        self.total = total
        self.bar = Progress(TextColumn("writing"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                            TimeRemainingColumn(), console=console, transient=not console.is_terminal)

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


# --------------------------------------------------------------------------------------
# kimi-quantize (its issue has not landed yet)

def quantize_main() -> None:
    console.print("kimi-quantize: not yet available (per-tensor policy quantization is a later issue)")
    sys.exit(2)
