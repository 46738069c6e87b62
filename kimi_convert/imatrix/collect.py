"""What llama-imatrix collects, from the engine's products (tools/imatrix/imatrix.cpp `collect_imatrix`).

- every routed-expert product (MUL_MAT_ID): per expert, the sum over the (token, expert) pairs of x_j^2 and the
  number of pairs; an expert no token reached keeps count 0 and zero sums;
- every other weight product whose weight is a `blk.*` tensor (and `output.weight` with --process-output), on
  batches of at least 16 rows (ours are whole chunks, --ctx >= 16): the sum of x_j^2 over the tokens and one
  count, the tokens; a 3-D weight multiplied head by head (attn_k_b, attn_v_b) keeps one sum vector per head and
  one count, as llama.cpp stores it: in_sum2 [1, heads x ne0].

The sums are kept in float64, each product's batch summed in float32 first (`squares`): llama.cpp adds float32
squares one token at a time, so ours are the more exact of the two, by far less than the tests' tolerances. A layer's entries are final when the
engine leaves the layer: `take_layer` hands them over to be saved, so memory holds one layer's sums.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..constants import T

MIN_ROWS = 16          # imatrix.cpp: "why are small batches ignored (<16 tokens)?"


@dataclass
class Entry:
    """One weight's statistics: sums [n_counts, ne0] (float64) and counts [n_counts]."""
    sums: np.ndarray
    counts: np.ndarray

    def add(self, other: "Entry") -> None:
        self.sums += other.sums
        self.counts += other.counts


def squares(x: torch.Tensor) -> torch.Tensor:
    """sum over the tokens of x^2, per column: float32 squares summed by torch's blocked reduction (relative error
    ~1e-7, where llama.cpp's one-at-a-time float32 sum drifts by ~1e-6 over 2048 tokens), added in float64."""
    return (x * x).sum(0).double()


class ImatrixStats:
    """The engine's `Stats`: accumulates llama-imatrix's entries on the engine's device."""

    def __init__(self, n_expert: int, process_output: bool = False):
        self.n_expert, self.process_output = n_expert, process_output
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, torch.Tensor] = {}

    def collects(self, name: str) -> bool:
        return name.startswith("blk.") or (self.process_output and name == T.OUTPUT)

    def _acc(self, name: str, n_counts: int, ne0: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        if name not in self._sums:
            self._sums[name] = torch.zeros(n_counts, ne0, dtype=torch.float64, device=device)
            self._counts[name] = torch.zeros(n_counts, dtype=torch.float64, device=device)
        return self._sums[name], self._counts[name]

    def dense(self, name: str, x: torch.Tensor) -> None:
        if not self.collects(name) or x.shape[0] < MIN_ROWS:
            return
        sums, counts = self._acc(name, 1, x.shape[-1], x.device)
        sums[0] += squares(x)
        counts[0] += x.shape[0]

    def heads(self, name: str, x: torch.Tensor) -> None:
        n, h, k = x.shape
        if not self.collects(name) or n < MIN_ROWS:
            return
        sums, counts = self._acc(name, 1, h * k, x.device)
        sums[0] += squares(x).reshape(-1)
        counts[0] += n

    def expert(self, name: str, e: int, x: torch.Tensor) -> None:
        sums, counts = self._acc(name, self.n_expert, x.shape[-1], x.device)
        sums[e] += squares(x)
        counts[e] += x.shape[0]

    def take(self, prefix: str | None = None) -> dict[str, Entry]:
        """The entries whose names start with `prefix` (all with None), removed from the collector."""
        names = [n for n in self._sums if prefix is None or n.startswith(prefix)]
        out = {}
        for n in names:
            out[n] = Entry(self._sums.pop(n).cpu().numpy(), self._counts.pop(n).cpu().numpy())
        return out

    def take_layer(self, il: int) -> dict[str, Entry]:
        return self.take(f"blk.{il}.")
