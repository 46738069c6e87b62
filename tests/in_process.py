"""A command run in the test's own process, as its console script runs it (cli.common.run_app: the one `error:`
line, the exit status), its stdout and stderr captured apart and `env` set for the run: for the tests that look
at a command's output and files. Signals, peak RSS and the exit status a shell sees still need a process of
their own (subprocess)."""
from __future__ import annotations

import importlib
import subprocess

from typer.testing import CliRunner

from kimi_convert.cli.common import run_app

APPS = {"kimi-quantize": ("kimi_convert.cli.quantize", "app"), "kimi-convert": ("kimi_convert.cli.convert", "convert_app"),
        "kimi-imatrix": ("kimi_convert.cli.imatrix", "app"), "kimi-verify": ("kimi_convert.cli.verify", "app")}


def run_command(prog: str, args, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    module, name = APPS[prog]
    app = getattr(importlib.import_module(module), name)
    args = [str(a) for a in args]
    with CliRunner().isolation(env={"COLUMNS": "300", **(env or {})}) as (out, err, _):
        try:
            run_app(app, prog, args)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        stdout, stderr = out.getvalue().decode(), err.getvalue().decode()
    return subprocess.CompletedProcess([prog, *args], code, stdout, stderr)
