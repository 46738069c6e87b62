"""Our numba kernels, called by name with checked arrays.

A kernel is numba source (``@njit(cache=True, nogil=True)`` in its module: its one implementation). Its first
call imports the module, and numba with it: on a machine where it never ran, numba compiles it (1-3 s a kernel)
and keeps the machine code in its cache (the ``__pycache__`` beside the module, or numba's user-wide cache
folder for a read-only install); every later process loads it from there. The kernels release the GIL, so
row ranges run on several threads at once.

There was a loader of our own here (``native.py``: the cached machine code linked without importing numba). It
saved 0.2 s and ~70 MiB once per process (benchmarks/bench_kernel_start.py, docs/performance.md), which is
5e-5 of an hour of quantizing: it went with the test suite's hundreds of processes, which now run in-process.
"""
from __future__ import annotations

import importlib
import threading

import numpy as np

# argument kinds: every argument is a C-contiguous array; i8_2d, i32_1d and u16_1d are the grid i-quants' tables
# (quant/kernels/grids.py: grid, kmap, neighbours); u32_1d a count a kernel returns (the non-finite values it saw)
ARRAYS = {"f32_2d": (np.float32, 2), "f32_1d": (np.float32, 1), "u8_2d": (np.uint8, 2), "u8_1d": (np.uint8, 1),
          "u16_2d": (np.uint16, 2), "u16_1d": (np.uint16, 1), "u32_2d": (np.uint32, 2), "u32_1d": (np.uint32, 1),
          "i8_2d": (np.int8, 2), "i32_1d": (np.int32, 1)}
# RSS that getting the kernels adds to a process (docs/performance.md, "native.py: what it saved"): numba and
# llvmlite imported and the cached code loaded, 105.5 MiB measured for the repack, 125.1-125.2 MiB for Q4_K and
# Q8_0; a run that compiles them first (a cold cache) peaked 111.7 and 169.8 MiB higher than before the call
KERNEL_RSS = 128 << 20
KERNEL_BUILD_RSS = 176 << 20


def load_rss(kernels) -> int:
    """What getting ``kernels`` adds to a new process's RSS: more if one has not been compiled on this machine
    (numba's cache index, ``<module>.<name>-<line>.py<ver>.nbi``, beside its module; a read-only install keeps it
    in numba's user-wide folder, which is not looked for: the larger figure then)."""
    import importlib.util
    import sys
    from pathlib import Path
    tag = f"py{sys.version_info.major}{sys.version_info.minor}"
    for k in kernels:
        spec = importlib.util.find_spec(k.module)
        if spec is None or spec.origin is None:
            return KERNEL_BUILD_RSS
        src = Path(spec.origin)
        if not any((src.parent / "__pycache__").glob(f"{src.stem}.{k.name}-*.{tag}.nbi")):
            return KERNEL_BUILD_RSS
    return KERNEL_RSS


class Kernel:
    """The numba kernel ``name`` of ``module``, called with C-contiguous arrays of the given kinds."""

    def __init__(self, module: str, name: str, *kinds: str):
        assert all(k in ARRAYS for k in kinds), kinds
        self.module, self.name, self.kinds = module, name, kinds
        self._function = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Kernel({self.module}.{self.name}{self.kinds})"

    def __call__(self, *arrays: np.ndarray) -> None:
        if len(arrays) != len(self.kinds):
            raise TypeError(f"{self.name} takes {len(self.kinds)} arrays, got {len(arrays)}")
        for i, (a, kind) in enumerate(zip(arrays, self.kinds)):
            dtype, ndim = ARRAYS[kind]
            if a.dtype != dtype or a.ndim != ndim or not a.flags.c_contiguous:
                raise TypeError(f"{self.name}: argument {i} must be a C-contiguous {kind}, "
                                f"not {a.dtype}{list(a.shape)}{'' if a.flags.c_contiguous else ' (strided)'}")
        (self._function or self.function())(*arrays)

    def function(self):
        """numba's dispatcher of the kernel (imports numba and the kernel's module on the first call)."""
        with self._lock:
            if self._function is None:
                self._function = getattr(importlib.import_module(self.module), self.name)
            return self._function

    def signature(self) -> tuple:
        """The numba argument types of a call: what build() compiles."""
        from numba import from_dtype, types
        return tuple(types.Array(from_dtype(np.dtype(ARRAYS[k][0])), ARRAYS[k][1], "C") for k in self.kinds)

    def build(self) -> None:
        """Compile the kernel for its arguments now, into numba's cache (scripts/build_kernels.py)."""
        self.function().compile(self.signature())
