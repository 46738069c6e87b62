#!/usr/bin/env python3
"""Compile every numba kernel once, on all cores, before the tests run.

    python scripts/build_kernels.py [--jobs N]

A fresh clone has no kernel cache, and each of pytest's two workers (pytest -n 2) would compile every kernel it
meets on its own, the same kernels twice, one after the other inside each worker. Here the kernels are shared out
over N processes (default: the cores) that compile them side by side into numba's cache (``__pycache__`` beside
the kernels; kimi_convert.kernel); the tests then load them. On a warm cache it only loads them.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def all_kernels():
    """Every kernel the package declares: each type's quantizers, its dequantizer, the widening, the finite
    check, the repack."""
    from kimi_convert.convert.mxfp4 import REPACK_KERNEL
    from kimi_convert.quant import blocks
    kernels = {id(k): k for k in (REPACK_KERNEL, blocks._BF16_TO_F32, blocks._COUNT_NONFINITE)}
    for qtype in blocks.supported_types():
        bt = blocks.block_type(qtype)
        for k in (bt._ref, bt._impl, bt._to_f32):
            if k is not None:
                kernels[id(k)] = k
    return sorted(kernels.values(), key=lambda k: (k.module, k.name))


def build_share(jobs: int, index: int) -> None:
    for k in all_kernels()[index::jobs]:
        k.build()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--share", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.share is not None:
        return build_share(args.jobs, args.share)
    start = time.perf_counter()
    children = [subprocess.Popen([sys.executable, __file__, "--jobs", str(args.jobs), "--share", str(i)])
                for i in range(args.jobs)]
    if any(c.wait() for c in children):
        raise SystemExit("build_kernels: a kernel failed to build (its error is above)")
    print(f"build_kernels: {len(all_kernels())} kernels ready in {time.perf_counter() - start:.0f} s "
          f"on {args.jobs} processes")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
