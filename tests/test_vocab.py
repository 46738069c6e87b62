"""kimi_convert.convert.vocab and kimi_convert.convert.chat_template on a tiny synthetic checkpoint.

The tiktoken.model here is learned by a small deterministic BPE trainer, so the
merges it was trained with are known and the reconstruction can be checked
exactly. Chat renderings are compared with strings written from the format rules
(/work/shared/reference/k3-chat-format.md), not produced by the template.
"""
from __future__ import annotations

import base64
import json
import os
import random
import signal
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest
from jinja2 import Environment
from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kimi_convert.convert.chat_template import K3_CHAT_TEMPLATE
from kimi_convert.convert.vocab import (
    CONTROL, NORMAL, UNUSED, VocabError, bpe_parts, load_vocab, read_tiktoken,
    reconstruct_merges, token_to_str, write_vocab,
)

CORPUS = (b"the cat sat on the mat. the rat ate the hat and the cat ate the rat. "
          b"a fat cat is a happy cat; that hat is the cat's hat.\n") * 3
N_MERGES = 40
N_PAD = 4                     # vocab_size exceeds ranked + reserved by this many fillers


# --- the synthetic checkpoint -----------------------------------------------------


def train_bpe(corpus: bytes, n_merges: int) -> tuple[list[bytes], list[tuple[bytes, bytes]]]:
    """Byte-level BPE over space-led words: ranked tokens and the pairs merged."""
    words = Counter(corpus.replace(b" ", b"\0 ").split(b"\0"))
    seqs = {w: [w[i:i + 1] for i in range(len(w))] for w in words if w}
    ranks = [bytes([b]) for b in range(256)]
    pairs: list[tuple[bytes, bytes]] = []
    for _ in range(n_merges):
        counts: Counter = Counter()
        for w, seq in seqs.items():
            for a, b in zip(seq, seq[1:]):
                counts[a, b] += words[w]
        if not counts:
            break
        # most frequent pair; ties go to the smallest bytes so the run is deterministic
        (a, b), _ = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        pairs.append((a, b))
        ranks.append(a + b)
        for w, seq in seqs.items():
            out, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and seq[i] == a and seq[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            seqs[w] = out
    return ranks, pairs


RANKS, TRAINED_PAIRS = train_bpe(CORPUS, N_MERGES)
N_RANKED = len(RANKS)
BOS, EOS_TOK, END_OF_MSG, OPEN, CLOSE, SEP = range(N_RANKED, N_RANKED + 6)
UNK, PAD = N_RANKED + 254, N_RANKED + 255
VOCAB_SIZE = N_RANKED + 256 + N_PAD

ADDED = {
    BOS: "[BOS]", EOS_TOK: "[EOS]", END_OF_MSG: "<|end_of_msg|>",
    OPEN: "<|open|>", CLOSE: "<|close|>", SEP: "<|sep|>", UNK: "[UNK]", PAD: "[PAD]",
}
NOT_SPECIAL = {OPEN, CLOSE, SEP}      # as in K3's tokenizer_config: special=false on markup


def tiktoken_lines(ranks: list[bytes]) -> list[str]:
    return [f"{base64.b64encode(t).decode()} {r}" for r, t in enumerate(ranks)]


def write_checkpoint(root: Path, lines: list[str] | None = None, added: dict | None = None,
                     extra_config: dict | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if lines is None:
        lines = tiktoken_lines(RANKS)
        random.Random(0).shuffle(lines)      # ids come from the ranks, not the line order
    (root / "tiktoken.model").write_text("\n".join(lines) + "\n", encoding="ascii")
    decoder = {str(i): {"content": c, "special": i not in NOT_SPECIAL}
               for i, c in (ADDED if added is None else added).items()}
    config = {"tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]", "eos_token": "[EOS]",
              "added_tokens_decoder": decoder, **(extra_config or {})}
    (root / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return root


def text_config(**over) -> dict:
    return {"vocab_size": VOCAB_SIZE, "bos_token_id": BOS, "eos_token_id": END_OF_MSG,
            "pad_token_id": PAD, **over}


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    return load_vocab(write_checkpoint(tmp_path_factory.mktemp("k3")), text_config())


# --- tokens -----------------------------------------------------------------------


def test_token_count_matches_vocab_size(vocab):
    assert len(vocab.tokens) == len(vocab.token_types) == VOCAB_SIZE
    assert (vocab.model, vocab.pre) == ("gpt2", "kimi-k2")


def test_byte_tokens_use_the_gpt2_byte_map(vocab):
    assert vocab.tokens[ord("a")] == "a" and vocab.tokens[ord("!")] == "!"
    assert vocab.tokens[ord(" ")] == "Ġ" and vocab.tokens[ord("\n")] == "Ċ"
    assert vocab.tokens[0] == "Ā" and vocab.tokens[0x7F] == "ġ" and vocab.tokens[0xAD] == "Ń"
    assert vocab.tokens[0xE9] == "é"
    assert len(set(vocab.tokens[:256])) == 256


def test_ranked_tokens_are_normal_and_byte_mapped(vocab):
    for rank, token in enumerate(RANKS):
        assert vocab.tokens[rank] == token_to_str(token)
    assert vocab.token_types[:N_RANKED] == [NORMAL] * N_RANKED
    assert vocab.tokens[RANKS.index(b" the")] == "Ġthe"


def test_special_range_is_control_and_the_rest_is_padding(vocab):
    for token_id, content in ADDED.items():         # special=false markup included
        assert (vocab.tokens[token_id], vocab.token_types[token_id]) == (content, CONTROL)
    free = N_RANKED + 100
    assert (vocab.tokens[free], vocab.token_types[free]) == (f"<|reserved_token_{free}|>", CONTROL)
    assert vocab.token_types[N_RANKED:N_RANKED + 256] == [CONTROL] * 256
    pads = range(N_RANKED + 256, VOCAB_SIZE)
    assert [vocab.tokens[i] for i in pads] == [f"[PAD{i}]" for i in pads]
    assert [vocab.token_types[i] for i in pads] == [UNUSED] * N_PAD


def test_special_ids_come_from_the_config(vocab):
    # eos is the turn terminator from config.json, not the tokenizer's [EOS]
    assert vocab.tokens[vocab.eos_id] == "<|end_of_msg|>" and vocab.eos_id != EOS_TOK
    assert (vocab.bos_id, vocab.pad_id, vocab.unk_id) == (BOS, PAD, None)
    assert (vocab.add_bos, vocab.add_eos) == (False, False)


# --- merges -----------------------------------------------------------------------


def test_merges_are_the_trained_ones(vocab):
    assert vocab.merges == [f"{token_to_str(a)} {token_to_str(b)}" for a, b in TRAINED_PAIRS]


def test_every_merge_joins_two_tokens_into_a_token(vocab):
    known = set(vocab.tokens[:N_RANKED])
    assert len(vocab.merges) == N_RANKED - 256
    for merge in vocab.merges:
        left, right = merge.split(" ")
        assert left in known and right in known and left + right in known


def test_lower_ranked_merge_wins():
    # "bc" (256) ranks below "ab" (257), so "abc" is "a" + "bc", not "ab" + "c"
    ranks = [bytes([b]) for b in range(256)] + [b"bc", b"ab", b"abc", b"abcab"]
    assert reconstruct_merges(ranks) == ["b c", "a b", "a bc", "abc ab"]
    rank_of = {t: r for r, t in enumerate(ranks)}
    assert bpe_parts(rank_of, b"abc", max_rank=257) == [b"a", b"bc"]
    assert bpe_parts(rank_of, b"abc", max_rank=256) == [b"a", b"b", b"c"]


def test_a_token_without_a_two_part_split_has_no_merge():
    # "xyz" cannot be built from two lower-ranked tokens ("xy"/"yz" do not exist)
    ranks = [bytes([b]) for b in range(256)] + [b"xyz"]
    assert reconstruct_merges(ranks) == []


# --- errors -----------------------------------------------------------------------


def test_corrupt_line_names_file_and_line(tmp_path):
    lines = tiktoken_lines(RANKS)
    lines[3] = "not*base64 3"
    root = write_checkpoint(tmp_path, lines=lines)
    with pytest.raises(VocabError, match=r"tiktoken\.model:4: ") as err:
        load_vocab(root, text_config())
    assert str(root / "tiktoken.model") in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("edit, message", [
    (lambda ls: ls + [f"{base64.b64encode(b'zz').decode()} 3"], r":\d+: duplicate rank 3"),
    (lambda ls: ls + [f"{base64.b64encode(b'a').decode()} {len(ls)}"], r"already has rank"),
    (lambda ls: ls[:-1] + [ls[-1].split()[0] + f" {len(ls) + 5}"], r"rank \d+ is missing"),
    (lambda ls: ls + ["YWJj"], r":\d+: expected 'base64 rank'"),
    (lambda ls: ls + ["YWJj x"], r"bad base64 token or rank"),
    (lambda ls: ls[1:] + [f"{base64.b64encode(bytes(2)).decode()} 0"], r"byte 0x00 has no token"),
])
def test_bad_tiktoken_files(tmp_path, edit, message):
    root = write_checkpoint(tmp_path, lines=edit(tiktoken_lines(RANKS)))
    with pytest.raises(VocabError, match=message):
        load_vocab(root, text_config())


def test_missing_files(tmp_path):
    with pytest.raises(VocabError, match=r"tiktoken\.model: missing"):
        load_vocab(tmp_path, text_config())
    root = write_checkpoint(tmp_path)
    (root / "tokenizer_config.json").unlink()
    with pytest.raises(VocabError, match=r"tokenizer_config\.json: missing"):
        load_vocab(root, text_config())
    (root / "tokenizer_config.json").write_text("{nope")
    with pytest.raises(VocabError, match=r"tokenizer_config\.json: not valid JSON"):
        load_vocab(root, text_config())


@pytest.mark.parametrize("name", ["tiktoken.model", "tokenizer_config.json", "chat_template.jinja"])
@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_tokenizer_file_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path, name, kind):
    # a FIFO that no process writes blocked a plain open() forever (the checkpoint's shards were fixed alike)
    root = write_checkpoint(tmp_path)
    path = root / name
    path.unlink(missing_ok=True)
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    previous = signal.signal(signal.SIGALRM, lambda *_: pytest.fail(f"reading {name} blocked"))
    signal.alarm(20)
    try:
        with pytest.raises(VocabError) as err:
            load_vocab(root, text_config())
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    what = "a FIFO (named pipe)" if kind == "fifo" else "a folder"
    assert str(err.value) == f"{path}: is {what}, not a regular file"


def test_bad_special_ids(tmp_path):
    root = write_checkpoint(tmp_path, added={**ADDED, VOCAB_SIZE: "<|late|>"})
    with pytest.raises(VocabError, match=r"tokenizer_config\.json: .*'<\|late\|>'.* beyond vocab_size"):
        load_vocab(root, text_config())
    root = write_checkpoint(tmp_path, added={**ADDED, 5: "<|early|>"})
    with pytest.raises(VocabError, match=r"belongs to the \d+ ranked tokens"):
        load_vocab(root, text_config())
    root = write_checkpoint(tmp_path, added={**ADDED, N_RANKED + 9: "[BOS]"})
    with pytest.raises(VocabError, match=r"'\[BOS\]' is listed for ids"):
        load_vocab(root, text_config())
    root = write_checkpoint(tmp_path)
    with pytest.raises(VocabError, match=r"config\.json: eos_token_id"):
        load_vocab(root, text_config(eos_token_id=VOCAB_SIZE))
    with pytest.raises(VocabError, match=r"vocab_size 10 is smaller"):
        load_vocab(root, text_config(vocab_size=10))


def test_read_tiktoken_orders_by_rank(tmp_path):
    root = write_checkpoint(tmp_path)
    assert read_tiktoken(root / "tiktoken.model") == RANKS


# --- chat template selection --------------------------------------------------------


def test_our_template_is_used_when_the_checkpoint_has_none(vocab):
    assert vocab.chat_template == K3_CHAT_TEMPLATE


def test_the_checkpoint_template_wins(tmp_path):
    root = write_checkpoint(tmp_path / "a", extra_config={"chat_template": "{{ 'mine' }}"})
    assert load_vocab(root, text_config()).chat_template == "{{ 'mine' }}"
    root = write_checkpoint(tmp_path / "b")
    (root / "chat_template.jinja").write_text("{{ 'file' }}")
    assert load_vocab(root, text_config()).chat_template == "{{ 'file' }}"


def test_add_bos_follows_tokenizer_config(tmp_path):
    root = write_checkpoint(tmp_path, extra_config={"add_bos_token": True})
    assert load_vocab(root, text_config()).add_bos is True


# --- GGUF round trip ------------------------------------------------------------------


def test_gguf_round_trip(vocab, tmp_path):
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(path, arch="kimi-k3")
    write_vocab(vocab, writer)
    writer.add_tensor("dummy.weight", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    fields = gguf.GGUFReader(path).fields
    value = lambda key: fields[key].contents()      # noqa: E731
    assert value("tokenizer.ggml.tokens") == vocab.tokens
    assert value("tokenizer.ggml.merges") == vocab.merges
    assert value("tokenizer.ggml.token_type") == vocab.token_types
    assert value("tokenizer.ggml.model") == "gpt2"
    assert value("tokenizer.ggml.pre") == "kimi-k2"
    assert value("tokenizer.ggml.eos_token_id") == END_OF_MSG
    assert value("tokenizer.ggml.bos_token_id") == BOS
    assert value("tokenizer.ggml.padding_token_id") == PAD
    assert "tokenizer.ggml.unknown_token_id" not in fields
    assert value("tokenizer.ggml.add_bos_token") is False
    assert value("tokenizer.chat_template") == K3_CHAT_TEMPLATE


# --- chat rendering -----------------------------------------------------------------

O, C, S, E = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
EFFORT = ("`thinking_effort` guides on how much to think in your thinking channel (not including the "
          "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
          "Now the system is invoked with `thinking_effort={}`.")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Wetter",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "Zone": {"type": "string"}}}}}
WEATHER_JSON = ('[{"function":{"description":"Wetter","name":"get_weather","parameters":'
                '{"properties":{"Zone":{"type":"string"},"city":{"type":"string"}},"type":"object"}},'
                '"type":"function"}]')


def msg(attrs: str, body: str) -> str:
    return f"{O}message {attrs}{S}{body}{C}message{S}{E}"


def effort(level: str = "max") -> str:
    return msg('role="system" type="thinking-effort"', EFFORT.format(level))


def el(tag: str, body: str, attrs: str = "") -> str:
    return f"{O}{tag}{attrs}{S}{body}{C}{tag}{S}"


GEN_THINK = f'{O}message role="assistant"{S}{O}think{S}'
GEN_RESPONSE = f'{O}message role="assistant"{S}{O}response{S}'


def hf_render(messages, **kwargs) -> str:
    """Render as transformers does: sandboxed jinja2 with its json.dumps tojson."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise TemplateError(message)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(K3_CHAT_TEMPLATE).render(messages=messages, **kwargs)


def test_chat_system_user_and_generation_prompt():
    got = hf_render([{"role": "system", "content": "be terse"}, {"role": "user", "content": "hi"}],
                    add_generation_prompt=True)
    assert got == (effort() + msg('role="system"', "be terse") + msg('role="user"', "hi") + GEN_THINK)


def test_chat_renders_in_a_plain_jinja2_environment():
    # nothing transformers-specific is needed for text-only chats
    got = Environment().from_string(K3_CHAT_TEMPLATE).render(
        messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True, enable_thinking=False)
    assert got == msg('role="user"', "hi") + GEN_RESPONSE


def test_chat_thinking_off_and_effort():
    got = hf_render([{"role": "user", "content": "hi"}], add_generation_prompt=True, thinking=False)
    assert got == msg('role="user"', "hi") + GEN_RESPONSE
    got = hf_render([{"role": "user", "content": "hi"}], thinking_effort="low")
    assert got == effort("low") + msg('role="user"', "hi")
    assert hf_render([], reasoning_effort="high") == effort("high")
    with pytest.raises(TemplateError, match="low, high or max"):
        hf_render([], thinking_effort="medium")


def test_chat_assistant_history_with_think_and_names():
    got = hf_render([
        {"role": "user", "name": 'a&"b', "content": "hi"},
        {"role": "assistant", "reasoning_content": "they said hi", "content": "hello"},
        {"role": "assistant", "content": [{"type": "text", "text": "again"}, {"type": "image"}]},
    ], thinking_effort=None)
    assert got == (msg('role="user" name="a&amp;&quot;b"', "hi")
                   + msg('role="assistant"', el("think", "they said hi") + el("response", "hello"))
                   + msg('role="assistant"', el("think", "")
                         + el("response", "again<|kimi_image_placeholder|>")))
    no_think = hf_render([{"role": "assistant", "reasoning_content": "r", "content": "x"}], thinking=False)
    assert no_think == msg('role="assistant"', el("response", "x"))


def test_chat_tools_calls_and_results():
    args = {"city": "Paris", "days": 3, "metric": True, "extra": None, "opts": {"k": 1}, "list": [1, "é"]}
    got = hf_render([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "reasoning_content": "call", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"'}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "20C"},        # out of call order
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
    ], tools=[WEATHER], add_generation_prompt=True)
    declare = msg('role="system" type="tool-declare"',
                  "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
                  f"```json\n{WEATHER_JSON}\n```")
    arguments = "".join(el("argument", value, f' key="{key}" type="{kind}"') for key, kind, value in [
        ("city", "string", "Paris"), ("days", "number", "3"), ("metric", "boolean", "true"),
        ("extra", "null", "null"), ("opts", "object", '{"k": 1}'), ("list", "array", '[1, "é"]')])
    calls = el("tools", el("call", arguments, ' tool="get_weather" index="1"')
               + el("call", el("json", '{"city": "Rome"', ' type="object"'), ' tool="get_weather" index="2"'))
    assert got == (declare + effort() + msg('role="user"', "weather?")
                   + msg('role="assistant"', el("think", "call") + el("response", "") + calls)
                   + msg('role="tool" tool="get_weather" index="1"', "18C")
                   + msg('role="tool" tool="get_weather" index="2"', "20C")
                   + GEN_THINK)


def test_chat_tool_result_names_without_ids():
    got = hf_render([
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "first", "arguments": {}}}, {"function": {"name": "second", "arguments": {}}}]},
        {"role": "tool", "content": "A"},
        {"role": "tool", "name": "explicit", "content": "B"},
        {"role": "user", "content": "ok"},
    ], thinking=False)
    assert got.endswith(msg('role="tool" tool="first" index="1"', "A")
                        + msg('role="tool" tool="explicit" index="2"', "B") + msg('role="user"', "ok"))
    with pytest.raises(TemplateError, match="names no tool"):
        hf_render([{"role": "tool", "content": "orphan"}])


def test_chat_run_settings_follow_the_conversation():
    got = hf_render([{"role": "user", "content": "hi"}], thinking=False, tool_choice="none",
                    response_format={"type": "json_schema",
                                     "json_schema": {"name": "x", "schema": {"type": "object", "properties": {}}}})
    assert got == (msg('role="user"', "hi")
                   + msg('role="system" type="tool-choice"', "The system is invoked with `tool_choice=none`.\n"
                         "You MUST NOT call any tools in the next message.")
                   + msg('role="system" type="response-format"',
                         "The system is invoked with `response_format=json_schema`.\n"
                         "Your response must be raw JSON data without markdown code blocks (```json) or any "
                         "additional formatting.\nThe JSON data must match the following schema:\n"
                         '```json\n{"properties":{},"type":"object"}\n```'))


def test_chat_dynamic_tools_from_a_system_message():
    got = hf_render([{"role": "system", "tools": [WEATHER]}], thinking=False)
    assert got.startswith(f'{O}message role="system" type="tool-declare"{S}## New Tools Available\n')
    assert got.endswith(f"```json\n{WEATHER_JSON}\n```{C}message{S}{E}")
