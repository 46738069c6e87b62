"""kimi_convert.tokenizer against llama.cpp's own tokenizer: llama-cpp-python 0.3.36 (the pinned Oct-2026 tree).

`Llama.tokenize(data, add_bos=True, special=False)` is `llama_tokenize(vocab, data, add_special=true,
parse_special=false)`, what llama-imatrix's `common_tokenize(ctx, text, true, false)` calls; `vocab_only=True`
loads the vocabulary alone. The K3 fixture's vocabulary (768 ranks learned from an English corpus, then the
specials) has merges among ASCII bytes only, so how non-ASCII text is split barely shows in its ids: the
"probe" vocabulary written here merges '!' and '1' with any following lead byte and any continuation byte with a
following 'q', so that every piece boundary next to a character shows, and with it llama.cpp's class of that
character (letter, number, Han, whitespace, other). llama-cpp-python missing fails these tests (the import).
"""
from __future__ import annotations

import importlib
import inspect
import random
from itertools import pairwise

import gguf
import numpy as np
import pytest

from kimi_convert import tokenizer as tokenizer_mod
from kimi_convert.convert.vocab import token_to_str
from kimi_convert.gguf_io import open_gguf
from kimi_convert.tokenizer import Tokenizer, TokenizerError

SEGMENTS = {
    "prose": "The quick brown fox jumps over the lazy dog. It's 5 o'clock; they'RE late, we'll see -- I'M sure "
             "you'd agree, dogs' toys' 'tis ' s 'll'LL'Ve.\nA second line, then: a list - one, two; three!\n",
    "code": "def f(x):\n\tif x  >  0:\n\t\treturn x ** 2   # square\n    else:\n        return -x\r\n\r\n\n\n    \n"
            "int main(void) { printf(\"%d\\n\", a[i]); }\t\t\n  /* c */ x+=1;//y\n\n\t \n \t",
    "digits": " ".join(str(7 ** k) for k in range(1, 45)) + " 0 00 000 0000 3.14159 1,234,567 v1.0.2 0x1F "
              "\u0661\u0662\u0663\u0664\u0665 \uff11\uff12\uff13\uff14 \u00b2\u00b3 \u216b \u3007 12ab34 a1b2",
    "han": "中文分词测试，汉字與日本語の漢字かな交じり文。한국어 텍스트. 中文abc中1二3 \u3007\u2e80\u2f00 "
           "\U00020000\U0002a700 \U00030000\U00031350 \ufa6e\U0002b73a!\ufa6e 中\u0301 !中 '中 1中 中's",
    "emoji": "🎉🎉 👩\u200d👩\u200d👧\u200d👦 👍🏽 🇫🇷 ❤️ ☃ 🙂🙃\u200d x🎉y 🎉's",
    "accents": "émigré café naïve Ångström Œuvre ß İstanbul e\u0301te\u0301 n\u0303 Zoë x\u0301y \u0301start "
               "ǅungla ﬁne ＡＢＣ",
    "special-token text": "<|end_of_msg|> [BOS] [EOS] <|im_end|> <|reserved_token_800|> <|kimi_image_placeholder|>"
                          "[PAD1023]<|open|>text<|close|> <|endoftext|>",
    "long words": "a" * 3000 + " " + "Supercalifragilistic" * 60 + " " + "=" * 2000 + "\n" + " " * 1500 + "x"
                  + "\t" * 300 + "\u3000" * 50 + "9" * 1000,
    "whitespace": "\u00a0nbsp\u2028line\u2029para\x85nel\x0b\x0c\x1c\x1d\x1e\x1f \u3000\u3000ideo  \u200b zwsp"
                  "\r\r\n\n\r \u00a0 \u1680x\u202f\u205f",
    "other scripts": "Привет, мир! Γειά σου κόσμε. مرحبا بالعالم שלום עולם नमस्ते दुनिया สวัสดีชาวโลก ᚠᚢᚦ 𐌰𐌱 "
                     "\U00011f04\U00011f50 \U0001e4d0",
    "control": "\x00\x01\x7f a\x00b \x1b[31mred\x1b[0m",
}

BAD_UTF8 = [b"", b"\xff\xfe", b"\x80abc", b"ab\xc0\x80cd", b"\xe0\x80\x80", b"\xed\xa0\x80\xed\xbf\xbf x",
            b"\xe3\x81", b"\xf0\x9f\x98", b"x\xe3\x81\x82\x81y", b"\xc3", b" \xc3\xa9\xc3", b"'\xc3\xa9's",
            b"\xf8\x88\x80\x80\x80", b"a\xc1\xbfb \xf0\x8f\xbf\xbf"]

# a character of every class llama.cpp's splitter tells apart, each three bytes long in UTF-8
CLASS_SAMPLES = {"letter": "\u0e01", "number": "\u3021", "Han letter": "中", "Han, unassigned": "\ufa6e",
                 "whitespace": "\u3000", "other": "\u2192"}


def llama_ids(llm, data: bytes) -> np.ndarray:
    # the binding passes add_bos as llama_tokenize's add_special (the BOS itself comes only if the GGUF says so)
    # and special as parse_special
    return np.array(llm.tokenize(data, add_bos=True, special=False), dtype=np.int32)


def vocab_only(path, **kv_overrides):
    import llama_cpp        # llama-cpp-python missing fails the tests that need it (the import)
    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False, kv_overrides=kv_overrides or None)


def assert_same(ours: np.ndarray, theirs: np.ndarray, what: str) -> None:
    if not np.array_equal(ours, theirs):
        n = min(len(ours), len(theirs))
        at = next((i for i in range(n) if ours[i] != theirs[i]), n)
        pytest.fail(f"{what}: {len(ours)} ids vs llama.cpp's {len(theirs)}, first difference at {at}: "
                    f"ours {ours[at:at + 8].tolist()}, llama.cpp {theirs[at:at + 8].tolist()}")


def random_text(seed: int, n: int) -> str:
    """Runs of characters of every class, mixed the way the splitter's rules meet."""
    pool = ["a", "Z", "q", "'", "s", "t", "LL", "re", "1", "23", "!", "=", "/", " ", "  ", "\t", "\n", "\r\n",
            "\r", "é", "e\u0301", "\u0301", "中", "文", "\ufa6e", "\U00030000", "\u3000", "\u00a0", "\x85", "٣",
            "\u2192", "🎉", "\u200d", "\ufffd", "ß", "\x1c", "<|open|>", "[BOS]"]
    rng = random.Random(seed)
    return "".join(rng.choice(pool) * rng.choice((1, 1, 1, 2, 3)) for _ in range(n))


def stdlib_source(n_bytes: int) -> bytes:
    names = ["inspect", "typing", "argparse", "collections", "dataclasses", "enum", "pathlib", "textwrap",
             "json.decoder", "email.message", "http.client", "logging", "difflib", "ast", "tarfile"]
    return "".join(inspect.getsource(importlib.import_module(m)) for m in names).encode()[:n_bytes]


# --- the K3 fixture -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def k3_gguf(converted):
    return converted("k3", "bf16")


@pytest.fixture(scope="module")
def llm(k3_gguf):
    model = vocab_only(k3_gguf)
    yield model
    model.close()


@pytest.fixture(scope="module")
def tok(k3_gguf):
    return Tokenizer.from_gguf(k3_gguf)


@pytest.mark.interop
@pytest.mark.parametrize("name", SEGMENTS)
def test_text_gives_llama_cpps_ids(tok, llm, name):
    data = SEGMENTS[name].encode()
    assert_same(tok.encode(data), llama_ids(llm, data), name)


@pytest.mark.interop
def test_all_segments_and_random_text_in_one_call(tok, llm):
    data = ("".join(SEGMENTS.values()) + random_text(0, 6000)).encode()
    assert_same(tok.encode(data), llama_ids(llm, data), "segments + random text")


@pytest.mark.interop
@pytest.mark.parametrize("data", BAD_UTF8, ids=lambda d: d.hex() or "empty")
def test_invalid_utf8_and_empty_text_give_llama_cpps_ids(tok, llm, data):
    assert_same(tok.encode(data), llama_ids(llm, data), repr(data))


@pytest.mark.interop
def test_200_kb_of_python_source_in_one_call(tok, llm):
    data = stdlib_source(200_000)
    assert len(data) == 200_000
    ours = tok.encode(data)
    assert_same(ours, llama_ids(llm, data), "stdlib source")
    assert np.array_equal(tok.encode(data.decode()), ours)      # str is taken as its UTF-8


def test_special_token_text_is_plain_text(tok):
    """parse_special=false: "<|end_of_msg|>" is its characters' ids, never the control token's."""
    specials = {tok.bos_id, tok.eos_id}
    ids = tok.encode("<|end_of_msg|>[BOS]")
    assert len(ids) > 2 and not specials & set(ids.tolist())


# --- where the vocabulary comes from, and BOS/EOS -------------------------------------------------------------

def test_checkpoint_and_gguf_give_the_same_ids(tok, k3_gguf, k3_dir, k31_dir, converted):
    data = (SEGMENTS["prose"] + SEGMENTS["han"] + random_text(1, 3000)).encode() + stdlib_source(30_000)
    expected = tok.encode(data)
    fields = open_gguf(k3_gguf).fields
    for other in (Tokenizer.from_checkpoint(k3_dir), Tokenizer.from_gguf(fields),
                  Tokenizer.from_gguf(converted("k31", "bf16")), Tokenizer.from_checkpoint(k31_dir)):
        assert (other.n_vocab, other.bos_id, other.add_bos) == (tok.n_vocab, tok.bos_id, tok.add_bos)
        assert np.array_equal(other.encode(data), expected)
    assert tok.n_vocab == len(fields["tokenizer.ggml.tokens"])
    assert (tok.bos_id, tok.add_bos) == (fields["tokenizer.ggml.bos_token_id"], False)


@pytest.mark.interop
@pytest.mark.parametrize("add_bos,add_eos", [(True, False), (False, True), (True, True)])
def test_add_bos_and_add_eos_as_the_gguf_says(k3_gguf, add_bos, add_eos):
    keys = {"tokenizer.ggml.add_bos_token": add_bos, "tokenizer.ggml.add_eos_token": add_eos}
    tok = Tokenizer.from_gguf({**open_gguf(k3_gguf).fields, **keys})
    model = vocab_only(k3_gguf, **keys)
    try:
        for data in (b"", b"hello world", "中文 [BOS]".encode()):
            ours = tok.encode(data)
            assert_same(ours, llama_ids(model, data), repr(data))
            assert (ours[:1].tolist() == [tok.bos_id]) == add_bos and (ours[-1:].tolist() == [tok.eos_id]) == add_eos
            plain = tok.encode(data, add_special=False)
            assert_same(plain, np.array(model.tokenize(data, add_bos=False, special=False), np.int32), repr(data))
    finally:
        model.close()


def test_special_ids_follow_llama_cpps_defaults(tok, k3_gguf):
    fields = {k: v for k, v in open_gguf(k3_gguf).fields.items()
              if k not in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")}
    # no key: llama.cpp's gpt2 default, 11; a key out of range: ignored
    assert Tokenizer.from_gguf({**fields, "tokenizer.ggml.add_bos_token": True}).encode("a")[0] == 11
    out_of_range = Tokenizer.from_gguf({**fields, "tokenizer.ggml.bos_token_id": tok.n_vocab})
    assert out_of_range.bos_id == 11
    tiny = ["a", "b", "c"]
    assert Tokenizer(tiny, None, [], bos_id=2).bos_id == 2
    with pytest.raises(TokenizerError, match="BOS/EOS"):
        Tokenizer(tiny, None, [], add_bos=True)     # 11 is out of range and no id is given: llama.cpp asserts


def test_refuses_what_it_does_not_mirror(tok, k3_gguf):
    fields = open_gguf(k3_gguf).fields
    with pytest.raises(TokenizerError, match="pre-tokenizer 'llama-bpe'"):
        Tokenizer.from_gguf({**fields, "tokenizer.ggml.pre": "llama-bpe"})
    with pytest.raises(TokenizerError, match="appears twice"):
        Tokenizer(["a", "b", "a"], None, [])
    # llama.cpp throws out of llama_tokenize on a code point past U+10FFFF and aborts (not run here: it would
    # kill the test process)
    with pytest.raises(TokenizerError, match=r"U\+110000"):
        tok.encode(b"ok \xf4\x90\x80\x80")


# --- the probe vocabulary: every character's class --------------------------------------------------------------

def write_probe(path, extra: list[tuple[str, int]] = ()) -> None:
    """A vocabulary-only `llama` GGUF with the "kimi-k2" pre-tokenizer, the 256 byte tokens, the merges
    ('!' or '1', any lead byte) and (any continuation byte, 'q'), and `extra` (text, token type) tokens."""
    merges = [f"{token_to_str(x)} {token_to_str(bytes([b]))}" for x in (b"!", b"1") for b in range(0xC0, 0x100)]
    merges += [f"{token_to_str(bytes([b]))} q" for b in range(0x80, 0xC0)]
    tokens = [token_to_str(bytes([b])) for b in range(256)] + [m.replace(" ", "") for m in merges]
    types = [gguf.TokenType.NORMAL] * len(tokens) + [t for _, t in extra]
    write_vocab_gguf(path, tokens + [text for text, _ in extra], merges, types)


def write_vocab_gguf(path, tokens: list[str], merges: list[str], types: list[int] | None = None) -> None:
    """A tensor-less `llama` GGUF holding a "kimi-k2" vocabulary: what llama.cpp's vocab_only load reads."""
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_context_length, 64), (w.add_embedding_length, 64), (w.add_block_count, 1),
                       (w.add_feed_forward_length, 64), (w.add_head_count, 4), (w.add_head_count_kv, 4),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_vocab_size, len(tokens))):
        add(value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("kimi-k2")
    w.add_token_list(tokens)
    if types is not None:
        w.add_token_types(types)
    w.add_token_merges(merges)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


PROBE_EXTRA = [("<|message|>", gguf.TokenType.CONTROL), ("<|ud|>", gguf.TokenType.USER_DEFINED),
               ("<|ud|>!", gguf.TokenType.USER_DEFINED), ("<|ctl|>", gguf.TokenType.CONTROL)]


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    path = tmp_path_factory.mktemp("probe") / "probe.gguf"
    write_probe(path, PROBE_EXTRA)
    model = vocab_only(path)
    yield Tokenizer.from_gguf(path), model
    model.close()


def probe_text(chars) -> bytes:
    """Per character c, "!cq" and "1cq": a letter joins both neighbours after '!', a number joins '1', a Han
    letter neither, Han not assigned joins '!' only, whitespace and the rest lead the 'q' word (the rest joins a
    '!' before it). Surrogates go in as llama.cpp reads their three bytes: as code points of their own."""
    return "".join(f"!{c}q\n1{c}q\n" for c in chars).encode("utf-8", "surrogatepass")


@pytest.mark.interop
def test_the_probe_tells_every_class_apart(probe):
    tok, _ = probe
    signatures = {name: tuple(i >= 256 for i in tok.encode(probe_text(c)).tolist())
                  for name, c in CLASS_SAMPLES.items()}
    assert len(set(signatures.values())) == len(CLASS_SAMPLES), signatures


def probe_code_points() -> list[int]:
    """The whole BMP past ASCII (surrogates included); above it every code point the tokenizer's Unicode tables
    name, and their edges, and every 97th of the rest."""
    named = [*tokenizer_mod._LN_ADDED_IN_15, *((lo, hi, "") for lo, hi in tokenizer_mod._LN_ADDED_AFTER_15_1),
             *((lo, hi, "") for lo, hi in tokenizer_mod._HAN_RANGES)]
    chosen = set(range(0x80, 0x10000)) | set(range(0x10000, 0x110000, 97))
    for lo, hi, _ in named:
        chosen |= set(range(lo - 1, hi + 2)) if hi - lo < 8000 else {lo - 1, lo, hi, hi + 1, *range(lo, hi, 7)}
    return sorted(c for c in chosen if c <= 0x10FFFF)


@pytest.mark.interop
def test_every_class_of_character_is_llama_cpps(probe):
    tok, model = probe
    data = probe_text(map(chr, probe_code_points()))
    assert_same(tok.encode(data), llama_ids(model, data), "probe text")


@pytest.mark.interop
def test_user_defined_tokens_are_cut_out_even_without_special_parsing(probe):
    """Type USER_DEFINED and the names llama.cpp makes user-defined (<|message|>): cut out first, longest
    first, each side decoded on its own; a control token (<|ctl|>) stays text."""
    tok, model = probe
    data = "a<|ud|>!b<|message|><|ctl|> <|ud|><|ud|>x中<|ud|>".encode() + b"\xe3<|ud|>\x81 q<|message|>"
    ours = tok.encode(data)
    assert_same(ours, llama_ids(model, data), repr(data))
    ud, ud_bang, message = (tok.n_vocab - len(PROBE_EXTRA) + i for i in (1, 2, 0))
    assert ours.tolist().count(ud) == 4 and ours.tolist().count(ud_bang) == 1 and ours.tolist().count(message) == 2


# --- byte-pair merging ------------------------------------------------------------------------------------------

def greedy_bpe(ranks: dict[tuple[bytes, bytes], int], word: bytes) -> list[bytes]:
    """The reference: merge the lowest-ranked adjacent pair, the leftmost of equal ones, until none is left."""
    parts = [word[i:i + 1] for i in range(len(word))]
    while True:
        found = [(ranks[p], i) for i, p in enumerate(pairwise(parts)) if p in ranks]
        if not found:
            return parts
        _, i = min(found)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


RANDOM_ALPHABET = ["a", "b", "s", "S", "'", "1", "2", " ", " ", "\n", "\r", "\t", "!", "=", "中", "é", "\u3000"]


def random_vocab(seed: int) -> tuple[list[str], list[str], str]:
    """A text over RANDOM_ALPHABET and merges "trained" on its bytes by merging a random adjacent pair of the
    current parts each step (across any class or character boundary), listed in a random order (a merge may then
    need a part ranked after it, which no learned list does); the token list misses a fifth of the merged texts
    (llama.cpp then falls back to byte tokens)."""
    rng = random.Random(seed)
    text = "".join(rng.choice(RANDOM_ALPHABET) * rng.choice((1, 1, 2, 4)) for _ in range(3000))
    parts, merges = [bytes([b]) for b in text.encode()], []
    for _ in range(250):
        i = rng.randrange(len(parts) - 1)
        pair = (parts[i], parts[i + 1])
        merges.append(f"{token_to_str(pair[0])} {token_to_str(pair[1])}")
        merged, k = [], 0
        while k < len(parts):
            if tuple(parts[k:k + 2]) == pair:
                merged.append(pair[0] + pair[1])
                k += 2
            else:
                merged.append(parts[k])
                k += 1
        parts = merged
    rng.shuffle(merges)
    tokens = [token_to_str(bytes([b])) for b in range(256)]
    tokens += sorted({m.replace(" ", "") for m in merges if rng.random() < 0.8} - set(tokens))
    return tokens, merges, text


@pytest.mark.interop
@pytest.mark.parametrize("seed", range(3))
def test_merging_is_the_greedy_reference_and_llama_cpps(tmp_path, seed):
    tokens, merges, text = random_vocab(seed)
    tok = Tokenizer(tokens, None, merges)
    for piece in tokenizer_mod._split(text):
        assert tok._bpe(piece.encode()) == greedy_bpe(tok._ranks, piece.encode()), piece
    path = tmp_path / "random.gguf"
    write_vocab_gguf(path, tokens, merges)
    model = vocab_only(path)
    try:
        assert_same(tok.encode(text), llama_ids(model, text.encode()), f"random merges, seed {seed}")
        assert np.array_equal(Tokenizer.from_gguf(path).encode(text), tok.encode(text))
    finally:
        model.close()
