"""Remake kimi_convert/quant/target/role_prior.json (the default --target-size's role scales, quant/target/prior.py)
from a quality run's measured pairs.

    python benchmarks/bench_quality.py --arch k3          # measures the pairs (its `correlation`), among the rest
    python benchmarks/role_prior.py docs/quality/quality-k3.json

Each pair is one decision of the trained fixture quantized alone to one type: its weight error (measure.py) and
the KL divergence of the output it caused (sensitivity.py, 8 chunks of 128 training-text tokens). A role's scale
is the geometric mean of KLD / weight error over its pairs; the JSON keeps how many pairs each had and their
spread (the standard deviation of the log ratio), so a reader sees how well one number describes a role.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kimi_convert.quant.target.prior import PRIOR_FILE, role_logs, role_scales  # noqa: E402


def spread(pairs) -> dict[str, tuple[int, float]]:
    """Per role: (pairs, standard deviation of log(KLD / weight error))."""
    out = {}
    for r, v in role_logs(pairs).items():
        m = sum(v) / len(v)
        out[r] = (len(v), math.sqrt(sum((x - m) ** 2 for x in v) / len(v)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("quality_json", type=Path, help="bench_quality.py's JSON (with its correlation pairs)")
    ap.add_argument("--out", type=Path, default=PRIOR_FILE)
    args = ap.parse_args()
    doc = json.loads(args.quality_json.read_text())
    corr = (doc.get("meta") or {}).get("correlation")
    if not corr or not corr.get("pairs"):
        raise SystemExit(f"{args.quality_json}: no correlation pairs (run bench_quality.py without --no-sensitivity)")
    pairs = corr["pairs"]
    scales = role_scales(pairs)
    n = spread(pairs)
    arch = "K3.1-Pro" if "k31" in args.quality_json.name else "K3"
    out = {"measured_on": f"the trained {arch} fixture ({len(pairs)} decision/type pairs, "
                          f"benchmarks/role_prior.py {args.quality_json.name})",
           "scales": {r: float(f"{s:.4g}") for r, s in scales.items()},
           "pairs": {r: n[r][0] for r in scales},
           "log_sd": {r: round(n[r][1], 2) for r in scales}}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    width = max(map(len, scales))
    for r, s in scales.items():
        print(f"{r:<{width}}  {s:.3e}  ({n[r][0]} pairs, log sd {n[r][1]:.2f})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
