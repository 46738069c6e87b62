"""The verdict's shapes: the tolerances of each file class (docs/verification.md explains every number),
a Part (one pass/fail check with its figures and rows) and the Report of a run."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType

from ..gguf_io import GGUFFile

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


def _short(v: Any) -> str:
    if isinstance(v, list):
        s = "[" + ",".join(str(int(x)) if isinstance(x, bool) else str(x) for x in v[:16])
        return s + (",...]" if len(v) > 16 else "]")
    return repr(v)
