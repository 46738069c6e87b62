"""Property-based tests of the two quantization inputs a user writes or brings: the POLICY parser (TOML text,
--tensor-type tokens and files) and the IMATRIX reader (GGUF and legacy .dat files).

Every generated input ends in a correct result or in one KimiError whose message names the file (and the line
or entry); never in another exception. Generated documents whose validity the test can decide on its own (the
rules of docs/policy.md, llama-imatrix's two formats) are checked both ways: a valid one must parse to exactly
what it says, an invalid one must be refused. Mutated bytes are only held to "a result or one named error".
"""
from __future__ import annotations

import json
import math
import re
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kimi_convert.errors import KimiError
from kimi_convert.fixtures.imatrix import write_dat, write_gguf_imatrix
from kimi_convert.quant.imatrix import ImatrixError, load_imatrix
from kimi_convert.quant.policy import (REQUIREMENTS, TARGET_TYPES, TOP_KEYS, PolicyError, parse_policy,
                                       parse_tensor_type, tensor_type_rules)

# derandomize: the same cases on every run (a CI failure reproduces locally); no example database in the repo
FUZZ = dict(deadline=None, derandomize=True, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                   HealthCheck.function_scoped_fixture])
ORIGIN = "p.toml"
TYPE_NAMES = {t.name.lower(): t for t in TARGET_TYPES}


# ------------------------------------------------------------------ what a policy says (docs/policy.md)

def type_of(value):
    """The target a policy `type` names: a QT, None for keep, or ValueError for anything else."""
    if not isinstance(value, str):
        raise ValueError(value)
    text = value.strip().lower()
    if text == "keep":
        return None
    if text not in TYPE_NAMES:
        raise ValueError(value)
    return TYPE_NAMES[text]


def compiles(pattern) -> bool:
    if not isinstance(pattern, str) or not pattern:
        return False
    try:
        re.compile(pattern)
    except Exception:            # noqa: BLE001 - re raises re.error, OverflowError, RecursionError
        return False
    return True


def expected_policy(doc: dict):
    """(default, [(pattern, target)], description, requires) for a valid document, else None."""
    if set(doc) - TOP_KEYS or "default" not in doc:
        return None
    try:
        default = type_of(doc["default"])
    except ValueError:
        return None
    rules = doc.get("rules", [])
    if not isinstance(rules, list) or not all(isinstance(r, dict) for r in rules):
        return None
    parsed = []
    for r in rules:
        if set(r) - {"pattern", "type", "why"} or "pattern" not in r or "type" not in r:
            return None
        if not compiles(r["pattern"]):
            return None
        try:
            parsed.append((r["pattern"], type_of(r["type"])))
        except ValueError:
            return None
    requires = doc.get("requires", [])
    if not isinstance(requires, list) or not all(isinstance(v, str) and v in REQUIREMENTS for v in requires):
        return None
    return default, parsed, str(doc.get("description", "")), tuple(dict.fromkeys(requires))


# ------------------------------------------------------------------ TOML text for a document

def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)                       # nan, inf, -inf and 1e+20 are TOML floats too
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=True)     # JSON's escapes are a subset of TOML's basic string's
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"


def toml_text(doc: dict, rules_as_tables: bool) -> str:
    rules = doc.get("rules")
    tables = rules_as_tables and isinstance(rules, list) and rules and all(isinstance(r, dict) for r in rules)
    lines = [f"{k} = {toml_value(v)}" for k, v in doc.items() if not (tables and k == "rules")]
    if tables:
        for r in rules:
            lines += ["", "[[rules]]"] + [f"{k} = {toml_value(v)}" for k, v in r.items()]
    return "\n".join(lines) + "\n"


# BMP only, no surrogates: a TOML \uXXXX escape must name a scalar value
short_text = st.text(st.characters(max_codepoint=0xFFFF, exclude_categories=("Cs",)), max_size=8)
scalar = st.one_of(st.integers(-2**63, 2**63 - 1), st.floats(), st.booleans(), short_text)
anything = st.recursive(scalar, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(st.sampled_from(["a", "b"]), inner,
                                                                         max_size=2)), max_leaves=4)
type_spelling = st.one_of(
    st.sampled_from([t.name for t in TARGET_TYPES] + ["keep", "KEEP", " q4_k ", "q8_0", "Q9_K", "", "IQ1_S"]),
    short_text)
pattern = st.one_of(
    st.sampled_from(["attn_", "ffn_(up|down)_exps", r"^blk\.0\.", "token_embd", "(", "[", "", "a{4294967296}",
                     "a{2,1}", r"(?<=a+)b", "(?P<x", "\\", "(" * 500 + ")" * 500]),
    st.text(alphabet="ab_.()*+?[]{}|^$\\0123456789,=", max_size=12))
good_rule = st.fixed_dictionaries({"pattern": pattern, "type": type_spelling}, optional={"why": short_text})
any_rule = st.dictionaries(st.sampled_from(["pattern", "type", "why", "typo"]), st.one_of(pattern, anything),
                           max_size=4)
policy_doc = st.fixed_dictionaries(
    {}, optional={"default": st.one_of(type_spelling, anything),
                  "rules": st.one_of(st.lists(st.one_of(good_rule, any_rule), max_size=4), anything),
                  "description": st.one_of(short_text, anything),
                  "requires": st.one_of(st.lists(st.sampled_from([*REQUIREMENTS, "gpu"]), max_size=3), anything),
                  "defualt": scalar})


def check_policy_error(e: PolicyError, origin: str, text: str) -> None:
    """The message names the file, and a line of it when it gives one."""
    message = str(e)
    assert message.startswith(origin + ":"), message
    m = re.match(rf"{re.escape(origin)}:(\d+): ", message)
    if m:
        assert 1 <= int(m[1]) <= max(1, len(text.splitlines())), message
        key = re.search(r"unknown key '([A-Za-z0-9_-]+)'", message)
        if key:
            assert key[1] in text.splitlines()[int(m[1]) - 1], message


@settings(max_examples=500, **FUZZ)
@given(doc=policy_doc, tables=st.booleans())
def test_generated_policy_parses_to_what_it_says_or_is_refused(doc, tables):
    text = toml_text(doc, tables)
    want = expected_policy(doc)
    try:
        pol = parse_policy(text, ORIGIN)
    except PolicyError as e:
        assert want is None, f"a valid policy was refused: {e}\n{text}"
        check_policy_error(e, ORIGIN, text)
        return
    assert want is not None, f"an invalid policy was accepted:\n{text}"
    default, rules, description, requires = want
    assert pol.default == default and pol.description == description and pol.requires == requires
    assert [(r.pattern.pattern, r.target) for r in pol.rules] == rules
    if tables:                  # each rule's origin is the line of its pattern
        lines = text.splitlines()
        for r in pol.rules:
            no = int(r.origin.rsplit(":", 1)[1])
            assert lines[no - 1].startswith("pattern = "), (r.origin, text)


edit = st.tuples(st.sampled_from(["insert", "delete", "replace", "duplicate-line"]), st.integers(0, 10**6),
                 st.sampled_from(list('"=[]{}\n#\\ .,') + ["\x00", "\ufeff", "é", "'''", "[[rules]]", "default"]))


def mutate_text(text: str, edits) -> str:
    for op, at, piece in edits:
        i = at % (len(text) + 1)
        if op == "insert":
            text = text[:i] + piece + text[i:]
        elif op == "delete":
            text = text[:i] + text[i + len(piece):]
        elif op == "replace":
            text = text[:i] + piece + text[i + 1:]
        else:
            lines = text.splitlines(keepends=True) or [""]
            k = at % len(lines)
            text = "".join(lines[:k + 1] + lines[k:])
    return text


@settings(max_examples=500, **FUZZ)
@given(doc=policy_doc, tables=st.booleans(), edits=st.lists(edit, min_size=1, max_size=4))
def test_mutated_policy_text_is_a_policy_or_one_named_error(doc, tables, edits):
    text = mutate_text(toml_text(doc, tables), edits)
    try:
        parse_policy(text, ORIGIN)
    except PolicyError as e:
        check_policy_error(e, ORIGIN, text)


# ------------------------------------------------------------------ --tensor-type tokens and files

def expected_rule(token: str):
    regex, sep, type_text = token.partition("=")
    if not sep or not regex or not compiles(regex.lower()):
        return None
    try:
        return regex.lower(), type_of(type_text)
    except ValueError:
        return None


token_text = st.one_of(
    st.text(max_size=24),
    st.builds(lambda r, t: f"{r}={t}", pattern, type_spelling),
    st.builds(lambda r, t: f"{r}={t}", st.text(max_size=8), st.text(max_size=8)))


@settings(max_examples=800, **FUZZ)
@given(token=token_text)
def test_tensor_type_token_is_a_rule_or_one_named_error(token):
    origin = "--tensor-type #1"
    want = expected_rule(token)
    try:
        rule = parse_tensor_type(token, origin)
    except PolicyError as e:
        assert want is None, f"{token!r} was refused: {e}"
        assert str(e).startswith(origin + ": "), str(e)
        return
    assert want is not None, f"{token!r} was accepted"
    assert (rule.pattern.pattern, rule.target) == want and rule.origin == origin


@settings(max_examples=150, **FUZZ)
@given(content=st.one_of(st.binary(max_size=200),
                         st.lists(token_text.filter(lambda t: t and not any(c.isspace() for c in t)), max_size=6)
                         .map(lambda ts: " \n".join(ts).encode())))
def test_tensor_type_file_is_rules_or_one_named_error(tmp_path_factory, content):
    path = tmp_path_factory.getbasetemp() / "tensor-types.txt"
    path.write_bytes(content)
    try:
        rules = tensor_type_rules([], [path])
    except PolicyError as e:
        assert re.match(rf"{re.escape(str(path))}(:\d+)?: ", str(e)), str(e)
        return
    lines = content.decode("utf-8").splitlines()
    want = [(f"{path}:{no}", expected_rule(t)) for no, line in enumerate(lines, start=1) for t in line.split()]
    assert [(r.origin, (r.pattern.pattern, r.target)) for r in rules] == want


# ------------------------------------------------------------------ imatrix files

F32_MAX = float(np.finfo(np.float32).max)
value_f32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
counts_f32 = st.one_of(st.floats(0, 5000, width=32), st.sampled_from([0.0, 0.4, 0.5, 1.5, -1.0, math.nan,
                                                                       math.inf, 2.0**63, F32_MAX]))


def lround(c: float) -> float:
    """std::lround of a count >= 0 (half away from zero)."""
    return math.floor(c + 0.5)


@st.composite
def gguf_entries(draw):
    """name -> (in_sum2 [n_mat, ne0], counts [n_mat]), as llama-imatrix writes them."""
    entries = {}
    for i in range(draw(st.integers(1, 3))):
        n_mat, ne0 = draw(st.integers(1, 4)), draw(st.sampled_from([1, 3, 32]))
        sums = np.array(draw(st.lists(st.one_of(st.floats(0, 1e6, width=32), value_f32),
                                      min_size=n_mat * ne0, max_size=n_mat * ne0)), np.float32)
        counts = np.array(draw(st.lists(counts_f32, min_size=n_mat, max_size=n_mat)), np.float32)
        entries[f"blk.{i}.ffn_up_exps.weight"] = (sums.reshape(n_mat, ne0), counts)
    return entries


def expected_gguf_vectors(entries):
    """name -> float32 importance vector (llama-quantize's), or None when the file must be refused."""
    out = {}
    for name, (sums, counts) in entries.items():
        c = counts.astype(np.float64)
        if not np.all(np.isfinite(c) & (c >= 0) & (c < 2.0**63)):
            return None
        rounded = np.array([lround(x) for x in c], np.float32)
        seen = rounded > 0
        if not np.all(np.isfinite(sums[seen])):
            return None
        v = np.ones_like(sums)
        v[seen] = sums[seen] / rounded[seen][:, None]
        out[name] = v.reshape(-1)
    return out


@st.composite
def dat_entries(draw):
    """[(name bytes, ncall, values)] of a legacy .dat, and its trailer."""
    names = draw(st.lists(st.one_of(st.sampled_from([b"blk.0.attn_q_a.weight", b"blk.1.ffn_up_exps.weight"]),
                                    st.binary(min_size=0, max_size=6)), min_size=0, max_size=3))
    entries = [(name, draw(st.integers(-3, 2**31 - 1)),
                np.array(draw(st.lists(st.one_of(st.floats(-1e6, 1e6, width=32), value_f32), max_size=8)),
                         np.float32)) for name in names]
    trailer = draw(st.one_of(st.none(), st.tuples(st.integers(-2**31, 2**31 - 1), st.binary(max_size=8))))
    return entries, trailer


def expected_dat_vectors(entries, trailer):
    if not entries:
        return None
    out = {}
    for raw, ncall, values in entries:
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError:
            return None
        if not name or "\0" in name or name in out or values.size == 0 or not np.all(np.isfinite(values)):
            return None
        out[name] = values / np.float32(ncall) if ncall > 0 else values
    return out


def loaded_vectors(path) -> dict:
    """Everything an Imatrix offers, used once: each vector, the coverage rows and the metadata."""
    im = load_imatrix(path)
    sizes = {name: im._entries[name].size for name in im.names}
    vectors = {name: im.vector(name, (size,)) for name, size in sizes.items()}
    im.coverage([(name, (1, size)) for name, size in sizes.items()])
    im.metadata()
    return vectors


def check_imatrix_error(e: ImatrixError, path) -> None:
    assert str(e).startswith(f"{path}: "), str(e)


def check_loaded_or_refused(path, want: dict | None, invalid: str) -> None:
    """The file loads to exactly `want`'s vectors, or, where `want` is None (llama-quantize would refuse
    it), is refused with one error naming it."""
    try:
        got = loaded_vectors(path)
    except ImatrixError as e:
        assert want is None, f"a valid imatrix was refused: {e}"
        check_imatrix_error(e, path)
        return
    assert want is not None, f"{invalid} was accepted"
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@settings(max_examples=150, **FUZZ)
@given(entries=gguf_entries())
def test_generated_gguf_imatrix_gives_llama_quantize_s_vectors_or_is_refused(tmp_path_factory, entries):
    path = write_gguf_imatrix(tmp_path_factory.getbasetemp() / "im.gguf", entries)
    check_loaded_or_refused(path, expected_gguf_vectors(entries), "an imatrix with a non-finite value or count")


@settings(max_examples=250, **FUZZ)
@given(case=dat_entries())
def test_generated_dat_imatrix_gives_llama_quantize_s_vectors_or_is_refused(tmp_path_factory, case):
    entries, trailer = case
    path = write_dat(tmp_path_factory.getbasetemp() / "im.dat", entries, trailer)
    check_loaded_or_refused(path, expected_dat_vectors(entries, trailer), "an invalid .dat")


# byte-level damage: flips, integers written over a field, cuts, insertions; biased to the first bytes, where a
# file's counts and lengths are
INTERESTING = [0, 1, 2, 0x7F, 0xFF, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**63 - 1, 2**64 - 1]
damage = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 400), st.integers(1, 255)),
    st.tuples(st.just("u32"), st.integers(0, 400), st.sampled_from(INTERESTING[:9] + [2**32 - 1])),
    st.tuples(st.just("u64"), st.integers(0, 400), st.sampled_from(INTERESTING)),
    st.tuples(st.just("cut"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 400), st.integers(0, 255)),
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(1, 255)))


def damaged(data: bytes, edits) -> bytes:
    b = bytearray(data)
    for op, at, value in edits:
        i = at % (len(b) + 1)
        if op == "flip" and i < len(b):
            b[i] ^= value
        elif op in ("u32", "u64"):
            n = 4 if op == "u32" else 8
            b[i:i + n] = struct.pack("<Q", value)[:n]
        elif op == "cut":
            del b[i:]
        elif op == "insert":
            b[i:i] = bytes([value])
    return bytes(b)


@pytest.fixture(scope="module")
def good_imatrices(tmp_path_factory):
    d = tmp_path_factory.mktemp("good-imatrix")
    entries = {"blk.0.attn_q_a.weight": (np.full((1, 32), 7, np.float32), np.array([3], np.float32)),
               "blk.1.ffn_up_exps.weight": (np.arange(96, dtype=np.float32).reshape(3, 32),
                                            np.array([2, 0, 5], np.float32))}
    gguf = write_gguf_imatrix(d / "good.gguf", entries).read_bytes()
    dat = write_dat(d / "good.dat", [(n, 4, s.reshape(-1)) for n, (s, _) in entries.items()]).read_bytes()
    return {"gguf": gguf, "dat": dat}


@settings(max_examples=600, **FUZZ)
@given(kind=st.sampled_from(["gguf", "dat"]), edits=st.lists(damage, min_size=1, max_size=3))
def test_damaged_imatrix_is_read_or_one_named_error(tmp_path_factory, good_imatrices, kind, edits):
    path = tmp_path_factory.getbasetemp() / f"damaged.{kind}"
    path.write_bytes(damaged(good_imatrices[kind], edits))
    try:
        vectors = loaded_vectors(path)
    except ImatrixError as e:
        check_imatrix_error(e, path)
        return
    except KimiError as e:       # another KimiError class is still a named error, but the reader's own is expected
        pytest.fail(f"{type(e).__name__} instead of ImatrixError: {e}")
    for name, v in vectors.items():     # what load_imatrix promises of what it accepts
        assert v.dtype == np.float32 and np.all(np.isfinite(v)), name
