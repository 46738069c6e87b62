"""The GGUF tokenizer for Kimi-K3, built from the checkpoint's own files.

No transformers, tiktoken or remote code: `tiktoken.model` is a plain text table
("base64(bytes) rank" per line), and the Kimi tokenizer is a GPT-2 style byte-level
BPE over it, so everything llama.cpp needs can be derived with the stdlib:

- ranked tokens become GPT-2 byte->unicode strings, their id being their rank;
- the merge list is recovered from the ranks (tiktoken files store no merges): a
  token's merge is the last step of running BPE over its bytes with only the
  merges ranked below it;
- the 256 ids after the ranked tokens are the tokenizer's special tokens, named from
  `added_tokens_decoder` or `<|reserved_token_{id}|>`, all CONTROL (the Kimi
  tokenizer treats the whole range as special, whatever the `special` flag says);
- ids past that, up to the model's vocab_size, are `[PAD{id}]` UNUSED fillers,
  because llama.cpp takes n_vocab from the token list and the embedding has
  vocab_size rows.

This reproduces what llama.cpp's converter writes for Kimi-K3 (pre "kimi-k2"), with
eos = the config's `<|end_of_msg|>` (the turn terminator), not the tokenizer's [EOS].
"""
from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import gguf

from .chat_template import K3_CHAT_TEMPLATE
from .checkpoint import CHAT_TEMPLATE_FILE, TIKTOKEN_FILE, TOKENIZER_CONFIG_FILE
from ..inputs import read_input, read_json
from ..errors import KimiError

MAX_TOKENIZER_FILE_BYTES = 256 << 20     # read whole: the real K3's tiktoken.model is 2.8 MB, its config 0.2 MB

# the Kimi tokenizer reserves this many special ids right after the ranked tokens
N_RESERVED_SPECIAL = 256

NORMAL = int(gguf.TokenType.NORMAL)
CONTROL = int(gguf.TokenType.CONTROL)
UNUSED = int(gguf.TokenType.UNUSED)


class VocabError(KimiError):
    """The tokenizer files are missing, malformed or disagree with the config."""


# --- special tokens: the one table of the ids a GGUF may name ---------------------

@dataclass(frozen=True)
class SpecialKey:
    key: str                    # the GGUF key (gguf-py's Keys.Tokenizer), a UINT32 to src/llama-vocab.cpp
    hf: str | None              # config.json's `{hf}_token_id` and tokenizer_config.json's `{hf}_token`
    k3_text: str | None = None  # the token it names in Kimi-K3's tokenizer (k3-hf-format.md, k3-chat-format.md)
    written: bool = False       # kimi-convert writes it (Vocab.special_ids) when config.json names the id


_K = gguf.Keys.Tokenizer
END_OF_MESSAGE = "<|end_of_msg|>"
SPECIAL_KEYS = (
    SpecialKey(_K.BOS_ID, "bos", "[BOS]", written=True),
    # the config's eos, the turn terminator; not the tokenizer's [EOS], the document terminator, after which a
    # chat would never stop at the end of a turn (llama.cpp's K3 converter restores it over kimi-linear's [EOS])
    SpecialKey(_K.EOS_ID, "eos", END_OF_MESSAGE, written=True),
    SpecialKey(_K.PAD_ID, "pad", "[PAD]", written=True),
    SpecialKey(_K.UNK_ID, "unk", written=True),
    # llama.cpp's converter also writes these when config.json names them (gguf.SpecialVocab)
    SpecialKey(_K.SEP_ID, "sep"),
    SpecialKey(_K.MASK_ID, "mask"),
    # K3 ends every message and every turn with its eos: an end-of-turn or end-of-message id must be that one
    SpecialKey(_K.EOT_ID, "eos", END_OF_MESSAGE),
    SpecialKey(_K.EOM_ID, "eos", END_OF_MESSAGE),
    # K3 has no fill-in-the-middle tokens: such a key can only be checked against the vocabulary
    *(SpecialKey(k, None) for k in (_K.FIM_PRE_ID, _K.FIM_SUF_ID, _K.FIM_MID_ID, _K.FIM_PAD_ID, _K.FIM_REP_ID,
                                    _K.FIM_SEP_ID, _K.PREFIX_ID, _K.SUFFIX_ID, _K.MIDDLE_ID)),
)


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]
    token_types: list[int]
    ranks: list[bytes] = field(repr=False)    # the ranked tokens, from which `merges` is recovered
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    chat_template: str
    pre: str = "kimi-k2"
    model: str = "gpt2"
    # llama.cpp's "kimi-k2" pre-tokenizer adds no BOS by default; written explicitly
    add_bos: bool = False
    add_eos: bool = False
    hf_tokens: dict[str, str] = field(default_factory=dict, repr=False)   # tokenizer_config's `{kind}_token`s

    @property
    def special_ids(self) -> dict[str, int]:
        """GGUF key -> id of every special token this vocabulary writes (the config's ids)."""
        ids = {s.key: getattr(self, f"{s.hf}_id") for s in SPECIAL_KEYS if s.written}
        return {key: token_id for key, token_id in ids.items() if token_id is not None}

    @cached_property
    def merges(self) -> list[str]:
        """Recovered on first use, when the file is written (4 s of CPU for the real 163,584 ranks):
        a dry run never needs them, and their recovery can fail on nothing."""
        return reconstruct_merges(self.ranks)


# --- public API -------------------------------------------------------------------


def load_vocab(hf_dir: Path, text_config: dict) -> Vocab:
    """Build the GGUF tokenizer of the checkpoint in `hf_dir`.

    `text_config` supplies vocab_size and bos/eos/pad(/unk)_token_id (the HF
    `text_config` of config.json). Raises VocabError with one line naming the file.
    """
    hf_dir = Path(hf_dir)
    ranks = read_tiktoken(hf_dir / TIKTOKEN_FILE)
    tok_config = _read_tokenizer_config(hf_dir / TOKENIZER_CONFIG_FILE)
    n_vocab = _vocab_size(text_config, len(ranks))
    specials = _special_tokens(tok_config, len(ranks), n_vocab, hf_dir / TOKENIZER_CONFIG_FILE)

    tokens, types = _token_table(ranks, specials, n_vocab)
    return Vocab(
        tokens=tokens,
        token_types=types,
        ranks=ranks,
        bos_id=_special_id(text_config, "bos", n_vocab),
        eos_id=_special_id(text_config, "eos", n_vocab),
        pad_id=_special_id(text_config, "pad", n_vocab),
        unk_id=_special_id(text_config, "unk", n_vocab),
        chat_template=_chat_template(hf_dir, tok_config),
        add_bos=_flag(tok_config, "add_bos_token"),
        add_eos=_flag(tok_config, "add_eos_token"),
        hf_tokens=_named_specials(tok_config),
    )


@dataclass(frozen=True)
class ExpectedSpecial:
    """What one special-token key of a GGUF must say."""
    key: str
    token_id: int | None        # None: no id is fixed, only the text (if known) and the range
    text: str | None            # the token's text, where known
    required: bool              # a file without the key fails
    source: str                 # where the expectation comes from, for the failure line


def checkpoint_specials(hf_dir: Path, text_config: dict) -> list[ExpectedSpecial]:
    """Every key of SPECIAL_KEYS as a GGUF converted from `hf_dir` must hold it, by our converter or llama.cpp's:
    the id config.json names (`text_config` as load_vocab takes it) and the checkpoint's token at it; where the
    config names none, the token tokenizer_config.json names, if any. The keys kimi-convert writes are required."""
    vocab = load_vocab(hf_dir, text_config)
    out = []
    for s in SPECIAL_KEYS:
        token_id = _special_id(text_config, s.hf, len(vocab.tokens)) if s.hf else None
        if token_id is not None:
            out.append(ExpectedSpecial(s.key, token_id, vocab.tokens[token_id], s.written,
                                       f"config.json {s.hf}_token_id"))
        elif s.hf in vocab.hf_tokens:
            out.append(ExpectedSpecial(s.key, None, vocab.hf_tokens[s.hf], False, f"{TOKENIZER_CONFIG_FILE} "
                                                                                   f"{s.hf}_token"))
        else:
            out.append(ExpectedSpecial(s.key, None, None, False, "the vocabulary"))
    return out


def k3_specials() -> list[ExpectedSpecial]:
    """The same without a checkpoint: each key names Kimi-K3's token where the release fixes it; the eos
    (what ends generation) is required."""
    return [ExpectedSpecial(s.key, None, s.k3_text, s.key == _K.EOS_ID,
                            "Kimi-K3's tokenizer" if s.k3_text else "the vocabulary") for s in SPECIAL_KEYS]


def write_vocab(vocab: Vocab, writer: gguf.GGUFWriter) -> None:
    """Add the tokenizer.ggml.* and tokenizer.chat_template keys to `writer`."""
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    writer.add_token_merges(vocab.merges)
    for key, token_id in vocab.special_ids.items():
        writer.add_uint32(key, token_id)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)
    writer.add_chat_template(vocab.chat_template)


# --- tiktoken.model ---------------------------------------------------------------


def read_tiktoken(path: Path) -> list[bytes]:
    """The ranked tokens of a tiktoken file, indexed by rank (ranks must be 0..n-1)."""
    text = read_input(path, MAX_TOKENIZER_FILE_BYTES, VocabError, missing="missing (the tokenizer's ranked tokens)")
    if not text.isascii():
        raise VocabError(f"{path}: not ASCII (a tiktoken file is base64 and ranks)")

    by_rank: dict[int, bytes] = {}
    seen: dict[bytes, int] = {}
    for line_no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        token, rank = _parse_tiktoken_line(path, line_no, line)
        if rank in by_rank:
            raise VocabError(f"{path}:{line_no}: duplicate rank {rank}")
        if token in seen:
            raise VocabError(f"{path}:{line_no}: token {token!r} already has rank {seen[token]}")
        by_rank[rank] = token
        seen[token] = rank
    return _ranks_to_list(path, by_rank)


def _parse_tiktoken_line(path: Path, line_no: int, line: str) -> tuple[bytes, int]:
    parts = line.split()
    if len(parts) != 2:
        raise VocabError(f"{path}:{line_no}: expected 'base64 rank', got {line[:60]!r}")
    try:
        token = base64.b64decode(parts[0], validate=True)
        rank = int(parts[1])
    except (binascii.Error, ValueError):
        raise VocabError(f"{path}:{line_no}: bad base64 token or rank in {line[:60]!r}") from None
    if not token or rank < 0:
        raise VocabError(f"{path}:{line_no}: empty token or negative rank in {line[:60]!r}")
    return token, rank


def _ranks_to_list(path: Path, by_rank: dict[int, bytes]) -> list[bytes]:
    # ids are ranks and the special ids start at len(ranks), so a gap would shift them
    n = len(by_rank)
    if n == 0:
        raise VocabError(f"{path}: no tokens")
    if max(by_rank) != n - 1:
        missing = next(r for r in range(n) if r not in by_rank)
        raise VocabError(f"{path}: ranks are not 0..{n - 1}: rank {missing} is missing")
    ranks = [by_rank[r] for r in range(n)]
    singles = {t for t in ranks if len(t) == 1}
    if len(singles) != 256:
        missing = next(b for b in range(256) if bytes([b]) not in singles)
        raise VocabError(f"{path}: byte 0x{missing:02x} has no token (byte-level BPE needs all 256)")
    return ranks


# --- merges -----------------------------------------------------------------------


def reconstruct_merges(ranks: list[bytes]) -> list[str]:
    """GPT-2 merges ("left right", in rank order) recovered from the ranked tokens."""
    rank_of = {token: rank for rank, token in enumerate(ranks)}
    merges = []
    for rank, token in enumerate(ranks):
        if len(token) < 2:
            continue
        parts = bpe_parts(rank_of, token, rank)
        # a token not built from exactly two lower-ranked tokens has no merge
        # (llama.cpp's converter skips it the same way)
        if len(parts) == 2:
            merges.append(f"{token_to_str(parts[0])} {token_to_str(parts[1])}")
    return merges


def bpe_parts(rank_of: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """BPE over `token`'s bytes, applying only merges ranked below `max_rank`: the lowest-ranked
    adjacent pair is merged first, the leftmost of equal ones. The pair ranks are kept and only the
    two next to a merge looked up again (4 s -> 3 s for the real 163,584 ranks)."""
    parts = [_SINGLE_BYTES[b] for b in token]
    get = rank_of.get
    ranks = [get(a + b, max_rank) for a, b in zip(parts, parts[1:])]
    while ranks:
        best = min(ranks)
        if best >= max_rank:
            break
        i = ranks.index(best)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
        del ranks[i]
        if i < len(ranks):
            ranks[i] = get(parts[i] + parts[i + 1], max_rank)
        if i:
            ranks[i - 1] = get(parts[i - 1] + parts[i], max_rank)
    return parts


_SINGLE_BYTES = tuple(bytes([b]) for b in range(256))


@lru_cache(maxsize=1)
def _byte_to_unicode() -> tuple[str, ...]:
    # GPT-2's reversible map: printable latin-1 bytes stand for themselves, the
    # rest are shifted to 256+ so no token string holds spaces or control chars
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table: dict[int, str] = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shift)
            shift += 1
    return tuple(table[b] for b in range(256))


def token_to_str(token: bytes) -> str:
    """The GPT-2 byte-level string of raw token bytes (latin-1 maps byte b to code point b)."""
    return token.decode("latin-1").translate(_unicode_table())


@lru_cache(maxsize=1)
def _unicode_table() -> dict[int, str]:
    return dict(enumerate(_byte_to_unicode()))


# --- special tokens and the token table ------------------------------------------


def _read_tokenizer_config(path: Path) -> dict:
    config = read_json(path, MAX_TOKENIZER_FILE_BYTES, VocabError, missing="missing (it names the special tokens)")
    if not isinstance(config, dict):
        raise VocabError(f"{path}: expected a JSON object")
    return config


def _vocab_size(text_config: dict, n_ranked: int) -> int:
    n_vocab = text_config.get("vocab_size")
    if not isinstance(n_vocab, int) or isinstance(n_vocab, bool):
        raise VocabError(f"config.json: text_config.vocab_size is missing or not an integer ({n_vocab!r})")
    if n_vocab < n_ranked:
        raise VocabError(f"config.json: vocab_size {n_vocab} is smaller than the "
                         f"{n_ranked} ranked tokens of {TIKTOKEN_FILE}")
    return n_vocab


def _special_tokens(config: dict, n_ranked: int, n_vocab: int, path: Path) -> dict[int, str]:
    """id -> content of the special tokens: the reserved range plus named added tokens."""
    named = _added_tokens(config, path)
    for token_id, content in named.items():
        if token_id < n_ranked:
            raise VocabError(f"{path}: added token {content!r} has id {token_id}, "
                             f"which belongs to the {n_ranked} ranked tokens")
        if token_id >= n_vocab:
            raise VocabError(f"{path}: added token {content!r} has id {token_id}, "
                             f"beyond vocab_size {n_vocab}")
    reserved = range(n_ranked, min(n_ranked + N_RESERVED_SPECIAL, n_vocab))
    specials = {i: f"<|reserved_token_{i}|>" for i in reserved}
    # named ids past the reserved range are not special to the Kimi tokenizer, but
    # they are still markup, so they stay CONTROL rather than become [PAD] fillers
    specials.update(named)
    return specials


def _added_tokens(config: dict, path: Path) -> dict[int, str]:
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise VocabError(f"{path}: added_tokens_decoder is not an object")
    named: dict[int, str] = {}
    owner: dict[str, int] = {}
    for key, entry in decoder.items():
        content = entry.get("content") if isinstance(entry, dict) else entry
        try:
            token_id = int(key)
        except ValueError:
            raise VocabError(f"{path}: added_tokens_decoder key {key!r} is not an id") from None
        if not isinstance(content, str) or not content:
            raise VocabError(f"{path}: added token {token_id} has no content")
        if content in owner:
            raise VocabError(f"{path}: added token {content!r} is listed for ids {owner[content]} and {token_id}")
        owner[content] = token_id
        named[token_id] = content
    return named


def _token_table(ranks: list[bytes], specials: dict[int, str], n_vocab: int) -> tuple[list[str], list[int]]:
    tokens = [token_to_str(t) for t in ranks]
    types = [NORMAL] * len(ranks)
    for i in range(len(ranks), n_vocab):
        content = specials.get(i)
        tokens.append(content if content is not None else f"[PAD{i}]")
        types.append(CONTROL if content is not None else UNUSED)
    return tokens, types


def _special_id(text_config: dict, kind: str, n_vocab: int) -> int | None:
    token_id = text_config.get(f"{kind}_token_id")
    if token_id is None:
        return None
    if isinstance(token_id, list) and token_id:
        token_id = token_id[0]          # HF allows a list of eos ids; the first is the main one
    if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < n_vocab:
        raise VocabError(f"config.json: {kind}_token_id {token_id!r} is not an id below vocab_size {n_vocab}")
    return token_id


def _named_specials(config: dict) -> dict[str, str]:
    """kind -> text of tokenizer_config.json's `{kind}_token` entries (a string, or an added-token object)."""
    named = {}
    for kind in {s.hf for s in SPECIAL_KEYS if s.hf}:
        entry = config.get(f"{kind}_token")
        text = entry.get("content") if isinstance(entry, dict) else entry
        if isinstance(text, str) and text:
            named[kind] = text
    return named


def _flag(config: dict, key: str) -> bool:
    value = config.get(key)
    return value if isinstance(value, bool) else False


def _chat_template(hf_dir: Path, config: dict) -> str:
    """The checkpoint's own template if it has one (tokenizer_config, then
    chat_template.jinja, as llama.cpp looks), else ours."""
    template: Any = config.get("chat_template")
    if isinstance(template, list):      # HF named templates: keep the default one
        template = next((t.get("template") for t in template
                         if isinstance(t, dict) and t.get("name") == "default"), None)
    if isinstance(template, str) and template.strip():
        return template
    jinja_file = hf_dir / CHAT_TEMPLATE_FILE
    if os.path.lexists(jinja_file):         # there: a regular file (a FIFO or a folder is refused, naming it)
        return read_input(jinja_file, MAX_TOKENIZER_FILE_BYTES, VocabError)
    return K3_CHAT_TEMPLATE
