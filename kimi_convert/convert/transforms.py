"""What the converter does to a tensor's source bytes: one class per transform, registered by name, each owning
the GGUF shape it makes, the RAM its producer needs, the producer itself (the bytes kimi-convert writes), the f32
values those bytes hold (verification and the streamed engine) and a row reader (--target-size's samples).

A rule of the tensor table (tensor_map.py) names its transform; `p` below is a planned tensor (converter.
PlannedTensor: its sources, output type, shape and repack threads), `ckpt` the checkpoint it is read from. A new
transform is one class here and one rule there.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from functools import lru_cache
from itertools import chain
from typing import Any, Callable, ClassVar, Iterator

import numpy as np
from gguf import GGMLQuantizationType as QT

from ..gguf_io import COPY_CHUNK, FileRange, Prefetch, SourceFiles, tensor_nbytes
from ..model import KimiConfig
from . import mxfp4
from .checkpoint import DTYPE_SIZE, NUMPY_DTYPE, f32_to_bf16, to_f32
from .shard_io import read_tensors

Shape = tuple[int, ...]
IN_FLIGHT = Prefetch.DEPTH + 1  # produced chunks alive at once: the queue, plus the one being staged
REPACK_AHEAD = 4              # MXFP4 experts repacked ahead of the one the writer takes, beyond one a thread
READ_AHEAD = 4                # experts requested from the disk (fadvise) beyond those
CAST_CHUNK = 16 << 20         # source bytes cast per chunk (--outtype f32): 4 such chunks in flight
CHUNK_ELEMS = 1 << 22         # f32 values made at a time by pieces() (16 MiB)

TRANSFORMS: dict[str, "Transform"] = {}


class Transform:
    """The identity: the source bytes copied (or cast to the output's float type), row blocks at a time."""
    name: ClassVar[str] = "copy"
    moves_values: ClassVar[bool] = True     # values moved, not computed: a BF16 source is stored as it is

    def __repr__(self) -> str:
        return self.name

    def __reduce__(self):               # a singleton: unpickled (worker processes) as the registered one
        return (transform, (self.name,))

    def gguf_shape(self, hf: Shape, c: KimiConfig) -> Shape:
        """Numpy-order shape of the GGUF tensor made from a source of shape `hf` (the rule's first)."""
        return hf

    def work_bytes(self, p) -> int:
        """RAM the producer's temporaries and its chunks in flight need at once (measured: test_real_size)."""
        src = sum(s.nbytes for s in p.sources[0])
        if not _casts(p):
            return 0          # byte ranges, read straight into the write buffers
        step = min(src, CAST_CHUNK)                    # about: _copy cuts at whole rows
        chunk = step * tensor_nbytes(p.qtype, (1,)) // DTYPE_SIZE[p.sources[0][0].dtype]
        n_chunks = -(-src // step)
        # two raw blocks (the next is read before the last is let go), the chunk being made and its widening
        # temporary, and the earlier chunks still in flight
        return 2 * step + 2 * chunk + min(IN_FLIGHT, n_chunks - 1) * chunk

    def produce(self, p, ckpt, cfg: KimiConfig) -> Iterator:
        """The tensor's bytes in the output type, in order: file ranges, or arrays."""
        yield from _copy(p.sources[0][0], p.qtype, ckpt)

    def pieces(self, p, ckpt, cfg: KimiConfig) -> Iterator[tuple[np.ndarray, Any]]:
        """(f32 values the converter computes, in GGUF layout, before rounding to the output type; the index of
        the stored rows they stand for), in pieces of at most CHUNK_ELEMS values."""
        src = p.sources[0][0]
        if len(src.shape) < 2:
            yield ckpt.read_f32(src).reshape(-1), slice(None)
            return
        n_rows = src.shape[0]
        per = max(1, CHUNK_ELEMS // max(1, int(np.prod(src.shape[1:]))))
        for a in range(0, n_rows, per):
            b = min(n_rows, a + per)
            yield source_rows(src, ckpt, a, b), slice(a, b)

    def row(self, p, ckpt, row: int) -> np.ndarray | None:
        """Row `row` (counted across matrices) as the output stores it (uint8 bytes of its type), read from the
        checkpoint alone; None where rows are only made whole (small computed tensors)."""
        return _stored_row(p.sources[0][0], row, p.shape[-1], p.qtype, ckpt)

    def f32_rows(self, p, ckpt, cfg: KimiConfig) -> Callable[[int, int], np.ndarray]:
        """rows(a, b): rows a..b-1 of the tensor seen as [rows, ne0] (counted across matrices), as the f32 values
        the converter computes (verification re-quantizes them). A copied matrix reads only those rows; the
        others are made whole once (small tensors)."""
        if self is COPY and len(p.shape) == 2:
            src = p.sources[0][0]
            return lambda a, b: source_rows(src, ckpt, a, b)
        whole = np.concatenate([np.asarray(x, np.float32).reshape(-1) for x, _ in self.pieces(p, ckpt, cfg)])
        whole = whole.reshape(-1, p.shape[-1])
        return lambda a, b: whole[a:b]


def register(cls):
    TRANSFORMS[cls.name] = cls()
    return TRANSFORMS[cls.name]


def transform(name: str) -> Transform:
    return TRANSFORMS[name]


COPY = register(Transform)


@register
class Conv1d(Transform):
    """[Di, 1, K] -> numpy (1, Di, 1, K): a pure reshape."""
    name = "conv1d"

    def gguf_shape(self, hf, c):
        return (1, c.d_inner, 1, c.conv_kernel)

    def pieces(self, p, ckpt, cfg):
        yield ckpt.read_f32(p.sources[0][0]).reshape(-1), slice(None)


CONV1D = TRANSFORMS["conv1d"]


class _MadeWhole(Transform):
    """A small tensor (a few KB to a few MB) made whole: no row of it is read alone."""

    def row(self, p, ckpt, row):
        return None


class _Computed(_MadeWhole):
    """Values computed from the sources, F32."""
    moves_values = False

    def work_bytes(self, p) -> int:
        return 8 * sum(s.nbytes for s in p.sources[0]) + 4 * p.nbytes

    def produce(self, p, ckpt, cfg):
        yield next(iter(self.pieces(p, ckpt, cfg)))[0].astype(np.float32)


@register
class ResScore(_Computed):
    """The attention residual's score vector: norm.weight * proj.weight, flattened, F32."""
    name = "res_score"

    def gguf_shape(self, hf, c):
        return (c.n_embd,)

    def pieces(self, p, ckpt, cfg):
        norm, proj = (ckpt.read_f32(s).reshape(-1) for s in p.sources[0])
        yield norm.astype(np.float32) * proj.astype(np.float32), slice(None)


RES_SCORE = TRANSFORMS["res_score"]


@register
class ALog(_Computed):
    """-exp(A_log[:n_head]), F32: the source may be padded past n_head."""
    name = "a_log"

    def gguf_shape(self, hf, c):
        return (c.n_head,)

    def pieces(self, p, ckpt, cfg):
        yield ssm_a(ckpt.read_f32(p.sources[0][0]), cfg.n_head), slice(None)


A_LOG = TRANSFORMS["a_log"]


class _KvBHalf(_MadeWhole):
    """One half of kv_b_proj, whose rows per head are [k_nope (d_n); v (d_v)]: each subclass's half(kv_b, cfg)
    cuts its part out (any dtype), as the GGUF tensor lays it out."""

    def work_bytes(self, p) -> int:
        # all of kv_b read, the half made contiguous (in the source's dtype), its two widening temporaries if it
        # is cast (bf16 -> uint32, shifted), and the other half waiting in the queue
        src = p.sources[0][0]
        if not _casts(p):
            return src.nbytes + 2 * p.nbytes
        half = p.nbytes * DTYPE_SIZE[src.dtype] // tensor_nbytes(p.qtype, (1,))
        return src.nbytes + half + 2 * p.nbytes + p.nbytes

    def produce(self, p, ckpt, cfg):
        t = p.sources[0][0]
        yield cast(np.ascontiguousarray(self.half(ckpt.read(t), cfg)), t.dtype, p.qtype)

    def pieces(self, p, ckpt, cfg):
        yield np.ascontiguousarray(self.half(ckpt.read_f32(p.sources[0][0]), cfg)).reshape(-1), slice(None)


@register
class KB(_KvBHalf):
    """The k part, transposed to (H, r, d_n)."""
    name = "k_b"

    def gguf_shape(self, hf, c):
        return (c.n_head, c.kv_lora_rank, c.qk_nope_head_dim)

    def half(self, kv_b, cfg):
        kv = kv_b.reshape(cfg.n_head, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return kv[:, :cfg.qk_nope_head_dim, :].transpose(0, 2, 1)


@register
class VB(_KvBHalf):
    """The v part, (H, d_v, r)."""
    name = "v_b"

    def gguf_shape(self, hf, c):
        return (c.n_head, c.v_head_dim, c.kv_lora_rank)

    def half(self, kv_b, cfg):
        kv = kv_b.reshape(cfg.n_head, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return kv[:, cfg.qk_nope_head_dim:, :]


K_B, V_B = TRANSFORMS["k_b"], TRANSFORMS["v_b"]


@register
class Experts(Transform):
    """The routed experts' matrices stacked over E; an MXFP4 checkpoint's (codes, scales) repacked bit-exactly
    into ggml's blocks."""
    name = "experts"

    def gguf_shape(self, hf, c):
        return (c.n_expert, *hf)

    def work_bytes(self, p) -> int:
        if len(p.sources[0]) != 2:
            return super().work_bytes(p)
        # each repack thread's read buffer; the experts repacked ahead, the one being handed over and those in
        # flight (_repacked_experts)
        ahead = p.threads + REPACK_AHEAD
        return p.threads * sum(s.nbytes for s in p.sources[0]) + (ahead + 1 + IN_FLIGHT) * (p.nbytes // len(p.sources))

    def produce(self, p, ckpt, cfg):
        if len(p.sources[0]) == 2:
            yield from _repacked_experts(p.sources, ckpt, p.threads)
            return
        for e, group in enumerate(p.sources):
            _ask_disk_ahead(p.sources, e, READ_AHEAD, ckpt)
            yield from _copy(group[0], p.qtype, ckpt)

    def pieces(self, p, ckpt, cfg):
        for e, group in enumerate(p.sources):
            if len(group) == 2:          # compressed-tensors MXFP4, decoded by its own definition
                exp = mxfp4.decode_compressed(ckpt.read(group[0]), ckpt.read(group[1]))
            else:
                exp = ckpt.read_f32(group[0])
            yield exp.reshape(-1), e

    def row(self, p, ckpt, row):
        group, local = self.source_of(p, row)
        n = p.shape[-1]
        if len(group) != 2:
            return _stored_row(group[0], local, n, p.qtype, ckpt)
        # an MXFP4 expert: (packed codes, E8M0 scales), repacked
        codes = np.frombuffer(ckpt.read_raw(group[0], local * n // 2, n // 2), np.uint8).reshape(1, -1)
        scales = np.frombuffer(ckpt.read_raw(group[1], local * n // mxfp4.BLOCK, n // mxfp4.BLOCK),
                               np.uint8).reshape(1, -1)
        out = np.empty((1, n // mxfp4.BLOCK * mxfp4.BLOCK_BYTES), np.uint8)
        mxfp4.repack_into(codes, scales, out)
        return out.reshape(-1)

    def f32_rows(self, p, ckpt, cfg):
        def rows(a: int, b: int) -> np.ndarray:
            e, r = divmod(a, p.shape[-2])        # verification's row chunks never cross an expert
            group = p.sources[e]
            if len(group) == 2:                  # MXFP4, as ggml dequantizes it for a re-quantization (no -0)
                packed, scale = (ckpt.map(s) for s in group)
                return mxfp4.decode_compressed(packed[r:r + b - a], scale[r:r + b - a]) + np.float32(0)
            return source_rows(group[0], ckpt, r, r + b - a)
        return rows

    @staticmethod
    def source_of(p, row: int):
        """The expert's own source tensors that row `row` (counted across experts) is made from, and its row."""
        return p.sources[row // p.shape[-2]], row % p.shape[-2]


EXPERTS = TRANSFORMS["experts"]


# ------------------------------------------------------------------------------------
# the pieces the transforms share

def _casts(p) -> bool:
    return p.sources[0][0].dtype != src_dtype(p.qtype)


def src_dtype(qtype: QT) -> str:
    """The checkpoint dtype whose bytes are already those of `qtype` (none for other types)."""
    return {QT.BF16: "BF16", QT.F32: "F32", QT.F16: "F16"}.get(qtype, "")


def cast(values: np.ndarray, src: str, qtype: QT) -> np.ndarray:
    """Stored values (BF16 as uint16 bits) -> the bytes of `qtype`; BF16->BF16 is untouched."""
    if src == src_dtype(qtype):
        return values
    f = to_f32(values, src)
    if qtype == QT.F32:
        return f
    if qtype == QT.BF16:
        return f32_to_bf16(f)
    if qtype == QT.F16:
        return f.astype(np.float16)
    raise ValueError(f"cannot cast {src} to {qtype.name}")


def ssm_a(a_log: np.ndarray, n_head: int) -> np.ndarray:
    """-exp(A_log[:H]), correctly rounded: exp in float64, one rounding to float32 (a float32 exp,
    numpy's or torch's, is only within 1-2 ulp of it)."""
    return (-np.exp(a_log[:n_head].astype(np.float64))).astype(np.float32)


def source_rows(src, ckpt, a: int, b: int) -> np.ndarray:
    """Rows a..b-1 of a source tensor, f32."""
    row = src.nbytes // src.shape[0]
    raw = ckpt.read_raw(src, a * row, (b - a) * row)
    return to_f32(np.frombuffer(raw, dtype=NUMPY_DTYPE[src.dtype]), src.dtype)


def _stored_row(t, row: int, n: int, qtype: QT, ckpt) -> np.ndarray:
    """Row `row` of source tensor t (n values), as `qtype` stores it: uint8 bytes."""
    itemsize = np.dtype(NUMPY_DTYPE[t.dtype]).itemsize
    values = np.frombuffer(ckpt.read_raw(t, row * n * itemsize, n * itemsize), NUMPY_DTYPE[t.dtype])
    return np.ascontiguousarray(cast(values, t.dtype, qtype)).view(np.uint8).reshape(-1)


def _copy(t, qtype: QT, ckpt) -> Iterator:
    """Verbatim when the type is unchanged (kernel copy), else a cast in row blocks."""
    if t.dtype == src_dtype(qtype):
        for off in range(0, t.nbytes, COPY_CHUNK):
            yield FileRange(t.path, t.offset + off, min(COPY_CHUNK, t.nbytes - off))
        return
    row_bytes = t.nbytes // (t.shape[0] if len(t.shape) > 1 else 1)
    rows_per_chunk = max(1, CAST_CHUNK // max(row_bytes, 1))
    n_rows = t.shape[0] if len(t.shape) > 1 else 1
    for r in range(0, n_rows, rows_per_chunk):
        n = min(rows_per_chunk, n_rows - r)
        raw = ckpt.read_raw(t, r * row_bytes, n * row_bytes)
        yield cast(np.frombuffer(raw, dtype=NUMPY_DTYPE[t.dtype]), t.dtype, qtype)


def _repacked_experts(experts: list, ckpt, threads: int) -> Iterator[np.ndarray]:
    """Each MXFP4 expert (packed, scale) repacked, in order. Experts are read (shard_io: one preadv into a
    buffer the thread reuses) and repacked (the compiled kernel, which drops the GIL) on a pool of `threads`,
    threads + REPACK_AHEAD experts ahead of the writer, so that every core works while it writes; the disk is
    asked for the READ_AHEAD experts beyond those, since they are read out of file order (every w1, then
    every w2, ...)."""
    pool, pending, ahead = repack_pool(threads), deque(), threads + REPACK_AHEAD
    with SourceFiles() as files:
        try:
            for e, group in enumerate(experts):
                _ask_disk_ahead(experts, e, ahead + READ_AHEAD, ckpt)
                pending.append(pool.submit(_read_repacked, group, [files.fd(t.path) for t in group]))
                if len(pending) > ahead:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:            # the writer stopped early: no job may read from the files about to be closed
            for job in pending:
                job.cancel()
            futures_wait(pending)


def _ask_disk_ahead(experts: list, e: int, ahead: int, ckpt) -> None:
    """As expert e is read, ask the disk (fadvise) for expert e + ahead, and at the start for those before it:
    the experts of a stacked tensor are read out of file order (every w1, then every w2, ...)."""
    for t in chain.from_iterable(experts[e + ahead:e + ahead + 1] if e else experts[:ahead + 1]):
        ckpt.will_need(t)


def _read_repacked(group: tuple, fds: list[int]) -> np.ndarray:
    packed, scale = read_tensors(group, fds)
    out = np.empty((packed.shape[0], packed.shape[1] * 2 // mxfp4.BLOCK * mxfp4.BLOCK_BYTES), np.uint8)
    mxfp4.repack_into(packed, scale, out)
    return out


@lru_cache(maxsize=None)
def repack_pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="kimi-repack")
