#!/usr/bin/env python3
"""kimi-quantize against llama-quantize's own code (not a test): wall time, peak RSS and byte equality, per type.

    python benchmarks/bench_quantize.py [--types Q8_0,Q4_K,...] [--experts 32] [--layers 3] [--keep DIR] [--repeat 3]
                                        [--imatrix] [--load N]

--load N runs N busy processes (a Python loop each) through every timed run of both sides: the busy machine a
user's desktop is. Both sides share it alike (their runs alternate), so the ratio says which copes better.

--imatrix gives both sides the same importance matrix (fixtures/imatrix.py, made for the file; llama.cpp gets its
vectors as llama-quantize reads them): the i-quants need one (IQ1_S, IQ2_XXS, IQ2_XS always; llama-quantize
refuses the other grid types without one too).

Makes one kimi-k3 GGUF with wide rows and BF16 experts (latent and expert width 1024, hidden 2048; about
0.4 GB per MoE layer at 32 experts), then for each type runs, each in a fresh child process so that its peak RSS
is its own (its VmHWM):
  * llama.cpp: `llama_model_quantize` from llama-cpp-python 0.3.36 (the code of llama-quantize), --pure, 2 threads,
    then an fsync of its output, timed apart: llama-quantize leaves its output in the page cache, ours is on
    disk when it ends (fsync before the rename), so "+ fsync" is llama.cpp's time for the same durable result;
  * ours: `kimi_convert.quant.driver.quantize_file` with `default = "TYPE"`, on 2 threads.
Each type runs --repeat times (llama.cpp, then ours, back to back); the medians are printed, with the range of the
ratio: single runs on a shared 2-core VM swing by 0.2 and more. Prints per type both wall times, the ratio ours / llama.cpp (the goal: at most 2.0, then 1.0), the ratio
against llama.cpp + fsync, our fixed startup (a child that only imports the quantizer and loads that type's kernels),
ggml's one-off set-up of the type's tables (`ggml_quantize_init` timed in a fresh child: the IQ grids, seconds for
IQ1_S/IQ1_M/IQ2_S, which llama-quantize pays once per run and a real K3 run never notices) and the ratio with
llama.cpp's time less that set-up (ours keeps all its start-up: the ratio a file large enough to hide both gets
is at most that), both peak RSS and whether every tensor's bytes are equal. The kernels are compiled into numba's cache first (kimi_convert.kernel; the first run compiles).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kimi_convert.convert.converter import build_plan, convert  # noqa: E402
from kimi_convert.fixtures.make_checkpoint import make_checkpoint  # noqa: E402

DEFAULT_TYPES = "Q8_0,Q4_0,Q5_0,Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,IQ4_NL,IQ4_XS"

LLAMA = """
import os, sys, time
from kimi_interop import llama_quantize
vectors = None
if len(sys.argv) > 4:       # the imatrix, as llama-quantize's main reads it into its map of vectors
    from kimi_convert.gguf_io import open_gguf
    from kimi_convert.quant.imatrix import load_imatrix
    im, gf = load_imatrix(sys.argv[4]), open_gguf(sys.argv[1])
    vectors = {n: v for n in im.names if (v := im.vector(n, gf.tensors[n].shape)) is not None}
# token_embd and output have no imatrix entry (llama-imatrix collects none): Q8_0 on both sides, as ggml would
# abort on an i-quant without one
keep = [("^(token_embd|output)\\.weight$", 8)] if vectors else []
llama_quantize(sys.argv[1], sys.argv[2], int(sys.argv[3]), pure=True, threads=2, imatrix=vectors, tensor_types=keep)
start = time.perf_counter()
fd = os.open(sys.argv[2], os.O_RDONLY)
os.fsync(fd)                # what our run also does before it renames its output into place
os.close(fd)
sys.stderr.write(f"FSYNC {time.perf_counter() - start}\\n")
"""
OURS = """
import sys
from kimi_convert.quant.driver import quantize_file
from kimi_convert.quant.imatrix import load_imatrix
from kimi_convert.quant.policy import parse_policy
imatrix = load_imatrix(sys.argv[4]) if len(sys.argv) > 4 else None
keep = "[[rules]]\\npattern = '^(token_embd|output)\\\\.weight$'\\ntype = 'Q8_0'\\n" if imatrix else ""
quantize_file(sys.argv[1], sys.argv[2], parse_policy(f'default = "{sys.argv[3]}"\\n' + keep, "bench"), threads=2,
              imatrix=imatrix)
"""
STARTUP = """
import sys
from gguf import GGMLQuantizationType as QT
from kimi_convert.quant.blocks import load_kernels
load_kernels([(QT.BF16, QT[sys.argv[1]], False)])
"""
# ggml's one-off set-up of a type's tables (the IQ grids and their neighbour maps: seconds for IQ1_S and IQ2_S,
# nothing for the others), which llama-quantize pays once per run, whatever the file's size: ggml_quantize_init,
# the very call its quantize_chunk makes first, timed in a fresh process
LLAMA_SETUP = """
import sys, time
from gguf import GGMLQuantizationType as QT
from kimi_interop.ggml_quants import _lib
lib = _lib()
start = time.perf_counter()
lib.ggml_quantize_init(int(QT[sys.argv[1]]))
sys.stderr.write(f"SETUP {time.perf_counter() - start}\\n")
"""
LLAMA_IMPORTS = "\nfrom kimi_interop import llama_quantize\n"
WARM = """
from kimi_convert.gguf_io import open_gguf
from kimi_convert.quant.blocks import load_kernels
from kimi_convert.quant.driver import plan_file
from kimi_convert.quant.policy import parse_policy
gf = open_gguf(sys.argv[2])
for t in sys.argv[1].split(","):      # every kernel of each plan, its shape fallbacks' too
    plan = plan_file(gf, parse_policy(f'default = "{t}"\\n', "bench"))
    load_kernels((d.source, d.target, w) for d in plan.decisions if not d.copied for w in (False, True))
"""


# The children may write bytecode (a pip install compiles it; PYTHONDONTWRITEBYTECODE, set in some shells
# and CI images, would make every child compile each module it imports that has no .pyc yet): the warm-up
# run writes it, the timed runs read it. Both sides get the same environment.
CHILD_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
# the children import kimi_interop (tests and benchmarks only, not installed) from the repo root
CHILD_ENV["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))

PEAK = "\nimport sys\nsys.stderr.write(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')))\n"


def timed(code: str, *args: str) -> tuple[float, int, float]:
    """Wall seconds (less what it reports as FSYNC), peak RSS (bytes) and those FSYNC seconds of
    `python -c code args` in a fresh child. The peak is the child's
    own VmHWM: wait4's ru_maxrss would also count the pages of this parent that the child had until exec."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code + PEAK, *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=CHILD_ENV)
    err = proc.stderr.read().decode()
    status = proc.wait()
    seconds = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"failed: {args}\n{err[-2000:]}")
    fsync = float(err.rsplit("FSYNC ", 1)[1].split()[0]) if "FSYNC " in err else 0.0
    return seconds - fsync, int(err.rsplit("VmHWM:", 1)[1].split()[0]) * 1024, fsync


def same_bytes(a: Path, b: Path) -> bool:
    from kimi_convert.gguf_io import open_gguf
    ta, tb = open_gguf(a).tensors, open_gguf(b).tensors
    return set(ta) == set(tb) and all(ta[n].qtype == tb[n].qtype and ta[n].raw.tobytes() == tb[n].raw.tobytes()
                                      for n in ta)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default=DEFAULT_TYPES)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--layers", type=int, default=3, help="layers (the first is dense)")
    ap.add_argument("--keep", type=Path, help="work in this folder and keep it")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each side per type (medians are printed)")
    ap.add_argument("--imatrix", action="store_true", help="both sides with the same importance matrix")
    ap.add_argument("--load", type=int, default=0, help="busy processes running beside every timed run")
    args = ap.parse_args()
    from gguf import GGMLQuantizationType as QT

    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-quantize-"))
    work.mkdir(parents=True, exist_ok=True)
    src = work / "k3-wide-bf16.gguf"
    if not src.exists():
        hf = make_checkpoint(work / "Kimi-K3-wide", arch="k3", n_layers=args.layers, experts_mxfp4=False,
                             hidden=2048, moe_intermediate_size=1024, routed_expert_hidden_size=1024,
                             intermediate_size=2048, num_experts=args.experts, num_experts_per_token=4, seed=1)
        convert(build_plan(hf, "bf16"), src)
    imatrix_args: list[str] = []
    if args.imatrix:
        from kimi_convert.fixtures.imatrix import k3_entries, write_gguf_imatrix
        from kimi_convert.gguf_io import open_gguf
        shapes = {n: t.shape for n, t in open_gguf(src).tensors.items()}
        imatrix_args = [str(write_gguf_imatrix(work / "k3.imatrix.gguf", k3_entries(shapes, seed=5),
                                               chunk_count=12))]
    print(f"input {src}: {src.stat().st_size / 1e6:.0f} MB; cores {os.cpu_count()}; "
          f"imatrix: {imatrix_args[0] if imatrix_args else 'none'}")
    types = args.types.split(",")
    subprocess.run([sys.executable, "-c", "import sys\n" + WARM + LLAMA_IMPORTS, ",".join(types), str(src)],
                   check=True, env=CHILD_ENV)       # numba's cache, and the bytecode of both sides' modules
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        run_types(types, src, work, imatrix_args, args.repeat, args.load)
    finally:
        for p in busy:
            p.kill()


def llama_file_type(qtype) -> int:
    """The llama-quantize file type whose --pure run writes `qtype` everywhere: the one named after it, else the
    first whose default it is (IQ2_S is IQ2_M's)."""
    from kimi_convert.quant.driver import FILE_TYPE
    from kimi_convert.quant.mixtures import FILE_TYPES
    if qtype in FILE_TYPE:
        return int(FILE_TYPE[qtype])
    return int(next(ft.ftype for ft in FILE_TYPES.values() if ft.default == qtype))


def run_types(types: list[str], src: Path, work: Path, imatrix_args: list[str], repeat: int, load: int) -> None:
    from gguf import GGMLQuantizationType as QT
    print(f"medians of {repeat} runs of each side per type, llama.cpp and ours back to back"
          + (f", {load} busy process(es) beside them" if load else ""))
    print(f"{'type':8} {'llama.cpp s':>11} {'+ fsync s':>9} {'ours s':>8} {'ratio':>6} {'(range)':>9} {'ratio+fsync':>11} "
          f"{'startup s':>9} {'ggml set-up':>10} {'w/o set-up':>12} {'llama RSS':>10} "
          f"{'our RSS':>9}  bytes equal")
    for name in types:
        theirs, ours = work / f"llama-{name}.gguf", work / f"ours-{name}.gguf"
        runs = []
        for _ in range(repeat):                 # llama.cpp, then ours, back to back: the pairs share the load
            t_l, rss_l, t_f = timed(LLAMA, str(src), str(theirs), str(llama_file_type(QT[name])), *imatrix_args)
            t_o, rss_o, _ = timed(OURS, str(src), str(ours), name, *imatrix_args)
            t_s, _, _ = timed(STARTUP, name)   # our fixed cost: interpreter, imports, linking the kernels, exit
            setup = llama_setup(name)
            equal = same_bytes(ours, theirs)
            theirs.unlink()
            ours.unlink()
            runs.append((t_l, t_l + t_f, t_o, t_o / t_l, t_o / (t_l + t_f), t_s, setup, t_o / (t_l - setup),
                         rss_l, rss_o, equal))
        t_l, t_lf, t_o, ratio, ratio_f, t_s, setup, ratio_ns = (statistics.median(r[k] for r in runs)
                                                                for k in range(8))
        spread = f"{min(r[3] for r in runs):.2f}-{max(r[3] for r in runs):.2f}" if len(runs) > 1 else ""
        print(f"{name:8} {t_l:11.2f} {t_lf:9.2f} {t_o:8.2f} {ratio:6.2f} {spread:>9} {ratio_f:11.2f} {t_s:9.2f} "
              f"{setup:10.2f} {ratio_ns:12.2f} "
              f"{max(r[8] for r in runs) / 2**20:8.0f}Mi {max(r[9] for r in runs) / 2**20:7.0f}Mi  "
              f"{all(r[10] for r in runs)}", flush=True)


def llama_setup(name: str) -> float:
    """Seconds of ggml_quantize_init for type `name` in a fresh process (LLAMA_SETUP)."""
    proc = subprocess.run([sys.executable, "-c", LLAMA_SETUP, name], env=CHILD_ENV, capture_output=True, text=True,
                          check=True)
    return float(proc.stderr.rsplit("SETUP ", 1)[1].split()[0])


if __name__ == "__main__":
    main()
