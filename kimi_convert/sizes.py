"""The one size grammar of every size option (--target-size, --gpu-budget, --split-max-size, kimi-imatrix's
--state-ram): a number of bytes, optionally with a unit, case-insensitive, a space allowed before the unit.

    600000000000    600G    600GB    600 gb      powers of 1000: K, M, G, T (a trailing B changes nothing)
    1.5T            0.5M                          a decimal fraction, computed exactly (1.1G = 1,100,000,000)
    558GiB          64KiB                         powers of 1024: KiB, MiB, GiB, TiB (as --dry-run prints sizes)

K, M, G and T count in powers of 1000 as llama.cpp's gguf-split and llama-quantize count theirs (gguf-split's
--split-max-size 50G is 50,000,000,000 bytes), and as the file sizes in the docs are given (GB); the IEC units
with an `i` are powers of 1024. Nothing else is a size: no exponent (1e9), no inf or nan, no `Gi` without the B.
A sign is read so that each option can say its own bound ("-5G: must be at least 1M"), not "not a size".
"""
from __future__ import annotations

import re
from decimal import Decimal

from .errors import KimiError

SIZE = re.compile(r"([-+]?(?:\d+\.?\d*|\.\d+))\s*(?:([KMGT])(?:(i)B|B)?|B)?", re.IGNORECASE)
MAX_FILE_SIZE = 2**63 - 1     # the largest file offset (off_t) there is
SIZE_HELP = "bytes, or a number with K, M, G, T (powers of 1000; KB, GB alike) or KiB, MiB, GiB, TiB (of 1024)"


def parse_size(text: str, option: str, error: type[KimiError] = KimiError) -> int:
    """`text` (an option's value, `option` its name for the message) -> bytes, rounded down to a whole byte;
    `error`: the exception a bad value raises (one line naming the option and the value)."""
    m = SIZE.fullmatch(text.strip())
    if not m:
        raise error(f"{option} {text!r}: not a size; use {SIZE_HELP}, e.g. 600G")
    unit, binary = (m[2] or "").upper(), bool(m[3])
    power = "KMGT".index(unit) + 1 if unit else 0
    n = int(Decimal(m[1]) * (1024 if binary else 1000) ** power)
    if n > MAX_FILE_SIZE:
        raise error(f"{option} {text}: more than any file can hold ({MAX_FILE_SIZE:,} bytes)")
    return n
