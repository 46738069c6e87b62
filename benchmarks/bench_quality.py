"""The quality table: every shipped preset, llama-quantize's mixtures, uniform expert types and --target-size
budgets, on the trained K3 (or K3.1) fixture, by their KL divergence from the checkpoint (kimi-verify kld).

    python benchmarks/bench_quality.py [--arch k3|k31] [--chunks 32] [--budgets 7] [--out docs/quality]

1. The trained fixture (kimi_convert.fixtures.trained) is written and converted (BF16, MXFP4 experts kept).
2. Its imatrix: kimi-imatrix on the training text (--ctx 128).
3. The base: kimi-verify kld HF --save-base, on the held-out text (--ctx 128, --chunks N).
4. Every file below made by kimi-quantize (the mixtures are llama-quantize's, byte for byte), measured against
   the base: bytes, mean KLD with 2 standard errors (of the chunk means: tokens of a chunk are not
   independent), top-1 agreement, PPL ratio.
5. Checks printed at the end: every --target-size file against every file of at most its bytes (paired by
   chunk: the difference of chunk means, 2 standard errors), and the budgets' KLD against the smaller budgets'.

Writes OUT/quality-ARCH.md (the table), OUT/quality-ARCH.json (every number) and OUT/quality-ARCH.png (size
against KLD). Everything else goes to a temporary folder.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from png_plot import Series, scatter_png  # noqa: E402

CTX = 128
SENSITIVITY_CHUNKS = 8          # chunks of 128 training-text tokens --sensitivity kld measures on
SENSITIVITY = True              # --no-sensitivity: only the weight-error budgets (and no rank correlation)
# the sampled variant: the decisions of one layer of each kind measured (here layers 0, 1 and 2 of the 4; layer
# 3's costed by its weight errors times what layer 1 measured of the same roles)
SAMPLED, SAMPLED_LAYERS = "--target-size --sensitivity kld --sensitivity-layers", 1
WEIGHTS = "--target-size --sensitivity weights"     # the raw weight errors, without the role prior (prior.py)
MIXTURES = ["Q4_K_M", "Q3_K_M", "Q2_K", "IQ2_M", "IQ2_XXS", "IQ1_M", "IQ1_S", "MXFP4_MOE"]
EXPERT_TYPES = ["Q4_K", "IQ4_XS", "Q3_K", "IQ3_S", "IQ3_XXS", "Q2_K", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S"]


@dataclass
class Row:
    name: str
    family: str
    nbytes: int
    kld: float = math.nan
    kld_2se: float = math.nan
    top1: float = math.nan
    ppl_ratio: float = math.nan
    chunk_kld: list = field(default_factory=list)
    seconds: float = 0.0


def sh(*args, cwd=None) -> subprocess.CompletedProcess:
    p = subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=cwd)
    if p.returncode != 0:
        raise SystemExit(f"failed: {' '.join(map(str, args))}\n{p.stderr[-2000:]}")
    return p


def uniform_experts(qtype: str) -> str:
    return (f'description = "routed experts {qtype}, everything else as converted"\n'
            f'default = "keep"\n[[rules]]\npattern = "ffn_(gate|up|down)_exps"\ntype = "{qtype}"\n')


def make(work: Path, gguf: Path, imatrix: Path, name: str, args: list) -> Path:
    out = work / f"{name}.gguf"
    if not out.is_file():           # a --work folder keeps what an earlier run made
        sh("kimi-quantize", *args, "--imatrix", imatrix, "--allow-requantize", "--threads", 2, gguf, out)
    return out


def measure(row: Row, base: Path, gguf: Path) -> Row:
    from kimi_convert.kld.job import KldOptions, KldRun
    cached = gguf.with_suffix(".row.json")
    if cached.is_file() and cached.stat().st_mtime >= gguf.stat().st_mtime:
        return Row(**json.loads(cached.read_text()))
    t0 = time.time()
    r = KldRun(KldOptions(base, gguf)).run()
    s = r.summary
    chunks = np.array(s["chunk_kld"])
    row.kld, row.top1, row.ppl_ratio = s["kld_mean"], s["same_top"], s["ppl_ratio"]
    row.kld_2se = 2 * chunks.std(ddof=1) / math.sqrt(len(chunks))
    row.chunk_kld, row.seconds = chunks.tolist(), time.time() - t0
    cached.write_text(json.dumps(row.__dict__))
    return row


def paired(a: Row, b: Row) -> tuple[float, float]:
    """mean and 2 standard errors of a's chunk KLD minus b's."""
    d = np.array(a.chunk_kld) - np.array(b.chunk_kld)
    return float(d.mean()), float(2 * d.std(ddof=1) / math.sqrt(len(d)))


def presets() -> list[str]:
    from kimi_convert.quant.policy import preset_names
    return preset_names()


def build(arch: str, chunks: int, n_budgets: int, work: Path, log, prior: dict | None = None,
          prior_correlation: dict | None = None, seed: int | None = None, shape: str = "small"
          ) -> tuple[list[Row], dict]:
    """`prior`: rows of an earlier run's JSON (same fixture, text and chunks: the same base), taken as they are;
    `prior_correlation`: its measured pairs, likewise; `seed`: train the fixture from this seed (the same recipe,
    another model: 20 min here) instead of writing the shipped weights; `shape`: train a model of that shape
    (fixtures.trained.SHAPES; "deep": about 50 min here). A checkpoint already in `work` is reused."""
    prior = prior or {}
    from kimi_convert.fixtures import trained
    hf, gguf, imatrix, base = work / "hf", work / "model.gguf", work / "imatrix.gguf", work / "base.kld"
    if not base.is_file():
        if not (hf / "config.json").is_file():
            shipped = seed is None and shape == "small"
            trained.write(hf, arch, None if shipped else trained.train(arch, log=log, seed=seed or 0, shape=shape),
                          shape)
        sh("kimi-convert", hf, gguf, "--force")
        (work / "train.txt").write_text(trained.read_text("train"))
        (work / "heldout.txt").write_text(trained.read_text("heldout"))
        sh("kimi-imatrix", hf, "-f", work / "train.txt", "-o", imatrix, "--ctx", CTX, "--chunks", 64, "--force")
        sh("kimi-verify", "kld", hf, "--save-base", base, "-f", work / "heldout.txt", "--ctx", CTX, "--chunks",
           chunks, "--force")
    rows = [measure(Row("as converted (BF16, MXFP4 experts)", "source", gguf.stat().st_size), base, gguf)]
    todo = [(p, "preset", ["--policy", p]) for p in presets()]
    todo += [(m, "llama-quantize mixture", ["--policy", m]) for m in MIXTURES]
    for t in EXPERT_TYPES:
        pol = work / f"experts-{t}.toml"
        pol.write_text(uniform_experts(t))
        todo.append((f"experts {t}", "uniform experts", ["--policy", pol]))
    for name, family, args in todo:
        if name in prior:
            rows.append(prior[name])
            continue
        out = make(work, gguf, imatrix, name.replace(" ", "-"), args)
        rows.append(measure(Row(name, family, out.stat().st_size), base, out))
        log(f"{name:40s} {rows[-1].nbytes:>12,} B  KLD {rows[-1].kld:.5f} ± {rows[-1].kld_2se:.5f}  "
            f"top-1 {100 * rows[-1].top1:.2f}%  ({rows[-1].seconds:.0f} s)")
    floor, ceiling = target_range(gguf, imatrix)
    top = min(max(r.nbytes for r in rows if r.family == "preset"), ceiling)     # the largest preset, if it can
    sens = ["--sensitivity", "kld", "--sensitivity-text", work / "train.txt", "--sensitivity-chunks",
            SENSITIVITY_CHUNKS]
    families = [("--target-size", [], ""), (WEIGHTS, ["--sensitivity", "weights"], "w-"),
                ("--target-size --sensitivity kld", sens, "kld-"),
                (f"{SAMPLED} {SAMPLED_LAYERS}", [*sens, "--sensitivity-layers", SAMPLED_LAYERS], "kld1-")]
    for b in np.linspace(floor, top, n_budgets):
        budget = int(b)
        for family, extra, tag in families[:4 if SENSITIVITY else 2]:
            if f"{family} {budget:,}" in prior:
                rows.append(prior[f"{family} {budget:,}"])
                continue
            out = make(work, gguf, imatrix, f"target-{tag}{budget}", ["--target-size", str(budget), *extra])
            rows.append(measure(Row(f"{family} {budget:,}", family, out.stat().st_size), base, out))
            log(f"{rows[-1].name:60s} {rows[-1].nbytes:>12,} B  KLD {rows[-1].kld:.5f} ± {rows[-1].kld_2se:.5f}")
    return rows, {"floor": floor, "ceiling": ceiling, "top_budget": top,
                  "correlation": (prior_correlation or correlation(gguf, imatrix, work, log)) if SENSITIVITY
                  else None}


def correlation(gguf: Path, imatrix: Path, work: Path, log) -> dict:
    """Each decision quantized alone to two or three types: its weight error (measure.py) against the KL
    divergence it causes (sensitivity.py), over every (decision, type); Spearman's rank correlation."""
    from gguf import GGMLQuantizationType as QT
    from kimi_convert.engine.tokens import chunk_tokens, model_tokenizer, text_tokens
    from kimi_convert.gguf_io import open_gguf
    from kimi_convert.quant.driver import plan_file
    from kimi_convert.quant.imatrix import load_imatrix
    from kimi_convert.quant.plan import PlanOptions
    from kimi_convert.quant.target.choose import expert_share, no_base
    from kimi_convert.quant.target.measure import ErrorCache, gguf_rows, token_shares, unit_errors
    from kimi_convert.quant.target.sensitivity import Sensitivity, sensitivity_cache_dir
    from kimi_convert.quant.target.units import split_decisions
    from kimi_convert.model import KimiConfig
    imat, gf = load_imatrix(imatrix), open_gguf(gguf)
    plan = plan_file(gf, no_base(), imatrix=True, options=PlanOptions(allow_requantize=True))
    units = split_decisions(plan, lambda d: imat.has_vector(d.name, d.shape)).units
    tok = model_tokenizer(gguf)
    ids = chunk_tokens(text_tokens(work / "train.txt", tok), CTX, SENSITIVITY_CHUNKS, None, work / "train.txt")
    sens = Sensitivity(gguf, ids, imat, cache_dir=sensitivity_cache_dir())
    shares = token_shares(imat, expert_share(KimiConfig.from_gguf(gf.fields, gf.paths[0])))
    vec = lambda name: next(imat.vector(d.name, d.shape) for u in units for d in u.decisions if d.name == name)
    pairs = []
    for u in units:
        types = [t for t in (QT.Q4_K, QT.Q2_K, QT.IQ2_XXS, QT.IQ1_S) if t in u.candidates][:3]
        if not types:
            continue
        errors = unit_errors(u, gguf_rows(gf), vec, ErrorCache(None), 2, shares)
        klds = sens.costs(u, types)
        pairs += [(u.key, t.name, errors[t], klds[t]) for t in types]
    w = np.array([p[2] for p in pairs])
    k = np.array([p[3] for p in pairs])
    rank = lambda x: np.argsort(np.argsort(x)).astype(float)
    rho = float(np.corrcoef(rank(w), rank(k))[0, 1])
    experts = [i for i, p in enumerate(pairs) if "_exps" in p[0]]
    rho_e = float(np.corrcoef(rank(w[experts]), rank(k[experts]))[0, 1]) if len(experts) > 2 else math.nan
    log(f"weight error against KLD: Spearman {rho:.3f} over {len(pairs)} (decision, type) pairs; "
        f"routed experts alone {rho_e:.3f}")
    return {"spearman": rho, "spearman_experts": rho_e, "pairs": pairs}


def prior_correlation(corr: dict, log) -> dict:
    """Spearman's rank correlation with the KLD of the weight error times its role's prior scale (prior.py):
    with the scales of every pair (in sample: the shipped prior is made from these pairs) and with each layer's
    scales taken from the other layers' pairs alone (leave one layer out: the case of an unmeasured layer)."""
    from kimi_convert.quant.target.prior import LAYER, RolePrior, role_scales

    def scaled(pair, pairs):                # as the solver costs it: an unknown role takes the mean of all
        return pair[2] * RolePrior(role_scales(pairs), "pairs").scale(pair[0])
    pairs = corr["pairs"]
    layer = lambda key: (m := LAYER.match(key)) and m[1]
    k = np.array([p[3] for p in pairs])
    inside = np.array([scaled(p, pairs) for p in pairs])
    apart = np.array([scaled(p, [q for q in pairs if layer(q[0]) != layer(p[0]) or layer(p[0]) is None])
                      for p in pairs])
    rank = lambda x: np.argsort(np.argsort(x)).astype(float)
    rho_in, rho_out = (float(np.corrcoef(rank(x), rank(k))[0, 1]) for x in (inside, apart))
    log(f"weight error times the role prior against KLD: Spearman {rho_in:.3f} in sample, {rho_out:.3f} with each "
        f"layer's scales from the other layers")
    return {"spearman_prior": rho_in, "spearman_prior_other_layers": rho_out}


def target_range(gguf: Path, imatrix: Path) -> tuple[int, int]:
    """The smallest and the largest file --target-size makes (its refusal of a 1-byte budget says both)."""
    p = subprocess.run(["kimi-quantize", "--target-size", "1", "--imatrix", str(imatrix), "--allow-requantize",
                        "--dry-run", str(gguf), str(gguf.with_suffix(".none.gguf"))], capture_output=True, text=True)
    import re
    lo = re.search(r"smallest file these types make, [^(]*\(([\d,]+) bytes\)", p.stderr + p.stdout)
    hi = re.search(r"largest worth making is [^(]*\(([\d,]+) bytes\)", p.stderr + p.stdout)
    if not (lo and hi):
        raise SystemExit(f"no floor or ceiling in the refusal:\n{p.stderr[-1500:]}")
    return int(lo[1].replace(",", "")) + 1, int(hi[1].replace(",", ""))


def checks(rows: list[Row]) -> list[str]:
    out = []
    for family in sorted({r.family for r in rows if r.family.startswith("--target-size")}):
        targets = sorted((r for r in rows if r.family == family), key=lambda r: r.nbytes)
        for t in targets:
            for r in rows:
                if r.family.startswith("--target-size") or r.family == "source" or r.nbytes > t.nbytes:
                    continue
                d, se = paired(t, r)
                verdict = "better" if d < -se else "within noise" if d <= se else "WORSE"
                out.append(f"{t.name} ({t.nbytes:,} B) vs {r.name} ({r.nbytes:,} B): KLD {d:+.5f} ± {se:.5f}: "
                           f"{verdict}")
        for a, b in zip(targets, targets[1:]):
            d, se = paired(b, a)
            out.append(f"{b.name} vs the smaller {a.name}: KLD {d:+.5f} ± {se:.5f}: "
                       + ("falls" if d < -se else "within noise" if d <= se else "RISES"))
    by_family = {f: sorted((r for r in rows if r.family == f), key=lambda r: r.nbytes)
                 for f in ("--target-size", WEIGHTS, "--target-size --sensitivity kld")}
    prior, weights, measured = by_family.values()
    sampled = sorted((r for r in rows if r.family == f"{SAMPLED} {SAMPLED_LAYERS}"), key=lambda r: r.nbytes)
    for label, better, worse in (("the role prior", prior, weights), ("--sensitivity kld", measured, weights),
                                 ("--sensitivity kld", measured, prior)):
        what = "the raw weight errors" if worse is weights else "the role prior"
        for w, k in zip(worse, better):
            d, se = paired(k, w)
            out.append(f"at {w.name.split()[-1]}: {label} against {what}: KLD {d:+.5f} ± {se:.5f}: "
                       + ("better" if d < -se else "within noise" if d <= se else "WORSE"))
    for k, s1 in zip(measured, sampled):
        d, se = paired(s1, k)
        out.append(f"at {k.name.split()[-1]}: --sensitivity-layers {SAMPLED_LAYERS} against every layer measured: "
                   f"KLD {d:+.5f} ± {se:.5f}: " + ("better" if d < -se else "within noise" if d <= se else "WORSE"))
    return out


def table(rows: list[Row], arch: str, meta: dict) -> str:
    n_weights = meta.get("n_weights")
    lines = [f"| file ({arch}) | family | bytes | bpw | mean KLD ± 2 SE | top-1 | PPL ratio |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: r.nbytes):
        bpw = f"{8 * r.nbytes / n_weights:.2f}" if n_weights else ""
        lines.append(f"| {r.name} | {r.family} | {r.nbytes:,} | {bpw} | {r.kld:.5f} ± {r.kld_2se:.5f} | "
                     f"{100 * r.top1:.2f}% | {r.ppl_ratio:.4f} |")
    return "\n".join(lines)


def plot(rows: list[Row], path: Path, arch: str) -> None:
    fams = {}
    for r in rows:
        if r.family != "source":
            fams.setdefault(r.family, []).append(r)
    series = [Series(_legend(f), [(r.nbytes / 1e6, r.kld, r.kld_2se, _short(r)) for r in rs],
                     line=f.startswith("--target-size")) for f, rs in fams.items()]
    scatter_png(path, series, f"TRAINED {arch.upper()} FIXTURE: FILE SIZE AGAINST MEAN KLD (2 SE BARS)",
                "FILE SIZE (MB)", "MEAN KLD (NATS)")


def _legend(family: str) -> str:
    """The family as the legend's column fits it (about 24 characters)."""
    short = {"--target-size": "TARGET, ROLE PRIOR", WEIGHTS: "TARGET, WEIGHT ERRORS",
             "--target-size --sensitivity kld": "TARGET, KLD ALL LAYERS",
             f"{SAMPLED} {SAMPLED_LAYERS}": f"TARGET, KLD {SAMPLED_LAYERS} LAYER/KIND"}
    return short.get(family, family.upper())


def _short(r: Row) -> str:
    if r.family.startswith("--target-size"):
        return ""
    return r.name.replace("experts ", "E:").upper()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="k3", choices=["k3", "k31"])
    ap.add_argument("--chunks", type=int, default=32, help="held-out chunks of 128 tokens")
    ap.add_argument("--budgets", type=int, default=7)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "quality")
    ap.add_argument("--work", type=Path, default=None, help="keep the files here (a rerun reuses them)")
    ap.add_argument("--rows-from", type=Path, default=None, help="take the rows of this earlier JSON as measured")
    ap.add_argument("--no-sensitivity", action="store_true", help="skip --sensitivity kld and the correlation")
    ap.add_argument("--seed", type=int, default=None,
                    help="train the fixture from this seed instead of the shipped weights (files: ARCH-seedN)")
    ap.add_argument("--shape", default="small", choices=["small", "deep"],
                    help="train a fixture of this shape (fixtures.trained.SHAPES; files: ARCH-deep)")
    args = ap.parse_args()
    global SENSITIVITY
    SENSITIVITY = not args.no_sensitivity
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-quality-") as tmp:
        tmp = args.work or Path(tmp)
        tmp.mkdir(parents=True, exist_ok=True)
        prior, earlier = {}, {}
        if args.rows_from:
            earlier = json.loads(args.rows_from.read_text())
            prior = {r["name"]: Row(**r) for r in earlier["rows"]}
        rows, meta = build(args.arch, args.chunks, args.budgets, tmp, lambda s: print(s, flush=True), prior,
                           (earlier.get("meta") or {}).get("correlation"), args.seed, args.shape)
        if meta.get("correlation"):
            meta["correlation"].update(prior_correlation(meta["correlation"], lambda s: print(s, flush=True)))
        from kimi_convert.engine.weights import open_source
        src = open_source(Path(tmp) / "model.gguf")
        meta["n_weights"] = sum(int(np.prod(src.shape(n))) for n in src.names())
    found = checks(rows)
    name = args.arch + (f"-{args.shape}" if args.shape != "small" else "") + (
        f"-seed{args.seed}" if args.seed is not None else "")
    md = table(rows, name, meta)
    (args.out / f"quality-{name}.md").write_text(md + "\n\n" + "\n".join(f"- {c}" for c in found) + "\n")
    (args.out / f"quality-{name}.json").write_text(json.dumps(
        {"meta": meta, "chunks": args.chunks, "ctx": CTX, "rows": [r.__dict__ for r in rows]}, indent=1))
    plot(rows, args.out / f"quality-{name}.png", name)
    print(md)
    print("\n".join(found))
    print(f"{len(rows)} files measured in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
