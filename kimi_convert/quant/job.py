"""kimi-quantize as a job: one frozen options object in; the input opened and planned once; then a dry run's
reports or the write. The command (cli/quantize.py) parses its options into QuantizeOptions, runs the job and
prints what it found."""
from __future__ import annotations

import json
from contextlib import ExitStack, closing
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable

from ..errors import KimiError
from ..gguf_io import open_gguf, output_lock, written_paths
from ..paths import Input, Report, refuse_overlap, report_output
from .driver import QuantizeResult, plan_file, run_inputs, write_plan
from .options import PolicyOptions, quiet
from .plan import QuantPlan

SENSITIVITY_CTX = 128          # --sensitivity kld's chunks: the trained fixture's context, a few thousand tokens


@dataclass(frozen=True)
class SensitivityOptions:
    """--sensitivity kld: the text its tokens come from, how many chunks of SENSITIVITY_CTX, and how many layers
    of each kind are measured (quant.target.sensitivity.sampled_layers; 0: every layer)."""
    text: Path
    chunks: int = 16
    layers_per_kind: int = 4


@dataclass(frozen=True)
class QuantizeOptions:
    src: Path
    out: Path | None                   # None: a plan only (--dry-run, --explain)
    quant: PolicyOptions
    sensitivity: SensitivityOptions | None = None
    threads: int = 0                   # 0: every CPU
    force: bool = False
    resume: bool = False
    keep_split: bool = False
    split_max_size: int = 0
    json_file: Path | None = None      # --json: the plan as JSON, beside the output (or alone with a plan only)
    plan_only: bool = False

    def outputs(self) -> list:
        """Every path the job writes: OUT (and its parts, manifest, lock, partial folder), --json, --emit-policy."""
        target = self.quant.target
        return [*(written_paths(self.out) if self.out is not None else []),
                *([report_output(self.json_file)] if self.json_file else []),
                *(target.outputs() if target else [])]


class QuantizeJob:
    """open() reads the options' files and the input's header, choose() spends a budget, `plan` decides every
    tensor, write() streams the output. `note` gets the lines a user should see; `reading(path)` is told each
    file as the job starts on it (error messages name it)."""

    def __init__(self, opts: QuantizeOptions, note: Callable[[str], None] = quiet,
                 reading: Callable[[object], None] = quiet):
        self.opts, self.note, self.reading = opts, note, reading
        self.choice = None
        self.report: Report | None = None
        self.emitted: Report | None = None

    def open(self, held: ExitStack) -> "QuantizeJob":
        """Policy and imatrix read, no output over an input, the reports and (to write) the output's lock taken,
        the input's header read: everything checked before any tensor is."""
        o = self.opts
        self.policy, self.imatrix = o.quant.load(plan_only=o.plan_only, note=self.note, reading=self.reading)
        self.inputs = run_inputs(o.src, self.policy, self.imatrix) + (
            [Input(o.sensitivity.text, "--sensitivity-text")] if o.sensitivity else [])
        refuse_overlap(self.inputs, o.outputs())
        if o.json_file is not None:
            self.report = held.enter_context(closing(Report(o.json_file, o.force)))
        target = o.quant.target
        if target is not None and target.emit_policy is not None:
            self.emitted = held.enter_context(closing(Report(target.emit_policy, o.force, "--emit-policy")))
        if not o.plan_only:            # a second run into OUT refuses before reading IN
            held.enter_context(output_lock(o.out))
        self.reading(o.src)
        self.gf = open_gguf(o.src)
        return self

    def choose(self):
        """With a budget: the chosen types (quant.target.choose), which become the policy; else None."""
        target, q = self.opts.quant.target, self.opts.quant
        if target is None:
            return None
        from ..cores import threads_or_all
        from .target.choose import choose
        from .target.measure import error_cache_dir
        self.choice = choose(self.gf, self.policy, target.budget, self.imatrix, q.plan,
                             gpu_budget=target.gpu_budget, threads=threads_or_all(self.opts.threads),
                             cache_dir=error_cache_dir(), inputs=self.inputs,
                             source=str(target.emit_policy or "the chosen policy"), note=self.note,
                             sensitivity=self._sensitivity() or target.prior())
        self.policy = self.choice.policy
        return self.choice

    @cached_property
    def plan(self) -> QuantPlan:
        return plan_file(self.gf, self.policy, self.opts.quant.plan, imatrix=self.imatrix is not None)

    def json_report(self) -> str:
        """The --json report: the plan, every tensor's decision."""
        plan, pol = self.plan, self.policy
        rows = [{"tensor": d.name, "shape": list(d.shape), "from": d.source.name, "to": d.target.name,
                 "bytes": d.target_bytes, "why": d.why, "protection": d.protection.kind if d.protection else None}
                for d in plan.decisions]
        report = {"policy": pol.source, "input_bytes": plan.source_bytes, "output_bytes": plan.target_bytes,
                  "tensors": rows, "conflicts": [c.describe() for c in plan.conflicts], "warnings": plan.warnings}
        return json.dumps(report, indent=2) + "\n"

    def reports(self) -> list[tuple[Report, str]]:
        """(report, its text) of --json and --emit-policy."""
        return [*([(self.report, self.json_report())] if self.report else []),
                *([(self.emitted, self.choice.text)] if self.emitted else [])]

    def deliver_reports(self) -> None:
        """A plan only: the reports written now (a write renames them into place with its output)."""
        for report, text in self.reports():
            report.deliver(text)

    def write(self, on_bytes: Callable[[int], None] = quiet) -> QuantizeResult:
        o = self.opts
        return write_plan(self.gf, self.plan, o.out, self.policy, imatrix=self.imatrix, force=o.force,
                          split_max_size=o.split_max_size, keep_split=o.keep_split, threads=o.threads,
                          on_bytes=on_bytes, log=self.note, resume=o.resume, reports=self.reports())

    def _sensitivity(self):
        """--sensitivity kld's costs (quant.target.sensitivity, on the streamed engine: torch), or None."""
        s = self.opts.sensitivity
        if s is None:
            return None
        try:
            import torch  # noqa: F401
        except ImportError:
            raise KimiError("--sensitivity kld runs the model on torch: pip install 'kimi-convert[engine]'") from None
        from ..engine.tokens import chunk_tokens, model_tokenizer, text_tokens
        from .target.sensitivity import KldCosts, Sensitivity, sensitivity_cache_dir
        self.reading(s.text)
        tok = model_tokenizer(self.opts.src)
        ids = chunk_tokens(text_tokens(s.text, tok), SENSITIVITY_CTX, s.chunks, tok.bos_id if tok.add_bos else None,
                           s.text, "--sensitivity kld")
        sens = Sensitivity(self.opts.src, ids, self.imatrix, cache_dir=sensitivity_cache_dir(), note=self.note)
        return KldCosts(sens, s.text, self.note, s.layers_per_kind)
