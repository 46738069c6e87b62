"""kimi-imatrix as a job: plan, dry run, run (with --resume), write. The command (cli/imatrix.py) is a thin layer.

The run is llama-imatrix's, computed layer by layer on the streamed engine (kimi_convert/engine):
- tokens: the text tokenized as llama.cpp tokenizes it for the model (kimi_convert/tokenizer.py), at least two
  chunks of --ctx tokens, cut into `len // ctx` consecutive chunks (--chunks takes the first N), the first token
  of each chunk replaced by BOS when the vocabulary adds one (tools/imatrix/imatrix.cpp `compute_imatrix`);
- statistics: collect.py; the file: files.py.

Resume: after each layer, its sums, the stream P and any new AttnRes bank are saved in a work folder beside the
output (`.OUT.imatrix-work`), and `progress.json` (written last, renamed into place) says which layer is done.
`--resume` continues after it when the run is the same (model, text, ctx, chunks, options: `identity`). The
folder is removed when the file is written, and on any error but an interruption after a finished layer (which
`--resume` can then take up); a run without --resume removes an earlier one's folder.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .collect import Entry, ImatrixStats
from .files import DAT, GGUF, add_in_files, write_dat, write_gguf
from .plan import ATTN_SLAB_BYTES, default_state_ram
from ..engine.forward import Engine, LayerReport
from ..engine.states import TokenStates
from ..engine.tokens import TextInputError, chunk_tokens, model_tokenizer, text_tokens
from ..engine.weights import open_source
from ..errors import DiskSpaceError, Interrupted, OutputError
from ..memory import peak_rss
from ..paths import Input, Output, refuse_overlap
from ..quant.imatrix import ImatrixError

MIN_CTX = 16                   # imatrix.cpp ignores products of fewer rows (collect.MIN_ROWS)
MAX_SLAB_TOKENS = 8192         # tokens of one attention slab: the dense products' batch


# the errors of a run's inputs are the engine's (text, tokens); the name stays for callers of kimi-imatrix
ImatrixInputError = TextInputError


@dataclass(frozen=True)
class ImatrixOptions:
    model: Path
    text: Path
    out: Path | None
    ctx: int = 512
    chunks: int | None = None
    device: str = "cpu"
    output_format: str = GGUF
    in_files: tuple[Path, ...] = ()
    process_output: bool = False
    resume: bool = False
    force: bool = False
    state_ram: int | None = None          # bytes of token states kept in RAM before they spill (None: auto)


@dataclass
class Coverage:
    """Per MoE layer: how many experts saw tokens, and the least-routed one's share of the layer's pairs."""
    layer: int
    experts_seen: int
    experts: int
    least_share: float

    def line(self) -> str:
        return (f"layer {self.layer}: {self.experts_seen}/{self.experts} experts saw tokens, least routed "
                f"{self.least_share:.3%} of the (token, expert) pairs")


@dataclass
class ImatrixResult:
    tokens: int
    chunks: int
    seconds: float
    bytes_read: int
    peak_rss: int
    coverage: list[Coverage] = field(default_factory=list)
    entries: int = 0


def identity(opts: ImatrixOptions, ids: np.ndarray) -> dict:
    """What makes two runs the same run (for --resume)."""
    st = Path(opts.model).stat()
    return {"model": str(Path(opts.model).resolve()), "model_mtime": st.st_mtime_ns,
            "tokens": hashlib.sha256(ids.tobytes()).hexdigest(), "ctx": opts.ctx,
            "process_output": opts.process_output, "version": 1}


def work_dir(out: Path) -> Path:
    return out.parent / f".{out.name}.imatrix-work"


class ImatrixRun:
    def __init__(self, opts: ImatrixOptions, log: Callable[[str], None] = lambda s: None):
        self.opts, self.log = opts, log
        self.source = open_source(opts.model)
        self.cfg = self.source.config
        if opts.ctx < MIN_CTX:
            raise ImatrixInputError(f"--ctx {opts.ctx}: llama-imatrix ignores products of fewer than {MIN_CTX} "
                                    f"tokens; give at least {MIN_CTX}")
        self.ids = chunk_tokens(self._tokenize(), opts.ctx, opts.chunks, self._bos(), opts.text)

    def _tokenize(self) -> np.ndarray:
        self.tokenizer = model_tokenizer(self.opts.model)
        return text_tokens(self.opts.text, self.tokenizer)

    def _bos(self) -> int | None:
        return self.tokenizer.bos_id if self.tokenizer.add_bos else None

    def slab_tokens(self) -> int:
        """Whole chunks per attention slab, so that its T x T scores (and two temporaries) fit ATTN_SLAB_BYTES."""
        per_chunk = self.cfg.n_head * self.opts.ctx * self.opts.ctx * 12
        return max(1, min(ATTN_SLAB_BYTES // per_chunk, MAX_SLAB_TOKENS // self.opts.ctx)) * self.opts.ctx

    @property
    def n_chunks(self) -> int:
        return self.ids.shape[0]

    @property
    def n_tokens(self) -> int:
        return self.ids.size

    # --- the files it reads and writes ---
    def inputs(self) -> list[Input]:
        model = Path(self.opts.model)
        reads = [Input(self.opts.text, "calibration text"), *(Input(p, "--in-file imatrix") for p in self.opts.in_files)]
        if model.is_dir():
            from ..convert.checkpoint import checkpoint_inputs
            return reads + checkpoint_inputs(model)
        from ..gguf_io import gguf_inputs
        return reads + gguf_inputs(model)

    def outputs(self) -> list[Output]:
        out = self.opts.out
        return [Output(out, "the imatrix"), Output(work_dir(out), "the resume folder", "folder")]

    # --- the run ---
    def run(self, on_layer: Callable[[LayerReport, float], None] = lambda r, eta: None) -> ImatrixResult:
        opts, cfg = self.opts, self.cfg
        refuse_overlap(self.inputs(), self.outputs())
        if opts.out.exists() and not opts.force:
            raise ImatrixInputError(f"{opts.out}: already exists (use --force to overwrite)")
        started = time.time()
        work = work_dir(opts.out)
        budget = opts.state_ram if opts.state_ram is not None else default_state_ram()
        states = TokenStates(self.n_chunks, opts.ctx, cfg.n_embd, ram_budget=budget, spill_dir=work)
        stats = ImatrixStats(cfg.n_expert, opts.process_output)
        engine = Engine(self.source, torch.device(opts.device), stats, self.slab_tokens())
        start, entries = self._prepare(work, states)
        coverage = [c for c in (self._coverage(il, entries) for il in range(start)) if c]
        finished = [start]

        def layer_done(report: LayerReport) -> None:
            il = report.layer
            layer_entries = self._checked(stats.take_layer(il))
            entries.update(layer_entries)
            self._save(work, il, layer_entries, states)
            finished[0] = il + 1
            cov = self._coverage(il, layer_entries)
            if cov:
                coverage.append(cov)
            on_layer(report, (time.time() - started) / (il + 1 - start) * (cfg.n_layer - il - 1))
        try:
            engine.run(self.ids, states, layer_done, start)
            if opts.process_output:
                for rows in states.slabs(4096):
                    stats.dense("output.weight", engine.final_hidden(states, rows))
                entries |= self._checked(stats.take())
            self._write(entries)
        except Interrupted:
            if finished[0] == start:
                shutil.rmtree(work, ignore_errors=True)
            raise
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        shutil.rmtree(work, ignore_errors=True)
        return ImatrixResult(self.n_tokens, self.n_chunks, time.time() - started, self.source.bytes_read,
                             peak_rss(), coverage, len(entries))

    def _checked(self, entries: dict[str, Entry]) -> dict[str, Entry]:
        """llama-imatrix stops on a non-finite sum: so do we, naming the tensor."""
        for name, e in entries.items():
            if not np.isfinite(e.sums).all():
                raise ImatrixInputError(f"{self.opts.model}: {name}: non-finite activations (the model's weights "
                                        f"give inf or NaN on this text)")
        return {n: Entry(e.sums.astype(np.float32), e.counts) for n, e in entries.items()}

    def _coverage(self, il: int, entries: dict[str, Entry]) -> Coverage | None:
        name = f"blk.{il}.ffn_gate_exps.weight"
        if name not in entries:
            return None
        counts = entries[name].counts
        return Coverage(il, int((counts > 0).sum()), counts.size, float(counts.min() / max(counts.sum(), 1)))

    # --- resume ---
    def _prepare(self, work: Path, states: TokenStates) -> tuple[int, dict[str, Entry]]:
        ident = identity(self.opts, self.ids)
        progress = work / "progress.json"
        if self.opts.resume and progress.is_file():
            saved = json.loads(progress.read_text())
            if saved.get("identity") == ident:
                done = int(saved["done"])
                states.load(work)
                entries = {}
                for il in range(done):
                    with np.load(work / f"layer{il}.npz") as z:
                        for key in z.files:
                            if key.endswith(".sums"):
                                n = key[:-5]
                                entries[n] = Entry(z[key], z[n + ".counts"])
                self.log(f"resuming after layer {done - 1} of {self.cfg.n_layer} ({work})")
                return done, entries
            self.log(f"{work}: an earlier run of another model, text or --ctx; starting over")
        elif work.exists() and not self.opts.resume:
            self.log(f"removing an earlier interrupted run's folder {work} (--resume would have continued it)")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        (work / "identity.json").write_text(json.dumps(ident))
        return 0, {}

    def _save(self, work: Path, il: int, entries: dict[str, Entry], states: TokenStates) -> None:
        try:
            self._save_layer(work, il, entries, states)
        except OSError as e:
            error = DiskSpaceError if e.errno in (errno.ENOSPC, errno.EDQUOT) else OutputError
            raise error(f"{work}: cannot save layer {il}'s sums and states for --resume "
                        f"({e.strerror or e})") from None

    def _save_layer(self, work: Path, il: int, entries: dict[str, Entry], states: TokenStates) -> None:
        arrays = {}
        for n, e in entries.items():
            arrays[n + ".sums"], arrays[n + ".counts"] = e.sums, e.counts
        tmp = work / f".layer{il}.npz"
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, work / f"layer{il}.npz")
        states.save(work)
        tmp = work / ".progress.json"
        tmp.write_text(json.dumps({"identity": identity(self.opts, self.ids), "done": il + 1}))
        os.replace(tmp, work / "progress.json")

    # --- the file ---
    def _write(self, entries: dict[str, Entry]) -> None:
        opts = self.opts
        datasets = add_in_files(entries, opts.in_files, opts.ctx) if opts.in_files else []
        self._check_in_file_names(entries)
        reads = self.inputs()
        if opts.output_format == DAT:
            last = str(opts.text)
            write_dat(opts.out, entries, dataset=last, chunk_size=opts.ctx, force=opts.force, reads=reads)
        else:
            write_gguf(opts.out, entries, datasets=[*datasets, str(opts.text)], chunk_size=opts.ctx,
                       force=opts.force, reads=reads, log=self.log)

    def _check_in_file_names(self, entries: dict[str, Entry]) -> None:
        names = self.source.names()
        for n in entries:
            if n not in names:
                raise ImatrixError(f"--in-file: entry {n} is not a tensor of {self.opts.model} (an imatrix of "
                                   f"another model?)")
