"""GGUF -> quantized GGUF: plan from the headers, then stream tensor by tensor through gguf_io's writer.

Copied tensors (protected, `keep`, or already of the target type) go through as file ranges, byte for byte.
A quantized tensor is read in row chunks that never cross an expert, dequantized to float32 as llama-quantize
does (its `to_float`), quantized by the kernel of its target type with that expert's slice of the imatrix,
and checked as `ggml_validate_row_data` checks it; no tensor is held whole. Metadata: every input key with its
value type, `general.file_type` and `general.quantization_version` set, `split.*` dropped (the writer adds its
own), and `quantize.imatrix.*` as llama-quantize writes them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
from gguf import GGML_QUANT_VERSION, GGUFValueType, LlamaFileType
from gguf import GGMLQuantizationType as QT

from ..errors import CheckpointError
from ..gguf_io import (Chunk, GGUFFile, GGUFStreamWriter, GGUFTensor, OutTensor, check_free_disk,
                       check_output_paths, check_split_max_size, disk_bytes, disk_room, gguf_inputs, iter_chunks_of,
                       open_gguf, split_paths, stale_partials, written_paths)
from ..paths import Input, Report, refuse_overlap
from ..model import KimiConfig
from ..tensor_map import ggml_n_dims, gguf_group
from .imatrix import Imatrix, coverage_lines
from .mixtures import PURE_FILE_TYPE, ModelFacts
from .plan import (Decision, NonFiniteWeightError, PlanOptions, QuantizeError, QuantPlan, check_can_write,
                   plan_quantization)
from .policy import Policy

CHUNK_VALUES = 4 << 20          # float32 values dequantized per chunk (16 MiB), whole rows
SKIPPED_KEYS = ("GGUF.", "split.")

# llama-quantize's file type for a default type: the file type of that name ("Q4_K" is Q4_K_M, "Q3_K" Q3_K_M, ...);
# MXFP4 is MXFP4_MOE's default. NVFP4 is no llama-quantize file type (llama_ftype_get_default_type has none:
# "invalid output file type"): MOSTLY_NVFP4 is what llama.cpp's converter writes for an NVFP4 checkpoint
# (conversion/base.py) and what its loader guesses for a file that is mostly NVFP4 (llama-model-loader.cpp).
FILE_TYPE = {**PURE_FILE_TYPE, QT.MXFP4: LlamaFileType.MOSTLY_MXFP4_MOE, QT.NVFP4: LlamaFileType.MOSTLY_NVFP4}


@dataclass
class QuantizeResult:
    paths: list[Path]
    plan: QuantPlan
    seconds: float
    notes: list[str] = field(default_factory=list)


def file_type(policy: Policy, stored: int) -> int:
    """The mixture's llama file type, or the default type's; `keep` keeps the input's (`stored`). A default
    no file type is named after (MXFP4) is GUESSED."""
    if policy.mixture is not None:
        return policy.mixture.ftype
    if policy.default is None:
        return int(stored)
    return int(FILE_TYPE.get(policy.default, LlamaFileType.GUESSED))


def stored_file_type(gf: GGUFFile) -> int:
    return int(gf.fields.get("general.file_type", LlamaFileType.GUESSED))


def plan_file(gf: GGUFFile, policy: Policy, options: PlanOptions = PlanOptions(), *,
              imatrix: bool = False) -> QuantPlan:
    """The plan of file `gf`; `imatrix`: whether the run has one (a mixture's choices may depend on it)."""
    config = KimiConfig.from_gguf(gf.fields, gf.paths[0])     # a kimi-k3 / kimi-k31 file, or a clear error
    if not gf.tensors:                       # valid GGUF (a vocabulary-only file, say), but nothing to quantize
        raise CheckpointError(f"{gf.paths[0]}: holds no tensors: a {gf.arch} GGUF with no tensors is not a model")
    return plan_quantization(((t.name, t.shape, t.qtype) for t in gf.tensors.values()), policy, options,
                             model=ModelFacts.of(config), imatrix=imatrix)


def stored_metadata(gf: GGUFFile) -> Iterator[tuple]:
    """(key, value, type, element type) of every key of the input file, in its order."""
    for k, v in gf.fields.items():
        yield (k, v, *gf.types[k])


def metadata(stored: Iterable[tuple], ftype: int, extra: list[tuple[str, object, GGUFValueType]]) -> list[tuple]:
    """(key, value, type, element type) for the output, from the input's keys (`stored`, same tuples) in their
    order; set keys move to the end, as llama-quantize's gguf_set_val does. The one-pass converter passes
    the keys it would have written, so its file's keys are those of this command on the converted file."""
    set_here = {"general.file_type": (ftype, GGUFValueType.UINT32),
                "general.quantization_version": (GGML_QUANT_VERSION, GGUFValueType.UINT32)}
    set_here.update({k: (v, t) for k, v, t in extra})
    out = []
    for k, v, vtype, sub in stored:
        if k.startswith(SKIPPED_KEYS) or k == "general.architecture" or k in set_here:
            continue
        out.append((k, v, vtype, sub))
    return out + [(k, v, t, None) for k, (v, t) in set_here.items()]


def quantize_file(src: Path, out: Path, policy: Policy, options: PlanOptions = PlanOptions(), *,
                  imatrix: Imatrix | None = None, force: bool = False, split_max_size: int = 0,
                  keep_split: bool = False, threads: int = 0, on_bytes: Callable[[int], None] = lambda n: None,
                  log: Callable[[str], None] = lambda s: None, resume: bool = False,
                  reports: Iterable[tuple[Report, str]] = ()) -> QuantizeResult:
    """`reports`: (report, its text), renamed into place with the output, or not at all."""
    policy.check_requirements(imatrix=imatrix is not None, allow_requantize=options.allow_requantize)
    gf = open_gguf(Path(src))
    plan = plan_file(gf, policy, options, imatrix=imatrix is not None)
    return write_plan(gf, plan, out, policy, imatrix=imatrix, force=force, split_max_size=split_max_size,
                      keep_split=keep_split, threads=threads, on_bytes=on_bytes, log=log, resume=resume,
                      reports=reports)


def write_plan(gf: GGUFFile, plan: QuantPlan, out: Path, policy: Policy, *, imatrix: Imatrix | None = None,
               force: bool = False, split_max_size: int = 0, keep_split: bool = False, threads: int = 0,
               on_bytes: Callable[[int], None] = lambda n: None, log: Callable[[str], None] = lambda s: None,
               resume: bool = False, reports: Iterable[tuple[Report, str]] = ()) -> QuantizeResult:
    """Write `plan` (plan_file of the open input `gf` by `policy`) into `out`: what quantize_file does once the
    input is open and planned, so a caller that has planned already (kimi-quantize) opens and plans it once."""
    reports = list(reports)
    reads = run_inputs(gf.paths[0], policy, imatrix)
    notes: list[str] = []
    vectors = imatrix_vectors(plan, imatrix, notes) if imatrix is not None else {}
    check_can_write(plan, vectors.shapes if imatrix is not None else None, imatrix.path if imatrix is not None else "")
    preflight(gf, plan, Path(out), force=force, split_max_size=split_max_size, log=log, keep_split=keep_split,
              reads=reads, reports=[r for r, _ in reports])
    extra = imatrix.metadata() if imatrix is not None else []
    writer = GGUFStreamWriter(Path(out), gf.arch, split_max_size=split_max_size, force=force, tool="kimi-quantize",
                              inputs=gf.paths + ([Path(imatrix.path)] if imatrix is not None else []),
                              settings={"policy": policy.source, "keep-split": "yes" if keep_split else "no"},
                              resume=resume, reads=reads, reports=reports, log=log, threads=threads)
    for key, value, vtype, sub in metadata(stored_metadata(gf), file_type(policy, stored_file_type(gf)), extra):
        writer.add_kv(key, value, vtype, sub)
    part = {p: i for i, p in enumerate(gf.paths)}
    from .blocks import default_threads, load_kernels     # noqa: PLC0415  (the kernels: only when quantizing)
    threads = threads or default_threads()
    load_kernels((d.source, d.target, imatrix is not None) for d in plan.decisions if not d.copied)
    tensors = [OutTensor(d.name, d.target, ggml_shape(d.shape),
                         (lambda d=d: chunks(d, gf.tensors[d.name], vectors.get(d.name), threads)),
                         part[gf.tensors[d.name].path] if keep_split else None)
               for d in plan.decisions]
    start = time.perf_counter()
    paths = writer.write(tensors, on_bytes)
    return QuantizeResult(paths, plan, time.perf_counter() - start, notes)


def ggml_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape as llama-quantize stores it: ggml_n_dims dimensions, trailing 1s of ne (leading 1s here) dropped."""
    return shape[len(shape) - ggml_n_dims(shape):]


def run_inputs(src: Path, policy: Policy, imatrix: Imatrix | None = None) -> list[Input]:
    """Every file a run of kimi-quantize reads: the GGUF (all its parts), the policy's files, the imatrix."""
    return [*gguf_inputs(src), *policy.inputs, *([Input(Path(imatrix.path), "imatrix")] if imatrix is not None else [])]


def preflight(gf: GGUFFile, plan: QuantPlan, out: Path, *, force: bool, split_max_size: int,
              log: Callable[[str], None], keep_split: bool = False, reads: Iterable[Input] = (),
              reports: Iterable[Report] = ()) -> None:
    """What the run checks before it writes a byte (the converter's checks, from the one GGUF layer). The
    split parts that --split-max-size makes are known only to the writer, which checks them again."""
    if split_max_size:
        check_split_max_size(split_max_size)
    finals = split_paths(out, len(gf.paths)) if keep_split else [out]
    refuse_overlap(reads, written_paths(out, finals, reports))
    check_output_paths(finals, force)
    stale = stale_partials(out)       # the writer removes them (or, resuming, takes one over)
    check_free_disk(disk_room(plan.target_bytes, out, sum(disk_bytes(p) for p in stale)))


def imatrix_coverage(plan: QuantPlan, imatrix: Imatrix) -> list[str]:
    """Per layer, how many experts of each quantized tensor had no data (llama.cpp: quantized with 1.0)."""
    return coverage_lines(imatrix.coverage((d.name, d.shape) for d in plan.decisions if not d.copied))


class ImatrixVectors:
    """The imatrix vector of every tensor that is quantized, validated against its shape up front as
    llama-quantize does for every one (Q8_0 then ignores it), and read from the file only when `get` asks
    for it: a K3 imatrix is GBs, and a run holds one tensor's vector at a time."""

    def __init__(self, plan: QuantPlan, imatrix: Imatrix, notes: list[str]):
        self.imatrix = imatrix
        self.shapes = {d.name: d.shape for d in plan.decisions
                       if not d.copied and imatrix.has_vector(d.name, d.shape, on_skip=notes.append)}

    def get(self, name: str) -> np.ndarray | None:
        return self.imatrix.vector(name, self.shapes[name]) if name in self.shapes else None


def imatrix_vectors(plan: QuantPlan, imatrix: Imatrix, notes: list[str]) -> ImatrixVectors:
    return ImatrixVectors(plan, imatrix, notes)


def chunks(d: Decision, t: GGUFTensor, imatrix: np.ndarray | None, threads: int) -> Iterator:
    """The output bytes of one tensor: its stored bytes, or its quantized rows chunk by chunk."""
    buf = np.empty(0, np.uint8)

    def rows(a: int, b: int) -> np.ndarray:        # one stored row per row, values or block bytes
        nonlocal buf
        if buf.size < (b - a) * t.row_nbytes:
            buf = np.empty((b - a) * t.row_nbytes, np.uint8)
        return t.read_rows(a, b, buf)
    try:
        yield from tensor_chunks(d, lambda: iter_chunks_of(t), rows, imatrix, threads, source=t.qtype, across=True)
    except QuantizeError as e:          # the line names the file the tensor is in
        raise QuantizeError(f"{t.path}: {e}") from None


def tensor_chunks(d: Decision, stored: Callable[[], Iterable[Chunk]], rows: Callable[[int, int], np.ndarray],
                  imatrix: np.ndarray | None, threads: int, source: QT = QT.F32,
                  across: bool = False) -> Iterator[Chunk]:
    """The output bytes of one tensor (both commands): its stored chunks as they are when it is copied, else
    the rows `rows(a, b)` gives (of type `source`) quantized chunk by chunk (quantize_rows)."""
    if d.copied:
        yield from stored()
        return
    for _, _, q in quantize_rows(d, rows, imatrix, threads, source, across):
        yield q


def row_chunks(shape: tuple[int, ...], across: bool = False) -> Iterator[tuple[int, int, int]]:
    """(matrix, first row, end row) over the rows of a tensor of numpy `shape` (rows counted across its
    matrices): whole rows, at most CHUNK_VALUES values, never across a matrix (an expert), as llama-quantize;
    `across`: across matrices too, as if the tensor were one (its matrix is then 0)."""
    n_per_row = shape[-1]
    n_mats = int(np.prod(shape[:-2], dtype=np.int64)) if len(shape) > 2 else 1
    rows_per_mat = shape[-2] if len(shape) > 1 else 1
    if across:
        n_mats, rows_per_mat = 1, n_mats * rows_per_mat
    step = max(1, CHUNK_VALUES // n_per_row)
    for e in range(n_mats):
        for a in range(e * rows_per_mat, (e + 1) * rows_per_mat, step):
            yield e, a, min(a + step, (e + 1) * rows_per_mat)


def quantize_rows(d: Decision, rows: Callable[[int, int], np.ndarray], imatrix: np.ndarray | None,
                  threads: int | None = None, source: QT = QT.F32,
                  across: bool = False) -> Iterator[tuple[int, int, np.ndarray]]:
    """(first row, end row, bytes) of tensor `d` quantized to d.target from the rows `rows(a, b)` gives
    (float32 values, or rows as a GGUF of type `source` stores them, which the quantizer widens to float32
    as llama-quantize's to_float does), chunk by chunk (row_chunks), each matrix with its slice of the
    imatrix vector, and validated as llama-quantize's ggml_validate_row_data check does. kimi-verify
    recomputes a file's blocks through this. `across`: where no imatrix slice is needed and `rows` can
    read across matrices (a file can), chunks may hold rows of several: a stacked BF16 expert tensor of 1M
    values a matrix then goes in 4M-value chunks, a quarter of the kernel calls and thread wake-ups.
    The bytes are the same: every row is quantized alone."""
    from .blocks import InvalidBlockError, NonFiniteError, quantize, validate_blocks     # noqa: PLC0415
    n_per_row = d.shape[-1]
    for e, a, b in row_chunks(d.shape, across and imatrix is None):
        weights = None if imatrix is None else imatrix[e * n_per_row:(e + 1) * n_per_row]
        x = rows(a, b)
        x = np.asarray(x, dtype=np.float32).reshape(b - a, n_per_row) if source == QT.F32 else x.reshape(b - a, -1)
        try:
            q = quantize(x, d.target, weights, threads=threads, source=source)
        except NonFiniteError as err:
            raise NonFiniteWeightError(f"{d.name}: {_row_name(d.shape, a + err.row)}, column {err.column} is "
                                       f"{err.what}{err.more}: refusing to quantize a non-finite weight to "
                                       f"{d.target.name} (llama-quantize aborts on it); the source is damaged", d.name, a + err.row) from None
        try:
            validate_blocks(q, d.target)
        except InvalidBlockError as err:      # as llama-quantize's ggml_validate_row_data check
            raise QuantizeError(f"{d.name}: rows {a}-{b - 1} quantize to invalid {d.target.name} data "
                                f"({err}); is the source finite?") from None
        yield a, b, q


def _row_name(shape: tuple[int, ...], row: int) -> str:
    """Row `row` of a tensor, counted across its matrices: "row 5", or "expert 3, row 5" in a stacked tensor."""
    if len(shape) < 3:
        return f"row {row}"
    return f"expert {row // shape[-2]}, row {row % shape[-2]}"


# ------------------------------------------------------------------------------------
# estimates for --dry-run (headers only, plus a small sample quantized on this machine)

COPY_BYTES_PER_S = 1e9          # the stated disk speed for copied bytes (docs/performance.md)
BASE_RSS = 200 << 20            # interpreter, numpy, the loaded kernels, the GGUF index


@dataclass
class EstimateRow:
    label: str
    n: int
    nbytes: int
    seconds: float


@dataclass
class Estimate:
    rows: list[EstimateRow]
    seconds: float
    peak_ram: int
    basis: str


def estimate(plan: QuantPlan, sample_rows: int = 64, n_per_row: int = 4096) -> Estimate:
    """Output bytes and time per target type: copies at COPY_BYTES_PER_S, quantization at the speed a
    sample of `sample_rows` x `n_per_row` values is quantized here, per type (NaN for a type that cannot be
    written yet; the total is then NaN too)."""
    from .blocks import block_type, quantize, supported_types       # noqa: PLC0415
    x = np.random.default_rng(0).standard_normal((sample_rows, n_per_row)).astype(np.float32)
    speed: dict[QT, float] = {}
    groups: dict[str, list[Decision]] = {}
    for d in plan.decisions:
        how = f"copied {d.source.name}" if d.copied else f"{d.source.name} -> {d.target.name}"
        groups.setdefault(f"{gguf_group(d.name)}: {how}", []).append(d)
    rows = []
    for label, ds in sorted(groups.items(), key=lambda kv: -sum(d.target_bytes for d in kv[1])):
        nbytes = sum(d.target_bytes for d in ds)
        if ds[0].copied:
            seconds = nbytes / COPY_BYTES_PER_S
        else:
            qtype = ds[0].target
            if qtype not in supported_types():
                speed[qtype] = float("nan")
            if qtype not in speed:
                # with importance weights where the type uses them: the i-quants need them (ggml asserts one for
                # IQ1_S, IQ2_XXS, IQ2_XS), and their imatrix path is the one a low-bit plan runs
                qw = np.ones(n_per_row, np.float32) if block_type(qtype).uses_imatrix() else None
                quantize(x[:1], qtype, qw)                  # compile / warm up
                t0 = time.perf_counter()
                quantize(x, qtype, qw)
                speed[qtype] = x.size / max(time.perf_counter() - t0, 1e-9)
            seconds = sum(int(np.prod(d.shape, dtype=np.int64)) for d in ds) / speed[qtype] \
                + sum(d.source_bytes for d in ds) / COPY_BYTES_PER_S
        rows.append(EstimateRow(label, len(ds), nbytes, seconds))
    peak = BASE_RSS + 8 * CHUNK_VALUES * 4
    return Estimate(rows, sum(r.seconds for r in rows), peak,
                    f"{sample_rows}x{n_per_row} sample per type; copies at {COPY_BYTES_PER_S / 1e9:g} GB/s")
