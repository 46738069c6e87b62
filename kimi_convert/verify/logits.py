"""Numbers on logits: the fixed token sequence, log-softmax, KL, NLL and perplexity, the near-tie routing
flags (RoutingMargins below the tolerance) and the comparison of runtime logits with the reference's."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..constants import T
from ..convert.vocab import SPECIAL_KEYS
from ..errors import KimiError
from ..gguf_io import GGUFFile
from ..runtime.margins import RoutingMargins
from .report import MIN_JUDGED_FRACTION, SEED, SEQ_LEN, Tolerance

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


def routing_flags(margin_tol: float, *sources: tuple[str, RoutingMargins]) -> Flags:
    """sources: (label, the margins of the runtime or the reference); NaN/inf margins mean no choice."""
    flags = Flags()
    seen: dict[tuple[int, str, int], tuple[float, str]] = {}
    for label, margins in sources:
        for kind, per_layer in (("moe", margins.moe), ("dsa", margins.dsa)):
            for il, gaps in per_layer.items():
                g = np.asarray(gaps, dtype=np.float64)
                for t in np.nonzero(np.isfinite(g) & (g < margin_tol))[0]:
                    key = (int(t), kind, int(il))
                    if key not in seen or g[t] < seen[key][0]:
                        seen[key] = (float(g[t]), label)
    for (t, kind, il), (gap, label) in sorted(seen.items()):
        flags.add(t, f"{kind.upper()} layer {il} margin {gap:.2e} ({label})")
    return flags


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
