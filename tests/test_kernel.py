"""kimi_convert.kernel: a numba kernel called by name with checked arrays, compiled once into numba's cache
(build) and loaded from there by every later process; what getting it adds to a process's RSS (load_rss)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from kimi_convert import kernel
from kimi_convert.quant import blocks

KERNEL_SOURCE = """
from numba import njit


@njit(cache=True, nogil=True)
def scale_rows(x, out):
    for r in range(x.shape[0]):
        for c in range(x.shape[1]):
            out[r, c] = x[r, c] * {factor}
"""
CALL = textwrap.dedent("""
    import numpy as np
    from kimi_convert.kernel import Kernel
    k = Kernel("kimi_test_scale", "scale_rows", "f32_2d", "f32_2d")
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = np.zeros_like(x)
    k(x, out)
    print(out[2].tolist(), k.function().stats.cache_hits.most_common(1))
""")


def call(src: Path) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", CALL], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_build_compiles_into_the_cache_that_later_processes_load_and_an_edit_compiles_again(tmp_path, monkeypatch):
    (tmp_path / "kimi_test_scale.py").write_text(KERNEL_SOURCE.format(factor=2))
    monkeypatch.syspath_prepend(str(tmp_path))
    k = kernel.Kernel("kimi_test_scale", "scale_rows", "f32_2d", "f32_2d")
    assert kernel.load_rss([k]) == kernel.KERNEL_BUILD_RSS              # never compiled here
    k.build()
    assert kernel.load_rss([k]) == kernel.KERNEL_RSS
    assert list((tmp_path / "__pycache__").glob("kimi_test_scale.scale_rows-*.nbi"))
    first = call(tmp_path)
    assert first.startswith("[16.0, 18.0, 20.0, 22.0]") and "[]" not in first       # loaded from the cache
    (tmp_path / "kimi_test_scale.py").write_text(KERNEL_SOURCE.format(factor=3))     # numba keys on the source
    assert call(tmp_path).startswith("[24.0, 27.0, 30.0, 33.0]")


@pytest.mark.parametrize("bad, what", [
    (lambda x, out: (x.astype(np.float64), out), "float64"),
    (lambda x, out: (x[:, ::2], out), "strided"),
    (lambda x, out: (x[0], out), r"float32\[256\]"),
])
def test_arrays_of_the_wrong_kind_are_refused_before_the_call(bad, what):
    x = np.zeros((2, 256), np.float32)
    out = np.zeros((2, 272), np.uint8)
    with pytest.raises(TypeError, match=what):
        blocks.block_type(QT.Q8_0)._ref(*bad(x, out))
    with pytest.raises(TypeError, match="takes 2 arrays"):
        blocks.block_type(QT.Q8_0)._ref(x)


def test_every_kernel_names_a_function_of_its_module_with_its_signature():
    """What scripts/build_kernels.py compiles before the tests: every kernel the package declares."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from build_kernels import all_kernels
    kernels = all_kernels()
    assert len(kernels) > 40
    for k in kernels:
        assert len(k.signature()) == len(k.kinds) and callable(k.function()), k
