#!/usr/bin/env python3
"""Quantizer kernel benchmark (not a test): kimi_convert.quant against ggml's ggml_quantize_chunk.

    python benchmarks/bench_quant_kernels.py [--mb 64] [--width 7168] [--types Q8_0,Q4_K,...]
                                             [--threads 1,2] [--imatrix both|none|only] [--repeats 2]

Both sides get the same float32 matrix (``--mb`` MB of rows ``--width`` wide: Student-t values rounded to
bf16, like weights dequantized from a BF16 checkpoint) and, with an imatrix, the same random positive
importance vector with 10% zeros. ggml is llama-cpp-python's libggml-base.so through ctypes; with N threads
it gets N row chunks in N Python threads (ctypes releases the GIL), as llama-quantize splits a tensor;
ours splits the rows the same way over N threads (its numba kernels release the GIL too). Each (type,
imatrix, threads) is timed ``--repeats`` times, alternating the two sides, and the best time of each is kept;
the kernels are compiled (or loaded from numba's cache) before timing. Prints, per case, both wall times,
the ratio ours/ggml of wall time (goal <= 2.0) and of process CPU time (steadier on a shared machine), our
throughput and whether the bytes are equal.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kimi_convert.gguf_io import TYPES_BY_NAME  # noqa: E402
from kimi_interop.ggml_quants import ggml_quantize  # noqa: E402
from kimi_convert.quant import quantize  # noqa: E402
from kimi_convert.quant.blocks import block_type  # noqa: E402

TYPES = ("Q8_0,Q4_0,Q4_1,Q5_0,Q5_1,Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,IQ4_NL,IQ4_XS,TQ1_0,TQ2_0,Q1_0,Q2_0,MXFP4,NVFP4,F16,BF16,F32,"
         "IQ2_XXS,IQ2_XS,IQ2_S,IQ3_XXS,IQ3_S,IQ1_S,IQ1_M")


def weights_like(n_rows: int, width: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_t(5, size=(n_rows, width)) * 0.02).astype(np.float32)
    bits = x.view(np.uint32)
    bits += 0x7FFF + ((bits >> 16) & 1)   # round to bf16, nearest even
    bits &= 0xFFFF0000
    return x


def importance(width: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    im = rng.lognormal(0.0, 1.0, width).astype(np.float32)
    im[rng.random(width) < 0.1] = 0.0
    return im


def timed(fn) -> tuple[float, float, np.ndarray]:
    """(wall s, process CPU s, result) of one call."""
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - w0, time.process_time() - c0, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=64.0, help="float32 input size in MB (default 64)")
    ap.add_argument("--width", type=int, default=7168, help="row length (default 7168)")
    ap.add_argument("--types", default=TYPES)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--imatrix", choices=("both", "none", "only"), default="both")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    n_rows = max(2, int(args.mb * 1e6 / 4 / args.width))
    x = weights_like(n_rows, args.width)
    im = importance(args.width)
    types = [TYPES_BY_NAME[t.strip().upper()] for t in args.types.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    variants = {"both": (False, True), "none": (False,), "only": (True,)}[args.imatrix]
    print(f"input: {n_rows} x {args.width} float32 = {x.nbytes / 1e6:.1f} MB; best of {args.repeats}")
    print(f"{'type':7} {'imatrix':7} {'thr':>3} {'ggml s':>8} {'ours s':>8} {'ratio':>6} {'cpu ratio':>9} "
          f"{'ours Mval/s':>11}  bytes")
    worst = 0.0
    for qt in types:
        for with_im in variants:
            if with_im and not block_type(qt).uses_imatrix():
                continue   # the imatrix is not used by this type (F32, F16, BF16, Q8_0, the low-bit types)
            if not with_im and block_type(qt).ggml_requires_imatrix:
                continue   # ggml asserts an imatrix (IQ1_S, IQ2_XXS, IQ2_XS)
            qw = im if with_im else None
            quantize(x[:2], qt, qw)  # compile / load the kernels outside the timing
            for nt in threads:
                wall = {"ggml": float("inf"), "ours": float("inf")}
                cpu = dict(wall)
                for _ in range(args.repeats):   # alternate, so that load changes hit both sides alike
                    for side, fn in (("ggml", lambda: ggml_quantize(x, qt, qw, threads=nt)),
                                     ("ours", lambda: quantize(x, qt, qw, threads=nt))):
                        w, c, out = timed(fn)
                        wall[side], cpu[side] = min(wall[side], w), min(cpu[side], c)
                        if side == "ggml":
                            ref = out
                        else:
                            ours = out
                ratio = wall["ours"] / wall["ggml"]
                worst = max(worst, ratio)
                equal = "equal" if np.array_equal(ref, ours) else "DIFFERENT"
                print(f"{qt.name:7} {'yes' if with_im else 'no':7} {nt:3d} {wall['ggml']:8.3f} {wall['ours']:8.3f} "
                      f"{ratio:6.2f} {cpu['ours'] / cpu['ggml']:9.2f} {x.size / wall['ours'] / 1e6:11.1f}  {equal}",
                      flush=True)
    print(f"worst ratio: {worst:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
