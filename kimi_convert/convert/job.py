"""kimi-convert as a job: one frozen options object in; the checkpoint planned once (and, with --policy or a budget,
the one pass's quantization planned on it); then a dry run's preflight or the write. The command
(cli/convert.py) parses its options into ConvertOptions, runs the job and prints what it found."""
from __future__ import annotations

from contextlib import ExitStack, closing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..gguf_io import output_lock, written_paths
from ..paths import Report, refuse_overlap
from ..quant.options import PolicyOptions, quiet
from .converter import ConvertResult, Plan, Preflight, build_plan, convert, plan_policy, preflight, run_inputs

if TYPE_CHECKING:
    from ..quant.onepass import OnePass


@dataclass(frozen=True)
class ConvertOptions:
    hf_dir: Path
    out: Path
    quant: PolicyOptions = PolicyOptions()     # no --policy and no budget: a plain conversion
    outtype: str = "bf16"
    split_max_size: int = 0
    split_max_tensors: int = 0
    threads: int = 0                           # 0: every CPU
    force: bool = False
    resume: bool = False
    dry_run: bool = False


class ConvertJob:
    """open() reads the options' files and plans the checkpoint; quantize() plans the one pass (with a budget,
    choosing the types first); dry_run() checks what the run would; write() streams the output. `note` gets
    the lines a user should see, `reading(path)` each input as the job starts on it."""

    def __init__(self, opts: ConvertOptions, note: Callable[[str], None] = quiet,
                 reading: Callable[[object], None] = quiet):
        self.opts, self.note, self.reading = opts, note, reading
        self.one: "OnePass | None" = None
        self.choice = None
        self.policy = self.imatrix = None
        self.emitted: Report | None = None

    def open(self, held: ExitStack) -> "ConvertJob":
        o, q = self.opts, self.opts.quant
        q.check_given()
        if q.quantizes:                 # the policy's errors come before the checkpoint is read
            self.policy, self.imatrix = q.load(plan_only=o.dry_run, note=self.note, reading=self.reading)
        self.inputs = run_inputs(o.hf_dir, self.policy, self.imatrix)
        refuse_overlap(self.inputs, [*written_paths(o.out), *(q.target.outputs() if q.target else [])])
        if q.target is not None and q.target.emit_policy is not None:
            self.emitted = held.enter_context(closing(Report(q.target.emit_policy, o.force, "--emit-policy")))
        if not o.dry_run:               # a second run into OUT refuses before reading 96 shard headers
            held.enter_context(output_lock(o.out))
        self.reading(o.hf_dir)
        self.plan: Plan = build_plan(o.hf_dir, o.outtype, o.threads)
        return self

    def quantize(self) -> "OnePass | None":
        """With --policy or a budget: the one pass's decisions on this plan (a budget's choice first)."""
        q = self.opts.quant
        if not q.quantizes:
            return None
        policy = self.policy
        if q.target is not None:
            self.choice = self._choose()
            policy = self.choice.policy
        self.one = plan_policy(self.plan, policy, q.plan, imatrix=self.imatrix, threads=self.plan.threads)
        return self.one

    def dry_run(self) -> Preflight:
        """Every check the run makes, nothing written but --emit-policy's file: the run's preflight, whose disk
        room the caller judges (check_free_disk) after it has shown the plan."""
        o = self.opts
        if self.emitted:
            self.emitted.deliver(self.choice.text)
        return preflight(self.plan, o.out, split_max_tensors=o.split_max_tensors, split_max_size=o.split_max_size,
                         force=o.force, quant=self.one)

    @property
    def total_bytes(self) -> int:
        return self.plan.total_bytes if self.one is None else sum(self.one.sizes)

    def write(self, on_bytes: Callable[[int], None] = quiet) -> ConvertResult:
        o = self.opts
        result = convert(self.plan, o.out, split_max_tensors=o.split_max_tensors, split_max_size=o.split_max_size,
                         force=o.force, on_bytes=on_bytes, log=self.note, quant=self.one, resume=o.resume)
        if self.emitted:                # after OUT: a failed run leaves no policy of a file that is not there
            self.emitted.deliver(self.choice.text)
        return result

    def _choose(self):
        """--target-size in the one pass: kimi-quantize's choice for the converted file, its rows cut from the
        converter's own producers (quant.target.streamed)."""
        import numpy as np

        from ..quant.target.choose import check_decisions, choose_decided, expert_share
        from ..quant.target.measure import error_cache_dir
        from ..quant.target.streamed import producer_rows
        from .converter import producers, row_reader
        q, plan, imat = self.opts.quant, self.plan, self.imatrix
        base_plan = plan_policy(plan, self.policy, q.plan, imatrix=imat).plan
        weights = sum(int(np.prod(t.shape, dtype=np.int64)) for t in plan.tensors)
        decisions, budget_bytes = check_decisions(base_plan, weights, q.target.budget, imat,
                                                  gpu_budget=q.target.gpu_budget)
        rows = producer_rows(producers(plan), row_reader(plan))
        return choose_decided(decisions, budget_bytes, rows, self.policy, q.target.budget, imat,
                              gpu_budget=q.target.gpu_budget,
                              threads=plan.threads, cache_dir=error_cache_dir(), inputs=self.inputs,
                              source=str(q.target.emit_policy or "the chosen policy"), note=self.note,
                              expert_share=expert_share(plan.config), sensitivity=q.target.prior())
