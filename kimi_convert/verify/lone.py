"""A GGUF without its checkpoint: the tensors the architecture implies (shape, type, valid blocks, finite
values) and the metadata keys llama.cpp reads."""
from __future__ import annotations

from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as QT

from ..constants import INDEXER_MATRIX_TYPES, Key, key
from ..gguf_io import QUANT_SIZES, GGUFFile, GGUFTensor, same_shape
from ..model import KimiConfig
from ..quant.driver import row_chunks
from ..tensor_map import gguf_tensors
from .metadata import check_metadata
from .report import CHUNK_ELEMS, Part
from .tensors import _gguf_values

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
    from ..quant.blocks import InvalidBlockError, supported_types, validate_blocks  # noqa: PLC0415
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
