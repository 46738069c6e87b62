"""What the commands print, and where: one-line summaries when piped, the plan on stdout, plain flags
in --help, ordinary file modes."""
from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONVERT = "from kimi_convert.cli.convert import convert_main; convert_main()"
VERIFY = "from kimi_convert.cli.verify import main; main()"


def run(entry: str, *args) -> subprocess.CompletedProcess:
    """A command with stdout and stderr piped and no COLUMNS: what a script or CI log sees."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-c", entry, *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=120)


def test_convert_summary_is_one_line_when_piped(tmp_path, k3_dir):
    r = run(CONVERT, k3_dir, tmp_path / "out.gguf")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{tmp_path / 'out.gguf'}\n"
    summary = [line for line in r.stderr.splitlines() if line.startswith("wrote ")]
    assert len(summary) == 1 and "peak RSS" in summary[0] and summary[0].endswith(")"), r.stderr
    assert len(summary[0]) > 80                      # so it would have wrapped at rich's default width
    assert not [line for line in r.stderr.splitlines() if line.rstrip().endswith(";")]


def test_slice_summary_is_one_line_when_piped(tmp_path, k3_dir):
    r = run(VERIFY, "slice", k3_dir, tmp_path / "s", "--layers", "4")
    assert r.returncode == 0, r.stderr
    summary = [line for line in r.stdout.splitlines() if " tensors, " in line]
    assert len(summary) == 1 and "peak RSS" in summary[0] and len(summary[0]) > 80, r.stdout


def test_dry_run_plan_goes_to_stdout(tmp_path, k3_dir):
    r = run(CONVERT, k3_dir, tmp_path / "out.gguf", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "routed experts" in r.stdout and "estimated peak RAM" in r.stdout and "free disk" in r.stdout
    assert r.stderr == ""
    plan_line = [line for line in r.stdout.splitlines() if line.startswith("output type")]
    assert len(plan_line) == 1 and plan_line[0].endswith(")"), r.stdout


@pytest.mark.parametrize("entry,args", [(CONVERT, []), (VERIFY, []), (VERIFY, ["check"]), (VERIFY, ["slice"])],
                         ids=["kimi-convert", "kimi-verify", "kimi-verify check", "kimi-verify slice"])
def test_help_shows_flags_as_flags(entry, args):
    r = run(entry, *args, "--help")
    assert r.returncode == 0, r.stderr
    assert "<bool>" not in r.stdout
    flags = {"--help"} | ({"--dry-run", "--force"} if entry == CONVERT else set()) | (
        {"--force"} if args == ["slice"] else set())
    for flag in flags:
        line = next(line for line in r.stdout.splitlines() if line.strip().startswith(flag + " "))
        assert re.match(rf"\s*{flag}\s+[A-Za-z]", line), line     # the flag, then straight to its help


def test_convert_help_documents_exit_codes_and_split_minimum():
    r = run(CONVERT, "--help")
    text = " ".join(r.stdout.split())
    assert "3 not enough free disk" in text and "1 bad input or any other error" in text
    assert "at least 1M" in text


def file_modes(d: Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in d.iterdir()}


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_fixture_and_slice_files_have_ordinary_modes(tmp_path, umask):
    """Files 0666 and folders 0777 less the umask, like any file a user makes (not 0600)."""
    from kimi_convert.fixtures.make_checkpoint import make_checkpoint
    from kimi_convert.verify.slice import slice_checkpoint
    old = os.umask(umask)
    try:
        ckpt = make_checkpoint(tmp_path / "ckpt", arch="k3", n_layers=4)
        sliced = tmp_path / "sliced"
        slice_checkpoint(ckpt, sliced, "2")
    finally:
        os.umask(old)
    for d in (ckpt, sliced):
        modes = file_modes(d)
        assert any(name.endswith(".safetensors") for name in modes)
        assert modes == {name: 0o666 & ~umask for name in modes}, d
    assert stat.S_IMODE(sliced.stat().st_mode) == 0o777 & ~umask
