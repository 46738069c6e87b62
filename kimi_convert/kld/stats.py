"""llama-perplexity's KL-divergence statistics, computed as it computes them and printed under its labels.

Per scored token (tools/perplexity/perplexity.cpp, the `log_softmax` that takes the base's u16 row): the quantized
model's nll from its float32 logits, the base's nll and log-probabilities from the stored row, KLD = sum over the
entries with base log p > -16 of p_base (log p_base - log p), whether both argmax agree, and dp = p - p_base of
the correct token. Sums are kept in double as llama-perplexity keeps them; the uncertainties, covariance and
percentiles are its formulas (`mean_and_uncertainty`, `covariance`, the interpolating percentile).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .basefile import LOG_PROB_RANGE, expand, log_sum_exp

F32 = np.float32


@dataclass
class KldStats:
    sum_nll: float = 0.0
    sum_nll2: float = 0.0
    sum_nll_base: float = 0.0
    sum_nll_base2: float = 0.0
    sum_nll_nll_base: float = 0.0
    sum_kld: float = 0.0
    sum_kld2: float = 0.0
    sum_p_diff: float = 0.0
    sum_p_diff2: float = 0.0
    sum_p_diff4: float = 0.0
    n_same_top: int = 0
    count: int = 0
    kld_values: list = field(default_factory=list)           # float32 arrays, one a chunk
    p_diff_values: list = field(default_factory=list)
    chunk_kld: list = field(default_factory=list)            # mean KLD of each chunk (for paired comparisons)

    def add(self, logits: np.ndarray, base_rows: np.ndarray, targets: np.ndarray) -> None:
        """One chunk's scored tokens: the quantized logits [n, V], the base rows [n, row_width], the next tokens."""
        logits = np.asarray(logits, F32)
        n, n_vocab = logits.shape
        idx = np.arange(n)
        top, lse = log_sum_exp(logits)
        nll = (top + lse - logits[idx, targets]).astype(F32)
        base = expand(base_rows, n_vocab)                                     # log p_base, float32
        nll_base = -base[idx, targets]
        shifted = (top + lse).astype(F32)                                     # so that log p = l - shifted
        keep = base > F32(-LOG_PROB_RANGE)
        terms = np.where(keep, np.exp(base) * ((base - logits) + shifted[:, None]), F32(0))
        kld = terms.sum(axis=1, dtype=np.float64)
        p_diff = (np.exp(-nll) - np.exp(-nll_base)).astype(F32)
        p_diff2 = (p_diff * p_diff).astype(np.float64)
        self.sum_nll += float(nll.sum(dtype=np.float64))
        self.sum_nll2 += float((nll * nll).sum(dtype=np.float64))
        self.sum_nll_base += float(nll_base.sum(dtype=np.float64))
        self.sum_nll_base2 += float((nll_base * nll_base).sum(dtype=np.float64))
        self.sum_nll_nll_base += float((nll * nll_base).sum(dtype=np.float64))
        self.sum_kld += float(kld.sum())
        self.sum_kld2 += float((kld * kld).sum())
        self.sum_p_diff += float(p_diff.sum(dtype=np.float64))
        self.sum_p_diff2 += float(p_diff2.sum())
        self.sum_p_diff4 += float((p_diff2 * p_diff2).sum())
        self.n_same_top += int((logits.argmax(axis=1) == base.argmax(axis=1)).sum())
        self.count += n
        self.kld_values.append(kld.astype(F32))
        self.p_diff_values.append(p_diff)
        self.chunk_kld.append(float(kld.mean()))

    def sorted_values(self) -> tuple[np.ndarray, np.ndarray]:
        """(KLD, dp) of every scored token, sorted: what the percentiles are read from."""
        return np.sort(np.concatenate(self.kld_values)), np.sort(np.concatenate(self.p_diff_values))

    # --- llama-perplexity's summary ---
    def summary(self) -> dict:
        c = self.count
        log_ppl, log_ppl_unc = _mean_unc(self.sum_nll, self.sum_nll2, c)
        log_base, log_base_unc = _mean_unc(self.sum_nll_base, self.sum_nll_base2, c)
        cov = _covariance(self.sum_nll, self.sum_nll_base, self.sum_nll_nll_base, c)
        ratio_unc = math.sqrt(max(log_ppl_unc ** 2 + log_base_unc ** 2 - 2 * cov, 0.0))
        ppl, ppl_base = math.exp(log_ppl), math.exp(log_base)
        ppl_unc, ppl_base_unc = ppl * log_ppl_unc, ppl_base * log_base_unc
        kld_mean, kld_unc = _mean_unc(self.sum_kld, self.sum_kld2, c)
        mse, mse_unc = _mean_unc(self.sum_p_diff2, self.sum_p_diff4, c)
        rms = math.sqrt(mse)
        same = self.n_same_top / c
        kv, pv = self.sorted_values()
        dp_mean, dp_unc = _mean_unc(self.sum_p_diff, self.sum_p_diff2, c)
        return {
            "tokens": c,
            "ppl": ppl, "ppl_unc": ppl_unc, "ppl_base": ppl_base, "ppl_base_unc": ppl_base_unc,
            "cor": cov / (log_ppl_unc * log_base_unc) if log_ppl_unc * log_base_unc else 0.0,
            "ln_ppl_ratio": log_ppl - log_base, "ln_ppl_ratio_unc": ratio_unc,
            "ppl_ratio": math.exp(log_ppl - log_base), "ppl_ratio_unc": math.exp(log_ppl - log_base) * ratio_unc,
            "ppl_diff": ppl - ppl_base,
            "ppl_diff_unc": math.sqrt(max(ppl_unc ** 2 + ppl_base_unc ** 2 - 2 * ppl * ppl_base * cov, 0.0)),
            "kld_mean": kld_mean, "kld_unc": kld_unc,
            "kld_max": float(kv[-1]), "kld_99.9": _pct(kv, 0.999), "kld_99": _pct(kv, 0.99),
            "kld_95": _pct(kv, 0.95), "kld_90": _pct(kv, 0.90), "kld_median": _median(kv),
            "kld_10": _pct(kv, 0.10), "kld_5": _pct(kv, 0.05), "kld_1": _pct(kv, 0.01), "kld_0.1": _pct(kv, 0.001),
            "kld_min": float(kv[0]),
            "dp_mean": dp_mean, "dp_unc": dp_unc, "dp_max": float(pv[-1]), "dp_99.9": _pct(pv, 0.999),
            "dp_99": _pct(pv, 0.99), "dp_95": _pct(pv, 0.95), "dp_90": _pct(pv, 0.90), "dp_75": _pct(pv, 0.75),
            "dp_median": _median(pv), "dp_25": _pct(pv, 0.25), "dp_10": _pct(pv, 0.10), "dp_5": _pct(pv, 0.05),
            "dp_1": _pct(pv, 0.01), "dp_0.1": _pct(pv, 0.001), "dp_min": float(pv[0]),
            "rms_dp": rms, "rms_dp_unc": 0.5 / rms * mse_unc if rms else 0.0,
            "same_top": same, "same_top_unc": math.sqrt(same * (1 - same) / (c - 1)) if c > 1 else 0.0,
            "chunk_kld": list(self.chunk_kld),
        }

    def chunk_line(self, chunk: int) -> str:
        """The line llama-perplexity prints after each chunk (running values)."""
        c = self.count
        log_ppl, log_ppl_unc = _mean_unc(self.sum_nll, self.sum_nll2, c)
        log_base, log_base_unc = _mean_unc(self.sum_nll_base, self.sum_nll_base2, c)
        cov = _covariance(self.sum_nll, self.sum_nll_base, self.sum_nll_nll_base, c)
        ratio_unc = math.sqrt(max(log_ppl_unc ** 2 + log_base_unc ** 2 - 2 * cov, 0.0))
        kld, kld_unc = _mean_unc(self.sum_kld, self.sum_kld2, c)
        mse, mse_unc = _mean_unc(self.sum_p_diff2, self.sum_p_diff4, c)
        rms = math.sqrt(mse)
        same = self.n_same_top / c
        same_unc = math.sqrt(same * (1 - same) / (c - 1)) if c > 1 else 0.0
        ppl = math.exp(log_ppl)
        return (f"{chunk:4d}    {ppl:9.4f} ± {ppl * log_ppl_unc:9.4f}    {log_ppl - log_base:10.5f} ± "
                f"{ratio_unc:10.5f}    {kld:10.5f} ± {kld_unc:10.5f}    {100 * rms:6.3f} ± "
                f"{100 * (0.5 / rms * mse_unc if rms else 0):6.3f} %    {100 * same:6.3f} ± {100 * same_unc:6.3f} %")


CHUNK_HEADER = ("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              "
                "Δp RMS            Same top p")


def report_lines(s: dict) -> list[str]:
    """The summary as llama-perplexity prints it (same labels and formats: scripts for one read the other)."""
    pct = lambda key: 100.0 * s[key]
    return [
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {s['ppl']:10.6f} ± {s['ppl_unc']:10.6f}",
        f"Mean PPL(base)                : {s['ppl_base']:10.6f} ± {s['ppl_base_unc']:10.6f}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {100.0 * s['cor']:6.2f}%",
        f"Mean ln(PPL(Q)/PPL(base))     : {s['ln_ppl_ratio']:10.6f} ± {s['ln_ppl_ratio_unc']:10.6f}",
        f"Mean PPL(Q)/PPL(base)         : {s['ppl_ratio']:10.6f} ± {s['ppl_ratio_unc']:10.6f}",
        f"Mean PPL(Q)-PPL(base)         : {s['ppl_diff']:10.6f} ± {s['ppl_diff_unc']:10.6f}",
        "",
        "====== KL divergence statistics ======",
        f"Mean    KLD: {s['kld_mean']:10.6f} ± {s['kld_unc']:10.6f}",
        f"Maximum KLD: {s['kld_max']:10.6f}",
        f"99.9%   KLD: {s['kld_99.9']:10.6f}",
        f"99.0%   KLD: {s['kld_99']:10.6f}",
        f"95.0%   KLD: {s['kld_95']:10.6f}",
        f"90.0%   KLD: {s['kld_90']:10.6f}",
        f"Median  KLD: {s['kld_median']:10.6f}",
        f"10.0%   KLD: {s['kld_10']:10.6f}",
        f" 5.0%   KLD: {s['kld_5']:10.6f}",
        f" 1.0%   KLD: {s['kld_1']:10.6f}",
        f" 0.1%   KLD: {s['kld_0.1']:10.6f}",
        f"Minimum KLD: {s['kld_min']:10.6f}",
        "",
        "====== Token probability statistics ======",
        f"Mean    Δp: {pct('dp_mean'):6.3f} ± {pct('dp_unc'):5.3f} %",
        f"Maximum Δp: {pct('dp_max'):6.3f}%",
        f"99.9%   Δp: {pct('dp_99.9'):6.3f}%",
        f"99.0%   Δp: {pct('dp_99'):6.3f}%",
        f"95.0%   Δp: {pct('dp_95'):6.3f}%",
        f"90.0%   Δp: {pct('dp_90'):6.3f}%",
        f"75.0%   Δp: {pct('dp_75'):6.3f}%",
        f"Median  Δp: {pct('dp_median'):6.3f}%",
        f"25.0%   Δp: {pct('dp_25'):6.3f}%",
        f"10.0%   Δp: {pct('dp_10'):6.3f}%",
        f" 5.0%   Δp: {pct('dp_5'):6.3f}%",
        f" 1.0%   Δp: {pct('dp_1'):6.3f}%",
        f" 0.1%   Δp: {pct('dp_0.1'):6.3f}%",
        f"Minimum Δp: {pct('dp_min'):6.3f}%",
        f"RMS Δp    : {pct('rms_dp'):6.3f} ± {pct('rms_dp_unc'):5.3f} %",
        f"Same top p: {pct('same_top'):6.3f} ± {pct('same_top_unc'):5.3f} %",
    ]


def ppl_estimate(sum_nll: float, sum_nll2: float, count: int) -> tuple[float, float]:
    """llama-perplexity's "Final estimate: PPL = X +/- Y" (the base run's line)."""
    mean = sum_nll / count
    var = sum_nll2 / count - mean * mean
    ppl = math.exp(mean)
    return ppl, (math.sqrt(var / (count - 1)) * ppl if var > 0 and count > 1 else 0.0)


def _mean_unc(total: float, total2: float, count: int) -> tuple[float, float]:
    if count < 1:
        return 0.0, 0.0
    f = total / count
    df = total2 / count - f * f
    return f, (math.sqrt(df / (count - 1)) if df > 0 and count > 10 else 0.0)


def _covariance(a: float, b: float, ab: float, count: int) -> float:
    if count < 10:
        return 0.0
    return (ab / count - (a / count) * (b / count)) / (count - 1)


def _pct(values: np.ndarray, fraction: float) -> float:
    if fraction <= 0:
        return float(values[0])
    if fraction >= 1:
        return float(values[-1])
    p = np.float32(fraction) * np.float32(len(values) - 1)
    ip = int(p)
    p = p - np.float32(ip)
    return float((1 - p) * values[ip] + p * values[min(ip + 1, len(values) - 1)])


def _median(values: np.ndarray) -> float:
    n = len(values)
    return float(0.5 * (values[n // 2] + values[n // 2 - 1])) if n % 2 == 0 else float(values[n // 2])
