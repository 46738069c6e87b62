"""What a kimi-verify kld run will read, hold, write and take (`--dry-run`, and the line every run prints).

Each model pass is a kimi-imatrix pass without statistics, with `output` (imatrix/plan.py measures it: bytes,
token states, peak, time from speeds measured here now); on top, the scored half of every chunk's logits (one
chunk at a time, ctx/2 x n_vocab floats) and the base file's bytes on disk (llama-perplexity's format: 2 bytes
a vocabulary entry a scored token).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from .basefile import BaseHeader
from ..imatrix.plan import ImatrixPlan, _duration, _h, dry_run_plan, measure_matmul_rate


@dataclass
class KldPlan:
    chunks: int
    ctx: int
    bytes_read: int
    token_state_bytes: int
    peak_bytes: int
    seconds: float
    base_file_bytes: int
    passes: dict = field(default_factory=dict)          # model -> ImatrixPlan

    def summary(self) -> str:
        return (f"{self.chunks} chunks of {self.ctx}, {len(self.passes)} model pass(es): read {_h(self.bytes_read)}, "
                f"token states {_h(self.token_state_bytes)}, base file {_h(self.base_file_bytes)}, peak memory "
                f"~{_h(self.peak_bytes)}, ~{_duration(self.seconds)} here")

    def lines(self) -> list[str]:
        out = ["kimi-verify kld plan", self.summary(),
               f"  bytes read         {self.bytes_read:,}",
               f"  token states       {self.token_state_bytes:,} (a pass at a time)",
               f"  base file          {self.base_file_bytes:,} bytes on disk",
               f"  peak memory        {self.peak_bytes:,}",
               f"  time               {self.seconds:,.0f} s"]
        for model, p in self.passes.items():
            out.append(f"  pass {model}: " + p.summary())
        return out

    def as_json(self) -> dict:
        return {"bytes_read": self.bytes_read, "peak_bytes": self.peak_bytes,
                "token_state_bytes": self.token_state_bytes, "seconds": self.seconds, "chunks": self.chunks,
                "ctx": self.ctx, "base_file_bytes": self.base_file_bytes,
                "passes": {m: p.as_json() for m, p in self.passes.items()}}


def _pass_plan(run, source) -> ImatrixPlan:
    opts = SimpleNamespace(state_ram=run.opts.state_ram, process_output=True, ctx=run.ctx)
    shim = SimpleNamespace(source=source, cfg=source.config, opts=opts, n_tokens=run.ids.size,
                           n_chunks=run.n_chunks, slab_tokens=lambda: run.slab_tokens(source))
    return dry_run_plan(shim)


def kld_plan(run) -> KldPlan:
    models = [("base", run.opts.base, run.base_source), ("quant", run.opts.quant, run.quant_source)]
    passes = {f"{which} {m}": _pass_plan(run, s) for which, m, s in models if s is not None}
    cfg = (run.quant_source or run.base_source).config
    header = BaseHeader(run.ctx, cfg.n_vocab, run.n_chunks)
    scored = header.scored * run.n_chunks
    logits_bytes = header.scored * cfg.n_vocab * 4 * 3            # one chunk's logits and two temporaries
    head_seconds = len(passes) * 2 * scored * cfg.n_vocab * cfg.n_embd / measure_matmul_rate(header.scored, cfg.n_embd,
                                                                                           cfg.n_vocab)
    return KldPlan(run.n_chunks, run.ctx, sum(p.bytes_read for p in passes.values()),
                   max(p.token_state_bytes for p in passes.values()),
                   max(p.peak_bytes for p in passes.values()) + logits_bytes,
                   sum(p.seconds for p in passes.values()) + head_seconds,
                   header.nbytes() if run.base_source is not None else 0, passes)
