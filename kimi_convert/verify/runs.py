"""The execution parts: the runtime and the reference run once each on the token sequence (_Runs), then
logits, perplexity, quantization cost, a lone forward pass and the K3.1 indexer are judged on those runs."""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import KimiError
from ..model import KimiConfig
from ..runtime.margins import RoutingMargins
from .logits import (
    _fmt_logits,
    _logit_failures,
    compare_logits,
    kl_div,
    perplexity,
    perplexity_ratio,
    routing_flags,
)
from .report import CHECKPOINT, DIVERGENCE_MIN, FILE, Part, Tolerance

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
        self._cache: dict[Any, tuple[np.ndarray, RoutingMargins]] = {}

    def runtime(self, top_k: int | None = None, dense: bool = False) -> tuple[np.ndarray, RoutingMargins]:
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
            self._cache[key] = (out, rt.routing_margins)
        return self._cache[key]

    def reference(self, top_k: int | None = None, dense: bool = False,
                  on: str = FILE) -> tuple[np.ndarray, RoutingMargins]:
        """The reference on the file's weights (on=FILE, when there are any) or on the checkpoint as is."""
        overrides = self.weights if on == FILE else None
        key = ("ref", top_k, dense, overrides is not None)
        if key not in self._cache:
            from ..runtime.reference import ReferenceModel
            ref = ReferenceModel(str(self.hf_dir), top_k_override=top_k, use_indexer=not dense,
                                 weight_overrides=overrides)
            out = ref.logits(self.ids).detach().numpy().astype(np.float32)
            self._cache[key] = (out, ref.last_routing_margins)
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
        c = compare_logits(eq, ref_dense, tol, routing_flags(tol.margin, ("runtime", runs.runtime(top_k=T)[1]),
                                                          ("reference", m_rd)).positions)
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
