"""A multiple-choice knapsack: one point (bytes, error) per decision, the total error least, the bytes at most
the budget.

Per decision, only the points on the lower convex hull of its (bytes, error) candidates can be a Lagrangian
optimum. For a multiplier lam every decision takes the hull point minimising error + lam * bytes; the bytes
fall as lam grows, and bisection finds the least lam whose choice fits. What that leaves of the budget is then
filled greedily: of the hull steps up that still fit, the one saving the most error per byte, until none fits.
Every tie is broken by the decision's order and the type's bytes, so the same inputs give the same choice.
"""
from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType as QT

BISECTION_STEPS = 200


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
    choice: list[int]           # per decision, the index of its hull point
    lam: float                  # the multiplier of the Lagrangian step
    nbytes: int
    error: float


def solve(hulls: list[list[Point]], budget: int) -> Solution:
    """The choice of one hull point per decision with total bytes <= budget (which must be at least the sum of
    the smallest points) and the least error this method finds."""
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
