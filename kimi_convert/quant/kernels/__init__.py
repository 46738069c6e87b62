"""ggml's block quantizers (ggml/src/ggml-quants.c, ggml-impl.h, ggml.c) in numba, bit for bit.

Every ``<type>_rows(x, [qw,] out)`` fills ``out[r]`` with the bytes ggml writes for row ``x[r]``
(float32 [n_rows, n_per_row] -> uint8 [n_rows, row bytes]; ``qw`` the importance weights of the columns).
The kernels release the GIL (``nogil``); ``blocks`` runs row ranges on threads. One module per family
(``legacy``, ``kquants``, ``iq4``, ...), over the helpers of ``common``. ``grids`` (NumPy, no numba) builds the
grid i-quants' tables (grid, kmap, neighbour lists), which their kernels take as arguments after their data
(``blocks.GridType``, ``blocks.GRID_TABLES``) and never import: numba would bake a global array into the
compiled code as a constant. numba's cache is keyed on the file that
defines a function, not on the files of the helpers it inlines, so an edit to ``common`` would leave stale
compiled callers: ``_drop_stale_cache`` below empties this package's numba cache when any of its sources
changed (an installed package never changes; this is for the working tree).

Rules that keep the bytes equal to ggml's:

* float32 everywhere, each expression evaluated in the order ggml writes it (``w*x*l`` is ``(w*x)*l``), sums
  sequential. Every integer that meets a float is converted with ``F32(...)`` first: numba would otherwise
  promote the operation to float64, where C converts the int to float. (``nearest_int`` only accepts float32,
  so a stray float64 there fails to compile.)
* No fastmath: without it numba marks no float operation ``contract``/``reassoc``, so LLVM neither fuses
  ``a*b+c`` into an FMA nor reorders sums. That matches ggml-base as llama-cpp-python builds it: ggml-quants.c
  is compiled with -O3 and no -march (the ISA flags go to ggml-cpu only), i.e. for baseline x86-64 with SSE2,
  which has no FMA instruction, so GCC's default -ffp-contract=fast has nothing to contract (objdump of
  libggml-base.so shows no vfmadd and no VEX-encoded instruction at all). A build of ggml-base with FMA
  enabled (or aarch64 GCC, which contracts by default) could round differently; the tests would show it.
* Where ggml sums products in a loop, the products are formed in one loop (which LLVM vectorizes) and summed
  in order in a second: the same float32 operations, 2-4x faster than one loop.
* ``error_model="numpy"``: division by zero gives inf/nan as in C instead of raising.
* C truth tests on floats (``d ? 1/d : 0``) are ``!= 0`` tests, true for NaN, and ``MAX(a, b)`` is
  ``a > b ? a : b``: both are written out as such so NaN input flows the same way. Float-to-int conversions
  of NaN give INT_MIN on x86, in C and here alike.
* Stores into ggml's ``uint8_t``/``int8_t`` fields wrap modulo 256, as C does.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

_HERE = Path(__file__).parent


def sources_digest() -> str:
    """SHA-256 over every source file of this package, in name order."""
    h = hashlib.sha256()
    for path in sorted(_HERE.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _drop_stale_cache() -> None:
    """Remove numba's cache files of this package if its sources differ from those that made them."""
    cache = _HERE / "__pycache__"
    stamp, digest = cache / "kernels.sources", sources_digest()
    try:
        if stamp.read_text() == digest:
            return
    except OSError:
        pass
    try:
        cache.mkdir(exist_ok=True)
        for path in (*cache.glob("*.nbi"), *cache.glob("*.nbc")):
            path.unlink(missing_ok=True)
        stamp.write_text(digest)
    except OSError:             # a read-only install: numba caches elsewhere (NUMBA_CACHE_DIR) or not at all
        pass


_drop_stale_cache()
