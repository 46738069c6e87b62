"""What a kimi-imatrix run will read, hold and take, before it starts (`--dry-run`, and the line every run prints).

- bytes read: every tensor the engine multiplies or looks up (the blk.* tensors, the embedding, the final norm and
  AttnRes score; `output` only with --process-output), each once;
- token states: the stream plus the AttnRes banks a token carries at the deepest layer, float32; those beyond the
  RAM budget spill to disk beside the output;
- peak memory: this process as it stands (interpreter, torch, the plan), the largest layer's dense weights as
  float32, one routed expert's three matrices, the FFN's whole-run activations, one attention slab's temporaries,
  and the states held in RAM;
- time: one chunk timed through one layer of each kind at the model's widths (zero weights, nothing read), scaled
  to the run's tokens and layers; one routed expert timed on its share of the tokens, times the experts; their
  decoding and the dense weights' widening at rates measured on the model's own bytes (all here, now).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..constants import T

ATTN_SLAB_BYTES = 1 << 30          # the attention temporaries of one slab of chunks (Engine.slab_tokens)


@dataclass
class ImatrixPlan:
    tokens: int
    chunks: int
    ctx: int
    bytes_read: int
    token_state_bytes: int
    states_in_ram: int
    peak_bytes: int
    seconds: float
    flops: float
    matmul_rate: float
    decode_rate: float
    layers: int
    parts: dict = field(default_factory=dict)     # seconds: layers, expert products, expert decoding, dense weights

    def summary(self) -> str:
        spill = self.token_state_bytes - self.states_in_ram
        return (f"{self.tokens:,} tokens ({self.chunks} chunks of {self.ctx}) through {self.layers} layers: read "
                f"{_h(self.bytes_read)}, token states {_h(self.token_state_bytes)}"
                + (f" ({_h(spill)} spilled to disk)" if spill > 0 else "")
                + f", peak memory ~{_h(self.peak_bytes)}, ~{_duration(self.seconds)} here")

    def lines(self) -> list[str]:
        return ["kimi-imatrix plan", self.summary(),
                f"  bytes read         {self.bytes_read:,}",
                f"  token states       {self.token_state_bytes:,} ({self.states_in_ram:,} in RAM)",
                f"  peak memory        {self.peak_bytes:,}",
                f"  time               {self.seconds:,.0f} s: "
                + ", ".join(f"{what} {sec:,.0f} s" for what, sec in self.parts.items())
                + f" ({self.flops:.3g} multiply-adds; the experts' products at {self.matmul_rate / 1e9:.0f} GFLOP/s, "
                f"decoded at {self.decode_rate / 1e6:.0f} MB/s: each measured here now)"]

    def as_json(self) -> dict:
        return {"bytes_read": self.bytes_read, "peak_bytes": self.peak_bytes,
                "token_state_bytes": self.token_state_bytes, "seconds": self.seconds, "tokens": self.tokens,
                "chunks": self.chunks, "ctx": self.ctx, "states_in_ram": self.states_in_ram, "flops": self.flops,
                "expert_matmul_flops_per_s": self.matmul_rate, "decode_bytes_per_s": self.decode_rate,
                "seconds_by_part": self.parts}


def _h(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _duration(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


def available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def default_state_ram() -> int:
    return available_ram() // 2


def _read_names(source, process_output: bool) -> list[str]:
    names = [n for n in source.names() if n.startswith("blk.")]
    names += [n for n in (T.TOKEN_EMBD, T.OUTPUT_NORM, T.OUTPUT_RES_SCORE) if n in source.names()]
    if process_output:
        names.append(T.OUTPUT)
    return names


def _elements(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def layer_weights_f32(source, il: int) -> tuple[int, int]:
    """(dense weights of layer il as float32, one expert's three matrices as float32) in bytes."""
    prefix, dense, expert = f"blk.{il}.", 0, 0
    for n in source.names():
        if not n.startswith(prefix):
            continue
        shape = source.shape(n)
        if "_exps." in n:
            expert += 4 * _elements(shape[1:])
        else:
            dense += 4 * _elements(shape)
    return dense, expert


def multiply_adds(cfg, tokens: int, ctx: int) -> float:
    """Multiply-adds of one run: every token through each layer's dense products, its k experts and the
    attention over its chunk (T^2/2 per head)."""
    total = 0.0
    per_tok_attn = cfg.n_head * (cfg.kv_lora_rank * 2 + cfg.qk_rope_head_dim) * ctx / 2
    for il in range(cfg.n_layer):
        if cfg.is_kda(il):
            d = cfg.d_inner
            total += tokens * (cfg.n_embd * d * 5 + cfg.n_embd * cfg.kda_head_dim + cfg.kda_head_dim * d
                               + cfg.n_embd * cfg.n_head)
        else:
            q = cfg.n_head * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
            total += tokens * (cfg.n_embd * cfg.q_lora_rank + cfg.q_lora_rank * q
                               + cfg.n_embd * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
                               + cfg.n_head * cfg.qk_nope_head_dim * cfg.kv_lora_rank
                               + cfg.n_head * cfg.v_head_dim * (cfg.kv_lora_rank + 2 * cfg.n_embd) + per_tok_attn)
            if cfg.indexer is not None:
                ix = cfg.indexer
                total += tokens * (cfg.q_lora_rank * ix.n_head * ix.head_dim + cfg.n_embd * (ix.head_dim + ix.n_head)
                                   + ix.n_head * ix.head_dim * ctx / 2)
        if cfg.is_moe(il):
            lat = cfg.n_lat
            total += tokens * (cfg.n_embd * cfg.n_expert + 2 * cfg.n_embd * cfg.n_latent
                               + cfg.n_expert_used * 3 * lat * cfg.n_ff_exp
                               + 3 * cfg.n_embd * cfg.n_ff_exp * cfg.n_expert_shared)
        else:
            total += tokens * 3 * cfg.n_embd * cfg.n_ff
    return total


def measure_matmul_rate(m: int = 1024, k: int = 2048, n: int = 2048, seconds: float = 0.3) -> float:
    """FLOP/s of torch's float32 matmul here, at a shape like the engine's: m tokens by a [n, k] matrix (a slab
    through a layer matrix; a routed expert's share of the tokens through one expert)."""
    m, k, n = max(1, min(m, 4096)), min(k, 8192), min(n, 8192)
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        count += 1
    return count * 2 * m * k * n / (time.perf_counter() - t0)


def measure_decode_rate(source, seconds: float = 0.3) -> float:
    """Bytes of routed-expert weights read and decoded to float32 per second: distinct experts of the last MoE
    layer, as the run reads them (from the page cache or the disk: a real run reads each byte once). The first
    expert is decoded untimed: it loads the compiled kernels (about 0.5 s), which a run pays once, not per
    expert; timed, it made the rate 11-14 MB/s instead of ~390 on the real K3's shapes."""
    names = sorted(n for n in source.names() if n.endswith("ffn_down_exps.weight"))
    if not names:
        return float("inf")
    name, bytes_before = names[-1], source.bytes_read
    n_expert = source.shape(name)[0]
    source.expert(name, 0)
    n, t0, start = min(1, n_expert - 1), time.perf_counter(), source.bytes_read
    while (time.perf_counter() - t0 < seconds or n < 2) and n < n_expert:
        source.expert(name, n)
        n += 1
    done = source.bytes_read - start
    source.bytes_read = bytes_before
    return done / max(time.perf_counter() - t0, 1e-9)


def measure_dense_rate(source, seconds: float = 0.2) -> float:
    """Bytes of the largest dense weight read and widened to float32 per second; the smallest one of its type
    first, untimed, for the kernels' one-off load (as in `measure_decode_rate`)."""
    dense = [n for n in source.names() if n.startswith("blk.") and "_exps." not in n]
    if not dense:
        return float("inf")
    name, bytes_before = max(dense, key=source.nbytes), source.bytes_read
    source.values(min((n for n in dense if source.qtype(n) == source.qtype(name)), key=source.nbytes))
    start, t0 = source.bytes_read, time.perf_counter()
    source.values(name)
    done = source.bytes_read - start
    source.bytes_read = bytes_before
    return done / max(time.perf_counter() - t0, 1e-9)


class ShapeSource:
    """A source with the model's names, shapes and types whose tensors are zeros: the engine's work on one chunk
    at the real widths, timed without reading the model (the dry run's calibration)."""

    def __init__(self, source):
        self.config, self.path, self.bytes_read, self.source = source.config, source.path, 0, source

    def names(self):
        return self.source.names()

    def qtype(self, name):
        return self.source.qtype(name)

    def shape(self, name):
        return self.source.shape(name)

    def nbytes(self, name):
        return self.source.nbytes(name)

    def values(self, name):
        return np.zeros(self.shape(name), np.float32)

    def expert(self, name, e):
        return np.zeros(self.shape(name)[1:], np.float32)


_LAYER_SECONDS: dict[tuple, dict[tuple[bool, bool], float]] = {}


def measure_layer_seconds(source, ctx: int) -> dict[tuple[bool, bool], float]:
    """Seconds a token of one chunk takes through one layer of each kind (KDA or MLA, dense or MoE), everything
    but the routed experts, at the model's widths, measured here now on zero weights (no file is read). Shapes
    and types decide it, so a second model of the same ones (kimi-verify kld's other pass) is not timed again."""
    key = (ctx, tuple(sorted((n, tuple(source.shape(n)), int(source.qtype(n))) for n in source.names()
                             if not n.endswith("_exps.weight"))))
    if key not in _LAYER_SECONDS:
        _LAYER_SECONDS[key] = _time_layers(source, ctx)
    return _LAYER_SECONDS[key]


def _time_layers(source, ctx: int) -> dict[tuple[bool, bool], float]:
    from ..engine.forward import Engine
    from ..engine.states import TokenStates
    from .collect import ImatrixStats
    cfg = source.config
    kinds: dict[tuple[bool, bool], int] = {}
    for il in range(cfg.n_layer):
        kinds.setdefault((cfg.is_kda(il), cfg.is_moe(il)), il)
    out = {}
    zeros = ShapeSource(source)
    for kind, il in kinds.items():
        states = TokenStates(1, ctx, cfg.n_embd)
        states.set_stream(np.random.default_rng(0).standard_normal((ctx, cfg.n_embd)).astype(np.float32))
        for _ in range(il // cfg.attn_res_block_size + 1 if cfg.attn_res_block_size else 0):
            states.bank_stream()
        engine = Engine(zeros, stats=ImatrixStats(cfg.n_expert), slab_tokens=ctx, routed=False)
        t0 = time.perf_counter()
        engine.layer(il, states)
        out[kind] = (time.perf_counter() - t0) / ctx
    return out


def measure_expert_seconds(source, rows: int, samples: int = 6) -> float:
    """Seconds one routed expert takes on `rows` tokens (its share of a run's): its three products with ggml's
    rounding, SiTU and the statistics, at the model's widths on zero weights (the decoding is timed apart)."""
    from ..engine.forward import Products, expert_ffn
    from ..engine.weights import Layer
    from .collect import ImatrixStats
    cfg = source.config
    moe = [il for il in range(cfg.n_layer) if cfg.is_moe(il)]
    if not moe:
        return 0.0
    mm = Products(Layer(ShapeSource(source), moe[0], torch.device("cpu")), ImatrixStats(cfg.n_expert))
    x = torch.randn(max(rows, 1), cfg.n_lat)
    expert_ffn(mm, 0, x, cfg)
    t0 = time.perf_counter()
    for e in range(samples):
        expert_ffn(mm, e, x, cfg)
    return (time.perf_counter() - t0) / samples


def _over(nbytes: float, rate: float) -> float:
    return nbytes / rate if math.isfinite(rate) and rate > 0 else 0.0


def dry_run_plan(run) -> ImatrixPlan:
    from ..memory import peak_rss
    source, cfg, opts = run.source, run.cfg, run.opts
    tokens, ctx = run.n_tokens, opts.ctx
    names = _read_names(source, opts.process_output)
    bytes_read = sum(source.nbytes(n) for n in names)
    banks = math.ceil(cfg.n_layer / cfg.attn_res_block_size) if cfg.attn_res_block_size else 0
    vector = tokens * cfg.n_embd * 4
    state_bytes = vector * (1 + banks)
    budget = opts.state_ram if opts.state_ram is not None else default_state_ram()
    in_ram = vector + min(banks, max(0, (budget - vector) // vector)) * vector
    dense, expert = max(layer_weights_f32(source, il) for il in range(cfg.n_layer))
    ffn = tokens * 4 * (3 * cfg.n_embd + 2 * cfg.n_lat + 3 * cfg.n_expert + 2 * cfg.n_expert
                        + 2 * cfg.n_ff_exp * max(cfg.n_expert_shared, 1))
    attn = min(ATTN_SLAB_BYTES, run.n_chunks * cfg.n_head * ctx * ctx * 12) \
        + 16 * run.slab_tokens() * max(cfg.d_inner, cfg.n_embd) * 4
    peak = peak_rss() + dense + expert + ffn + attn + in_ram
    flops = multiply_adds(cfg, tokens, ctx)
    per_token = measure_layer_seconds(source, ctx)
    per_expert = tokens * cfg.n_expert_used // max(cfg.n_expert, 1)          # an expert's share of the tokens
    expert_rate = measure_matmul_rate(per_expert, cfg.n_lat, cfg.n_ff_exp)
    decode, dense_rate = measure_decode_rate(source), measure_dense_rate(source)
    moe_layers = sum(cfg.is_moe(il) for il in range(cfg.n_layer))
    expert_bytes = sum(source.nbytes(n) for n in names if "_exps." in n)
    parts = {
        "layers": sum(per_token[(cfg.is_kda(il), cfg.is_moe(il))] for il in range(cfg.n_layer)) * tokens,
        "expert products": moe_layers * cfg.n_expert * measure_expert_seconds(source, per_expert),
        "expert decoding": _over(expert_bytes, decode),
        "dense weights": _over(bytes_read - expert_bytes, dense_rate)}
    seconds = sum(parts.values())
    return ImatrixPlan(tokens, run.n_chunks, ctx, bytes_read, state_bytes, in_ram, int(peak), seconds, flops,
                       expert_rate, decode, cfg.n_layer, parts)
