"""What a process pays to get our kernels: wall time and peak RSS of a fresh process that quantizes 16 x 4096
rows to Q4_K and Q8_0 and repacks one MXFP4 expert, against the same work in a process that has them already
(the work itself), on this checkout and, with --baseline DIR, on an earlier checkout in the same run.

    python benchmarks/bench_kernel_start.py [--runs 7] [--baseline OLD_CHECKOUT]

Each kernel cache is warmed by one untimed run first (the first run ever compiles: that cost is the same numba
compile either way). What matters at user scale is printed last: the start-up against an hour of work.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = """
import time
t0 = time.perf_counter()
import numpy as np
from gguf import GGMLQuantizationType as QT
from kimi_convert.quant.blocks import quantize
from kimi_convert.convert.mxfp4 import repack
x = np.random.default_rng(3).standard_normal((16, 4096)).astype(np.float32)
w = np.ones(4096, np.float32)
def work():
    quantize(x, QT.Q4_K, w, threads=1)
    quantize(x, QT.Q8_0, threads=1)
    repack(np.zeros((3072, 2048), np.uint8), np.full((3072, 128), 127, np.uint8))     # one K3 expert matrix
work()
t1 = time.perf_counter()
work()
t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""


def one(tree: Path) -> tuple[float, float, float, int]:
    """(process wall time, first work incl. imports, the same work again, peak RSS in bytes) of one run."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", WORK], env=env, capture_output=True, text=True, cwd=tree)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(p.stderr[-2000:])
    first, again = map(float, p.stdout.split())
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return wall, first, again, max(rss, before) * 1024


def measure(tree: Path, runs: int) -> dict:
    one(tree)                                   # warm the kernel cache (and the page cache)
    rows = [one(tree) for _ in range(runs)]
    # ru_maxrss of children is the largest child so far: run each tree in its own process for a clean figure
    return {"wall": statistics.median(r[0] for r in rows), "first": statistics.median(r[1] for r in rows),
            "again": statistics.median(r[2] for r in rows), "rss": rows[-1][3]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--baseline", type=Path, default=None, help="an earlier checkout, measured in the same run")
    ap.add_argument("--tree", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tree != ROOT or args.baseline is None:
        m = measure(args.tree, args.runs)
        print(f"{args.tree}: process {m['wall']:.3f} s, imports + first call {m['first']:.3f} s, the work again "
              f"{m['again'] * 1000:.1f} ms, peak RSS {m['rss'] / 2**20:.0f} MiB")
        start = m["first"] - m["again"]
        print(f"start-up {start:.3f} s: {start / 3600:.2e} of an hour of work")
        return 0
    for tree in (args.baseline, ROOT):          # each in a process of its own: ru_maxrss is per parent
        subprocess.run([sys.executable, __file__, "--tree", str(tree), "--runs", str(args.runs)], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
