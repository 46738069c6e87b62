"""Cut an N-layer checkpoint out of a full Kimi-K3 / K3.1-Pro one, in the real HF layout.

The slice is a checkpoint like any other: config.json with the layer lists rewritten,
one shard per kept decoder layer plus one for the globals (`model-00001-of-000009.safetensors`,
5-digit number and 6-digit total as in the release), a fresh `model.safetensors.index.json`,
and every tokenizer / code file copied. The vision tower and projector are dropped.

Streaming: every tensor's bytes are copied by range from the source shard (kernel-side
`copy_file_range`, else bounded preads), never through a whole-shard read or a mmap; only
the safetensors headers are parsed. The resident set is the headers plus one copy buffer.

Layer selection (`parse_layers`):
  * a list / ranges, 0-based, e.g. `0-3,91-92`: exactly those layers, in model order;
  * a bare count N: the first N layers, except that the earliest layer of every kind the
    model has (KDA and MLA attention, dense and MoE FFN) is always included, picked greedily
    so that one layer covers as many missing kinds as possible; the rest are the lowest
    remaining layer ids. For K3 `--layers 8` is layers 0-7 (KDA+dense 0, KDA+MoE 1,2,4-6,
    MLA+MoE 3,7); `--layers 2` is layers 0 and 3.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..convert.checkpoint import INDEX_NAME, SINGLE_NAME, Checkpoint, SourceTensor, checkpoint_inputs
from ..errors import ConfigError, KimiError, OutputError
from ..gguf_io import FileRange, SourceFiles, copy_range, partial_dir, remove_stale, stale_partials
from ..interrupts import deferred
from ..model import DSA_ALIASES, KimiConfig
from ..paths import FOLDER, Input, Output, refuse_overlap
from ..tensor_map import sanitize

_LAYER_RE = re.compile(r"^(?P<pre>(?:language_model\.)?(?:model\.)?layers\.)(?P<il>\d+)(?P<post>\..+)$")
_DTYPE_ALIGN = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "U32": 4, "BF16": 2, "F16": 2, "I16": 2, "U16": 2}
_COPY_SKIP = {"config.json", INDEX_NAME, SINGLE_NAME}


class SliceError(KimiError):
    """The layer selection or the slice output is not possible."""


@dataclass
class SliceResult:
    out_dir: Path
    layers: list[int]               # original 0-based ids, in new order (new id = position)
    n_tensors: int
    n_bytes: int
    shards: list[str]
    dropped: int                    # vision / projector tensors left out
    copied_files: list[str]
    config: KimiConfig              # the slice's own parsed config


# ------------------------------------------------------------------------------------
# layer selection

def layer_kinds(cfg: KimiConfig, il: int) -> set[str]:
    return {"mla" if cfg.is_mla(il) else "kda", "moe" if cfg.is_moe(il) else "dense"}


def default_layers(cfg: KimiConfig, n: int) -> list[int]:
    """The first n layers, forced to include one layer of every kind the model has (see module doc)."""
    if not 1 <= n <= cfg.n_layer:
        raise SliceError(f"--layers {n}: choose 1..{cfg.n_layer} layers")
    missing = set().union(*(layer_kinds(cfg, il) for il in range(cfg.n_layer)))
    chosen: set[int] = set()
    while missing and len(chosen) < n:
        best = max((il for il in range(cfg.n_layer) if il not in chosen),
                   key=lambda il: (len(layer_kinds(cfg, il) & missing), -il))
        if not layer_kinds(cfg, best) & missing:
            break
        chosen.add(best)
        missing -= layer_kinds(cfg, best)
    for il in range(cfg.n_layer):
        if len(chosen) >= n:
            break
        chosen.add(il)
    return sorted(chosen)


def parse_layers(spec: str, cfg: KimiConfig) -> list[int]:
    """'8' -> default_layers(cfg, 8); '0-3,91-92' or '5-5' -> exactly those 0-based layers."""
    text = spec.replace(" ", "")
    if re.fullmatch(r"\d+", text):
        return default_layers(cfg, int(text))
    if not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*,?", text):
        raise SliceError(f"--layers {spec!r}: use a count (8) or 0-based layers and ranges (0-3,91-92)")
    out: list[int] = []
    for part in filter(None, text.split(",")):
        a, _, b = part.partition("-")
        lo, hi = int(a), int(b or a)
        if lo > hi:
            raise SliceError(f"--layers {spec!r}: range {part} runs backwards")
        out += range(lo, hi + 1)
    bad = sorted({i for i in out if i >= cfg.n_layer})
    if bad:
        shown = ", ".join(map(str, bad[:8])) + (", ..." if len(bad) > 8 else "")
        raise SliceError(f"--layers {spec!r}: layer(s) {shown} do not exist (the model has 0..{cfg.n_layer - 1})")
    dup = sorted({i for i in out if out.count(i) > 1})
    if dup:
        raise SliceError(f"--layers {spec!r}: layers {dup} are listed twice")
    return sorted(out)


# ------------------------------------------------------------------------------------
# config

def slice_config(raw: dict, cfg: KimiConfig, layers: list[int]) -> dict:
    """config.json of the slice: layer count, 1-indexed layer lists, dense prefix, DSA list."""
    new = json.loads(json.dumps(raw))
    tc = new["text_config"]
    n = len(layers)
    full = [k + 1 for k, il in enumerate(layers) if cfg.is_mla(il)]
    kda = [k + 1 for k, il in enumerate(layers) if cfg.is_kda(il)]
    tc["num_hidden_layers"] = n
    lac = tc["linear_attn_config"]
    lac["full_attn_layers"] = full
    lac["kda_layers"] = kda                  # always written: the partition is then explicit
    # dense layers are a prefix of the model, so (sorted) also a prefix of the slice
    n_dense = sum(1 for il in layers if not cfg.is_moe(il))
    if n_dense or "first_k_dense_replace" in tc:
        tc["first_k_dense_replace"] = n_dense
    for where in (tc.get("dsa_config"), new.get("dsa_config")):
        if isinstance(where, dict):
            for alias in DSA_ALIASES["layers"]:
                if alias in where:
                    where[alias] = list(full)
    if cfg.indexer is not None and not full:
        raise SliceError("a K3.1 slice needs at least one full-attention (DSA) layer: "
                         "the indexer config would be unusable")
    return new


# ------------------------------------------------------------------------------------
# writing

def shard_name(k: int, n: int) -> str:
    return f"model-{k:05d}-of-{n:06d}.safetensors"


def _header(tensors: list[tuple[str, SourceTensor]]) -> tuple[bytes, list[tuple[str, SourceTensor]]]:
    """safetensors header (8-byte aligned) for tensors in the order their data will follow."""
    order = sorted(tensors, key=lambda nt: (-_DTYPE_ALIGN.get(nt[1].dtype, 1), nt[0]))
    meta: dict = {"__metadata__": {"format": "pt"}}
    pos = 0
    for name, t in order:
        meta[name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    blob = json.dumps(meta, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob, order


def _write_shard(path: Path, tensors: list[tuple[str, SourceTensor]], sources: SourceFiles) -> int:
    head, order = _header(tensors)
    with open(path, "wb") as f:
        f.write(head)
        for _, t in order:
            copy_range(f, FileRange(t.path, t.offset, t.nbytes), sources.fd(t.path))
        f.flush()
        os.fsync(f.fileno())
    return sum(t.nbytes for _, t in order)


def slice_checkpoint(hf_dir: Path, out_dir: Path, layers: str | list[int], *, force: bool = False,
                     log: Callable[[str], None] = lambda s: None) -> SliceResult:
    """Write the slice of `hf_dir` with `layers` (a spec string or 0-based ids) into `out_dir`; `log` says which
    partial folders of dead runs it removes."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    cfg = KimiConfig.from_hf_dir(hf_dir)
    raw = json.loads((hf_dir / "config.json").read_text())
    # a list is explicit even with one element ("5," is layer 5, "5" would be a count)
    chosen = parse_layers(layers if isinstance(layers, str) else ",".join(map(str, layers)) + ",", cfg)
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputError(f"{out_dir}: not a folder; OUT_DIR is the folder the sliced checkpoint goes into")
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise OutputError(f"{out_dir}: exists and is not empty (use --force to overwrite)")
    ckpt = Checkpoint(hf_dir)
    new_id = {il: k for k, il in enumerate(chosen)}

    per_layer: dict[int, list[tuple[str, SourceTensor]]] = {k: [] for k in range(len(chosen))}
    globals_: list[tuple[str, SourceTensor]] = []
    dropped = 0
    for name, t in ckpt.tensors.items():
        if sanitize(name) is None:
            dropped += 1
            continue
        m = _LAYER_RE.match(name)
        if m is None:
            globals_.append((name, t))
            continue
        il = int(m["il"])
        if il >= cfg.n_layer:
            raise SliceError(f"{t.path}: tensor {name} belongs to layer {il}, but config.json has "
                             f"{cfg.n_layer} layers (MTP layers are not supported)")
        if il in new_id:
            per_layer[new_id[il]].append((f"{m['pre']}{new_id[il]}{m['post']}", t))
    empty = [chosen[k] for k, ts in per_layer.items() if not ts]
    if empty:
        raise SliceError(f"{hf_dir}: no tensors for layer(s) {empty}")

    groups = [per_layer[k] for k in range(len(chosen))] + [globals_]
    n_shards = len(groups)
    new_raw = slice_config(raw, cfg, chosen)

    tmp = partial_dir(out_dir)
    shards = [shard_name(k, n_shards) for k in range(1, n_shards + 1)]
    refuse_overlap(slice_inputs(hf_dir), slice_outputs(out_dir, shards, tmp, hf_dir))
    remove_stale(stale_partials(out_dir), log)
    if tmp.exists():
        shutil.rmtree(tmp)
    with contextlib.ExitStack() as settling:      # from the install, or a failure, on: signals wait
        try:
            tmp.mkdir(parents=True)
            weight_map, total, shards = {}, 0, []
            with SourceFiles() as sources:
                for k, group in enumerate(groups, start=1):
                    fname = shard_name(k, n_shards)
                    total += _write_shard(tmp / fname, group, sources)
                    shards.append(fname)
                    weight_map.update({name: fname for name, _ in group})
            (tmp / INDEX_NAME).write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                indent=2) + "\n")
            (tmp / "config.json").write_text(json.dumps(new_raw, indent=2, sort_keys=True,
                                                        ensure_ascii=False) + "\n")
            copied = []
            for p in _copied(hf_dir):
                shutil.copy2(p, tmp / p.name)
                copied.append(p.name)
            try:
                new_cfg = KimiConfig.from_hf_dir(tmp)          # the rewritten config must parse
            except ConfigError as e:
                raise SliceError(f"slice config is inconsistent: {e}") from None
            settling.enter_context(deferred())
            _install(tmp, out_dir)
        except BaseException as e:
            settling.enter_context(deferred())
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError):
                raise OutputError(f"{out_dir}: cannot write the slice ({e.strerror or e})") from None
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return SliceResult(out_dir, chosen, len(weight_map), total, shards, dropped, copied, new_cfg)


def slice_inputs(hf_dir: Path) -> list[Input]:
    """What a slice reads: the checkpoint's shards and every other file it copies."""
    return [*checkpoint_inputs(hf_dir), *(Input(p, "checkpoint file") for p in _copied(hf_dir))]


def slice_outputs(out_dir: Path, shards: list[str], tmp: Path, hf_dir: Path) -> list[Output]:
    """What a slice writes into `out_dir`, or removes there (an earlier slice's shards), and its partial folder."""
    names = {*shards, INDEX_NAME, "config.json", *(p.name for p in _copied(hf_dir))}
    stale = [*out_dir.glob("model-*-of-*.safetensors"), out_dir / SINGLE_NAME] if out_dir.is_dir() else []
    return [*(Output(out_dir / n, "slice file") for n in sorted(names)),
            *(Output(p, "earlier slice's shard") for p in stale if p.name not in names),
            Output(tmp, "partial folder", FOLDER),
            *(Output(p, "stale partial folder", FOLDER) for p in stale_partials(out_dir))]


def _copied(hf_dir: Path) -> list[Path]:
    """The checkpoint's other files, copied into the slice as they are (tokenizer, template, ...)."""
    return [p for p in sorted(hf_dir.iterdir())
            if p.is_file() and p.name not in _COPY_SKIP and not p.name.endswith(".safetensors")]


def _install(tmp: Path, out_dir: Path) -> None:
    """Move the finished slice into out_dir; stale shards of an earlier slice are removed first."""
    if not out_dir.exists():
        os.replace(tmp, out_dir)
        return
    for p in [*out_dir.glob("model-*-of-*.safetensors"), out_dir / SINGLE_NAME]:
        if p.exists():
            p.unlink()
    for p in tmp.iterdir():
        os.replace(p, out_dir / p.name)
