"""Text -> token ids, exactly as llama.cpp tokenizes with a Kimi-K3 / K3.1 GGUF's vocabulary.

`Tokenizer.encode(text)` returns what `common_tokenize(ctx, text, add_special=true, parse_special=false)` returns
(common/common.cpp, i.e. `llama_tokenize` with those flags) in the pinned llama.cpp (the Oct-2026 tree of
llama-cpp-python 0.3.36), which is how `llama-imatrix` turns its calibration text into tokens. It mirrors:

- src/llama-vocab.cpp, `llama_vocab::impl::tokenize`, BPE branch: with add_special, the BOS first when
  `tokenizer.ggml.add_bos_token` is true and the EOS last when `add_eos_token` is; empty text gives only those.
- `llama_vocab::impl::tokenizer_st_partition` with parse_special=false: control (and unknown) tokens such as
  `<|end_of_msg|>` or `[BOS]` are plain text; only user-defined tokens are cut out first (token type 4, and the
  names `load` always makes user-defined: <|channel|>, <|message|>, <|start|>, <|constrain|>), longest first.
- `llama_vocab::impl::load`: model "gpt2", pre "kimi-k2" (no whitespace escaping, merges by `find(' ', 1)`, the
  first rank of a repeated pair kept), BOS/EOS ids defaulting to 11 when the key is absent, an id out of range
  ignored; an empty token text read as "[EMPTY_{id}]".
- src/unicode.cpp: `unicode_cpts_from_utf8` (each byte that does not start a sequence of the right length is
  U+FFFD; overlong forms and surrogates are accepted and re-encoded canonically; past U+10FFFF llama.cpp throws
  out of `llama_tokenize` and aborts, so we raise); `unicode_regex_split`, whose "kimi-k2" regex "\\p{Han}+" only
  selects `unicode_regex_split_custom_kimi_k2`: a hand-written splitter, not the Kimi tokenizer's regex (it
  treats combining marks as non-letters, for one), reproduced here by `_SPLIT` below; `unicode_cpt_is_han` (a
  fixed list of CJK blocks, not the Unicode Han script); the category flags of src/unicode-data.cpp (Unicode
  15.1 general categories, and the White_Space property).
- `llm_tokenizer_bpe_session::tokenize`: each piece's UTF-8 bytes, GPT-2 byte-encoded, merged by lowest merge
  rank (leftmost first) from a priority queue; a merged part that is no token falls back to the single-character
  tokens of its byte-level text.

Not mirrored, as a Kimi vocabulary (ours or llama.cpp's converter's: no token of type 4, no <|return|> or
<|call|>) never meets them: llama.cpp also makes a type-4 token control when it takes its text for an
end-of-generation or fill-in-the-middle marker, and <|end|> user-defined when <|return|> and <|call|> exist
(gpt-oss); user-defined tokens of equal length are tried in id order here, in an unspecified one there.
"""
from __future__ import annotations

import bisect
import codecs
import heapq
import re
import unicodedata
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from .convert.vocab import token_to_str
from .errors import KimiError

TOKENIZER_MODEL = "gpt2"
TOKENIZER_PRE = "kimi-k2"

# gguf's TokenType (llama.h's llama_token_type)
NORMAL, USER_DEFINED = 1, 4
# names src/llama-vocab.cpp makes user-defined whatever their type (its gpt-oss workaround)
ALWAYS_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")
# llama.cpp's BOS and EOS when a gpt2 vocabulary names none
DEFAULT_SPECIAL_ID = 11

_KEY = "tokenizer.ggml."


class TokenizerError(KimiError):
    """The vocabulary is not one this tokenizer mirrors llama.cpp for, or the text is one llama.cpp aborts on."""


# --- Unicode: llama.cpp's classes, whatever Python's unicodedata version ---------------------------------------

# unicode_cpt_is_han's blocks: CJK Unified Ideographs and extensions A-F, the compatibility ideographs
# (not extensions G-I, not U+3007 or radicals), assigned or not
_HAN_RANGES = ((0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0x20000, 0x2A6DF), (0x2A700, 0x2EBEF),
               (0x2F800, 0x2FA1F))

# the White_Space property (unicode-data.cpp's whitespace set): not Python's str.isspace(), which adds \x1c-\x1f
_WHITESPACE = frozenset([*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029,
                         0x202F, 0x205F, 0x3000])

# llama.cpp's flags are Unicode 15.1 (unicode-data.cpp; Python 3.13's unicodedata matches them exactly). Letters and
# numbers assigned in 15.0 and 15.1, for Pythons whose unicodedata is older (3.11: 14.0, 3.12: 15.0) ...
_LN_ADDED_IN_15 = (
    (0x1123F, 0x11240, "L"), (0x11F02, 0x11F02, "L"), (0x11F04, 0x11F10, "L"), (0x11F12, 0x11F33, "L"),  # Khojki, Kawi
    (0x11F50, 0x11F59, "N"), (0x1342F, 0x1342F, "L"), (0x13441, 0x13446, "L"),       # Kawi digits, hieroglyphs
    (0x1B132, 0x1B132, "L"), (0x1B155, 0x1B155, "L"), (0x1D2C0, 0x1D2D3, "N"),       # kana, Kaktovik numerals
    (0x1DF25, 0x1DF2A, "L"), (0x1E030, 0x1E06D, "L"), (0x1E4D0, 0x1E4EB, "L"),       # Latin, Cyrillic, Nag Mundari
    (0x1E4F0, 0x1E4F9, "N"), (0x2B739, 0x2B739, "L"), (0x2EBF0, 0x2EE5D, "L"),       # CJK ext. C and I
    (0x31350, 0x323AF, "L"),                                                         # CJK ext. H
)
# ... and those assigned in 16.0 and 17.0, which llama.cpp's table leaves unassigned, for newer ones (3.14: 16.0)
_LN_ADDED_AFTER_15_1 = (
    (0x0088F, 0x0088F), (0x00C5C, 0x00C5C), (0x00CDC, 0x00CDC), (0x01C89, 0x01C8A), (0x0A7CB, 0x0A7CF),
    (0x0A7D2, 0x0A7D2), (0x0A7D4, 0x0A7D4), (0x0A7DA, 0x0A7DC), (0x0A7F1, 0x0A7F1), (0x105C0, 0x105F3),
    (0x10940, 0x10959), (0x10D40, 0x10D65), (0x10D6F, 0x10D85), (0x10EC2, 0x10EC7), (0x11380, 0x11389),
    (0x1138B, 0x1138B), (0x1138E, 0x1138E), (0x11390, 0x113B5), (0x113B7, 0x113B7), (0x113D1, 0x113D1),
    (0x113D3, 0x113D3), (0x116D0, 0x116E3), (0x11BC0, 0x11BE0), (0x11BF0, 0x11BF9), (0x11DB0, 0x11DDB),
    (0x11DE0, 0x11DE9), (0x13460, 0x143FA), (0x16100, 0x1611D), (0x16130, 0x16139), (0x16D40, 0x16D6C),
    (0x16D70, 0x16D79), (0x16EA0, 0x16EB8), (0x16EBB, 0x16ED3), (0x16FF2, 0x16FF6), (0x187F8, 0x187FF),
    (0x18CFF, 0x18CFF), (0x18D09, 0x18D1E), (0x18D80, 0x18DF2), (0x1CCF0, 0x1CCF9), (0x1E5D0, 0x1E5ED),
    (0x1E5F0, 0x1E5FA), (0x1E6C0, 0x1E6DE), (0x1E6E0, 0x1E6E2), (0x1E6E4, 0x1E6E5), (0x1E6E7, 0x1E6ED),
    (0x1E6F0, 0x1E6F4), (0x1E6FE, 0x1E6FF), (0x2B73A, 0x2B73F), (0x2CEA2, 0x2CEAD), (0x323B0, 0x33479),
)
LLAMA_UNICODE = (15, 1, 0)
NEWEST_KNOWN_UNICODE = (17, 0, 0)


@lru_cache(maxsize=1)
def _category_fixes() -> tuple[list[int], list[tuple[int, int, str]]]:
    """(starts, ranges) that bring this Python's unicodedata to Unicode 15.1 for letters ("L") and numbers ("N");
    "" is neither."""
    version = tuple(int(p) for p in unicodedata.unidata_version.split("."))
    if version > NEWEST_KNOWN_UNICODE:
        raise TokenizerError(f"Python's Unicode database is {unicodedata.unidata_version}, newer than the "
                             f"{'.'.join(map(str, NEWEST_KNOWN_UNICODE))} this tokenizer knows: its letters and "
                             f"numbers assigned after 15.1 (llama.cpp's tables) are not listed in {__name__}")
    if version < LLAMA_UNICODE:
        fixes = list(_LN_ADDED_IN_15)
    elif version > LLAMA_UNICODE:
        fixes = [(lo, hi, "") for lo, hi in _LN_ADDED_AFTER_15_1]
    else:
        fixes = []
    fixes.sort()
    return [lo for lo, _, _ in fixes], fixes


def _letter_or_number(ch: str) -> str:
    """"L", "N" or "" for `ch` as in Unicode 15.1 (unicode_cpt_flags is_letter / is_number)."""
    starts, fixes = _category_fixes()
    i = bisect.bisect_right(starts, ord(ch)) - 1
    if i >= 0 and ord(ch) <= fixes[i][1]:
        return fixes[i][2]
    kind = unicodedata.category(ch)[0]
    return kind if kind in "LN" else ""


def _is_han(cp: int) -> bool:
    return any(lo <= cp <= hi for lo, hi in _HAN_RANGES)


# The splitter runs on a "collapsed" copy of the text, one character for one, where every non-ASCII character
# stands for its class (ASCII keeps its own: the splitter looks at ', \r, \n, space and the contraction letters):
_HAN_LETTER = "\u4e00"      # in _HAN_RANGES and a letter
_HAN_OTHER = "\u3400"       # in _HAN_RANGES, unassigned in 15.1: Han to rule 1, "other" to rule 5
_LETTER, _NUMBER, _SPACE, _OTHER = "x", "0", "\x0b", "!"    # 'x' is no contraction letter, \x0b no \r, \n or ' '


def _collapsed(ch: str) -> str:
    kind = _letter_or_number(ch)
    if _is_han(ord(ch)):
        return _HAN_LETTER if kind == "L" else _HAN_OTHER
    if ord(ch) in _WHITESPACE:
        return _SPACE
    return {"L": _LETTER, "N": _NUMBER}.get(kind, _OTHER)


# every character seen so far -> its stand-in; ASCII maps to itself, so that str.translate never misses
_COLLAPSE: dict[int, str] = {c: chr(c) for c in range(128)}


def _collapse(text: str) -> str:
    if text.isascii():
        return text
    for ch in set(text):                        # classify each distinct character once, not each occurrence
        if ord(ch) not in _COLLAPSE:
            _COLLAPSE[ord(ch)] = _collapsed(ch)
    return text.translate(_COLLAPSE)


# unicode_regex_split_custom_kimi_k2, rule by rule, on collapsed text (W: whitespace; L: letters; N: numbers):
_W = "\t\n\x0b\x0c\r "
_SPLIT = re.compile(
    f"[{_HAN_LETTER}{_HAN_OTHER}]+"                          # 1. a run of Han (letters or not)
    # 2. an optional lead (anything but \r, \n, L, N), non-Han letters, an optional ASCII contraction
    f"|[^\r\nA-Za-z0-9{_HAN_LETTER}]?[A-Za-z]+(?:'[sStTmMdD]|'(?:[rR][eE]|[vV][eE]|[lL][lL]))?"
    "|[0-9]{1,3}"                                             # 3. numbers, three at a time from the left
    f"| ?[^{_W}A-Za-z0-9{_HAN_LETTER}]+[\r\n]*"              # 4. an optional space, other characters, newlines
    f"|[{_W}]*[\r\n]+"                                        # 5. whitespace up to its last \r or \n
    f"|[{_W}]+(?![^{_W}])"                                    # 6. whitespace but the last before a non-space
    f"|[{_W}]+"                                               # 7. the rest of the whitespace
    "|.",                                                     # (never reached: rule 4 takes any other character)
    re.DOTALL)


def _split(text: str) -> list[str]:
    """The pieces of `text` (one fragment), each merged on its own."""
    collapsed = _collapse(text)
    if collapsed is text:
        return _SPLIT.findall(text)
    out, pos = [], 0
    for piece in _SPLIT.findall(collapsed):
        out.append(text[pos:pos + len(piece)])
        pos += len(piece)
    return out


# --- UTF-8 as unicode_cpts_from_utf8 reads it ------------------------------------------------------------------

def _llama_utf8_error(e: UnicodeDecodeError) -> tuple[str, int]:
    """Called where Python's strict decoder stops: decode one code point there as llama.cpp does, which accepts
    overlong forms and surrogates, and reads any other bad byte as U+FFFD, moving on by one byte."""
    data, i = e.object, e.start
    lead = data[i]
    n = 2 if 0xC0 <= lead < 0xE0 else 3 if 0xE0 <= lead < 0xF0 else 4 if 0xF0 <= lead < 0xF8 else 0
    if not n or i + n > len(data) or any(b & 0xC0 != 0x80 for b in data[i + 1:i + n]):
        return "\ufffd", i + 1
    cp = lead & (0xFF >> (n + 1))
    for b in data[i + 1:i + n]:
        cp = cp << 6 | b & 0x3F
    if cp > 0x10FFFF:
        # unicode_cpt_to_utf8 throws out of llama_tokenize: llama-imatrix would abort
        raise TokenizerError(f"bytes {data[i:i + n].hex(' ')} at offset {i} decode to U+{cp:X}, past U+10FFFF: "
                             f"llama.cpp aborts on such text")
    return chr(cp), i + n


_UTF8_ERRORS = "kimi-convert-llama-utf8"
codecs.register_error(_UTF8_ERRORS, _llama_utf8_error)


# --- the vocabulary -------------------------------------------------------------------------------------------

@lru_cache(maxsize=1)
def _byte_level_table() -> dict[int, str]:
    """GPT-2 byte-level character -> the byte it stands for (as a latin-1 character); every other character below
    256 -> U+FFFF, so that a text holding one fails to encode as latin-1."""
    table: dict[int, str] = {c: "\uffff" for c in range(256)}
    table.update({ord(ch): chr(b) for b, ch in enumerate(token_to_str(bytes(range(256))))})
    return table


def _byte_level_bytes(text: str) -> bytes | None:
    """The raw bytes a byte-level token text stands for; None when it is no such text (a control token with a
    space, ...), which a BPE piece can never equal."""
    try:
        return text.translate(_byte_level_table()).encode("latin-1")
    except UnicodeEncodeError:
        return None


def _special_id(value: Any, n_vocab: int) -> int | None:
    """llama_vocab::impl::load: the default 11 unless out of range; the key's id unless out of range."""
    token_id = DEFAULT_SPECIAL_ID if DEFAULT_SPECIAL_ID < n_vocab else None
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n_vocab:
        token_id = value
    return token_id


class Tokenizer:
    """A Kimi-K3 vocabulary (byte-level BPE, pre-tokenizer "kimi-k2") tokenizing as llama.cpp does."""

    def __init__(self, tokens: Sequence[str], token_types: Sequence[int] | None, merges: Sequence[str], *,
                 bos_id: int | None = None, eos_id: int | None = None, add_bos: bool = False,
                 add_eos: bool = False, model: str = TOKENIZER_MODEL, pre: str = TOKENIZER_PRE):
        if model != TOKENIZER_MODEL or pre != TOKENIZER_PRE:
            raise TokenizerError(f"tokenizer {model!r} with pre-tokenizer {pre!r}: only {TOKENIZER_MODEL!r} with "
                                 f"{TOKENIZER_PRE!r} (Kimi-K3's) is mirrored")
        if token_types is not None and len(token_types) < len(tokens):
            raise TokenizerError(f"{len(token_types)} token types for {len(tokens)} tokens")
        _category_fixes()                      # a Python too new fails here, not on the first non-ASCII text
        self.tokens = tuple(tokens)               # the vocabulary, to tell two models' apart
        self.n_vocab = len(tokens)
        self.bos_id = _special_id(bos_id, self.n_vocab)
        self.eos_id = _special_id(eos_id, self.n_vocab)
        self.add_bos, self.add_eos = bool(add_bos), bool(add_eos)
        if (self.add_bos and self.bos_id is None) or (self.add_eos and self.eos_id is None):
            raise TokenizerError("the vocabulary adds a BOS/EOS token but has none (llama.cpp asserts)")
        texts = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self._text_ids = self._text_to_id(texts)
        self._byte_ids = {b: i for t, i in self._text_ids.items() if (b := _byte_level_bytes(t)) is not None}
        self._ranks = self._merge_ranks(merges)
        types = token_types if token_types is not None else [NORMAL] * len(tokens)
        self._user_defined = self._user_defined_tokens(texts, types)
        self._cache: dict[str, tuple[int, ...]] = {}

    # construction ------------------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path_or_fields: str | Path | Mapping[str, Any]) -> Tokenizer:
        """From a GGUF file (any part of a split one) or its fields (`open_gguf(path).fields`)."""
        if isinstance(path_or_fields, Mapping):
            fields = path_or_fields
        else:
            from .gguf_io import open_gguf
            fields = open_gguf(Path(path_or_fields)).fields
        tokens = fields.get(_KEY + "tokens")
        if not isinstance(tokens, list) or not tokens:
            raise TokenizerError(f"{_KEY}tokens is missing or empty")
        return cls(tokens, fields.get(_KEY + "token_type"), fields.get(_KEY + "merges") or [],
                   bos_id=fields.get(_KEY + "bos_token_id"), eos_id=fields.get(_KEY + "eos_token_id"),
                   add_bos=fields.get(_KEY + "add_bos_token") is True,
                   add_eos=fields.get(_KEY + "add_eos_token") is True,
                   model=fields.get(_KEY + "model", ""), pre=fields.get(_KEY + "pre", ""))

    @classmethod
    def from_checkpoint(cls, hf_dir: str | Path) -> Tokenizer:
        """From a Hugging Face checkpoint: the vocabulary kimi-convert writes into its GGUF (same ids)."""
        from .convert.converter import _text_config
        from .convert.vocab import load_vocab
        vocab = load_vocab(Path(hf_dir), _text_config(Path(hf_dir)))
        return cls(vocab.tokens, vocab.token_types, vocab.merges, bos_id=vocab.bos_id, eos_id=vocab.eos_id,
                   add_bos=vocab.add_bos, add_eos=vocab.add_eos, model=vocab.model, pre=vocab.pre)

    @staticmethod
    def _text_to_id(texts: list[str]) -> dict[str, int]:
        ids = {t: i for i, t in enumerate(texts)}
        if len(ids) != len(texts):              # llama.cpp asserts on it
            seen: set[str] = set()
            twice = next(t for t in texts if t in seen or seen.add(t))
            raise TokenizerError(f"token text {twice!r} appears twice in the vocabulary")
        return ids

    @staticmethod
    def _merge_ranks(merges: Sequence[str]) -> dict[tuple[bytes, bytes], int]:
        """(left, right) raw bytes -> rank; a merge split at its first space after the first character, the first
        rank of a pair kept; a side that is no byte-level text can never match and is left out."""
        ranks: dict[tuple[bytes, bytes], int] = {}
        for rank, merge in enumerate(merges):
            cut = merge.find(" ", 1)
            left, right = (merge[:cut], merge[cut + 1:]) if cut >= 0 else ("", "")
            pair = (_byte_level_bytes(left), _byte_level_bytes(right))
            if pair[0] and pair[1]:
                ranks.setdefault(pair, rank)
        return ranks

    @staticmethod
    def _user_defined_tokens(texts: list[str], types: Sequence[int]) -> list[tuple[bytes, int]]:
        """(text, id) of the tokens cut out of the text even with parse_special=false, longest first."""
        found = [(t.encode("utf-8"), i) for i, t in enumerate(texts)
                 if types[i] == USER_DEFINED or t in ALWAYS_USER_DEFINED]
        return sorted(found, key=lambda ti: (-len(ti[0]), ti[1]))

    # encoding ----------------------------------------------------------------------------------------------

    def encode(self, text: str | bytes, *, add_special: bool = True) -> np.ndarray:
        """Token ids (int32) of `text` (bytes as they are, str as UTF-8) as common_tokenize(..., add_special,
        parse_special=false) gives them."""
        if isinstance(text, str):
            data = text.encode("utf-8", "surrogatepass")   # a lone surrogate as llama.cpp would read its bytes
        elif isinstance(text, (bytes, bytearray, memoryview)):
            data = bytes(text)
        else:
            raise TypeError(f"text must be str or bytes, not {type(text).__name__}")
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)
        for fragment in self._partition(data) if data else ():
            if isinstance(fragment, int):
                out.append(fragment)
            else:
                self._encode_fragment(fragment, out)
        if add_special and self.add_eos:
            out.append(self.eos_id)
        return np.array(out, dtype=np.int32)

    def _partition(self, data: bytes) -> list[bytes | int]:
        """tokenizer_st_partition: text fragments and the ids of the user-defined tokens between them."""
        fragments: list[bytes | int] = [data]
        for text, token_id in self._user_defined:
            cut: list[bytes | int] = []
            for fragment in fragments:
                if isinstance(fragment, int):
                    cut.append(fragment)
                    continue
                for k, part in enumerate(fragment.split(text)):
                    cut += [token_id] * (k > 0) + [part] * (part != b"")
            fragments = cut
        return fragments

    def _encode_fragment(self, fragment: bytes, out: list[int]) -> None:
        cache = self._cache
        if len(cache) > 1 << 18:               # bounded: a long varied text would otherwise keep every word
            cache.clear()
        for piece in _split(fragment.decode("utf-8", _UTF8_ERRORS)):
            ids = cache.get(piece)
            if ids is None:
                ids = cache[piece] = self._piece_ids(piece.encode("utf-8", "surrogatepass"))
            out += ids

    def _piece_ids(self, piece: bytes) -> tuple[int, ...]:
        ids: list[int] = []
        for part in self._bpe(piece):
            token_id = self._byte_ids.get(part)
            ids += [token_id] if token_id is not None else self._byte_fallback(part)
        return tuple(ids)

    def _byte_fallback(self, part: bytes) -> list[int]:
        """llama.cpp's fallback for a merged part that is no token: each byte of its byte-level UTF-8 text that
        is itself a token text (only ASCII can be)."""
        text = token_to_str(part)
        return [self._text_ids[ch] for ch in text if ch.isascii() and ch in self._text_ids]

    def _bpe(self, piece: bytes) -> list[bytes]:
        """llm_tokenizer_bpe_session's merging: the lowest-ranked adjacent pair first, the leftmost of equal ones,
        from a priority queue whose stale entries (a side merged since) are skipped."""
        parts = [piece[i:i + 1] for i in range(len(piece))]
        n, rank_of, push, pop = len(parts), self._ranks.get, heapq.heappush, heapq.heappop
        nxt = [*range(1, n), -1]
        prv = [*range(-1, n - 1)]
        # (rank, left, right, the merged bytes): the queue orders by rank, then by left index
        queue = [(rank, i, i + 1, parts[i] + parts[i + 1]) for i in range(n - 1)
                 if (rank := rank_of((parts[i], parts[i + 1]))) is not None]
        heapq.heapify(queue)
        while queue:
            _, left, right, text = pop(queue)
            # stale: a side merged since it was queued (a symbol only grows, by taking its right neighbour)
            if not parts[left] or not parts[right] or len(parts[left]) + len(parts[right]) != len(text):
                continue
            parts[left], parts[right] = text, b""
            after = nxt[left] = nxt[right]
            if after >= 0:
                prv[after] = left
                if (rank := rank_of((text, parts[after]))) is not None:
                    push(queue, (rank, left, after, text + parts[after]))
            before = prv[left]
            if before >= 0 and (rank := rank_of((parts[before], text))) is not None:
                push(queue, (rank, before, left, parts[before] + text))
        return [p for p in parts if p]
