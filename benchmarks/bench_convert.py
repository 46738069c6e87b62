#!/usr/bin/env python3
"""Converter benchmark (not a test): kimi-convert at the real widths against `cat` and `cp`, and the one pass
(`kimi-convert --policy P`) against the two-pass routes, each on real data written to disk.

    python benchmarks/bench_convert.py [--experts 896] [--layers 1] [--repeats 2] [--caches cold,warm] [--threads 1,2]
    python benchmarks/bench_convert.py --policy k3-native [--experts 256] [--repeats 2] [--caches warm]
        common: [--workdir DIR] [--checkpoint DIR] [--keep] [--baseline OLD_CHECKOUT]

The checkpoint (written here, or --checkpoint: one written by an earlier --keep run): `--layers` MoE layers at
the real K3 widths (hidden 7168, 96 heads, q_lora 1536, kv_lora 512, the last layer MLA, the others KDA), each
with `--experts` routed experts in the real MXFP4 layout (w1/w3 weight_packed U8[3072,1792] + weight_scale
U8[3072,112], w2 U8[3584,1536] + U8[3584,96]: 17.5 MB an expert, 15.7 GB for the real 896), random codes and
E8M0 scales in 118..127, real bytes on disk (no sparse holes); a 1024-token vocabulary (the real one would add
4.7 GB of embeddings). One shard per layer, as the release roughly has (96 shards of ~16 GB).

Without --policy, per cache state, in the order cat, cp, convert, convert, cp, cat, ... (--repeats rounds):
  * `cat SHARDS > /dev/null`;
  * `cp SHARDS COPY/` to the same disk, then `sync` of the copies (the converter fsyncs its output);
  * `kimi-convert HF OUT --force --threads N` for each N of --threads (the experts' repack and the manifest's
    hashing run on N threads; the rate against N, and the rate per CPU-second of the converter, which is what
    a machine of more cores and a faster disk multiplies).
Cache states: cold-ish = the shards' pages dropped from the page cache before each run (posix_fadvise
DONTNEED on these files only, so that the other processes of a shared machine keep theirs; pages another
process holds stay); warm = the shards read before each run. The share of the shards in the page cache at the
start of each run is printed (util-linux `fincore`): on a machine with less free RAM than the shards, warm is
only partly warm. Speed ratios are time ratios on the same shards (cat / convert: 1.0 = as fast as cat).

With --policy P (warm, unless --caches says otherwise), in one run, the routes in turn:
  * one pass: `kimi-convert HF OUT --policy P --force`;
  * `kimi-convert HF MID` + `kimi-quantize MID OUT --policy P`;
  * `kimi-convert HF MID` + llama.cpp's quantizer (`interop.llama_quantize`: llama_model_quantize, 2 threads,
    Q8_0 with --tensor-type overrides that give every tensor the one pass's type, checked afterwards);
  * `cp -r` of the checkpoint folder + `sync`.
The routes run in turn, the one pass first; each output is checked against the first one pass's: kimi-quantize's
by its manifest (the same bytes, header and tensors), llama.cpp's tensor by tensor (types, SHA-256). Ratios: the best two-pass
route's time over the one pass's; the one pass's over cp's.

Every command is its own child process: wall time and CPU time (user + sys) from os.wait4, peak RSS from
/usr/bin/time (run_measured says why), each that run's alone; a two-command route sums the times and takes the
larger RSS. The best time of each side
is kept. Outputs are deleted (and synced) between runs, untimed; everything under the work folder at the end
unless --keep.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kimi_convert.fixtures import make_checkpoint as fx  # noqa: E402  (tensor_plan, config and tokenizer writers)

REAL_WIDTHS = dict(arch="k3", hidden=7168, n_heads=96, kda_head_dim=128, q_lora_rank=1536, kv_lora_rank=512,
                   qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, moe_intermediate_size=3072,
                   routed_expert_hidden_size=3584, num_experts_per_token=16, num_shared_experts=2,
                   attn_res_block_size=12, first_k_dense_replace=0, experts_mxfp4=True, seed=0)
GEN_CHUNK = 1 << 22        # elements per generated block of a big float tensor
GB, MB, GIB, MIB = 1e9, 1e6, 1 << 30, 1 << 20


def log(msg: str = "") -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------------------------------
# checkpoint generation

def spec_for(n_layers: int, n_experts: int) -> "fx.FixtureSpec":
    widths = dict(REAL_WIDTHS, num_experts_per_token=min(REAL_WIDTHS["num_experts_per_token"], n_experts))
    return fx.FixtureSpec(**widths, n_layers=n_layers, num_experts=n_experts, n_shards=n_layers + 3)


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


def expert_bytes(spec) -> int:
    return sum(math.prod(t.shape) for t in fx.tensor_plan(spec) if t.init in ("mx_packed", "mx_scale"))


# ------------------------------------------------------------------------------------------
# measuring

@dataclass
class Run:
    seconds: float
    cpu: float            # user + sys, seconds
    max_rss: int          # bytes
    stderr: str = ""

    def __add__(self, other: "Run") -> "Run":
        return Run(self.seconds + other.seconds, self.cpu + other.cpu, max(self.max_rss, other.max_rss),
                   self.stderr + other.stderr)


def run_measured(cmd: list[str], env=None) -> Run:
    """Wall time and CPU time (os.wait4 on the child) and the command's own peak RSS.

    The RSS comes from /usr/bin/time, which forks the command from its own small process: Linux carries a
    process's peak RSS over exec, so a command started from this (larger) process would report this one's
    peak as its own (and os.wait4's ru_maxrss with it)."""
    with tempfile.TemporaryFile("w+") as err, tempfile.NamedTemporaryFile("r") as rss:
        start = time.perf_counter()
        p = subprocess.Popen(["/usr/bin/time", "-f", "%M", "-o", rss.name, *map(str, cmd)],
                             stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=REPO)
        _, status, usage = os.wait4(p.pid, 0)
        seconds = time.perf_counter() - start
        err.seek(0)
        run = Run(seconds, usage.ru_utime + usage.ru_stime, int(rss.read().split()[-1]) * 1024, err.read())
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{' '.join(map(str, cmd))} failed ({os.waitstatus_to_exitcode(status)}):\n"
                         f"{run.stderr[-3000:]}")
    return run


def tool_env(repo: Path = REPO) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(repo) + os.pathsep + env.get("PYTHONPATH", "")
    env["COLUMNS"] = "200"
    return env


def kimi_convert(hf: Path, out: Path, *extra: str) -> Run:
    return run_measured([sys.executable, "-m", "kimi_convert", str(hf), str(out), "--force", *extra], tool_env())


def kimi_quantize(src: Path, out: Path, policy: str) -> Run:
    code = "import sys; from kimi_convert.cli.quantize import main; sys.argv[0] = 'kimi-quantize'; main()"
    return run_measured([sys.executable, "-c", code, str(src), str(out), "--policy", policy, "--force"],
                        tool_env())


def llama_quantize(src: Path, out: Path, ftype: int, tensor_types: list[tuple[str, int]]) -> Run:
    code = ("import json, sys; from kimi_interop.llama_cpp import llama_quantize; "
            "a = json.loads(sys.argv[1]); "
            "llama_quantize(a['src'], a['out'], a['ftype'], pure=True, threads=2, "
            "tensor_types=[tuple(t) for t in a['types']])")
    args = json.dumps({"src": str(src), "out": str(out), "ftype": ftype, "types": tensor_types})
    return run_measured([sys.executable, "-c", code, args], tool_env())


def cat(files: list[Path]) -> Run:
    return run_measured(["cat", *map(str, files)])         # stdout: /dev/null


def cp_sync(sources: list[Path], dest: Path, recursive: bool = False) -> Run:
    """cp of the shard files (or -r of the folder) to the same disk, then sync of the copies."""
    if recursive:
        copied = run_measured(["cp", "-r", str(sources[0]), str(dest)])
        files = [p for p in dest.rglob("*") if p.is_file()]
    else:
        dest.mkdir(parents=True, exist_ok=True)
        copied = run_measured(["cp", *map(str, sources), str(dest)])
        files = [dest / f.name for f in sources]
    return copied + run_measured(["sync", *map(str, files)])


def drop_from_cache(files: list[Path]) -> None:
    """Evict these files' clean pages (only theirs: the rest of the page cache is left alone)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_into_cache(files: list[Path]) -> None:
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.read(64 << 20):
                pass


def resident(files: list[Path]) -> float:
    """Share of the files' bytes in the page cache (util-linux fincore), or nan if it cannot tell."""
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *map(str, files)],
                             capture_output=True, text=True, check=True).stdout
        return sum(int(x) for x in out.split()) / sum(f.stat().st_size for f in files)
    except (OSError, subprocess.CalledProcessError, ValueError):
        return float("nan")


def remove(*paths: Path) -> None:
    for p in paths:
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
        manifest = p.with_name(p.name + ".manifest.json")
        if manifest.exists():
            manifest.unlink()
    os.sync()        # untimed: the next run must not pay for this one's write-back


def check_expert_bits(hf: Path, gguf: Path) -> str:
    """One routed expert, GGUF vs shard, bit for bit (so the timed output is a real conversion)."""
    from kimi_convert.convert import mxfp4
    from kimi_convert.convert.checkpoint import Checkpoint
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
# the two comparisons

@dataclass
class Side:
    runs: list[Run] = field(default_factory=list)
    warmth: list[float] = field(default_factory=list)

    @property
    def best(self) -> Run:
        return min(self.runs, key=lambda r: r.seconds)

    @property
    def median(self) -> float:
        return float(np.median([r.seconds for r in self.runs]))


def prepare(cache: str, files: list[Path]) -> float:
    if cache == "cold":
        drop_from_cache(files)
    else:
        read_into_cache(files)
    return resident(files)


def bench_converter(a, hf: Path, root: Path, in_bytes: int) -> dict[str, dict[str, Side]]:
    files, out, copy_dir = shard_files(hf), root / "out.gguf", root / "cp-copy"
    table: dict[str, dict[str, Side]] = {}
    for cache in a.caches:
        sides = table[cache] = {"cat": Side(), "cp + sync": Side(),
                                **{f"kimi-convert -t{n}": Side() for n in a.threads},
                                **({"baseline": Side()} if a.baseline else {})}
        order = [s for i in range(a.repeats) for s in (list(sides) if i % 2 == 0 else list(sides)[::-1])]
        for name in order:
            warmth = prepare(cache, files)
            if name == "cat":
                run = cat(files)
            elif name == "cp + sync":
                run = cp_sync(files, copy_dir)
            elif name == "baseline":
                run = run_measured([sys.executable, "-m", "kimi_convert", str(hf), str(out), "--force"],
                                   tool_env(a.baseline))
            else:
                run = kimi_convert(hf, out, "--threads", name.rsplit("-t", 1)[1])
                log(f"    {check_expert_bits(hf, out)}")
            remove(out, copy_dir)
            sides[name].runs.append(run)
            sides[name].warmth.append(warmth)
            log(f"  [{cache}, {100 * warmth:.0f}% cached] {name:17} {run.seconds:7.2f} s wall "
                f"({in_bytes / MB / run.seconds:5.0f} MB/s), CPU {run.cpu:6.2f} s, peak RSS {run.max_rss / MIB:5.0f} MiB")
    return table


def summarize_converter(table: dict[str, dict[str, Side]], in_bytes: int, out_bytes: int) -> None:
    log(f"\nshards {in_bytes / GB:.2f} GB -> GGUF {out_bytes / GB:.2f} GB; best run of each side (and the median "
        f"wall time of its runs); MB/s of shard bytes")
    log(f"{'cache':6} {'side':17} {'wall':>9} {'median':>9} {'MB/s':>6} {'CPU':>8} {'RSS':>8}  {'cached':>6}")
    for cache, sides in table.items():
        for name, side in sides.items():
            r = side.best
            log(f"{cache:6} {name:17} {r.seconds:7.2f} s {side.median:7.2f} s {in_bytes / MB / r.seconds:6.0f} "
                f"{r.cpu:6.2f} s {r.max_rss / MIB:5.0f} MiB  {100 * side.warmth[side.runs.index(r)]:5.0f}%")
        for name in (n for n in sides if n.startswith("kimi-convert") or n == "baseline"):
            conv, conv_m, cpu = sides[name].best.seconds, sides[name].median, sides[name].best.cpu
            log(f"{cache:6} {name} at {sides['cat'].best.seconds / conv:.2f}x of cat's speed, "
                f"{sides['cp + sync'].best.seconds / conv:.2f}x of cp + sync's (medians: "
                f"{sides['cat'].median / conv_m:.2f}x, {sides['cp + sync'].median / conv_m:.2f}x); "
                f"{in_bytes / MB / cpu:.0f} MB per CPU-second (user + sys)")
        names = [n for n in sides if n == "baseline"] + [n for n in sides if n.startswith("kimi-convert")]
        if len(names) > 1:
            base = sides[names[0]].best.seconds
            log(f"{cache:6} speed-up over {names[0]}: " + ", ".join(
                f"{n} {base / sides[n].best.seconds:.2f}x" for n in names[1:]))


def manifest_of(out: Path):
    """What the writer's manifest says of `out`: each file's size and header hash, each tensor's entry (name,
    type, shape, offset, size, SHA-256). Two outputs with equal manifests hold the same bytes."""
    from kimi_convert.gguf_io import load_manifest, manifest_path
    return tuple((f.size, f.header_sha256, tuple(f.tensors)) for f in load_manifest(manifest_path(out)).files)


def tensor_digests(gguf: Path) -> dict[str, tuple[str, str]]:
    """name -> (type, SHA-256 of its bytes) of any GGUF (llama.cpp's output has no manifest), 64 MB at a time."""
    import hashlib

    from kimi_convert.gguf_io import open_gguf
    out = {}
    for n, t in open_gguf(gguf).tensors.items():
        h, raw = hashlib.sha256(), t.raw_bytes().reshape(-1)
        for i in range(0, raw.size, 64 << 20):
            h.update(raw[i:i + (64 << 20)])
        out[n] = (t.qtype.name, h.hexdigest())
    return out


def llama_overrides(one_pass: Path) -> list[tuple[str, int]]:
    """--tensor-type overrides giving llama-quantize (default Q8_0) the one pass's type for every tensor it
    would make Q8_0 otherwise: exact names; the F32 ones it never quantizes anyway."""
    from gguf import GGMLQuantizationType as QT

    from kimi_convert.gguf_io import open_gguf
    return [(f"^{re.escape(n)}$", int(t.qtype)) for n, t in open_gguf(one_pass).tensors.items()
            if t.qtype not in (QT.Q8_0, QT.F32)]


def bench_policy(a, hf: Path, root: Path) -> dict[str, dict[str, Side]]:
    """The routes in turn (the one pass first, whose manifest the others are checked against); only one
    route's files are on disk at a time."""
    from gguf import GGMLQuantizationType as QT

    from kimi_convert.quant.driver import FILE_TYPE
    files, out, mid, copy_dir = shard_files(hf), root / "one.gguf", root / "mid.gguf", root / "cp-copy"
    routes = ["one pass", "convert + kimi-quantize", "convert + llama.cpp", "cp -r + sync"]
    ref = None                  # (manifest, {tensor: (type, sha256)}, llama overrides) of the first one pass
    table: dict[str, dict[str, Side]] = {}
    for cache in a.caches:
        sides = table[cache] = {r: Side() for r in routes}
        order = [s for i in range(a.repeats) for s in (routes if i % 2 == 0 else routes[::-1])]
        for name in order:
            warmth = prepare(cache, files)
            if name == "one pass":
                run = kimi_convert(hf, out, "--policy", a.policy)
                if ref is None:
                    m = manifest_of(out)
                    ref = (m, {t.name: (t.type, t.sha256) for f in m for t in f[2]}, llama_overrides(out))
                check = "the same bytes as the first one pass" if manifest_of(out) == ref[0] else "DIFFERS"
            elif name == "convert + kimi-quantize":
                run = kimi_convert(hf, mid) + kimi_quantize(mid, out, a.policy)
                check = "the same bytes as the one pass" if manifest_of(out) == ref[0] else "DIFFERS from the one pass"
            elif name == "convert + llama.cpp":
                run = kimi_convert(hf, mid) + llama_quantize(mid, out, int(FILE_TYPE[QT.Q8_0]), ref[2])
                theirs = tensor_digests(out)
                types_equal = {n: v[0] for n, v in theirs.items()} == {n: v[0] for n, v in ref[1].items()}
                equal = sum(theirs.get(n) == v for n, v in ref[1].items())
                check = (f"types {'equal' if types_equal else 'DIFFER: ' + str(_type_diff(ref[1], theirs))}, "
                         f"{equal}/{len(ref[1])} tensors byte-equal to the one pass's")
            else:
                run = cp_sync([hf], copy_dir, recursive=True)
                check = ""
            remove(out, mid, copy_dir)
            sides[name].runs.append(run)
            sides[name].warmth.append(warmth)
            log(f"  [{cache}, {100 * warmth:.0f}% cached] {name:24} {run.seconds:7.2f} s wall, CPU {run.cpu:6.2f} s, "
                f"peak RSS {run.max_rss / MIB:5.0f} MiB  {check}")
    return table


def _type_diff(ours: dict[str, tuple], theirs: dict[str, tuple]) -> list[str]:
    return [f"{n}: {t[0]} vs {theirs.get(n, ('-',))[0]}" for n, t in ours.items()
            if theirs.get(n, ("-",))[0] != t[0]][:5]


def summarize_policy(table: dict[str, dict[str, Side]], policy: str, in_bytes: int) -> None:
    log(f"\n--policy {policy}: shards {in_bytes / GB:.2f} GB; best run of each route (and the median wall time)")
    log(f"{'cache':6} {'route':24} {'wall':>9} {'median':>9} {'CPU':>8} {'peak RSS':>9}")
    for cache, sides in table.items():
        for name, side in sides.items():
            r = side.best
            log(f"{cache:6} {name:24} {r.seconds:7.2f} s {side.median:7.2f} s {r.cpu:6.2f} s "
                f"{r.max_rss / MIB:6.0f} MiB")
        two_pass = ("convert + kimi-quantize", "convert + llama.cpp")
        one, one_m = sides["one pass"].best.seconds, sides["one pass"].median
        two, two_m = min(sides[r].best.seconds for r in two_pass), min(sides[r].median for r in two_pass)
        cp, cp_m = sides["cp -r + sync"].best.seconds, sides["cp -r + sync"].median
        log(f"{cache:6} the best two-pass route takes {two / one:.2f}x the one pass's time (goal >= 1.8); "
            f"the one pass {one / cp:.2f}x cp's (goal <= 1.25); medians: {two_m / one_m:.2f}x, {one_m / cp_m:.2f}x")


# ------------------------------------------------------------------------------------------

def machine() -> str:
    cpu = "?"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return (f"{os.cpu_count()} cores ({cpu}), {mem / GIB:.0f} GiB RAM, Linux {platform.release()}, "
            f"Python {platform.python_version()}, numpy {np.__version__}; load average {os.getloadavg()[0]:.1f}")


def fs_of(path: Path) -> str:
    try:
        out = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True).stdout.splitlines()[-1]
        dev, fstype = out.split()[:2]
        return f"{dev} ({fstype})"
    except Exception:
        return "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", help="compare the one pass with this policy against the two-pass routes")
    ap.add_argument("--experts", type=int, help="routed experts per MoE layer (default 896; 256 with --policy)")
    ap.add_argument("--layers", type=int, default=1, help="MoE layers at the real widths (one shard each)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs of each side per cache state")
    ap.add_argument("--caches", help="cold,warm (default; warm with --policy)")
    ap.add_argument("--threads", default="1,2", help="kimi-convert --threads values to time (default 1,2)")
    ap.add_argument("--baseline", type=Path, help="also time the kimi-convert of this checkout (a git worktree "
                    "of an earlier commit, say), with its defaults: the same shards, interleaved")
    ap.add_argument("--workdir", type=Path, default=Path("/work/bench-tmp"))
    ap.add_argument("--checkpoint", type=Path, help="use this checkpoint (written by an earlier --keep run)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint written here")
    a = ap.parse_args(argv)
    a.experts = a.experts or (256 if a.policy else 896)
    a.caches = (a.caches or ("warm" if a.policy else "cold,warm")).split(",")
    a.threads = [int(n) for n in a.threads.split(",")]
    spec = spec_for(a.layers, a.experts)

    a.workdir.mkdir(parents=True, exist_ok=True)
    shard_est = expert_bytes(spec) * 1.06 + 0.85e9 * a.layers
    outputs = 2 if a.policy else 1          # a two-pass route's two files; or one output (or copy)
    need = (0 if a.checkpoint else shard_est) + outputs * shard_est + 1e9
    free = shutil.disk_usage(a.workdir).free
    log(f"machine: {machine()}")
    log(f"workdir: {a.workdir} on {fs_of(a.workdir)}, {free / GB:.1f} GB free, ~{need / GB:.1f} GB needed")
    if free < need:
        raise SystemExit(f"{a.workdir}: not enough free disk ({free / GB:.1f} GB < {need / GB:.1f} GB); "
                         f"use fewer --experts")
    root = Path(tempfile.mkdtemp(prefix="bench-", dir=a.workdir))
    try:
        hf = a.checkpoint or generate(root / f"k3-{a.layers}x{a.experts}", spec)
        in_bytes = sum(f.stat().st_size for f in shard_files(hf))
        if a.policy:
            summarize_policy(bench_policy(a, hf, root), a.policy, in_bytes)
        else:
            table = bench_converter(a, hf, root, in_bytes)
            out_bytes = _converted_bytes(hf)
            summarize_converter(table, in_bytes, out_bytes)
        log(f"load average at the end: {os.getloadavg()[0]:.1f}")
        return 0
    finally:
        if a.keep:
            log(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
            log(f"removed {root}")


def generate(hf: Path, spec) -> Path:
    t0 = time.perf_counter()
    total, expert = write_checkpoint(hf, spec)
    os.sync()
    dt = time.perf_counter() - t0
    log(f"generated {hf.name}: {spec.n_layers} MoE layer(s) x {spec.num_experts} experts at the real widths, "
        f"{len(shard_files(hf))} shards, {total / GB:.2f} GB ({expert / GB:.2f} GB routed experts) in {dt:.0f} s")
    return hf


def _converted_bytes(hf: Path) -> int:
    from kimi_convert.convert.converter import build_plan
    return build_plan(hf).total_bytes


if __name__ == "__main__":
    sys.exit(main())
