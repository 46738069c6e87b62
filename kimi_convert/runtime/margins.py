"""The routing margins of a forward pass (RoutingMargins): how close each discrete choice (the MoE's experts, the
K3.1 indexer's keys) came to going the other way. The runtime (forward.py) and the reference (reference.py) both
record one, and verification flags the positions where either came close (verify.logits.routing_flags)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RoutingMargins:
    """Discrete-choice gaps of the last run, to flag near-ties (§4.3): the runtime's and the reference's alike.

    moe[il][t]: k-th selected minus best rejected biased router score (the runtime: NaN, the reference: inf,
    if every expert is used).
    dsa[il][t]: last kept minus best dropped indexer score; NaN where t+1 <= top_k.
    experts[il] [T, k]: the selected experts; kept[il] [T, T]: the tokens the indexer kept (the runtime only).
    """
    n_tokens: int = 0
    moe: dict[int, np.ndarray] = field(default_factory=dict)
    dsa: dict[int, np.ndarray] = field(default_factory=dict)
    experts: dict[int, np.ndarray] = field(default_factory=dict)
    kept: dict[int, np.ndarray] = field(default_factory=dict)

    def same_choices_until(self, other: "RoutingMargins") -> int:
        """The number of leading positions at which both runs made the same discrete choices."""
        n = self.n_tokens
        for il, sel in self.experts.items():
            diff = np.flatnonzero((np.sort(sel, 1) != np.sort(other.experts[il], 1)).any(1))
            n = min(n, diff[0]) if len(diff) else n
        for il, keep in self.kept.items():
            diff = np.flatnonzero((keep != other.kept[il]).any(1))
            n = min(n, diff[0]) if len(diff) else n
        return int(n)

    def smallest(self) -> tuple[str, int, int, float] | None:
        """(kind, layer, position, gap) of the closest call, or None if nothing was chosen."""
        best = None
        for kind, per_layer in (("moe", self.moe), ("dsa", self.dsa)):
            for il, gaps in per_layer.items():
                if np.isnan(gaps).all():
                    continue
                t = int(np.nanargmin(gaps))
                if best is None or gaps[t] < best[3]:
                    best = (kind, il, t, float(gaps[t]))
        return best
