"""The last line of defence of kimi-convert, kimi-quantize and kimi-verify (kimi_convert.cli.common.run_app), and the
checks in front of it: an exception no check named is one `error: internal error while reading FILE (please
report): ...` line (the traceback with --debug) after the writer's cleanup; usage mistakes, bad option values and
bad path arguments are one `error:` line each; and a known fault never reaches the defence at all."""
from __future__ import annotations

import io
import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import signal
import threading
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

import kimi_convert.convert.converter as convert_mod
import kimi_convert.convert.job as convert_job
import kimi_convert.quant.job as quantize_job
import kimi_convert.quant.driver as driver_mod
from kimi_convert.cli import common, convert as convert_cli, quantize as quantize_cli, verify as verify_cli
from kimi_convert.cli.common import Defence, run_app

ROOT = Path(__file__).resolve().parents[1]
APPS = {"kimi-convert": convert_cli.convert_app, "kimi-quantize": quantize_cli.app, "kimi-verify": verify_cli.app}
INJECTED = "injected fault"


class Run:
    def __init__(self, code: int, out: str, err: str, fallback):
        self.code, self.out, self.err, self.fallback = code, out, err, fallback
        self.errors = [line for line in err.splitlines() if line.startswith("error:")]

    def one_error(self) -> str:
        """The one `error:` line of a failed run that no fallback produced."""
        assert self.code != 0, (self.out, self.err)
        assert len(self.errors) == 1 and "Traceback" not in self.err, self.err
        return self.errors[0]


def run(prog: str, *args) -> Run:
    """The command as its entry point runs it (run_app), in this process."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            run_app(APPS[prog], prog, [str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return Run(code, out.getvalue(), err.getvalue(), Defence.fallback)


class Blocked(BaseException):
    """Raised by the alarm in a command that hangs: a BaseException, so that no `except Exception` takes it."""


def run_guarded(prog: str, *args, timeout: float = 60) -> Run:
    """run(), ended by an alarm if it blocks (on a FIFO, say): the test then fails instead of hanging."""
    def on_alarm(signum, frame):
        raise Blocked()
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return run(prog, *args)
    except Blocked:
        pytest.fail(f"{prog} {' '.join(map(str, args))} blocked for {timeout} s")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def listing(folder: Path) -> set[str]:
    """Every entry under `folder`, hidden ones included (a partial folder, a lock, a manifest)."""
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@pytest.fixture
def out_dir(tmp_path) -> Path:
    d = tmp_path / "out"
    d.mkdir()
    return d


@pytest.fixture(scope="module")
def gguf(converted) -> Path:
    return converted("k3")


def raise_at(index: int):
    """A producer wrapper that raises ZeroDivisionError at the `index`-th tensor it is asked for, after the
    writer has written the ones before it."""
    calls = {"n": 0}

    def wrap(make):
        def produce(*args):
            calls["n"] += 1
            if calls["n"] == index:
                raise ZeroDivisionError(INJECTED)
            yield from make(*args)
        return produce
    return wrap


# ------------------------------------------------------------------ the internal-error line and cleanup

def test_unexpected_exception_in_convert_is_one_line_naming_the_checkpoint_and_leaves_nothing(
        monkeypatch, k3_dir, out_dir):
    monkeypatch.setattr(convert_mod, "_produce", raise_at(100)(convert_mod._produce))
    r = run("kimi-convert", k3_dir, out_dir / "x.gguf", "--split-max-tensors", "40")
    assert r.one_error() == (f"error: internal error while reading {k3_dir} (please report): "
                             f"ZeroDivisionError: {INJECTED}")
    assert r.code == 1 and r.fallback == "internal"
    assert listing(out_dir) == set()        # no part, no hidden partial folder, no manifest, no lock


def test_debug_shows_the_traceback_then_the_line(monkeypatch, k3_dir, out_dir):
    monkeypatch.setattr(convert_mod, "_produce", raise_at(5)(convert_mod._produce))
    r = run("kimi-convert", k3_dir, out_dir / "x.gguf", "--debug")
    lines = r.err.splitlines()
    assert "Traceback (most recent call last):" in lines and f"ZeroDivisionError: {INJECTED}" in lines
    assert lines[-1] == f"error: internal error while reading {k3_dir} (please report): ZeroDivisionError: {INJECTED}"
    assert r.code == 1 and listing(out_dir) == set()


def test_unexpected_exception_in_quantize_names_the_input_and_leaves_nothing(monkeypatch, gguf, out_dir):
    monkeypatch.setattr(driver_mod, "chunks", raise_at(50)(driver_mod.chunks))
    r = run("kimi-quantize", "--policy", "q8_0", gguf, out_dir / "q.gguf", "--split-max-size", "1M")
    assert r.one_error() == f"error: internal error while reading {gguf} (please report): ZeroDivisionError: {INJECTED}"
    assert r.code == 1 and listing(out_dir) == set()


def test_unexpected_exception_in_verify_names_the_file(monkeypatch, gguf):
    import kimi_convert.verify.check as verify_mod

    def boom(*a, **k):
        raise KeyError("tokenizer.ggml.tokens")
    monkeypatch.setattr(verify_mod, "verify", boom)
    r = run("kimi-verify", "check", gguf)
    assert r.one_error() == (f"error: internal error while reading {gguf} (please report): "
                             f"KeyError: 'tokenizer.ggml.tokens'")


def test_unexpected_exception_while_reading_the_policy_names_it(monkeypatch, gguf, tmp_path):
    import kimi_convert.quant.policy as policy_mod
    monkeypatch.setattr(policy_mod, "parse_policy", lambda *a, **k: [][0])
    p = tmp_path / "mine.toml"
    p.write_text('default = "Q8_0"\n')
    r = run("kimi-quantize", "--policy", p, gguf, tmp_path / "q.gguf")
    assert r.one_error() == (f"error: internal error while reading {p} (please report): "
                             f"IndexError: list index out of range")


def test_an_os_error_no_check_named_is_one_line_naming_its_file(monkeypatch, k3_dir, out_dir):
    def eio(*a, **k):
        raise OSError(5, "Input/output error", str(k3_dir / "model-00001-of-000005.safetensors"))
    monkeypatch.setattr(convert_job, "build_plan", eio)
    r = run("kimi-convert", k3_dir, out_dir / "x.gguf")
    assert r.one_error() == f"error: {k3_dir / 'model-00001-of-000005.safetensors'}: Input/output error"
    assert r.fallback == "os-error"


def test_ctrl_c_before_the_command_starts_is_one_line_and_exit_130(monkeypatch):
    """SIGINT while typer builds the command (found by scripts/campaign.py, seed 2 run 54): no traceback."""
    import typer.main

    def interrupted(app):
        raise KeyboardInterrupt
    monkeypatch.setattr(typer.main, "get_command", interrupted)
    r = run("kimi-convert", "a", "b")
    assert r.code == 130 and r.err.splitlines() == ["error: interrupted by SIGINT"]


def test_a_successful_run_reaches_no_fallback(k3_dir, out_dir):
    r = run("kimi-convert", k3_dir, out_dir / "x.gguf")
    assert r.code == 0 and r.errors == [] and r.fallback is None
    assert r.out == f"{out_dir / 'x.gguf'}\n"


def test_sigterm_during_a_slice_leaves_nothing(monkeypatch, k3_dir, out_dir):
    """kimi-verify slice unwinds on SIGTERM as the writers do (found by scripts/campaign.py, seed 2 run 705)."""
    import kimi_convert.verify.slice as slice_mod
    write = slice_mod._write_shard

    def terminated(*args):
        os.kill(os.getpid(), signal.SIGTERM)
        return write(*args)
    monkeypatch.setattr(slice_mod, "_write_shard", terminated)
    r = run("kimi-verify", "slice", k3_dir, out_dir / "sliced", "--layers", "2")
    assert r.code == 143 and r.one_error() == f"error: {out_dir / 'sliced'}: interrupted by SIGTERM; nothing was written"
    assert listing(out_dir) == set()


def signal_during_cleanup(monkeypatch, sig: int) -> list[str]:
    """shutil.rmtree sends `sig` to this process once it has begun removing a partial folder (as a signal that
    lands in the writer's cleanup after the commit would, seed 5 run 1086); the folders it was called on."""
    real, calls = shutil.rmtree, []

    def rmtree(path, *args, **kwargs):
        if ".partial-" in Path(path).name and not calls:
            calls.append(str(path))
            first = next(Path(path).iterdir(), None) if Path(path).is_dir() else None
            if first is not None and first.is_file():
                first.unlink()                      # the removal is under way
            os.kill(os.getpid(), sig)
        return real(path, *args, **kwargs)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    return calls


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
@pytest.mark.parametrize("command", ["convert", "convert-split", "slice"])
def test_a_signal_during_the_cleanup_after_the_commit_waits_for_its_end(monkeypatch, k3_dir, out_dir, command, sig):
    """The commit and the cleanup run to their end, then the signal is delivered: the output is complete and
    nothing else is left (no partial folder, no lock)."""
    calls = signal_during_cleanup(monkeypatch, sig)
    args = {"convert": ("kimi-convert", k3_dir, out_dir / "x.gguf"),
            "convert-split": ("kimi-convert", k3_dir, out_dir / "x.gguf", "--split-max-tensors", "40"),
            "slice": ("kimi-verify", "slice", k3_dir, out_dir / "sliced", "--layers", "2")}[command]
    r = run(*args)
    assert calls, "the cleanup was not reached"
    out = out_dir / ("sliced" if command == "slice" else "x.gguf")
    assert r.code == 128 + sig and r.one_error() == \
        f"error: {out}: interrupted by {signal.Signals(sig).name} after {out} was complete"
    assert not [p for p in listing(out_dir) if p.startswith(".")], listing(out_dir)
    if command == "slice":
        assert (out / "config.json").is_file()
    else:
        parts = sorted(out_dir.glob("x*.gguf"))
        assert parts and all(p.stat().st_size > 0 for p in parts)


@pytest.mark.parametrize("prog", ["kimi-convert", "kimi-quantize"])
def test_a_second_run_into_a_locked_output_refuses_before_reading_its_input(monkeypatch, k3_dir, gguf, out_dir, prog):
    """The output lock comes before the plan (96 shard headers, or the input GGUF's): a run that must refuse
    does no heavy work first."""
    import fcntl

    def planned(*args, **kwargs):
        raise AssertionError("the input was read before the output lock was taken")
    monkeypatch.setattr(convert_job, "build_plan", planned)           # what each command's job reads first
    monkeypatch.setattr(quantize_job, "open_gguf", planned)
    out = out_dir / "x.gguf"
    lock = out_dir / ".x.gguf.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, b"4242\n")               # another run's lock (flock conflicts across open files, too)
        args = [k3_dir, out] if prog == "kimi-convert" else ["--policy", "q8_0", gguf, out]
        r = run(prog, *args)
    finally:
        os.close(fd)
    assert r.one_error() == (f"error: {out}: another run (process 4242) is writing this output now ({lock} is "
                             f"locked); wait for it to end, or stop it")
    assert r.fallback is None and listing(out_dir) == {".x.gguf.lock"}


def test_a_slice_removes_the_partial_folder_of_a_dead_run(k3_dir, out_dir):
    stale = out_dir / ".sliced.partial-999999999"          # no process has that id
    stale.mkdir()
    (stale / "model-00001-of-00003.safetensors").write_bytes(b"half")
    r = run("kimi-verify", "slice", k3_dir, out_dir / "sliced", "--layers", "2")
    assert r.code == 0 and f"removed {stale}" in r.err
    assert not stale.exists() and (out_dir / "sliced" / "config.json").is_file()


# ------------------------------------------------------------------ usage mistakes

@pytest.mark.parametrize("prog,args,message", [
    ("kimi-convert", ["--bogus"], "No such option: --bogus"),
    ("kimi-convert", [], "Missing argument 'HF_DIR'"),
    ("kimi-convert", ["A", "B", "--split-max-tensors", "abc"], "Invalid value for '--split-max-tensors'"),
    ("kimi-quantize", ["in.gguf", "out.gguf"], "Missing option '--policy'"),
    ("kimi-quantize", ["--policy", "q8_0", "in.gguf", "--threads", "two"], "Invalid value for '--threads'"),
    ("kimi-verify", ["chek", "x.gguf"], "No such command 'chek'"),
    ("kimi-verify", ["check", "x.gguf", "--length", "1.5"], "Invalid value for '--length'"),
    ("kimi-verify", ["check", "x.gguf", "--max-kl", "low"], "Invalid value for '--max-kl'"),
])
def test_a_usage_mistake_is_one_error_line_with_exit_2(prog, args, message):
    r = run(prog, *args)
    assert r.code == 2 and r.err.splitlines() == r.errors and len(r.errors) == 1, r.err
    assert message in r.errors[0] and "--help" in r.errors[0] and "Usage:" not in r.err


# ------------------------------------------------------------------ bad option values

HUGE = "99999999999999999999T"


@pytest.mark.parametrize("prog,args,message", [
    ("kimi-convert", ["--split-max-size", "-5G"], "--split-max-size -5G: must be at least 1M"),
    ("kimi-convert", ["--split-max-size", "0"], "--split-max-size 0: must be at least 1M"),
    ("kimi-convert", ["--split-max-size", "five"], "--split-max-size 'five': not a size"),
    ("kimi-convert", ["--split-max-size", "1e400G"], "--split-max-size '1e400G': not a size"),
    ("kimi-convert", ["--split-max-size", "infG"], "--split-max-size 'infG': not a size"),
    ("kimi-convert", ["--split-max-size", HUGE], f"--split-max-size {HUGE}: more than any file can hold"),
    ("kimi-convert", ["--split-max-tensors", "-1"], "--split-max-tensors -1: must be at least 0"),
    ("kimi-convert", ["--outtype", "q4"], "--outtype 'q4'"),
    ("kimi-quantize", ["--threads", "-1"], "--threads -1: must be at least 0"),
    ("kimi-quantize", ["--threads", "100000"], "--threads 100000: must be at most 1,024"),
    ("kimi-quantize", ["--split-max-size", "-5G"], "--split-max-size -5G: must be at least 1M"),
    ("kimi-quantize", ["--split-max-size", HUGE], "more than any file can hold"),
    ("kimi-quantize", ["--split-max-size="], "--split-max-size '': not a size"),      # campaign seed 5 run 609
    ("kimi-convert", ["--split-max-size="], "--split-max-size '': not a size"),
    ("kimi-quantize", ["--keep-split", "--split-max-size", "5G"], "--keep-split and --split-max-size exclude"),
    ("kimi-quantize", ["--json", "{tmp}/no/such/r.json"], "the folder {tmp}/no/such does not exist"),
    ("kimi-quantize", ["--json", "{tmp}"], "{tmp}: is a folder; --json takes a file name"),
    ("kimi-verify", ["--seed", "-1"], "--seed -1: must be at least 0"),
    ("kimi-verify", ["--length", "1"], "--length 1: must be at least 2"),
    ("kimi-verify", ["--length", "100000000"], "--length 100000000: must be at most 1,048,576"),
    ("kimi-verify", ["--json", "{tmp}/no/such/r.json"], "the folder {tmp}/no/such does not exist"),
], ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_a_bad_option_value_is_one_error_line_and_writes_nothing(prog, args, message, k3_dir, gguf, out_dir):
    args = [a.replace("{tmp}", str(out_dir)) for a in args]
    where = {"kimi-convert": [k3_dir, out_dir / "x.gguf"],
             "kimi-quantize": ["--policy", "q8_0", gguf, out_dir / "x.gguf"],
             "kimi-verify": ["check", gguf]}[prog]
    r = run(prog, *where, *args)
    assert message.replace("{tmp}", str(out_dir)) in r.one_error() and r.code == 1 and r.fallback is None
    assert listing(out_dir) == set()


def test_a_slice_into_a_file_is_one_error_line(k3_dir, gguf):
    r = run("kimi-verify", "slice", k3_dir, gguf, "--layers", "2")
    assert r.one_error() == (f"error: {gguf}: not a folder; OUT_DIR is the folder the sliced checkpoint goes "
                             f"into") and r.fallback is None


def test_split_sizes_are_decimal_exact():
    assert common.parse_size("1.1G") == 1_100_000_000 and common.parse_size("50g") == 50 * 10**9
    assert common.parse_size(" 900M ") == 900 * 10**6 and common.parse_size("1234567") == 1234567


def test_a_report_into_a_fifo_nobody_reads_is_an_error_not_a_hang(gguf, tmp_path):
    fifo = tmp_path / "report.json"
    os.mkfifo(fifo)
    r = run_guarded("kimi-quantize", "--policy", "q8_0", gguf, "--dry-run", "--json", fifo)
    assert r.one_error() == f"error: {fifo}: cannot write the report (no process reads this FIFO)"


def test_a_report_into_a_fifo_that_is_read_is_written(gguf, tmp_path):
    fifo = tmp_path / "report.json"
    os.mkfifo(fifo)
    got: list[bytes] = []

    def read():
        with open(fifo, "rb") as f:            # blocks until the command opens it for writing
            got.append(f.read())
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while not got and reader.is_alive():      # the reader may open after the command: retry until it has
        r = run("kimi-quantize", "--policy", "q8_0", gguf, "--dry-run", "--json", fifo)
        if r.code == 0:
            break
    reader.join(30)
    assert r.code == 0 and json.loads(got[0])["policy"] == "preset q8_0"


# ------------------------------------------------------------------ path arguments

@pytest.fixture
def odd_paths(tmp_path, gguf) -> dict[str, Path]:
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    (tmp_path / "folder.gguf").mkdir()
    return {"missing": tmp_path / "missing.gguf", "folder": tmp_path / "folder.gguf", "fifo": fifo}


PATH_MESSAGES = {"missing": "not found|No such file", "folder": "folder", "fifo": "FIFO|not a regular file"}


@pytest.mark.parametrize("kind", ["missing", "folder", "fifo"])
@pytest.mark.parametrize("where", ["quantize IN", "quantize --policy", "quantize --imatrix",
                                   "quantize --tensor-type-file", "verify FILE", "verify HF_DIR FILE",
                                   "verify --imatrix", "convert --policy"])
def test_a_path_argument_that_is_not_a_readable_file_is_one_error_line(where, kind, odd_paths, gguf, k3_dir,
                                                                        out_dir):
    bad = odd_paths[kind]
    args = {"quantize IN": ["kimi-quantize", "--policy", "q8_0", bad, out_dir / "q.gguf"],
            "quantize --policy": ["kimi-quantize", "--policy", bad, gguf, out_dir / "q.gguf"],
            "quantize --imatrix": ["kimi-quantize", "--policy", "q8_0", "--imatrix", bad, gguf, out_dir / "q.gguf"],
            "quantize --tensor-type-file": ["kimi-quantize", "--policy", "q8_0", "--tensor-type-file", bad, gguf,
                                            out_dir / "q.gguf"],
            "verify FILE": ["kimi-verify", "check", bad],
            "verify HF_DIR FILE": ["kimi-verify", "check", k3_dir, bad],
            "verify --imatrix": ["kimi-verify", "check", k3_dir, gguf, "--imatrix", bad],
            "convert --policy": ["kimi-convert", k3_dir, out_dir / "x.gguf", "--policy", bad]}[where]
    r = run_guarded(*args)
    line = r.one_error()
    assert str(bad) in line and any(m in line for m in PATH_MESSAGES[kind].split("|")), line
    assert r.fallback is None and listing(out_dir) == set()


@pytest.mark.parametrize("kind", ["missing", "a file", "fifo"])
def test_an_hf_dir_that_is_not_a_folder_is_one_error_line(kind, odd_paths, gguf, out_dir):
    bad = {"missing": odd_paths["missing"], "a file": gguf, "fifo": odd_paths["fifo"]}[kind]
    for args in (["kimi-convert", bad, out_dir / "x.gguf"], ["kimi-verify", "slice", bad, out_dir / "s"]):
        r = run_guarded(*args)
        assert str(bad) in r.one_error() and r.fallback is None
    assert listing(out_dir) == set()


# unreadable files: root reads everything, so as root the command runs without the capabilities that let it
# (util-linux's setpriv drops them before python starts)
NO_DAC = (["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search"]
          if os.geteuid() == 0 else [])


def run_unreadable(tmp: Path, module: str, main: str, *args) -> subprocess.CompletedProcess:
    code = f"from {module} import {main}; {main}()"
    return subprocess.run([*NO_DAC, sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120, cwd=tmp)


@pytest.fixture
def open_tmp(tmp_path):
    return tmp_path


def test_unreadable_inputs_are_one_error_line(open_tmp, gguf, k3_dir):
    src = open_tmp / "in.gguf"
    shutil.copyfile(gguf, src)
    ckpt = open_tmp / "ckpt"
    shutil.copytree(k3_dir, ckpt)
    for p in [ckpt, *ckpt.iterdir()]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    shard = next(ckpt.glob("*.safetensors"))
    for p in (src, shard):
        p.chmod(0)
    policy = open_tmp / "p.toml"
    policy.write_text('default = "Q8_0"\n')
    policy.chmod(0)
    cases = [(src, ["kimi_convert.cli.quantize", "main", "--policy", "q8_0", src, open_tmp / "q.gguf"]),
             (src, ["kimi_convert.cli.verify", "main", "check", src]),
             (policy, ["kimi_convert.cli.quantize", "main", "--policy", policy, gguf, open_tmp / "q.gguf"]),
             (shard, ["kimi_convert.cli.convert", "convert_main", ckpt, open_tmp / "x.gguf"])]
    for bad, args in cases:
        before = listing(open_tmp)
        r = run_unreadable(open_tmp, *args)
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert r.returncode == 1 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
        assert str(bad) in errors[0] and "ermission denied" in errors[0] and "internal" not in errors[0], errors
        assert listing(open_tmp) == before


# ------------------------------------------------------------------ known faults are named by their own checks

def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(d: Path, **changes) -> None:
    p = d / "config.json"
    cfg = json.loads(p.read_text())
    (cfg.get("text_config", cfg)).update(changes)
    p.write_text(json.dumps(cfg))


def shard_header(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


def write_shard(path: Path, header: dict, body: bytes, *, header_bytes: bytes | None = None) -> None:
    raw = header_bytes if header_bytes is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def first_shard(d: Path) -> Path:
    return sorted(d.glob("*.safetensors"))[0]


def mutate_entry(d: Path, fn, name_filter=lambda n: not n.startswith("__")) -> None:
    shard = first_shard(d)
    header, body = shard_header(shard)
    name = sorted(n for n in header if name_filter(n))[0]
    fn(header, name)
    write_shard(shard, header, body)


def vision_shard(d: Path) -> Path:
    idx = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    return d / next(f for n, f in idx.items() if "vision_tower" in n)


def checkpoint_faults():
    def config(**changes):
        return lambda d: edit_config(d, **changes)

    def config_text(text):
        return lambda d: (d / "config.json").write_text(text)

    def null_offsets(d):
        mutate_entry(d, lambda h, n: h[n].update(data_offsets=None))

    def overlap(d):
        def f(h, n):
            names = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
            a, b = names[0], names[1]
            h[b]["data_offsets"] = [h[a]["data_offsets"][0], h[a]["data_offsets"][0] + (
                h[b]["data_offsets"][1] - h[b]["data_offsets"][0])]
        mutate_entry(d, f)

    def huge_shape(d):
        mutate_entry(d, lambda h, n: h[n].update(shape=[2**40, 2**40]))

    def string_dims(d):
        mutate_entry(d, lambda h, n: h[n].update(shape=[str(x) for x in h[n]["shape"]]))

    def negative_dropped_dim(d):
        shard = vision_shard(d)
        header, body = shard_header(shard)
        name = next(n for n in header if "vision_tower" in n)
        header[name]["shape"] = [-header[name]["shape"][0], *header[name]["shape"][1:]]
        write_shard(shard, header, body)

    def header_cut_by_one(d):
        shard = first_shard(d)
        data = shard.read_bytes()
        n = struct.unpack("<Q", data[:8])[0]
        shard.write_bytes(struct.pack("<Q", n - 1) + data[8:])

    def trailing_garbage(d):
        with open(first_shard(d), "ab") as f:
            f.write(b"garbage")

    def shard_is_folder(d):
        s = first_shard(d)
        s.unlink()
        s.mkdir()

    def index_escape(d):
        p = d / "model.safetensors.index.json"
        idx = json.loads(p.read_text())
        name = next(iter(idx["weight_map"]))
        idx["weight_map"][name] = "../" + idx["weight_map"][name]
        p.write_text(json.dumps(idx))

    return {
        "config.json is null": config_text("null"),
        "config value a string for a float": config(rms_norm_eps="1e-5x"),
        "negative attn_res_block_size": config(attn_res_block_size=-3),
        "fractional num_hidden_layers": config(num_hidden_layers=9.5),
        "NaN rms_norm_eps": config(rms_norm_eps=float("nan")),          # json writes it as NaN
        "number as a string in the config": config(num_attention_heads="4"),
        "data_offsets null": null_offsets,
        "overlapping data_offsets": overlap,
        "shape product beyond int64": huge_shape,
        "dims given as strings": string_dims,
        "negative dim of a dropped tensor": negative_dropped_dim,
        "header length cut by one byte": header_cut_by_one,
        "trailing garbage after the data": trailing_garbage,
        "a shard that is a folder": shard_is_folder,
        "../ path in the index": index_escape,
        "missing shard": lambda d: first_shard(d).unlink(),
    }


CHECKPOINT_FAULTS = checkpoint_faults()


@pytest.mark.parametrize("fault", list(CHECKPOINT_FAULTS))
def test_a_known_checkpoint_fault_is_named_by_its_own_check(fault, k3_dir, tmp_path, out_dir):
    d = copy_ckpt(k3_dir, tmp_path / "ckpt")
    CHECKPOINT_FAULTS[fault](d)
    r = run("kimi-convert", d, out_dir / "x.gguf")
    line = r.one_error()
    assert r.fallback is None and "internal error" not in line, line
    assert str(d) in line or d.name in line, line
    assert listing(out_dir) == set()


def gguf_fields(path: Path) -> dict:
    """The key-value fields of a good file (gguf-py also lists the header as GGUF.* pseudo-fields: not keys)."""
    from gguf import GGUFReader
    return {name: f for name, f in GGUFReader(path).fields.items() if not name.startswith("GGUF.")}


def gguf_faults(gguf: Path):
    fields = gguf_fields(gguf)

    def patch(offset: int, data: bytes):
        def f(path: Path):
            raw = bytearray(path.read_bytes())
            raw[offset:offset + len(data)] = data
            path.write_bytes(bytes(raw))
        return f

    tokens = fields["tokenizer.ggml.tokens"]
    key_len = len(tokens.name.encode())
    array_len_at = tokens.offset + 8 + key_len + 4 + 4
    by_len: dict[int, list] = {}
    for f in fields.values():
        by_len.setdefault(len(f.name.encode()), []).append(f)
    twins = next(fs for fs in by_len.values() if len(fs) >= 2)
    arch = fields["general.architecture"]
    return {
        "array length 2^32": patch(array_len_at, struct.pack("<Q", 1 << 32)),
        "duplicate key": patch(twins[1].offset + 8, twins[0].name.encode()),
        "key not UTF-8": patch(arch.offset + 8, b"\xff\xfe"),
        "tensor count huge": patch(8, struct.pack("<Q", 1 << 60)),
        "truncated": lambda p: p.write_bytes(p.read_bytes()[:len(p.read_bytes()) // 2]),
    }


@pytest.mark.parametrize("fault", ["array length 2^32", "duplicate key", "key not UTF-8", "tensor count huge",
                                   "truncated"])
def test_a_known_gguf_fault_is_named_by_its_own_check(fault, gguf, tmp_path, out_dir):
    bad = tmp_path / "bad.gguf"
    shutil.copyfile(gguf, bad)
    gguf_faults(gguf)[fault](bad)
    q = run("kimi-quantize", "--policy", "q8_0", bad, out_dir / "q.gguf")
    assert str(bad) in q.one_error() and q.fallback is None and "internal error" not in q.errors[0]
    v = run("kimi-verify", "check", bad)
    assert v.code == 1 and v.fallback is None and "Traceback" not in v.err
    assert v.errors == [] and v.out.rstrip().endswith("FAIL"), v.out + v.err    # verify reports, in its table
    assert listing(out_dir) == set()


def test_the_regular_file_check_keeps_a_symlink_to_one(gguf, tmp_path):
    link = tmp_path / "link.gguf"
    link.symlink_to(gguf)
    common.check_input_file(link)
    assert stat.S_ISLNK(os.lstat(link).st_mode)
