"""Measured sensitivity: each decision's cost per type as the output's KL divergence, on the streamed engine.

The weight-error measure (measure.py) says how far a quantized matrix is from its source, weighted by its
activations; what a user loses is the output distribution. Here each (decision, candidate type) is measured end to
end: the decision's tensors alone are quantized to the type (our byte-exact quantizers, with the imatrix vectors
the write would use) and widened back, every other tensor stays as stored, and the model runs on a few thousand
tokens of a text; the cost is the mean KL divergence of its next-token distributions from the unquantized
model's, over the scored half of each chunk (as llama-perplexity scores). The solver then adds these costs (a
first-order model: small independent perturbations add in KL), so bytes go where the output loses least.

It is affordable because the model is run layer by layer: the unquantized run keeps the tokens' states at the
start of every layer, and a decision of layer L replays only layers L.. from there (the output head alone for
`output.weight`). Per decision and type that is (n_layer - L) / n_layer of a model pass over the tokens.

Costs are cached in the user's cache folder ($XDG_CACHE_HOME/kimi-convert/sensitivity, one JSON file per model,
tokens, imatrix and decision), like the error cache, so a second budget measures nothing.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from ...engine.forward import Engine
from ...engine.states import TokenStates
from ...engine.weights import GGUFSource
from ..blocks import dequantize, quantize
from ..imatrix import expert_slice
from .units import Unit

SENSITIVITY_VERSION = 1
LAYER = __import__("re").compile(r"^blk\.(\d+)\.")


def sensitivity_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "kimi-convert" / "sensitivity"


class QuantizedView:
    """A weight source equal to `source` but for some tensors, replaced by their quantize-dequantize round trip
    (and multiplied with that type's activation rounding, as ggml would)."""

    def __init__(self, source: GGUFSource, replaced: dict[str, tuple[QT, np.ndarray]]):
        self.source, self.replaced = source, replaced
        self.config, self.path = source.config, source.path

    @property
    def bytes_read(self) -> int:
        return self.source.bytes_read

    def names(self):
        return self.source.names()

    def qtype(self, name):
        return self.replaced[name][0] if name in self.replaced else self.source.qtype(name)

    def shape(self, name):
        return self.source.shape(name)

    def nbytes(self, name):
        return self.source.nbytes(name)

    def values(self, name):
        return self.replaced[name][1] if name in self.replaced else self.source.values(name)

    def expert(self, name, e):
        return self.replaced[name][1][e] if name in self.replaced else self.source.expert(name, e)

    def rows(self, name, ids):
        return self.replaced[name][1][ids] if name in self.replaced else self.source.rows(name, ids)


def round_trip(values: np.ndarray, qtype: QT, vector: np.ndarray | None) -> np.ndarray:
    """The values a tensor of numpy shape [..., rows, cols] holds after quantizing to `qtype` (each matrix with
    its own slice of the importance vector) and widening back: what the written file will multiply."""
    shape = values.shape
    mats = values.reshape(-1, shape[-2], shape[-1]) if values.ndim >= 2 else values.reshape(1, 1, -1)
    out = np.empty_like(mats)
    for e, m in enumerate(mats):
        v = None if vector is None else expert_slice(vector, values.shape, e)
        out[e] = dequantize(quantize(np.ascontiguousarray(m, np.float32), qtype, v), qtype)
    return out.reshape(shape)


@dataclass
class Baseline:
    """The unquantized run: states at the start of each layer, and the scored log-probabilities."""
    states: list[tuple[np.ndarray, list[np.ndarray]]]          # per layer: TokenStates.snapshot()
    log_probs: torch.Tensor                                     # [scored tokens, n_vocab]


class Sensitivity:
    """KL costs of decisions on one model and one token set."""

    def __init__(self, gguf: Path, ids: np.ndarray, imat, *, device: str = "cpu", cache_dir: Path | None = None,
                 note: Callable[[str], None] = lambda s: None):
        self.path, self.ids, self.imat, self.note = Path(gguf), ids, imat, note
        self.source = GGUFSource(self.path)
        self.cfg = self.source.config
        self.device = torch.device(device)
        self.ctx = ids.shape[1]
        self.scored = slice(self.ctx // 2, self.ctx - 1)
        self.cache_dir = cache_dir
        self.measured = self.cached = 0
        self._base: Baseline | None = None

    # --- the unquantized run ---
    def baseline(self) -> Baseline:
        if self._base is None:
            snaps = []
            engine, states = self._engine(self.source), self._states()
            engine.embed(self.ids, states)
            for il in range(self.cfg.n_layer):
                snaps.append(states.snapshot())
                engine.layer(il, states)
            snaps.append(states.snapshot())
            self._base = Baseline(snaps, self._log_probs(engine, states))
        return self._base

    def _engine(self, source) -> Engine:
        return Engine(source, self.device, None, slab_tokens=max(self.ctx, 4096 // self.ctx * self.ctx))

    def _states(self) -> TokenStates:
        return TokenStates(self.ids.shape[0], self.ctx, self.cfg.n_embd)

    def _log_probs(self, engine: Engine, states: TokenStates) -> torch.Tensor:
        head, out = engine.head(), []
        for c in range(states.n_chunks):
            h = engine.final_hidden(states, slice(c * self.ctx, (c + 1) * self.ctx), head)[self.scored]
            out.append(torch.log_softmax(engine.logits(h, head).double(), dim=-1))
        return torch.cat(out)

    # --- one decision, its types ---
    def costs(self, unit: Unit, types: list[QT]) -> dict[QT, float]:
        """Mean KL divergence (nats per scored token) of the model with `unit` alone at each type. The layer of
        the decision runs once per type; the layers after it once for all the types, their tokens side by side
        (the model's weights read once, every variant's tokens through them)."""
        out, todo = {}, []
        for t in types:
            hit = 0.0 if t == unit.source else self._read(self._key(unit, t))
            if hit is None:
                todo.append(t)
            else:
                out[t] = hit
                self.cached += t != unit.source
        if todo:
            for t, kld in zip(todo, self._measure(unit, todo)):
                out[t] = kld
                self.measured += 1
                self._write(self._key(unit, t), kld)
        return out

    def _measure(self, unit: Unit, types: list[QT]) -> list[float]:
        base, start, n = self.baseline(), self._first_layer(unit), self.ids.shape[0]
        variants = []
        for t in types:
            replaced = {d.name: (t, round_trip(self.source.values(d.name), t, self._vector(d)))
                        for d in unit.decisions}
            view = QuantizedView(self.source, replaced)
            states, engine = self._states(), self._engine(view)
            if unit.decisions[0].name.startswith("token_embd"):
                engine.embed(self.ids, states)          # the quantized embedding starts the stream
            else:
                states.restore(base.states[start])
            if start < self.cfg.n_layer:
                engine.layer(start, states)
            variants.append((view, states.snapshot()))
        joined = TokenStates(n * len(types), self.ctx, self.cfg.n_embd)
        joined.restore((np.concatenate([v[1][0] for v in variants]),
                        [np.concatenate([v[1][1][b] for v in variants]) for b in range(len(variants[0][1][1]))]))
        head_source = variants[0][0] if unit.decisions[0].name.startswith("output") else self.source
        if len(types) > 1 and head_source is not self.source:        # the head differs per variant
            return [self._kld_alone(view, snap) for view, snap in variants]
        engine = self._engine(head_source)
        for il in range(start + 1, self.cfg.n_layer):
            engine.layer(il, joined)
        lp = self._log_probs(engine, joined)
        per = lp.shape[0] // len(types)
        return [float((base.log_probs.exp() * (base.log_probs - lp[k * per:(k + 1) * per])).sum(-1).mean())
                for k in range(len(types))]

    def _kld_alone(self, view, snap) -> float:
        states = self._states()
        states.restore(snap)
        lp = self._log_probs(self._engine(view), states)
        base = self.baseline().log_probs
        return float((base.exp() * (base - lp)).sum(-1).mean())

    def _first_layer(self, unit: Unit) -> int:
        m = LAYER.match(unit.decisions[0].name)
        if m:
            return int(m[1])
        return 0 if unit.decisions[0].name.startswith("token_embd") else self.cfg.n_layer

    def _vector(self, d):
        return None if self.imat is None else self.imat.vector(d.name, d.shape)

    # --- cache ---
    def _key(self, unit: Unit, qtype: QT) -> str:
        h = hashlib.sha256()
        st = self.path.stat()
        h.update(json.dumps([SENSITIVITY_VERSION, str(self.path.resolve()), st.st_size, st.st_mtime_ns,
                             unit.key, qtype.name, str(self.device.type)]).encode())
        h.update(self.ids.tobytes())
        if self.imat is not None:
            ist = Path(self.imat.path).stat()
            h.update(f"{Path(self.imat.path).resolve()}:{ist.st_size}:{ist.st_mtime_ns}".encode())
        return h.hexdigest()[:32]

    def _read(self, key: str) -> float | None:
        if self.cache_dir is None:
            return None
        try:
            return float(json.loads((self.cache_dir / f"{key}.json").read_text())["kld"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _write(self, key: str, kld: float) -> None:
        if self.cache_dir is None:
            return
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.cache_dir, prefix=".", suffix=".part")
            with os.fdopen(fd, "w") as f:
                json.dump({"kld": kld}, f)
            os.replace(tmp, self.cache_dir / f"{key}.json")
        except OSError:
            pass                  # a cache that cannot be written only costs a re-measurement


class KldCosts:
    """The costs `choose` spends the budget by (choose.Costs): per decision and candidate, the KL divergence."""

    def __init__(self, sens: Sensitivity, text: Path, note: Callable[[str], None] = lambda s: None):
        self.sens, self.text, self.note = sens, text, note

    def __call__(self, units, types) -> list[dict[QT, float]]:
        out = []
        for i, (u, ts) in enumerate(zip(units, types)):
            out.append(self.sens.costs(u, ts))
            self.note(f"sensitivity {i + 1}/{len(units)} {u.key}: "
                      + ", ".join(f"{t.name} {v:.2e}" for t, v in out[-1].items()))
        self.note(f"sensitivity: {self.sens.measured} measured, {self.sens.cached} from the cache "
                  f"({self.sens.cache_dir}); each decision's types on the weight errors' lower hull")
        return out

    def describe(self) -> str:
        s = self.sens
        return (f"measured KL divergence of the output (nats per token) with the decision alone quantized, on "
                f"{s.ids.shape[0]} chunks of {s.ctx} tokens of {self.text} (the scored half of each chunk)")
