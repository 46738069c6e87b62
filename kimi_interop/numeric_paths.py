"""Which arithmetic the interop comparisons run: CPU features, llama.cpp's compiled ISA, numpy's and OpenBLAS's kernels.

ggml picks its kernels at compile time (-march), numpy and OpenBLAS at run time, both by CPU feature; the same
file can then give different last bits on different machines (docs/verification.md §8). The test header prints
all of it, and `.ci/install-interop.sh` uses this file (stdlib only, runnable as a script) to check that the
installed llama-cpp-python is its pinned x86-64-v3 build:

    python kimi_interop/numeric_paths.py pinned-system-info   # what that build reports
    python kimi_interop/numeric_paths.py llama-cpp-probe      # version, sha256 of libggml-cpu.so, report
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

# The /proc/cpuinfo flags that change a kernel: ggml -march=native (AVX512/VNNI/BF16/AMX paths), numpy's dispatch.
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")

# llama_print_system_info() of llama-cpp-python 0.3.36 built by .ci/install-interop.sh (GGML_NATIVE=OFF,
# AVX/AVX2/FMA/F16C/BMI2, tinyBLAS, repack), whitespace-normalised. A -march=native build on an AVX512 CPU adds
# "AVX512 = 1 | AVX512_BF16 = 1 | ...", which means other BF16/F32 matmul kernels (kimi_convert/runtime/ggml_cpu.py).
PINNED_SYSTEM_INFO = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | "
                      "LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 |")
INSTALL_HINT = "run `bash .ci/install-interop.sh` from the repo root"


def cpu_flags() -> dict[str, bool]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    have = set(line.partition(":")[2].split())
    return {flag: flag in have for flag in CPU_FLAGS}


def llama_cpp_system_info() -> str | None:
    """llama.cpp's own llama_print_system_info(), whitespace-normalised; None if llama-cpp-python is missing."""
    try:
        import llama_cpp  # noqa: PLC0415
    except ImportError:
        return None
    return " ".join(llama_cpp.llama_print_system_info().decode().split())


def llama_cpp_pinned_problem() -> str | None:
    """None if the installed llama-cpp-python is the pinned build, else what is wrong (for a test failure)."""
    info = llama_cpp_system_info()
    if info == PINNED_SYSTEM_INFO:
        return None
    return (f"llama-cpp-python reports {info!r}, not the pinned x86-64-v3 build {PINNED_SYSTEM_INFO!r}, whose "
            f"arithmetic Runtime(llama_cpp_rounding=True) emulates: {INSTALL_HINT}")


def numpy_kernels() -> str:
    """numpy's enabled SIMD dispatch targets and OpenBLAS's kernel family (both chosen at run time)."""
    import numpy as np  # noqa: PLC0415

    try:
        from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__  # noqa: PLC0415
    except ImportError:  # numpy 1.x
        from numpy.core._multiarray_umath import __cpu_dispatch__, __cpu_features__  # noqa: PLC0415
    simd = [f for f in __cpu_dispatch__ if __cpu_features__.get(f)]
    return f"numpy {np.__version__} SIMD {'/'.join(simd) or 'baseline'}, OpenBLAS core {_openblas_corename()}"


def _openblas_corename() -> str:
    import ctypes  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415

    libs = sorted((Path(np.__file__).parent.parent / "numpy.libs").glob("*openblas*.so*"))
    for lib in libs:
        handle = ctypes.CDLL(str(lib))
        for symbol in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename"):
            fn = getattr(handle, symbol, None)
            if fn is not None:
                fn.restype = ctypes.c_char_p
                return fn().decode()
    return "unknown"


def numeric_paths() -> list[str]:
    """The lines pytest prints in its header."""
    flags = cpu_flags()
    info = llama_cpp_system_info()
    pinned = "pinned x86-64-v3 build" if info == PINNED_SYSTEM_INFO else "NOT the pinned build"
    return [
        "cpu flags: " + (" ".join(f"{f}={int(v)}" for f, v in flags.items()) or "unknown (no /proc/cpuinfo)"),
        f"llama.cpp (llama-cpp-python): {info or 'not installed'}" + (f" [{pinned}]" if info else ""),
        numpy_kernels(),
    ]


def _probe() -> str:
    """version<TAB>sha256(libggml-cpu.so)<TAB>system info of the installed llama-cpp-python (raises if missing)."""
    import importlib.metadata  # noqa: PLC0415

    import llama_cpp  # noqa: PLC0415

    lib = Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so"
    sha = hashlib.sha256(lib.read_bytes()).hexdigest()
    return "\t".join([importlib.metadata.version("llama_cpp_python"), sha, llama_cpp_system_info() or ""])


if __name__ == "__main__":
    # run as a script, this folder is sys.path[0], and its llama_cpp.py would shadow the real llama_cpp
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    commands = {"pinned-system-info": lambda: PINNED_SYSTEM_INFO, "llama-cpp-probe": _probe,
                "header": lambda: "\n".join(numeric_paths())}
    if len(sys.argv) != 2 or sys.argv[1] not in commands:
        sys.exit(f"usage: numeric_paths.py {'|'.join(commands)}")
    print(commands[sys.argv[1]]())
