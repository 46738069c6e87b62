"""HF checkpoint -> GGUF: plan everything from the headers, then stream the data once.

`build_plan` reads config.json, the index and every shard header, checks them against
each other and against tensor_map's table, and decides every output tensor (name,
type, shape, bytes, sources, transform) before a single tensor byte is read.
`convert` then writes the plan in order through gguf_io's streaming writer; no tensor
is ever held whole unless it is small (the fused and split ones are a few MB at most).
"""
from __future__ import annotations

import time
from collections import defaultdict
from itertools import chain
from operator import attrgetter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np
from gguf import GGML_QUANT_VERSION, GGUFWriter, LlamaFileType
from gguf import GGMLQuantizationType as QT

from . import mxfp4
from .. import kernel
from .checkpoint import Checkpoint, SourceTensor, checkpoint_inputs
from ..constants import HF_TEXT_PREFIX, tname
from ..errors import CheckpointError, ConfigError
from ..gcutil import gc_paused
from ..memory import peak_rss
from ..gguf_io import (DirectSink, DiskRoom, GGUFStreamWriter, OutTensor, check_free_disk, check_output_paths,
                       check_split_max_size, disk_bytes, disk_room, split_paths, stale_partials, tensor_nbytes,
                       written_paths)
from ..cores import threads_or_all
from ..model import KimiConfig
from ..paths import Input, refuse_overlap
from ..tensor_map import EXPERTS, Rule, expert_sources, gguf_shape, sanitize, stored_type, walk
from .transforms import Experts, repack_pool

if TYPE_CHECKING:
    from ..quant.onepass import OnePass
    from ..quant.plan import PlanOptions
    from ..quant.policy import Policy
    from .vocab import Vocab

OUTTYPES = {"bf16": QT.BF16, "f32": QT.F32}
FLOAT_DTYPES = ("BF16", "F16", "F32")
# The RAM model of a run (docs/performance.md, "Memory"); each figure was measured on the
# real-size sparse checkpoint of kimi_convert.fixtures.real_size (497,220 tensors, 163,840 tokens).
BASE_RSS = 56 << 20           # interpreter, numpy, gguf, typer, rich: 54 MiB for a tiny checkpoint
INDEX_BYTES_PER_TENSOR = 340  # index and plan, per source tensor: 324 B measured from 144k to 497k
VOCAB_BYTES_PER_TOKEN = 320   # token strings, merges and types: 300 B resident, 313 B at the peak of loading
WRITE_BUFFERS = DirectSink.STAGE * DirectSink.BUFFERS   # O_DIRECT staging of a big output (staging_bytes)
_LAYOUT = attrgetter("dtype", "shape")


@dataclass
class PlannedTensor:
    rule: Rule
    bid: int | None
    name: str
    qtype: QT
    shape: tuple[int, ...]
    sources: list[tuple[SourceTensor, ...]]   # one tuple per expert for EXPERTS, else one tuple
    threads: int = 1                          # repack threads (transforms.Experts): Plan.threads

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.qtype, self.shape)

    @property
    def work_bytes(self) -> int:
        """RAM this tensor's producer and its chunks in flight need at once: its transform's figure
        (transforms.py; each measured with tracemalloc on the real widths, test_real_size.py)."""
        return self.rule.transform.work_bytes(self)


@dataclass
class Plan:
    hf_dir: Path
    config: KimiConfig
    checkpoint: Checkpoint
    outtype: str
    tensors: list[PlannedTensor]
    dropped: list[SourceTensor] = field(default_factory=list)
    threads: int = 1            # repack and hash threads (build_plan)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def planning_ram_estimate(self) -> int:
        """Peak RSS of everything before the data: the checkpoint index, the plan and the vocabulary
        (what --dry-run itself needs)."""
        return (BASE_RSS + INDEX_BYTES_PER_TENSOR * len(self.checkpoint.tensors)
                + VOCAB_BYTES_PER_TOKEN * self.config.n_vocab)

    @property
    def peak_ram_estimate(self) -> int:
        """Peak RSS of the run: the planning figure, the write buffers, the repack kernel and the largest
        tensor's work."""
        buffers = DirectSink.staging_bytes(self.total_bytes)      # staging pages are touched as they fill
        return self.planning_ram_estimate + buffers + self.repack_rss + max(t.work_bytes for t in self.tensors)

    @property
    def repack_rss(self) -> int:
        """What loading the MXFP4 repack kernel adds (kernel.load_rss) if the run repacks experts, else 0."""
        repacks = any(t.rule.transform == EXPERTS and len(t.sources[0]) == 2 for t in self.tensors)
        return kernel.load_rss([mxfp4.REPACK_KERNEL]) if repacks else 0

    def by_group(self) -> dict[str, tuple[int, int]]:
        out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for t in self.tensors:
            out[t.rule.group][0] += 1
            out[t.rule.group][1] += t.nbytes
        return {k: (v[0], v[1]) for k, v in out.items()}

    def n_files(self, split_max_tensors: int = 0, split_max_size: int = 0) -> int:
        return count_files([t.nbytes for t in self.tensors], split_max_tensors, split_max_size)


def count_files(sizes: list[int], split_max_tensors: int = 0, split_max_size: int = 0) -> int:
    """How many split files GGUFWriter will make for tensors of these byte sizes, in order (same rule: a file
    gets at least one tensor)."""
    files, count, size = 1, 0, 0
    for n in sizes:
        if count and ((split_max_tensors and count >= split_max_tensors)
                      or (split_max_size and size + n > split_max_size)):
            files, count, size = files + 1, 0, 0
        count, size = count + 1, size + n
    return files


# ------------------------------------------------------------------------------------
# planning

def build_plan(hf_dir: Path, outtype: str = "bf16", threads: int = 0) -> Plan:
    """The conversion of `hf_dir`: each output tensor, its sources and its transform, checked against
    config.json; `threads` (0: every CPU) repack the MXFP4 experts and hash the output."""
    if outtype not in OUTTYPES:
        raise CheckpointError(f"--outtype {outtype!r}: choose one of {sorted(OUTTYPES)}")
    hf_dir = Path(hf_dir)
    if hf_dir.exists() and not hf_dir.is_dir():
        raise ConfigError(f"{hf_dir}: not a folder; give the checkpoint folder (the one holding config.json)")
    cfg = KimiConfig.from_hf_dir(hf_dir)
    ckpt = Checkpoint(hf_dir)
    planner = _Planner(cfg, ckpt.tensors, outtype, hf_dir, threads_or_all(threads))
    with gc_paused():       # 250k source tuples; full collections over the index would find nothing
        tensors = [planner.plan(r, il) for r, il in walk(cfg)]
    planner.check_all_used()
    return Plan(hf_dir, cfg, ckpt, outtype, tensors, planner.dropped, planner.threads)


class _Planner:
    """Looks sources up by canonical name (tensor_map.sanitize) in the checkpoint's own table.

    Names spelled HF_TEXT_PREFIX + canonical (the release's) are found there directly; only other
    spellings get an entry of their own, so the real model's 497k names are not copied (~75 MB).
    The 494,592 routed-expert sources are counted rather than kept in the set of used names: each
    is the source of one expert of one tensor only (a set of them took 16 MiB and a second).
    """

    def __init__(self, cfg: KimiConfig, tensors: dict[str, SourceTensor], outtype: str, hf_dir: Path,
                 threads: int):
        self.cfg, self.tensors, self.outtype, self.hf_dir, self.threads = cfg, tensors, outtype, hf_dir, threads
        self.aliases: dict[str, SourceTensor] = {}
        self.dropped: list[SourceTensor] = []
        # the release's spelling, which sanitize() maps to itself minus the prefix: no entry needed
        release = HF_TEXT_PREFIX + "model."
        for name, t in tensors.items():
            if name.startswith(release):
                continue
            canonical = sanitize(name)
            if canonical is None:
                self.dropped.append(t)
            elif name != HF_TEXT_PREFIX + canonical:
                self.aliases[canonical] = t
        self.used: set[str] = set()     # HF names (the checkpoint's own string objects), experts aside
        self.expert_groups: list[list[tuple[SourceTensor, ...]]] = []    # the experts counted instead
        self.experts_used = 0

    def source(self, name: str, needed_for: str) -> SourceTensor:
        t = self.aliases.get(name) or self.tensors.get(HF_TEXT_PREFIX + name)
        if t is None:
            raise CheckpointError(f"{self.hf_dir / 'model.safetensors.index.json'}: tensor "
                                  f"{HF_TEXT_PREFIX}{name} is missing (needed for {needed_for})")
        self.used.add(t.name)
        return t

    def expert_sources(self, rule: Rule, bid: int, needed_for: str) -> list[tuple[SourceTensor, ...]]:
        """Every expert's sources, checked: source() and check_expert() in bulk, at C speed where the
        checkpoint has the release's names (per tensor, they took 1.7 s of the 2 s plan at the real size)."""
        c = self.cfg
        if self.aliases:            # other spellings: looked up name by name
            names = expert_sources(rule, bid, c.n_expert, c.experts_mxfp4)
            groups = [tuple(self.source(n, needed_for) for n in group) for group in names]
        else:
            names = expert_sources(rule, bid, c.n_expert, c.experts_mxfp4, prefix=HF_TEXT_PREFIX)
            found = list(map(self.tensors.get, chain.from_iterable(names)))
            if not all(found):      # a SourceTensor is true, a missing one None
                for n in chain.from_iterable(names):
                    self.source(n.removeprefix(HF_TEXT_PREFIX), needed_for)   # raises, naming it
            column = iter(found)
            groups = list(zip(*[column] * len(names[0])))
            self.expert_groups.append(groups)
            self.experts_used += len(found)
        logical = rule.hf_shapes(c)[0]
        if c.experts_mxfp4:         # (packed, scale): every expert's layout is one of the 39 shared ones
            rows, cols = logical
            want = (("U8", (rows, cols // 2)), ("U8", (rows, cols // mxfp4.BLOCK)))
            if all({w} == set(map(_LAYOUT, (g[k] for g in groups))) for k, w in enumerate(want)):
                return groups
        for group in groups:
            self.check_expert(group, logical)       # raises, naming the first one that is wrong
        return groups

    def plan(self, rule: Rule, bid: int | None) -> PlannedTensor:
        c, out_name = self.cfg, tname(rule.gguf, bid)
        if rule.transform == EXPERTS:
            sources = self.expert_sources(rule, bid, out_name)
            qtype = stored_type(rule, c, OUTTYPES[self.outtype])
        else:
            group = tuple(self.source(n.format(bid=bid), out_name) for n in rule.hf)
            for t, shape in zip(group, rule.hf_shapes(c)):
                self.check_float(t, shape)
            sources, qtype = [group], stored_type(rule, c, OUTTYPES[self.outtype])
        return PlannedTensor(rule, bid, out_name, qtype, gguf_shape(rule, c), sources, self.threads)

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
        if len(self.used) + self.experts_used + len(self.dropped) == len(self.tensors):
            return
        experts = {t.name for groups in self.expert_groups for group in groups for t in group}
        stray = sorted(((sanitize(t.name), t) for t in self.tensors.values()
                        if t.name not in self.used and t.name not in experts and sanitize(t.name) is not None),
                       key=lambda ct: ct[0])
        t = stray[0][1]
        raise CheckpointError(f"{t.path}: tensor {t.name} has no GGUF mapping for this config "
                              f"({len(stray)} unmapped); refusing to drop it silently")


# ------------------------------------------------------------------------------------
# producing bytes

def _produce(p: PlannedTensor, ckpt: Checkpoint, cfg: KimiConfig) -> Iterator:
    """The tensor's bytes, as its transform makes them (transforms.py)."""
    return p.rule.transform.produce(p, ckpt, cfg)


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


# ------------------------------------------------------------------------------------
# before writing: the checks the run and the dry run share

@dataclass
class Preflight:
    """Everything the run checks before it writes a byte. The dry run is this and nothing more,
    so the two decide alike; only the disk check is left to the caller (exit code 3, after the plan)."""
    finals: list[Path]        # the output file(s)
    vocab: Vocab
    stale: list[Path]         # partial folders of dead processes, which the run removes
    room: DiskRoom


def preflight(plan: Plan, out: Path, *, split_max_tensors: int = 0, split_max_size: int = 0,
              force: bool = False, quant: "OnePass | None" = None) -> Preflight:
    from .vocab import load_vocab     # here, so that planning alone needs no vocabulary
    out = Path(out)
    if split_max_size:
        check_split_max_size(split_max_size)
    sizes = [t.nbytes for t in plan.tensors] if quant is None else quant.sizes
    finals = split_paths(out, count_files(sizes, split_max_tensors, split_max_size))
    refuse_overlap(_run_inputs(plan, quant), written_paths(out, finals))
    check_output_paths(finals, force)
    vocab = load_vocab(plan.hf_dir, _text_config(plan.hf_dir))
    stale = stale_partials(out)
    return Preflight(finals, vocab, stale, disk_room(sum(sizes), out, sum(disk_bytes(p) for p in stale)))


def run_inputs(hf_dir: Path, policy: "Policy | None" = None, imatrix=None) -> list[Input]:
    """Every file a conversion reads: the checkpoint's, and with --policy the policy's files and the imatrix."""
    return [*checkpoint_inputs(hf_dir), *(policy.inputs if policy is not None else ()),
            *([Input(Path(imatrix.path), "imatrix")] if imatrix is not None else [])]


def _run_inputs(plan: Plan, quant: "OnePass | None") -> list[Input]:
    return run_inputs(plan.hf_dir, *((quant.policy, quant.imatrix) if quant is not None else ()))


# ------------------------------------------------------------------------------------
# the quantization hook (kimi-convert --policy): kimi-quantize's decisions and bytes, quant/onepass.py

def plan_policy(plan: Plan, policy: "Policy", options: "PlanOptions | None" = None, *, imatrix=None,
                threads: int = 0) -> "OnePass":
    """The policy applied to what this plan writes (each tensor's name, shape and output type), as kimi-quantize
    applies it to the converted file."""
    from ..quant.mixtures import ModelFacts
    from ..quant.onepass import plan_one_pass
    from ..quant.plan import PlanOptions
    return plan_one_pass(((t.name, t.shape, t.qtype) for t in plan.tensors), policy, options or PlanOptions(),
                         model=ModelFacts.of(plan.config), imatrix=imatrix, threads=threads)


def row_reader(plan: Plan) -> Callable[[str, int], np.ndarray | None]:
    """(tensor, row) -> that one row as the converted file stores it (uint8 bytes of its type), read from the
    checkpoint alone (its transform's row reader), or None for a transform whose rows are only made whole
    (RES_SCORE, A_LOG, K_B, V_B: small tensors). --target-size samples so a few rows of each expert, not the
    checkpoint."""
    by_name = {t.name: t for t in plan.tensors}
    return lambda name, row: by_name[name].rule.transform.row(by_name[name], plan.checkpoint, row)


def producers(plan: Plan) -> dict[str, Callable[[], Iterator]]:
    """Each tensor's producer, by name: what convert() streams into the writer (--target-size samples them)."""
    return {t.name: (lambda t=t: _produce(t, plan.checkpoint, plan.config)) for t in plan.tensors}


def _source_of(plan: Plan) -> Callable[[str, int], str]:
    """(tensor, row) -> "shard: checkpoint tensor" the row was made from (an expert's own tensor)."""
    by_name = {t.name: t for t in plan.tensors}

    def source_of(name: str, row: int) -> str:
        p = by_name[name]
        stacked = p.rule.transform is EXPERTS and len(p.shape) == 3
        source = (Experts.source_of(p, row) if stacked else (p.sources[0], row))[0][0]
        return f"{source.path}: {source.name}"
    return source_of


def one_pass_peak_ram(plan: Plan, quant: "OnePass") -> int:
    """Plan.peak_ram_estimate for the quantized output: the quantizer itself, and each tensor's producer work
    plus, if it is quantized, a chunk's work."""
    work = max(t.work_bytes + quant.chunk_work(i) for i, t in enumerate(plan.tensors))
    buffers = DirectSink.staging_bytes(sum(quant.sizes))
    kernels = max(quant.quantizer_rss, plan.repack_rss)     # one llvmlite for both: 50 MiB measured
    return plan.planning_ram_estimate + buffers + kernels + work


# ------------------------------------------------------------------------------------
# the run

def convert(plan: Plan, out: Path, *, split_max_tensors: int = 0, split_max_size: int = 0,
            force: bool = False, on_bytes: Callable[[int], None] = lambda n: None,
            log: Callable[[str], None] = lambda s: None, quant: "OnePass | None" = None,
            resume: bool = False, manifest: bool = True) -> ConvertResult:
    """Write the plan; with `quant` (plan_policy), every tensor as kimi-quantize would make it from ours.
    `resume`: keep the finished parts of an interrupted run of the same plan (gguf_io.writer)."""
    if quant is not None:
        quant.check_requirements()
    out = Path(out)
    pre = preflight(plan, out, split_max_tensors=split_max_tensors, split_max_size=split_max_size,
                    force=force, quant=quant)
    check_free_disk(pre.room)         # the writer removes (or with `resume` takes over) the stale partials
    cfg, ckpt = plan.config, plan.checkpoint
    imatrix = getattr(quant, "imatrix", None)
    writer = GGUFStreamWriter(out, cfg.arch, split_max_tensors=split_max_tensors,
                              split_max_size=split_max_size, force=force, tool="kimi-convert",
                              inputs=ckpt.shard_paths + ([Path(imatrix.path)] if imatrix is not None else []),
                              settings={"outtype": plan.outtype, "policy": quant.policy.source if quant else "none"},
                              resume=resume, manifest=manifest, reads=_run_inputs(plan, quant), log=log,
                              threads=plan.threads)
    produce = [(lambda t=t: _produce(t, ckpt, cfg)) for t in plan.tensors]
    if plan.repack_rss:
        repack_pool(plan.threads).submit(mxfp4.load_kernel)        # the kernel's load overlaps the tensors before the experts
    if quant is None:
        add_metadata(writer, plan, pre.vocab)
        outs = [OutTensor(t.name, t.qtype, t.shape, p) for t, p in zip(plan.tensors, produce)]
    else:
        for key, value, vtype, sub in quant.metadata(converted_metadata(plan, pre.vocab), file_type(plan)):
            writer.add_kv(key, value, vtype, sub)
        quant.source_of = _source_of(plan)
        outs = quant.out_tensors(produce)
    start = time.perf_counter()
    paths = writer.write(outs, on_bytes)
    return ConvertResult(paths, len(outs), sum(t.nbytes for t in outs), time.perf_counter() - start, peak_rss(),
                         len(plan.dropped), sum(t.nbytes for t in plan.dropped))


def add_metadata(writer: GGUFStreamWriter, plan: Plan, vocab: "Vocab") -> None:
    """Every key of the output: general.*, the model's hyperparameters and the tokenizer
    (also used by kimi_convert.fixtures.real_size for its data-less GGUF of the real model)."""
    write_metadata(writer.meta, plan, vocab)


def write_metadata(m: GGUFWriter, plan: Plan, vocab: "Vocab") -> None:
    from .vocab import write_vocab

    m.add_name(plan.hf_dir.name)
    m.add_file_type(file_type(plan))
    m.add_quantization_version(GGML_QUANT_VERSION)
    for key, value, vtype, sub in plan.config.gguf_metadata():
        m.add_key_value(key, value, vtype, sub)
    write_vocab(vocab, m)


def converted_metadata(plan: Plan, vocab: "Vocab") -> list[tuple]:
    """(key, value, type, element type) of every key a plain conversion writes, in its order: what kimi-quantize
    reads back from our file, and so what the one pass hands to its metadata."""
    m = GGUFWriter(None, plan.config.arch)        # collects keys only: no file
    write_metadata(m, plan, vocab)
    return [(k, v.value, v.type, v.sub_type) for k, v in m.kv_data[0].items()]


def _text_config(hf_dir: Path) -> dict:
    """config.json's text_config over its top level: what the vocabulary reads the special ids from."""
    import json
    raw = json.loads((hf_dir / "config.json").read_text())
    merged = {k: v for k, v in raw.items() if k != "text_config"}
    merged.update(raw.get("text_config") or {})
    return merged
