"""Prove a GGUF by reading and executing it: `kimi-verify check`.

With the HF checkpoint (`verify(gguf, hf_dir)`), seven parts, each pass/fail with figures:

  structure   the file(s) parse; tensor data aligned, inside the file, packed in order (as llama.cpp requires)
  tensors     every GGUF tensor against its HF source through the plan's transform:
              bit-exact for float and MXFP4 tensors; a quantized one must be, byte for byte,
              our quantization (quant.blocks, with the imatrix) of the values the converter
              writes (a type without a quantizer here is not checked, n/a with the reason, and
              listed in the report's notes); nothing missing, nothing extra
  metadata    every architecture key (value and GGUF type) against
              KimiConfig.gguf_metadata() of the checkpoint's config, plus the vocabulary, and every
              special-token id against the id config.json names (vocab.checkpoint_specials)
  logits      runtime (GGUF) vs reference (HF) on a fixed token sequence: max |diff|,
              argmax agreement, KL, within the file class's tolerances; positions whose
              MoE / DSA routing margin is below tolerance are listed and excluded. For a
              quantized file the reference runs on the file's dequantized weights
  k31 indexer top_k >= length is bit-identical to dense MLA (runtime and reference), and
              top_k below the length diverges (KL reported) while matching the reference
  perplexity  of runtime and reference on the sequence, and their ratio
  cost        what quantization costs: KL and perplexity ratio of the file's logits against
              the reference on the checkpoint as is (information; a gate with max_kl)

Without a checkpoint (`verify(gguf)`): structure; every tensor the architecture implies
(from KimiConfig.from_gguf and tensor_map's table) present with its shape and an allowed
type, no extra, valid blocks (as ggml_validate_row_data) and finite values; metadata keys
with the types llama.cpp reads, special-token ids naming Kimi-K3's tokens (vocab.k3_specials);
a forward pass without NaN; and the runtime-only half of the k31 part.

Files llama.cpp writes pass as ours do: shapes are compared up to leading 1s (trailing ggml
1-dims, which llama-quantize's headers leave out), and each key may have any type llama.cpp's
loader reads it as (per-layer arrays: INT32, UINT32 or BOOL).

Tolerances and their reasons: docs/verification.md. A part that raises is a failed part
(the error is its message); only an unreadable checkpoint aborts the whole run. The reference
needs torch (`pip install 'kimi-convert[verify]'`); without it the parts that need it are n/a,
not failures.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field, replace
from importlib import import_module
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf import GGUFValueType
from gguf import GGMLQuantizationType as QT

from ..convert import mxfp4
from ..convert.checkpoint import Checkpoint, SourceTensor
from ..convert.converter import OUTTYPES, _text_config, ssm_a
from ..convert.values import converted_pieces, round_to, source_rows
from ..constants import INDEXER_MATRIX_TYPES, Key, T, key
from ..errors import KimiError
from ..gguf_io import QUANT_SIZES, GGUFFile, GGUFTensor, dequantize, gguf_parts, open_gguf, read_gguf, same_shape
from ..model import KimiConfig
from ..quant.driver import imatrix_vectors, quantize_rows, row_chunks
from ..quant.plan import Decision, QuantPlan
from ..tensor_map import A_LOG, CONV1D, COPY, EXPERTS, K_B, V_B, gguf_tensors
from ..convert.vocab import SPECIAL_KEYS, ExpectedSpecial, checkpoint_specials, k3_specials

SEQ_LEN = 32
SEED = 0
CHUNK_ELEMS = 1 << 22            # elements compared at a time (16 MiB of f32 per side)
MIN_JUDGED_FRACTION = 0.5        # fewer unflagged positions than this and the logits part fails

FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)
CONVERTED_TYPES = (QT.F32, QT.BF16)      # the float types kimi-convert writes (its --outtype, and F32 rules)


# ------------------------------------------------------------------------------------
# tolerances (docs/verification.md explains every number)

CHECKPOINT, FILE = "checkpoint", "file"      # what the reference's weights are

@dataclass(frozen=True)
class Tolerance:
    file_class: str
    logits_rtol: float          # per position: max |logit diff| <= logits_rtol * RMS(reference logits)
    kl_max: float               # KL(reference || runtime) per position, nats
    margin: float               # routing margins below this are near-ties: listed and not judged
    reference: str = CHECKPOINT  # the weights the reference runs on: the checkpoint's, or the file's (FILE)

    def atol(self, scale: float) -> float:
        return self.logits_rtol * scale

    def ppl_bound(self, scale: float) -> float:
        # |ln ratio| <= max_t |Δ log p_t| <= 2 max|Δ logit|: the logits bound carries over
        return 2 * self.atol(scale)


# Forcing top_k below the length is compared with the same runtime's dense result, which
# top_k >= length reproduces bit for bit: there is no noise to rise above, so any KL above
# this (far below the 0.1-1 nats a real selection produces) shows that the indexer bites.
DIVERGENCE_MIN = 1e-4

TOLERANCES = {
    "f32": Tolerance("f32", logits_rtol=1e-3, kl_max=1e-6, margin=1e-4),
    "bf16": Tolerance("bf16", logits_rtol=2e-2, kl_max=1e-3, margin=1e-3),
    # the reference runs on the file's own (dequantized) weights, so both sides hold the same
    # values, as for an F32 file; what quantization costs is the `cost` part's, not a tolerance
    "quantized": Tolerance("quantized", logits_rtol=1e-3, kl_max=1e-6, margin=1e-4, reference=FILE),
}


def file_class(gf: GGUFFile) -> str:
    """The loosest weight type of the file; MXFP4 experts are lossless repacks and do not count."""
    worst = "f32"
    for name, t in gf.tensors.items():
        if t.qtype == QT.F32 or (t.qtype == QT.MXFP4 and name.endswith("_exps.weight")):
            continue
        if t.qtype in (QT.BF16, QT.F16):
            worst = "bf16" if worst == "f32" else worst
        else:
            return "quantized"
    return worst


# ------------------------------------------------------------------------------------
# report

@dataclass
class Part:
    key: str
    title: str
    ok: bool | None = None                  # None: not applicable / not run
    summary: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    info: bool = False                      # figures to read, not a verdict (ok is None)

    def fail(self, message: str) -> None:
        self.failures.append(message)

    def finish(self, summary: str) -> "Part":
        self.ok = not self.failures
        self.summary = summary
        return self


@dataclass
class Report:
    gguf: str
    hf_dir: str | None
    tokens: list[int]
    tolerance: dict[str, Any]
    parts: list[Part]
    notes: list[str] = field(default_factory=list)     # what was not checked, and why

    @property
    def ok(self) -> bool:
        return all(p.ok is not False for p in self.parts) and any(p.ok for p in self.parts)

    def part(self, key: str) -> Part:
        return next(p for p in self.parts if p.key == key)

    def to_dict(self) -> dict:
        return _jsonable({"ok": self.ok, "gguf": self.gguf, "hf_dir": self.hf_dir, "tokens": self.tokens,
                          "tolerance": self.tolerance, "parts": [asdict(p) for p in self.parts],
                          "notes": self.notes})


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, float)):
        v = float(x)
        return v if math.isfinite(v) else str(v)
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    if isinstance(x, (QT, GGUFValueType)):
        return x.name
    return x


def _run(part: Part, body: Callable[[Part], Part | None]) -> Part:
    """Run one part; an exception is that part's failure, never the end of the report."""
    try:
        out = body(part)
        if out is not None:
            return out
        if part.ok is None:
            part.finish(part.summary)
    except Exception as e:           # noqa: BLE001 - a crashing part is a failed part
        part.fail(f"{type(e).__name__}: {e}")
        part.ok = False
        part.summary = part.summary or "error"
    return part


# ------------------------------------------------------------------------------------
# the token sequence

def token_sequence(gf: GGUFFile, length: int = SEQ_LEN, seed: int = SEED,
                   extra_special: tuple[int | None, ...] = ()) -> list[int]:
    """`length` ids drawn with a fixed seed among the NORMAL tokens (no control, unused or
    configured special id), below the embedding's row count."""
    n_rows = gf.tensors[T.TOKEN_EMBD].shape[0] if T.TOKEN_EMBD in gf.tensors else 0
    types = gf.fields.get("tokenizer.ggml.token_type")
    if types:
        ok = np.array([i for i, t in enumerate(types[:n_rows]) if t == 1], dtype=np.int64)
    else:
        ok = np.arange(n_rows, dtype=np.int64)
    special = {int(i) for i in extra_special if i is not None}
    for s in SPECIAL_KEYS:
        if s.key in gf.fields:
            special.add(int(gf.fields[s.key]))
    ok = ok[~np.isin(ok, list(special))]
    if len(ok) == 0:
        raise KimiError("the vocabulary has no ordinary token to build a test sequence from")
    rng = np.random.default_rng(seed)
    return [int(i) for i in rng.choice(ok, size=length, replace=True)]


# ------------------------------------------------------------------------------------
# numbers

def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def kl_div(ref: np.ndarray, other: np.ndarray) -> np.ndarray:
    """KL(softmax(ref) || softmax(other)) per row, in nats."""
    lr, lo = log_softmax(ref), log_softmax(other)
    return np.maximum((np.exp(lr) * (lr - lo)).sum(-1), 0.0)


def mean_nll(logits: np.ndarray, ids: list[int], positions: list[int] | None = None) -> float:
    """mean -log p(ids[t+1] | logits[t]) over positions t (default: all but the last); NaN if none."""
    lp = log_softmax(logits)
    pos = [t for t in (positions if positions is not None else range(len(ids) - 1)) if t < len(ids) - 1]
    if not pos:
        return float("nan")
    return float(-np.mean([lp[t, ids[t + 1]] for t in pos]))


MAX_EXP_ARG = math.log(np.finfo(np.float64).max)


def exp_or_inf(x: float) -> float:
    """exp(x), infinite where a float64 overflows (damaged weights give a mean NLL of 1e30), NaN for NaN."""
    return math.inf if x > MAX_EXP_ARG else math.exp(x)


def perplexity(logits: np.ndarray, ids: list[int], positions: list[int] | None = None) -> float:
    """exp(mean NLL), infinite if it overflows."""
    return exp_or_inf(mean_nll(logits, ids, positions))


def perplexity_ratio(run: np.ndarray, ref: np.ndarray, ids: list[int],
                     positions: list[int] | None = None) -> tuple[float, float]:
    """(ln ratio, ratio) of two perplexities, from the difference of their mean NLLs: finite whenever both
    are, however large (NaN if both are infinite: inf / inf says nothing)."""
    log_ratio = mean_nll(run, ids, positions) - mean_nll(ref, ids, positions)
    return log_ratio, exp_or_inf(log_ratio)


@dataclass
class Flags:
    """Positions with a near-tie routing choice, and why."""
    reasons: dict[int, list[str]] = field(default_factory=dict)

    def add(self, t: int, why: str) -> None:
        self.reasons.setdefault(int(t), []).append(why)

    @property
    def positions(self) -> list[int]:
        return sorted(self.reasons)

    def describe(self) -> list[str]:
        return [f"position {t}: " + "; ".join(self.reasons[t]) for t in self.positions]


def routing_flags(margin_tol: float, *sources: tuple[str, dict[str, dict[int, Any]]]) -> Flags:
    """sources: (label, {"moe": {il: [T]}, "dsa": {il: [T]}}); NaN/inf margins mean no choice."""
    flags = Flags()
    seen: dict[tuple[int, str, int], tuple[float, str]] = {}
    for label, margins in sources:
        for kind in ("moe", "dsa"):
            for il, gaps in (margins.get(kind) or {}).items():
                g = np.asarray(gaps.detach().numpy() if hasattr(gaps, "detach") else gaps, dtype=np.float64)
                for t in np.nonzero(np.isfinite(g) & (g < margin_tol))[0]:
                    key = (int(t), kind, int(il))
                    if key not in seen or g[t] < seen[key][0]:
                        seen[key] = (float(g[t]), label)
    for (t, kind, il), (gap, label) in sorted(seen.items()):
        flags.add(t, f"{kind.upper()} layer {il} margin {gap:.2e} ({label})")
    return flags


def _margins_of(obj) -> dict:
    """Runtime.routing_margins (dataclass) or ReferenceModel.last_routing_margins (dict)."""
    if isinstance(obj, dict):
        return obj
    return {"moe": getattr(obj, "moe", {}), "dsa": getattr(obj, "dsa", {})}


def compare_logits(run: np.ndarray, ref: np.ndarray, tol: Tolerance, exclude: list[int]) -> dict[str, Any]:
    """Figures and verdict of runtime logits vs reference logits: every position not in `exclude`
    must be within the max |diff| and KL bounds and agree on the argmax (unless the reference's
    top two are a near tie)."""
    run, ref = np.asarray(run, np.float64), np.asarray(ref, np.float64)
    T = len(ref)
    scale = float(np.sqrt(np.mean(ref ** 2))) or 1.0
    atol = tol.atol(scale)
    diff = np.abs(run - ref).max(-1)
    kl = kl_div(ref, run)
    top2 = np.sort(ref, axis=-1)[:, -2:] if ref.shape[-1] > 1 else np.zeros((T, 2))
    near_tie = (top2[:, 1] - top2[:, 0]) < 2 * atol
    agree = run.argmax(-1) == ref.argmax(-1)
    excluded = sorted(set(exclude))
    judged = [t for t in range(T) if t not in set(excluded)]
    j = np.array(judged, dtype=np.int64)
    finite = bool(np.isfinite(run).all())
    enough = len(judged) >= max(1, math.ceil(MIN_JUDGED_FRACTION * T))
    bad_diff = [t for t in judged if not diff[t] <= atol]
    bad_kl = [t for t in judged if not kl[t] <= tol.kl_max]
    bad_arg = [t for t in judged if not agree[t] and not near_tie[t]]
    return {
        "ok": not bad_diff and not bad_kl and not bad_arg and enough and finite,
        "finite": finite, "positions": T, "judged": len(judged), "excluded": excluded, "enough_judged": enough,
        "logit_scale_rms": scale, "atol": atol,
        "max_abs_diff": float(diff[j].max()) if len(j) else float("nan"),
        "max_abs_diff_all": float(diff.max()),
        "argmax_agree": int(agree[j].sum()) if len(j) else 0,
        "argmax_near_ties": [t for t in judged if near_tie[t] and not agree[t]],
        "kl_max": float(kl[j].max()) if len(j) else float("nan"),
        "kl_mean": float(kl[j].mean()) if len(j) else float("nan"),
        "kl_tol": tol.kl_max, "bad_diff": bad_diff, "bad_kl": bad_kl, "bad_argmax": bad_arg,
    }


def _logit_failures(c: dict, what: str) -> list[str]:
    out = []
    if not c["finite"]:
        out.append(f"{what}: non-finite logits")
    if c["bad_diff"]:
        out.append(f"{what}: |diff| > {c['atol']:.2e} at positions {c['bad_diff']}")
    if c["bad_kl"]:
        out.append(f"{what}: KL > {c['kl_tol']:.0e} at positions {c['bad_kl']}")
    if c["bad_argmax"]:
        out.append(f"{what}: argmax differs at positions {c['bad_argmax']}")
    if not c["enough_judged"]:
        out.append(f"{what}: only {c['judged']}/{c['positions']} positions left after excluding near-ties")
    return out


def _fmt_logits(c: dict) -> str:
    return (f"max|Δ| {c['max_abs_diff']:.2e} (tol {c['atol']:.2e}), argmax {c['argmax_agree']}/{c['judged']}, "
            f"KL max {c['kl_max']:.1e} (tol {c['kl_tol']:.0e})"
            + (f", excluded {c['excluded']}" if c["excluded"] else ""))


# ------------------------------------------------------------------------------------
# part: structure

def check_structure(part: Part, path: Path) -> Part:
    try:
        parts = gguf_parts(path)
    except KimiError as e:
        part.fail(str(e))
        return part.finish("a split part is missing")
    n_tensors, unreadable = 0, 0
    for p in parts:
        try:
            r = read_gguf(p)        # checks alignment, sizes, bounds and packing; names the first fault
        except KimiError as e:
            part.fail(str(e))
            unreadable += 1
            continue
        (layout,) = r.parts
        n_tensors += layout.n_tensors
        part.rows.append({"file": p.name, "bytes": layout.size, "tensors": layout.n_tensors,
                          "alignment": layout.alignment, "gguf_version": layout.version,
                          "data_offset": layout.data_offset})
        if len(parts) > 1:
            no = r.fields.get("split.no")
            if not isinstance(no, int) or no != parts.index(p):
                part.fail(f"{p.name}: split.no is missing or not {parts.index(p)}")
    part.figures = {"files": len(parts), "tensors": n_tensors, "unreadable": unreadable}
    if unreadable:
        return part.finish("not a readable GGUF file" if len(parts) == 1
                           else f"{unreadable} of {len(parts)} files are not readable GGUF files")
    verdict = "offsets aligned and in bounds" if not part.failures else "see the failures"
    return part.finish(f"{len(parts)} file(s), {n_tensors} tensors, {verdict}")


# ------------------------------------------------------------------------------------
# part: tensors against the checkpoint

@dataclass
class _Acc:
    """Running bit-exact comparison of one tensor, chunk by chunk (NaN equals NaN)."""
    n: int = 0
    n_diff: int = 0
    first_diff: int | None = None
    max_abs: float = 0.0

    def add(self, expected: np.ndarray, got: np.ndarray, offset: int = 0) -> None:
        e = np.ascontiguousarray(expected, np.float32).reshape(-1)
        g = np.ascontiguousarray(got, np.float32).reshape(-1)
        if e.shape != g.shape:
            raise ValueError(f"{g.size} values where {e.size} were expected")
        neq = (e.view(np.uint32) != g.view(np.uint32)) & ~(np.isnan(e) & np.isnan(g))
        k = int(neq.sum())
        if k:
            if self.first_diff is None:
                self.first_diff = offset + int(np.argmax(neq))
            self.n_diff += k
            with np.errstate(invalid="ignore", over="ignore"):
                d = np.abs(e[neq].astype(np.float64) - g[neq].astype(np.float64))
            self.max_abs = max(self.max_abs, float(np.nanmax(d))) if not np.isnan(d).all() else float("nan")
        self.n += e.size


def _gguf_values(t: GGUFTensor, index=slice(None)) -> np.ndarray:
    """Dequantised values of t.raw[index] (a row range or an expert), f32."""
    return np.asarray(dequantize(t.raw[index], t.qtype), dtype=np.float32)


def _mxfp4_repack(p, t: GGUFTensor) -> bool:
    """An MXFP4 expert of an MXFP4 checkpoint: the converter's lossless repack."""
    return t.qtype == QT.MXFP4 and p.rule.transform == EXPERTS and len(p.sources[0]) == 2


def is_quantized(p, t: GGUFTensor) -> bool:
    """Stored in a type the converter does not write (it writes F32, BF16 and repacked MXFP4): made by a
    quantizer, from the converter's values. F16 counts: kimi-quantize and llama-quantize write it as a
    target or a shape fallback, rounding the converted values once more."""
    return t.qtype not in CONVERTED_TYPES and not _mxfp4_repack(p, t)


def compare_tensor(p, t: GGUFTensor, ckpt: Checkpoint, cfg: KimiConfig, imatrix=None) -> dict[str, Any]:
    """One planned tensor against the GGUF one: a row of the tensors table."""
    row: dict[str, Any] = {"tensor": p.name, "type": t.qtype.name, "transform": p.rule.transform}
    if not same_shape(t.shape, p.shape):
        return row | {"ok": False, "mode": "shape", "detail": f"shape {list(t.shape)}, expected {list(p.shape)}"}
    t = t.as_shape(p.shape)
    if is_quantized(p, t):
        return row | compare_quantized(p, t, ckpt, cfg, imatrix)
    if p.rule.transform == A_LOG:
        # -exp(A_log[:H]) is computed, not copied: compared with the float64 value rounded to the
        # stored type, within 4 ulp (no float32 exp is correctly rounded everywhere)
        want = round_to(ssm_a(ckpt.read_f32(p.sources[0][0]), cfg.n_head), t.qtype)
        got = _gguf_values(t).reshape(-1)
        ulp = np.abs(want.view(np.int32).astype(np.int64) - got.view(np.int32).astype(np.int64))
        ulp_max = int(ulp.max()) if ulp.size else 0
        ok = ulp_max <= 4 and bool((np.sign(want) == np.sign(got)).all())
        return row | {"ok": ok, "mode": "ulp", "max_ulp": ulp_max,
                      "detail": f"max {ulp_max} ulp from -exp(A_log) (bound 4)"}
    acc = _Acc()
    for expected, index in converted_pieces(p, ckpt, cfg):
        got = _gguf_values(t, index).reshape(-1)
        expected = round_to(np.asarray(expected, np.float32), t.qtype)
        if t.qtype == QT.MXFP4:          # ggml's E2M1 table has no -0: code 8 decodes to +0
            expected, got = expected + np.float32(0), got + np.float32(0)
        acc.add(expected, got, acc.n)
    ok = acc.n_diff == 0
    detail = ("bit-exact" if ok else
              f"{acc.n_diff}/{acc.n} values differ (first at flat index {acc.first_diff}, "
              f"max |diff| {acc.max_abs:.3g})")
    return row | {"ok": ok, "mode": "exact", "n_values": acc.n, "n_diff": acc.n_diff,
                  "max_abs_diff": acc.max_abs, "detail": detail}


# ------------------------------------------------------------------------------------
# quantized tensors: recomputed from the checkpoint, byte for byte

def converted_rows(p, ckpt: Checkpoint, cfg: KimiConfig) -> Callable[[int, int], np.ndarray]:
    """rows(a, b): rows a..b-1 of planned tensor p seen as [rows, ne0] (rows counted across experts), as the
    f32 values the converter computes. Reads only those rows; the small tensors (kv_b's halves, the conv,
    the fused scores) are made whole once."""
    if p.rule.transform == COPY and len(p.shape) == 2:
        src = p.sources[0][0]
        return lambda a, b: source_rows(src, ckpt, a, b)
    if p.rule.transform == EXPERTS:
        return lambda a, b: _expert_rows(p, ckpt, a, b)
    whole = np.concatenate([np.asarray(x, np.float32).reshape(-1) for x, _ in converted_pieces(p, ckpt, cfg)])
    whole = whole.reshape(-1, p.shape[-1])
    return lambda a, b: whole[a:b]


def _expert_rows(p, ckpt: Checkpoint, a: int, b: int) -> np.ndarray:
    e, r = divmod(a, p.shape[-2])        # row_chunks never crosses an expert
    group = p.sources[e]
    if len(group) == 2:                  # MXFP4, as ggml dequantizes it for a re-quantization (no -0)
        packed, scale = (ckpt.map(s) for s in group)
        return mxfp4.decode_compressed(packed[r:r + b - a], scale[r:r + b - a]) + np.float32(0)
    return source_rows(group[0], ckpt, r, r + b - a)


def converted_types(p) -> tuple[QT, ...]:
    """The float types the converter may have written p as, in the order tried: its output types (BF16, the
    default, then F32), or F32 alone where both hold the same values (BF16 or MXFP4 sources, F32 rules)."""
    if p.rule.f32 or all(s.dtype in ("BF16", "U8") for group in p.sources for s in group):
        return (QT.F32,)
    return tuple(OUTTYPES.values())


@dataclass
class _Blocks:
    """Running byte comparison of one quantized tensor, block by block."""
    type_size: int
    blocks_per_row: int
    n: int = 0
    n_diff: int = 0
    first: tuple[int, int] | None = None        # (row, block in that row) of the first differing block
    first_rows: tuple[int, int] | None = None   # the chunk that holds it

    def add(self, a: int, b: int, expected: np.ndarray, stored: np.ndarray) -> None:
        bad = (expected.reshape(-1, self.type_size) != stored.reshape(-1, self.type_size)).any(axis=1)
        self.n += bad.size
        k = int(bad.sum())
        if k and self.first is None:
            i = int(np.argmax(bad))
            self.first, self.first_rows = (a + i // self.blocks_per_row, i % self.blocks_per_row), (a, b)
        self.n_diff += k


def compare_quantized(p, t: GGUFTensor, ckpt: Checkpoint, cfg: KimiConfig, imatrix) -> dict[str, Any]:
    """The file's blocks against our quantization (quant.blocks, chunked and imatrix-sliced by the driver's
    quantize_rows) of the values the converter writes, with the imatrix vector kimi-quantize would use."""
    from ..quant.blocks import block_type, quantize, supported_types     # noqa: PLC0415  (the kernels, on first use)
    row: dict[str, Any] = {"mode": "quantized"}
    if t.qtype not in supported_types():      # neither a pass nor a fault of the file: not checked, and why
        return row | {"mode": UNCHECKED, "ok": None,
                      "detail": f"not checked (n/a): {t.qtype.name} has no byte-exact quantizer here yet, so its "
                                f"blocks cannot be recomputed from the source"}
    bt = block_type(t.qtype)
    d = Decision(p.name, p.shape, QT.F32, t.qtype, "the file's type")
    vector = imatrix_vectors(QuantPlan([d]), imatrix, []).get(p.name) if imatrix is not None else None
    if vector is None and bt.ggml_requires_imatrix:     # IQ1_S, IQ2_XXS, IQ2_XS: no blocks exist without one
        return row | {"mode": UNCHECKED, "ok": None,
                      "detail": f"not checked (n/a): ggml quantizes {t.qtype.name} only with an imatrix, and "
                                + ("none was given (--imatrix)" if imatrix is None else
                                   "the imatrix has no vector for this tensor")}
    stored = t.raw.reshape(-1, t.raw.shape[-1]).view(np.uint8)      # rows of bytes (F16: of values)
    read = converted_rows(p, ckpt, cfg)
    via, chunks = _closest_conversion(d, read, vector, stored, converted_types(p))
    acc = _Blocks(bt.type_size, p.shape[-1] // bt.block_size)
    for a, b, q in chunks:
        acc.add(a, b, q, stored[a:b])
    used = vector is not None and bt.uses_imatrix()        # Q8_0 ignores it, as ggml's quantize_q8_0 does
    values = via.name if len(converted_types(p)) > 1 else _source_dtypes(p)
    how = f"from {values} values, " + ("with the imatrix" if used else "without an imatrix")
    row |= {"converted_as": via.name, "imatrix": used, "uses_imatrix": bt.uses_imatrix(),
            "n_blocks": acc.n, "n_diff": acc.n_diff}
    if not acc.n_diff:
        return row | {"ok": True, "detail": f"byte for byte our {t.qtype.name} ({how})"}
    (r, k), (a, b) = acc.first, acc.first_rows
    unit, at = ("values", "value") if bt.block_size == 1 else ("blocks", "block")
    plain = used and np.array_equal(    # the chunk that differs, quantized without the imatrix
        quantize(round_to(read(a, b), via).reshape(b - a, -1), t.qtype), stored[a:b])
    return row | {"ok": False, "plain_matches": plain,
                  "detail": f"{acc.n_diff}/{acc.n} {t.qtype.name} {unit} differ from our quantization ({how}; "
                            f"first at row {r}, {at} {k})"
                            + ("; those rows equal our quantization without an imatrix" if plain else "")}


def _source_dtypes(p) -> str:
    return "/".join(sorted({"MXFP4" if s.dtype == "U8" else s.dtype for group in p.sources for s in group}))


def _closest_conversion(d: Decision, read, vector, stored: np.ndarray, types: tuple[QT, ...]):
    """(type, chunks): of the types the converter may have written, the one whose first chunk of blocks
    differs least from the file's (the first that matches), and the quantized chunks (a, b, bytes) from it."""
    best = None
    for qtype in types:
        chunks = quantize_rows(replace(d, source=qtype), lambda a, b, q=qtype: round_to(read(a, b), q), vector)
        first = next(chunks)
        n_diff = int((first[2] != stored[first[0]:first[1]]).sum())
        if best is None or n_diff < best[0]:
            best = (n_diff, qtype, first, chunks)
        if n_diff == 0:
            break
    _, qtype, first, chunks = best
    return qtype, itertools.chain([first], chunks)


IMATRIX_KEYS = ("quantize.imatrix.file", "quantize.imatrix.dataset", "quantize.imatrix.entries_count",
                "quantize.imatrix.chunks_count")


def imatrix_failure(rows: list[dict], gf: GGUFFile, imatrix) -> str | None:
    """One line when the quantized tensors that differ point at the imatrix rather than at damage: the file
    records one (quantize.imatrix.*, which kimi-quantize and the llama-quantize tool write) and none was given,
    or another one; the differing blocks are those made without one; or the pattern a wrong imatrix leaves:
    only, and at least two, tensors of types that use one differ (a flipped byte damages one tensor)."""
    bad = [r for r in rows if r["ok"] is False]
    suspects = [r for r in bad if r.get("mode") == "quantized" and r.get("uses_imatrix")]
    if not suspects:
        return None
    recorded = {k: gf.fields[k] for k in IMATRIX_KEYS if k in gf.fields}
    given = {k: v for k, v, _ in imatrix.metadata()} if imatrix is not None else {}
    checked = f"--imatrix {imatrix.path}" if imatrix is not None else "no --imatrix"
    if recorded and imatrix is None:
        return (f"the imatrix differs: the file was quantized with the imatrix {recorded.get(IMATRIX_KEYS[0])} "
                f"(quantize.imatrix.*), and it was checked without one: give it with --imatrix")
    if not recorded and any(r.get("plain_matches") for r in suspects):
        return f"the imatrix differs: the file records none, and its blocks are those made without one ({checked})"
    differ = {k: (recorded.get(k), given.get(k)) for k in IMATRIX_KEYS if recorded and recorded.get(k) != given.get(k)}
    said = "; ".join(f"the file records {k} = {_short(a)}, {checked} has {_short(b)}" for k, (a, b) in differ.items())
    if set(differ) - {IMATRIX_KEYS[0]}:         # not only the path, which a moved file changes
        return f"the imatrix differs: {said}"
    if len(suspects) == len(bad) >= 2:
        return (f"the imatrix differs from the one the file was quantized with ({checked}): the {len(bad)} "
                f"tensors that differ are all of types that use one ({', '.join(sorted({r['type'] for r in bad}))}), "
                f"every other tensor matches" + (f"; {said}" if said else ""))
    return None


def check_tensors(part: Part, plan, gf: GGUFFile, log: Callable[[str], None], imatrix=None) -> Part:
    ckpt, cfg = plan.checkpoint, plan.config
    planned = {p.name: p for p in plan.tensors}
    n_ok = 0
    by_mode: dict[str, int] = {}
    for i, p in enumerate(plan.tensors):
        t = gf.tensors.get(p.name)
        if t is None:
            part.fail(f"{p.name}: missing from the GGUF")
            part.rows.append({"tensor": p.name, "ok": False, "mode": "missing", "detail": "missing"})
            by_mode["missing"] = by_mode.get("missing", 0) + 1
            continue
        try:
            row = compare_tensor(p, t, ckpt, cfg, imatrix)
        except (KimiError, ValueError) as e:        # an imatrix entry of another size, an invalid source
            row = {"tensor": p.name, "type": t.qtype.name, "ok": False, "mode": "quantized", "detail": str(e)}
        part.rows.append(row)
        by_mode[row["mode"]] = by_mode.get(row["mode"], 0) + 1
        if row["ok"]:
            n_ok += 1
        elif row["ok"] is False:
            part.fail(f"{p.name}: {row['detail']}")
        if i % 64 == 63:
            log(f"tensors: {i + 1}/{len(plan.tensors)}")
    extra = sorted(set(gf.tensors) - set(planned))
    for name in extra:
        part.fail(f"{name}: in the GGUF but not made from any checkpoint tensor")
        part.rows.append({"tensor": name, "ok": False, "mode": "extra", "detail": "extra tensor"})
    matched_by_mode = {m: sum(1 for r in part.rows if r.get("mode") == m and r["ok"]) for m in by_mode}
    unchecked = [r for r in part.rows if r["ok"] is None]
    compared = sum(n for m, n in by_mode.items() if m in VALUE_MODES)
    if n_ok == 0 and compared == len(plan.tensors) > 1 and not extra:
        # every tensor is there in its shape and none holds its source's values: one cause, one line
        part.failures = [f"none of the {compared} tensors holds the values of its source in {ckpt.dir}: "
                         f"the file was not converted from this checkpoint"]
    elif (why := imatrix_failure(part.rows, gf, imatrix)) is not None:
        part.failures.insert(0, why)
    part.figures = {"matched": n_ok, "total": len(plan.tensors), "extra": len(extra), "by_mode": by_mode,
                    "matched_by_mode": matched_by_mode,
                    "mismatched": [r["tensor"] for r in part.rows if r["ok"] is False],
                    "unchecked": [r["tensor"] for r in unchecked],
                    "unchecked_types": sorted({r["type"] for r in unchecked}),
                    "imatrix": imatrix.path if imatrix is not None else None,
                    "imatrix_recorded": {k: gf.fields[k] for k in IMATRIX_KEYS if k in gf.fields}}
    return part.finish(f"{n_ok}/{len(plan.tensors)} tensors match their HF source"
                       + (f", {len(extra)} extra" if extra else "") + f" ({_modes_summary(by_mode, matched_by_mode)})")


# how compare_tensor judges a tensor, in the summary's words
UNCHECKED = "unchecked"
VALUE_MODES = {"exact": "bit-exact", "ulp": "ssm_a within 4 ulp", "quantized": "quantized byte for byte"}
OTHER_MODES = {"shape": "of another shape", "missing": "missing", UNCHECKED: "not checked (n/a)"}


def unchecked_note(part: Part) -> str | None:
    """The report's note for the quantized tensors the tensors part could not recompute, or None."""
    names = part.figures.get("unchecked") if isinstance(part.figures, dict) else None
    if not names:
        return None
    types = ", ".join(part.figures["unchecked_types"])
    # the reason: no byte-exact quantizer here for the type, or an imatrix-only type (IQ1_S, IQ2_XXS, IQ2_XS)
    # checked without the imatrix that made it
    reasons = sorted({r["detail"].split(": ", 1)[1] for r in part.rows
                      if r.get("ok") is None and r.get("mode") == UNCHECKED})
    return (f"tensors: {len(names)} quantized tensor(s) ({types}) not checked against their source (n/a): "
            f"{'; '.join(reasons)}; their values are still run by the runtime and the reference")


def _modes_summary(by_mode: dict[str, int], matched: dict[str, int]) -> str:
    """'212/212 bit-exact, 6/6 ssm_a within 4 ulp; 3 of another shape': how many of each kind matched."""
    values = [f"{matched[m]}/{by_mode[m]} {w}" for m, w in VALUE_MODES.items() if m in by_mode]
    others = [f"{by_mode[m]} {w}" for m, w in OTHER_MODES.items() if m in by_mode]
    return "; ".join(x for x in (", ".join(values), ", ".join(others)) if x)


# ------------------------------------------------------------------------------------
# the file's weights, for the reference (quantized files)

def file_weights(plan, gf: GGUFFile) -> dict[str, Callable[[slice | None], np.ndarray]]:
    """HF name -> rows of the file's values of that weight, dequantized and mapped back to the HF name and
    layout (inverting the plan's transform), for every weight whose values in the file are not the
    checkpoint's (quantized, or stored in a narrower float type): ReferenceModel's weight_overrides."""
    out: dict[str, Callable] = {}
    kv_b: dict[SourceTensor, dict[str, GGUFTensor]] = {}
    for p in plan.tensors:
        t = gf.tensors.get(p.name)
        if t is None or not same_shape(t.shape, p.shape) or not _lossy(p, t):
            continue
        t, tr, src = t.as_shape(p.shape), p.rule.transform, p.sources[0][0]
        if tr == EXPERTS:                # expert e: the GGUF's matrix e, in the HF layout already
            out |= {group[0].name: _rows_of(t, e) for e, group in enumerate(p.sources)}
        elif tr in (K_B, V_B):           # both halves of one kv_b
            kv_b.setdefault(src, {})[tr] = t
        elif tr == COPY and len(p.shape) == 2:
            out[src.name] = _rows_of(t, None)
        elif tr in (COPY, CONV1D):
            out[src.name] = lambda rows, t=t, shape=src.shape: _gguf_values(t).reshape(shape)[_all(rows)]
        # RES_SCORE (norm * proj) and A_LOG (-exp) have no HF tensor of their own; F32 in every file
    for src, halves in kv_b.items():
        out[src.name] = lambda rows, src=src, halves=halves: _kv_b_values(src, halves, plan)[_all(rows)]
    return out


def _lossy(p, t: GGUFTensor) -> bool:
    """The file holds other values than the checkpoint: quantized (F16 included), or BF16 rounded from an
    F32 or F16 source (MXFP4 codes times powers of two are BF16 values)."""
    if is_quantized(p, t):
        return True
    return t.qtype == QT.BF16 and any(s.dtype not in ("BF16", "U8") for group in p.sources for s in group)


def _all(rows: slice | None) -> slice:
    return slice(None) if rows is None else rows


def _rows_of(t: GGUFTensor, expert: int | None) -> Callable[[slice | None], np.ndarray]:
    """Rows of a 2-D tensor, or of expert `expert` of a stacked one, dequantized (only those rows)."""
    if expert is None:
        return lambda rows: _gguf_values(t, _all(rows))
    return lambda rows: _gguf_values(t, expert)[_all(rows)]


def _kv_b_values(src: SourceTensor, halves: dict[str, GGUFTensor], plan) -> np.ndarray:
    """kv_b [H*(d_n+d_v), r] with its k rows from attn_k_b (H, r, d_n) and its v rows from attn_v_b (H, d_v, r)
    where the file's differ; the other half from the checkpoint."""
    cfg = plan.config
    dn, dv, r = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    kv = plan.checkpoint.read_f32(src).reshape(cfg.n_head, dn + dv, r).copy()
    if K_B in halves:
        kv[:, :dn, :] = _gguf_values(halves[K_B]).reshape(cfg.n_head, r, dn).transpose(0, 2, 1)
    if V_B in halves:
        kv[:, dn:, :] = _gguf_values(halves[V_B]).reshape(cfg.n_head, dv, r)
    return kv.reshape(src.shape)


# ------------------------------------------------------------------------------------
# part: metadata

VT = GGUFValueType

# llama.cpp reads these per-layer keys with get_key_or_arr into a std::array<uint32_t>; its get_arr takes an
# array of INT32, UINT32 or BOOL alike (src/llama-model-loader.cpp; k31-indexer.md for indexer.types). A
# scalar goes through get_key, which takes exactly one type ("key ... has wrong type"): a UINT32 key stored
# as INT32 does not load. (get_key_or_arr would also take a per-layer array for feed_forward_length,
# head_count, expert_used_count and expert_feed_forward_length, and a scalar head_count_kv; KimiConfig
# holds one value, resp. one per layer, for those, and no llama.cpp tool writes the other form for K3.)
PER_LAYER_KEYS = (Key.HEAD_COUNT_KV, Key.INDEXER_TYPES)
PER_LAYER_ELEMENTS = (VT.INT32, VT.UINT32, VT.BOOL)


def accepted_types(name: str, vtype: VT, sub: VT | None, arch: str) -> list[tuple[VT, VT | None]]:
    """The (type, element type) pairs llama.cpp's loader reads `name` from; ours first."""
    if name in {key(k, arch) for k in PER_LAYER_KEYS} and vtype == VT.ARRAY:
        return [(VT.ARRAY, sub)] + [(VT.ARRAY, e) for e in PER_LAYER_ELEMENTS if e != sub]
    return [(vtype, sub)]


def _type_name(vtype: VT | None, sub: VT | None) -> str:
    return (vtype.name if vtype else "?") + (f"[{sub.name}]" if sub else "")


def _as_loaded(value: Any, vtype: VT) -> Any:
    """A scalar as llama.cpp holds it: BOOL array entries become 0/1 and INT32 bits a uint32 (get_arr);
    floats compare as float32."""
    if vtype == VT.BOOL:
        return int(bool(value))
    if vtype in (VT.INT32, VT.UINT32):
        return int(value) & 0xFFFFFFFF
    if vtype == VT.FLOAT32:
        return np.float32(value)
    if vtype == VT.FLOAT64:
        return float(value)
    return value


def _same_value(want: Any, got: Any, want_type: tuple[VT, VT | None], got_type: tuple[VT, VT | None]) -> bool:
    """Equal as llama.cpp reads them, each under its own stored type."""
    (vtype, sub), (_, got_sub) = want_type, got_type
    if vtype == VT.ARRAY:
        if not isinstance(got, list) or len(got) != len(want):
            return False
        return all(_as_loaded(w, sub) == _as_loaded(g, got_sub) for w, g in zip(want, got))
    return _as_loaded(want, vtype) == _as_loaded(got, vtype)


def _short(v: Any) -> str:
    if isinstance(v, list):
        s = "[" + ",".join(str(int(x)) if isinstance(x, bool) else str(x) for x in v[:16])
        return s + (",...]" if len(v) > 16 else "]")
    return repr(v)


def check_metadata(part: Part, expected: list, gf: GGUFFile, arch: str, *, cfg: KimiConfig,
                   specials: list[ExpectedSpecial] | None = None) -> Part:
    """specials: what each special-token key must say (vocab.checkpoint_specials); by default what Kimi-K3's
    tokenizer fixes (vocab.k3_specials)."""
    n_ok = 0
    if gf.fields.get("general.architecture") != arch:
        part.fail(f"general.architecture is {gf.fields.get('general.architecture')!r}, expected {arch!r}")
    for name, want, vtype, sub in expected:
        got = gf.fields.get(name)
        accepted = accepted_types(name, vtype, sub, arch)
        stored = gf.types.get(name, (None, None))
        row = {"key": name, "expected": _short(want), "type": _type_name(vtype, sub),
               "stored_as": _type_name(*stored)}
        if name not in gf.fields:
            row |= {"ok": False, "found": "missing"}
            part.fail(f"{name}: missing (expected {_short(want)})")
        elif stored not in accepted:
            row |= {"ok": False, "found": f"{_short(got)} as {row['stored_as']}"}
            part.fail(f"{name}: stored as {row['stored_as']}, " + (
                "expected a per-layer ARRAY of INT32, UINT32 or BOOL" if len(accepted) > 1
                else f"llama.cpp reads it only as {row['type']}"))
        elif not _same_value(want, got, (vtype, sub), stored):
            row |= {"ok": False, "found": _short(got)}
            part.fail(f"{name}: {_short(got)}, expected {_short(want)}")
        else:
            row |= {"ok": True, "found": _short(got)}
            n_ok += 1
        part.rows.append(row)
    wanted = {k for k, *_ in expected}
    stray = sorted(k for k in gf.fields if k.startswith(arch + ".") and k not in wanted)
    for k in stray:
        part.fail(f"{k}: unexpected key (not written for this config)")
        part.rows.append({"key": k, "ok": False, "expected": "absent", "found": _short(gf.fields[k])})
    # vocabulary: llama.cpp takes n_vocab from the token list
    tokens = gf.fields.get("tokenizer.ggml.tokens")
    n_tok = len(tokens) if isinstance(tokens, list) else None
    for k in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        v = gf.fields.get(k)
        if v is not None and n_tok is not None and len(v) != n_tok:
            part.fail(f"{k}: {len(v)} entries for {n_tok} tokens")
    vocab_ok = n_tok == cfg.n_vocab
    if not vocab_ok:
        part.fail(f"tokenizer.ggml.tokens: {n_tok} tokens, config vocab_size is {cfg.n_vocab}")
    for k in (T.TOKEN_EMBD, T.OUTPUT):
        t = gf.tensors.get(k)
        if t is not None and t.shape[0] != cfg.n_vocab:
            part.fail(f"{k}: {t.shape[0]} rows, vocab_size is {cfg.n_vocab}")
    part.rows.append({"key": "tokenizer.ggml.tokens (count)", "expected": cfg.n_vocab, "found": n_tok,
                      "type": "ARRAY[STRING]", "ok": vocab_ok})
    n_special, n_special_ok = check_special_tokens(part, gf, k3_specials() if specials is None else specials)
    part.figures = {"keys_matched": n_ok, "keys_expected": len(expected), "unexpected_keys": stray,
                    "vocab_tokens": n_tok, "vocab_size": cfg.n_vocab, "special_ids_matched": n_special_ok,
                    "special_ids": n_special}
    return part.finish(f"{n_ok}/{len(expected)} architecture keys match (value, and a type llama.cpp reads), "
                       f"vocabulary {n_tok}/{cfg.n_vocab}, special ids {n_special_ok}/{n_special}"
                       + (f", {len(stray)} unexpected" if stray else ""))


def check_special_tokens(part: Part, gf: GGUFFile, expected: list[ExpectedSpecial]) -> tuple[int, int]:
    """Each special-token key present (or required) against its expectation: stored as the UINT32 llama.cpp reads,
    inside the vocabulary, the expected id, and naming the expected token. (checked, passed)"""
    tokens = gf.fields.get("tokenizer.ggml.tokens")
    tokens = tokens if isinstance(tokens, list) else []
    n, n_ok = 0, 0
    for e in expected:
        if e.key not in gf.fields and not e.required:
            continue
        n += 1
        problem = _special_problem(e, gf, tokens)
        found = gf.fields.get(e.key, "missing")
        part.rows.append({"key": e.key, "expected": _special_shown(e.token_id, e.text), "type": "UINT32",
                          "stored_as": _type_name(*gf.types.get(e.key, (None, None))),
                          "found": _special_shown(found, _text_at(tokens, found)), "ok": problem is None})
        if problem is None:
            n_ok += 1
        else:
            part.fail(f"{e.key}: {problem}")
    return n, n_ok


def _special_problem(e: ExpectedSpecial, gf: GGUFFile, tokens: list[str]) -> str | None:
    want_id = e.token_id
    if want_id is None and e.text is not None and e.text in tokens:
        want_id = tokens.index(e.text)          # the file's id of the token it must name
    want = f"expected {_special_shown(want_id, e.text)} from {e.source}" if want_id is not None else \
        f"expected the id of {e.text!r} from {e.source}, which the file's vocabulary does not hold" if e.text else \
        f"expected an id of the vocabulary of {len(tokens)} tokens"
    if e.key not in gf.fields:
        return f"missing, {want}"
    got, stored = gf.fields[e.key], gf.types.get(e.key)
    if stored != (VT.UINT32, None):
        return f"{_short(got)} stored as {_type_name(*stored)}, llama.cpp reads it only as UINT32; {want}"
    if not got < len(tokens):
        return f"{got} is outside the vocabulary of {len(tokens)} tokens, {want}"
    if (e.token_id is not None and got != e.token_id) or (e.text is not None and tokens[got] != e.text):
        return f"{_special_shown(got, tokens[got])}, {want}"
    return None


def _text_at(tokens: list[str], token_id: Any) -> str | None:
    ok = isinstance(token_id, int) and not isinstance(token_id, bool) and 0 <= token_id < len(tokens)
    return tokens[token_id] if ok else None


def _special_shown(token_id: Any, text: str | None) -> str:
    if token_id is None:
        return repr(text) if text is not None else "any id of the vocabulary"
    return f"{token_id} ({text!r})" if text is not None else str(token_id)


# ------------------------------------------------------------------------------------
# lone GGUF: the tensors the architecture implies

expected_tensors = gguf_tensors     # name -> (rule, numpy shape), the walk build_plan makes


def _allowed_types(rule) -> tuple[QT, ...] | None:
    if rule.gguf.startswith("blk.{bid}.indexer.") and not rule.f32:
        return INDEXER_MATRIX_TYPES            # llama.cpp refuses anything else
    if rule.f32:
        return (QT.F32,)                       # norms, scores, router, conv, ssm_a, dt, indexer.proj
    return None


def check_lone_tensors(part: Part, gf: GGUFFile, cfg: KimiConfig, log: Callable[[str], None]) -> Part:
    want = expected_tensors(cfg)
    n_ok = 0
    for i, (name, (rule, shape)) in enumerate(want.items()):
        t = gf.tensors.get(name)
        row = {"tensor": name, "expected_shape": list(shape)}
        problems = []
        if t is None:
            problems.append("missing")
        else:
            row |= {"type": t.qtype.name, "shape": list(t.shape)}
            if same_shape(t.shape, shape):
                t = t.as_shape(shape)
            else:
                problems.append(f"shape {list(t.shape)}, the architecture implies {list(shape)}")
            allowed = _allowed_types(rule)
            if allowed and t.qtype not in allowed:
                problems.append(f"type {t.qtype.name}, must be {'/'.join(q.name for q in allowed)}")
            if not problems:
                invalid = _invalid_block(t)
                if invalid:
                    problems.append(invalid)
                elif bad := _non_finite(t):
                    problems.append(f"{bad} non-finite values")
        row["ok"] = not problems
        row["detail"] = "; ".join(problems) or "present, valid blocks, finite"
        part.rows.append(row)
        if problems:
            part.fail(f"{name}: {row['detail']}")
        else:
            n_ok += 1
        if i % 64 == 63:
            log(f"tensors: {i + 1}/{len(want)}")
    extra = sorted(set(gf.tensors) - set(want))
    for name in extra:
        part.fail(f"{name}: not a tensor of {cfg.arch} with this metadata")
        part.rows.append({"tensor": name, "ok": False, "detail": "extra"})
    part.figures = {"present_ok": n_ok, "expected": len(want), "extra": extra}
    return part.finish(f"{n_ok}/{len(want)} expected tensors present with the implied shape, "
                       f"valid blocks and finite values" + (f", {len(extra)} extra" if extra else ""))


def _invalid_block(t: GGUFTensor) -> str | None:
    """Where ggml_validate_row_data (quant.blocks.validate_blocks) rejects t's data, a row chunk at a time,
    or None. Types without a quantizer here (MXFP4, ...) are left to the finite check."""
    from ..quant.blocks import InvalidBlockError, supported_types, validate_blocks    # noqa: PLC0415
    if t.qtype not in supported_types():
        return None
    block = QUANT_SIZES[t.qtype][0]
    stored = t.raw.reshape(-1, t.raw.shape[-1])
    for _, a, b in row_chunks(t.shape):
        try:
            validate_blocks(np.ascontiguousarray(stored[a:b]).view(np.uint8), t.qtype)
        except InvalidBlockError as e:
            row, k = divmod(e.block, t.shape[-1] // block)
            what, where = (f"{e.what} value", f"element {k}") if block == 1 else (f"{e.what} scale", f"block {k}")
            return f"invalid {t.qtype.name} data (as ggml_validate_row_data): {what} at row {a + row}, {where}"
    return None


def _non_finite(t: GGUFTensor) -> int:
    """Non-finite values of t, dequantised a slab of its first axis at a time."""
    if len(t.shape) < 2:
        return int((~np.isfinite(_gguf_values(t))).sum())
    per = max(1, CHUNK_ELEMS // max(1, int(np.prod(t.shape[1:]))))
    return sum(int((~np.isfinite(_gguf_values(t, slice(a, a + per)))).sum())
               for a in range(0, t.shape[0], per))


# keys a reader may omit (KimiConfig.from_gguf and llama.cpp fall back to a default)
LONE_OPTIONAL = (Key.VOCAB_SIZE, Key.INDEXER_TYPES, Key.LAYER_NORM_EPS, Key.KDA_GATE_LOWER_BOUND, Key.Q_LORA_RANK,
                 Key.LEADING_DENSE_BLOCK_COUNT, Key.EXPERT_LATENT_LENGTH, Key.EXPERT_WEIGHTS_NORM,
                 Key.EXPERT_WEIGHTS_SCALE, Key.EXPERT_GROUP_USED_COUNT, Key.KEY_LENGTH, Key.VALUE_LENGTH)


def check_lone_metadata(part: Part, gf: GGUFFile, cfg: KimiConfig) -> Part:
    """The file's keys re-derived through KimiConfig must come back with llama.cpp's types and
    consistent values (derived keys such as key_length are recomputed); optional keys may be absent."""
    optional = {key(k, cfg.arch) for k in LONE_OPTIONAL}
    expected = [kv for kv in cfg.gguf_metadata() if kv[0] in gf.fields or kv[0] not in optional]
    return check_metadata(part, expected, gf, cfg.arch, cfg=cfg)


# ------------------------------------------------------------------------------------
# execution parts

def _available_ram() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class _Runs:
    """Forward passes, made once and shared by the parts that need them."""

    def __init__(self, gguf: Path, hf_dir: Path | None, ids: list[int], log: Callable[[str], None] = print,
                 weights: dict[str, Callable] | None = None):
        self.gguf, self.hf_dir, self.ids, self.log = gguf, hf_dir, ids, log
        self.weights = weights      # the file's weights for the reference (file_weights), or None: the checkpoint's
        self._cache: dict[Any, tuple[np.ndarray, dict]] = {}

    def runtime(self, top_k: int | None = None, dense: bool = False) -> tuple[np.ndarray, dict]:
        key = ("rt", top_k, dense)
        if key not in self._cache:
            from ..runtime.forward import Runtime
            rt = Runtime(self.gguf, top_k=top_k)
            need, avail = rt.estimate_ram_bytes(len(self.ids)), _available_ram()
            if not self._cache:
                self.log(f"runtime: about {need / 2**20:.0f} MiB of RAM for {len(self.ids)} tokens"
                         + (f" ({avail / 2**30:.1f} GiB available)" if avail else ""))
            if avail is not None and need > avail:
                raise KimiError(f"the runtime needs about {need / 2**30:.1f} GiB, "
                                f"{avail / 2**30:.1f} GiB are available")
            if dense:       # the same runtime with the indexer bypassed: plain causal MLA
                rt.cfg = replace(rt.cfg, indexer=None)
            out = np.asarray(rt.logits(self.ids), np.float32)
            self._cache[key] = (out, _margins_of(rt.routing_margins))
        return self._cache[key]

    def reference(self, top_k: int | None = None, dense: bool = False, on: str = FILE) -> tuple[np.ndarray, dict]:
        """The reference on the file's weights (on=FILE, when there are any) or on the checkpoint as is."""
        overrides = self.weights if on == FILE else None
        key = ("ref", top_k, dense, overrides is not None)
        if key not in self._cache:
            from ..runtime.reference import ReferenceModel
            ref = ReferenceModel(str(self.hf_dir), top_k_override=top_k, use_indexer=not dense,
                                 weight_overrides=overrides)
            out = ref.logits(self.ids).detach().numpy().astype(np.float32)
            self._cache[key] = (out, _margins_of(ref.last_routing_margins))
        return self._cache[key]


def check_logits(part: Part, runs: _Runs, tol: Tolerance) -> Part:
    run, m_run = runs.runtime()
    ref, m_ref = runs.reference()
    flags = routing_flags(tol.margin, ("runtime", m_run), ("reference", m_ref))
    c = compare_logits(run, ref, tol, flags.positions)
    for msg in _logit_failures(c, "runtime vs reference"):
        part.fail(msg)
    on_file = runs.weights is not None
    part.figures = c | {"flagged": flags.describe(), "margin_tol": tol.margin,
                        "reference_weights": f"the file's ({len(runs.weights)} dequantized)" if on_file
                        else "the checkpoint's"}
    part.rows = [{"position": t, "max_abs_diff": float(np.abs(run[t] - ref[t]).max()),
                  "kl": float(kl_div(ref[t:t + 1], run[t:t + 1])[0]),
                  "argmax_run": int(run[t].argmax()), "argmax_ref": int(ref[t].argmax()),
                  "judged": t not in flags.reasons, "flag": "; ".join(flags.reasons.get(t, []))}
                 for t in range(len(ref))]
    return part.finish(_fmt_logits(c) + ("; reference on the file's weights" if on_file else ""))


def check_perplexity(part: Part, runs: _Runs, tol: Tolerance) -> Part:
    run, m_run = runs.runtime()
    ref, m_ref = runs.reference()
    flags = routing_flags(tol.margin, ("runtime", m_run), ("reference", m_ref))
    judged = [t for t in range(len(runs.ids) - 1) if t not in flags.reasons]
    p_run, p_ref = perplexity(run, runs.ids, judged), perplexity(ref, runs.ids, judged)
    log_ratio, ratio = perplexity_ratio(run, ref, runs.ids, judged)
    scale = float(np.sqrt(np.mean(np.asarray(ref, np.float64) ** 2))) or 1.0
    bound = tol.ppl_bound(scale)
    if not abs(log_ratio) <= bound:                     # NaN fails too
        part.fail(f"perplexity ratio {ratio:.6f}: |ln ratio| {abs(log_ratio):.2e} > {bound:.2e}"
                  + ("" if math.isfinite(log_ratio) else f" (perplexities {p_run:.4g} and {p_ref:.4g})"))
    part.figures = {"runtime": p_run, "reference": p_ref, "ratio": ratio, "log_ratio_bound": bound,
                    "positions": judged, "runtime_all": perplexity(run, runs.ids),
                    "reference_all": perplexity(ref, runs.ids)}
    return part.finish(f"runtime {p_run:.4f}, reference {p_ref:.4f}, ratio {ratio:.6f} "
                       f"(|ln| bound {bound:.1e}) over {len(judged)} predictions")


def check_cost(part: Part, runs: _Runs, max_kl: float | None) -> Part:
    """What quantization costs: the file's logits (runtime) against the reference on the checkpoint as is.
    Information, unless max_kl makes the mean KL a gate."""
    run, _ = runs.runtime()
    ref, _ = runs.reference(on=CHECKPOINT)
    kl = kl_div(ref, run)
    p_run, p_ref = perplexity(run, runs.ids), perplexity(ref, runs.ids)
    _, ppl_ratio = perplexity_ratio(run, ref, runs.ids)
    agree = int((run.argmax(-1) == ref.argmax(-1)).sum())
    if max_kl is not None and not kl.mean() <= max_kl:
        part.fail(f"mean KL {kl.mean():.3e} against the checkpoint is above --max-kl {max_kl:g}")
    part.figures = {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "ppl_runtime": p_run,
                    "ppl_checkpoint": p_ref, "ppl_ratio": ppl_ratio, "argmax_agree": agree,
                    "positions": len(kl), "max_kl": max_kl}
    part.rows = [{"position": t, "kl": float(kl[t]), "argmax_run": int(run[t].argmax()),
                  "argmax_checkpoint": int(ref[t].argmax())} for t in range(len(kl))]
    part.finish(f"mean KL {kl.mean():.2e} (max {kl.max():.2e}), perplexity ratio {ppl_ratio:.4f}, argmax "
                f"{agree}/{len(kl)} against the checkpoint as is"
                + (f" (gate: mean KL <= {max_kl:g})" if max_kl is not None else " (information)"))
    if max_kl is None:
        part.ok, part.info = None, True
    return part


def check_forward(part: Part, runs: _Runs) -> Part:
    run, m = runs.runtime()
    finite = bool(np.isfinite(run).all())
    if not finite:
        bad = sorted({int(t) for t in np.nonzero(~np.isfinite(run))[0]})
        part.fail(f"non-finite logits at positions {bad}")
    part.figures = {"positions": len(run), "vocab": run.shape[1], "finite": finite,
                    "max_abs_logit": float(np.abs(run[np.isfinite(run)]).max()) if np.isfinite(run).any() else None,
                    "argmax": [int(x) for x in run.argmax(-1)]}
    return part.finish(f"{len(run)} positions x {run.shape[1]} logits, "
                       + ("all finite" if finite else "NOT finite"))


def check_k31(part: Part, runs: _Runs, cfg: KimiConfig, tol: Tolerance) -> Part:
    if cfg.indexer is None:
        part.ok, part.summary = None, f"not applicable ({cfg.arch} has no indexer)"
        return part
    T = len(runs.ids)
    k_small = max(1, T // 4)
    dense, _ = runs.runtime(dense=True)
    rows = part.rows

    def exact(a, b, what):
        d = float(np.abs(a.astype(np.float64) - b).max())
        ok = np.array_equal(a, b)
        rows.append({"check": what, "ok": ok, "max_abs_diff": d})
        if not ok:
            part.fail(f"{what}: differs (max |diff| {d:.3e}), must be identical")
        return d

    # 1. top_k >= length is exactly dense attention (the edge top_k = T, and the file's own top_k)
    eq, _ = runs.runtime(top_k=T)
    exact(eq, dense, f"runtime top_k={T} (= length) vs runtime dense MLA")
    if cfg.indexer.top_k >= T:
        own, _ = runs.runtime()
        exact(own, dense, f"runtime top_k={cfg.indexer.top_k} (file) vs runtime dense MLA")
    # 2. top_k below the length: identical before position top_k, diverging after
    small, m_small = runs.runtime(top_k=k_small)
    exact(small[:k_small], dense[:k_small], f"runtime top_k={k_small}: positions 0..{k_small - 1} vs dense")
    kl = kl_div(dense, small)
    kl_after = kl[k_small:]
    div = float(kl_after.max()) if kl_after.size else 0.0
    diverges = div > DIVERGENCE_MIN
    rows.append({"check": f"runtime top_k={k_small} diverges from dense at positions >= {k_small}",
                 "ok": diverges, "kl_max": div, "kl_mean": float(kl_after.mean()) if kl_after.size else 0.0,
                 "threshold": DIVERGENCE_MIN})
    if not diverges:
        part.fail(f"top_k={k_small} < length {T} does not diverge from dense attention "
                  f"(max KL {div:.2e} <= {DIVERGENCE_MIN:.0e}): the indexer selects nothing")
    figures = {"length": T, "top_k_small": k_small, "file_top_k": cfg.indexer.top_k,
               "divergence_kl_max": div, "divergence_kl_mean": float(kl_after.mean()) if kl_after.size else 0.0,
               "divergence_kl_by_position": [float(x) for x in kl]}
    # 3. against the reference
    if runs.hf_dir is not None:
        ref_dense, m_rd = runs.reference(dense=True)
        ref_eq, _ = runs.reference(top_k=T)
        exact(ref_eq, ref_dense, f"reference top_k={T} vs reference dense MLA")
        c = compare_logits(eq, ref_dense, tol, routing_flags(tol.margin, ("runtime", _margins_of(
            runs.runtime(top_k=T)[1])), ("reference", m_rd)).positions)
        rows.append({"check": f"runtime top_k={T} vs reference dense", "ok": c["ok"], **_brief(c)})
        for msg in _logit_failures(c, f"runtime top_k={T} vs reference dense"):
            part.fail(msg)
        ref_small, m_rs = runs.reference(top_k=k_small)
        flags = routing_flags(tol.margin, ("runtime", m_small), ("reference", m_rs))
        c = compare_logits(small, ref_small, tol, flags.positions)
        rows.append({"check": f"runtime top_k={k_small} vs reference top_k={k_small}", "ok": c["ok"],
                     **_brief(c), "flagged": flags.describe()})
        for msg in _logit_failures(c, f"top_k={k_small} runtime vs reference"):
            part.fail(msg)
        ref_kl = kl_div(ref_dense, ref_small)[k_small:]
        figures["reference_divergence_kl_max"] = float(ref_kl.max()) if ref_kl.size else 0.0
        figures["sparse_flagged"] = flags.describe()
    part.figures = figures
    return part.finish(f"top_k>={T} == dense exactly; top_k={k_small} diverges (KL max {div:.2e}, "
                       f"threshold {DIVERGENCE_MIN:.0e})"
                       + (", and matches the reference" if runs.hf_dir is not None else ""))


def _brief(c: dict) -> dict:
    return {k: c[k] for k in ("max_abs_diff", "atol", "kl_max", "argmax_agree", "judged", "excluded")}


# ------------------------------------------------------------------------------------
# entry point

TORCH_HINT = "the torch reference needs torch: pip install 'kimi-convert[verify]' (torch==2.13.0, CPU)"


def reference_unavailable() -> str | None:
    """Why the torch reference cannot run here (torch is an optional extra), or None."""
    try:
        import_module("..runtime.reference", __package__)
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != "torch":
            raise
        return TORCH_HINT
    return None


def verify(gguf_path: Path, hf_dir: Path | None = None, *, length: int = SEQ_LEN, seed: int = SEED,
           imatrix=None, max_kl: float | None = None, log: Callable[[str], None] = lambda s: None) -> Report:
    """Check `gguf_path` (any part of a split file) against `hf_dir`, or on its own.

    imatrix: the importance matrix the file was quantized with (a path, or quant.imatrix.load_imatrix's
    result), for the byte comparison of its quantized tensors; max_kl: fail when the mean KL of the file's
    logits against the checkpoint's is above it. Both need hf_dir."""
    gguf_path = Path(gguf_path)
    if not gguf_path.exists():
        raise KimiError(f"{gguf_path}: not found")
    if length < 2:
        raise KimiError(f"--length {length}: need at least 2 tokens")
    for given, what in ((imatrix, "--imatrix"), (max_kl, "--max-kl")):
        if given is not None and hf_dir is None:
            raise KimiError(f"{what} needs the checkpoint: kimi-verify check HF_DIR {gguf_path} {what} ...")
    if max_kl is not None and not max_kl >= 0:
        raise KimiError(f"--max-kl {max_kl}: must be a number >= 0 (nats)")
    if imatrix is not None and not hasattr(imatrix, "vector"):
        from ..quant.imatrix import load_imatrix
        imatrix = load_imatrix(imatrix)                 # a bad imatrix is the user's error: raises
    plan = None
    if hf_dir is not None:
        from ..convert.converter import build_plan
        plan = build_plan(Path(hf_dir), "f32")         # a bad checkpoint is the user's error: raises
    hf = str(hf_dir) if hf_dir is not None else None
    structure = _run(Part("structure", "structure"), lambda p: check_structure(p, gguf_path))
    try:
        gf = open_gguf(gguf_path)
    except KimiError as e:                              # already named by the structure part, as a rule
        if str(e) not in structure.failures:
            structure.fail(str(e))
            structure.summary = "not readable as one GGUF file"
        structure.ok = False
        return Report(str(gguf_path), hf, [], {}, [structure])

    tol = TOLERANCES[file_class(gf)]
    ids: list[int] = []
    try:
        ids = token_sequence(gf, length, seed, tuple(plan.config.extra.values()) if plan is not None else ())
    except Exception as e:                              # noqa: BLE001
        structure.fail(f"no token sequence: {e}")
        structure.ok = False
    report = Report(str(gguf_path), hf, ids, asdict(tol), [structure])
    if plan is not None:
        report.parts += _checkpoint_parts(report, gf, plan, Path(hf_dir), tol, log, imatrix, max_kl)
    else:
        report.parts += _lone_parts(gf, _Runs(gguf_path, None, ids, log), tol, log)
    return report


def _needs_ids(runs: "_Runs", fn: Callable[[Part], Part]) -> Callable[[Part], Part]:
    def body(p: Part) -> Part:
        if not runs.ids:
            raise KimiError("no token sequence (see structure)")
        return fn(p)
    return body


def _checkpoint_parts(report: Report, gf: GGUFFile, plan, hf_dir: Path, tol: Tolerance, log, imatrix,
                      max_kl: float | None) -> list[Part]:
    cfg = plan.config
    if gf.arch != cfg.arch:                             # nothing else can be compared: one line says why
        meta = Part("metadata", "metadata vs config.json")
        meta.fail(f"general.architecture is {gf.arch or 'missing'}, but {hf_dir} is a {cfg.arch} checkpoint: "
                  f"the file was not made from it")
        meta.finish(f"architecture {gf.arch or 'missing'}, the checkpoint's is {cfg.arch}")
        skipped = [Part(k, t, ok=None, summary="not compared: the architectures differ")
                   for k, t in (("tensors", "tensors vs checkpoint"), ("logits", "logits: runtime vs reference"),
                                ("perplexity", "perplexity"), ("cost", COST_TITLE))]
        return skipped[:1] + [meta] + skipped[1:]
    no_reference = reference_unavailable()
    weights = file_weights(plan, gf) if tol.reference == FILE else None
    runs = _Runs(Path(report.gguf), None if no_reference else hf_dir, report.tokens, log, weights)
    log("comparing tensors")
    parts = [_run(Part("tensors", "tensors vs checkpoint"), lambda p: check_tensors(p, plan, gf, log, imatrix)),
             _run(Part("metadata", "metadata vs config.json"),
                  lambda p: check_metadata(p, cfg.gguf_metadata(), gf, cfg.arch, cfg=cfg,
                                           specials=checkpoint_specials(hf_dir, _text_config(hf_dir))))]
    if (note := unchecked_note(parts[0])) is not None:
        report.notes.append(note)
    if no_reference:                                    # the file is not at fault: those parts are n/a
        log("running the runtime (no reference)")
        report.notes.append(f"logits, perplexity, quantization cost"
                            f"{', K3.1 against the reference' if cfg.indexer else ''}: n/a -- {no_reference}")
        cost = Part("cost", COST_TITLE, ok=None, summary=no_reference)
        if max_kl is not None:                          # a gate that cannot be evaluated does not pass
            cost.fail(f"--max-kl {max_kl:g} cannot be checked: {no_reference}")
            cost.ok = False
        return parts + [Part("logits", "logits: runtime vs reference", ok=None, summary=no_reference),
                        _run(Part("k31", "K3.1 indexer (runtime only)"),
                             _needs_ids(runs, lambda p: check_k31(p, runs, cfg, tol))),
                        Part("perplexity", "perplexity", ok=None, summary=no_reference), cost]
    log("running runtime and reference" + (" (on the file's dequantized weights)" if weights else ""))
    return parts + [_run(Part("logits", "logits: runtime vs reference"),
                         _needs_ids(runs, lambda p: check_logits(p, runs, tol))),
                    _run(Part("k31", "K3.1 indexer"), _needs_ids(runs, lambda p: check_k31(p, runs, cfg, tol))),
                    _run(Part("perplexity", "perplexity"),
                         _needs_ids(runs, lambda p: check_perplexity(p, runs, tol))),
                    _run(Part("cost", COST_TITLE), _needs_ids(runs, lambda p: check_cost(p, runs, max_kl)))]


COST_TITLE = "quantization cost (vs the checkpoint)"


def _lone_parts(gf: GGUFFile, runs: "_Runs", tol: Tolerance, log) -> list[Part]:
    meta = Part("metadata", "metadata (keys and types)")
    try:
        cfg = KimiConfig.from_gguf(gf.fields, gf.paths[0])
    except KimiError as e:
        meta.fail(str(e))
        meta.ok, meta.summary = False, "the architecture cannot be read from the metadata"
        return [meta]
    log("reading every tensor")
    parts = [_run(meta, lambda p: check_lone_metadata(p, gf, cfg)),
             _run(Part("tensors", "tensors the architecture implies"), lambda p: check_lone_tensors(p, gf, cfg, log))]
    log("running the runtime")
    return parts + [_run(Part("forward", "forward pass"), _needs_ids(runs, lambda p: check_forward(p, runs))),
                    _run(Part("k31", "K3.1 indexer (runtime only)"),
                         _needs_ids(runs, lambda p: check_k31(p, runs, cfg, tol)))]
