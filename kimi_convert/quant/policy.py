"""Quantization policies: a TOML file (or a shipped preset) plus llama-quantize's `--tensor-type` tokens.

    default = "Q4_K"            # every tensor that no rule names and no protection holds
    [[rules]]
    pattern = "attn_(q_a|q_b)"  # Python regex, searched (not anchored) in the GGUF tensor name; first match wins
    type = "Q8_0"               # a ggml type name, any case, or "keep" (leave the tensor as it is)
    why = "..."                 # optional: shown by --explain

`--tensor-type REGEX=TYPE` tokens are tried before the policy's rules, in command-line order, and are read as
llama-quantize reads them: the regex is lower-cased first (tools/quantize/quantize.cpp), so a llama-quantize recipe
selects the same tensors here. Every error names the file and line it comes from (docs/policy.md).
"""
from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from gguf import GGMLQuantizationType as QT

from ..errors import KimiError

KEEP = None                    # the target "keep": the tensor stays as it is stored

# the types kimi-quantize writes (docs/policy.md); MXFP4 only as a copy of MXFP4 experts
TARGET_TYPES = (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K,
                QT.Q6_K, QT.IQ4_NL, QT.IQ4_XS, QT.MXFP4)
PRESETS = resources.files("kimi_convert.quant").joinpath("presets")   # package data: presets/*.toml
TOP_KEYS, RULE_KEYS = {"default", "rules", "description"}, {"pattern", "type", "why"}


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

    def with_tensor_types(self, first: list[Rule]) -> "Policy":
        """--tensor-type rules go before the policy's own."""
        return Policy(self.default, self.default_origin, (*first, *self.rules), self.source, self.description)

    def first_match(self, name: str) -> Rule | None:
        return next((r for r in self.rules if r.pattern.search(name)), None)


def type_name(target: QT | None) -> str:
    return "keep" if target is None else target.name


def parse_type(text: object, where: str) -> QT | None:
    if not isinstance(text, str):
        raise PolicyError(f"{where}: type must be a string such as \"Q4_K\" or \"keep\", not {text!r}")
    if text.strip().lower() == "keep":
        return KEEP
    found = next((t for t in TARGET_TYPES if t.name.lower() == text.strip().lower()), None)
    if found is None:
        names = ", ".join(t.name for t in TARGET_TYPES)
        raise PolicyError(f"{where}: unknown type {text!r}; use one of {names} or keep")
    return found


def compile_pattern(text: object, where: str) -> re.Pattern:
    if not isinstance(text, str) or not text:
        raise PolicyError(f"{where}: pattern must be a non-empty string (a Python regex), not {text!r}")
    try:
        return re.compile(text)
    except re.error as e:
        raise PolicyError(f"{where}: bad regex {text!r}: {e}") from None


# ------------------------------------------------------------------------------------
# policy files and presets

def preset_names() -> list[str]:
    return sorted(p.name.removesuffix(".toml") for p in PRESETS.iterdir() if p.name.endswith(".toml"))


def load_policy(spec: str | Path) -> Policy:
    """A policy file path, or the name of a shipped preset."""
    path = Path(spec)
    if path.suffix == ".toml" or path.exists() or "/" in str(spec):
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise PolicyError(f"{path}: policy file not found") from None
        except (OSError, UnicodeDecodeError) as e:
            raise PolicyError(f"{path}: cannot read the policy file ({e})") from None
        return parse_policy(text, str(path))
    name = str(spec)
    if name not in preset_names():
        raise PolicyError(f"{name}: no such policy file or preset; presets: {', '.join(preset_names())}")
    text = PRESETS.joinpath(f"{name}.toml").read_text(encoding="utf-8")
    return parse_policy(text, f"preset {name}", origin_file=f"{name}.toml")


def parse_policy(text: str, source: str, origin_file: str | None = None) -> Policy:
    origin_file = origin_file or source
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise PolicyError(f"{origin_file}: TOML syntax error: {e}") from None
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
    return Policy(default, default_at, tuple(parsed), source, str(doc.get("description", "")))


class _KeyLines:
    """Line numbers of keys in a policy file, for error messages (tomllib keeps no positions)."""
    _KEY = re.compile(r"^\s*([A-Za-z0-9_-]+|\"[^\"]*\")\s*=")

    def __init__(self, text: str):
        self.top_keys: dict[str, int] = {}
        self.rules: list[tuple[int, dict[str, int]]] = []     # (header line, key -> line)
        for no, line in enumerate(text.splitlines(), start=1):
            if line.strip().startswith("[[") and "rules" in line:
                self.rules.append((no, {}))
                continue
            m = self._KEY.match(line)
            if m:
                key = m[1].strip('"')
                (self.rules[-1][1] if self.rules else self.top_keys).setdefault(key, no)

    def top(self, key: str) -> int:
        return self.top_keys.get(key, self.rules[0][0] if self.rules else 1)

    def rule(self, i: int, key: str | None = None) -> int:
        if i >= len(self.rules):
            return 1
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
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise PolicyError(f"{path}: cannot read the tensor-type file ({e})") from None
        for no, line in enumerate(text.splitlines(), start=1):
            rules += [parse_tensor_type(t, f"{path}:{no}") for t in line.split()]
    return rules
