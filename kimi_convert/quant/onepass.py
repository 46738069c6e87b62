"""kimi-convert --policy: the converter's tensors quantized as they are produced, in its one pass.

Nothing here decides or computes anything of its own, so that the file equals kimi-convert followed by
kimi-quantize with the same policy, byte for byte (tests/test_one_pass.py):
- the types: plan.plan_quantization on what the converter writes (name, numpy shape, output type);
- the bytes: driver.tensor_chunks over the converter's own producer, whose chunks are already rounded to its
  output type (BF16, F32, MXFP4 repacks); `StreamedRows` cuts them into the stored rows kimi-quantize reads
  from the converted file, which quantize_rows widens and quantizes alike, chunk by chunk (4M values at most,
  never across an expert), so no tensor, stacked experts included, is ever held whole;
- the imatrix: driver.ImatrixVectors, every size checked before any data is read, each vector read in turn;
- the keys: driver.metadata over the keys the converter would write, in its order.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
from gguf import GGMLQuantizationType as QT

from ..errors import CheckpointError
from ..gguf_io import Chunk, FileRange, OutTensor, tensor_nbytes
from .driver import CHUNK_VALUES, ImatrixVectors, file_type, ggml_shape, metadata, tensor_chunks
from .imatrix import Imatrix
from .mixtures import ModelFacts
from .plan import NonFiniteWeightError, PlanOptions, QuantPlan, check_can_write, plan_quantization
from .policy import Policy

PIECE = 16 << 20            # a FileRange of the producer is read in pieces of this many bytes


@dataclass
class OnePass:
    """What `--policy` adds to a conversion: the decisions, the imatrix vectors and the output keys."""
    policy: Policy
    plan: QuantPlan
    imatrix: Imatrix | None = None
    vectors: ImatrixVectors | None = None
    notes: list[str] = field(default_factory=list)    # imatrix entries missing or skipped
    threads: int = 0                       # quantizer threads; 0: every CPU available
    options: PlanOptions = PlanOptions()
    # (tensor name, row) -> the source file and tensor it was made from, for an error's first words
    source_of: Callable[[str, int], str] | None = None

    def check_requirements(self) -> None:
        """What the policy `requires` of a run (an imatrix, --allow-requantize) and what its plan needs to be
        written (writable types, the imatrix entries its types need), as kimi-quantize checks them."""
        self.policy.check_requirements(imatrix=self.imatrix is not None,
                                       allow_requantize=self.options.allow_requantize)
        check_can_write(self.plan, self.vectors.shapes if self.vectors is not None else None,
                        self.imatrix.path if self.imatrix is not None else "")

    @property
    def sizes(self) -> list[int]:
        return [d.target_bytes for d in self.plan.decisions]

    @property
    def quantizer_rss(self) -> int:
        """RSS that loading the kernels adds (kernel.load_rss); a chunk's work is in chunk_work."""
        from .. import kernel
        from .blocks import kernels_for, supported_types     # noqa: PLC0415
        pairs = [(d.source, d.target, self.imatrix is not None) for d in self.plan.decisions
                 if not d.copied and d.target in supported_types()]
        return kernel.load_rss(kernels_for(pairs)) if pairs else 0

    def chunk_work(self, i: int) -> int:
        """RAM that quantizing tensor i adds to its producer's work: a piece of the stream and the stored rows
        cut from it (up to 4M values each: 48 MiB at most for F32 rows, 40 MiB measured with BF16 experts
        quantized to Q4_K, the quantized chunks in flight included), and its imatrix vector."""
        d = self.plan.decisions[i]
        if d.copied:
            return 0
        values = int(np.prod(d.shape, dtype=np.int64))
        chunk = min(PIECE, d.source_bytes) + 2 * 4 * min(CHUNK_VALUES, values)
        vector = self.vectors is not None and d.name in self.vectors.shapes
        return chunk + (4 * values // d.shape[-2] if vector and len(d.shape) > 1 else 0)

    def metadata(self, converted: Iterable[tuple], converted_file_type: int) -> list[tuple]:
        """The output's keys from those the converter writes (key, value, type, element type), in its order."""
        extra = self.imatrix.metadata() if self.imatrix is not None else []
        return metadata(converted, file_type(self.policy, converted_file_type), extra)

    def out_tensors(self, produce: Sequence[Callable[[], Iterable[Chunk]]]) -> list[OutTensor]:
        """The writer's tensors, from the converter's producer of each tensor (in plan order)."""
        from .blocks import default_threads, load_kernels     # noqa: PLC0415  (the kernels: only when quantizing)
        threads = self.threads or default_threads()
        load_kernels((d.source, d.target, self.imatrix is not None) for d in self.plan.decisions if not d.copied)
        return [OutTensor(d.name, d.target, ggml_shape(d.shape), lambda d=d, p=p: self._chunks(d, p, threads))
                for d, p in zip(self.plan.decisions, produce, strict=True)]

    def _chunks(self, d, produce: Callable[[], Iterable[Chunk]], threads: int) -> Iterator[Chunk]:
        vector = None if d.copied or self.vectors is None else self.vectors.get(d.name)
        rows = StreamedRows(d.name, produce, d.source, d.shape)
        try:
            yield from tensor_chunks(d, produce, rows, vector, threads, source=d.source)
        except NonFiniteWeightError as e:       # the line names the shard and the checkpoint's tensor
            if self.source_of is None:
                raise
            raise NonFiniteWeightError(f"{self.source_of(e.name, e.row)}: {e}", e.name, e.row) from None
        if not d.copied:
            rows.finish()


def plan_one_pass(tensors: Iterable[tuple[str, tuple[int, ...], QT]], policy: Policy,
                  options: PlanOptions = PlanOptions(), *, model: ModelFacts, imatrix=None, threads: int = 0
                  ) -> OnePass:
    """Decide every tensor the converter writes (name, numpy shape, output type) of a model with facts `model`
    as kimi-quantize decides the converted file's, and check the imatrix against every tensor to quantize:
    all from the headers."""
    plan = plan_quantization(tensors, policy, options, model=model, imatrix=imatrix is not None)
    notes: list[str] = []
    vectors = ImatrixVectors(plan, imatrix, notes) if imatrix is not None else None
    return OnePass(policy, plan, imatrix, vectors, notes, threads, options)


class StreamedRows:
    """`rows(a, b)`: rows a..b as stored (uint8 [b - a, row bytes] of `qtype`; F32 as values) of a tensor of `shape`
    whose bytes come as a stream of chunks, FileRanges, arrays or bytes, from `produce()`, started on the
    first call: the rows kimi-quantize reads from the converted file, for quantize_rows to widen alike.
    quantize_rows asks for consecutive row ranges, so the stream is read once, in order, and only the
    bytes not yet handed out are held."""

    def __init__(self, name: str, produce: Callable[[], Iterable[Chunk]], qtype: QT, shape: tuple[int, ...]):
        self.name, self.produce, self.qtype = name, produce, qtype
        self.row_bytes = tensor_nbytes(qtype, (shape[-1],))
        self.total_rows = int(np.prod(shape[:-1], dtype=np.int64))
        self.pieces: Iterator[memoryview] | None = None
        self.held: list[memoryview] = []
        self.n_held = 0
        self.next_row = 0

    def __call__(self, a: int, b: int) -> np.ndarray:
        if a != self.next_row:
            raise AssertionError(f"{self.name}: rows {a}-{b} asked for, the stream is at row {self.next_row}")
        if self.pieces is None:
            self.pieces = _byte_pieces(self.produce())
        raw = self._take((b - a) * self.row_bytes).reshape(b - a, self.row_bytes)
        self.next_row = b
        return raw.view(np.float32) if self.qtype == QT.F32 else raw    # F32 as values, as quantize_rows takes it

    def finish(self) -> None:
        """Every row was asked for, and the producer has nothing more: it made exactly the tensor's bytes."""
        extra = self.n_held + sum(len(p) for p in self.pieces or ())
        if self.next_row != self.total_rows or extra:
            raise CheckpointError(f"{self.name}: produced {self.next_row * self.row_bytes + extra} bytes, "
                                  f"expected {self.total_rows * self.row_bytes}")

    def _take(self, n: int) -> np.ndarray:
        while self.n_held < n:
            piece = next(self.pieces, None)
            if piece is None:
                raise CheckpointError(f"{self.name}: produced {self.next_row * self.row_bytes + self.n_held} "
                                      f"bytes, expected {self.total_rows * self.row_bytes}")
            self.held.append(piece)
            self.n_held += len(piece)
        out = np.empty(n, np.uint8)
        filled = 0
        while filled < n:
            piece = self.held[0]
            k = min(len(piece), n - filled)
            out[filled:filled + k] = np.frombuffer(piece[:k], np.uint8)
            filled += k
            if k == len(piece):
                self.held.pop(0)
            else:
                self.held[0] = piece[k:]
        self.n_held -= n
        return out


def _byte_pieces(chunks: Iterable[Chunk]) -> Iterator[memoryview]:
    """The bytes of a producer's chunks, a FileRange read in PIECE-sized parts."""
    for chunk in chunks:
        if isinstance(chunk, FileRange):
            yield from _read_range(chunk)
        elif isinstance(chunk, np.ndarray):
            yield memoryview(np.ascontiguousarray(chunk)).cast("B")
        else:
            yield memoryview(chunk).cast("B")


def _read_range(r: FileRange) -> Iterator[memoryview]:
    fd = os.open(Path(r.path), os.O_RDONLY)
    try:
        for off in range(0, r.length, PIECE):
            buf = memoryview(bytearray(min(PIECE, r.length - off)))
            got = 0
            while got < len(buf):
                n = os.preadv(fd, [buf[got:]], r.offset + off + got)
                if n == 0:
                    raise CheckpointError(f"{r.path}: ends before byte {r.offset + off + len(buf)} "
                                          f"(truncated shard?)")
                got += n
            yield buf
    finally:
        os.close(fd)
