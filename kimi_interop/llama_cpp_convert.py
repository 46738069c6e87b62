"""llama.cpp's own converter (convert_hf_to_gguf.py of the Oct-2026 tree), run on a checkpoint, for conformance tests;
and the same tree's llama-quantize type-selection snapshots (``upstream_snapshots``).

``.ci/install-interop.sh`` unpacks the converter's part of the llama-cpp-python 0.3.36 sdist (the same tree the
native build compiles) into ``<interop dir>/llama.cpp``; ``upstream_convert`` runs it in a child process through
``upstream_convert_driver.py``, which says what stands in for ``transformers`` and why. The tree knows ``kimi-k3``
only: llama.cpp's ``kimi-k31`` converter came later (b12180) and is not published as source here.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ._common import INSTALL_HINT, InteropError, InteropUnavailable, interop_dir

DRIVER = Path(__file__).with_name("upstream_convert_driver.py")


def upstream_tree() -> Path:
    tree = interop_dir() / "llama.cpp"
    if not (tree / "convert_hf_to_gguf.py").is_file():
        raise InteropUnavailable(f"llama.cpp's converter is not unpacked in {tree}: {INSTALL_HINT}")
    return tree


def upstream_snapshots() -> Path:
    """llama-quantize's type-selection snapshots of the same tree (tests/snapshots/*.schema, which its
    test-quant-type-selection compares llama_quant_compute_types with), as install-interop.sh unpacks them."""
    snapshots = interop_dir() / "llama.cpp" / "tests" / "snapshots"
    if not any(snapshots.glob("*.schema")):
        raise InteropUnavailable(f"llama.cpp's tests/snapshots are not unpacked in {snapshots.parent.parent}: "
                                 f"{INSTALL_HINT}")
    return snapshots


def upstream_convert(hf_dir: Path, out: Path, outtype: str = "bf16", timeout: float = 900) -> Path:
    """Convert HF_DIR with llama.cpp's convert_hf_to_gguf.py; returns OUT."""
    cmd = [sys.executable, str(DRIVER), str(upstream_tree()), str(hf_dir), "--outfile", str(out),
           "--outtype", outtype]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0 or not Path(out).is_file():
        tail = "\n".join(res.stderr.strip().splitlines()[-15:])
        raise InteropError(f"llama.cpp's converter failed on {hf_dir} (exit {res.returncode}):\n{tail}")
    return Path(out)
