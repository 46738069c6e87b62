"""Prove a GGUF by reading and executing it: `kimi-verify check`.

With the HF checkpoint (`verify(gguf, hf_dir)`), seven parts, each pass/fail with figures:

  structure   the file(s) parse; tensor data aligned, inside the file, packed in order (as llama.cpp requires)
  tensors     every GGUF tensor against its HF source through the plan's transform:
              bit-exact for float and MXFP4 tensors; a quantized one must be, byte for byte,
              our quantization (quant.blocks, with the imatrix) of the values the converter
              writes (a type without a quantizer here is not checked, n/a with the reason, and
              listed in the report's notes); nothing missing, nothing extra
  metadata    every architecture key (value and GGUF type) against
              KimiConfig.gguf_metadata() of the checkpoint's config, plus the vocabulary, and every
              special-token id against the id config.json names (vocab.checkpoint_specials)
  logits      runtime (GGUF) vs reference (HF) on a fixed token sequence: max |diff|,
              argmax agreement, KL, within the file class's tolerances; positions whose
              MoE / DSA routing margin is below tolerance are listed and excluded. For a
              quantized file the reference runs on the file's dequantized weights
  k31 indexer top_k >= length is bit-identical to dense MLA (runtime and reference), and
              top_k below the length diverges (KL reported) while matching the reference
  perplexity  of runtime and reference on the sequence, and their ratio
  cost        what quantization costs: KL and perplexity ratio of the file's logits against
              the reference on the checkpoint as is (information; a gate with max_kl)

Without a checkpoint (`verify(gguf)`): structure; every tensor the architecture implies
(from KimiConfig.from_gguf and tensor_map's table) present with its shape and an allowed
type, no extra, valid blocks (as ggml_validate_row_data) and finite values; metadata keys
with the types llama.cpp reads, special-token ids naming Kimi-K3's tokens (vocab.k3_specials);
a forward pass without NaN; and the runtime-only half of the k31 part.

Files llama.cpp writes pass as ours do: shapes are compared up to leading 1s (trailing ggml
1-dims, which llama-quantize's headers leave out), and each key may have any type llama.cpp's
loader reads it as (per-layer arrays: INT32, UINT32 or BOOL).

Tolerances and their reasons: docs/verification.md. A part that raises is a failed part
(the error is its message); only an unreadable checkpoint aborts the whole run. The reference
needs torch (`pip install 'kimi-convert[verify]'`); without it the parts that need it are n/a,
not failures.

The parts live in modules of one concern each: report (tolerances, Part, Report), logits (the token sequence,
KL, perplexity, routing flags), structure, tensors (against the checkpoint, quantized ones byte for byte),
weights (the file's weights for the reference), metadata, lone (a GGUF without its checkpoint) and runs (the
execution parts); this module is the entry point, `verify`.
"""
from __future__ import annotations

import os
from dataclasses import asdict
from importlib import import_module
from pathlib import Path
from typing import Callable

from ..convert.converter import _text_config
from ..convert.vocab import checkpoint_specials
from ..errors import KimiError
from ..gguf_io import GGUFFile, open_gguf
from ..model import KimiConfig
from ..quant.imatrix import Imatrix, load_imatrix
from .logits import token_sequence
from .lone import check_lone_metadata, check_lone_tensors
from .metadata import check_metadata
from .report import FILE, SEED, SEQ_LEN, TOLERANCES, Part, Report, Tolerance, _run, file_class
from .runs import _Runs, check_cost, check_forward, check_k31, check_logits, check_perplexity
from .structure import check_structure
from .tensors import check_tensors, unchecked_note
from .weights import file_weights
# the names the tests and benchmarks import from here, as before the parts had modules of their own
from .logits import compare_logits, kl_div, perplexity, perplexity_ratio, routing_flags  # noqa: F401,E402
from .report import DIVERGENCE_MIN  # noqa: F401,E402


# ------------------------------------------------------------------------------------
# entry point

TORCH_HINT = "the torch reference needs torch: pip install 'kimi-convert[verify]' (torch==2.13.0, CPU)"


def reference_unavailable() -> str | None:
    """Why the torch reference cannot run here (torch is an optional extra), or None."""
    try:
        import_module("..runtime.reference", __package__)
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != "torch":
            raise
        return TORCH_HINT
    return None


def verify(gguf_path: Path, hf_dir: Path | None = None, *, length: int = SEQ_LEN, seed: int = SEED,
           imatrix: Imatrix | str | os.PathLike | None = None, max_kl: float | None = None,
           log: Callable[[str], None] = lambda s: None) -> Report:
    """Check `gguf_path` (any part of a split file) against `hf_dir`, or on its own.

    imatrix: the importance matrix the file was quantized with (a path, or quant.imatrix.load_imatrix's
    result), for the byte comparison of its quantized tensors; max_kl: fail when the mean KL of the file's
    logits against the checkpoint's is above it. Both need hf_dir."""
    gguf_path = Path(gguf_path)
    if not gguf_path.exists():
        raise KimiError(f"{gguf_path}: not found")
    if length < 2:
        raise KimiError(f"--length {length}: need at least 2 tokens")
    for given, what in ((imatrix, "--imatrix"), (max_kl, "--max-kl")):
        if given is not None and hf_dir is None:
            raise KimiError(f"{what} needs the checkpoint: kimi-verify check HF_DIR {gguf_path} {what} ...")
    if max_kl is not None and not max_kl >= 0:
        raise KimiError(f"--max-kl {max_kl}: must be a number >= 0 (nats)")
    if imatrix is not None and not isinstance(imatrix, Imatrix):
        imatrix = load_imatrix(imatrix)                 # a bad imatrix is the user's error: raises
    plan = None
    if hf_dir is not None:
        from ..convert.converter import build_plan
        plan = build_plan(Path(hf_dir), "f32")         # a bad checkpoint is the user's error: raises
    hf = str(hf_dir) if hf_dir is not None else None
    structure = _run(Part("structure", "structure"), lambda p: check_structure(p, gguf_path))
    try:
        gf = open_gguf(gguf_path)
    except KimiError as e:                              # already named by the structure part, as a rule
        if str(e) not in structure.failures:
            structure.fail(str(e))
            structure.summary = "not readable as one GGUF file"
        structure.ok = False
        return Report(str(gguf_path), hf, [], {}, [structure])

    tol = TOLERANCES[file_class(gf)]
    ids: list[int] = []
    try:
        ids = token_sequence(gf, length, seed, tuple(plan.config.extra.values()) if plan is not None else ())
    except Exception as e:                              # noqa: BLE001
        structure.fail(f"no token sequence: {e}")
        structure.ok = False
    report = Report(str(gguf_path), hf, ids, asdict(tol), [structure])
    if plan is not None:
        report.parts += _checkpoint_parts(report, gf, plan, Path(hf_dir), tol, log, imatrix, max_kl)
    else:
        report.parts += _lone_parts(gf, _Runs(gguf_path, None, ids, log), tol, log)
    return report


def _needs_ids(runs: "_Runs", fn: Callable[[Part], Part]) -> Callable[[Part], Part]:
    def body(p: Part) -> Part:
        if not runs.ids:
            raise KimiError("no token sequence (see structure)")
        return fn(p)
    return body


def _checkpoint_parts(report: Report, gf: GGUFFile, plan, hf_dir: Path, tol: Tolerance, log, imatrix: Imatrix | None,
                      max_kl: float | None) -> list[Part]:
    cfg = plan.config
    if gf.arch != cfg.arch:                             # nothing else can be compared: one line says why
        meta = Part("metadata", "metadata vs config.json")
        meta.fail(f"general.architecture is {gf.arch or 'missing'}, but {hf_dir} is a {cfg.arch} checkpoint: "
                  f"the file was not made from it")
        meta.finish(f"architecture {gf.arch or 'missing'}, the checkpoint's is {cfg.arch}")
        skipped = [Part(k, t, ok=None, summary="not compared: the architectures differ")
                   for k, t in (("tensors", "tensors vs checkpoint"), ("logits", "logits: runtime vs reference"),
                                ("perplexity", "perplexity"), ("cost", COST_TITLE))]
        return skipped[:1] + [meta] + skipped[1:]
    no_reference = reference_unavailable()
    weights = file_weights(plan, gf) if tol.reference == FILE else None
    runs = _Runs(Path(report.gguf), None if no_reference else hf_dir, report.tokens, log, weights)
    log("comparing tensors")
    parts = [_run(Part("tensors", "tensors vs checkpoint"), lambda p: check_tensors(p, plan, gf, log, imatrix)),
             _run(Part("metadata", "metadata vs config.json"),
                  lambda p: check_metadata(p, cfg.gguf_metadata(), gf, cfg.arch, cfg=cfg,
                                           specials=checkpoint_specials(hf_dir, _text_config(hf_dir))))]
    if (note := unchecked_note(parts[0])) is not None:
        report.notes.append(note)
    if no_reference:                                    # the file is not at fault: those parts are n/a
        log("running the runtime (no reference)")
        report.notes.append(f"logits, perplexity, quantization cost"
                            f"{', K3.1 against the reference' if cfg.indexer else ''}: n/a -- {no_reference}")
        cost = Part("cost", COST_TITLE, ok=None, summary=no_reference)
        if max_kl is not None:                          # a gate that cannot be evaluated does not pass
            cost.fail(f"--max-kl {max_kl:g} cannot be checked: {no_reference}")
            cost.ok = False
        return parts + [Part("logits", "logits: runtime vs reference", ok=None, summary=no_reference),
                        _run(Part("k31", "K3.1 indexer (runtime only)"),
                             _needs_ids(runs, lambda p: check_k31(p, runs, cfg, tol))),
                        Part("perplexity", "perplexity", ok=None, summary=no_reference), cost]
    log("running runtime and reference" + (" (on the file's dequantized weights)" if weights else ""))
    return parts + [_run(Part("logits", "logits: runtime vs reference"),
                         _needs_ids(runs, lambda p: check_logits(p, runs, tol))),
                    _run(Part("k31", "K3.1 indexer"), _needs_ids(runs, lambda p: check_k31(p, runs, cfg, tol))),
                    _run(Part("perplexity", "perplexity"),
                         _needs_ids(runs, lambda p: check_perplexity(p, runs, tol))),
                    _run(Part("cost", COST_TITLE), _needs_ids(runs, lambda p: check_cost(p, runs, max_kl)))]


COST_TITLE = "quantization cost (vs the checkpoint)"


def _lone_parts(gf: GGUFFile, runs: "_Runs", tol: Tolerance, log) -> list[Part]:
    meta = Part("metadata", "metadata (keys and types)")
    try:
        cfg = KimiConfig.from_gguf(gf.fields, gf.paths[0])
    except KimiError as e:
        meta.fail(str(e))
        meta.ok, meta.summary = False, "the architecture cannot be read from the metadata"
        return [meta]
    log("reading every tensor")
    parts = [_run(meta, lambda p: check_lone_metadata(p, gf, cfg)),
             _run(Part("tensors", "tensors the architecture implies"), lambda p: check_lone_tensors(p, gf, cfg, log))]
    log("running the runtime")
    return parts + [_run(Part("forward", "forward pass"), _needs_ids(runs, lambda p: check_forward(p, runs))),
                    _run(Part("k31", "K3.1 indexer (runtime only)"),
                         _needs_ids(runs, lambda p: check_k31(p, runs, cfg, tol)))]
