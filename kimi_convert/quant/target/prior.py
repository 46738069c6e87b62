"""The role prior: what --target-size spends the budget by when nothing is measured end to end.

A decision's weight error (measure.py) ranks the types of one tensor well, but not tensors of different roles
against each other: on the trained K3 fixture, a unit of weight error in an attention projection cost about
80 times the output's KL divergence that one in a routed expert did (docs/quality, the `correlation` pairs of
bench_quality.py), and a solve on raw weight errors gave the always-active weights ~4.25 bits and the experts
~2.3, which lost to k3-iq1 (Q8_0 everywhere but the experts) at k3-iq1's size.

So by default each decision's weight error is multiplied by its role's scale: the geometric mean over the
measured (decision, type) pairs of that role of KLD / weight error, measured once with `--sensitivity kld` on the
trained K3 fixture and shipped in `role_prior.json` (benchmarks/role_prior.py remakes it from a quality run's
JSON). A role the prior does not know (a new model's tensor) takes the geometric mean of every role. Within one
decision the scale is one constant, so the ranking of its types (and the hull) is the weight error's own; only the
exchange rate between roles changes. A global factor does not change a budget's choice, so only the ratios
between roles matter.

What it is not: a measurement of the model being quantized. The trained fixture has 4 layers and 32 experts,
K3 93 and 896; `--sensitivity kld` measures the model itself, and `--sensitivity weights` turns the prior off.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

PRIOR_FILE = Path(__file__).with_name("role_prior.json")
LAYER = re.compile(r"^blk\.(\d+)\.")        # a layer's decision; group 1: its number


def role(key: str) -> str:
    """A decision's role: its key without the layer ("attn_q_b.weight", "ffn_gate_up_exps")."""
    return LAYER.sub("", key)


def role_logs(pairs) -> dict[str, list[float]]:
    """(decision key, type, weight error, KLD) pairs -> each role's log(KLD / weight error) values (a pair
    with no error or no divergence says nothing)."""
    logs: dict[str, list[float]] = {}
    for key, _type, error, kld in pairs:
        if error > 0 and kld > 0:
            logs.setdefault(role(key), []).append(math.log(kld / error))
    return dict(sorted(logs.items()))


def role_scales(pairs) -> dict[str, float]:
    """Each role's geometric mean of KLD / weight error over its pairs."""
    return {r: math.exp(sum(v) / len(v)) for r, v in role_logs(pairs).items()}


class WeightErrors:
    """Costs (choose.Costs): the weight errors as measured (--sensitivity weights)."""
    hull_only = False           # every candidate costed: the exact search may take a point off the hull

    def __call__(self, units, types, errors) -> list[dict]:
        return [{t: e[t] for t in ts} for ts, e in zip(types, errors)]

    def describe(self) -> str | None:
        return None             # choose's own description of the weight error


class RolePrior:
    """Costs (choose.Costs): each decision's weight errors times its role's scale."""
    hull_only = False

    def __init__(self, scales: dict[str, float], source: str):
        if not scales or any(not (s > 0 and math.isfinite(s)) for s in scales.values()):
            raise ValueError(f"{source}: a role prior needs a positive, finite scale for every role")
        self.scales, self.source = dict(scales), source
        self.default = math.exp(sum(math.log(s) for s in scales.values()) / len(scales))
        self.unknown: set[str] = set()

    def scale(self, key: str) -> float:
        r = role(key)
        if r not in self.scales:
            self.unknown.add(r)
        return self.scales.get(r, self.default)

    def __call__(self, units, types, errors) -> list[dict]:
        return [{t: e[t] * self.scale(u.key) for t in ts} for u, ts, e in zip(units, types, errors)]

    def describe(self) -> str:
        unknown = (f"; roles it does not know ({', '.join(sorted(self.unknown))}) take the mean of all"
                   if self.unknown else "")
        return (f"imatrix-weighted relative weight error on sampled rows (each matrix weighted by its rows and its "
                f"share of the tokens), times its role's KLD / weight error measured on {self.source}{unknown}")


def shipped_prior() -> RolePrior:
    """The prior in role_prior.json (measured on the trained K3 fixture)."""
    doc = json.loads(PRIOR_FILE.read_text(encoding="utf-8"))
    return RolePrior({str(k): float(v) for k, v in doc["scales"].items()}, doc["measured_on"])
