"""The error of each candidate type: imatrix-weighted relative quantization error on sampled rows.

For a row x of a tensor, quantized to type T and widened back (our byte-exact quantizers and dequantizers, with
the imatrix vector the write would use: what is measured is what will be written), with s the importance
vector (llama-imatrix's mean squared activations per column; all ones where the tensor has no entry):

    e(x, T) = sum_j s_j (x_j - deq(q(x))_j)^2 / sum_j s_j x_j^2

which is E|dW a|^2 / E|W a|^2 for activations a of diagonal covariance s: what ggml's quantizers minimise. A
matrix's error is the mean of e over its sampled rows times its row count (an estimate of the sum over all its
rows, so a big matrix weighs more than a small one) times the share of the tokens that run through it: 1 for
every tensor but the routed experts, and for expert j of a stacked tensor its imatrix count over the tokens a
dense tensor saw (what llama-imatrix's unnormalised sums say of its routing), or num_experts_per_tok /
num_experts where the imatrix does not say (a .dat). On K3 an expert runs for 16 tokens in 896 on average: a
weight of an always-active tensor matters ~56 times as much to the output as one of an expert, and spending the
bytes per weight alike would starve the 4% of the model every token runs through. A tensor's error is the sum
over its matrices, a decision's the sum over its tensors.

Rows: at least TENSOR_ROWS per tensor and EXPERT_ROWS per matrix (every expert of a stacked tensor is sampled),
evenly strided from an offset seeded by the tensor's name (the same rows every run). The candidates of a tensor
are measured on `threads` threads at once (one candidate each; the kernels drop the GIL); each candidate's sum
is taken in the same order whatever the thread count, so the errors do not depend on it.

Results are cached in the user's cache folder, $XDG_CACHE_HOME/kimi-convert/errors (else
~/.cache/kimi-convert/errors; `error_cache_dir`), one small JSON file per sampled tensor named by a hash of its
sampled rows' stored bytes, the imatrix values they are quantized with, the token shares and this module's
MEASURE_VERSION, holding the error of each type measured for it. Every run on the machine shares it (a second
budget on the same model and imatrix, from any folder, reads the samples and quantizes nothing), and no run
writes anything beside its output for it: a --dry-run leaves the output's folder as it was. Each file is written
under a temporary name in that folder and renamed, merged with what another run may have written meanwhile,
and never over a file the run reads.
"""
from __future__ import annotations

import hashlib
import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as QT

from ...gguf_io import GGUFFile
from ..blocks import dequantize, quantize
from ..imatrix import expert_slice
from ..plan import Decision
from .units import Unit

MEASURE_VERSION = 3       # 3: matrices weighted by their share of the tokens
EXPERT_ROWS = 4         # rows sampled per matrix at least: K3's 896 experts give 3,584 rows per expert tensor
TENSOR_ROWS = 64        # rows sampled per tensor at least (all of them when it has fewer)


def error_cache_dir() -> Path:
    """The measurement cache every run on this machine shares: $XDG_CACHE_HOME/kimi-convert/errors, else
    ~/.cache/kimi-convert/errors (the XDG base directory spec's default)."""
    base = os.environ.get("XDG_CACHE_HOME") or ""
    root = Path(base) if os.path.isabs(base) else Path.home() / ".cache"      # the spec: a relative one is ignored
    return root / "kimi-convert" / "errors"


class ErrorCache:
    """(sample hash, type) -> error, read from and written to `folder` (None: in memory only): one file
    `<hash>.json` per sampled tensor, read when first asked for, written atomically by save(). `inputs`: the
    files the run reads (paths.Input), which a cache file never replaces."""

    def __init__(self, folder: Path | None, note: Callable[[str], None] = lambda s: None, inputs=()):
        self.folder, self.note, self.inputs = folder, note, tuple(inputs)
        self.loaded: dict[str, dict[str, float]] = {}       # digest -> {type name: error}
        self.new: set[str] = set()                          # digests with an error measured by this run
        self.hits = self.misses = 0

    def file(self, digest: str) -> Path:
        return self.folder / f"{digest}.json"

    def _entries(self, digest: str) -> dict[str, float]:
        if digest not in self.loaded:
            self.loaded[digest] = self._read(digest) if self.folder is not None else {}
        return self.loaded[digest]

    def _read(self, digest: str) -> dict[str, float]:
        path = self.file(digest)
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            if doc.get("version") != MEASURE_VERSION:
                return {}
            return {str(k): float(v) for k, v in doc["errors"].items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            self.note(f"{path}: unreadable error cache ({e}); measuring again")
            return {}

    def has(self, digest: str, qtype: QT) -> bool:
        return qtype.name in self._entries(digest)

    def get(self, digest: str, qtype: QT, compute: Callable[[], float]) -> float:
        entries = self._entries(digest)
        if qtype.name in entries:
            self.hits += 1
            return entries[qtype.name]
        self.misses += 1
        entries[qtype.name] = value = float(compute())
        self.new.add(digest)
        return value

    def save(self, note: Callable[[str], None] | None = None) -> None:
        """Each file with a new error: merged with the file as it is now (another run may have added to it),
        written under a temporary name in the cache folder, then renamed; a cache that cannot be written is
        said, not an error (the next run measures again)."""
        note = note or self.note
        if self.folder is None or not self.new:
            return
        from ...paths import Output, OverlapError, refuse_overlap
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            note(f"{self.folder}: cannot make the error cache folder ({e.strerror or e}); the next run measures "
                 f"again")
            return
        for digest in sorted(self.new):
            path = self.file(digest)
            try:
                refuse_overlap(self.inputs, [Output(path, "error cache")])
            except OverlapError as e:
                note(f"{e}; not cached")
                continue
            entries = {**self._read(digest), **self.loaded[digest]}
            tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
            try:
                with open(tmp, "w", encoding="utf-8") as f:
                    json.dump({"version": MEASURE_VERSION, "errors": dict(sorted(entries.items()))}, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except OSError as e:
                note(f"{path}: cannot write the error cache ({e.strerror or e}); the next run measures again")
                return
            finally:
                tmp.unlink(missing_ok=True)
        self.new.clear()


def sampled_rows(name: str, shape: tuple[int, ...]) -> list[tuple[int, list[int]]]:
    """(matrix, its sampled row numbers, counted over the whole tensor) for every matrix of a tensor."""
    n_mats = int(np.prod(shape[:-2], dtype=np.int64)) if len(shape) > 2 else 1
    rows = shape[-2] if len(shape) > 1 else 1
    k = min(max(EXPERT_ROWS, -(-TENSOR_ROWS // n_mats)), rows)
    stride = rows // k
    offset = zlib.crc32(name.encode()) % stride
    return [(e, [e * rows + offset + i * stride for i in range(k)]) for e in range(n_mats)]


# (tensor's decision, sorted row numbers counted over the whole tensor) -> those rows as stored, one array each
RowReader = Callable[[Decision, list[list[int]]], list[np.ndarray]]


def gguf_rows(gf: GGUFFile) -> RowReader:
    """Rows read from a GGUF file, each with one pread."""
    def read(d: Decision, groups: list[list[int]]) -> list[np.ndarray]:
        t = gf.tensors[d.name]
        buf = np.empty(t.row_nbytes, np.uint8)
        return [np.concatenate([np.array(t.read_rows(r, r + 1, buf)) for r in rows]) for rows in groups]
    return read


# a tensor -> the share of the tokens each of its matrices runs for (None: 1 for each)
Shares = Callable[[Decision], "np.ndarray | None"]


def token_shares(imat, expert_share: float) -> Shares:
    """The routed experts' shares from the imatrix's counts (Imatrix.usage), else `expert_share` each
    (num_experts_per_tok / num_experts); None (1 each) for every other tensor."""
    from .units import ROUTED_EXPERTS

    def shares(d: Decision) -> np.ndarray | None:
        if not ROUTED_EXPERTS.match(d.name):
            return None
        found = imat.usage(d.name, d.shape)
        return found if found is not None else np.full(d.shape[0], expert_share)
    return shares


def unit_errors(unit: Unit, read_rows: RowReader, vectors: Callable[[str], np.ndarray | None], cache: ErrorCache,
                threads: int, shares: Shares = lambda d: None) -> dict[QT, float]:
    """The error of each of `unit`'s candidates (keeping the stored type: 0)."""
    errors = {t: 0.0 for t in unit.candidates}
    for d in unit.decisions:
        vector = vectors(d.name)
        picked = sampled_rows(d.name, d.shape)
        stored = read_rows(d, [rows for _, rows in picked])
        samples = [(rows, None if vector is None else expert_slice(vector, d.shape, e))
                   for (e, _), rows in zip(picked, stored)]
        weight = shares(d)
        weights = np.ones(len(samples)) if weight is None else np.asarray(weight, np.float64)
        rows_per_matrix = int(np.prod(d.shape[:-1], dtype=np.int64)) // len(samples)
        digest = _digest(d.name, samples, weights)
        todo = [qt for qt in unit.candidates if qt != d.source and not cache.has(digest, qt)]
        if todo:
            x = [dequantize(stored, d.source, threads=1) for stored, _ in samples]
            measured = dict(zip(todo, _pool(threads).map(lambda qt: _matrix_errors(x, samples, qt), todo)))
        for qt in unit.candidates:
            if qt != d.source:
                errors[qt] += cache.get(digest, qt, lambda qt=qt: float(measured[qt] @ weights) * rows_per_matrix)
    return errors


@lru_cache(maxsize=None)
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max(1, threads), thread_name_prefix="kimi-target")


def _digest(name: str, samples, weights: np.ndarray) -> str:
    h = hashlib.sha256(f"{MEASURE_VERSION}:{EXPERT_ROWS}:{TENSOR_ROWS}:{name}".encode())
    for stored, vector in samples:
        h.update(np.ascontiguousarray(stored).tobytes())
        h.update(b"-" if vector is None else np.ascontiguousarray(vector, dtype=np.float32).tobytes())
    h.update(np.ascontiguousarray(weights, dtype=np.float64).tobytes())
    return h.hexdigest()


def _matrix_errors(x: list[np.ndarray], samples, qtype: QT) -> np.ndarray:
    """Per matrix of one tensor, the mean relative weighted error over its sampled rows: `x` its rows per matrix
    (float32), `samples` their (stored rows, importance vector); every matrix quantized with its vector, then
    all widened back at once."""
    quantized = [quantize(rows, qtype, vector, threads=1) for rows, (_, vector) in zip(x, samples)]
    back = dequantize(np.concatenate(quantized), qtype, threads=1)
    out, at = np.zeros(len(x)), 0
    for m, (rows, (_, vector)) in enumerate(zip(x, samples)):
        y = back[at:at + rows.shape[0]]
        at += rows.shape[0]
        s = np.ones(rows.shape[1], np.float64) if vector is None else vector.astype(np.float64)
        xd = rows.astype(np.float64)
        num = ((xd - y) ** 2) @ s
        den = (xd ** 2) @ s
        out[m] = float(np.mean(np.divide(num, den, out=np.zeros_like(num), where=den > 0)))
    return out
