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
import time
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
from .prior import LAYER, role
from .units import Unit

SENSITIVITY_VERSION = 1


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
                 note: Callable[[str], None] = lambda s: None, max_variants: int = 0):
        self.path, self.ids, self.imat, self.note = Path(gguf), ids, imat, note
        self.source = GGUFSource(self.path)
        self.cfg = self.source.config
        self.device = torch.device(device)
        self.ctx = ids.shape[1]
        self.scored = slice(self.ctx // 2, self.ctx - 1)
        self.cache_dir = cache_dir
        self.measured = self.cached = 0
        self.baseline_seconds = 0.0
        self._base: Baseline | None = None
        self.max_variants = max_variants or self._variants_that_fit()

    def _variants_that_fit(self) -> int:
        """As many variants as a quarter of the RAM available now holds, each with its token states at every
        AttnRes bank a layer may hold (the stream and n_layer / block banks) and a snapshot: at least 1."""
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            avail = 8 << 30
        banks = 2 + self.cfg.n_layer // max(self.cfg.attn_res_block_size, 1)
        per_variant = 2 * self.ids.size * self.cfg.n_embd * 4 * banks
        return max(1, int(avail // 4 // per_variant))

    # --- the unquantized run ---
    def baseline(self) -> Baseline:
        """The unquantized run, made once (its n_layer layer passes timed: baseline_seconds)."""
        if self._base is None:
            start = time.perf_counter()
            snaps = []
            engine, states = self._engine(self.source), self._states()
            engine.embed(self.ids, states)
            for il in range(self.cfg.n_layer):
                snaps.append(states.snapshot())
                engine.layer(il, states)
            snaps.append(states.snapshot())
            self._base = Baseline(snaps, self._log_probs(engine, states))
            self.baseline_seconds = time.perf_counter() - start
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

    # --- decisions, their types ---
    def costs(self, unit: Unit, types: list[QT]) -> dict[QT, float]:
        """Mean KL divergence (nats per scored token) of the model with `unit` alone at each type."""
        return self.costs_of([unit], [types])[0]

    def costs_of(self, units: list[Unit], types: list[list[QT]]) -> list[dict[QT, float]]:
        """costs() of several decisions. The variants (a decision at a type) that start at the same layer run
        that layer each, then the layers after it once for all of them, their tokens side by side: the weights
        of a following layer are read once per group, not once per decision and type. A group holds at most
        `max_variants` (the token states of every variant are in RAM at once)."""
        out: list[dict[QT, float]] = [{} for _ in units]
        todo: dict[int, list[tuple[int, QT]]] = {}
        for i, (u, ts) in enumerate(zip(units, types)):
            for t in ts:
                hit = 0.0 if t == u.source else self._read(self._key(u, t))
                if hit is None:
                    todo.setdefault(self._first_layer(u), []).append((i, t))
                else:
                    out[i][t] = hit
                    self.cached += t != u.source
        for start, pairs in sorted(todo.items()):
            groups = _head_groups(units, pairs) if start == self.cfg.n_layer else \
                [pairs[a:a + self.max_variants] for a in range(0, len(pairs), self.max_variants)]
            for group in groups:
                for (i, t), kld in zip(group, self._measure_variants(start, [(units[i], t) for i, t in group])):
                    out[i][t] = kld
                    self.measured += 1
                    self._write(self._key(units[i], t), kld)
        return out

    def _measure(self, unit: Unit, types: list[QT]) -> list[float]:
        return self._measure_variants(self._first_layer(unit), [(unit, t) for t in types])

    def _measure_variants(self, start: int, pairs: list[tuple[Unit, QT]]) -> list[float]:
        base, n = self.baseline(), self.ids.shape[0]
        variants = []
        for unit, t in pairs:
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
        head_source = variants[0][0] if pairs[0][0].decisions[0].name.startswith("output") else self.source
        if len(pairs) > 1 and head_source is not self.source:        # the head differs per variant
            return [self._kld_alone(view, snap) for view, snap in variants]
        joined = TokenStates(n * len(pairs), self.ctx, self.cfg.n_embd)
        joined.restore((np.concatenate([v[1][0] for v in variants]),
                        [np.concatenate([v[1][1][b] for v in variants]) for b in range(len(variants[0][1][1]))]))
        engine = self._engine(head_source)
        for il in range(start + 1, self.cfg.n_layer):
            engine.layer(il, joined)
        lp = self._log_probs(engine, joined)
        per = lp.shape[0] // len(pairs)
        return [float((base.log_probs.exp() * (base.log_probs - lp[k * per:(k + 1) * per])).sum(-1).mean())
                for k in range(len(pairs))]

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


def _head_groups(units, pairs) -> list[list]:
    """The variants after the last layer (the output head): each decision's types together (the head is the
    decision, so it differs per variant and each type runs the head alone)."""
    by_unit: dict[int, list] = {}
    for i, t in pairs:
        by_unit.setdefault(i, []).append((i, t))
    return list(by_unit.values())


def sampled_layers(units, per_kind: int) -> set[int]:
    """The layers whose decisions are measured when `per_kind` layers of each kind are: layers are of one kind
    when their decisions have the same roles (K3: the dense first layer, KDA with routed experts, MLA with routed
    experts), and each kind's `per_kind` are spread evenly over its layers, its first and last among them
    (0: every layer)."""
    roles: dict[int, set[str]] = {}
    for u in units:
        m = LAYER.match(u.key)
        if m:
            roles.setdefault(int(m[1]), set()).add(role(u.key))
    if per_kind <= 0:
        return set(roles)
    kinds: dict[frozenset, list[int]] = {}
    for il in sorted(roles):
        kinds.setdefault(frozenset(roles[il]), []).append(il)
    picked = set()
    for layers in kinds.values():
        k = min(per_kind, len(layers))
        picked |= {layers[round(i * (len(layers) - 1) / max(k - 1, 1))] for i in range(k)}
    return picked


def layer_passes(units, types, per_kind: int, n_layer: int) -> tuple[int, int]:
    """(decisions measured, layer passes over the token set) of KldCosts with `per_kind`: a decision of layer L
    with k types runs layers L..n_layer-1 for k copies of the tokens (the embedding's from layer 0; the output
    head's none), on top of the unquantized run's n_layer."""
    sampled = sampled_layers(units, per_kind)
    passes, measured = n_layer, 0
    for u, ts in zip(units, types):
        il = _layer(u)
        if il is not None and il not in sampled:
            continue
        k = sum(t != u.source for t in ts)
        start = il if il is not None else (0 if u.key.startswith("token_embd") else n_layer)
        passes += k * (n_layer - start)
        measured += 1
    return measured, passes


class RoleScales:
    """measured cost / weight error of the measured decisions, per role and type: what a decision of an
    unmeasured layer is costed by (its weight error times its role's scale for that type). A type its role
    was not measured at takes the role's scale over every type, then the type's over every role, then the
    scale over everything; each a geometric mean (the ratios span decades)."""

    def __init__(self, pairs: list[tuple[str, QT, float, float]]):       # (role, type, weight error, cost)
        self.logs: dict = {}
        for r, t, e, c in pairs:
            if e > 0 and c > 0:
                for key in ((r, t), r, t, None):                # a role is a str, a type a QT: keys apart
                    self.logs.setdefault(key, []).append(float(np.log(c / e)))

    def scale(self, role_: str, qtype: QT) -> float:
        for key in ((role_, qtype), role_, qtype, None):
            if key in self.logs:
                return float(np.exp(np.mean(self.logs[key])))
        return 1.0


class KldCosts:
    """The costs `choose` spends the budget by (choose.Costs): per decision and candidate, the KL divergence,
    measured for the decisions of the sampled layers (sampled_layers; the embedding and the output head always)
    and, for the others, their weight error times the measured scale of their role (RoleScales)."""

    hull_only = True            # only the weight errors' hull types are worth a measurement

    def __init__(self, sens: Sensitivity, text: Path, note: Callable[[str], None] = lambda s: None,
                 layers_per_kind: int = 0):
        self.sens, self.text, self.note, self.per_kind = sens, text, note, layers_per_kind
        self.n_estimated = 0

    def __call__(self, units, types, errors) -> list[dict[QT, float]]:
        sampled = sampled_layers(units, self.per_kind)
        n, passes = layer_passes(units, types, self.per_kind, self.sens.cfg.n_layer)
        self.sens.baseline()
        per_pass = self.sens.baseline_seconds / max(self.sens.cfg.n_layer, 1)
        self.note(f"sensitivity: {n} of {len(units)} decisions measured (layers {sorted(sampled)}): "
                  f"{passes:,} layer passes over {self.sens.ids.size:,} tokens, less what the cache holds; about "
                  f"{_hours(passes * per_pass)} at this run's {per_pass:.2f} s a pass")
        measured = [i for i, u in enumerate(units) if _layer(u) is None or _layer(u) in sampled]
        out: list = [None] * len(units)
        by_layer: dict[int | None, list[int]] = {}
        for i in measured:
            by_layer.setdefault(_layer(units[i]), []).append(i)
        for il, idx in by_layer.items():            # a layer's decisions together: its following layers read once
            for i, c in zip(idx, self.sens.costs_of([units[i] for i in idx], [types[i] for i in idx])):
                out[i] = c
                self.note(f"sensitivity {units[i].key}: " + ", ".join(f"{t.name} {v:.2e}" for t, v in c.items()))
        scales = RoleScales([(role(units[i].key), t, errors[i][t], c) for i in measured for t, c in out[i].items()
                             if t != units[i].source])
        rest = [i for i in range(len(units)) if out[i] is None]
        for i in rest:
            out[i] = {t: 0.0 if t == units[i].source else errors[i][t] * scales.scale(role(units[i].key), t)
                      for t in types[i]}
        self.n_estimated = len(rest)
        self.note(f"sensitivity: {self.sens.measured} measured, {self.sens.cached} from the cache "
                  f"({self.sens.cache_dir}); each decision's types on the weight errors' lower hull"
                  + (f"; {len(rest)} decisions of the {len(_layers(units)) - len(sampled)} unsampled layers "
                     f"costed by their weight error times their role's measured scale" if rest else ""))
        return out

    def describe(self) -> str:
        s = self.sens
        sampled = (f"; the decisions of {self.per_kind} layer(s) of each kind measured, the others' weight errors "
                   f"scaled by their role's measured KLD / weight error" if self.n_estimated else "")
        return (f"measured KL divergence of the output (nats per token) with the decision alone quantized, on "
                f"{s.ids.shape[0]} chunks of {s.ctx} tokens of {self.text} (the scored half of each chunk)"
                + sampled)


def _hours(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 3600 else f"{seconds / 3600:.1f} h"


def _layer(u) -> int | None:
    m = LAYER.match(u.key)
    return int(m[1]) if m else None


def _layers(units) -> set[int]:
    return {il for u in units if (il := _layer(u)) is not None}
