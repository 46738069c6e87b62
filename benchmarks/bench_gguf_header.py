#!/usr/bin/env python3
"""GGUF header benchmark (not a test): how long `read_gguf` takes on the real K3's header, and how much of it is
decoding, and so checking as UTF-8, the strings of the vocabulary (163,840 tokens and their merges).

    python benchmarks/bench_gguf_header.py [--arch k3|k31] [--repeats 5] [--workdir DIR] [--keep]

The file is the real-size sparse GGUF of fixtures/real_size.py: every key and tensor info `kimi-convert` writes
for the release, its data section a hole (the checkpoint and the file take about 140 MB). Printed, best of
--repeats in this process: read_gguf of the whole header; and the UTF-8 decoding of every element of
tokenizer.ggml.tokens and tokenizer.ggml.merges alone (`bytes.decode("utf-8")` on each, the reader's own check,
which turns them into the str it returns anyway), with its share of the header's time.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kimi_convert.fixtures.real_size import make_sparse_checkpoint, write_sparse_gguf  # noqa: E402
from kimi_convert.gguf_io import read_gguf  # noqa: E402

STRING_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="k3", choices=("k3", "k31"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the work folder (reused by a later --workdir run)")
    args = ap.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-gguf-header-"))
    hf, gguf = work / f"Kimi-{args.arch}-real", work / f"{args.arch}-real.gguf"
    try:
        if not gguf.exists():
            t = time.perf_counter()
            make_sparse_checkpoint(hf, arch=args.arch)
            write_sparse_gguf(hf, gguf)
            print(f"built {gguf} in {time.perf_counter() - t:.0f} s")
        gf = read_gguf(gguf)
        raws = [s.encode("utf-8") for key in STRING_ARRAYS for s in gf.fields[key]]
        counts = ", ".join(f"{len(gf.fields[k]):,} {k.rsplit('.', 1)[-1]}" for k in STRING_ARRAYS)
        header = best(lambda: read_gguf(gguf), args.repeats)
        decode = best(lambda: [r.decode("utf-8") for r in raws], args.repeats)
        print(f"{gguf.name}: {gf.parts[0].data_offset:,} header bytes, {len(gf.fields)} keys, {len(gf.tensors):,} "
              f"tensors; {counts} ({sum(map(len, raws)):,} string bytes)")
        print(f"read_gguf (whole header): {header * 1e3:.0f} ms, best of {args.repeats}")
        print(f"UTF-8 decode of every token and merge: {decode * 1e3:.1f} ms ({decode / header:.0%} of the header)")
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
