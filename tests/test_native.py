"""kimi_convert.native: numba kernels built once into a cache, then linked by processes that never import numba."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from kimi_convert import native
from kimi_interop.ggml_quants import ggml_quantize
from kimi_convert.quant import blocks

ROWS, COLS = 16, 512
QUANTIZE = textwrap.dedent("""
    import hashlib, sys
    import numpy as np
    from gguf import GGMLQuantizationType as QT
    from kimi_convert import native
    from kimi_convert.quant.blocks import quantize
    x = np.random.default_rng(3).standard_t(3, (16, 512)).astype(np.float32)
    w = np.random.default_rng(4).random(512).astype(np.float32)
    for out in (quantize(x, QT.Q4_K, w, threads=2), quantize(x, QT.Q8_0, threads=2)):
        print(hashlib.sha256(out.tobytes()).hexdigest())
    print("numba" in sys.modules, native._fallbacks)
""")


def run(code: str, cache: Path, *path: Path) -> list[str]:
    env = dict(os.environ, **{native.CACHE_ENV: str(cache)})
    if path:
        env["PYTHONPATH"] = os.pathsep.join([*map(str, path), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split("\n")[:-1]


def ggml_digests() -> list[str]:
    x = np.random.default_rng(3).standard_t(3, (ROWS, COLS)).astype(np.float32)
    w = np.random.default_rng(4).random(COLS).astype(np.float32)
    return [hashlib.sha256(np.asarray(ggml_quantize(x, QT.Q4_K, w)).tobytes()).hexdigest(),
            hashlib.sha256(np.asarray(ggml_quantize(x, QT.Q8_0)).tobytes()).hexdigest()]


@pytest.mark.interop
def test_a_warm_cache_quantizes_without_numba_and_a_corrupt_entry_is_built_again(tmp_path, monkeypatch):
    expected = ggml_digests()
    q8_0, q2_K = blocks.block_type(QT.Q8_0)._ref, blocks.block_type(QT.Q2_K)._ref
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    assert native.load_rss([q8_0]) == native.BUILD_RSS
    assert run(QUANTIZE, tmp_path) == [*expected, "True []"]         # a cold cache: numba builds the entries
    entries = sorted(tmp_path.glob("*.native"))
    assert [p.name.split(".")[1] for p in entries] == ["q4_K_impl_rows", "q8_0_rows"]
    assert native.load_rss([q8_0]) == native.NATIVE_RSS
    assert native.load_rss([q8_0, q2_K]) == native.BUILD_RSS           # Q2_K was never built here
    assert run(QUANTIZE, tmp_path) == [*expected, "False []"]        # warm: linked, numba never imported

    head, obj = entries[0].read_bytes().split(b"\n", 1)
    bad = bytearray(obj)
    bad[len(bad) // 2] ^= 0xFF
    entries[0].write_bytes(head + b"\n" + bytes(bad))
    assert run(QUANTIZE, tmp_path) == [*expected, "True []"]         # refused by its SHA-256, built again
    head, obj = entries[0].read_bytes().split(b"\n", 1)
    assert json.loads(head)["sha256"] == hashlib.sha256(obj).hexdigest()
    assert run(QUANTIZE, tmp_path) == [*expected, "False []"]

    header = json.loads(head)
    del header["symbol"]                                              # a header that lost a field
    entries[0].write_bytes(json.dumps(header).encode() + b"\n" + obj)
    assert run(QUANTIZE, tmp_path) == [*expected, "True []"]


KERNEL_SOURCE = """
from numba import njit

@njit(nogil=True)       # no numba cache: its file stamp could miss an edit within the same tick
def scale_rows(x, out):
    for r in range(x.shape[0]):
        for c in range(x.shape[1]):
            out[r, c] = x[r, c] * {factor}
"""
CALL = textwrap.dedent("""
    import sys
    import numpy as np
    from kimi_convert import native
    k = native.Kernel("kimi_test_scale", "scale_rows", "f32_2d", "f32_2d")
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = np.zeros_like(x)
    k(x, out)
    print(out[2].tolist(), "numba" in sys.modules, native._fallbacks)
""")


def test_the_cache_key_follows_the_kernel_source(tmp_path):
    cache, src = tmp_path / "cache", tmp_path / "src"
    src.mkdir()
    (src / "kimi_test_scale.py").write_text(KERNEL_SOURCE.format(factor=2))
    assert run(CALL, cache, src) == ["[16.0, 18.0, 20.0, 22.0] True []"]
    assert run(CALL, cache, src) == ["[16.0, 18.0, 20.0, 22.0] False []"]
    (src / "kimi_test_scale.py").write_text(KERNEL_SOURCE.format(factor=3))      # an edit: a new key
    assert run(CALL, cache, src) == ["[24.0, 27.0, 30.0, 33.0] True []"]
    assert len(list(cache.glob("kimi_test_scale.scale_rows.*.native"))) == 2


def test_an_entry_that_needs_a_missing_symbol_is_refused_not_linked():
    kernel = native.Kernel(f"{blocks.KERNELS}.legacy", "q8_0_rows", "f32_2d", "u8_2d")
    with pytest.raises(native.NativeError, match="kimi_no_such_symbol"):
        native._link(kernel, {"symbol": "entry", "needs": ["kimi_no_such_symbol"]}, b"")


@pytest.mark.interop
def test_a_kernel_that_cannot_be_linked_runs_as_numbas_dispatcher(monkeypatch, tmp_path):
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))

    def refuse(k, header, obj):
        raise native.NativeError("refused by the test")
    monkeypatch.setattr(native, "_link", refuse)
    monkeypatch.setattr(native, "_fallbacks", [])
    kernel = native.Kernel(f"{blocks.KERNELS}.legacy", "q8_0_rows", "f32_2d", "u8_2d")
    x = np.random.default_rng(5).standard_normal((4, 256)).astype(np.float32)
    out = np.empty((4, 272), np.uint8)
    kernel(x, out)
    assert native._fallbacks == ["kimi_convert.quant.kernels.legacy.q8_0_rows: refused by the test"]
    assert out.tobytes() == np.asarray(ggml_quantize(x, QT.Q8_0)).tobytes()


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


def test_an_entry_built_for_other_arguments_is_built_again(tmp_path):
    cache, src = tmp_path / "cache", tmp_path / "src"
    src.mkdir()
    (src / "kimi_test_scale.py").write_text(KERNEL_SOURCE.format(factor=2))
    assert run(CALL, cache, src) == ["[16.0, 18.0, 20.0, 22.0] True []"]
    [entry] = cache.glob("kimi_test_scale.scale_rows.*.native")
    head, obj = entry.read_bytes().split(b"\n", 1)
    header = json.loads(head)
    assert (header["kinds"], header["arrays"]) == (["f32_2d", "f32_2d"], 2)
    del header["arrays"]        # as entries were before the grid tables: code for three (pointer, rows, columns)
    entry.write_bytes(json.dumps(header).encode() + b"\n" + obj)
    assert run(CALL, cache, src) == ["[16.0, 18.0, 20.0, 22.0] True []"]      # not linked: built again
    assert json.loads(entry.read_bytes().split(b"\n", 1)[0])["arrays"] == 2
    assert run(CALL, cache, src) == ["[16.0, 18.0, 20.0, 22.0] False []"]


# a kernel that reads a grid type's tables as a quantizer does: per group of 8 levels (x holds 0., 1. or 2.), the
# point kmap gives, or the first of its neighbour list off the grid; out: that id (2 bytes) and its coordinates'
# sum (sum(2*level + 1), at most 40)
GRID_KERNEL_SOURCE = """
from numba import njit

@njit(nogil=True)
def snap_rows(x, out, grid, kmap, neighbours):
    for r in range(x.shape[0]):
        for g in range(x.shape[1] // 8):
            u = 0
            for i in range(8):
                u |= int(x[r, 8 * g + i]) << 2 * i
            j = kmap[u]
            if j < 0:                       # its list [n, ids...] starts at -j - 1
                j = neighbours[-j - 1 + 1]
            s = 0
            for i in range(8):
                s += grid[j, i]
            out[r, 3 * g] = j & 255
            out[r, 3 * g + 1] = j >> 8
            out[r, 3 * g + 2] = s
"""
GRID_CALL = textwrap.dedent("""
    import sys
    import numpy as np
    from gguf import GGMLQuantizationType as QT
    from kimi_convert import native
    from kimi_convert.quant.blocks import GRID_TABLES
    from kimi_convert.quant.kernels.grids import grid_tables
    k = native.Kernel("kimi_test_snap", "snap_rows", "f32_2d", "u8_2d", *GRID_TABLES)
    x = np.random.default_rng(6).integers(0, 3, (4, 256)).astype(np.float32)
    out = np.zeros((4, 96), np.uint8)
    k(x, out, *grid_tables(QT.IQ2_XS).arrays)
    print(out.tobytes().hex(), "numba" in sys.modules, native._fallbacks)
""")


def snapped(qtype: QT, x: np.ndarray) -> np.ndarray:
    """What snap_rows computes, from the tables' Python API."""
    from kimi_convert.quant.kernels.grids import grid_tables, pack
    t = grid_tables(qtype)
    out = np.zeros((x.shape[0], x.shape[1] // 8 * 3), np.uint8)
    for r in range(x.shape[0]):
        for g in range(x.shape[1] // 8):
            u = int(pack(x[r, 8 * g:8 * g + 8].astype(np.int64), 2))
            j = int(t.kmap[u]) if t.kmap[u] >= 0 else int(t.neighbour_list(u)[0])
            out[r, 3 * g:3 * g + 3] = j & 255, j >> 8, int(t.grid[j].sum())
    return out


def test_a_kernel_reads_grid_tables_through_its_native_entry(tmp_path):
    cache, src = tmp_path / "cache", tmp_path / "src"
    src.mkdir()
    (src / "kimi_test_snap.py").write_text(GRID_KERNEL_SOURCE)
    x = np.random.default_rng(6).integers(0, 3, (4, 256)).astype(np.float32)
    expected = snapped(QT.IQ2_XS, x).tobytes().hex()
    assert len(set(expected[i:i + 6] for i in range(0, len(expected), 6))) > 50     # many points, on and off
    assert run(GRID_CALL, cache, src) == [f"{expected} True []"]       # built
    assert run(GRID_CALL, cache, src) == [f"{expected} False []"]      # linked, numba never imported


@pytest.mark.parametrize("linked", [True, False], ids=["native", "dispatcher"])
def test_a_grid_types_quantize_rows_passes_its_tables(linked, tmp_path, monkeypatch):
    (tmp_path / "kimi_test_snap.py").write_text(GRID_KERNEL_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "kimi_test_snap", raising=False)
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_fallbacks", [])
    if not linked:
        def refuse(k, header, obj):
            raise native.NativeError("refused by the test")
        monkeypatch.setattr(native, "_link", refuse)
    registry = {q: t for q, t in blocks._REGISTRY.items() if q != QT.IQ2_S}
    monkeypatch.setattr(blocks, "_REGISTRY", registry)      # the class below is registered there only

    class Snap(blocks.GridType, blocks.BlockType, qtype=QT.IQ2_S):
        mirrors = "snap_rows (a test kernel)"
        _ref = native.Kernel("kimi_test_snap", "snap_rows", "f32_2d", "u8_2d", *blocks.GRID_TABLES)

    x = np.random.default_rng(7).integers(0, 3, (3, 512)).astype(np.float32)
    out = np.zeros((3, 192), np.uint8)
    Snap.quantize_rows(x, None, out)
    assert out.tobytes() == snapped(QT.IQ2_S, x).tobytes()
    if linked:
        assert native._fallbacks == [] and isinstance(Snap._ref._entry, native._entry_type(5))
    else:
        assert native._fallbacks == ["kimi_test_snap.snap_rows: refused by the test"]
