"""HF checkpoint -> GGUF: plan everything from the headers, then stream the data once.

`build_plan` reads config.json, the index and every shard header, checks them against
each other and against tensor_map's table, and decides every output tensor (name,
type, shape, bytes, sources, transform) before a single tensor byte is read.
`convert` then writes the plan in order through gguf_io's streaming writer; no tensor
is ever held whole unless it is small (the fused and split ones are a few MB at most).
"""
from __future__ import annotations

import resource
import shutil
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from gguf import GGUF_DEFAULT_ALIGNMENT, LlamaFileType, GGML_QUANT_VERSION
from gguf import GGMLQuantizationType as QT

from . import mxfp4
from .checkpoint import Checkpoint, SourceTensor, f32_to_bf16, to_f32
from .constants import HF_TEXT_PREFIX, tname
from .errors import CheckpointError, OutputError
from .gguf_io import COPY_CHUNK, FileRange, GGUFStreamWriter, OutTensor, tensor_nbytes
from .model import KimiConfig
from .tensor_map import (A_LOG, CONV1D, COPY, EXPERTS, GLOBAL_RULES, K_B, LAYER_KINDS, LAYER_RULES,
                         RES_SCORE, V_B, Rule, expert_sources, gguf_shape, sanitize)

OUTTYPES = {"bf16": QT.BF16, "f32": QT.F32}
FLOAT_DTYPES = ("BF16", "F16", "F32")
BASE_RSS = 200 << 20          # interpreter, numpy, gguf, the vocabulary
READ_AHEAD = 4               # experts requested from the disk ahead of the one being repacked
CAST_CHUNK = 16 << 20         # source bytes cast per chunk (--outtype f32): 4 such chunks in flight


@dataclass
class PlannedTensor:
    rule: Rule
    bid: int | None
    name: str
    qtype: QT
    shape: tuple[int, ...]
    sources: list[tuple[SourceTensor, ...]]   # one tuple per expert for EXPERTS, else one tuple

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.qtype, self.shape)

    @property
    def work_bytes(self) -> int:
        """RAM this tensor's producer needs at once (see _produce)."""
        src = sum(s.nbytes for s in self.sources[0])
        if self.rule.transform == EXPERTS:
            return 12 * src       # read + repack of one expert, up to 4 in flight (Prefetch)
        if self.rule.transform in (COPY, CONV1D):
            same = self.sources[0][0].dtype == _src_dtype(self.qtype)
            return 0 if same else 16 * min(src, CAST_CHUNK)
        return 8 * src + 4 * self.nbytes


@dataclass
class Plan:
    hf_dir: Path
    config: KimiConfig
    checkpoint: Checkpoint
    outtype: str
    tensors: list[PlannedTensor]
    dropped: list[SourceTensor] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def peak_ram_estimate(self) -> int:
        return BASE_RSS + max(t.work_bytes for t in self.tensors)

    def by_group(self) -> dict[str, tuple[int, int]]:
        out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for t in self.tensors:
            out[t.rule.group][0] += 1
            out[t.rule.group][1] += t.nbytes
        return {k: (v[0], v[1]) for k, v in out.items()}

    def n_files(self, split_max_tensors: int = 0, split_max_size: int = 0) -> int:
        """How many split files GGUFWriter will make (same rule: a file gets at least one tensor)."""
        files, count, size = 1, 0, 0
        for t in self.tensors:
            if count and ((split_max_tensors and count >= split_max_tensors)
                          or (split_max_size and size + t.nbytes > split_max_size)):
                files, count, size = files + 1, 0, 0
            count, size = count + 1, size + t.nbytes
        return files


# ------------------------------------------------------------------------------------
# planning

def build_plan(hf_dir: Path, outtype: str = "bf16") -> Plan:
    if outtype not in OUTTYPES:
        raise CheckpointError(f"--outtype {outtype!r}: choose one of {sorted(OUTTYPES)}")
    hf_dir = Path(hf_dir)
    cfg = KimiConfig.from_hf_dir(hf_dir)
    ckpt = Checkpoint(hf_dir)
    text, dropped = {}, []
    for name, t in ckpt.tensors.items():
        canonical = sanitize(name)
        if canonical is None:
            dropped.append(t)
        else:
            text[canonical] = t
    planner = _Planner(cfg, text, outtype, hf_dir)
    tensors = [planner.plan(r, None) for r in GLOBAL_RULES[:1]]
    for il in range(cfg.n_layer):
        tensors += [planner.plan(r, il) for r in LAYER_RULES if LAYER_KINDS[r.when](cfg, il)]
    tensors += [planner.plan(r, None) for r in GLOBAL_RULES[1:]]
    planner.check_all_used()
    return Plan(hf_dir, cfg, ckpt, outtype, tensors, dropped)


class _Planner:
    def __init__(self, cfg: KimiConfig, text: dict[str, SourceTensor], outtype: str, hf_dir: Path):
        self.cfg, self.text, self.outtype, self.hf_dir = cfg, text, outtype, hf_dir
        self.used: set[str] = set()

    def source(self, name: str, needed_for: str) -> SourceTensor:
        t = self.text.get(name)
        if t is None:
            raise CheckpointError(f"{self.hf_dir / 'model.safetensors.index.json'}: tensor "
                                  f"{HF_TEXT_PREFIX}{name} is missing (needed for {needed_for})")
        self.used.add(name)
        return t

    def plan(self, rule: Rule, bid: int | None) -> PlannedTensor:
        c, out_name = self.cfg, tname(rule.gguf, bid)
        if rule.transform == EXPERTS:
            names = expert_sources(rule, bid, c.n_expert, c.experts_mxfp4)
            sources = [tuple(self.source(n, out_name) for n in group) for group in names]
            for group in sources:
                self.check_expert(group, rule.hf_shapes(c)[0])
            qtype = QT.MXFP4 if c.experts_mxfp4 else self.float_type(rule)
        else:
            group = tuple(self.source(n.format(bid=bid), out_name) for n in rule.hf)
            for t, shape in zip(group, rule.hf_shapes(c)):
                self.check_float(t, shape)
            sources, qtype = [group], self.float_type(rule)
        return PlannedTensor(rule, bid, out_name, qtype, gguf_shape(rule, c), sources)

    def float_type(self, rule: Rule) -> QT:
        return QT.F32 if rule.f32 else OUTTYPES[self.outtype]

    def check_float(self, t: SourceTensor, shape: tuple[int, ...]) -> None:
        if t.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{t.path}: tensor {t.name} is {t.dtype}, expected one of {FLOAT_DTYPES}")
        if len(shape) == 1 and shape[0] < 0:      # "at least n" (the padded A_log)
            ok = len(t.shape) == 1 and t.shape[0] >= -shape[0]
            want = f"[>= {-shape[0]}]"
        else:
            ok, want = t.shape == shape, str(list(shape))
        if not ok:
            raise CheckpointError(f"{t.path}: tensor {t.name} has shape {list(t.shape)} "
                                  f"but config.json implies {want}")

    def check_expert(self, group: tuple[SourceTensor, ...], logical: tuple[int, int]) -> None:
        rows, cols = logical
        if len(group) == 1:
            return self.check_float(group[0], logical)
        packed, scale = group
        for t, want in ((packed, (rows, cols // 2)), (scale, (rows, cols // mxfp4.BLOCK))):
            if t.dtype != "U8" or t.shape != want:
                raise CheckpointError(f"{t.path}: tensor {t.name} is {t.dtype}{list(t.shape)}, "
                                      f"config.json implies U8{list(want)}")

    def check_all_used(self) -> None:
        stray = sorted(set(self.text) - self.used)
        if stray:
            t = self.text[stray[0]]
            raise CheckpointError(f"{t.path}: tensor {t.name} has no GGUF mapping for this config "
                                  f"({len(stray)} unmapped); refusing to drop it silently")


# ------------------------------------------------------------------------------------
# producing bytes

def _src_dtype(qtype: QT) -> str:
    return {QT.BF16: "BF16", QT.F32: "F32", QT.F16: "F16"}.get(qtype, "")


def cast(values: np.ndarray, src_dtype: str, qtype: QT) -> np.ndarray:
    """Stored values (BF16 as uint16 bits) -> the bytes of `qtype`; BF16->BF16 is untouched."""
    if src_dtype == _src_dtype(qtype):
        return values
    f = to_f32(values, src_dtype)
    if qtype == QT.F32:
        return f
    if qtype == QT.BF16:
        return f32_to_bf16(f)
    if qtype == QT.F16:
        return f.astype(np.float16)
    raise ValueError(f"cannot cast {src_dtype} to {qtype.name}")


def _produce(p: PlannedTensor, ckpt: Checkpoint, cfg: KimiConfig) -> Iterator:
    tr = p.rule.transform
    if tr in (COPY, CONV1D):
        yield from _copy(p.sources[0][0], p.qtype, ckpt)
    elif tr == RES_SCORE:
        norm, proj = (ckpt.read_f32(t).reshape(-1) for t in p.sources[0])
        yield (norm * proj).astype(np.float32)
    elif tr == A_LOG:
        yield -np.exp(ckpt.read_f32(p.sources[0][0])[:cfg.n_head])
    elif tr in (K_B, V_B):
        yield _split_kv_b(p, ckpt, cfg)
    elif tr == EXPERTS:
        for t in (t for group in p.sources[:READ_AHEAD] for t in group):
            ckpt.will_need(t)
        for e, group in enumerate(p.sources):
            for t in p.sources[e + READ_AHEAD] if e + READ_AHEAD < len(p.sources) else ():
                ckpt.will_need(t)                  # experts are read out of file order: ask early
            if len(group) == 2:
                yield mxfp4.repack(ckpt.map(group[0]), ckpt.map(group[1]))
            else:
                yield from _copy(group[0], p.qtype, ckpt)
    else:
        raise AssertionError(f"unknown transform {tr}")


def _copy(t: SourceTensor, qtype: QT, ckpt: Checkpoint) -> Iterator:
    """Verbatim when the type is unchanged (kernel copy), else a cast in row blocks."""
    if t.dtype == _src_dtype(qtype):
        for off in range(0, t.nbytes, COPY_CHUNK):
            yield FileRange(t.path, t.offset + off, min(COPY_CHUNK, t.nbytes - off))
        return
    row_bytes = t.nbytes // (t.shape[0] if len(t.shape) > 1 else 1)
    rows_per_chunk = max(1, CAST_CHUNK // max(row_bytes, 1))
    n_rows = t.shape[0] if len(t.shape) > 1 else 1
    from .checkpoint import NUMPY_DTYPE
    for r in range(0, n_rows, rows_per_chunk):
        n = min(rows_per_chunk, n_rows - r)
        raw = ckpt.read_raw(t, r * row_bytes, n * row_bytes)
        yield cast(np.frombuffer(raw, dtype=NUMPY_DTYPE[t.dtype]), t.dtype, qtype)


def _split_kv_b(p: PlannedTensor, ckpt: Checkpoint, cfg: KimiConfig) -> np.ndarray:
    """kv_b rows per head are [k_nope (d_n); v (d_v)]: k_b is (H, r, d_n), v_b (H, d_v, r)."""
    t = p.sources[0][0]
    kv = ckpt.read(t).reshape(cfg.n_head, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    if p.rule.transform == K_B:
        part = kv[:, :cfg.qk_nope_head_dim, :].transpose(0, 2, 1)
    else:
        part = kv[:, cfg.qk_nope_head_dim:, :]
    return cast(np.ascontiguousarray(part), t.dtype, p.qtype)


# ------------------------------------------------------------------------------------
# writing

@dataclass
class ConvertResult:
    paths: list[Path]
    n_tensors: int
    n_bytes: int
    seconds: float
    peak_rss: int
    dropped: int
    dropped_bytes: int

    @property
    def throughput(self) -> float:
        return self.n_bytes / max(self.seconds, 1e-9)


def file_type(plan: Plan) -> int:
    if plan.config.experts_mxfp4:
        return LlamaFileType.MOSTLY_MXFP4_MOE
    return LlamaFileType.ALL_F32 if plan.outtype == "f32" else LlamaFileType.MOSTLY_BF16


def check_free_disk(plan: Plan, out: Path) -> None:
    free = shutil.disk_usage(out.parent).free
    need = plan.total_bytes + (64 << 20)
    if free < need:
        raise OutputError(f"{out.parent}: not enough free disk: {need / 2**30:.2f} GiB needed, "
                          f"{free / 2**30:.2f} GiB free")


def convert(plan: Plan, out: Path, *, split_max_tensors: int = 0, split_max_size: int = 0,
            force: bool = False, on_bytes: Callable[[int], None] = lambda n: None) -> ConvertResult:
    from .vocab import load_vocab, write_vocab   # here, so planning needs no vocabulary

    out = Path(out)
    check_free_disk(plan, out)
    cfg, ckpt = plan.config, plan.checkpoint
    vocab = load_vocab(plan.hf_dir, _text_config(plan.hf_dir))
    writer = GGUFStreamWriter(out, cfg.arch, split_max_tensors=split_max_tensors,
                              split_max_size=split_max_size, force=force)
    m = writer.meta
    m.add_name(plan.hf_dir.name)
    m.add_file_type(file_type(plan))
    m.add_quantization_version(GGML_QUANT_VERSION)
    for key, value, vtype, sub in cfg.gguf_metadata():
        writer.add_kv(key, value, vtype, sub)
    write_vocab(vocab, m)
    outs = [OutTensor(t.name, t.qtype, t.shape, (lambda t=t: _produce(t, ckpt, cfg))) for t in plan.tensors]
    start = time.perf_counter()
    paths = writer.write(outs, on_bytes)
    return ConvertResult(paths, len(outs), plan.total_bytes, time.perf_counter() - start, peak_rss(),
                         len(plan.dropped), sum(t.nbytes for t in plan.dropped))


def _text_config(hf_dir: Path) -> dict:
    import json
    raw = json.loads((hf_dir / "config.json").read_text())
    merged = {k: v for k, v in raw.items() if k != "text_config"}
    merged.update(raw.get("text_config") or {})
    return merged


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def group_counts(plan: Plan) -> Counter:
    return Counter(t.rule.group for t in plan.tensors)
