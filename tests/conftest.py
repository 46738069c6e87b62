"""Shared fixtures: tiny real-format checkpoints, generated at run time, and their conversions."""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

# Under pytest-xdist (scripts/test.sh: one worker a core) a worker's torch, OpenBLAS and OpenMP get one thread,
# and so do the commands it starts: two workers of two threads each on two cores spun in each other's way (a
# torch test took 64 s in CI beside the other worker, 4 s alone). Set before numpy or torch is imported.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kimi_convert.fixtures.make_checkpoint import make_checkpoint  # noqa: E402
from kimi_convert.interrupts import INTERRUPTS  # noqa: E402


# The signal tests send SIGINT, SIGTERM and SIGHUP and expect them to act. A runner may start this process with
# them ignored (a CI that starts its job as nohup does, or as a background job of a script, which ignores SIGINT)
# or blocked, and an ignored signal stays ignored across exec: the commands then keep ignoring it, as they should
# (test_convert_errors: nohup), and the tests would see a command that is never stopped. So the session starts
# from the dispositions of an interactive shell, for itself and for every command it starts; the header says
# what it inherited.

def _default_interrupts() -> list[str]:
    changed = []
    for sig in INTERRUPTS:
        if signal.getsignal(sig) == signal.SIG_IGN:
            changed.append(f"{sig.name} ignored")
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, INTERRUPTS) & set(INTERRUPTS)
    changed += [f"{sig.name} blocked" for sig in sorted(blocked)]
    return changed


_INHERITED = _default_interrupts()


# CPU flags, llama.cpp's compiled ISA and numpy's kernels (docs/verification.md §8): printed at the start, also
# under -q, and attached to every failing interop test, so that a failure says which arithmetic ran.

def _numeric_paths() -> list[str]:
    from kimi_interop.numeric_paths import numeric_paths
    return numeric_paths()


def _header() -> list[str]:
    inherited = (f"signals: inherited {', '.join(_INHERITED)}; the tests run with the default actions"
                 if _INHERITED else "signals: SIGINT, SIGTERM and SIGHUP inherited with their default actions")
    return _numeric_paths() + [inherited]


def pytest_report_header(config):
    return _header()


def pytest_sessionstart(session):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and session.config.option.verbose < 0:      # -q hides the header
        for line in _header():
            reporter.write_line(line)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.failed and "interop" in item.nodeid:
        report.sections.append(("numeric paths", "\n".join(_numeric_paths())))


@pytest.fixture(scope="session")
def k3_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("k3") / "Kimi-K3-tiny", arch="k3")


@pytest.fixture(scope="session")
def k31_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("k31") / "Kimi-K3.1-tiny", arch="k31")


def _convert(hf_dir: Path, out: Path, outtype: str) -> Path:
    from kimi_convert.convert.converter import build_plan, convert
    convert(build_plan(hf_dir, outtype), out)
    return out


@pytest.fixture(scope="session")
def converted(tmp_path_factory, k3_dir, k31_dir):
    """(arch, outtype) -> converted GGUF path, made once per session."""
    out_dir = tmp_path_factory.mktemp("gguf")
    cache: dict[tuple[str, str], Path] = {}

    def get(arch: str, outtype: str = "bf16") -> Path:
        if (arch, outtype) not in cache:
            src = k3_dir if arch == "k3" else k31_dir
            cache[arch, outtype] = _convert(src, out_dir / f"{arch}-{outtype}.gguf", outtype)
        return cache[arch, outtype]

    return get


@pytest.fixture(scope="session")
def calib_text(tmp_path_factory) -> Path:
    """A calibration text every machine has: the source of the standard library's argparse (about 100 KB, some
    55k tokens of the fixtures' vocabulary), for kimi-imatrix and llama-imatrix alike."""
    import argparse
    import inspect
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(inspect.getsource(argparse))
    return path

