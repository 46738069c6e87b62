"""llama-perplexity's `--kl-divergence-base` file: the base model's log-probabilities, 16 bits a value.

Layout (tools/perplexity/perplexity.cpp, `perplexity` and `kl_divergence`), little-endian:
  "_logits_"                      8 bytes
  n_ctx                           u32
  n_vocab, n_chunk                i32, i32
  tokens                          i32 x n_ctx x n_chunk   (as tokenized: the BOS put in at run time is not stored)
  per chunk, per scored token     row_width(n_vocab) x u16
Only the second half of each chunk is scored: positions first = n_ctx / 2 .. n_ctx - 2 predict the next token,
n_ctx - 1 - first rows a chunk. A row is two float32 (scale, min_log_prob) in its first four u16, then one u16 a
vocabulary entry, padded to an even count: log p_i = scale * q_i + min_log_prob, q_i = round((logit_i - lo) /
scale) over [lo, max], lo = max(min logit, max logit - 16), 0 below lo.

`compress` makes the rows from logits with llama-perplexity's float arithmetic (float32 steps, the exponentials
summed in double); `BaseWriter` streams them to a temporary name renamed at the end; `BaseFile` reads one
(ours or llama-perplexity's) a chunk at a time, memory-mapped.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import KimiError, OutputError

MAGIC = b"_logits_"
HEADER_BYTES = 8 + 4 + 4 + 4
LOG_PROB_RANGE = 16.0                  # logits more than this below the maximum are stored as 0


class BaseFileError(KimiError):
    """A base file that is not llama-perplexity's format, or not the one this run needs."""


def row_width(n_vocab: int) -> int:
    """u16 values a scored token takes: the two float32 and the vocabulary, padded to an even count."""
    return 2 * ((n_vocab + 1) // 2) + 4


def scored_positions(n_ctx: int) -> slice:
    """The positions whose logits are scored (each predicts the token after it)."""
    return slice(n_ctx // 2, n_ctx - 1)


def is_base_file(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(8) == MAGIC
    except OSError:
        return False


def log_sum_exp(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(max [n], log sum exp(l - max) [n], float32): llama-perplexity sums expf(l - max) in double, logs in float."""
    top = logits.max(axis=1)
    total = np.exp(logits - top[:, None]).sum(axis=1, dtype=np.float64)
    return top, np.log(total).astype(np.float32)


def compress(logits: np.ndarray) -> np.ndarray:
    """Rows [n, row_width] (u16) of float32 logits [n, n_vocab], as llama-perplexity's log_softmax writes them."""
    logits = np.asarray(logits, np.float32)
    n, n_vocab = logits.shape
    top, lse = log_sum_exp(logits)
    lo = np.maximum(logits.min(axis=1), top - np.float32(LOG_PROB_RANGE))
    min_log_prob = (lo - top - lse).astype(np.float32)
    scale = ((top - lo) / np.float32(65535)).astype(np.float32)
    rows = np.zeros((n, row_width(n_vocab)), np.uint16)
    rows[:, :4] = np.stack([scale, min_log_prob], axis=1).astype("<f4").view(np.uint16)
    with np.errstate(divide="ignore"):
        inv = np.where(scale != 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
    q = np.rint((logits - lo[:, None]) * inv[:, None])          # the float32 magic-number rounding: to even
    rows[:, 4:4 + n_vocab] = np.where(logits > lo[:, None], q, 0).astype(np.uint16)
    return rows


def expand(rows: np.ndarray, n_vocab: int) -> np.ndarray:
    """log p [n, n_vocab] (float32) of stored rows: scale * q + min_log_prob."""
    head = np.ascontiguousarray(rows[:, :4]).view("<f4")
    scale, min_log_prob = head[:, 0:1], head[:, 1:2]
    return rows[:, 4:4 + n_vocab].astype(np.float32) * scale + min_log_prob


@dataclass(frozen=True)
class BaseHeader:
    n_ctx: int
    n_vocab: int
    n_chunk: int

    @property
    def scored(self) -> int:
        return self.n_ctx - 1 - self.n_ctx // 2

    def nbytes(self) -> int:
        return HEADER_BYTES + 4 * self.n_ctx * self.n_chunk + 2 * self.n_chunk * self.scored * row_width(self.n_vocab)


class BaseFile:
    """A base file, read chunk by chunk: `tokens` [n_chunk, n_ctx] and `rows(chunk)` [scored, row_width]."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(HEADER_BYTES)
        except OSError as e:
            raise BaseFileError(f"{path}: cannot read the base file ({e.strerror or e})") from None
        if len(head) < HEADER_BYTES or head[:8] != MAGIC:
            raise BaseFileError(f"{path}: not a llama-perplexity base file (no '_logits_' header)")
        n_ctx = int(np.frombuffer(head, "<u4", 1, 8)[0])
        n_vocab, n_chunk = (int(v) for v in np.frombuffer(head, "<i4", 2, 12))
        if n_ctx < 4 or n_vocab < 1 or n_chunk < 1:
            raise BaseFileError(f"{path}: impossible header (n_ctx {n_ctx}, n_vocab {n_vocab}, n_chunk {n_chunk})")
        self.header = BaseHeader(n_ctx, n_vocab, n_chunk)
        if size != self.header.nbytes():
            raise BaseFileError(f"{path}: {size:,} bytes, but its header (n_ctx {n_ctx}, n_vocab {n_vocab}, "
                                f"{n_chunk} chunks) needs {self.header.nbytes():,}: truncated or not this format")
        self._map = np.memmap(self.path, np.uint8, "r")
        self.tokens = self._map[HEADER_BYTES:HEADER_BYTES + 4 * n_ctx * n_chunk].view("<i4").reshape(n_chunk, n_ctx)
        self._rows_at = HEADER_BYTES + 4 * n_ctx * n_chunk

    def rows(self, chunk: int) -> np.ndarray:
        h = self.header
        per = h.scored * row_width(h.n_vocab) * 2
        at = self._rows_at + chunk * per
        return np.asarray(self._map[at:at + per].view("<u2").reshape(h.scored, row_width(h.n_vocab)))


class BaseWriter:
    """Writes a base file chunk by chunk to `.NAME.part` beside it, renamed onto NAME by `finish`."""

    def __init__(self, path: Path, header: BaseHeader, tokens: np.ndarray):
        self.path, self.header = Path(path), header
        self.part = self.path.with_name(f".{self.path.name}.part")
        self._chunks = 0
        try:
            self._f = open(self.part, "wb")
            self._f.write(MAGIC + np.array([header.n_ctx], "<u4").tobytes()
                          + np.array([header.n_vocab, header.n_chunk], "<i4").tobytes())
            self._f.write(np.ascontiguousarray(tokens, "<i4").tobytes())
        except OSError as e:
            self.abort()
            raise OutputError(f"{self.part}: cannot write the base file ({e.strerror or e})") from None

    def add(self, rows: np.ndarray) -> None:
        assert rows.shape == (self.header.scored, row_width(self.header.n_vocab)), rows.shape
        try:
            self._f.write(np.ascontiguousarray(rows, "<u2").tobytes())
        except OSError as e:
            self.abort()
            raise OutputError(f"{self.part}: cannot write the base file ({e.strerror or e})") from None
        self._chunks += 1

    def finish(self) -> Path:
        assert self._chunks == self.header.n_chunk
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            os.replace(self.part, self.path)
        except OSError as e:
            self.abort()
            raise OutputError(f"{self.path}: cannot write the base file ({e.strerror or e})") from None
        return self.path

    def abort(self) -> None:
        f = getattr(self, "_f", None)
        if f is not None and not f.closed:
            f.close()
        self.part.unlink(missing_ok=True)
