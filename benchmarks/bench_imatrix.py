#!/usr/bin/env python3
"""kimi-imatrix against the real llama-imatrix (not a test): wall time and peak RSS of the whole command, same file,
same text, same threads, measured in this run.

    python benchmarks/bench_imatrix.py [--layers 2] [--experts 32] [--chunks 128] [--ctx 128] [--repeat 3]
                                       [--threads 2] [--keep DIR] [--mxfp4]

Makes one kimi-k3 checkpoint with wide rows (hidden 2048, expert and latent width 1024; --layers 2 is a dense
layer and an MoE layer, about 0.5 GB of BF16 at 32 experts) and its BF16 GGUF, and a calibration text from the
Python standard library's sources. Then, --repeat times each, back to back, every run a fresh process:
  * llama.cpp: `llama-imatrix -m GGUF -f TEXT -c CTX --chunks N -t THREADS` (its defaults otherwise: -b 2048,
    flash attention auto), the tool .ci/install-interop.sh builds;
  * ours from the GGUF: `kimi-imatrix GGUF -f TEXT --ctx CTX --chunks N --threads THREADS`;
  * ours from the checkpoint folder (the same run, the weights read from the safetensors shards).
Prints the medians, the ratios ours / llama.cpp with their range over the repeats, and each side's peak RSS
(the child's VmHWM, read through /proc as it runs). --mxfp4 makes the experts MXFP4 (the release's format).
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kimi_convert.convert.converter import build_plan, convert  # noqa: E402
from kimi_convert.fixtures.make_checkpoint import make_checkpoint  # noqa: E402
from kimi_interop.llama_tools import tool_path  # noqa: E402

STDLIB = ["argparse", "collections", "difflib", "string", "typing", "inspect", "dataclasses", "pathlib", "ast",
          "tokenize", "pydoc", "logging", "subprocess", "threading", "unittest.case", "http.client", "urllib.parse",
          "zipfile", "tarfile", "shutil", "csv", "decimal", "fractions", "statistics", "textwrap", "pprint",
          "datetime", "calendar", "email.message", "json.decoder"]
CHILD_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


def peak_of(proc: subprocess.Popen, out: list[int]) -> None:
    """The child's VmHWM, polled until it exits (the last value read is its peak)."""
    path = f"/proc/{proc.pid}/status"
    while proc.poll() is None:
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        out[0] = max(out[0], int(line.split()[1]) * 1024)
        except OSError:
            pass
        time.sleep(0.05)


def timed(cmd: list[str]) -> tuple[float, int]:
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=CHILD_ENV, text=True)
    peak = [0]
    watcher = threading.Thread(target=peak_of, args=(proc, peak))
    watcher.start()
    err = proc.stderr.read()
    proc.wait()
    watcher.join()
    if proc.returncode != 0:
        raise SystemExit(f"failed: {cmd}\n{err[-3000:]}")
    return time.perf_counter() - start, peak[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--chunks", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mxfp4", action="store_true")
    ap.add_argument("--keep", type=Path)
    args = ap.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-imatrix-"))
    work.mkdir(parents=True, exist_ok=True)
    hf, src, text = work / "Kimi-K3-wide", work / "k3-wide.gguf", work / "calib.txt"
    if not src.exists():
        make_checkpoint(hf, arch="k3", n_layers=args.layers, experts_mxfp4=args.mxfp4, hidden=2048,
                        moe_intermediate_size=1024, routed_expert_hidden_size=1024, intermediate_size=2048,
                        num_experts=args.experts, num_experts_per_token=4, seed=1)
        convert(build_plan(hf, "bf16"), src)
    if not text.exists():
        text.write_text("".join(inspect.getsource(importlib.import_module(m)) for m in STDLIB))
    size = src.stat().st_size
    print(f"model {src} ({size / 1e6:.0f} MB), {args.chunks} chunks of {args.ctx}, {args.threads} threads")
    n = str(args.chunks)
    llama = [str(tool_path("llama-imatrix")), "-m", str(src), "-f", str(text), "-o", str(work / "llama.gguf"),
             "-c", str(args.ctx), "--chunks", n, "-t", str(args.threads)]
    ours = [sys.executable, "-c", "from kimi_convert.cli.imatrix import main; main()"]
    tail = ["-f", str(text), "--ctx", str(args.ctx), "--chunks", n, "--threads", str(args.threads), "--force"]
    runs = {"llama-imatrix": llama,
            "kimi-imatrix GGUF": ours + [str(src), "-o", str(work / "ours.gguf")] + tail,
            "kimi-imatrix HF": ours + [str(hf), "-o", str(work / "ours-hf.gguf")] + tail}
    times: dict[str, list[float]] = {k: [] for k in runs}
    peaks: dict[str, int] = {k: 0 for k in runs}
    for _ in range(args.repeat):
        for name, cmd in runs.items():
            seconds, peak = timed(cmd)
            times[name].append(seconds)
            peaks[name] = max(peaks[name], peak)
    base = statistics.median(times["llama-imatrix"])
    for name in runs:
        t = statistics.median(times[name])
        ratios = [a / b for a, b in zip(times[name], times["llama-imatrix"])]
        print(f"{name:<18} {t:7.2f} s (median of {args.repeat}), {t / base:.2f}x llama-imatrix "
              f"({min(ratios):.2f}-{max(ratios):.2f}), peak RSS {peaks[name] / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
