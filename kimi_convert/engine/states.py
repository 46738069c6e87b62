"""The tokens' states between layers: the residual stream P and the banked AttnRes blocks, [N, n_embd] each.

On K3 (93 layers, AttnRes blocks of 12) a token carries up to 9 such vectors: 100k tokens are 26 GB of states.
They stay in RAM while they fit the budget and go to memory-mapped files in `spill_dir` beyond it (the stream
first stays in RAM, the banks spill, oldest first, since each is read once per layer and written once). The
same files hold a finished layer's states for `--resume` (`save` / `load`).
"""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import torch

from ..errors import DiskSpaceError, OutputError

F32 = np.float32


class TokenStates:
    def __init__(self, n_chunks: int, ctx: int, n_embd: int, *, ram_budget: int | None = None,
                 spill_dir: Path | None = None):
        self.n_chunks, self.ctx, self.n_embd = n_chunks, ctx, n_embd
        self.n_tokens = n_chunks * ctx
        self.ram_budget, self.spill_dir = ram_budget, spill_dir
        self.P = np.zeros((self.n_tokens, n_embd), F32)
        self._banks: list[np.ndarray] = []
        self._saved = 0                  # banks already in the resume folder (they never change)

    # --- memory ---
    @property
    def vector_bytes(self) -> int:
        return self.n_tokens * self.n_embd * 4

    def ram_bytes(self) -> int:
        return sum(a.nbytes for a in [self.P, *self._banks] if not isinstance(a, np.memmap))

    def _new_bank(self) -> np.ndarray:
        if self.ram_budget is None or self.ram_bytes() + self.vector_bytes <= self.ram_budget:
            return np.empty((self.n_tokens, self.n_embd), F32)
        if self.spill_dir is None:
            raise MemoryError("token states exceed the RAM budget and no spill folder was given")
        path = self.spill_dir / f"state{len(self._banks) + 1}.npy"      # saved in place (`save`)
        try:
            bank = np.lib.format.open_memmap(path, mode="w+", dtype=F32, shape=(self.n_tokens, self.n_embd))
            with open(path, "r+b") as f:      # the blocks now: a full disk is an error here, not a SIGBUS later
                os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size)
            return bank
        except OSError as e:
            error = DiskSpaceError if e.errno in (errno.ENOSPC, errno.EDQUOT) else OutputError
            raise error(f"{path}: cannot spill token states to disk ({e.strerror or e})") from None

    def snapshot(self) -> tuple[np.ndarray, list[np.ndarray]]:
        """A copy of every state (in RAM), to run the following layers again from here (`restore`)."""
        return self.P.copy(), [np.array(b) for b in self._banks]

    def restore(self, snap: tuple[np.ndarray, list[np.ndarray]]) -> None:
        self.P[:] = snap[0]
        self._banks = [b.copy() for b in snap[1]]

    # --- access by token rows (whole chunks) ---
    def slabs(self, tokens: int) -> list[slice]:
        per = max(1, tokens // self.ctx) * self.ctx
        return [slice(a, min(a + per, self.n_tokens)) for a in range(0, self.n_tokens, per)]

    def stream(self, rows: slice, device) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(self.P[rows])).to(device)

    def banks(self, rows: slice, device) -> list[torch.Tensor]:
        return [torch.from_numpy(np.ascontiguousarray(b[rows])).to(device) for b in self._banks]

    def set_stream(self, values, rows: slice = slice(None)) -> None:
        self.P[rows] = values.cpu().numpy() if isinstance(values, torch.Tensor) else values

    def add_stream(self, values: torch.Tensor, rows: slice = slice(None)) -> None:
        self.P[rows] += values.cpu().numpy()

    def bank_stream(self) -> None:
        bank = self._new_bank()
        bank[:] = self.P
        self._banks.append(bank)

    @property
    def n_banks(self) -> int:
        return len(self._banks)

    # --- resume ---
    def save(self, folder: Path) -> None:
        """Write every state to `folder` (np.save of each, then a manifest written last)."""
        folder.mkdir(parents=True, exist_ok=True)
        for i, a in enumerate([self.P, *self._banks]):
            if 0 < i <= self._saved:
                continue
            path = folder / f"state{i}.npy"
            if isinstance(a, np.memmap) and Path(a.filename) == path:
                a.flush()
                continue
            with open(folder / f".state{i}.npy.tmp", "wb") as f:
                np.save(f, a)
            os.replace(folder / f".state{i}.npy.tmp", path)
        self._saved = len(self._banks)
        (folder / "states.json").write_text(json.dumps({"n": 1 + len(self._banks)}))

    def load(self, folder: Path) -> None:
        n = json.loads((folder / "states.json").read_text())["n"]
        self.P = np.array(np.load(folder / "state0.npy"))
        self._banks = [np.load(folder / f"state{i}.npy", mmap_mode="r") for i in range(1, n)]
        self._saved = len(self._banks)
