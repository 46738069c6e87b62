"""ggml's tensor types: gguf-py's `GGMLQuantizationType` and `GGML_QUANT_SIZES`, plus the ggml types the pinned
gguf (0.19.0 on PyPI) does not list yet.

Q2_0 is the one such type: ggml.h numbers it 42 (`GGML_TYPE_Q2_0`) and ggml-common.h lays it out as
`block_q2_0` (an fp16 scale and 16 bytes of 2-bit codes for 64 values); llama.h gives its file type the
number 41 (`LLAMA_FTYPE_MOSTLY_Q2_0`). gguf-py's own source in that llama.cpp tree already lists both with
these numbers (gguf-py/gguf/constants.py), unreleased. So Q2_0 is a member of `NewerType` here, an IntEnum of
its own: it compares and hashes as its number, as gguf's members do, so it sits beside them in any table keyed
by type. Every gguf member stays gguf's own (a tensor of a type gguf knows is typed exactly as before); once the
pin moves to a gguf that lists Q2_0, its member is used and `NewerType` is no longer reached.

What this does not cover, because it is gguf-py's own code: gguf's `GGUFReader` cannot open a file with a Q2_0
tensor (it raises ValueError: 42 is not a valid GGMLQuantizationType), and `gguf.quants` has no Q2_0 (nor
Q1_0) dequantizer; kimi_convert.quant.blocks has both (docs/formats.md).
"""
from __future__ import annotations

from enum import IntEnum

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType


class NewerType(IntEnum):
    """ggml types (ggml.h `enum ggml_type`) that the pinned gguf lacks."""
    Q2_0 = 42


class NewerFileType(IntEnum):
    """llama file types (llama.h `enum llama_ftype`) that the pinned gguf lacks."""
    MOSTLY_Q2_0 = 41


_NEWER_SIZES = {NewerType.Q2_0: (64, 2 + 16)}       # (values per block, bytes per block): block_q2_0


def _newer(enum, pinned):
    """enum's members that `pinned` (gguf's enum) does not have; those it has must carry the same number."""
    out = []
    for t in enum:
        known = pinned.__members__.get(t.name)
        assert known is None or int(known) == int(t), (t, known)
        if known is None:
            out.append(t)
    return out


# every ggml type this project can read or write: gguf's, then the newer ones
QUANT_SIZES: dict = {**GGML_QUANT_SIZES,
                     **{t: _NEWER_SIZES[t] for t in _newer(NewerType, GGMLQuantizationType)}}
TYPES_BY_ID = {int(t): t for t in QUANT_SIZES}
TYPES_BY_NAME = {t.name: t for t in QUANT_SIZES}
assert len(TYPES_BY_ID) == len(TYPES_BY_NAME) == len(QUANT_SIZES)
FILE_TYPES_BY_NAME = {t.name: t for t in (*LlamaFileType, *_newer(NewerFileType, LlamaFileType))}

Q2_0 = TYPES_BY_NAME["Q2_0"]
MOSTLY_Q2_0 = FILE_TYPES_BY_NAME["MOSTLY_Q2_0"]


def ggml_type(number: int):
    """The type numbered `number` in ggml.h; ValueError if ggml (as far as we know it) has none."""
    try:
        return TYPES_BY_ID[int(number)]
    except KeyError:
        raise ValueError(f"{number} is not a ggml type this version knows") from None
