#!/usr/bin/env python3
"""A seeded, bounded fault campaign over kimi-convert, kimi-quantize and kimi-verify (issue 9).

    python scripts/campaign.py --runs 5000 --seed 1 [--workers 2] [--time-limit 3600] [--json out.json]
    python scripts/campaign.py --seed 1 --only 1234 --keep       # one run again: its command, output, folder

Run i draws its fault class and its fault from random.Random(f"{seed}:{i}"), so a run is reproduced by its seed
and index alone. The classes are those of issue 9 §1: mutated safetensors headers, checkpoint-level faults
(missing shard, bad index, config mutations, FIFO, symlinks, permissions), mutated GGUF files for kimi-verify and
kimi-quantize, mutated policies and imatrices, bad options, and SIGINT / SIGTERM / SIGKILL at a random point
followed by a rerun; and valid inputs, whose outputs must equal a reference run's byte for byte.

Each run is classified: clean (exit 0 with the right output, or exit != 0 with exactly one `error:` line and no
traceback; for `kimi-verify check`, a FAIL report is a refusal too) or flagged:
  traceback      a Python traceback on stderr, or death by a signal nobody sent
  fallback       the last line of defence (cli.run_app's internal-error or unnamed-OSError line), or a verify
                 report part that failed on a non-KimiError exception: a fault no check named
  wrong-success  exit 0 on input known to be bad
  wrong-output   exit 0 on valid input, but the output differs from the reference run's
  valid-failed   exit != 0 on valid input
  not-one-error  exit != 0 without exactly one `error:` line (and no FAIL report)
  memory         peak RSS above the fork point by more than --mem-bound, or a MemoryError (the address space is
                 capped at the fork point's + 4 GiB, so that a blowup fails instead of swapping)
  hang           no exit within --timeout seconds (then SIGKILL)
  left-behind    anything new in the output folder after a failed run (hidden partial folders, locks, manifests)
  input-lost     a file the command reads changed (an output, a report or a lock written over an input)

Speed: the commands run in fork()ed children of workers that imported everything once (typer's lazy modules,
numba's kernels, torch), on fixtures made once: a fork-server. Children are single-threaded (OMP/BLAS/numba).
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")        # before numpy: a forked child must not inherit thread pools
os.environ["NO_COLOR"] = "1"                # rich decides colours when kimi_convert.cli is imported: none, ever
os.environ.pop("COLUMNS", None)

import argparse                              # noqa: E402
import ctypes                                # noqa: E402
import hashlib                               # noqa: E402
import json                                  # noqa: E402
import multiprocessing as mp                 # noqa: E402
import random                                # noqa: E402
import re                                    # noqa: E402
import resource                              # noqa: E402
import select                                # noqa: E402
import shutil                                # noqa: E402
import signal                                # noqa: E402
import struct                                # noqa: E402
import sys                                   # noqa: E402
import tempfile                              # noqa: E402
import time                                  # noqa: E402
import traceback                             # noqa: E402
from collections import Counter              # noqa: E402
from dataclasses import dataclass, field     # noqa: E402
from pathlib import Path                     # noqa: E402
from typing import Callable                  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FLAGS = ("traceback", "fallback", "wrong-success", "wrong-output", "valid-failed", "not-one-error", "memory",
         "hang", "left-behind", "input-lost")
MiB, GiB = 1 << 20, 1 << 30
AS_HEADROOM = 4 * GiB


# ================================================================================== fixtures and references

@dataclass
class Fixtures:
    """Inputs made once, read-only for the runs (which copy what they damage), and reference outputs."""
    base: Path
    refs: dict = field(default_factory=dict)         # name -> {relative path: sha256, or None for names only}
    seconds: dict = field(default_factory=dict)      # name -> how long the reference run took
    gguf_layout: dict = field(default_factory=dict)  # offsets of the fields of k3.gguf that GGUF faults edit

    def __getattr__(self, name):                     # fx.k3, fx.k3_gguf, ... : files under base
        if name.startswith("_") or name in ("base", "refs", "seconds", "gguf_layout"):
            raise AttributeError(name)
        return self.base / FIXTURE_FILES[name]


FIXTURE_FILES = {"k3": "k3", "k31": "k31", "k3_gguf": "k3.gguf", "k31_gguf": "k31.gguf",
                 "imatrix_gguf": "k3.imatrix.gguf", "imatrix_dat": "k3.imatrix.dat", "policy": "q4k.toml",
                 "split": "split", "calib": "calib.txt"}
QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q6_K", "BF16", "F16")     # the campaign's policies choose among these
POLICY_TEXT = ('default = "Q4_K"\n\n[[rules]]\npattern = "attn_(q_a|q_b|kv_a)"\ntype = "Q8_0"\n'
               'why = "low-rank projections"\n\n[[rules]]\npattern = "token_embd|output"\ntype = "Q6_K"\n')


def build_fixtures(base: Path) -> Fixtures:
    from kimi_convert.fixtures.make_checkpoint import make_checkpoint
    fx = Fixtures(base)
    make_checkpoint(fx.k3, arch="k3", n_layers=4)
    make_checkpoint(fx.k31, arch="k31", n_layers=4)
    fx.policy.write_text(POLICY_TEXT)
    import inspect
    import argparse as calib_source
    fx.calib.write_text(inspect.getsource(calib_source))        # kimi-imatrix's calibration text
    for name, prog, args in [("k3.gguf", "kimi-convert", [fx.k3, "{out}"]),
                             ("k31.gguf", "kimi-convert", [fx.k31, "{out}"])]:
        r = spawn(prog, [str(a).replace("{out}", str(base / name)) for a in args], base, timeout=300)
        if r.code != 0:
            raise SystemExit(f"fixture {name}: {prog} failed:\n{r.err}")
    _write_imatrices(fx)
    fx.split.mkdir()
    r = spawn("kimi-quantize", ["--policy", "q8_0", str(fx.k3_gguf), str(fx.split / "s.gguf"), "--split-max-size",
                                "1M"], base, timeout=300)
    if r.code != 0:
        raise SystemExit(f"fixture split: kimi-quantize failed:\n{r.err}")
    (fx.split / "s.gguf.manifest.json").unlink()
    for name, (prog, args) in REFERENCES.items():
        out = base / "ref" / name
        out.mkdir(parents=True)
        started = time.monotonic()
        r = spawn(prog, [a.format(fx=fx, out=out) for a in args], out, timeout=300)
        fx.seconds[name] = time.monotonic() - started
        if r.code != 0:
            raise SystemExit(f"reference {name}: {prog} {' '.join(args)} failed:\n{r.err}")
        fx.refs[name] = output_digest(out)
    fx.gguf_layout = gguf_layout(fx.k3_gguf)
    return fx


# name -> (command, arguments); {out} is the output folder, the output file is always {out}/out.gguf
REFERENCES = {
    "convert": ("kimi-convert", ["{fx.k3}", "{out}/out.gguf"]),
    "convert-split": ("kimi-convert", ["{fx.k3}", "{out}/out.gguf", "--split-max-tensors", "40"]),
    "convert-k31": ("kimi-convert", ["{fx.k31}", "{out}/out.gguf"]),
    "convert-policy": ("kimi-convert", ["{fx.k3}", "{out}/out.gguf", "--policy", "q8_0"]),
    "quantize": ("kimi-quantize", ["--policy", "q8_0", "{fx.k3_gguf}", "{out}/out.gguf"]),
    "quantize-split": ("kimi-quantize", ["--policy", "q8_0", "{fx.k3_gguf}", "{out}/out.gguf", "--split-max-size",
                                         "1M"]),
    "quantize-imatrix": ("kimi-quantize", ["--policy", "{fx.policy}", "--imatrix", "{fx.imatrix_gguf}",
                                           "{fx.k3_gguf}", "{out}/out.gguf"]),
    "slice": ("kimi-verify", ["slice", "{fx.k3}", "{out}/sliced", "--layers", "2"]),
}


def _write_imatrices(fx: Fixtures) -> None:
    from kimi_convert.fixtures.imatrix import k3_entries, write_dat, write_gguf_imatrix
    from kimi_convert.gguf_io import open_gguf
    shapes = {n: t.shape for n, t in open_gguf(fx.k3_gguf).tensors.items()}
    entries = k3_entries(shapes)
    write_gguf_imatrix(fx.imatrix_gguf, entries)
    write_dat(fx.imatrix_dat, [(n, 4, (s * 4 / c.sum()).reshape(-1)) for n, (s, c) in entries.items()])


def output_digest(folder: Path) -> dict:
    """What a run left in `folder`: every entry, with the SHA-256 of each GGUF (other files by name: a manifest
    names its inputs by their paths, which differ from run to run)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        if p.is_file() and (p.suffix in (".gguf", ".safetensors")):
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = None
    return out


def listing(folder: Path) -> set:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")} if folder.exists() else set()


def gguf_layout(path: Path) -> dict:
    """Byte offsets of the header counts, of each key-value field and of each tensor info of a good file."""
    from gguf import GGUFReader
    r = GGUFReader(path)
    kvs = []
    for name, f in r.fields.items():
        if name.startswith("GGUF."):             # gguf-py lists the header as pseudo-fields
            continue
        key_len = len(name.encode())
        kvs.append({"name": name, "offset": int(f.offset), "key_len": key_len, "type": int(f.types[0]),
                    "value_at": int(f.offset) + 8 + key_len + 4})
    tensors = []
    for t in r.tensors:
        off, name_len, n_dims = int(t.field.offset), len(t.name.encode()), len(t.shape)
        tensors.append({"name": t.name, "offset": off, "name_len": name_len, "n_dims": n_dims,
                        "dims_at": off + 8 + name_len + 4, "type_at": off + 12 + name_len + 8 * n_dims,
                        "data_offset_at": off + 16 + name_len + 8 * n_dims, "data_offset": int(t.data_offset)})
    return {"kvs": kvs, "tensors": tensors, "size": path.stat().st_size, "data_start": int(r.data_offset)}


# ================================================================================== running one command

APPS: dict = {}


def load_apps() -> None:
    """Import everything a command imports, once, and warm what is lazy (typer's parameter adapters, numba's
    kernels), so that each forked run starts warm."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    import kimi_convert.convert.checkpoint  # noqa: F401
    import kimi_convert.convert.converter  # noqa: F401
    import kimi_convert.quant.driver  # noqa: F401
    import kimi_convert.quant.imatrix  # noqa: F401
    import kimi_convert.verify.slice  # noqa: F401
    import kimi_convert.verify.check  # noqa: F401
    import kimi_convert.convert.vocab  # noqa: F401
    from gguf import GGMLQuantizationType as QT
    import kimi_convert.imatrix.job  # noqa: F401
    from kimi_convert.cli import common, convert as convert_cli, quantize as quantize_cli, verify as verify_cli
    from kimi_convert.cli import imatrix as imatrix_cli
    from kimi_convert.quant.blocks import load_kernels
    APPS.update({"kimi-convert": convert_cli.convert_app, "kimi-quantize": quantize_cli.app, "kimi-verify": verify_cli.app,
                 "kimi-imatrix": imatrix_cli.app})
    for prog, app in APPS.items():
        with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
            try:
                common.run_app(app, prog, ["--bogus-option-to-load-the-parser"])
            except SystemExit:
                pass
    targets = [getattr(QT, t) for t in QUANT_TYPES]
    load_kernels((src, t, w) for src in (QT.BF16, QT.F32) for t in targets for w in (False, True))
    try:
        import torch
        torch.set_num_threads(1)             # no intra-op pool in a process that forks
    except ImportError:
        pass


@dataclass
class Outcome:
    code: int                 # exit status; -N for death by signal N
    out: str
    err: str
    fallback: str | None      # cli.Defence.fallback of the child
    seconds: float
    rss_growth: int           # peak RSS of the child above the fork point, bytes
    timed_out: bool = False
    signalled: int | None = None      # the signal the campaign sent, if it did


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def drop_dac_capabilities() -> None:
    """As root, lose CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, so that file permissions apply to this process."""
    libc = ctypes.CDLL(None, use_errno=True)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]
    header, data = Header(0x20080522, 0), (Data * 2)()          # _LINUX_CAPABILITY_VERSION_3
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    keep = ~((1 << 1) | (1 << 2)) & 0xFFFFFFFF                  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
    data[0].effective &= keep
    data[0].permitted &= keep
    data[0].inheritable &= keep
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


INTERRUPTS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def _child(prog: str, args: list, cwd: Path, unprivileged: bool, mask) -> None:
    """In the fork: the command as its entry point runs it, stdout and stderr into files. Never returns.
    The campaign's signals are blocked until the command starts (spawn blocks them around fork()), so that one
    that comes early finds the command, not this harness."""
    code = 1
    try:
        os.chdir(cwd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            f = os.open(cwd / f".campaign.{name}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        resource.setrlimit(resource.RLIMIT_AS, (_vm_size() + AS_HEADROOM, resource.RLIM_INFINITY))
        for s in INTERRUPTS:
            signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
        if unprivileged and os.geteuid() == 0:
            drop_dac_capabilities()
        from kimi_convert.cli.common import Defence, run_app
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            run_app(APPS[prog], prog, [str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except KeyboardInterrupt as e:
            if not _inside_the_command(e):      # the harness's window before run_app: as if killed by SIGINT
                code = 130
            else:
                raise
        with open(cwd / ".campaign.status", "w") as f:
            f.write(json.dumps({"fallback": Defence.fallback}))
    except BaseException:               # what the interpreter would print for an exception nobody caught
        traceback.print_exc()
        code = 130 if isinstance(sys.exc_info()[1], KeyboardInterrupt) else 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _inside_the_command(e: BaseException) -> bool:
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "run_app":
            return True
        tb = tb.tb_next
    return False


def spawn(prog: str, args: list, cwd: Path, *, timeout: float = 60, send: tuple | None = None,
          unprivileged: bool = False) -> Outcome:
    """Run `prog args` in a forked child in `cwd`; `send` = (signal, delay): send it after delay seconds."""
    for name in ("stdout", "stderr", "status"):
        (cwd / f".campaign.{name}").unlink(missing_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    base_rss = _rss()
    started = time.monotonic()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, INTERRUPTS)
    pid = os.fork()
    if pid == 0:
        _child(prog, args, cwd, unprivileged, mask)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    pidfd = os.pidfd_open(pid)
    timed_out, sent = False, None
    try:
        while True:
            now = time.monotonic() - started
            wait = timeout - now
            if send is not None and sent is None:
                wait = min(wait, send[1] - now)
            ready, _, _ = select.select([pidfd], [], [], max(wait, 0))
            if ready:
                break
            now = time.monotonic() - started
            if send is not None and sent is None and now >= send[1]:
                os.kill(pid, send[0])
                sent = send[0]
            elif now >= timeout:
                os.kill(pid, signal.SIGKILL)
                timed_out = True
                break
        _, status, usage = os.wait4(pid, 0)
    finally:
        os.close(pidfd)
    seconds = time.monotonic() - started

    def read(name: str) -> str:
        p = cwd / f".campaign.{name}"
        text = p.read_text(errors="replace") if p.exists() else ""
        p.unlink(missing_ok=True)
        return text
    status_text = read("status")
    fallback = json.loads(status_text)["fallback"] if status_text else None
    return Outcome(os.waitstatus_to_exitcode(status), read("stdout"), read("stderr"), fallback, seconds,
                   usage.ru_maxrss * 1024 - base_rss, timed_out, sent)


# ================================================================================== cases

@dataclass
class Case:
    cls: str                   # the fault class
    what: str                  # the fault, in words
    prog: str
    args: list
    expect: str                # "ok" (reference equal), "ok-any" (exit 0), "bad", "either"
    ref: str | None = None     # REFERENCES name an "ok" run's output folder must equal
    send: tuple | None = None  # (signal, delay s)
    rerun: list | None = None  # after `send`: the run that must then succeed and equal `ref`
    unprivileged: bool = False
    intact: list = field(default_factory=list)     # inputs whose bytes the run must leave as they were


@dataclass
class Ctx:
    rng: random.Random
    fx: Fixtures
    run: Path                  # this run's folder: inputs under in/, outputs under out/

    @property
    def inp(self) -> Path:
        return self.run / "in"

    @property
    def out(self) -> Path:
        return self.run / "out"

    def copy_ckpt(self, src: Path, name: str = "ckpt") -> Path:
        """A copy of a fixture checkpoint whose files are hard links (a case replaces what it damages)."""
        dst = self.inp / name
        dst.mkdir(parents=True)
        for p in src.iterdir():
            os.link(p, dst / p.name)
        return dst

    def private(self, path: Path) -> Path:
        """`path` (a hard link) made a file of its own, so that changing it leaves the fixture alone."""
        data = path.read_bytes()
        path.unlink()
        path.write_bytes(data)
        return path

    def copy_file(self, src: Path, name: str) -> Path:
        dst = self.inp / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        return dst


def shards(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


def read_shard(path: Path) -> tuple[int, bytes, bytes]:
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return n, data[8:8 + n], data[8 + n:]


# ---------------------------------------------------------------------------------- safetensors headers

def safetensors_refuses(path: Path) -> bool:
    """The safetensors library is the reference: a header it refuses, we refuse."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="numpy"):
            return False
    except Exception:        # noqa: BLE001 - its errors are SafetensorError, OSError, ValueError, ...
        return True


def case_safetensors_header(c: Ctx) -> Case:
    rng = c.rng
    d = c.copy_ckpt(c.fx.k3)
    shard = c.private(rng.choice(shards(d)))
    n, head, body = read_shard(shard)
    header = json.loads(head)
    names = [k for k in header if k != "__metadata__"]
    name = rng.choice(names)
    entry = header[name]
    a, b = entry["data_offsets"]
    kind = rng.choice(["offsets", "offsets", "shape", "shape", "dtype", "entry", "metadata", "raw", "raw", "raw"])
    what = kind
    if kind == "offsets":
        ordered = sorted(names, key=lambda k: header[k]["data_offsets"][0])
        prev = ordered[max(0, ordered.index(name) - 1)]
        choice = rng.choice(["null", "swap", "grow", "shrink", "overlap", "beyond", "negative", "float", "string",
                             "three", "huge"])
        entry["data_offsets"] = {
            "null": None, "swap": [b, a], "grow": [a, b + 1], "shrink": [a, max(a, b - 1)],
            "overlap": [header[prev]["data_offsets"][0], header[prev]["data_offsets"][0] + (b - a)],
            "beyond": [a, len(body) + 4096], "negative": [-8, b], "float": [float(a), float(b)],
            "string": [str(a), str(b)], "three": [a, b, b], "huge": [a, 2**64 + b]}[choice]
        what = f"data_offsets {choice}"
    elif kind == "shape":
        shape = list(entry["shape"])
        choice = rng.choice(["negative", "string", "float", "huge", "extra-1", "drop", "null", "empty", "bool"])
        i = rng.randrange(len(shape)) if shape else 0
        entry["shape"] = {
            "negative": [-x if k == i else x for k, x in enumerate(shape)],
            "string": [str(x) for x in shape], "float": [x + 0.5 if k == i else x for k, x in enumerate(shape)],
            "huge": [2**40, 2**40, *shape], "extra-1": [1, *shape], "drop": shape[1:], "null": None, "empty": [],
            "bool": [True for _ in shape]}[choice]
        what = f"shape {choice}"
    elif kind == "dtype":
        choice = rng.choice(["unknown", "lowercase", "F16", "F32", "U8", "null", "F8_E4M3"])
        entry["dtype"] = {"unknown": "Q4", "lowercase": entry["dtype"].lower(), "null": None}.get(choice, choice)
        what = f"dtype {choice}"
    elif kind == "entry":
        choice = rng.choice(["removed", "renamed", "duplicated", "extra-key"])
        if choice == "removed":
            del header[name]
        elif choice == "renamed":
            header[name + ".x"] = header.pop(name)
        elif choice == "extra-key":
            entry["extra"] = 1
        what = f"entry {choice}"
        if choice == "duplicated":
            raw = json.dumps(header).encode()
            dup = json.dumps({name: entry})[1:-1].encode()
            raw = raw[:-1] + b", " + dup + b"}"
            return _shard_case(c, d, shard, raw, body, "entry duplicated (a key twice in the JSON)")
    elif kind == "metadata":
        choice = rng.choice(["number", "null", "list", "nested"])
        header["__metadata__"] = {"number": {"format": 1}, "null": None, "list": ["pt"],
                                  "nested": {"format": {"x": "pt"}}}[choice]
        what = f"__metadata__ {choice}"
    if kind != "raw":
        return _shard_case(c, d, shard, json.dumps(header).encode(), body, what)
    choice = rng.choice(["len-1", "len+1", "len-8", "len+8", "len0", "len-huge", "len-past-end", "not-utf8",
                         "json-cut", "top-list", "trailing-garbage", "data-cut", "leading-space", "file-cut-in-len"])
    raw, data = head, body
    if choice == "not-utf8":
        i = rng.randrange(len(raw))
        raw = raw[:i] + b"\xff" + raw[i + 1:]
    elif choice == "json-cut":
        raw = raw[:rng.randrange(1, len(raw))]
    elif choice == "top-list":
        raw = b"[" + raw + b"]"
    elif choice == "trailing-garbage":
        data = body + bytes(rng.randrange(1, 64))
    elif choice == "data-cut":
        data = body[:rng.randrange(len(body))]
    elif choice == "leading-space":
        raw = b" " + raw
    length = {"len-1": n - 1, "len+1": n + 1, "len-8": n - 8, "len+8": n + 8, "len0": 0, "len-huge": 2**63,
              "len-past-end": n + len(body) + 100}.get(choice)
    if length is not None:                  # the header as it was, behind a wrong length
        blob = struct.pack("<Q", length) + head + body
    else:
        blob = struct.pack("<Q", len(raw)) + raw + data
    if choice == "file-cut-in-len":
        blob = blob[:rng.randrange(1, 8)]
    shard.write_bytes(blob)
    return Case("safetensors header", f"{shard.name}: {choice}", "kimi-convert", [d, c.out / "out.gguf"],
                "bad" if safetensors_refuses(shard) else "either")


def _shard_case(c: Ctx, d: Path, shard: Path, raw: bytes, body: bytes, what: str) -> Case:
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw + body)
    return Case("safetensors header", f"{shard.name}: {what}", "kimi-convert", [d, c.out / "out.gguf"],
                "bad" if safetensors_refuses(shard) else "either")


# ---------------------------------------------------------------------------------- checkpoint-level faults

COUNT_KEYS = ("num_hidden_layers", "num_attention_heads", "hidden_size", "num_key_value_heads", "vocab_size",
              "moe_intermediate_size", "num_experts", "num_experts_per_token", "kv_lora_rank", "qk_nope_head_dim",
              "qk_rope_head_dim", "v_head_dim", "intermediate_size", "num_shared_experts", "attn_res_block_size")
COUNT0_KEYS = ("routed_expert_hidden_size", "first_k_dense_replace", "q_lora_rank")
POSITIVE_KEYS = ("rms_norm_eps", "routed_scaling_factor", "activation_situ_beta")
LAC_COUNT_KEYS = ("num_heads", "head_dim", "short_conv_kernel_size")
# values that no key of the kind accepts (a count is a positive integer below 2^31, ...)
BAD_COUNT = [None, "4", 9.5, float("nan"), -1, 0, True, 2**64, 2**31, [], {}]
BAD_COUNT0 = [None, "4", 9.5, float("nan"), -1, True, 2**64, []]
BAD_POSITIVE = [None, "1e-5", float("nan"), float("inf"), float("-inf"), True, [], 0, -1.0, 1e39]
BAD_LAYERS = [None, "1,2", [0], [99], [1.5], [4, 4], {}, [True]]


def case_config(c: Ctx) -> Case:
    rng = c.rng
    arch = rng.choice(["k3", "k3", "k31"])
    d = c.copy_ckpt(c.fx.k3 if arch == "k3" else c.fx.k31)
    p = c.private(d / "config.json")
    cfg = json.loads(p.read_text())
    tc = cfg["text_config"]
    kind = rng.choice(["count", "count", "count0", "positive", "lac", "layers", "flag", "document", "document",
                       "dsa"] if arch == "k31" else ["count", "count", "count0", "positive", "lac", "layers", "flag",
                                                      "document", "document"])
    if kind == "document":
        choice = rng.choice(["null", "list", "string", "invalid-json", "not-utf8", "no-text_config",
                             "text_config-null", "nested-deep", "empty", "huge-int"])
        text = {"null": "null", "list": "[]", "string": '"config"', "invalid-json": p.read_text()[:-20],
                "no-text_config": json.dumps({k: v for k, v in cfg.items() if k != "text_config"}),
                "text_config-null": json.dumps({**cfg, "text_config": None}), "nested-deep": "[" * 100000,
                "empty": "", "huge-int": p.read_text().replace('"vocab_size": ', '"vocab_size": ' + "9" * 5000, 1)
                }.get(choice)
        if choice == "not-utf8":
            p.write_bytes(p.read_bytes().replace(b'"dtype"', b'"\xff\xfetype"', 1))
        else:
            p.write_text(text)
        return Case("config", f"config.json: {choice}", "kimi-convert", [d, c.out / "out.gguf"], "bad")
    if kind == "count":
        key, value, where = rng.choice(COUNT_KEYS), rng.choice(BAD_COUNT), tc
    elif kind == "count0":
        key, value, where = rng.choice(COUNT0_KEYS), rng.choice(BAD_COUNT0), tc
    elif kind == "positive":
        key, value, where = rng.choice(POSITIVE_KEYS), rng.choice(BAD_POSITIVE), tc
    elif kind == "lac":
        key, value, where = rng.choice(LAC_COUNT_KEYS), rng.choice(BAD_COUNT), tc["linear_attn_config"]
    elif kind == "layers":
        key, value, where = rng.choice(["full_attn_layers", "kda_layers"]), rng.choice(BAD_LAYERS), \
            tc["linear_attn_config"]
    elif kind == "flag":
        key, where = rng.choice(["moe_renormalize", "mla_use_nope"]), tc
        value = rng.choice({"moe_renormalize": ["true", 1, None], "mla_use_nope": [False, None, 1]}[key])
    else:
        dsa = tc["dsa_config"]
        key = rng.choice(sorted(dsa))
        value, where = rng.choice(BAD_LAYERS if key == "layers" else BAD_COUNT), dsa
    where[key] = value
    p.write_text(json.dumps(cfg))           # NaN and Infinity as config.json writers spell them
    return Case("config", f"config.json: {key} = {json.dumps(value)[:30]}", "kimi-convert",
                [d, c.out / "out.gguf"], "bad")


def case_checkpoint(c: Ctx) -> Case:
    rng = c.rng
    d = c.copy_ckpt(c.fx.k3)
    shard = rng.choice(shards(d))
    index = d / "model.safetensors.index.json"
    kind = rng.choice(["missing-shard", "shard-folder", "shard-fifo", "dangling-symlink", "hf-cache-symlinks",
                       "unreadable-shard", "unreadable-config", "unreadable-folder", "shard-cut", "index",
                       "index", "index", "no-index", "index-fifo", "config-fifo", "config-folder", "no-config"])
    expect, unprivileged, ref = "bad", False, None
    if kind == "missing-shard":
        shard.unlink()
    elif kind == "shard-folder":
        shard.unlink()
        shard.mkdir()
    elif kind == "shard-fifo":
        shard.unlink()
        os.mkfifo(shard)
    elif kind == "dangling-symlink":
        shard.unlink()
        shard.symlink_to(d / "gone.safetensors")
    elif kind == "hf-cache-symlinks":          # snapshots/REV/x -> ../../blobs/SHA, as the hub cache lays it out
        repo = c.inp / "hub"
        # the revision folder is named as the fixture is: general.name is the checkpoint folder's name
        blobs, snap = repo / "blobs", repo / "snapshots" / c.fx.k3.name
        blobs.mkdir(parents=True)
        snap.mkdir(parents=True)
        for p in d.iterdir():
            blob = blobs / hashlib.sha256(p.name.encode()).hexdigest()
            os.link(p, blob)
            (snap / p.name).symlink_to(Path("../../blobs") / blob.name)
        d, expect, ref = snap, "ok", "convert"
    elif kind == "unreadable-shard":
        c.private(shard).chmod(0)
        unprivileged = True
    elif kind == "unreadable-config":
        c.private(d / "config.json").chmod(0)
        unprivileged = True
    elif kind == "unreadable-folder":
        d.chmod(0o300)                          # can enter, cannot list
        unprivileged, expect = True, "either"   # a checkpoint is read by name: listing is not needed
    elif kind == "shard-cut":
        c.private(shard)
        data = shard.read_bytes()
        shard.write_bytes(data[:rng.randrange(len(data))])
    elif kind == "index":
        return _index_case(c, d, index)
    elif kind == "no-index":
        index.unlink()
    elif kind == "index-fifo":
        index.unlink()
        os.mkfifo(index)
    elif kind == "config-fifo":
        (d / "config.json").unlink()
        os.mkfifo(d / "config.json")
    elif kind == "config-folder":
        (d / "config.json").unlink()
        (d / "config.json").mkdir()
    elif kind == "no-config":
        (d / "config.json").unlink()
    return Case("checkpoint", f"{kind} ({shard.name})" if "shard" in kind else kind, "kimi-convert",
                [d, c.out / "out.gguf"], expect, ref=ref, unprivileged=unprivileged)


def _index_case(c: Ctx, d: Path, index: Path) -> Case:
    rng = c.rng
    c.private(index)
    idx = json.loads(index.read_text())
    wm = idx["weight_map"]
    name = rng.choice(sorted(wm))
    choice = rng.choice(["invalid-json", "null", "no-weight_map", "weight_map-list", "unknown-shard", "dotdot",
                         "absolute", "subfolder", "tensor-removed", "tensor-extra", "value-number", "empty-name",
                         "backslash"])
    expect = "bad"
    if choice == "invalid-json":
        index.write_text(index.read_text()[:-10])
        return Case("checkpoint", "index: invalid-json", "kimi-convert", [d, c.out / "out.gguf"], "bad")
    if choice == "null":
        idx = None
    elif choice == "no-weight_map":
        del idx["weight_map"]
    elif choice == "weight_map-list":
        idx["weight_map"] = list(wm.items())
    elif choice == "unknown-shard":
        wm[name] = "model-99999-of-000005.safetensors"
    elif choice == "dotdot":
        wm[name] = "../" + d.name + "/" + wm[name]
    elif choice == "absolute":
        wm[name] = str(d / wm[name])
    elif choice == "subfolder":
        wm[name] = "sub/" + wm[name]
    elif choice == "tensor-removed":
        del wm[name]
        expect = "either" if any(v in name for v in ("vision_tower", "mm_projector")) else "bad"
    elif choice == "tensor-extra":
        wm["model.layers.0.extra.weight"] = wm[name]
    elif choice == "value-number":
        wm[name] = 5
    elif choice == "empty-name":
        wm[name] = ""
    elif choice == "backslash":
        wm[name] = "..\\" + wm[name]
    index.write_text(json.dumps(idx))
    return Case("checkpoint", f"index: {choice} ({name})", "kimi-convert", [d, c.out / "out.gguf"], expect)


# ---------------------------------------------------------------------------------- GGUF files

def case_gguf(c: Ctx) -> Case:
    rng = c.rng
    lay = c.fx.gguf_layout
    bad = c.copy_file(c.fx.k3_gguf, "bad.gguf")
    data = bytearray(bad.read_bytes())

    def put(at: int, fmt: str, value: int) -> None:
        data[at:at + struct.calcsize(fmt)] = struct.pack(fmt, value)
    kvs, tensors = lay["kvs"], lay["tensors"]
    kv, t = rng.choice(kvs), rng.choice(tensors)
    kind = rng.choice(["magic", "version", "n_tensors", "n_kv", "key-len", "key-utf8", "value-type", "string-len",
                       "array-len", "array-type", "duplicate-key", "tensor-name-len", "n-dims", "dim", "tensor-type",
                       "tensor-offset", "duplicate-tensor", "truncate", "truncate", "flip-header", "flip-header",
                       "flip-data", "append"])
    expect = "bad"
    if kind == "magic":
        data[0:4] = rng.choice([b"GGUG", b"\0\0\0\0", b"FUGG"])
    elif kind == "version":
        put(4, "<I", rng.choice([0, 1, 4, 99, 2**32 - 1]))
    elif kind == "n_tensors":
        put(8, "<Q", rng.choice([0, len(tensors) + 1, 2**32, 2**60, 2**64 - 1]))
        expect = "bad"
    elif kind == "n_kv":
        put(16, "<Q", rng.choice([len(kvs) + 1, 2**32, 2**63, 2**64 - 1]))
    elif kind == "key-len":
        put(kv["offset"], "<Q", rng.choice([0, kv["key_len"] + 1, 2**32, 2**63]))
    elif kind == "key-utf8":
        data[kv["offset"] + 8] = 0xFF
    elif kind == "value-type":
        put(kv["value_at"] - 4, "<I", rng.choice([13, 99, 2**31]))
    elif kind == "string-len":
        strings = [k for k in kvs if k["type"] == 8]
        kv = rng.choice(strings)
        put(kv["value_at"], "<Q", rng.choice([2**32, 2**63, lay["size"]]))
    elif kind == "array-len":
        arrays = [k for k in kvs if k["type"] == 9]
        kv = rng.choice(arrays)
        put(kv["value_at"] + 4, "<Q", rng.choice([2**32, 2**40, 2**63]))
    elif kind == "array-type":
        arrays = [k for k in kvs if k["type"] == 9]
        kv = rng.choice(arrays)
        put(kv["value_at"], "<I", rng.choice([9, 13, 99]))       # an array of arrays, or no type at all
    elif kind == "duplicate-key":
        by_len: dict = {}
        for k in kvs:
            by_len.setdefault(k["key_len"], []).append(k)
        twins = rng.choice([v for v in by_len.values() if len(v) >= 2])
        a, b = rng.sample(twins, 2)
        data[b["offset"] + 8:b["offset"] + 8 + b["key_len"]] = a["name"].encode()
        kind = f"duplicate-key {a['name']}"
    elif kind == "tensor-name-len":
        put(t["offset"], "<Q", rng.choice([0, 2**32, 2**63]))
    elif kind == "n-dims":
        put(t["dims_at"] - 4, "<I", rng.choice([0, 5, 2**31]))
    elif kind == "dim":
        i = rng.randrange(t["n_dims"])
        put(t["dims_at"] + 8 * i, "<Q", rng.choice([0, 3, 2**31, 2**63, 2**64 - 1]))
    elif kind == "tensor-type":
        put(t["type_at"], "<I", rng.choice([4, 5, 13, 99, 2**31]))   # removed Q4_2 / Q4_3, and none at all
    elif kind == "tensor-offset":
        put(t["data_offset_at"], "<Q", rng.choice([t["data_offset"] + 1, t["data_offset"] + 16, 2**40,
                                                   max(0, t["data_offset"] - 32)]))
    elif kind == "duplicate-tensor":
        same = [u for u in tensors if u["name_len"] == t["name_len"] and u["name"] != t["name"]]
        if not same:
            return case_gguf(c)
        u = rng.choice(same)
        data[u["offset"] + 8:u["offset"] + 8 + u["name_len"]] = t["name"].encode()
        kind = f"duplicate-tensor {t['name']}"
    elif kind == "truncate":
        data = data[:rng.randrange(lay["size"])]
    elif kind == "flip-header":
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(lay["data_start"])] ^= rng.randint(1, 255)
        expect = "either"
    elif kind == "flip-data":
        for _ in range(rng.randint(1, 16)):
            data[rng.randrange(lay["data_start"], lay["size"])] ^= rng.randint(1, 255)
        expect = "either"
    elif kind == "append":
        data += bytes(rng.randrange(1, 4096))
        expect = "either"
    bad.write_bytes(bytes(data))
    about_kv = kind.startswith(("key", "duplicate-key", "value", "string", "array"))
    what = f"{kind} ({kv['name'] if about_kv else t['name']})"
    mode = rng.choice(["verify", "verify", "quantize", "quantize", "verify-hf"])
    if mode == "verify":
        return Case("gguf", what, "kimi-verify", ["check", bad, "--length", "4"], expect)
    if mode == "verify-hf":
        return Case("gguf", what, "kimi-verify", ["check", c.fx.k3, bad, "--length", "4"], expect)
    return Case("gguf", what, "kimi-quantize", ["--policy", "q8_0", bad, c.out / "out.gguf"], expect)


# ---------------------------------------------------------------------------------- policies and imatrices

TYPE_SPELLINGS = [*QUANT_TYPES, "keep", "q4_k", " Q8_0 "]
BAD_POLICIES = {
    "unknown type": 'default = "Q9_K"\n',
    "bad regex": 'default = "Q8_0"\n[[rules]]\npattern = "attn_("\ntype = "Q4_K"\n',
    "huge repetition": 'default = "Q8_0"\n[[rules]]\npattern = "a{4294967296}"\ntype = "Q4_K"\n',
    "deep groups": 'default = "Q8_0"\n[[rules]]\npattern = "' + "(" * 600 + ")" * 600 + '"\ntype = "Q4_K"\n',
    "unknown key": 'default = "Q8_0"\nrule = 1\n',
    "no default": '[[rules]]\npattern = "x"\ntype = "Q8_0"\n',
    "syntax": 'default = Q8_0\n',
    "rules not tables": 'default = "Q8_0"\nrules = [1, 2]\n',
    "type not a string": 'default = 8\n',
    "unknown requirement": 'default = "Q8_0"\nrequires = ["gpu"]\n',
    "requires imatrix": 'default = "Q4_K"\nrequires = ["imatrix"]\n',
}
BAD_TOKENS = ["=Q4_K", "attn", "attn_(=Q4_K", "a{4294967296}=Q8_0", "attn=Q9_K", "attn=", "(" * 600 + ")" * 600 + "=F16"]


def _random_policy(rng: random.Random) -> str:
    lines = [f'default = "{rng.choice(TYPE_SPELLINGS[:-1])}"']
    for _ in range(rng.randint(0, 3)):
        pattern = rng.choice(["attn_", "ffn_(up|down)_exps", r"^blk\\.0\\.", "token_embd", "norm", "exps", "output"])
        lines += ["", "[[rules]]", f'pattern = "{pattern}"', f'type = "{rng.choice(TYPE_SPELLINGS)}"']
    return "\n".join(lines) + "\n"


def case_policy(c: Ctx) -> Case:
    rng = c.rng
    out = c.out / "out.gguf"
    src = c.fx.k3_gguf
    kind = rng.choice(["valid", "mutated", "mutated", "known-bad", "known-bad", "file-kind", "token", "token",
                       "token-file", "imatrix-valid", "imatrix-damaged", "imatrix-damaged", "imatrix-kind"])
    pol = c.inp / "policy.toml"
    pol.parent.mkdir(parents=True, exist_ok=True)
    args = ["--policy", pol, src, out]
    if kind == "valid":
        pol.write_text(_random_policy(rng))
        return Case("policy", "a valid policy", "kimi-quantize", args, "ok-any")
    if kind == "mutated":
        text = bytearray(_random_policy(rng).encode())
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(text) + 1)
            op = rng.choice(["insert", "delete", "replace"])
            piece = rng.choice([b'"', b"=", b"[", b"]", b"\n", b"#", b"\\", b"\xff", b"{", b"'''", b"\x00"])
            text[i:i + (0 if op == "insert" else 1)] = b"" if op == "delete" else piece
        pol.write_bytes(bytes(text))
        return Case("policy", "a mutated policy", "kimi-quantize", args, "either")
    if kind == "known-bad":
        name = rng.choice(sorted(BAD_POLICIES))
        pol.write_text(BAD_POLICIES[name])
        return Case("policy", f"policy: {name}", "kimi-quantize", args, "bad")
    if kind == "file-kind":
        choice = rng.choice(["fifo", "folder", "missing", "binary", "empty", "not-utf8"])
        if choice == "fifo":
            os.mkfifo(pol)
        elif choice == "folder":
            pol.mkdir()
        elif choice == "binary":
            shutil.copyfile(src, pol)
        elif choice == "empty":
            pol.write_text("")
        elif choice == "not-utf8":
            pol.write_bytes(b'default = "Q8_0"\ndescription = "\xff\xfe"\n')
        return Case("policy", f"policy file: {choice}", "kimi-quantize", args, "bad")
    if kind in ("token", "token-file"):
        good = f"{rng.choice(['attn_', 'ffn_up', 'output', 'BLK'])}={rng.choice(TYPE_SPELLINGS)}"
        bad = rng.choice(BAD_TOKENS)
        token = rng.choice([good, bad, bad])
        if kind == "token":
            return Case("policy", f"--tensor-type {token[:40]}", "kimi-quantize",
                        ["--policy", "q8_0", "--tensor-type", token, src, out], "ok-any" if token == good else "bad")
        f = c.inp / "types.txt"
        choice = rng.choice(["tokens", "fifo", "folder", "not-utf8"])
        if choice == "tokens":
            f.write_text(f"{good}\n{token}\n")
        elif choice == "fifo":
            os.mkfifo(f)
        elif choice == "folder":
            f.mkdir()
        else:
            f.write_bytes(b"attn=Q8_0 \xff=Q4_K\n")
        expect = "ok-any" if choice == "tokens" and token == good else "bad"
        return Case("policy", f"--tensor-type-file {choice}", "kimi-quantize",
                    ["--policy", "q8_0", "--tensor-type-file", f, src, out], expect)
    im_args = ["--policy", c.fx.policy, "--imatrix"]
    if kind == "imatrix-valid":
        fmt = rng.choice(["gguf", "dat"])
        im = c.fx.imatrix_gguf if fmt == "gguf" else c.fx.imatrix_dat
        return (Case("imatrix", "the reference GGUF imatrix", "kimi-quantize", [*im_args, im, src, out], "ok",
                     ref="quantize-imatrix") if fmt == "gguf" else
                Case("imatrix", "a valid .dat imatrix", "kimi-quantize", [*im_args, im, src, out], "ok-any"))
    if kind == "imatrix-kind":
        im = c.inp / "im.dat"
        choice = rng.choice(["fifo", "folder", "missing", "empty", "the model"])
        if choice == "fifo":
            os.mkfifo(im)
        elif choice == "folder":
            im.mkdir()
        elif choice == "empty":
            im.write_bytes(b"")
        elif choice == "the model":
            im = src
        return Case("imatrix", f"imatrix: {choice}", "kimi-quantize", [*im_args, im, src, out], "bad")
    fmt = rng.choice(["gguf", "dat"])
    im = c.copy_file(c.fx.imatrix_gguf if fmt == "gguf" else c.fx.imatrix_dat, f"im.{fmt}")
    data = bytearray(im.read_bytes())
    choice = rng.choice(["cut", "flip", "int", "int", "nan"])
    if choice == "cut":
        data = data[:rng.randrange(len(data))]
    elif choice == "flip":
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(min(len(data), 2048))] ^= rng.randint(1, 255)
    elif choice == "int":
        at = rng.randrange(min(len(data), 1024) - 8)
        data[at:at + rng.choice([4, 8])] = struct.pack("<Q", rng.choice([0, 1, 2**31 - 1, 2**32, 2**63]))[
            :rng.choice([4, 8])]
    else:
        at = rng.randrange(len(data) // 2, len(data) - 4) & ~3
        data[at:at + 4] = struct.pack("<f", float("nan"))
    im.write_bytes(bytes(data))
    return Case("imatrix", f"{fmt} imatrix: {choice}", "kimi-quantize", [*im_args, im, src, out], "either")


# ---------------------------------------------------------------------------------- options and outputs

def case_options(c: Ctx) -> Case:
    rng = c.rng
    out = c.out / "out.gguf"
    k3, gguf = c.fx.k3, c.fx.k3_gguf
    size = rng.choice(["-5G", "0", "garbage", "99999999999999999999T", "1e400G", "infG", "nanG", "", "10", "0.5M",
                       "5Gi", "5GBB", "--5G"])     # 5GB is 5G (kimi_convert.sizes); 5Gi is no unit
    table = [
        ("kimi-convert", [k3, out, f"--split-max-size={size}"], f"--split-max-size {size!r}"),
        ("kimi-quantize", ["--policy", "q8_0", gguf, out, f"--split-max-size={size}"], f"--split-max-size {size!r}"),
        ("kimi-convert", [k3, out, "--split-max-tensors", rng.choice(["-1", "-99", "x", "1.5", ""])],
         "--split-max-tensors"),
        ("kimi-convert", [k3, out, "--outtype", rng.choice(["q4", "", "BF16x", "f16"])], "--outtype"),
        ("kimi-convert", [k3, out, rng.choice(["--bogus", "-x", "--force=3"])], "unknown option"),
        ("kimi-convert", [k3], "missing OUT"),
        ("kimi-convert", [k3, out, "--imatrix", c.fx.imatrix_gguf], "--imatrix without --policy"),
        ("kimi-quantize", ["--policy", "q8_0", gguf, out, "--threads", rng.choice(["-1", "100000", "x", "2**70"])],
         "--threads"),
        ("kimi-quantize", ["--policy", "q8_0", gguf, out, "--keep-split", "--split-max-size", "5G"],
         "--keep-split with --split-max-size"),
        ("kimi-quantize", ["--policy", "q8_0", gguf], "no OUT"),
        ("kimi-quantize", ["--policy", "q8_0", gguf, gguf], "OUT is IN"),
        ("kimi-quantize", ["--policy", "q8_0", gguf, out, "--json", c.out / "no" / "r.json"], "--json into a missing folder"),
        ("kimi-quantize", ["--policy", "q8_0", gguf, "--dry-run", "--json", c.out], "--json a folder"),
        ("kimi-verify", ["check", gguf, "--seed", rng.choice(["-1", "x"])], "--seed"),
        ("kimi-verify", ["check", gguf, "--length", rng.choice(["0", "1", "-5", "100000000", "x"])], "--length"),
        ("kimi-verify", ["check", gguf, "--max-kl", rng.choice(["nan", "-1", "x"])], "--max-kl"),
        ("kimi-verify", ["check", k3, gguf, "--max-kl", rng.choice(["nan", "-1"]), "--length", "4"], "--max-kl"),
        ("kimi-verify", ["check", gguf, "--json", c.out / "no" / "r.json"], "--json into a missing folder"),
        ("kimi-verify", ["check", gguf, gguf, gguf], "three paths"),
        ("kimi-verify", ["check", k3, k3], "two folders"),
        ("kimi-verify", ["check"], "no path"),
        ("kimi-verify", [rng.choice(["chek", "--bogus", "slice"])], "bad subcommand"),
        ("kimi-verify", ["slice", k3, c.out / "s", "--layers", rng.choice(["0", "-1", "abc", "0-100", "3-1", ""])],
         "--layers"),
        ("kimi-verify", ["slice", k3, c.fx.k3_gguf, "--layers", "2"], "slice OUT_DIR is a file"),
        ("kimi-verify", ["slice", k3, k3, "--layers", "2", "--force"], "slice OUT_DIR is HF_DIR"),
        ("kimi-imatrix", [rng.choice([k3, gguf]), "-f", c.fx.calib, "-o", out, "--ctx",
                          rng.choice(["0", "8", "-1", "x", "2000000"])], "kimi-imatrix --ctx"),
        ("kimi-imatrix", [gguf, "-f", c.fx.calib, "-o", out, "--output-format", rng.choice(["xyz", "", "GGUF"])],
         "kimi-imatrix --output-format"),
        ("kimi-imatrix", [gguf, "-f", c.fx.calib, "-o", gguf, "--force"], "kimi-imatrix over its model"),
        ("kimi-imatrix", [k3, "-f", c.fx.calib, "-o", c.fx.calib, "--force"], "kimi-imatrix over its text"),
        ("kimi-imatrix", [gguf, "-f", c.fx.calib], "kimi-imatrix without -o"),
        ("kimi-imatrix", [gguf, "-f", c.out / "missing.txt", "-o", out], "kimi-imatrix text missing"),
        ("kimi-imatrix", [gguf, "-f", c.fx.calib, "-o", out, "--in-file", c.fx.k31_gguf], "--in-file not an imatrix"),
        ("kimi-imatrix", [gguf, "-f", c.fx.calib, "-o", out, "--ctx", "2048"], "kimi-imatrix text < 2 chunks"),
        ("kimi-imatrix", [c.fx.policy, "-f", c.fx.calib, "-o", out], "kimi-imatrix model not a GGUF"),
    ]
    prog, args, what = rng.choice(table)
    return Case("options", what, prog, args, "bad")


def case_outputs(c: Ctx) -> Case:
    rng = c.rng
    kind = rng.choice(["no-folder", "is-folder", "exists", "exists-split", "symlink-existing", "symlink-dangling",
                       "read-only-folder", "out-in-a-file"])
    prog = rng.choice(["kimi-convert", "kimi-quantize"])
    out = c.out / "out.gguf"
    expect = "bad"
    if kind == "no-folder":
        out = c.out / "missing" / "out.gguf"
    elif kind == "is-folder":
        out.mkdir()
    elif kind == "exists":
        out.write_bytes(b"precious")
    elif kind == "exists-split":            # one part of the split output is there already
        ref = "convert-split" if prog == "kimi-convert" else "quantize-split"
        parts = sorted(n for n in c.fx.refs[ref] if n.endswith(".gguf"))
        (c.out / parts[1]).write_bytes(b"precious")
        extra = ["--split-max-tensors", "40"] if prog == "kimi-convert" else ["--split-max-size", "1M"]
        return Case("outputs", kind, prog, _io(c, prog, out) + extra, "bad")
    elif kind == "symlink-existing":
        target = c.run / "elsewhere.gguf"
        target.write_bytes(b"precious")
        out.symlink_to(target)
    elif kind == "symlink-dangling":
        out.symlink_to(c.run / "nowhere.gguf")
        expect = "either"
    elif kind == "read-only-folder":
        c.out.chmod(0o555)
        return Case("outputs", kind, prog, _io(c, prog, out), "bad", unprivileged=True)
    elif kind == "out-in-a-file":
        (c.out / "file").write_bytes(b"x")
        out = c.out / "file" / "out.gguf"
    return Case("outputs", kind, prog, _io(c, prog, out), expect)


def _io(c: Ctx, prog: str, out: Path) -> list:
    return [c.fx.k3, out] if prog == "kimi-convert" else ["--policy", "q8_0", c.fx.k3_gguf, out]


# ---------------------------------------------------------------------------------- overlapping paths

def case_overlap(c: Ctx) -> Case:
    """An output, a report or a helper path that is (or leads to) a file the command reads, spelled as users
    mistype it: never written over, with --force or without (kimi_convert.paths). Inputs are private copies under
    out/, so that anything a refused run leaves beside them counts as left behind."""
    rng = c.rng
    force = ["--force"] if rng.random() < 0.7 else []
    hf = c.out / "ckpt"
    shutil.copytree(c.fx.k3, hf)
    files = sorted(p for p in hf.iterdir() if p.suffix in (".json", ".safetensors", ".model"))    # what is read
    src = Path(shutil.copyfile(c.fx.k3_gguf, c.out / "in.gguf"))
    pol = Path(shutil.copyfile(c.fx.policy, c.out / "policy.toml"))
    imatrix = Path(shutil.copyfile(c.fx.imatrix_gguf, c.out / "k3.imatrix.gguf"))
    kind = rng.choice(["convert-over-checkpoint", "convert-over-policy", "convert-lock", "quantize-over-input",
                       "quantize-json", "quantize-keep-split", "verify-json", "slice-into-source",
                       "link-to-input"])
    victim = rng.choice(files)
    intact = [*files, src, pol, imatrix]
    if kind == "convert-over-checkpoint":
        args = [hf, victim, *force] + (["--dry-run"] if rng.random() < 0.2 else [])
        return Case("overlap", f"kimi-convert into {victim.name}", "kimi-convert", args, "bad", intact=intact)
    if kind == "convert-over-policy":
        target, extra = rng.choice([(pol, ["--policy", pol]), (imatrix, ["--policy", pol, "--imatrix", imatrix])])
        return Case("overlap", f"kimi-convert --policy into {target.name}", "kimi-convert",
                    [hf, target, *extra, *force], "bad", intact=intact)
    if kind == "convert-lock":
        out = c.out / "out.gguf"
        lock = c.out / ".out.gguf.lock"
        lock.symlink_to(victim) if rng.random() < 0.5 else os.link(victim, lock)
        return Case("overlap", f"the lock file links to {victim.name}", "kimi-convert", [hf, out, *force], "bad",
                    intact=intact)
    if kind == "quantize-over-input":
        target = rng.choice([src, pol, imatrix])
        return Case("overlap", f"kimi-quantize into {target.name}", "kimi-quantize",
                    ["--policy", pol, "--imatrix", imatrix, src, target, *force], "bad", intact=intact)
    if kind == "quantize-json":
        out = c.out / "out.gguf"
        target = rng.choice([src, pol, imatrix, out, c.out / "out.gguf.manifest.json"])
        dry = ["--dry-run"] if rng.random() < 0.3 else []
        return Case("overlap", f"kimi-quantize --json {target.name}", "kimi-quantize",
                    ["--policy", pol, "--imatrix", imatrix, "--json", target, src, out, *dry, *force], "bad",
                    intact=intact)
    if kind == "quantize-keep-split":
        parts = [Path(shutil.copyfile(p, c.out / p.name)) for p in sorted(c.fx.split.glob("*.gguf"))]
        return Case("overlap", "kimi-quantize --keep-split into the split input's own names", "kimi-quantize",
                    ["--policy", "q8_0", "--keep-split", rng.choice(parts), c.out / "s.gguf", *force], "bad",
                    intact=[*intact, *parts])
    if kind == "verify-json":
        target, extra = rng.choice([(src, [src]), (victim, [hf, src])])
        return Case("overlap", f"kimi-verify check --json {target.name}", "kimi-verify",
                    ["check", *extra, "--json", target, "--length", "4", *force], "bad", intact=intact)
    if kind == "slice-into-source":
        out_dir = hf
        if rng.random() < 0.5:
            out_dir = c.out / "same"
            out_dir.symlink_to(hf)
        return Case("overlap", "kimi-verify slice into its own checkpoint", "kimi-verify",
                    ["slice", hf, out_dir, "--layers", "2", "--force"], "bad", intact=intact)
    out = c.out / "link.gguf"           # a link to an input: the rename replaces the link, the input stays
    out.symlink_to(victim) if rng.random() < 0.5 else os.link(victim, out)
    return Case("overlap", f"kimi-convert over a link to {victim.name}", "kimi-convert", [hf, out, "--force"],
                "ok-any", intact=intact)


# ---------------------------------------------------------------------------------- valid inputs and signals

VALID = [("convert", "kimi-convert", lambda c: [c.fx.k3, c.out / "out.gguf"]),
         ("convert-split", "kimi-convert", lambda c: [c.fx.k3, c.out / "out.gguf", "--split-max-tensors", "40"]),
         ("convert-k31", "kimi-convert", lambda c: [c.fx.k31, c.out / "out.gguf"]),
         ("convert-policy", "kimi-convert", lambda c: [c.fx.k3, c.out / "out.gguf", "--policy", "q8_0"]),
         ("quantize", "kimi-quantize", lambda c: ["--policy", "q8_0", c.fx.k3_gguf, c.out / "out.gguf"]),
         ("quantize-split", "kimi-quantize", lambda c: ["--policy", "q8_0", c.fx.k3_gguf, c.out / "out.gguf",
                                                         "--split-max-size", "1M"]),
         ("slice", "kimi-verify", lambda c: ["slice", c.fx.k3, c.out / "sliced", "--layers", "2"])]


def case_valid(c: Ctx) -> Case:
    rng = c.rng
    if rng.random() < 0.25:
        if rng.random() < 0.2:
            return Case("valid", "check HF_DIR FILE", "kimi-verify", ["check", c.fx.k3, c.fx.k3_gguf, "--length", "4"],
                        "ok-any")
        return Case("valid", "check FILE", "kimi-verify", ["check", rng.choice([c.fx.k3_gguf, c.fx.k31_gguf]),
                                                           "--length", "4"], "ok-any")
    ref, prog, args = rng.choice(VALID)
    return Case("valid", ref, prog, args(c), "ok", ref=ref)


def case_signal(c: Ctx) -> Case:
    rng = c.rng
    ref, prog, args = rng.choice(VALID)
    sig = rng.choice([signal.SIGINT, signal.SIGTERM, signal.SIGKILL, signal.SIGHUP])
    delay = rng.uniform(0.0, 1.2 * c.fx.seconds[ref])
    rerun = args(c) + ["--force"] + (["--resume"] if "split" in ref and rng.random() < 0.5 else [])
    return Case("signal", f"{signal.Signals(sig).name} at {delay:.2f} s into {ref}, then a rerun", prog, args(c),
                "ok", ref=ref, send=(sig, delay), rerun=rerun)


CLASSES: list[tuple[str, float, Callable[[Ctx], Case]]] = [
    ("valid", 0.08, case_valid), ("safetensors header", 0.20, case_safetensors_header),
    ("config", 0.10, case_config), ("checkpoint", 0.12, case_checkpoint), ("gguf", 0.20, case_gguf),
    ("policy/imatrix", 0.12, case_policy), ("options", 0.07, case_options), ("outputs", 0.04, case_outputs),
    ("overlap", 0.06, case_overlap), ("signal", 0.07, case_signal)]


def make_case(seed: int, index: int, fx: Fixtures, run: Path) -> Case:
    rng = random.Random(f"{seed}:{index}")
    _, _, make = rng.choices(CLASSES, weights=[w for _, w, _ in CLASSES])[0]
    c = Ctx(rng, fx, run)
    c.inp.mkdir(parents=True)
    c.out.mkdir()
    return make(c)


# ================================================================================== classification

KIMI_ERRORS: set = set()
ANSI = re.compile(r"\x1b\[[0-9;]*m")
REPORT_EXCEPTION = re.compile(r"^\s+([A-Z][A-Za-z_]*(?:Error|Exception|Warning|Interrupt)|StopIteration): ",
                              re.MULTILINE)


def kimi_error_names() -> set:
    from kimi_convert.errors import KimiError
    names, todo = set(), [KimiError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo += cls.__subclasses__()
    return names


def check_run(case: Case, r: Outcome, before: set, out: Path, fx: Fixtures, mem_bound: int,
              expect: str | None = None) -> list[str]:
    """The flags of one finished command."""
    expect = expect or case.expect
    flags = []
    if r.timed_out:
        return ["hang"]
    if r.rss_growth > mem_bound or "MemoryError" in r.err:
        flags.append("memory")
    died = r.code < 0 and -r.code != r.signalled
    if "Traceback (most recent call last)" in r.err or died:
        flags.append("traceback")
    hidden = [m for m in REPORT_EXCEPTION.findall(r.out) if m not in KIMI_ERRORS]
    if r.fallback or hidden:
        flags.append("fallback")
    errors = [line for line in ANSI.sub("", r.err).splitlines() if line.startswith("error:")]
    if r.signalled is not None and r.code != 0:           # stopped by the campaign's signal
        complete = case.ref is not None and output_digest(out) == fx.refs[case.ref]    # it came after the commit
        if r.signalled != signal.SIGKILL and listing(out) != before and not complete:
            flags.append("left-behind")
        if len(errors) > 1:
            flags.append("not-one-error")
        return flags
    report = case.prog == "kimi-verify" and case.args[:1] == ["check"]
    if r.code == 0:
        if errors:                                       # a success says no error
            flags.append("not-one-error")
        if expect == "bad":
            flags.append("wrong-success")
        elif expect == "ok":
            got, want = output_digest(out), fx.refs[case.ref]
            if set(got) - set(want):                    # a stale partial folder, a lock, a journal
                flags.append("left-behind")
            if any(got.get(k, "missing") != v for k, v in want.items()):
                flags.append("wrong-output")
        elif expect == "ok-any" and report and not r.out.rstrip().endswith("PASS"):
            flags.append("wrong-output")
        return flags
    if expect in ("ok", "ok-any"):
        flags.append("valid-failed")
    fail_report = report and r.code == 1 and r.out.rstrip().endswith("FAIL") and not errors
    if len(errors) != 1 and not fail_report:
        flags.append("not-one-error")
    if listing(out) != before:
        flags.append("left-behind")
    return flags


def execute(seed: int, index: int, fx: Fixtures, work: Path, timeout: float, mem_bound: int,
            keep: bool = False) -> dict:
    run = work / f"run-{index}"
    try:
        case = make_case(seed, index, fx, run)
        before = listing(run / "out")
        intact = {p: hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in case.intact}
        r = spawn(case.prog, case.args, run, timeout=timeout, send=case.send, unprivileged=case.unprivileged)
        flags = check_run(case, r, before, run / "out", fx, mem_bound)
        if any(not Path(p).is_file() or hashlib.sha256(Path(p).read_bytes()).hexdigest() != h
               for p, h in intact.items()):
            flags.append("input-lost")
        outcomes, new = [r], [sorted(listing(run / "out") - before)]
        if case.rerun is not None and not flags:
            r2 = spawn(case.prog, case.rerun, run, timeout=timeout)
            flags = check_run(case, r2, before, run / "out", fx, mem_bound, expect="ok")
            outcomes.append(r2)
            new.append(sorted(listing(run / "out") - before))
    except Exception:                   # noqa: BLE001 - the campaign's own fault: reported, never a crash
        return {"index": index, "cls": "campaign", "what": traceback.format_exc(), "flags": ["campaign-error"],
                "seconds": 0.0, "command": ""}
    finally:
        if not keep:
            _remove(run)
    last = outcomes[-1]
    return {"index": index, "cls": case.cls, "what": case.what, "flags": sorted(set(flags)),
            "seconds": sum(o.seconds for o in outcomes), "code": last.code, "expect": case.expect,
            "command": " ".join([case.prog, *map(str, case.args)]), "new_in_out": new,
            "exit_codes": [o.code for o in outcomes], "stderr": last.err[-2000:], "stdout": last.out[-1000:]}


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)       # the campaign runs as the files' owner (or root)


# ================================================================================== workers and the summary

_STATE: dict = {}


def _init_worker(fx: Fixtures, work: Path, seed: int, timeout: float, mem_bound: int, deadline: float) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)          # the parent stops the campaign
    d = Path(tempfile.mkdtemp(prefix=f"w{os.getpid()}-", dir=work))
    _STATE.update(fx=fx, work=d, seed=seed, timeout=timeout, mem_bound=mem_bound, deadline=deadline)


def _run_index(index: int) -> dict | None:
    s = _STATE
    if time.time() > s["deadline"]:
        return None
    return execute(s["seed"], index, s["fx"], s["work"], s["timeout"], s["mem_bound"])


def summarize(results: list[dict], seed: int, wall: float) -> dict:
    runs = len(results)
    clean = sum(1 for r in results if not r["flags"])
    flags = Counter(f for r in results for f in r["flags"])
    examples = {f: next(r for r in results if f in r["flags"]) for f in flags}
    by_class: dict = {}
    for r in results:
        row = by_class.setdefault(r["cls"], {"runs": 0, "clean": 0})
        row["runs"] += 1
        row["clean"] += not r["flags"]
    return {"seed": seed, "runs": runs, "clean": clean, "flags": dict(flags), "by_class": by_class,
            "wall_seconds": round(wall, 1), "cpu_seconds": round(sum(r["seconds"] for r in results), 1),
            "examples": {f: {"index": e["index"], "class": e["cls"], "what": e["what"], "command": e["command"],
                             "stderr": e.get("stderr", "")[-600:]} for f, e in examples.items()}}


def print_summary(s: dict) -> None:
    print(f"\ncampaign seed {s['seed']}: {s['runs']} runs in {s['wall_seconds']} s "
          f"({s['cpu_seconds']} s of runs), {s['clean']} clean")
    print(f"{'flag':<15} {'runs':>6}  example (reproduce: scripts/campaign.py --seed {s['seed']} --only INDEX)")
    for f in FLAGS + ("campaign-error",):
        n = s["flags"].get(f, 0)
        if f == "campaign-error" and not n:
            continue
        e = s["examples"].get(f)
        example = f"--only {e['index']}: {e['class']}: {e['what']}"[:100] if e else ""
        print(f"{f:<15} {n:>6}  {example}")
    print(f"\n{'class':<20} {'runs':>6} {'clean':>6}")
    for cls, row in sorted(s["by_class"].items()):
        print(f"{cls:<20} {row['runs']:>6} {row['clean']:>6}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--time-limit", type=float, default=3600, help="seconds; no run starts after it")
    p.add_argument("--timeout", type=float, default=60, help="seconds a run may take before it counts as a hang")
    p.add_argument("--mem-bound", type=int, default=1024, help="MiB of RSS growth a run may use")
    p.add_argument("--only", type=int, default=None, help="run this index alone and show everything about it")
    p.add_argument("--keep", action="store_true", help="with --only: keep the run's folder")
    p.add_argument("--json", type=Path, default=None, help="also write the summary and every flagged run here")
    p.add_argument("--work", type=Path, default=None, help="folder for fixtures and runs (default: a temp one)")
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kimi-campaign-", dir=a.work))
    work.chmod(0o755)
    started = time.time()
    try:
        load_apps()
        KIMI_ERRORS.update(kimi_error_names())
        fx = build_fixtures(work / "fixtures")
        print(f"fixtures and references in {time.time() - started:.1f} s", flush=True)
        if a.only is not None:
            r = execute(a.seed, a.only, fx, work / "runs", a.timeout, a.mem_bound * MiB, keep=a.keep)
            print(json.dumps(r, indent=2, default=str))
            if a.keep:
                print(f"kept {work / 'runs' / f'run-{a.only}'}")
            return 0 if not r["flags"] else 1
        (work / "runs").mkdir()
        deadline = started + a.time_limit
        results: list[dict] = []
        pool = mp.get_context("fork").Pool(a.workers, _init_worker,
                                           (fx, work / "runs", a.seed, a.timeout, a.mem_bound * MiB, deadline))
        try:
            for r in pool.imap_unordered(_run_index, range(a.runs), chunksize=4):
                if r is not None:
                    results.append(r)
                    if r["flags"]:
                        print(f"  run {r['index']}: {', '.join(r['flags'])}: {r['cls']}: {r['what'][:90]}",
                              flush=True)
                    if len(results) % 250 == 0:
                        print(f"{len(results)} runs, {time.time() - started:.0f} s", flush=True)
        finally:
            pool.terminate()
            pool.join()
        summary = summarize(sorted(results, key=lambda r: r["index"]), a.seed, time.time() - started)
        print_summary(summary)
        if a.json is not None:
            flagged = [r for r in results if r["flags"]]
            a.json.write_text(json.dumps({"summary": summary, "flagged": flagged}, indent=2, default=str) + "\n")
        return 0 if summary["clean"] == summary["runs"] else 1
    finally:
        if not a.keep:
            _remove(work)


if __name__ == "__main__":
    sys.exit(main())
