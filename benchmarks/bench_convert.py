#!/usr/bin/env python3
"""Converter benchmark (not a test): throughput against `cp` and peak RSS at two model sizes.

    python benchmarks/bench_convert.py [--sizes 1,2.5] [--workdir DIR] [--keep] [--repeats 2]
                                       [--no-drop-caches] [--profile]

For each size (GB, decimal, of routed-expert shard bytes) it writes a Kimi-K3 checkpoint whose
routed experts have the real shapes and MXFP4 layout (latent L=3584, moe intermediate I=3072:
w1/w3 weight_packed U8[3072,1792] + weight_scale U8[3072,112], w2 U8[3584,1536] + U8[3584,96]),
32 experts per MoE layer (--experts), as many MoE layers as the size needs; the other dimensions are
small but real-looking (hidden 2048, 16 heads of 128, ...), so routed experts are ~80% of the
bytes (the real model: >95%; the rest is BF16 that the converter copies in-kernel, so this
flatters the converter a little). Config, tokenizer and small tensors come from
kimi_convert.fixtures.make_checkpoint; the big tensors are written here by a streaming safetensors writer
(random packed codes, E8M0 scales in 118..127), one tensor at a time, so generation is
disk-bound and its memory is a few tens of MB.

Then, each in its own subprocess (so ru_maxrss, read with os.wait4, is that run's alone):
  * `python -m kimi_convert HF OUT --force` (build_plan + convert) for every size: peak RSS;
  * on the largest size, `cp` of the same shard files to the same disk followed by `sync` of
    the copies (the converter fsyncs its output, so cp is charged for its write-back too),
    against the converter; cold cache (`sync; echo 3 > /proc/sys/vm/drop_caches` before every
    timed run, when permitted) and warm cache (sources in the page cache), each in the order
    cp, convert, convert, cp for --repeats 2 (ABBA, so neither side always goes first);
    the best time of each side is kept.
Throughput = bytes written / wall time of the whole process (interpreter start, planning and
vocabulary included); the converter's own write-phase time (from its summary line) is shown too.
Everything under the work directory is deleted at the end unless --keep.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kimi_convert.fixtures import make_checkpoint as fx  # noqa: E402  (tensor_plan, config and tokenizer writers)

LATENT, MOE_I, BLOCK = 3584, 3072, 32
N_EXPERTS = 32            # per MoE layer (the real model has hundreds; --experts)
# the other dimensions: small, but shaped like the real model's
BASE_SPEC = dict(arch="k3", hidden=2048, n_heads=16, kda_head_dim=128, q_lora_rank=768, kv_lora_rank=512,
                 qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=4096,
                 moe_intermediate_size=MOE_I, routed_expert_hidden_size=LATENT, num_experts=N_EXPERTS,
                 num_experts_per_token=8, num_shared_experts=1, first_k_dense_replace=1,
                 experts_mxfp4=True, seed=0)
# bytes of one expert (w1, w2, w3: packed + scale)
EXPERT_BYTES = 2 * (MOE_I * LATENT // 2 + MOE_I * LATENT // BLOCK) + (LATENT * MOE_I // 2 + LATENT * MOE_I // BLOCK)
GEN_CHUNK = 1 << 22        # elements per generated block of a big float tensor
GB, MB, GIB, MIB = 1e9, 1e6, 1 << 30, 1 << 20


def log(msg: str) -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------------------------------
# checkpoint generation

def spec_for(size_gb: float) -> "fx.FixtureSpec":
    moe_layers = max(1, math.ceil(size_gb * GB / (N_EXPERTS * EXPERT_BYTES)))
    n_layers = moe_layers + BASE_SPEC["first_k_dense_replace"]
    return fx.FixtureSpec(**BASE_SPEC, n_layers=n_layers, n_shards=n_layers + 3)   # one layer a shard


def _bf16_random(rng: np.random.Generator, n: int, std: float):
    """Normal(0, std) rounded down to BF16, in blocks (bounded memory)."""
    for start in range(0, n, GEN_CHUNK):
        x = rng.standard_normal(min(GEN_CHUNK, n - start), dtype=np.float32)
        x *= std
        yield (x.view(np.uint32) >> 16).astype("<u2")


def _tensor_chunks(spec, t, rng: np.random.Generator):
    n = math.prod(t.shape)
    if t.init == "mx_packed":                 # any byte is two valid E2M1 codes
        yield np.frombuffer(rng.bytes(n), dtype=np.uint8)
    elif t.init == "mx_scale":                # E8M0 2^-9 .. 2^0
        yield rng.integers(118, 128, size=n, dtype=np.uint8)
    elif t.dtype == fx.BF16 and t.init in ("linear", "embed", "router"):
        fan_in = math.prod(t.shape[1:]) if len(t.shape) > 1 else 1
        std = {"linear": 1 / math.sqrt(fan_in), "embed": 1.0, "router": 2 / math.sqrt(fan_in)}[t.init]
        yield from _bf16_random(rng, n, std)
    else:                                     # small tensors with meaningful values: the fixture's own
        yield np.frombuffer(fx._tensor_bytes(spec, t), dtype=np.uint8)


def _write_shard(path: Path, spec, tensors, rng: np.random.Generator) -> int:
    """A safetensors file written one tensor (block) at a time."""
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for t in tensors:
        nbytes = math.prod(t.shape) * fx.DTYPE_SIZE[t.dtype]
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in tensors:
            want, got = header[t.name]["data_offsets"][1] - header[t.name]["data_offsets"][0], 0
            for chunk in _tensor_chunks(spec, t, rng):
                b = memoryview(np.ascontiguousarray(chunk)).cast("B")
                f.write(b)
                got += len(b)
            assert got == want, (t.name, got, want)
    return off


def write_checkpoint(out: Path, spec) -> tuple[int, int]:
    """(shard bytes, routed-expert bytes)."""
    out.mkdir(parents=True, exist_ok=True)
    plan = fx.tensor_plan(spec)
    weight_map, total = {}, 0
    for k in range(1, spec.n_shards + 1):
        fname = fx.shard_filename(k, spec.n_shards)
        tensors = [t for t in plan if t.shard == k]
        total += _write_shard(out / fname, spec, tensors, np.random.default_rng([spec.seed, k]))
        weight_map.update({t.name: fname for t in tensors})
    expert = sum(math.prod(t.shape) for t in plan if t.init in ("mx_packed", "mx_scale"))
    fx._dump_json(out / fx.INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map}, True)
    fx._dump_json(out / "config.json", fx.build_config(spec), True)
    fx._dump_json(out / "tokenizer_config.json", fx._tokenizer_config(spec), False)
    (out / "tiktoken.model").write_text(fx._tiktoken_text(spec), encoding="ascii")
    for name, text in fx._STUBS.items():
        (out / name).write_text(text, encoding="utf-8")
    return total, expert


def shard_files(hf: Path) -> list[Path]:
    return sorted(hf.glob("model-*-of-*.safetensors"))


# ------------------------------------------------------------------------------------------
# measuring

@dataclass
class Run:
    seconds: float
    max_rss: int          # bytes
    stdout: str
    stderr: str


def run_measured(cmd: list[str], env=None) -> Run:
    """Wall time and this child's own peak RSS (os.wait4, not the cumulative RUSAGE_CHILDREN)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=REPO)
        _, status, usage = os.wait4(p.pid, 0)
        seconds = time.perf_counter() - start
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        run = Run(seconds, usage.ru_maxrss * 1024, out.read(), err.read())
    if p.returncode:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n{run.stderr[-3000:]}")
    return run


def converter_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["COLUMNS"] = "200"
    return env


def run_convert(hf: Path, out: Path) -> tuple[Run, float | None]:
    """The CLI (build_plan + convert) in a subprocess; also its own write-phase seconds."""
    run = run_measured([sys.executable, "-m", "kimi_convert", str(hf), str(out), "--force"], converter_env())
    m = re.search(r"wrote \d+ tensors, .*? in ([\d.]+) s", run.stderr.replace("\n", " "))
    return run, float(m.group(1)) if m else None


def run_cp(hf: Path, dest: Path) -> tuple[float, float]:
    """(cp seconds, cp + sync-of-the-copies seconds)."""
    dest.mkdir(parents=True, exist_ok=True)
    files = shard_files(hf)
    start = time.perf_counter()
    run_measured(["cp", *map(str, files), str(dest)])
    t_cp = time.perf_counter() - start
    run_measured(["sync", *[str(dest / f.name) for f in files]])
    return t_cp, time.perf_counter() - start


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def warm(hf: Path) -> None:
    for f in shard_files(hf):
        with open(f, "rb", buffering=0) as fh:
            while fh.read(64 << 20):
                pass


def cleanup_outputs(*paths: Path) -> None:
    for p in paths:
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    os.sync()        # untimed: the next run must not pay for this one's write-back


def check_expert_bits(hf: Path, gguf: Path) -> str:
    """One routed expert, GGUF vs shard, bit for bit (so the timed output is a real conversion)."""
    from kimi_convert import mxfp4
    from kimi_convert.checkpoint import Checkpoint
    from kimi_convert.gguf_io import open_gguf
    ck, g = Checkpoint(hf), open_gguf(gguf)
    name = next(n for n in g.tensors if n.endswith("ffn_down_exps.weight"))
    bid = int(name.split(".")[1])
    t = g.tensors[name]
    e, rows = t.shape[0] - 1, t.shape[1]
    blocks = t.raw_bytes().reshape(t.shape[0], rows, -1)[e]
    packed, scale = mxfp4.unpack(np.asarray(blocks))
    base = f"language_model.model.layers.{bid}.block_sparse_moe.experts.{e}.w2."
    ok = (np.array_equal(packed, ck.read(ck.tensors[base + "weight_packed"]))
          and np.array_equal(scale, ck.read(ck.tensors[base + "weight_scale"])))
    if not ok:
        raise SystemExit(f"{gguf}: {name} expert {e} does not match the shard bytes")
    return f"{name}[{e}] bit-exact"


# ------------------------------------------------------------------------------------------

def machine() -> str:
    cpu = "?"
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return (f"{os.cpu_count()} cores ({cpu}), {mem / GIB:.0f} GiB RAM, Linux {platform.release()}, "
            f"Python {platform.python_version()}, numpy {np.__version__}")


def fs_of(path: Path) -> str:
    try:
        out = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True).stdout.splitlines()[-1]
        dev, fstype = out.split()[:2]
        return f"{dev} ({fstype})"
    except Exception:
        return "?"


def main(argv=None) -> int:
    global N_EXPERTS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,2.5", help="GB (decimal) of routed-expert bytes per model, e.g. 1,2.5")
    ap.add_argument("--workdir", type=Path, default=Path("/work/bench-tmp"))
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints and outputs")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs of each side per cache state")
    ap.add_argument("--no-drop-caches", action="store_true", help="skip the cold-cache measurement")
    ap.add_argument("--profile", action="store_true", help="also run the converter under cProfile (largest size)")
    ap.add_argument("--experts", type=int, default=N_EXPERTS, help="routed experts per MoE layer")
    a = ap.parse_args(argv)
    N_EXPERTS = BASE_SPEC["num_experts"] = a.experts
    sizes = sorted(float(s) for s in a.sizes.split(","))
    specs = [spec_for(s) for s in sizes]

    # disk: every checkpoint + one converter output + one cp copy of the largest, plus slack
    est = [s.n_layers * N_EXPERTS * EXPERT_BYTES * 1.15 for s in specs]
    need = sum(est) + 2 * max(est) + 1 * GB
    a.workdir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(a.workdir).free
    log(f"machine: {machine()}")
    log(f"workdir: {a.workdir} on {fs_of(a.workdir)}, {free / GB:.1f} GB free, ~{need / GB:.1f} GB needed")
    if free < need:
        raise SystemExit(f"{a.workdir}: not enough free disk ({free / GB:.1f} GB < {need / GB:.1f} GB)")
    root = Path(tempfile.mkdtemp(prefix="bench-", dir=a.workdir))
    try:
        return _bench(a, root, sizes, specs)
    finally:
        if a.keep:
            log(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
            log(f"removed {root}")


def _bench(a, root: Path, sizes, specs) -> int:
    ckpts = []
    for size, spec in zip(sizes, specs):
        hf = root / f"k3-{size:g}gb"
        t0 = time.perf_counter()
        total, expert = write_checkpoint(hf, spec)
        os.sync()
        dt = time.perf_counter() - t0
        log(f"generated {hf.name}: {spec.n_layers} layers ({spec.n_layers - 1} MoE x {N_EXPERTS} experts), "
            f"{len(shard_files(hf))} shards, {total / GB:.2f} GB ({expert / GB:.2f} GB routed experts, "
            f"{100 * expert / total:.0f}%) in {dt:.1f} s ({total / MB / dt:.0f} MB/s incl. sync); "
            f"benchmark process peak RSS so far {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
        ckpts.append((size, hf, total, expert))

    out, copy_dir = root / "out.gguf", root / "cp-copy"
    results = []

    # (b) peak RSS at every size (warm cache; page cache is not RSS)
    for size, hf, total, expert in ckpts:
        warm(hf)
        run, write_s = run_convert(hf, out)
        out_bytes = out.stat().st_size
        check = check_expert_bits(hf, out) if hf == ckpts[-1][1] else ""
        results.append((size, total, expert, out_bytes, run.max_rss))
        log(f"convert {hf.name}: peak RSS {run.max_rss / MIB:.0f} MiB, {out_bytes / GB:.2f} GB out in "
            f"{run.seconds:.1f} s {check}")
        cleanup_outputs(out)

    # (a) throughput vs cp on the largest checkpoint
    size, hf, total, _ = ckpts[-1]
    out_bytes = results[-1][3]
    modes = ["warm"]
    can_drop = drop_caches()
    if a.no_drop_caches:
        log("cold cache: skipped (--no-drop-caches)")
    elif can_drop:
        modes.insert(0, "cold")
    else:
        log("cold cache: NOT measured: writing /proc/sys/vm/drop_caches is not permitted here")
    table = {}
    for mode in modes:
        cp_times, cpsync_times, conv_times, write_times, rss = [], [], [], [], []
        order = [s for i in range(a.repeats) for s in (("cp", "conv") if i % 2 == 0 else ("conv", "cp"))]
        for side in order:
            if mode == "cold":
                drop_caches()
            else:
                warm(hf)
            if side == "cp":
                t_cp, t_cpsync = run_cp(hf, copy_dir)
                cp_times.append(t_cp), cpsync_times.append(t_cpsync)
                log(f"  [{mode}] cp: {t_cp:.2f} s, cp+sync: {t_cpsync:.2f} s ({total / MB / t_cpsync:.0f} MB/s)")
                cleanup_outputs(copy_dir)
            else:
                run, write_s = run_convert(hf, out)
                conv_times.append(run.seconds), rss.append(run.max_rss)
                write_times.append(write_s or float("nan"))
                log(f"  [{mode}] convert: {run.seconds:.2f} s ({out_bytes / MB / run.seconds:.0f} MB/s), "
                    f"write phase {write_s} s, peak RSS {run.max_rss / MIB:.0f} MiB")
                cleanup_outputs(out)
        table[mode] = (min(cp_times), min(cpsync_times), min(conv_times), min(write_times), max(rss))

    if a.profile:
        prof = root / "convert.prof"
        warm(hf)
        run_measured([sys.executable, "-m", "cProfile", "-o", str(prof), "-m", "kimi_convert", str(hf), str(out),
                      "--force"], converter_env())
        import pstats
        log("\ncProfile of the converter (warm cache), top 15 by own time:")
        pstats.Stats(str(prof)).sort_stats("tottime").print_stats(15)
        cleanup_outputs(out)

    # summary
    log("\n=== summary ===")
    log(f"machine: {machine()}; disk {fs_of(root)}")
    log(f"throughput, {hf.name}: {total / GB:.2f} GB of shards -> {out_bytes / GB:.2f} GB GGUF, best of {a.repeats}")
    log(f"{'cache':6} {'cp':>10} {'cp+sync':>10} {'convert':>10} {'write phase':>11}   "
        f"{'vs cp+sync':>10} {'vs cp':>6}")
    for mode, (cp, cps, conv, wr, _) in table.items():
        log(f"{mode:6} {cp:5.2f} s {cps:8.2f} s {conv:8.2f} s {wr:9.2f} s   {cps / conv:9.2f}x {cp / conv:5.2f}x")
        log(f"{'':6} {total / MB / cp:5.0f} MB/s {total / MB / cps:5.0f} MB/s {out_bytes / MB / conv:5.0f} MB/s "
            f"{out_bytes / MB / wr:6.0f} MB/s")
    log("(convert = whole process: start-up, plan, vocabulary, data, fsync; write phase = the converter's own\n"
        " figure for streaming the tensors; ratios are throughput ratios of the whole converter run; the\n"
        " converter fsyncs its output, so the headline ratio charges cp with a sync of its copies too)")
    log("peak RSS of the converter:")
    for size, total, expert, ob, rss in results:
        log(f"  {expert / GB:5.2f} GB routed experts ({total / GB:.2f} GB shards): {rss / MIB:6.0f} MiB")
    growth = results[-1][4] - results[0][4]
    log(f"  growth {growth / MIB:+.0f} MiB for {(results[-1][1] - results[0][1]) / GB:+.2f} GB of shards")
    ratio = min(v[1] / v[2] for v in table.values())
    peak = max(r[4] for r in results)
    log(f"goals: throughput >= 0.8x cp: {'met' if ratio >= 0.8 else 'NOT met'} (worst {ratio:.2f}x); "
        f"peak RSS < 1 GiB: {'met' if peak < GIB else 'NOT met'} ({peak / MIB:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
