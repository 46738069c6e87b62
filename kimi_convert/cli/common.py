"""What the three commands share: one error line and exit code per fault (run_app), the consoles, the
options' checks and formats. Imports no command."""
from __future__ import annotations

import errno
import glob
import os
import signal
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from .. import sizes
from ..errors import Interrupted, KimiError
from ..interrupts import INTERRUPTS, deliver_postponed, postpone


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
    from ..inputs import open_input
    with open_input(Path(path), KimiError):
        pass


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def parse_size(text: str, option: str = "--split-max-size") -> int:
    """A size option's value in bytes: the one grammar of every size option (kimi_convert.sizes: 50G, 50GB,
    46.6GiB, bytes; K/M/G/T powers of 1000 as llama.cpp counts them). Computed in decimal, so 1.1G is
    1,100,000,000 bytes, not a float's neighbour of it."""
    return sizes.parse_size(text, option)


MAX_THREADS = 1024


def threads_option(what: str):
    """--threads N, the same in every command: `what` the threads do; 0 (the default) is every core."""
    return typer.Option(0, "--threads", "-t", metavar="N", help=f"{what} (default 0: all cores)")


def check_threads(threads: int) -> None:
    check_count(threads, "--threads", 0, MAX_THREADS, "one OS thread each; 0 is all cores")


def check_count(value: int, option: str, low: int, high: Optional[int] = None, why: str = "") -> None:
    """An integer option in low..high (`why`: where the upper bound comes from)."""
    if value < low:
        raise KimiError(f"{option} {value}: must be at least {low}")
    if high is not None and value > high:
        raise KimiError(f"{option} {value}: must be at most {high:,} ({why})")


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


def show_plan(plan, report, dry_run: bool) -> bool:
    """A job's plan (kimi-imatrix, kimi-verify kld): printed whole under --dry-run, and given to --json, or else
    its one-line summary before the run. True when the command ends here."""
    if dry_run:
        for line in plan.lines():
            output.print(line, highlight=False, markup=False)
        if report:
            import json
            report.deliver(json.dumps(plan.as_json(), indent=2) + "\n")
        return True
    note(plan.summary())
    return False

