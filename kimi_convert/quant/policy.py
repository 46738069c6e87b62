"""Quantization policies: a TOML file (or a shipped preset) plus llama-quantize's `--tensor-type` tokens.

    default = "Q4_K"            # every tensor that no rule names and no protection holds
    [[rules]]
    pattern = "attn_(q_a|q_b)"  # Python regex, searched (not anchored) in the GGUF tensor name; first match wins
    type = "Q8_0"               # a ggml type name, any case, or "keep" (leave the tensor as it is)
    why = "..."                 # optional: shown by --explain

A policy may state what a run needs (`requires = ["imatrix", "allow-requantize"]`, top level); a run that lacks
it is refused before any heavy work by `Policy.check_requirements`, the one check kimi-quantize and
`kimi-convert --policy` share.

`--tensor-type REGEX=TYPE` tokens are tried before the policy's rules, in command-line order, and are read as
llama-quantize reads them: the regex is lower-cased first (tools/quantize/quantize.cpp), so a llama-quantize recipe
selects the same tensors here. Every error names the file and line it comes from (docs/policy.md).

A POLICY name is a preset of ours (lower case: `q8_0`, `k3-q4`) or one of llama-quantize's file types (upper case,
as its --help lists them: `Q4_K_M`, `IQ2_XXS`), whose mixture (quant/mixtures.py) then decides every tensor no
--tensor-type token names; a name that is neither, but one of them in another case, is refused with the name it
may have meant.
"""
from __future__ import annotations

import re
import reprlib
import tomllib
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Iterable

from gguf import GGMLQuantizationType as QT

from ..errors import KimiError
from ..paths import Input
from .blocks import supported_types
from .mixtures import FILE_TYPES, FileType, requires_imatrix

KEEP = None                    # the target "keep": the tensor stays as it is stored

# the types a policy may name: those kimi-quantize writes (its block types, quant/blocks.py), and MXFP4, which
# keeps MXFP4 experts as they are (llama-quantize recipes write `exps=mxfp4`); making it is refused at writing
TARGET_TYPES = (*supported_types(), QT.MXFP4)
PRESETS = resources.files("kimi_convert.quant").joinpath("presets")   # package data: presets/*.toml
TOP_KEYS, RULE_KEYS = {"default", "rules", "description", "requires"}, {"pattern", "type", "why"}
# what a policy may require of a run: the option that provides it, and why a policy would need it
REQUIREMENTS = {
    "imatrix": ("--imatrix FILE", "low-bit types need importance weights to choose their scales; make one from the "
                                  "checkpoint or this file with kimi-imatrix MODEL -f TEXT -o FILE"),
    "allow-requantize": ("--allow-requantize", "it re-quantizes tensors that are already quantized, "
                                               "such as MXFP4 experts"),
}


class PolicyError(KimiError):
    """A policy file, preset name or --tensor-type token is wrong; the message names where."""


@dataclass(frozen=True)
class Rule:
    pattern: re.Pattern
    target: QT | None          # None = keep
    origin: str                # "policy.toml:7" or "--tensor-type #2"
    why: str = ""

    def describe(self) -> str:
        return f"{self.origin} ({self.pattern.pattern!r} -> {type_name(self.target)})"


@dataclass(frozen=True)
class Policy:
    default: QT | None
    default_origin: str
    rules: tuple[Rule, ...]
    source: str                # the file, or "preset NAME"
    description: str = ""
    requires: tuple[str, ...] = ()     # REQUIREMENTS keys, in the file's order
    requires_origin: str = ""          # "k3-q2.toml:12"
    # the files it was read from (the policy file, the --tensor-type-files): no output may replace one
    inputs: tuple[Input, ...] = ()
    mixture: FileType | None = None    # llama-quantize's file type whose rules replace `default`

    def with_tensor_types(self, first: list[Rule], files: Iterable[Path] = ()) -> "Policy":
        """--tensor-type rules (read from the command line and `files`) go before the policy's own."""
        if first and self.mixture is not None and not self.mixture.quantized:
            raise PolicyError(f"{first[0].origin}: {self.source} is a float file type, to which llama-quantize "
                              f"applies no --tensor-type; write a policy file with default = "
                              f"\"{self.mixture.default.name}\" and rules instead")
        return replace(self, rules=(*first, *self.rules),
                       inputs=(*self.inputs, *(Input(Path(f), "tensor-type file") for f in files)))

    def check_requirements(self, *, imatrix: bool, allow_requantize: bool, plan_only: bool = False) -> list[str]:
        """Refuse a run that lacks what the policy `requires`: one PolicyError naming the policy, what is missing
        and where the policy says so. Call it before any heavy work.

        plan_only (--explain, --dry-run): a policy file's types and sizes do not depend on the imatrix (a
        mixture's may: the plan is then the one without), so it is not demanded there; the returned notes say
        that writing will need it. --allow-requantize changes the plan
        (without it the MXFP4 experts are protected), so it is demanded always."""
        given = {"imatrix": imatrix, "allow-requantize": allow_requantize}
        missing = [r for r in self.requires if not given[r]]
        later = [r for r in missing if plan_only and r == "imatrix"]
        now = [r for r in missing if r not in later]
        if now:
            wanted = " and ".join(REQUIREMENTS[r][0] for r in self.requires)
            why = "; ".join(REQUIREMENTS[r][1] for r in now)
            raise PolicyError(f"{self.source} requires {wanted} ({self.requires_origin}); missing: "
                              f"{', '.join(REQUIREMENTS[r][0] for r in now)} ({why})")
        depends = ("the plan shown is the one without (the mixture's choices for IQ3_XXS, IQ4_NL, IQ4_XS, Q4_0 "
                   "and Q5_0 depend on it)" if self.mixture is not None else "the plan does not depend on it")
        return [f"{self.source}: writing the file needs {REQUIREMENTS[r][0]} too ({self.requires_origin}); "
                f"{depends}" for r in later]


def type_name(target: QT | None) -> str:
    return "keep" if target is None else target.name


def parse_type(text: object, where: str) -> QT | None:
    if not isinstance(text, str):
        raise PolicyError(f"{where}: type must be a string such as \"Q4_K\" or \"keep\", not {shown(text)}")
    if text.strip().lower() == "keep":
        return KEEP
    found = next((t for t in TARGET_TYPES if t.name.lower() == text.strip().lower()), None)
    if found is None:
        names = ", ".join(t.name for t in TARGET_TYPES)
        known = next((t for t in QT if t.name.lower() == text.strip().lower()), None)
        if known is not None:
            raise PolicyError(f"{where}: kimi-quantize cannot write {known.name} yet; use one of {names} or keep")
        raise PolicyError(f"{where}: unknown type {text!r}; use one of {names} or keep")
    return found


def shown(value: object) -> str:
    """A value from a policy, for a message: short, and safe for any nesting (reprlib stops at 6 levels)."""
    return reprlib.repr(value)


def compile_pattern(text: object, where: str) -> re.Pattern:
    if not isinstance(text, str) or not text:
        raise PolicyError(f"{where}: pattern must be a non-empty string (a Python regex), not {shown(text)}")
    if len(text) > MAX_PATTERN_CHARS:
        check_pattern(text, where)                  # refused by its length, before it is parsed
    try:
        pattern = re.compile(text)
    except (re.error, OverflowError, RecursionError) as e:     # a{4294967296}; groups nested 500 deep
        raise PolicyError(f"{where}: bad regex {shown(text)}: {e}") from None
    try:
        check_pattern(text, where)
    except RecursionError:
        raise PolicyError(f"{where}: bad regex {shown(text)}: groups nested too deep") from None
    return pattern


# A policy's patterns are searched in every tensor name of the model (about 2,000 for the real K3) at plan time,
# by Python's backtracking engine. Whether a pattern may run is decided from the pattern alone, before any search,
# the same on every machine and under any load (no timer):
# - at most MAX_PATTERN_CHARS characters;
# - no repeat inside a repeat: the body of a repeat that can match more than once (*, +, {m,n} with n > 1, or
#   {n} for n > 1) is single characters and classes (literals, ., [...], \d, \w, \s, anchors, groups of them),
#   without a repeat, an alternation of several characters, a backreference or a lookaround of its own. That is
#   what makes backtracking exponential: ^(.+)+x$, (a|a)*, (a|ab)*c, (\.\d+)* ... (Python's parser already turns
#   an alternation of single characters, (a|b)+, into the class [ab]+, which stays allowed);
# - at most MAX_AMBIGUOUS_REPEATS ambiguous repeats in sequence (summed along a sequence, the most of any branch
#   of an alternation): each can end at any of a name's characters, so k of them in a row try up to n^k splits of
#   an n-character name (.*.*.*x). A repeat is not ambiguous where its end is forced: its body is one character
#   class, the next item is a literal character the class does not match and the one before is not a repeat
#   (\.\d+\. , [a-z]+_), or nothing but anchors follows it to the pattern's end (a trailing .* or .*$ takes
#   the rest at once).
# On GGUF tensor names (at most 63 characters) the slowest admitted pattern measured, \w*\w*Z, searched 2,000
# names in about 0.35 s on one core (.*.*.*Z, refused, took 4.7 s); the recipes' patterns (alternation, classes,
# anchors, \., \d+) take milliseconds.
MAX_PATTERN_CHARS = 10_000
MAX_AMBIGUOUS_REPEATS = 2


def check_pattern(text: str, where: str) -> None:
    """PolicyError naming `where` (POLICY_FILE:LINE or the --tensor-type token) for a pattern whose search could
    backtrack without bound; the verdict depends on the pattern only."""
    if len(text) > MAX_PATTERN_CHARS:
        raise PolicyError(f"{where}: pattern of {len(text):,} characters: at most {MAX_PATTERN_CHARS:,} (a tensor "
                          f"name has at most 63); split it into several rules")
    from re import _constants as C, _parser
    parsed = _parser.parse(text)
    ignore_case = bool(parsed.state.flags & re.IGNORECASE)
    simple_ops = {C.LITERAL, C.NOT_LITERAL, C.ANY, C.IN, C.CATEGORY, C.AT}
    repeats = {C.MAX_REPEAT, C.MIN_REPEAT, getattr(C, "POSSESSIVE_REPEAT", C.MAX_REPEAT)}

    def refuse(why: str) -> None:
        raise PolicyError(f"{where}: pattern {shown(text)} backtracks exponentially on some names: {why}; write "
                          f"it without one (docs/policy.md, \"Patterns\")")

    def simple(items) -> bool:
        for op, av in items:
            if op in simple_ops:
                continue
            if op == C.SUBPATTERN and simple(av[-1]):
                continue
            if op == getattr(C, "ATOMIC_GROUP", None) and simple(av):
                continue
            return False
        return True

    def one_char(items):
        """The single character matcher `items` is (unwrapping groups), else None."""
        while len(items) == 1 and items[0][0] == C.SUBPATTERN:
            items = items[0][1][-1]
        if len(items) == 1 and items[0][0] in (C.LITERAL, C.NOT_LITERAL, C.ANY, C.IN, C.CATEGORY):
            return items[0]
        return None

    def may_match(item, ch: str) -> bool:
        """Whether the one-character matcher `item` may match `ch` (True where unsure)."""
        chars = {ch, ch.lower(), ch.upper()} if ignore_case else {ch}
        return any(_matches(item, c, C) for c in chars)

    def degree(items, trailing: bool) -> int:
        """Ambiguous repeats in sequence in `items`; `trailing`: nothing but anchors follows `items`."""
        total = 0
        for k, (op, av) in enumerate(items):
            rest = items[k + 1:]
            at_end = trailing and all(o == C.AT for o, _ in rest)
            if op in repeats:
                lo, hi, body = av
                if hi > 1:
                    if not simple(body):
                        refuse("a repeat, an alternation, a backreference or a lookaround inside a repeat "
                               "(such as (.+)+ or (a|ab)*)")
                    if lo == hi:
                        continue                        # {n}: no choice to make
                    char = one_char(body)
                    nxt = rest[0] if rest else None
                    prev = items[k - 1][0] if k else None
                    forced = (char is not None and nxt is not None and nxt[0] == C.LITERAL
                              and not may_match(char, chr(nxt[1])) and prev not in repeats)
                    if not (forced or at_end):
                        total += 1
                else:                                   # ? : the body at most once
                    total += degree(body, at_end)
            elif op == C.SUBPATTERN:
                total += degree(av[-1], at_end)
            elif op == C.BRANCH:
                total += max(degree(b, at_end) for b in av[1])
            elif op in (C.ASSERT, C.ASSERT_NOT):
                total += degree(av[1], False)
            elif op == C.GROUPREF_EXISTS:
                total += max(degree(b, at_end) for b in av[1:] if b is not None)
            elif op == getattr(C, "ATOMIC_GROUP", None):
                total += degree(av, at_end)
        return total

    found = degree(parsed.data, True)
    if found > MAX_AMBIGUOUS_REPEATS:
        raise PolicyError(f"{where}: pattern {shown(text)} has {found} repeats in a row whose ends are not forced "
                          f"(such as .*.*.*): at most {MAX_AMBIGUOUS_REPEATS}, as each multiplies the ways a name "
                          f"can be split; anchor them with literal characters (blk\\.\\d+\\.ffn_.*_exps)")


def _matches(item, ch: str, C) -> bool:
    op, av = item
    o = ord(ch)
    if op == C.LITERAL:
        return av == o
    if op == C.NOT_LITERAL:
        return av != o
    if op == C.CATEGORY:
        return _category(av, ch, C)
    if op == C.IN:
        negate = bool(av) and av[0][0] == C.NEGATE
        hit = False
        for sub_op, sub_av in av[1:] if negate else av:
            if sub_op == C.LITERAL:
                hit |= sub_av == o
            elif sub_op == C.RANGE:
                hit |= sub_av[0] <= o <= sub_av[1]
            elif sub_op == C.CATEGORY:
                hit |= _category(sub_av, ch, C)
            else:
                return True                             # unsure: may match
        return hit != negate
    return True                                         # ANY, or unsure


def _category(cat, ch: str, C) -> bool:
    table = {C.CATEGORY_DIGIT: r"\d", C.CATEGORY_NOT_DIGIT: r"\D", C.CATEGORY_SPACE: r"\s",
             C.CATEGORY_NOT_SPACE: r"\S", C.CATEGORY_WORD: r"\w", C.CATEGORY_NOT_WORD: r"\W"}
    return cat not in table or re.fullmatch(table[cat], ch) is not None


def first_matches(rules: Iterable[Rule], names: list[str]) -> dict[str, Rule | None]:
    """The first rule whose pattern is found in each name (None: no rule). Each rule is searched only in the names
    no earlier rule took; every pattern passed check_pattern when it was read, so no search runs away."""
    found: dict[str, Rule] = {}
    for rule in rules:
        for n in names:
            if n not in found and rule.pattern.search(n):
                found[n] = rule
    return {n: found.get(n) for n in names}


# ------------------------------------------------------------------------------------
# policy files and presets

def preset_names() -> list[str]:
    return sorted(p.name.removesuffix(".toml") for p in PRESETS.iterdir() if p.name.endswith(".toml"))


def load_policy(spec: str | Path) -> Policy:
    """A policy file path, the name of a shipped preset, or the name of a llama-quantize file type (its mixture)."""
    path = Path(spec)
    if path.suffix == ".toml" or path.exists() or "/" in str(spec):
        return replace(parse_policy(_read_text(path, "policy file"), str(path)), inputs=(Input(path, "policy file"),))
    name = str(spec)
    if name in preset_names():
        text = PRESETS.joinpath(f"{name}.toml").read_text(encoding="utf-8")
        return parse_policy(text, f"preset {name}", origin_file=f"{name}.toml")
    if name in FILE_TYPES:
        return mixture_policy(FILE_TYPES[name])
    raise PolicyError(_unknown_name(name))


def _unknown_name(name: str) -> str:
    """The one-line refusal of a name that is neither a preset nor a file type, naming the one it may mean."""
    ftype = next((f for f in FILE_TYPES if f.lower() == name.lower()), None)
    preset = next((p for p in preset_names() if p.lower() == name.lower()), None)
    if ftype is not None:
        return (f"{name}: no such preset; did you mean llama-quantize's mixture {ftype}? (file types are upper "
                f"case, as llama-quantize lists them; presets are lower case)")
    if preset is not None:
        return f"{name}: no such file type; did you mean the preset {preset}? (presets are lower case)"
    return (f"{name}: no such policy file or preset; presets: {', '.join(preset_names())}; llama-quantize "
            f"mixtures: {', '.join(FILE_TYPES)} (kimi-quantize --list-presets)")


def mixture_policy(ftype: FileType) -> Policy:
    """llama-quantize's file type `ftype` as a policy: its mixture decides, and it requires an imatrix when
    llama-quantize would for its default type."""
    needs = requires_imatrix("blk.0.attn_q.weight", ftype.default, ftype)
    return Policy(ftype.default, f"llama-quantize {ftype.name}", (), f"mixture {ftype.name}",
                  f"llama-quantize's {ftype.name} (general.file_type {ftype.ftype}): {ftype.what}",
                  ("imatrix",) if needs else (),
                  f"llama-quantize's tensor_requires_imatrix, {ftype.default.name}" if needs else "", mixture=ftype)


def parse_policy(text: str, source: str, origin_file: str | None = None) -> Policy:
    origin_file = origin_file or source
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise PolicyError(f"{origin_file}: TOML syntax error: {e}") from None
    except RecursionError:          # arrays or inline tables nested hundreds deep
        line, depth = _deepest(text)
        raise PolicyError(f"{origin_file}:{line}: arrays or inline tables nested {depth} deep; a policy needs "
                          f"two levels at most") from None
    lines = _KeyLines(text)
    for k in doc:
        if k not in TOP_KEYS:
            raise PolicyError(f"{origin_file}:{lines.top(k)}: unknown key {k!r}; expected {sorted(TOP_KEYS)}")
    if "default" not in doc:
        raise PolicyError(f"{origin_file}: no `default = \"TYPE\"` (the type of every tensor no rule names)")
    default_at = f"{origin_file}:{lines.top('default')}"
    default = parse_type(doc["default"], default_at)
    rules = doc.get("rules", [])
    if not isinstance(rules, list) or not all(isinstance(r, dict) for r in rules):
        raise PolicyError(f"{origin_file}:{lines.top('rules')}: rules must be [[rules]] tables")
    parsed = []
    for i, r in enumerate(rules):
        for k in r:
            if k not in RULE_KEYS:
                raise PolicyError(f"{origin_file}:{lines.rule(i, k)}: unknown key {k!r} in a rule; "
                                  f"expected {sorted(RULE_KEYS)}")
        for k in ("pattern", "type"):
            if k not in r:
                raise PolicyError(f"{origin_file}:{lines.rule(i)}: rule {i + 1} has no {k!r}")
        at = f"{origin_file}:{lines.rule(i, 'pattern')}"
        parsed.append(Rule(compile_pattern(r["pattern"], at), parse_type(r["type"], f"{origin_file}:"
                                                                         f"{lines.rule(i, 'type')}"),
                           at, str(r.get("why", ""))))
    requires = _requirements(doc.get("requires", []), f"{origin_file}:{lines.top('requires')}")
    return Policy(default, default_at, tuple(parsed), source, str(doc.get("description", "")), requires,
                  f"{origin_file}:{lines.top('requires')}" if requires else "")


def _requirements(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise PolicyError(f"{where}: requires must be a list of strings such as [\"imatrix\"], not {shown(value)}")
    for v in value:
        if v not in REQUIREMENTS:
            raise PolicyError(f"{where}: unknown requirement {v!r}; expected some of {sorted(REQUIREMENTS)}")
    return tuple(dict.fromkeys(value))


def _deepest(text: str) -> tuple[int, int]:
    """(line, depth) where TOML arrays and inline tables ([ and { outside strings and comments) nest deepest."""
    depth = best = 0
    line = best_line = 1
    quote = ""
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\n":
            line += 1
        if quote:
            if c == "\\" and quote == '"':
                i += 1
            elif c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif c == "#":
            while i + 1 < len(text) and text[i + 1] != "\n":
                i += 1
        elif c in "[{":
            depth += 1
            if depth > best:
                best, best_line = depth, line
        elif c in "]}":
            depth -= 1
        i += 1
    return best_line, best


class _KeyLines:
    """Line numbers of keys in a policy file, for error messages (tomllib keeps no positions)."""
    _NAME = r"([A-Za-z0-9_-]+|\"[^\"]*\"|'[^']*')"        # a bare, basic or literal key: its first part
    _KEY = re.compile(rf"^\s*{_NAME}\s*[=.]")               # key = ..., or dotted.key = ...
    _TABLE = re.compile(rf"^\s*\[\[?\s*{_NAME}")

    def __init__(self, text: str):
        self.top_keys: dict[str, int] = {}
        self.rules: list[tuple[int, dict[str, int]]] = []     # (header line, key -> line)
        for no, line in enumerate(text.splitlines(), start=1):
            table = self._TABLE.match(line)
            if table and table[1].strip("\"'") == "rules" and line.lstrip().startswith("[["):
                self.rules.append((no, {}))
                continue
            if table:                       # [other] or [[other]]: a top-level key, defined on this line
                self.top_keys.setdefault(table[1].strip("\"'"), no)
                continue
            m = self._KEY.match(line)
            if m:
                key = m[1].strip("\"'")
                (self.rules[-1][1] if self.rules else self.top_keys).setdefault(key, no)

    def top(self, key: str) -> int:
        return self.top_keys.get(key, self.rules[0][0] if self.rules else 1)

    def rule(self, i: int, key: str | None = None) -> int:
        if i >= len(self.rules):            # an inline array, `rules = [{...}]`: its line
            return self.top("rules")
        header, keys = self.rules[i]
        return keys.get(key, header) if key else header


# ------------------------------------------------------------------------------------
# llama-quantize's --tensor-type spellings

def parse_tensor_type(token: str, origin: str) -> Rule:
    """REGEX=TYPE, as llama-quantize reads it: split at the first '=', the regex lower-cased."""
    regex, sep, type_text = token.partition("=")
    if not sep or not regex:
        raise PolicyError(f"{origin}: {token!r} is not REGEX=TYPE")
    return Rule(compile_pattern(regex.lower(), origin), parse_type(type_text, origin), origin)


def tensor_type_rules(tokens: list[str], files: list[Path]) -> list[Rule]:
    """--tensor-type tokens, then the tokens of each --tensor-type-file (whitespace-separated, as upstream)."""
    rules = [parse_tensor_type(t, f"--tensor-type {t}") for t in tokens]
    for path in files:
        text = _read_text(Path(path), "tensor-type file")
        for no, line in enumerate(text.splitlines(), start=1):
            rules += [parse_tensor_type(t, f"{path}:{no}") for t in line.split()]
    return rules


MAX_POLICY_BYTES = 16 << 20     # a policy or tensor-type file is a few KB; this is far above any


def _read_text(path: Path, what: str) -> str:
    """A policy or tensor-type file's text: a regular file only (a FIFO would block the read forever), UTF-8."""
    from ..inputs import read_input
    return read_input(path, MAX_POLICY_BYTES, PolicyError, missing=f"{what} not found")
