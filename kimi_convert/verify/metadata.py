"""The metadata part: every architecture key (value and GGUF type, as llama.cpp's loader reads it) and the
special-token ids."""
from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGUFValueType

from ..constants import Key, T, key
from ..convert.vocab import ExpectedSpecial, k3_specials
from ..gguf_io import GGUFFile
from ..model import KimiConfig
from .report import Part, _short

# ------------------------------------------------------------------------------------
# part: metadata

VT = GGUFValueType

# llama.cpp reads these per-layer keys with get_key_or_arr into a std::array<uint32_t>; its get_arr takes an
# array of INT32, UINT32 or BOOL alike (src/llama-model-loader.cpp; k31-indexer.md for indexer.types). A
# scalar goes through get_key, which takes exactly one type ("key ... has wrong type"): a UINT32 key stored
# as INT32 does not load. (get_key_or_arr would also take a per-layer array for feed_forward_length,
# head_count, expert_used_count and expert_feed_forward_length, and a scalar head_count_kv; KimiConfig
# holds one value, resp. one per layer, for those, and no llama.cpp tool writes the other form for K3.)
PER_LAYER_KEYS = (Key.HEAD_COUNT_KV, Key.INDEXER_TYPES)
PER_LAYER_ELEMENTS = (VT.INT32, VT.UINT32, VT.BOOL)


def accepted_types(name: str, vtype: VT, sub: VT | None, arch: str) -> list[tuple[VT, VT | None]]:
    """The (type, element type) pairs llama.cpp's loader reads `name` from; ours first."""
    if name in {key(k, arch) for k in PER_LAYER_KEYS} and vtype == VT.ARRAY:
        return [(VT.ARRAY, sub)] + [(VT.ARRAY, e) for e in PER_LAYER_ELEMENTS if e != sub]
    return [(vtype, sub)]


def _type_name(vtype: VT | None, sub: VT | None) -> str:
    return (vtype.name if vtype else "?") + (f"[{sub.name}]" if sub else "")


def _as_loaded(value: Any, vtype: VT) -> Any:
    """A scalar as llama.cpp holds it: BOOL array entries become 0/1 and INT32 bits a uint32 (get_arr);
    floats compare as float32."""
    if vtype == VT.BOOL:
        return int(bool(value))
    if vtype in (VT.INT32, VT.UINT32):
        return int(value) & 0xFFFFFFFF
    if vtype == VT.FLOAT32:
        return np.float32(value)
    if vtype == VT.FLOAT64:
        return float(value)
    return value


def _same_value(want: Any, got: Any, want_type: tuple[VT, VT | None], got_type: tuple[VT, VT | None]) -> bool:
    """Equal as llama.cpp reads them, each under its own stored type."""
    (vtype, sub), (_, got_sub) = want_type, got_type
    if vtype == VT.ARRAY:
        if not isinstance(got, list) or len(got) != len(want):
            return False
        return all(_as_loaded(w, sub) == _as_loaded(g, got_sub) for w, g in zip(want, got))
    return _as_loaded(want, vtype) == _as_loaded(got, vtype)


def check_metadata(part: Part, expected: list, gf: GGUFFile, arch: str, *, cfg: KimiConfig,
                   specials: list[ExpectedSpecial] | None = None) -> Part:
    """specials: what each special-token key must say (vocab.checkpoint_specials); by default what Kimi-K3's
    tokenizer fixes (vocab.k3_specials)."""
    n_ok = 0
    if gf.fields.get("general.architecture") != arch:
        part.fail(f"general.architecture is {gf.fields.get('general.architecture')!r}, expected {arch!r}")
    for name, want, vtype, sub in expected:
        got = gf.fields.get(name)
        accepted = accepted_types(name, vtype, sub, arch)
        stored = gf.types.get(name, (None, None))
        row = {"key": name, "expected": _short(want), "type": _type_name(vtype, sub),
               "stored_as": _type_name(*stored)}
        if name not in gf.fields:
            row |= {"ok": False, "found": "missing"}
            part.fail(f"{name}: missing (expected {_short(want)})")
        elif stored not in accepted:
            row |= {"ok": False, "found": f"{_short(got)} as {row['stored_as']}"}
            part.fail(f"{name}: stored as {row['stored_as']}, " + (
                "expected a per-layer ARRAY of INT32, UINT32 or BOOL" if len(accepted) > 1
                else f"llama.cpp reads it only as {row['type']}"))
        elif not _same_value(want, got, (vtype, sub), stored):
            row |= {"ok": False, "found": _short(got)}
            part.fail(f"{name}: {_short(got)}, expected {_short(want)}")
        else:
            row |= {"ok": True, "found": _short(got)}
            n_ok += 1
        part.rows.append(row)
    wanted = {k for k, *_ in expected}
    stray = sorted(k for k in gf.fields if k.startswith(arch + ".") and k not in wanted)
    for k in stray:
        part.fail(f"{k}: unexpected key (not written for this config)")
        part.rows.append({"key": k, "ok": False, "expected": "absent", "found": _short(gf.fields[k])})
    # vocabulary: llama.cpp takes n_vocab from the token list
    tokens = gf.fields.get("tokenizer.ggml.tokens")
    n_tok = len(tokens) if isinstance(tokens, list) else None
    for k in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        v = gf.fields.get(k)
        if v is not None and n_tok is not None and len(v) != n_tok:
            part.fail(f"{k}: {len(v)} entries for {n_tok} tokens")
    vocab_ok = n_tok == cfg.n_vocab
    if not vocab_ok:
        part.fail(f"tokenizer.ggml.tokens: {n_tok} tokens, config vocab_size is {cfg.n_vocab}")
    for k in (T.TOKEN_EMBD, T.OUTPUT):
        t = gf.tensors.get(k)
        if t is not None and t.shape[0] != cfg.n_vocab:
            part.fail(f"{k}: {t.shape[0]} rows, vocab_size is {cfg.n_vocab}")
    part.rows.append({"key": "tokenizer.ggml.tokens (count)", "expected": cfg.n_vocab, "found": n_tok,
                      "type": "ARRAY[STRING]", "ok": vocab_ok})
    n_special, n_special_ok = check_special_tokens(part, gf, k3_specials() if specials is None else specials)
    part.figures = {"keys_matched": n_ok, "keys_expected": len(expected), "unexpected_keys": stray,
                    "vocab_tokens": n_tok, "vocab_size": cfg.n_vocab, "special_ids_matched": n_special_ok,
                    "special_ids": n_special}
    return part.finish(f"{n_ok}/{len(expected)} architecture keys match (value, and a type llama.cpp reads), "
                       f"vocabulary {n_tok}/{cfg.n_vocab}, special ids {n_special_ok}/{n_special}"
                       + (f", {len(stray)} unexpected" if stray else ""))


def check_special_tokens(part: Part, gf: GGUFFile, expected: list[ExpectedSpecial]) -> tuple[int, int]:
    """Each special-token key present (or required) against its expectation: stored as the UINT32 llama.cpp reads,
    inside the vocabulary, the expected id, and naming the expected token. (checked, passed)"""
    tokens = gf.fields.get("tokenizer.ggml.tokens")
    tokens = tokens if isinstance(tokens, list) else []
    n, n_ok = 0, 0
    for e in expected:
        if e.key not in gf.fields and not e.required:
            continue
        n += 1
        problem = _special_problem(e, gf, tokens)
        found = gf.fields.get(e.key, "missing")
        part.rows.append({"key": e.key, "expected": _special_shown(e.token_id, e.text), "type": "UINT32",
                          "stored_as": _type_name(*gf.types.get(e.key, (None, None))),
                          "found": _special_shown(found, _text_at(tokens, found)), "ok": problem is None})
        if problem is None:
            n_ok += 1
        else:
            part.fail(f"{e.key}: {problem}")
    return n, n_ok


def _special_problem(e: ExpectedSpecial, gf: GGUFFile, tokens: list[str]) -> str | None:
    want_id = e.token_id
    if want_id is None and e.text is not None and e.text in tokens:
        want_id = tokens.index(e.text)          # the file's id of the token it must name
    want = f"expected {_special_shown(want_id, e.text)} from {e.source}" if want_id is not None else \
        f"expected the id of {e.text!r} from {e.source}, which the file's vocabulary does not hold" if e.text else \
        f"expected an id of the vocabulary of {len(tokens)} tokens"
    if e.key not in gf.fields:
        return f"missing, {want}"
    got, stored = gf.fields[e.key], gf.types.get(e.key)
    if stored != (VT.UINT32, None):
        return f"{_short(got)} stored as {_type_name(*stored)}, llama.cpp reads it only as UINT32; {want}"
    if not got < len(tokens):
        return f"{got} is outside the vocabulary of {len(tokens)} tokens, {want}"
    if (e.token_id is not None and got != e.token_id) or (e.text is not None and tokens[got] != e.text):
        return f"{_special_shown(got, tokens[got])}, {want}"
    return None


def _text_at(tokens: list[str], token_id: Any) -> str | None:
    ok = isinstance(token_id, int) and not isinstance(token_id, bool) and 0 <= token_id < len(tokens)
    return tokens[token_id] if ok else None


def _special_shown(token_id: Any, text: str | None) -> str:
    if token_id is None:
        return repr(text) if text is not None else "any id of the vocabulary"
    return f"{token_id} ({text!r})" if text is not None else str(token_id)
