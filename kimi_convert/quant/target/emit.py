"""The choice written down as an ordinary policy: one rule per decision (an anchored regex of its exact tensor
names), so that `kimi-quantize --policy CHOSEN.toml` plans, and writes, the same file.

Every tensor that is not protected is named: the solver's decisions with their measured error and bytes, and
the tensors it did not decide (a --policy BASE rule's, or those with no other type) with their planned type.
`default` is the type most of the decided bytes went to: it names the file type (general.file_type) and no
tensor. `requires` lists what writing it needs, as a shipped preset does: always the imatrix (the types were
chosen with it, and the quantizers that read it write other bytes without it).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from gguf import GGMLQuantizationType as QT

from ..mixtures import FLOAT_TYPES
from ..plan import Decision
from .budget import decimal_size


@dataclass(frozen=True)
class Chosen:
    """One decision's outcome: its tensors, the type, its measured error (None: not decided by the solver)
    and why, for the rule's `why`."""
    decisions: tuple[Decision, ...]
    qtype: QT
    error: float | None
    why: str


def exact_pattern(names: list[str]) -> str:
    if len(names) == 1:
        return f"^{re.escape(names[0])}$"
    return "^(?:" + "|".join(re.escape(n) for n in names) + ")$"


def policy_text(chosen: list[Chosen], header: list[str]) -> str:
    """The TOML text; `header`: comment lines (the budget, bytes per class, error, cache, solver)."""
    decided: dict[QT, int] = {}
    for c in chosen:
        if c.error is not None:
            decided[c.qtype] = decided.get(c.qtype, 0) + sum(d.target_bytes for d in c.decisions)
    default = max(decided, key=lambda t: (decided[t], -int(t))) if decided else None
    needs = ["imatrix"]     # the types were measured, and are written, with it: without it the bytes differ
    if any(c.qtype != d.source and d.source not in FLOAT_TYPES for c in chosen for d in c.decisions):
        needs.append("allow-requantize")
    lines = [f"# {h}" for h in header]
    lines += [f"description = {_s('chosen by kimi-quantize ' + header[0] if header else 'chosen by kimi-quantize')}",
              f"default = {_s(default.name if default is not None else 'keep')}",
              f"requires = [{', '.join(_s(n) for n in needs)}]", ""]
    for c in chosen:
        names = [d.name for d in c.decisions]
        kept = all(c.qtype == d.source for d in c.decisions)
        lines += ["[[rules]]", f"pattern = {_s(exact_pattern(names))}",
                  f"type = {_s('keep' if kept and c.error is None else c.qtype.name)}", f"why = {_s(c.why)}", ""]
    return "\n".join(lines)


def decided_why(qtype: QT, error: float, nbytes: int, others: str) -> str:
    return f"solver: {qtype.name}, measured error {error:.4g}, {decimal_size(nbytes)}; {others}"


def _s(text: str) -> str:
    """A TOML basic string (JSON's escapes are TOML's)."""
    return json.dumps(text, ensure_ascii=True)
