"""A multiple-choice knapsack: one point (bytes, error) per decision, the total error least, the bytes at most
the budget.

The heuristic. Per decision, only the points on the lower convex hull of its (bytes, error) candidates can be a
Lagrangian optimum. For a multiplier lam every decision takes the hull point minimising error + lam * bytes; the
bytes fall as lam grows, and bisection finds the least lam whose choice fits. What that leaves of the budget is
then filled greedily: of the hull steps up that still fit, the one saving the most error per byte, until none
fits. Every tie is broken by the decision's order and the type's bytes, so the same inputs give the same choice.

What it guarantees. The lower bound is the Lagrangian dual, which equals the LP relaxation's optimum (`lp_bound`:
the hull steps taken by error saved per byte, the last one in part): no choice within the budget has less error.
The multiplier's choice is those steps but the cut one, whole, so the heuristic's error is at most the lower
bound plus the error that one cut hull step saves (and it is optimal among all choices of at most its own bytes,
Everett's theorem); the fill only lowers it. Every solve reports the gap, (error - bound) / bound: how far above
the best possible the choice can be, at most.

The exact search. `solve` then searches every choice (`exact_solve`: each decision's non-dominated points, not
only its hull's; a dynamic programme over the Pareto set of (bytes, error) of the decisions so far, pruned by the
budget and by the LP bound of the decisions still to come against the heuristic's error), and takes the optimum
where it is better. It is exact, not a grid: bytes are integers and no state is rounded. It gives up (the
heuristic's choice stands, `optimal` None) when a stage keeps more than EXACT_STATES states, which bounds its
time and memory whatever the input.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from gguf import GGMLQuantizationType as QT

BISECTION_STEPS = 200
EXACT_STATES = 200_000      # the most (bytes, error) states a stage of the exact search keeps


@dataclass(frozen=True)
class Point:
    qtype: QT
    nbytes: int
    error: float


def lower_hull(points: list[Point]) -> list[Point]:
    """The lower-left convex hull, by bytes ascending and error descending: dominated points (more bytes, no
    less error) and points above a chord between two others are dropped."""
    best: dict[int, Point] = {}
    for p in sorted(points, key=lambda p: (p.nbytes, p.error, int(p.qtype))):
        best.setdefault(p.nbytes, p)            # the least error at each size
    frontier: list[Point] = []
    for p in best.values():
        if frontier and p.error >= frontier[-1].error:
            continue                            # dominated
        frontier.append(p)
    hull: list[Point] = []
    for p in frontier:
        while len(hull) >= 2 and _not_convex(hull[-2], hull[-1], p):
            hull.pop()
        hull.append(p)
    return hull


def _not_convex(a: Point, b: Point, c: Point) -> bool:
    """b on or above the chord a-c: its slope from a is no steeper than c's."""
    return (b.error - a.error) * (c.nbytes - a.nbytes) >= (c.error - a.error) * (b.nbytes - a.nbytes)


@dataclass
class Solution:
    choice: list[int]           # per decision, the index of its point in the list given to solve
    lam: float                  # the multiplier of the Lagrangian step
    nbytes: int
    error: float
    lower_bound: float = 0.0    # no choice within the budget has less error (the Lagrangian dual / LP bound)
    optimal: bool | None = None     # True: the exact search proved it optimal; None: not searched to the end

    @property
    def gap(self) -> float:
        """(error - lower bound) / lower bound: how far above the best possible the choice can be, at most."""
        if self.lower_bound > 0:
            return (self.error - self.lower_bound) / self.lower_bound
        return 0.0 if self.error <= self.lower_bound else float("inf")

    def describe(self) -> str:
        """One line for --explain, --dry-run and the emitted policy's header."""
        how = {True: "optimal: exact search", False: "heuristic",
               None: "heuristic: too many states for the exact search"}[self.optimal]
        return (f"predicted error {self.error:.6g}, lower bound {self.lower_bound:.6g}, gap {self.gap:.4%} "
                f"({how}), lambda {self.lam:.6g}")


def solve(points: list[list[Point]], budget: int, exact: bool = True) -> Solution:
    """The choice of one point per decision with total bytes <= budget (which must be at least the sum of the
    smallest points), with its lower bound; `points`: each decision's candidates (their hulls are taken here).
    `exact`: search for the optimum too, where it is cheap (EXACT_STATES)."""
    hulls = [lower_hull(p) for p in points]
    h = _solve_hulls(hulls, budget)
    choice = [_index(p, hull[i]) for p, hull, i in zip(points, hulls, h.choice)]
    best = Solution(choice, h.lam, h.nbytes, h.error, lp_bound(hulls, budget), False)
    if not exact:
        return best
    found = exact_solve(points, budget, h.error)
    if found is None:
        return replace(best, optimal=None)
    if found[1] < h.error:
        best = replace(best, choice=found[0], nbytes=_bytes(points, found[0]), error=found[1])
    return replace(best, optimal=True)


def _index(points: list[Point], p: Point) -> int:
    return next(k for k, q in enumerate(points) if q is p)


def _solve_hulls(hulls: list[list[Point]], budget: int) -> Solution:
    smallest = sum(h[0].nbytes for h in hulls)
    if budget < smallest:
        raise ValueError(f"budget {budget} below the smallest choice {smallest}")
    largest = [len(h) - 1 for h in hulls]
    if _bytes(hulls, largest) <= budget:
        return _solution(hulls, largest, 0.0)
    lo, hi = 0.0, max(_max_slope(h) for h in hulls) * 2 + 1.0     # at hi every decision takes its smallest
    for _ in range(BISECTION_STEPS):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        if _bytes(hulls, _at(hulls, mid)) <= budget:
            hi = mid
        else:
            lo = mid
    choice = _at(hulls, hi)
    return _solution(hulls, _fill(hulls, choice, budget), hi)


def lp_bound(hulls: list[list[Point]], budget: int, clamp: bool = True) -> float:
    """The least error of the LP relaxation (each decision may mix two neighbouring hull points), which is the
    Lagrangian dual's optimum: a lower bound on any choice's error within `budget`. inf below the floor."""
    left = budget - sum(h[0].nbytes for h in hulls)
    if left < 0:
        return float("inf")
    error = sum(h[0].error for h in hulls)
    for nbytes, saved in _steps(hulls):     # a hull's steps come in its own order: their slopes fall
        if nbytes <= left:
            error -= saved
            left -= nbytes
        else:
            error -= saved * left / nbytes
            break
    return max(error, 0.0) if clamp else error


def lp_bound_two(points: list[list[Point]], dense: list[bool], budget: int, dense_budget: int,
                 steps: int = 100) -> float:
    """A lower bound on any choice's error with total bytes <= budget and the `dense` decisions' bytes <=
    dense_budget: the Lagrangian dual of both constraints, max over mu >= 0 of the one-constraint bound with
    mu * bytes added to each dense point's error, less mu * dense_budget (concave in mu: golden-section search;
    any mu gives a valid bound, so the search's precision can only loosen it). Adding mu * bytes keeps each hull
    a hull and shifts its steps' error saved per byte by mu, so each mu is one sort of the steps."""
    import numpy as np
    hulls = [lower_hull(p) for p in points]
    left0 = budget - sum(h[0].nbytes for h in hulls)
    if left0 < 0:
        return float("inf")
    floor_dense = sum(h[0].nbytes for h, d in zip(hulls, dense) if d)
    base = sum(h[0].error for h in hulls)
    db = np.array([b.nbytes - a.nbytes for h in hulls for a, b in zip(h, h[1:])], np.float64)
    saved = np.array([a.error - b.error for h in hulls for a, b in zip(h, h[1:])], np.float64)
    is_dense = np.array([d for h, d in zip(hulls, dense) for _ in h[1:]], bool)

    def bound(mu: float) -> float:
        gain = saved - mu * db * is_dense              # error saved by each step, less mu per dense byte
        take = gain > 0
        g, b = gain[take], db[take]
        order = np.argsort(-(g / b), kind="stable")
        g, b = g[order], b[order]
        used = np.cumsum(b)
        whole = int(np.searchsorted(used, left0, side="right"))     # steps that fit whole
        total = float(g[:whole].sum())
        if whole < len(b):
            total += float(g[whole]) * (left0 - (used[whole - 1] if whole else 0.0)) / float(b[whole])
        return base + mu * floor_dense - total - mu * dense_budget
    top = float(max((saved / db)[is_dense], default=0.0))
    lo, hi = 0.0, top
    g = (5 ** 0.5 - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = bound(a), bound(b)
    best = max(bound(0.0), bound(top), fa, fb)
    for _ in range(steps):
        if fa < fb:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = bound(b)
        else:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = bound(a)
        best = max(best, fa, fb)
    return max(best, 0.0)


def _steps(hulls: list[list[Point]]) -> list[tuple[int, float]]:
    """Every hull step up (bytes added, error saved), the most error saved per byte first."""
    steps = [(b.nbytes - a.nbytes, a.error - b.error, u, k) for u, h in enumerate(hulls)
             for k, (a, b) in enumerate(zip(h, h[1:]))]
    steps.sort(key=lambda s: (-s[1] / s[0], s[2], s[3]))
    return [(nbytes, saved) for nbytes, saved, _, _ in steps]


def pareto(points: list[Point]) -> list[int]:
    """The indexes of the non-dominated points (no other has at most its bytes and less error), by bytes."""
    order = sorted(range(len(points)), key=lambda k: (points[k].nbytes, points[k].error, int(points[k].qtype)))
    out: list[int] = []
    for k in order:
        if out and (points[k].error >= points[out[-1]].error or points[k].nbytes == points[out[-1]].nbytes):
            continue
        out.append(k)
    return out


def exact_solve(points: list[list[Point]], budget: int, incumbent: float,
                max_states: int = EXACT_STATES) -> tuple[list[int], float] | None:
    """The optimum (choice, error) if it has less error than `incumbent` by more than rounding, else
    ([], incumbent) (the incumbent is optimal); None when a stage would keep more than `max_states` states."""
    import numpy as np
    fronts = [pareto(p) for p in points]
    n = len(points)
    # the LP bound of decisions i.. as a function of the bytes left (convex, piecewise linear): the floor of
    # those decisions, then every hull step of theirs in the one order of error saved per byte
    hulls = [lower_hull(p) for p in points]
    steps = sorted(((b.nbytes - a.nbytes, a.error - b.error, u) for u, h in enumerate(hulls)
                    for a, b in zip(h, h[1:])), key=lambda s: (-s[1] / s[0], s[2]))
    step_b = np.array([s[0] for s in steps], np.float64)
    step_e = np.array([s[1] for s in steps], np.float64)
    step_u = np.array([s[2] for s in steps], np.int64)
    floor_b = np.cumsum([h[0].nbytes for h in hulls][::-1])[::-1].tolist() + [0]
    floor_e = np.cumsum([h[0].error for h in hulls][::-1])[::-1].tolist() + [0.0]

    def suffix(i: int) -> tuple[np.ndarray, np.ndarray]:
        mine = step_u >= i
        xs = np.concatenate([[floor_b[i]], floor_b[i] + np.cumsum(step_b[mine])])
        ys = np.concatenate([[floor_e[i]], floor_e[i] - np.cumsum(step_e[mine])])
        return xs, ys
    cut = incumbent - 1e-12 * abs(incumbent) if np.isfinite(incumbent) else incumbent   # better by more than rounding
    nbytes, error = np.zeros(1, np.int64), np.zeros(1, np.float64)
    parents, picks = [], []
    for i in range(n):
        pts = [points[i][k] for k in fronts[i]]
        cand_b = np.concatenate([nbytes + p.nbytes for p in pts])
        cand_e = np.concatenate([error + p.error for p in pts])
        cand_parent = np.tile(np.arange(len(nbytes), dtype=np.int64), len(pts))
        cand_pick = np.repeat(np.arange(len(pts), dtype=np.int64), len(nbytes))
        xs, ys = suffix(i + 1)
        left = (budget - cand_b).astype(np.float64)
        keep = (left >= xs[0]) & (cand_e + np.interp(left, xs, ys) < cut)
        cand_b, cand_e, cand_parent, cand_pick = cand_b[keep], cand_e[keep], cand_parent[keep], cand_pick[keep]
        if not len(cand_b):
            return [], incumbent
        order = np.lexsort((cand_e, cand_b))        # by bytes, then error
        cand_b, cand_e, cand_parent, cand_pick = cand_b[order], cand_e[order], cand_parent[order], cand_pick[order]
        before = np.minimum.accumulate(np.concatenate([[np.inf], cand_e[:-1]]))
        front = cand_e < before                     # less error than every state of no more bytes
        nbytes, error = cand_b[front], cand_e[front]
        parents.append(cand_parent[front])
        picks.append(cand_pick[front])
        if len(nbytes) > max_states:
            return None
    best = int(np.argmin(error))
    choice = [0] * n
    at = best
    for i in range(n - 1, -1, -1):
        choice[i] = fronts[i][int(picks[i][at])]
        at = int(parents[i][at])
    total = float(sum(points[i][c].error for i, c in enumerate(choice)))
    return (choice, total) if total < cut else ([], incumbent)


def _max_slope(h: list[Point]) -> float:
    return max([(a.error - b.error) / (b.nbytes - a.nbytes) for a, b in zip(h, h[1:])] or [0.0])


def _at(hulls: list[list[Point]], lam: float) -> list[int]:
    """Per decision, the hull point minimising error + lam * bytes (the smaller one on a tie)."""
    out = []
    for h in hulls:
        costs = [p.error + lam * p.nbytes for p in h]
        out.append(min(range(len(h)), key=lambda i: (costs[i], i)))
    return out


def _fill(hulls: list[list[Point]], choice: list[int], budget: int) -> list[int]:
    """Take the best step up (error saved per byte) that fits, repeatedly, until none fits."""
    choice = list(choice)
    left = budget - _bytes(hulls, choice)
    while True:
        best, best_key = None, None
        for u, (h, i) in enumerate(zip(hulls, choice)):
            if i + 1 >= len(h):
                continue
            step = h[i + 1].nbytes - h[i].nbytes
            if step > left:
                continue
            key = (-(h[i].error - h[i + 1].error) / step, u)
            if best_key is None or key < best_key:
                best, best_key = u, key
        if best is None:
            return choice
        h, i = hulls[best], choice[best]
        left -= h[i + 1].nbytes - h[i].nbytes
        choice[best] = i + 1


def _bytes(hulls: list[list[Point]], choice: list[int]) -> int:
    return sum(h[i].nbytes for h, i in zip(hulls, choice))


def _solution(hulls: list[list[Point]], choice: list[int], lam: float) -> Solution:
    return Solution(choice, lam, _bytes(hulls, choice), sum(h[i].error for h, i in zip(hulls, choice)))
