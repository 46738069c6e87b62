#!/usr/bin/env python3
"""Grid table build benchmark (not a test): kimi_convert.quant.kernels.grids against ggml's own init.

    python benchmarks/bench_grids.py [--repeats 3]

Each grid is built in a new process (its cost at first use: the tables are memoized per process), ``--repeats``
times, the best kept: ours is ``grid_tables(type)`` (including gguf-py's decoding of its grid), ggml's is
``ggml_quantize_init(type)`` of llama-cpp-python's libggml-base.so (iq2xs_init_impl / iq3xs_init_impl, OpenMP
on the CPUs there are). Prints both times, the bytes our tables take (``GridTables.nbytes``) and the bytes of
ggml's (its grid, kmap and full neighbour lists: what ``_nearest`` gives for every off-grid index, with the
levels a quantizer never packs).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as QT  # noqa: E402

from kimi_convert.quant.kernels import grids  # noqa: E402

OURS = """
import sys, time
sys.path.insert(0, {root!r})
from gguf import GGMLQuantizationType as QT
from kimi_convert.quant.kernels import grids
t = time.perf_counter()
grids.grid_tables(QT[{name!r}])
print(time.perf_counter() - t)
"""
GGML = """
import sys, time
sys.path.insert(0, {root!r})
from gguf import GGMLQuantizationType as QT
from kimi_interop.ggml_quants import _lib
lib = _lib()
t = time.perf_counter()
lib.ggml_quantize_init(int(QT[{name!r}]))
print(time.perf_counter() - t)
"""


def timed(code: str, name: str, repeats: int) -> float:
    return min(float(subprocess.run([sys.executable, "-c", code.format(root=str(ROOT), name=name)], check=True,
                                    capture_output=True, text=True).stdout) for _ in range(repeats))


def ggml_bytes(qtype: QT) -> int:
    """ggml's tables: grid (8 or 4 int8s a point), kmap (int32) and the neighbour lists of every off-grid index."""
    t, init = grids.grid_tables(qtype), grids.INITS[qtype]
    dim, levels = t.grid.shape[1], 1 << init.bits
    vectors = np.indices((levels,) * dim).reshape(dim, -1).T
    u = grids.pack(vectors, init.bits)
    vectors = vectors[(u < init.kmap_size) & ~np.isin(u, t.packed)]
    counts, ids = grids._nearest(t.grid, vectors, levels, init.nwant)
    return t.grid.nbytes + 4 * init.kmap_size + 2 * (len(counts) + len(ids))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"{'grid':<8} {'ours s':>8} {'ggml s':>8} {'ours MiB':>9} {'ggml MiB':>9}")
    total = [0.0, 0.0, 0, 0]
    for qtype in grids.INITS:
        row = (timed(OURS, qtype.name, args.repeats), timed(GGML, qtype.name, args.repeats),
               grids.grid_tables(qtype).nbytes, ggml_bytes(qtype))
        total = [a + b for a, b in zip(total, row)]
        print(f"{qtype.name:<8} {row[0]:8.3f} {row[1]:8.3f} {row[2] / 2**20:9.2f} {row[3] / 2**20:9.2f}")
    print(f"{'all':<8} {total[0]:8.3f} {total[1]:8.3f} {total[2] / 2**20:9.2f} {total[3] / 2**20:9.2f}")


if __name__ == "__main__":
    main()
