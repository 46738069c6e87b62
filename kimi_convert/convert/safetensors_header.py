"""The safetensors header, read and validated as completely as safetensors' own reader does.

The reference is the `safetensors` package (0.8: the Rust reader behind `safe_open`): a header it
refuses is refused here too, with one line naming the file and the tensor or key
(tests/test_checkpoint_hardening.py compares the two on generated and mutated headers). Checked:

- the 8-byte little-endian header length: at most safetensors' limit, and inside the file;
- the header: UTF-8, one JSON object and nothing after it but whitespace; no NaN or Infinity, no
  number beyond a double's range, no lone UTF-16 surrogate, no nesting deeper than serde_json's
  limit (the JSON parser safetensors uses);
- `__metadata__`: absent, null or an object of strings;
- every tensor, the ones the converter drops (vision tower, projector) included: a dtype
  safetensors knows, a shape of integers in 0..2^64-1 whose element and bit counts fit 64 bits
  and make whole bytes, and data_offsets of two such integers spanning exactly shape x dtype;
- all tensors together: sorted by offset, they tile the data section from its first byte to its
  last, with no gap, no overlap and no trailing byte. (A header length cut short by a byte or
  two into the header's padding leaves such trailing bytes: every tensor would be read early.)

Stricter than safetensors, because the input is ambiguous rather than malformed: a key given
twice in one object (safetensors keeps the last of two tensors of one name), and a tensor entry
written as a list instead of an object.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError

LENGTH_BYTES = 8                    # the little-endian u64 header length that starts the file
MAX_HEADER_BYTES = 100_000_000      # safetensors' MAX_HEADER_SIZE: a longer header is refused
U64_MAX = 2**64 - 1                 # usize: safetensors checks element and bit counts against it
MAX_DEPTH = 127                     # serde_json refuses the 128th nested array or object
PADDING_PEEK = 8                    # data bytes read after the header, to recognise header padding
# bits per element of every dtype safetensors 0.8 knows (its Dtype::bitsize)
DTYPE_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8,
              "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16,
              "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64,
              "U64": 64}
_DTYPE_NAMES = {k: k for k in DTYPE_BITS}      # one shared string object per dtype
TENSOR_FIELDS = ("dtype", "shape", "data_offsets")
# the JSON strings of an entry with exactly the three fields: its name, the three keys, the dtype
_PLAIN_ENTRY_STRINGS = 5
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")     # \uD800-\uDFFF, perhaps unpaired


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """A dtype and shape, shared by every tensor that has them (the real model has 39 distinct)."""
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


# (tensor name, layout, offset of its first byte in the data section)
Entry = tuple[str, TensorLayout, int]


def read_header(fd: int, size: int, path: Path, layouts: dict | None = None) -> tuple[int, list[Entry]]:
    """(offset of the data section, the tensors) of the safetensors file open as `fd`, `size` bytes long."""
    if size < LENGTH_BYTES:
        raise CheckpointError(f"{path}: not a safetensors file: {size} bytes, shorter than the "
                              f"{LENGTH_BYTES}-byte header length")
    (n,) = struct.unpack("<Q", _pread(fd, LENGTH_BYTES, 0, path))
    if n > MAX_HEADER_BYTES:
        raise _corrupt(path, f"header length {n:,} is over safetensors' limit of {MAX_HEADER_BYTES:,} bytes")
    if n > size - LENGTH_BYTES:
        raise _corrupt(path, f"header length {n:,} runs past the end of the file ({size:,} bytes)")
    blob = _pread(fd, n + PADDING_PEEK, LENGTH_BYTES, path, at_least=n)
    data_size = size - LENGTH_BYTES - n
    return LENGTH_BYTES + n, parse_header(blob[:n], data_size, path, layouts, data_head=blob[n:])


def parse_header(raw: bytes, data_size: int, path: Path, layouts: dict | None = None,
                 data_head: bytes = b"") -> list[Entry]:
    """The tensors of header `raw` (the bytes after the length) over a data section of `data_size`
    bytes, in the header's order. `layouts`, shared across shards, keeps one TensorLayout per
    distinct (dtype, *shape); `data_head` (the first data bytes) only words an error better."""
    doc, text, exact = _load(raw, path)
    strings = _check_metadata(path, doc)
    entries, entry_strings, end = _entries(doc, path, {} if layouts is None else layouts, exact)
    _check_unique_keys(text, strings + entry_strings, path)
    if "\\" in text and _SURROGATE_ESCAPE.search(text):
        for name in doc:
            _check_string(path, name, f"the name of tensor {name!r}")
    last = entries[-1][0] if entries else None
    if end is None:             # not in file order: tile them in offset order, as safetensors does
        end, last = _tiled_end(path, sorted(entries, key=_offset_order))
    if end != data_size:
        raise _size_mismatch(path, len(raw), data_size, end, last, data_head)
    return entries


# --- the JSON ---------------------------------------------------------------------------------

class _Numbers:
    """JSON number hooks: refuse what serde_json refuses, and note whether any number is not an int
    (until one is, an int-only shape can be looked up without checking each dimension's type)."""

    def __init__(self) -> None:
        self.only_ints = True

    def float(self, text: str) -> float:
        self.only_ints = False
        value = float(text)
        if math.isinf(value):
            raise ValueError(f"number {text[:30]} is out of a double's range")
        return value

    def int(self, text: str):
        if text == "-0":            # serde_json reads -0 as the float -0.0, which no shape accepts
            self.only_ints = False
            return -0.0
        return int(text)            # a ValueError past 4300 digits (serde_json: out of range too)

    @staticmethod
    def constant(text: str):
        raise ValueError(f"{text} is not JSON")


def _load(raw: bytes, path: Path, pairs_hook=None) -> tuple[dict, str, bool]:
    """(the header object, its text, whether every number in it is an int and no value a bool)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _corrupt(path, f"not UTF-8 (byte {e.start} of the header)") from None
    numbers = _Numbers()
    try:
        doc = json.loads(text, parse_float=numbers.float, parse_constant=numbers.constant,
                         parse_int=numbers.int if "-" in text and "-0" in text else None, object_pairs_hook=pairs_hook)
    except RecursionError:
        raise _corrupt(path, f"nested more than {MAX_DEPTH} deep") from None
    except ValueError as e:         # json.JSONDecodeError included
        raise _corrupt(path, f"not valid JSON: {e}") from None
    if type(doc) is not dict:
        raise _corrupt(path, f"not a JSON object but {_kind(doc)}")
    return doc, text, numbers.only_ints and "true" not in text and "false" not in text


def _check_metadata(path: Path, doc: dict) -> int:
    """Pops __metadata__ (null or strings -> strings); returns its JSON strings (the key included)."""
    if "__metadata__" not in doc:
        return 0
    meta = doc.pop("__metadata__")
    if meta is None:
        return 1
    if type(meta) is not dict or not all(type(v) is str for v in meta.values()):
        raise _corrupt(path, f"__metadata__ must be null or an object of strings, not {_show(meta)}")
    for k, v in meta.items():
        _check_string(path, k, "a __metadata__ key")
        _check_string(path, v, f"__metadata__ {k!r}")
    return 1 + 2 * len(meta)


def _check_unique_keys(text: str, strings: int, path: Path) -> None:
    """No key is given twice in one object (serde_json refuses a field twice; json keeps the last).

    Cheap when the text has no backslash: then every '"' delimits a string, and a duplicate key
    would show as more strings in the text than in the parsed header (`strings`). Otherwise the
    text is parsed again, watching every object."""
    if "\\" not in text and text.count('"') == 2 * strings:
        return
    repeated: dict[int, str] = {}

    def watch(pairs: list) -> dict:
        obj = dict(pairs)
        if len(obj) < len(pairs):
            seen: set = set()
            repeated[id(obj)] = next(k for k, _ in pairs if k in seen or seen.add(k))
        return obj
    doc, _, _ = _load(text.encode(), path, pairs_hook=watch)
    if repeated:
        raise _corrupt(path, _where_repeated(doc, repeated))


def _where_repeated(doc: dict, repeated: dict[int, str]) -> str:
    if id(doc) in repeated:
        key = repeated[id(doc)]
        return "__metadata__ is given twice" if key == "__metadata__" else f"tensor {key} is listed twice"
    for name, info in doc.items():
        if id(info) in repeated:
            return f"the entry for tensor {name} gives {repeated[id(info)]!r} twice"
    return f"key {next(iter(repeated.values()))!r} is given twice in one object"


def _check_string(path: Path, value: str, what: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _corrupt(path, f"{what} holds a lone UTF-16 surrogate escape (\\uD800-\\uDFFF)") from None


# --- the tensors ------------------------------------------------------------------------------

def _entries(doc: dict, path: Path, layouts: dict, exact: bool) -> tuple[list[Entry], int, int | None]:
    """(the entries, their JSON strings, where the last ends if each starts where the one before
    ends, the first at 0, else None).

    The common entry -- a shape and dtype seen before, offsets spanning it -- is taken on a fast
    path; any other is checked field by field (`_checked_entry`), which names what is wrong."""
    entries: list[Entry] = []
    strings, pos, in_order = 0, 0, True
    for name, info in doc.items():
        layout = None
        if exact:       # only ints and no bools: a shape equal to a known one is that shape
            try:
                dims, (begin, end) = info["shape"], info["data_offsets"]
                if type(dims) is list and len(info) == 3:
                    layout = layouts.get((info["dtype"], *dims))
                    if layout is not None and not (begin >= 0 and end == begin + layout.nbytes):
                        layout = None
            except (TypeError, KeyError, ValueError):
                layout = None
        if layout is None:
            layout, begin, n_strings = _checked_entry(path, name, info, layouts)
            strings += n_strings
        else:
            strings += _PLAIN_ENTRY_STRINGS
        in_order = in_order and begin == pos
        pos = begin + layout.nbytes
        entries.append((name, layout, begin))
    return entries, strings, pos if in_order else None


def _checked_entry(path: Path, name: str, info, layouts: dict) -> tuple[TensorLayout, int, int]:
    """(layout, first data byte, JSON strings) of one tensor entry, every field checked."""
    def bad(what: str) -> CheckpointError:
        return _corrupt_entry(path, name, what)
    if type(info) is not dict:
        raise bad(f"not an object but {_kind(info)}")
    for field in TENSOR_FIELDS:
        if field not in info:
            raise bad(f"no {field}")
    dtype, dims, offsets = (info[f] for f in TENSOR_FIELDS)
    if type(dtype) is not str or dtype not in DTYPE_BITS:
        raise bad(f"unknown dtype {_show(dtype)}")
    if type(dims) is not list or not all(map(_is_u64, dims)):
        raise bad(f"shape must be a list of integers in 0..2^64-1, not {_show(dims)}")
    if type(offsets) is not list or len(offsets) != 2 or not all(map(_is_u64, offsets)):
        raise bad(f"data_offsets must be two integers in 0..2^64-1, not {_show(offsets)}")
    strings = 1 + len(TENSOR_FIELDS) + 1 + _check_ignored_fields(path, name, info)
    begin, end = offsets
    if end < begin:
        raise CheckpointError(f"{path}: tensor {name}: data_offsets {offsets} end before they begin")
    layout = _layout(path, name, dtype, dims, layouts)
    if end - begin != layout.nbytes:
        raise CheckpointError(f"{path}: tensor {name} spans {end - begin} bytes but "
                              f"{dtype}{dims} needs {layout.nbytes}")
    return layout, begin, strings


def _is_u64(value) -> bool:
    return type(value) is int and 0 <= value <= U64_MAX


def _layout(path: Path, name: str, dtype: str, dims: list[int], layouts: dict) -> TensorLayout:
    """The shared layout of (dtype, dims); sizes computed as safetensors does, overflow included."""
    key = (dtype, *dims)
    layout = layouts.get(key)
    if layout is None:
        count = 1
        for d in dims:          # in order, as safetensors' checked products: [2^40, 2^40, 0] overflows
            count *= d
            if count > U64_MAX:
                raise CheckpointError(f"{path}: tensor {name}: shape {dims} has more than 2^64-1 elements")
        bits = count * DTYPE_BITS[dtype]
        if bits > U64_MAX:
            raise CheckpointError(f"{path}: tensor {name}: {dtype}{dims} has more than 2^64-1 bits")
        if bits % 8:
            raise CheckpointError(f"{path}: tensor {name}: {dtype}{dims} is not a whole number of bytes")
        layout = layouts[key] = TensorLayout(_DTYPE_NAMES[dtype], tuple(dims), bits // 8)
    return layout


def _check_ignored_fields(path: Path, name: str, info: dict) -> int:
    """Fields besides the three are ignored by safetensors, but serde_json still refuses some
    values in them; returns their JSON strings."""
    strings = 0
    for key, value in info.items():
        if key not in TENSOR_FIELDS:
            _check_string(path, key, f"a key of tensor {name}'s entry")
            strings += 1 + _check_ignored_value(path, f"tensor {name}'s {key!r}", value, 3)
    return strings


def _check_ignored_value(path: Path, where: str, value, depth: int) -> int:
    """Nesting (the header is depth 1, an entry 2, this value `depth`), strings and big ints."""
    if type(value) in (dict, list):
        if depth > MAX_DEPTH:
            raise _corrupt(path, f"{where} is nested more than {MAX_DEPTH} deep")
        items = value.items() if type(value) is dict else ((None, v) for v in value)
        strings = 0
        for k, v in items:
            if k is not None:
                _check_string(path, k, where)
                strings += 1
            strings += _check_ignored_value(path, where, v, depth + 1)
        return strings
    if type(value) is str:
        _check_string(path, value, where)
        return 1
    if type(value) is int:
        try:
            float(value)        # serde_json reads an integer past 64 bits as a double
        except OverflowError:
            raise _corrupt(path, f"{where} is a number beyond a double's range") from None
    return 0


# --- the data section ------------------------------------------------------------------------

def _offset_order(entry: Entry) -> tuple[int, int]:
    return entry[2], entry[1].nbytes


def _tiled_end(path: Path, entries: list[Entry]) -> tuple[int, str | None]:
    """(end of the last tensor, its name), the entries in offset order each starting where the
    previous one ends, the first at 0."""
    pos, prev = 0, None
    for name, layout, begin in entries:
        if begin != pos:
            raise _offset_error(path, name, begin, begin + layout.nbytes, pos, prev)
        pos, prev = begin + layout.nbytes, name
    return pos, prev


def _offset_error(path: Path, name: str, begin: int, end: int, pos: int, prev: str | None) -> CheckpointError:
    where = f"{path}: tensor {name}: data_offsets [{begin}, {end}]"
    if prev is None:
        return CheckpointError(f"{where}: the first tensor must start at 0")
    if begin > pos:
        return CheckpointError(f"{where} leave a gap of {begin - pos} bytes after tensor {prev}, "
                               f"which ends at {pos}")
    return CheckpointError(f"{where} overlap tensor {prev}, which ends at {pos}")


def _size_mismatch(path: Path, header_len: int, data_size: int, end: int, last: str | None,
                   data_head: bytes) -> CheckpointError:
    base = LENGTH_BYTES + header_len
    if end > data_size:
        return CheckpointError(f"{path}: truncated shard: tensor {last} ends at byte {base + end:,}, "
                               f"the file has {base + data_size:,}")
    extra = data_size - end
    message = (f"{path}: {extra:,} bytes of data after the last tensor"
               + (f" ({last}, which ends at data byte {end:,})" if last else " (it has no tensors)"))
    if extra <= len(data_head) and data_head[:extra].strip(b" ") == b"":
        message += (f"; they are spaces, the header's padding: the header length {header_len:,} is "
                    f"{extra} short, and every tensor would be read {extra} bytes early")
    return CheckpointError(message)


# --- helpers ---------------------------------------------------------------------------------

def _pread(fd: int, n: int, offset: int, path: Path, at_least: int | None = None) -> bytes:
    try:
        data = os.pread(fd, n, offset)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
    if len(data) < (n if at_least is None else at_least):
        raise CheckpointError(f"{path}: truncated while reading its header (the file shrank?)")
    return data


def _corrupt(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: corrupt safetensors header: {what}")


def _corrupt_entry(path: Path, name: str, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: corrupt safetensors header entry for tensor {name}: {what}")


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _show(value, limit: int = 60) -> str:
    """A JSON value as the header spells it, cut short."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."
