#!/usr/bin/env python3
"""--target-size (quant/target) measured (not a test): what the error measure costs at K3's real width, and how
the solver's choice compares with uniform policies of at most the same size on a fixture.

    python benchmarks/bench_target_size.py [--experts 8] [--threads 1] [--sequences 16] [--length 32]
                                           [--skip-cost]

1. cost: one stacked expert tensor at K3's real width (rows of 3584 values, 3072 rows per expert, random
   values stored as MXFP4 as K3's are, or BF16 with --source bf16, `--experts` of them instead of 896: the measure samples EXPERT_ROWS rows of every expert, so its time
   is per expert), measured for every candidate type, as `--target-size` does; the time per expert and the peak
   RSS are printed and extrapolated to K3's 276 expert tensors of 896 experts.
2. quality: the tiny K3 fixture with its experts free (--allow-requantize), at three budgets (two low in the
   range, and the smallest shipped preset's size): the solver's total error (the measure: imatrix-weighted
   relative error summed over rows, each matrix weighted by its share of the tokens, as --target-size does) against every uniform policy (`default = "T"`, llama-quantize's shape
   fallbacks applied) and every shipped preset whose bytes are at most the budget; then, for the solver and the
   two best of those, the KL divergence of our runtime's logits against the unquantized file's. Random
   weights make every tensor about equally sensitive, so this shows that the solver spends bytes where the
   measure says they buy the most; it does not show what a real model's KL divergence does (docs/policy.md,
   "Choosing types for a size").
"""
from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf import GGUFWriter  # noqa: E402

from kimi_convert.convert.converter import build_plan, convert  # noqa: E402
from kimi_convert.fixtures.imatrix import k3_entries, write_gguf_imatrix  # noqa: E402
from kimi_convert.fixtures.make_checkpoint import make_checkpoint  # noqa: E402
from kimi_convert.gguf_io import QUANT_SIZES, open_gguf  # noqa: E402
from kimi_convert.quant.blocks import load_kernels, supported_types  # noqa: E402
from kimi_convert.quant.driver import plan_file  # noqa: E402
from kimi_convert.quant.imatrix import load_imatrix  # noqa: E402
from kimi_convert.quant.plan import PlanOptions  # noqa: E402
from kimi_convert.quant.policy import load_policy, parse_policy, preset_names  # noqa: E402
from kimi_convert.quant.target.budget import parse_budget  # noqa: E402
from kimi_convert.model import KimiConfig  # noqa: E402
from kimi_convert.quant.target.choose import choose, expert_share, no_base  # noqa: E402
from kimi_convert.quant.target.measure import EXPERT_ROWS, ErrorCache, gguf_rows, token_shares, unit_errors  # noqa: E402
from kimi_convert.quant.target.solver import Point, lower_hull, solve  # noqa: E402
from kimi_convert.quant.target.units import Unit, candidates, split_decisions  # noqa: E402

K3_EXPERT_TENSORS, K3_EXPERTS, ROW, ROWS = 276, 896, 3584, 3072


def cost(experts: int, threads: int, tmp: Path, source: str) -> None:
    path = tmp / "wide.gguf"
    rng = np.random.default_rng(0)
    w = GGUFWriter(path, "kimi-k3")
    data = (rng.standard_normal((experts, ROWS, ROW), dtype=np.float32) * 0.02)
    if source == "mxfp4":       # K3's experts, re-quantized under --allow-requantize: MXFP4 blocks of random values
        from kimi_convert.quant.blocks import quantize
        raw = quantize(data.reshape(-1, ROW), QT.MXFP4, threads=threads).reshape(experts, ROWS, -1)
        w.add_tensor("blk.0.ffn_gate_exps.weight", raw, raw_shape=raw.shape, raw_dtype=QT.MXFP4)
    else:
        bf16 = (data.view(np.uint32) >> 16).astype(np.uint16)
        w.add_tensor("blk.0.ffn_gate_exps.weight", bf16, raw_shape=(experts, ROWS, ROW), raw_dtype=QT.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    del data
    gf = open_gguf(path)
    t = gf.tensors["blk.0.ffn_gate_exps.weight"]
    vector = rng.chisquare(3, experts * ROW).astype(np.float32)

    class D:        # what units.candidates and measure read of a plan decision
        name, shape, source = t.name, t.shape, t.qtype
        source_bytes = t.nbytes
    cands = candidates([D], lambda d: True, True)
    unit = Unit("blk.0.ffn_gate_up_exps", (D,), cands)
    load_kernels((t.qtype, c, True) for c in cands)      # built (first use) and loaded before the clock starts
    start = time.perf_counter()
    errors = unit_errors(unit, gguf_rows(gf), lambda name: vector, ErrorCache(None), threads)
    seconds = time.perf_counter() - start
    per_expert = seconds / experts
    total = per_expert * K3_EXPERTS * K3_EXPERT_TENSORS
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"cost: {len(cands) - 1} candidate types ({', '.join(c.name for c in cands)}), {EXPERT_ROWS} rows of "
          f"{ROW} per expert, {experts} experts: {seconds:.2f} s, {per_expert * 1e3:.1f} ms per expert; "
          f"peak RSS {rss / 2**20:.0f} MiB (the tensor is never read whole)")
    print(f"cost: K3 extrapolated: {K3_EXPERT_TENSORS} x {K3_EXPERTS} experts -> {total / 60:.1f} min on "
          f"{threads} thread(s) for the experts (the ~1,000 non-expert tensors add a few hundred matrices)")
    print("cost: errors " + ", ".join(f"{q.name} {e:.3g}" for q, e in errors.items()))


def kl_figures(src: Path, files: dict[str, Path], sequences: int, length: int) -> None:
    """Mean KL, 99th-percentile KL and argmax agreement of each file's logits (our runtime) against the
    unquantized file's, over `sequences` random token sequences of `length` (kimi-verify's token_sequence with
    seeds 0..n-1); the solver's paired difference per sequence with its standard error, since positions of one
    sequence are not independent."""
    from kimi_convert.runtime.forward import Runtime
    from kimi_convert.verify.check import kl_div, token_sequence
    gf = open_gguf(src)
    seqs = [token_sequence(gf, length, seed=i) for i in range(sequences)]
    ref = [np.asarray(Runtime(src).logits(ids), np.float64) for ids in seqs]
    per_seq = {}
    for name, path in files.items():
        rt = Runtime(path)
        kls, agree = [], 0
        for ids, r in zip(seqs, ref):
            run = np.asarray(rt.logits(ids), np.float64)
            kls.append(kl_div(r, run))
            agree += int((run.argmax(-1) == r.argmax(-1)).sum())
        allk = np.concatenate(kls)
        per_seq[name] = np.array([k.mean() for k in kls])
        print(f"kl:   {name:<18} mean KL {allk.mean():.4g}, p99 {np.percentile(allk, 99):.4g}, argmax "
              f"{agree}/{allk.size}")
    solver = per_seq.pop("solver")
    for name, v in per_seq.items():
        d = solver - v
        se = d.std(ddof=1) / np.sqrt(len(d))
        verdict = ("solver lower" if d.mean() + 2 * se < 0 else "solver HIGHER" if d.mean() - 2 * se > 0
                   else "within 2 standard errors")
        print(f"kl:   solver - {name}: {d.mean():+.4g} +- {2 * se:.2g} (2 s.e., {len(d)} sequences): {verdict}")


def quality(tmp: Path, threads: int, sequences: int = 16, length: int = 32) -> None:
    hf = make_checkpoint(tmp / "k3", arch="k3")
    src = tmp / "k3.gguf"
    convert(build_plan(hf, "bf16"), src)
    gf = open_gguf(src)
    imat_path = write_gguf_imatrix(tmp / "im.gguf", k3_entries({n: t.shape for n, t in gf.tensors.items()}))
    imat = load_imatrix(imat_path)
    plan = plan_file(gf, no_base(), imatrix=True, options=PlanOptions(allow_requantize=True))
    decisions = split_decisions(plan, lambda d: imat.has_vector(d.name, d.shape))
    shares = token_shares(imat, expert_share(KimiConfig.from_gguf(gf.fields, gf.paths[0])))   # as choose's
    # every free tensor measured alone for every type its rows fit (larger ones too: a preset may choose them),
    # a decision's error then the sum over its tensors
    cache, per_tensor = ErrorCache(None), {}
    for u in decisions.units:
        for d in u.decisions:
            fitting = tuple(t for t in supported_types() if t == d.source or not d.shape[-1] % QUANT_SIZES[t][0])
            per_tensor[d.name] = unit_errors(Unit(d.name, (d,), fitting), gguf_rows(gf),
                                             lambda n, d=d: imat.vector(n, d.shape), cache, threads, shares)
    hulls = [lower_hull([Point(t, u.nbytes(t), sum(per_tensor[d.name][t] for d in u.decisions))
                         for t in u.candidates]) for u in decisions.units]
    uniform = []
    policies = [(f"uniform {t.name}", parse_policy(f'default = "{t.name}"\n', f"uniform {t.name}"))
                for t in sorted({t for u in decisions.units for t in u.candidates}, key=int)]
    policies += [(f"preset {n}", load_policy(n)) for n in preset_names()]
    for label, pol in policies:
        try:
            planned = plan_file(gf, pol, imatrix=True, options=PlanOptions(allow_requantize=True))
        except Exception as e:      # a type with no fallback for some row length
            print(f"quality: {label}: cannot plan ({e})")
            continue
        # the error over the solver's free tensors (what a policy does to a fixed one is not counted)
        error = sum(per_tensor[d.name][d.target] for d in planned.decisions if d.name in per_tensor)
        uniform.append((label, planned.target_bytes, error, pol))
    floor, ceiling = decisions.floor(), decisions.ceiling()
    print(f"quality: fixture {len(decisions.units)} decisions, floor {floor:,} B, ceiling {ceiling:,} B")
    for name, nbytes, error, _ in uniform:
        print(f"quality:   {name:<16} {nbytes:>10,} B, error {error:.4g}")
    # two budgets low in the range, and the smallest shipped preset's size (at most the ceiling): a preset then
    # competes at equal size (with the MXFP4 experts re-quantized, the others are larger than keeping them)
    presets = min(ceiling, min(nbytes for name, nbytes, _, _ in uniform if name.startswith("preset ")))
    for frac, budget in ((0.15, int(floor + 0.15 * (ceiling - floor))), (0.4, int(floor + 0.4 * (ceiling - floor))),
                         ("presets", presets)):
        s = solve(hulls, budget - decisions.fixed_bytes)
        fits = [u for u in uniform if u[1] <= budget]
        print(f"quality: budget {budget:,} B: solver {decisions.fixed_bytes + s.nbytes:,} B, error {s.error:.4g}")
        for name, nbytes, error, _ in sorted(fits, key=lambda u: u[2])[:4]:
            verdict = "solver better" if s.error < error else "SOLVER WORSE"
            print(f"quality:   {name:<16} {nbytes:>10,} B, error {error:.4g}  ({verdict}, "
                  f"{error / max(s.error, 1e-30):.2f}x the solver's error)")
        files = {"solver": _write(gf, src, imat, choose(gf, no_base(), parse_budget(str(budget), None), imat,
                                                        PlanOptions(allow_requantize=True), threads=threads).policy,
                                  tmp / f"solver-{frac}.gguf")}
        for name, _, _, pol in sorted(fits, key=lambda u: u[2])[:2]:
            files[name] = _write(gf, src, imat, pol, tmp / f"{name.replace(' ', '-')}-{frac}.gguf")
        kl_figures(src, files, sequences, length)


def _write(gf, src: Path, imat, policy, out: Path) -> Path:
    from kimi_convert.quant.driver import quantize_file
    quantize_file(src, out, policy, imatrix=imat, options=PlanOptions(allow_requantize=True))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sequences", type=int, default=16, help="token sequences for the KL figures")
    ap.add_argument("--length", type=int, default=32, help="tokens per sequence")
    ap.add_argument("--skip-cost", action="store_true")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--source", choices=("mxfp4", "bf16"), default="mxfp4",
                    help="the expert tensor's stored type (K3's: MXFP4; its candidates are the smaller types)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        if not args.skip_cost:
            cost(args.experts, args.threads, Path(d), args.source)
        if not args.skip_quality:
            quality(Path(d), args.threads, args.sequences, args.length)


if __name__ == "__main__":
    main()
