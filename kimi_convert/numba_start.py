"""Numba's once-per-process start, without the BLAS probe that none of our kernels needs.

The first time a process compiles or loads a numba function, numba fills its typing and lowering registries.
One of them (``numba.np.arraymath``) checks whether ``np.dot`` can have a BLAS by importing
``scipy.linalg.cython_blas`` when SciPy is installed: 1.0-1.9 s of the 1.3-2.2 s that start took here
(0.25-0.35 s without it, measured on this 2-core VM with ``cpu_target.target_context.refresh()`` timed alone).
Our kernels (``quant.kernels``, ``mxfp4_kernel``) call no BLAS, so ``start`` fills the registries with
``scipy.linalg`` hidden: numba then records that it has no BLAS, and in this process a numba function of
someone else's that calls ``np.dot`` would not compile. Without SciPy installed, nothing changes.
"""
from __future__ import annotations

import sys
import threading

_LOCK = threading.Lock()
_started = False


def start() -> None:
    """Fill numba's registries now (once; later calls return at once)."""
    global _started
    with _LOCK:
        if _started:
            return
        from numba.core.registry import cpu_target    # noqa: PLC0415  (numba only where kernels run)
        hide = "scipy.linalg" not in sys.modules
        if hide:
            sys.modules["scipy.linalg"] = None         # makes `import scipy.linalg...` raise ImportError
        try:
            cpu_target.target_context.refresh()
        finally:
            if hide and sys.modules.get("scipy.linalg", 0) is None:
                del sys.modules["scipy.linalg"]
        _started = True
