"""The tensors part: every GGUF tensor against its checkpoint source through the plan's transform, bit-exact
for float and MXFP4 tensors, and byte for byte our quantization (with the imatrix) for quantized ones."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np
from gguf import GGMLQuantizationType as QT

from ..convert.checkpoint import Checkpoint
from ..convert.converter import OUTTYPES
from ..convert.transforms import ssm_a
from ..convert.values import converted_pieces, round_to
from ..errors import KimiError
from ..gguf_io import GGUFFile, GGUFTensor, dequantize, same_shape
from ..model import KimiConfig
from ..quant.driver import imatrix_vectors, quantize_rows
from ..quant.imatrix import Imatrix
from ..quant.plan import Decision, QuantPlan
from ..tensor_map import A_LOG, EXPERTS
from .report import CONVERTED_TYPES, Part, _short

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


def compare_tensor(p, t: GGUFTensor, ckpt: Checkpoint, cfg: KimiConfig,
                   imatrix: Imatrix | None = None) -> dict[str, Any]:
    """One planned tensor against the GGUF one: a row of the tensors table."""
    row: dict[str, Any] = {"tensor": p.name, "type": t.qtype.name, "transform": p.rule.transform.name}
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
    f32 values the converter computes: its transform's reader (reading only those rows of a matrix or expert)."""
    return p.rule.transform.f32_rows(p, ckpt, cfg)


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


def compare_quantized(p, t: GGUFTensor, ckpt: Checkpoint, cfg: KimiConfig, imatrix: Imatrix | None) -> dict[str, Any]:
    """The file's blocks against our quantization (quant.blocks, chunked and imatrix-sliced by the driver's
    quantize_rows) of the values the converter writes, with the imatrix vector kimi-quantize would use."""
    from ..quant.blocks import block_type, quantize, supported_types  # noqa: PLC0415  (the kernels, on first use)
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


def imatrix_failure(rows: list[dict], gf: GGUFFile, imatrix: Imatrix | None) -> str | None:
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


def check_tensors(part: Part, plan, gf: GGUFFile, log: Callable[[str], None], imatrix: Imatrix | None = None) -> Part:
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
