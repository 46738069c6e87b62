"""kimi-verify: slice a checkpoint, and prove a GGUF by reading and executing it.

\b
  kimi-verify slice HF_DIR OUT_DIR --layers 8          (or --layers 0-3,91-92)
  kimi-verify check HF_DIR FILE.gguf [--json report.json] [--imatrix F] [--max-kl X]
  kimi-verify check FILE.gguf                          (no checkpoint: the file on its own)
  kimi-verify check FILE.gguf --manifest M             (every byte against the writer's SHA-256 manifest)
  kimi-verify kld BASE QUANT.gguf -f text.txt          (llama-perplexity's KL divergence, layer by layer)

`check` exits 0 only if every part passes; docs/verification.md explains each part and
its tolerances.
"""
from __future__ import annotations

import json
import time
from contextlib import ExitStack, closing
from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape
from rich.table import Table

from .common import (check_count, check_input_file, console as err, debug_option, fail, human, interrupted,
                     interrupts_raise, output as out, reading, run_app, typer_app)
from ..errors import Interrupted, KimiError
from ..paths import Input, Report, refuse_overlap, report_output
from .kld import kld_cmd


app = typer_app(help=__doc__, no_args_is_help=True)     # out: the report (stdout); err: progress, errors
SHOW_FAILURES = 20
# Kimi-K3's context (max_position_embeddings); the ids alone take 8 bytes each before the runtime's RAM
# estimate (quadratic in the length) can refuse the run
MAX_LENGTH = 1 << 20


# --------------------------------------------------------------------------------------
# slice

@app.command("slice")
def slice_cmd(
    hf_dir: Path = typer.Argument(..., readable=False, help="full Kimi-K3 / K3.1-Pro checkpoint folder"),
    out_dir: Path = typer.Argument(..., readable=False, help="folder for the sliced checkpoint"),
    layers: str = typer.Option("8", "--layers", help="a count (default selection keeps every layer kind) "
                               "or 0-based layers and ranges, e.g. 0-3,91-92"),
    force: bool = typer.Option(False, "--force", help="overwrite a non-empty OUT_DIR"),
    _debug: bool = debug_option(),
):
    """Write a real N-layer checkpoint from a full one, streamed by byte ranges."""
    from ..memory import peak_rss
    from ..verify.slice import slice_checkpoint
    started, r = time.time(), None
    try:
        with interrupts_raise():            # SIGTERM and SIGHUP unwind through the slice's cleanup too
            reading(hf_dir)
            r = slice_checkpoint(hf_dir, out_dir, layers, force=force,
                                 log=lambda s: err.print(s, highlight=False, markup=False))
    except KimiError as e:
        fail(e)
    except Interrupted as e:
        interrupted(e, out_dir, started, r)
    c = r.config
    t = Table(title=f"{c.arch} slice: {len(r.layers)} layers -> {out_dir}")
    for col in ("layer", "from", "attention", "ffn"):
        t.add_column(col, justify="right" if col in ("layer", "from") else "left")
    for k, il in enumerate(r.layers):
        att = "MLA+DSA" if c.has_indexer(k) else "MLA" if c.is_mla(k) else "KDA"
        t.add_row(str(k), str(il), att, "MoE" if c.is_moe(k) else "dense")
    out.print(t)
    out.print(f"{r.n_tensors} tensors, {human(r.n_bytes)} in {len(r.shards)} shards "
              f"({r.shards[0]} ... {r.shards[-1]}); full_attn_layers {[i + 1 for i in c.full_attn_layers]}, "
              f"first_k_dense_replace {c.n_dense_layers}; dropped {r.dropped} vision/projector tensors; "
              f"copied {', '.join(r.copied_files) or 'no other files'}; peak RSS {human(peak_rss())}",
              highlight=False)


# --------------------------------------------------------------------------------------
# check

@app.command("check")
def check_cmd(
    paths: List[Path] = typer.Argument(..., readable=False, help="[HF_DIR] FILE.gguf (any part of a split file)"),
    json_file: Optional[Path] = typer.Option(None, "--json", readable=False, help="also write the full report as JSON"),
    length: int = typer.Option(32, "--length", help="tokens in the test sequence"),
    seed: int = typer.Option(0, "--seed", help="seed of the test sequence"),
    imatrix: Optional[Path] = typer.Option(None, "--imatrix", readable=False, help="the imatrix the file was "
                                           "quantized with (its quantized tensors are recomputed with it, byte for "
                                           "byte)"),
    max_kl: Optional[float] = typer.Option(None, "--max-kl", help="fail when the mean KL (nats) of the file's "
                                           "logits against the unquantized checkpoint's is above this"),
    manifest: Optional[Path] = typer.Option(None, "--manifest", metavar="M", readable=False, help="check FILE (or "
                                            "its whole split "
                                            "set) byte for byte against the manifest kimi-convert / kimi-quantize "
                                            "wrote beside it (OUT.gguf.manifest.json); needs no checkpoint"),
    force: bool = typer.Option(False, "--force", help="overwrite an existing --json report (never an input)"),
    _debug: bool = debug_option(),
):
    """Check FILE.gguf against HF_DIR (tensors, metadata, logits, K3.1 indexer, perplexity, quantization
    cost), or on its own (structure, tensors, metadata, forward pass), or against its manifest."""
    if manifest is not None:
        return check_against_manifest(paths, manifest, json_file, force,
                                      other=[f for f, v in (("--imatrix", imatrix), ("--max-kl", max_kl)) if v])
    from ..convert.checkpoint import checkpoint_inputs
    from ..gguf_io import gguf_inputs
    from ..verify.check import verify
    try:
        with ExitStack() as held:
            hf_dir, gguf = _split_args(paths)
            check_count(length, "--length", 2, MAX_LENGTH, "Kimi-K3's context")
            check_count(seed, "--seed", 0)
            reads = [*gguf_inputs(gguf), *(checkpoint_inputs(hf_dir) if hf_dir else []),
                     *([Input(imatrix, "imatrix")] if imatrix is not None else [])]
            report_file = _report(held, json_file, force, reads)      # before the work, not after it
            reading(gguf)
            report = verify(gguf, hf_dir, length=length, seed=seed, imatrix=imatrix, max_kl=max_kl,
                            log=lambda s: err.print(f"[dim]{s}[/]", highlight=False))
            print_report(report)
            if report_file is not None:
                report_file.deliver(json.dumps(report.to_dict(), indent=2) + "\n")
    except KimiError as e:
        fail(e)
    raise typer.Exit(0 if report.ok else 1)


def _report(held: ExitStack, json_file: Optional[Path], force: bool, reads: list) -> "Report | None":
    """The --json report, checked writable (and, a FIFO, opened) now, and never one of the files read."""
    if json_file is None:
        return None
    refuse_overlap(reads, [report_output(json_file)])
    return held.enter_context(closing(Report(json_file, force)))


def check_against_manifest(paths: List[Path], manifest: Path, json_file: Optional[Path], force: bool,
                           other: List[str]) -> None:
    """check --manifest: each difference on a line of its own, then one summary line; exit 1 on any."""
    from ..gguf_io import gguf_inputs
    from ..gguf_io.manifest import check_manifest
    try:
        with ExitStack() as held:
            if other:
                raise KimiError(f"{other[0]} does not apply to check --manifest (it compares bytes only)")
            if len(paths) != 1:
                raise KimiError("check --manifest takes one FILE.gguf (any part of a split set), and no checkpoint")
            report_file = _report(held, json_file, force, [*gguf_inputs(paths[0]), Input(manifest, "manifest")])
            reading(paths[0])
            result = check_manifest(paths[0], manifest)
            for d in result.differences:
                out.print(d.line(), highlight=False, markup=False, soft_wrap=True)
            out.print(result.summary(), highlight=False, markup=False, soft_wrap=True)
            if report_file is not None:
                report_file.deliver(json.dumps(result.to_json(), indent=2) + "\n")
    except KimiError as e:
        fail(e)
    raise typer.Exit(0 if result.ok else 1)


def _split_args(paths: List[Path]) -> tuple[Optional[Path], Path]:
    if len(paths) == 1:
        if paths[0].is_dir():
            raise KimiError(f"{paths[0]}: is a folder; give a GGUF file (and the checkpoint folder before it)")
        check_input_file(paths[0])
        return None, paths[0]
    if len(paths) == 2:
        a, b = paths
        hf, gguf = (a, b) if a.is_dir() or not b.is_dir() else (b, a)
        if not hf.is_dir():
            raise KimiError(f"{hf}: not a checkpoint folder")
        check_input_file(gguf)
        return hf, gguf
    raise KimiError("check takes FILE.gguf, or HF_DIR FILE.gguf")


def print_report(report) -> None:
    title = f"kimi-verify {Path(report.gguf).name}" + (f" against {report.hf_dir}" if report.hf_dir else "")
    t = Table(title=title)
    t.add_column("part")
    t.add_column("result")
    t.add_column("figures", overflow="fold")
    for p in report.parts:
        result = ("[green]PASS" if p.ok else "[red]FAIL" if p.ok is False
                  else "[cyan]info" if p.info else "[dim]n/a")
        t.add_row(p.title, result, escape(p.summary))
    out.print(t)
    tol = report.tolerance
    compared = any(p.key in ("logits", "perplexity") and p.ok is not None for p in report.parts)
    if tol and not compared:
        why = ("logits are compared only against a checkpoint (kimi-verify check HF_DIR FILE)"
               if report.hf_dir is None else "no logits were compared")
        out.print(f"file class {tol['file_class']}; no logits tolerance applies: {why}; "
                  f"{len(report.tokens)} tokens (seed-fixed)", highlight=False)
    elif tol:
        rule = (f"per position: max|Δ| <= {tol['logits_rtol']:g} x RMS(reference logits), "
                f"KL <= {tol['kl_max']:g}, same argmax")
        on = "; the reference runs on the file's dequantized weights" if tol["reference"] == "file" else ""
        out.print(f"tolerance class {tol['file_class']}, {rule}; routing margins < {tol['margin']:g} flagged"
                  f"{on}; {len(report.tokens)} tokens (seed-fixed)", highlight=False)
    for p in report.parts:
        if p.key == "k31" and p.rows:
            k = Table(title="K3.1 indexer")
            for col in ("check", "result", "figures"):
                k.add_column(col, overflow="fold")
            for r in p.rows:
                figs = ", ".join(f"{n} {_num(v)}" for n, v in r.items() if n not in ("check", "ok", "flagged"))
                k.add_row(escape(r["check"]), "[green]ok" if r["ok"] else "[red]FAIL", escape(figs))
            out.print(k)
        flagged = p.figures.get("flagged") if isinstance(p.figures, dict) else None
        if flagged:
            out.print(f"[yellow]{p.title}: {len(flagged)} position(s) with a near-tie routing choice, "
                      f"listed and not judged:[/]")
            for line in flagged:
                out.print(f"  {escape(line)}", highlight=False)
        if p.failures:
            out.print(f"[red]{p.title}: {len(p.failures)} failure(s)[/]")
            for line in p.failures[:SHOW_FAILURES]:
                out.print(f"  {escape(line)}", highlight=False, soft_wrap=True)
            if len(p.failures) > SHOW_FAILURES:
                out.print(f"  ... and {len(p.failures) - SHOW_FAILURES} more (see --json)")
    for note in report.notes:
        out.print(f"[yellow]{escape(note)}[/]", highlight=False, soft_wrap=True)
    out.print("[bold green]PASS" if report.ok else "[bold red]FAIL")


def _num(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


app.command("kld")(kld_cmd)          # kimi_convert/cli/kld.py


def main() -> None:
    run_app(app, "kimi-verify")
