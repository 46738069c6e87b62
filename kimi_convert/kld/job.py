"""kimi-verify kld as a job: llama-perplexity's KL divergence of a file against a base, on the streamed engine.

  BASE (checkpoint or GGUF) QUANT   the base runs first into a base file (a temporary one unless --save-base),
                                    then QUANT is scored against it: llama-perplexity's two runs, in one command
  BASE --save-base F                only the base file (llama-perplexity --kl-divergence-base F)
  F (a base file) QUANT             QUANT against a saved base (ours or llama-perplexity's)

Each model runs layer by layer (kimi_convert/engine: one layer's weights at a time, every token through it, the
tokens' states kept, spilled to disk beyond the RAM budget); then each chunk's final hidden states give its
logits, and only the scored half of each chunk (basefile.scored_positions) is turned into log-probabilities. So
neither model is ever resident, and the logits of one chunk are the largest new array (ctx/2 x n_vocab floats).
Tokens: engine/tokens.py, as llama-perplexity cuts them (add_special, BOS in place of each chunk's first token).
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from .basefile import BaseFile, BaseFileError, BaseHeader, BaseWriter, compress, is_base_file, scored_positions
from .stats import KldStats, ppl_estimate
from ..engine.forward import Engine, LayerReport
from ..engine.states import TokenStates
from ..engine.tokens import TextInputError, chunk_tokens, model_tokenizer, text_tokens
from ..engine.weights import WeightSource, open_source
from ..errors import KimiError
from ..memory import peak_rss
from ..imatrix.plan import ATTN_SLAB_BYTES, default_state_ram
from ..paths import Input, Output, refuse_overlap

MIN_CTX = 8
MAX_SLAB_TOKENS = 8192
TOOL = "llama-perplexity"


class KldInputError(KimiError):
    """Two files that cannot be compared (other models, vocabularies, ctx), or a model whose logits are not finite."""


@dataclass(frozen=True)
class KldOptions:
    base: Path
    quant: Path | None = None
    text: Path | None = None
    ctx: int | None = None                  # None: 512, or the base file's
    chunks: int | None = None
    device: str = "cpu"
    save_base: Path | None = None
    force: bool = False
    state_ram: int | None = None


@dataclass
class PassReport:
    """One model's pass: what it read and how long it took."""
    model: Path
    seconds: float
    bytes_read: int


@dataclass
class KldResult:
    chunks: int
    ctx: int
    summary: dict | None                    # KldStats.summary() when a QUANT was scored
    stats: KldStats | None                  # and the per-token values behind it
    base_ppl: tuple[float, float] | None    # the base pass's "Final estimate" (PPL, +/-)
    passes: list[PassReport]
    seconds: float
    peak_rss: int


def model_signature(source: WeightSource) -> dict:
    c = source.config
    return {"arch": c.arch, "n_layer": c.n_layer, "n_embd": c.n_embd, "n_vocab": c.n_vocab, "n_head": c.n_head,
            "n_expert": c.n_expert}


class KldRun:
    def __init__(self, opts: KldOptions, log: Callable[[str], None] = lambda s: None):
        self.opts, self.log = opts, log
        self.base_file = BaseFile(opts.base) if is_base_file(opts.base) else None
        self.base_source = None if self.base_file else open_source(opts.base)
        self.quant_source = open_source(opts.quant) if opts.quant else None
        if self.base_file is None and opts.text is None:
            raise KldInputError(f"{opts.base}: a model as BASE needs the text (-f)")
        if self.quant_source is None and opts.save_base is None:
            raise KldInputError("nothing to do: give QUANT.gguf, or --save-base F to write the base file")
        self._check_same_model()
        self.ids, self.tokens = self._tokens()
        self.ctx = self.ids.shape[1]

    # --- inputs ---
    def _check_same_model(self) -> None:
        if self.quant_source is None:
            return
        q = model_signature(self.quant_source)
        if self.base_file is not None:
            if self.base_file.header.n_vocab != q["n_vocab"]:
                raise KldInputError(f"{self.opts.quant}: vocabulary of {q['n_vocab']:,} tokens, but the base file "
                                    f"{self.opts.base} has {self.base_file.header.n_vocab:,} (another model)")
            return
        b = model_signature(self.base_source)
        if b != q:
            diff = ", ".join(f"{k} {b[k]} vs {q[k]}" for k in b if b[k] != q[k])
            raise KldInputError(f"{self.opts.quant}: not a file of the model {self.opts.base} ({diff})")
        tb, tq = model_tokenizer(self.opts.base), model_tokenizer(self.opts.quant)
        if tb.tokens != tq.tokens:
            raise KldInputError(f"{self.opts.quant}: its vocabulary differs from {self.opts.base}'s")

    def _tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """(the ids the model runs [chunks, ctx], BOS put in; the tokens as stored in a base file)."""
        opts = self.opts
        if self.base_file is not None:
            h = self.base_file.header
            if opts.ctx is not None and opts.ctx != h.n_ctx:
                raise KldInputError(f"{opts.base}: a base file of ctx {h.n_ctx}, but --ctx {opts.ctx} was given")
            n = h.n_chunk if opts.chunks is None else min(opts.chunks, h.n_chunk)
            stored = np.array(self.base_file.tokens[:n], np.int64)
            if stored.min() < 0 or stored.max() >= h.n_vocab:
                raise BaseFileError(f"{opts.base}: a token id outside the vocabulary of {h.n_vocab:,}")
            tokenizer = model_tokenizer(opts.quant)
        else:
            ctx = opts.ctx or 512
            if ctx < MIN_CTX:
                raise KldInputError(f"--ctx {ctx}: give at least {MIN_CTX} (half of each chunk is scored)")
            tokenizer = model_tokenizer(opts.base)
            stored = chunk_tokens(text_tokens(opts.text, tokenizer), ctx, opts.chunks, None, opts.text, TOOL)
        ids = stored.copy()
        if tokenizer.add_bos:
            ids[:, 0] = tokenizer.bos_id
        return ids, stored

    @property
    def n_chunks(self) -> int:
        return self.ids.shape[0]

    def inputs(self) -> list[Input]:
        reads = [Input(self.opts.text, "evaluation text")] if self.opts.text else []
        for path in (self.opts.base, self.opts.quant):
            if path is None:
                continue
            if Path(path).is_dir():
                from ..convert.checkpoint import checkpoint_inputs
                reads += checkpoint_inputs(Path(path))
            elif is_base_file(path):
                reads.append(Input(Path(path), "base file"))
            else:
                from ..gguf_io import gguf_inputs
                reads += gguf_inputs(Path(path))
        return reads

    def outputs(self) -> list[Output]:
        outs = [Output(self.work_dir(), "the work folder", "folder")]
        if self.opts.save_base:
            outs.append(Output(self.opts.save_base, "the base file"))
        return outs

    def work_dir(self) -> Path:
        anchor = Path(self.opts.save_base or self.opts.quant)
        return anchor.parent / f".{anchor.name}.kld-work"

    def slab_tokens(self, source: WeightSource) -> int:
        per_chunk = source.config.n_head * self.ctx * self.ctx * 12
        return max(1, min(ATTN_SLAB_BYTES // per_chunk, MAX_SLAB_TOKENS // self.ctx)) * self.ctx

    # --- the run ---
    def run(self, on_layer: Callable[[str, LayerReport], None] = lambda which, r: None,
            on_chunk: Callable[[str], None] = lambda line: None) -> KldResult:
        opts = self.opts
        refuse_overlap(self.inputs(), self.outputs())
        if opts.save_base and opts.save_base.exists() and not opts.force:
            raise KldInputError(f"{opts.save_base}: already exists (use --force to overwrite)")
        started, passes, work = time.time(), [], self.work_dir()
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        try:
            base_file, base_ppl = self.base_file, None
            if base_file is None:                 # into the work folder: --save-base gets it when all succeeded
                base_ppl = self._base_pass(work / "base.kld", work, passes, on_layer)
                base_file = BaseFile(work / "base.kld")
            stats = self._quant_pass(base_file, work, passes, on_layer, on_chunk) if self.quant_source else None
            if opts.save_base:
                os.replace(work / "base.kld", opts.save_base)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return KldResult(self.n_chunks, self.ctx, stats.summary() if stats else None, stats, base_ppl, passes,
                         time.time() - started, peak_rss())

    def _logits(self, source: WeightSource, which: str, work: Path, on_layer) -> Iterator[tuple[int, np.ndarray]]:
        """Each chunk's scored logits [ctx - 1 - ctx/2, n_vocab] (float32), the model run layer by layer first."""
        opts = self.opts
        budget = opts.state_ram if opts.state_ram is not None else default_state_ram()
        spill = work / which
        spill.mkdir()
        states = TokenStates(self.n_chunks, self.ctx, source.config.n_embd, ram_budget=budget, spill_dir=spill)
        engine = Engine(source, torch.device(opts.device), None, self.slab_tokens(source))
        engine.run(self.ids, states, lambda r: on_layer(which, r))
        head, scored = engine.head(), scored_positions(self.ctx)
        for c in range(self.n_chunks):
            h = engine.final_hidden(states, slice(c * self.ctx, (c + 1) * self.ctx), head)[scored]
            logits = engine.logits(h, head).cpu().numpy()
            if not np.isfinite(logits).all():
                bad = int(np.argwhere(~np.isfinite(logits))[0][0]) + c * self.ctx + scored.start
                raise KldInputError(f"{source.path}: non-finite logits (inf or NaN) at token {bad} of chunk {c + 1}: "
                                    f"the file's weights do not compute")
            yield c, logits
        head.drop()
        del states

    def _base_pass(self, path: Path, work: Path, passes: list, on_layer) -> tuple[float, float]:
        source, t0, before = self.base_source, time.time(), self.base_source.bytes_read
        writer = BaseWriter(path, BaseHeader(self.ctx, source.config.n_vocab, self.n_chunks), self.tokens)
        nll = nll2 = 0.0
        count, targets = 0, self._targets()
        try:
            for c, logits in self._logits(source, "base", work, on_layer):
                rows = compress(logits)
                writer.add(rows)
                idx = np.arange(len(logits))
                lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, dtype=np.float64)).astype(np.float32)
                v = (logits.max(1) + lse - logits[idx, targets[c]]).astype(np.float64)
                nll, nll2, count = nll + v.sum(), nll2 + (v * v).sum(), count + len(v)
            writer.finish()
        except BaseException:
            writer.abort()
            raise
        passes.append(PassReport(self.opts.base, time.time() - t0, source.bytes_read - before))
        return ppl_estimate(nll, nll2, count)

    def _quant_pass(self, base: BaseFile, work: Path, passes: list, on_layer, on_chunk) -> KldStats:
        source, t0, before = self.quant_source, time.time(), self.quant_source.bytes_read
        stats, targets = KldStats(), self._targets()
        for c, logits in self._logits(source, "quant", work, on_layer):
            stats.add(logits, base.rows(c), targets[c])
            on_chunk(stats.chunk_line(c + 1))
        passes.append(PassReport(self.opts.quant, time.time() - t0, source.bytes_read - before))
        return stats

    def _targets(self) -> np.ndarray:
        """[chunks, scored]: the token each scored position predicts (the stored tokens, not the BOS put in)."""
        s = scored_positions(self.ctx)
        return self.tokens[:, s.start + 1:s.stop + 1]
