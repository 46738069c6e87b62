"""Command-line entry points: thin typer wrappers over the library."""
from __future__ import annotations

import errno
import glob
import os
import re
import signal
import sys
import time
import traceback
from contextlib import ExitStack, closing, contextmanager
from decimal import Decimal
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)
from rich.table import Table

from .errors import Interrupted, KimiError
from .interrupts import INTERRUPTS, deliver_postponed, postpone

# soft_wrap: a line is never broken at rich's 80 columns when the output is a pipe or a file
console = Console(stderr=True, soft_wrap=True)      # progress, notes and errors
output = Console(soft_wrap=True)                    # what a command produces: paths, plans, reports


def typer_app(**settings) -> typer.Typer:
    """Plain help text: typer's rich help prints `<bool>` after every flag (--help included).

    Path parameters say `readable=False`: typer's own check would be a usage error in its words (exit 2); the
    commands check their inputs themselves, with one error line naming the file (exit 1)."""
    return typer.Typer(add_completion=False, rich_markup_mode=None, **settings)


def print_error(message: str) -> None:
    """The one `error:` line of a command that fails (a message of several lines is joined into one)."""
    console.print(f"[bold red]error:[/] {escape(' '.join(message.split()))}", highlight=False)


def fail(e: Exception) -> None:
    """The error's `details` (each thing refused, one line each), then its one `error:` line."""
    for line in getattr(e, "details", ()):
        console.print(f"[red]refused:[/] {escape(line)}", highlight=False)
    print_error(str(e))
    raise typer.Exit(getattr(e, "exit_code", 1))


# --------------------------------------------------------------------------------------
# the last line of defence: every command runs through run_app

class Defence:
    """What run_app needs to know about the one command this process runs: the input it is reading (named by
    an internal error), --debug, and which fallback ended it, if one did (scripts/campaign.py counts them: a
    known fault must be named by its own check, never reach these)."""
    reading: str = ""
    debug: bool = False
    fallback: Optional[str] = None      # "internal" or "os-error"


def reading(path) -> None:
    """From here on the command is working on `path` (an input file or folder)."""
    Defence.reading = str(path)


def run_app(app: typer.Typer, prog_name: str, args: Optional[List[str]] = None) -> None:
    """Run a command and exit. A usage mistake is one `error:` line (exit 2); an exception that no check
    named is `error: internal error while reading FILE (please report): Type: message` (exit 1), with its
    traceback under --debug. Cleanup has run by then: the exception unwound through the writer's."""
    Defence.reading, Defence.debug, Defence.fallback = "", False, None
    try:
        command = typer.main.get_command(app)
        code = command.main(args, prog_name=prog_name, standalone_mode=False)
    except typer.TyperException as e:                      # UsageError, BadParameter, MissingParameter, ...
        if type(e).__name__ == "NoArgsIsHelpError":        # `kimi-verify` alone: the help, as click prints it
            e.show()
        else:
            ctx = getattr(e, "ctx", None)
            print_error(e.format_message() + (f" (see {ctx.command_path} --help)" if ctx else ""))
        code = e.exit_code
    except typer.Abort:
        code = 1
    except KimiError as e:                                 # from an eager option (--list-presets)
        print_error(str(e))
        code = e.exit_code
    except OSError as e:
        code = _os_error(e)
    except Exception as e:                                 # noqa: BLE001 - the last line of defence
        code = _internal_error(e)
    except KeyboardInterrupt:       # Ctrl-C outside a command's own handling (interrupts_raise): while starting
        print_error("interrupted by SIGINT")
        code = 128 + signal.SIGINT
    sys.exit(code if isinstance(code, int) else 0)


def debug_option():
    """Every command's --debug (a parameter `_debug: bool = debug_option()`), read before the others."""
    return typer.Option(False, "--debug", is_eager=True, callback=_on_debug,
                        help="on an internal error, also show its traceback")


def _on_debug(value: bool) -> None:
    Defence.debug = Defence.debug or value


def _os_error(e: OSError) -> int:
    """An OSError that no check named (the library names the ones it expects): still one line, naming the
    file. A closed pipe on stdout (`| head`) ends the command quietly, as it ends `cat`."""
    if e.errno == errno.EPIPE:
        sys.stdout = open(os.devnull, "w")       # the interpreter's final flush would fail again
        return 1
    Defence.fallback = "os-error"
    _show_traceback(e)
    print_error(f"{e.filename or Defence.reading or 'the command line'}: {e.strerror or e}")
    return 1


def _internal_error(e: Exception) -> int:
    Defence.fallback = "internal"
    _show_traceback(e)
    message = " ".join(str(e).split())
    message = message if len(message) <= 500 else message[:500] + " ..."
    print_error(f"internal error while reading {Defence.reading or 'the command line'} (please report): "
                f"{type(e).__name__}: {message}")
    return 1


def _show_traceback(e: BaseException) -> None:
    if Defence.debug:
        traceback.print_exception(e, file=sys.stderr)
        sys.stderr.flush()


@contextmanager
def interrupts_raise():
    """SIGTERM and SIGHUP end the command as Ctrl-C does, by an exception (errors.Interrupted), so
    that the writer's cleanup runs. One signal is enough: more are ignored while it unwinds. A signal
    ignored from the start stays ignored (nohup's SIGHUP, SIGINT in a background job). During a commit
    and its cleanup (interrupts.deferred) the signal waits for their end."""
    def on_signal(signum, frame):
        if postpone(signum, frame):         # in a commit, or in a finalizer (which would drop the exception)
            return
        for s in INTERRUPTS:
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum)
    previous = {s: signal.getsignal(s) for s in INTERRUPTS}
    for s, handler in previous.items():
        if handler != signal.SIG_IGN:
            signal.signal(s, on_signal)
    try:
        yield
        deliver_postponed()             # one a finalizer kept: the command ends by it, after all
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def check_input_file(path: Path) -> None:
    """`path` is a regular file (or a symlink to one) that this process can read; else one error naming it.
    For a command's own file arguments, so that a FIFO, a device or an unreadable file is refused up front."""
    from .checkpoint import open_input
    with open_input(Path(path), KimiError):
        pass


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


_SIZE = re.compile(r"([-+]?(?:\d+\.?\d*|\.\d+))\s*([KMGT]?)", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4}
MAX_FILE_SIZE = 2**63 - 1     # the largest file offset (off_t) there is


def parse_size(text: str, option: str = "--split-max-size") -> int:
    """'50G', '900M', '1.5T' or bytes -> bytes (llama.cpp's --split-max-size spelling; powers of 1000).
    Computed in decimal, so 1.1G is 1,100,000,000 bytes, not a float's neighbour of it."""
    m = _SIZE.fullmatch(text.strip())
    if not m:
        raise KimiError(f"{option} {text!r}: not a size; use bytes or a number with K, M, G or T, e.g. 50G")
    n = int(Decimal(m[1]) * _SIZE_UNITS[m[2].upper()])
    if n > MAX_FILE_SIZE:
        raise KimiError(f"{option} {text}: more than any file can hold ({MAX_FILE_SIZE:,} bytes)")
    return n


def check_count(value: int, option: str, low: int, high: Optional[int] = None, why: str = "") -> None:
    """An integer option in low..high (`why`: where the upper bound comes from)."""
    if value < low:
        raise KimiError(f"{option} {value}: must be at least {low}")
    if high is not None and value > high:
        raise KimiError(f"{option} {value}: must be at most {high:,} ({why})")


# --------------------------------------------------------------------------------------
# kimi-convert

convert_app = typer_app(help=__doc__)


@convert_app.command()
def convert(
    hf_dir: Path = typer.Argument(..., readable=False, metavar="HF_DIR",
                                  help="Kimi-K3 / K3.1-Pro checkpoint folder (config.json, shards, index)"),
    out: Path = typer.Argument(..., readable=False, metavar="OUT.gguf",
                               help="output .gguf (split parts get -00001-of-0000N.gguf)"),
    outtype: str = typer.Option("bf16", help="bf16 (source bytes copied) or f32; MXFP4 experts stay MXFP4"),
    split_max_size: Optional[str] = typer.Option(
        None, metavar="SIZE", help="max bytes per split file, e.g. 50G; at least 1M (K, M, G, T: powers of 1000)"),
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
    from .convert import build_plan, convert as run, plan_policy, run_inputs
    from .gguf_io import check_split_max_size, output_lock, written_paths
    from .paths import Report, refuse_overlap
    started, result, one = time.time(), None, None
    try:
        with interrupts_raise(), ExitStack() as held:
            max_size = 0
            if split_max_size is not None:
                max_size = parse_size(split_max_size)
                check_split_max_size(max_size, split_max_size)
            check_count(split_max_tensors, "--split-max-tensors", 0)
            from .quantize_cli import target_options
            target = target_options(target_size, target_bpw, gpu_budget, emit_policy, imatrix, policy)
            quant_options = _policy_options(policy, tensor_type, tensor_type_file, imatrix, allow_requantize,
                                            strict, dry_run, target is not None)    # their errors come first
            refuse_overlap(run_inputs(hf_dir, *(quant_options or ())),
                           [*written_paths(out), *(target.outputs(out) if target else [])])
            emitted = (held.enter_context(closing(Report(emit_policy, force, "--emit-policy")))
                       if emit_policy is not None else None)
            if not dry_run:             # a second run into OUT refuses before reading 96 shard headers
                held.enter_context(output_lock(out))
            reading(hf_dir)
            plan = build_plan(hf_dir, outtype)
            if quant_options is not None:
                from .quantize_cli import report_decisions, report_write_blockers
                pol, imat = quant_options
                if target is not None:
                    choice = choose_in_pass(plan, pol, imat, target, out, allow_requantize=allow_requantize)
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


def choose_in_pass(plan, base, imat, target, out: Path, *, allow_requantize: bool):
    """--target-size in the one pass: kimi-quantize's choice for the converted file, its rows cut from the
    converter's own producers (quant.target.streamed)."""
    from .convert import plan_policy, producers
    from .quant.blocks import default_threads
    from .quant.target.choose import check_decisions, choose_decided
    from .quant.target.streamed import producer_rows
    import numpy as np
    base_plan = plan_policy(plan, base, imatrix=imat, allow_requantize=allow_requantize).plan
    weights = sum(int(np.prod(t.shape, dtype=np.int64)) for t in plan.tensors)
    decisions, budget_bytes = check_decisions(base_plan, weights, target.budget, imat,
                                              allow_requantize=allow_requantize, gpu_budget=target.gpu_budget)
    choice = choose_decided(decisions, budget_bytes, producer_rows(producers(plan)), base, target.budget, imat,
                            allow_requantize=allow_requantize, gpu_budget=target.gpu_budget,
                            threads=default_threads(), cache_path=target.cache_path(out),
                            source=str(target.emit_policy or "the chosen policy"), note=note)
    from .quantize_cli import print_choice
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
    from .quantize_cli import load_policy_options
    return load_policy_options(policy, tensor_type, tensor_type_file, imatrix, allow_requantize=allow_requantize,
                               plan_only=dry_run, base=budget)


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
    return any(p.exists() and p.stat().st_mtime >= since for p in parts)      # a file, or a slice's folder


def dry_run_plan(plan, out: Path, split_max_tensors: int, split_max_size: int, force: bool, one=None) -> None:
    """What the run would check and do (convert.preflight), on stdout; a short disk exits 3.
    With --policy (`one`), the table is kimi-quantize --dry-run's, for the quantized output."""
    from .convert import preflight
    from .gguf_io import check_free_disk
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
        from .convert import one_pass_peak_ram
        from .quantize_cli import print_dry_run_table
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
