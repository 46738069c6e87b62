"""The grid i-quants' tables (kimi_convert.quant.kernels.grids) against ggml's own sources.

ggml-quants.c and ggml-common.h are those of the llama-cpp-python 0.3.36 sdist that libggml-base.so is built
from, unpacked by .ci/install-interop.sh into .interop/llama.cpp/ggml/src (read here, never copied). From them:
the kgrid_* source tables the grids must equal point for point, the init functions' kmap_size, nwant and
choice of table, the quantizers' kMaxQ, and the dequantization grids. The kmap and neighbour lists are checked
against a plain loop over ggml's source table that does what iq2xs_init_impl / iq3xs_init_impl do.
"""
from __future__ import annotations

import random
import re
from functools import cache

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants as gguf_quants

from kimi_interop import InteropUnavailable, interop_dir
from kimi_convert.quant.kernels import grids

# ggml.c, ggml_quantize_init: the init each type runs, with its argument
GGML_INIT = {QT.IQ2_XXS: ("iq2xs_init_impl", "type", "GGML_TYPE_IQ2_XXS"),
             QT.IQ2_XS: ("iq2xs_init_impl", "type", "GGML_TYPE_IQ2_XS"),
             QT.IQ2_S: ("iq2xs_init_impl", "type", "GGML_TYPE_IQ2_S"),
             QT.IQ1_S: ("iq2xs_init_impl", "type", "GGML_TYPE_IQ1_S"),
             QT.IQ1_M: ("iq2xs_init_impl", "type", "GGML_TYPE_IQ1_M"),
             QT.IQ3_XXS: ("iq3xs_init_impl", "grid_size", "256"),
             QT.IQ3_S: ("iq3xs_init_impl", "grid_size", "512")}
# ggml-common.h: the dequantization grid each type reads
DEQUANT_GRID = {QT.IQ2_XXS: "iq2xxs_grid", QT.IQ2_XS: "iq2xs_grid", QT.IQ2_S: "iq2s_grid", QT.IQ1_S: "iq1s_grid",
                QT.IQ1_M: "iq1s_grid", QT.IQ3_XXS: "iq3xxs_grid", QT.IQ3_S: "iq3s_grid"}
SAMPLE = 150            # off-grid vectors per grid checked by the plain loop (~2 ms each for IQ1_S)


@cache
def ggml_source(name: str) -> str:
    path = interop_dir() / "llama.cpp" / "ggml" / "src" / name
    if not path.is_file():
        raise InteropUnavailable(f"{path} is missing: run `bash .ci/install-interop.sh` from the repo root")
    return path.read_text()


def c_function(name: str) -> str:
    """The text of C function ``name`` in ggml-quants.c (from its signature to the closing brace in column 0),
    without its // comments (iq2xs_init_impl keeps an older nwant in one)."""
    m = re.search(rf"^\w[^\n(]* {name}\(.*?^}}", ggml_source("ggml-quants.c"), re.S | re.M)
    assert m, name
    return re.sub(r"//[^\n]*", "", m.group(0))


def c_select(expr: str, env: dict[str, str]) -> str:
    """The value of a C chain ``cond ? value : cond ? value : ... : value`` whose conditions are alternatives
    ``name == token || ...``, with ``env`` giving each name's token."""
    expr = " ".join(expr.split())
    while "?" in expr:
        cond, rest = expr.split("?", 1)
        value, expr = rest.split(":", 1)
        if any(env[lhs.strip()] == rhs.strip() for lhs, rhs in (c.split("==") for c in cond.split("||"))):
            return value.strip()
    return expr.strip()


@cache
def kgrid_tables() -> dict[str, list[int]]:
    """ggml-quants.c's ``static const uint16_t kgrid_*[...] = {...};`` tables."""
    found = re.findall(r"static const uint16_t (kgrid_\w+)\[[^\]]*\] = \{([^}]*)\};", ggml_source("ggml-quants.c"))
    return {name: [int(v) for v in body.replace(",", " ").split()] for name, body in found}


@cache
def ggml_init(qtype: QT) -> dict:
    """What ggml's init of ``qtype`` builds from: its source table, bits per level, kmap_size and nwant."""
    func, var, arg = GGML_INIT[qtype]
    body = c_function(func)
    env = {var: arg}

    def declared(decl: str) -> str:
        m = re.search(rf"const {decl} = ([^;]*);", body)
        assert m, (func, decl)
        return c_select(m.group(1), env)
    bits = int(re.search(r"int l = \(kgrid\[k\] >> (\d)\*i\) & (0x\w+);", body).group(1))
    source = declared(r"uint16_t \* kgrid")
    return {"call": f"{func}({arg})", "source": source, "kgrid": kgrid_tables()[source], "bits": bits,
            "kmap_size": int(declared("int kmap_size")), "nwant": int(declared("int nwant"))}


@cache
def dequant_grid(name: str) -> np.ndarray:
    """ggml-common.h's GGML_TABLE ``name`` (uint64/uint32 per point) as its bytes per point, [n, 8 or 4]."""
    m = re.search(rf"GGML_TABLE_BEGIN\((\w+), {name}, \w+\)(.*?)GGML_TABLE_END\(\)", ggml_source("ggml-common.h"),
                  re.S)
    dtype = {"uint64_t": np.uint64, "uint32_t": np.uint32}[m.group(1)]
    values = np.array([int(v, 16) for v in re.findall(r"0x[0-9a-fA-F]+", m.group(2))], dtype)
    return values.astype(values.dtype.newbyteorder("<")).view(np.uint8).reshape(len(values), -1)


def ggml_neighbours(kgrid: list[int], bits: int, dim: int, nwant: int, u: int) -> list[int]:
    """iq2xs_init_impl's / iq3xs_init_impl's list for off-grid index ``u``, as a plain loop: the squared
    distance of 2*level+1 coordinates to every grid point, sorted by (distance, id), cut after the points of
    the nwant-th distinct distance."""
    mask = (1 << bits) - 1
    pos = [2 * ((u >> bits * k) & mask) + 1 for k in range(dim)]
    ranked = []
    for j, g in enumerate(kgrid):
        point = [2 * ((g >> bits * k) & mask) + 1 for k in range(dim)]
        ranked.append((sum((a - b) * (a - b) for a, b in zip(point, pos)), j))
    ranked.sort()
    kept, distances = [], []
    for d2, j in ranked:
        if d2 not in distances:
            if len(distances) == nwant:
                break
            distances.append(d2)
        kept.append(j)
    return kept


def reachable(tables: grids.GridTables, bits: int) -> list[int]:
    """Every index a quantizer packs: levels 0..reach-1 in each coordinate."""
    dim = tables.grid.shape[1]
    mask = (1 << bits) - 1
    return [u for u in range(len(tables.kmap))
            if all((u >> bits * k) & mask < tables.reach for k in range(dim))]


@pytest.mark.interop
@pytest.mark.parametrize("qtype", grids.GRID_TYPES, ids=lambda q: q.name)
def test_the_grid_is_ggmls_source_table_point_for_point(qtype):
    tables, init = grids.grid_tables(qtype), ggml_init(qtype)
    assert tables.packed.tolist() == init["kgrid"]
    levels = (tables.grid.astype(int) - 1) // 2           # the grid as the quantizers decode it
    assert np.array_equal(2 * levels + 1, tables.grid)
    assert grids.pack(levels, init["bits"]).tolist() == init["kgrid"]
    assert (tables.nwant, len(tables.kmap)) == (init["nwant"], init["kmap_size"])
    ours = grids.INITS[grids.SHARED.get(qtype, qtype)]
    assert (ours.source, ours.bits) == (init["source"], init["bits"])
    if qtype not in grids.SHARED:
        assert ours.call == init["call"]


@pytest.mark.interop
@pytest.mark.parametrize("qtype", grids.GRID_TYPES, ids=lambda q: q.name)
def test_the_grid_dequantizes_as_ggml_common_h_and_gguf_py(qtype):
    tables = grids.grid_tables(qtype)
    table = dequant_grid(DEQUANT_GRID[qtype])
    if qtype in (QT.IQ1_S, QT.IQ1_M):
        table = table.view(np.int8)                       # iq1s_grid holds int8 -1, 0, 1
    values = np.unique(table)                             # ggml's value of each level, in level order
    assert len(values) == (3 if tables.reach == 3 else 8)
    decoded = values[(tables.grid.astype(int) - 1) // 2]
    assert np.array_equal(decoded, table)
    cls = getattr(gguf_quants, qtype.name)
    cls.init_grid()
    assert np.array_equal(decoded.astype(np.float32), cls.grid.reshape(cls.grid_shape))
    assert np.array_equal(values.astype(np.float32), np.asarray(cls.grid_map, np.float32))


@pytest.mark.interop
@pytest.mark.parametrize("qtype", grids.GRID_TYPES, ids=lambda q: q.name)
def test_reach_is_what_ggmls_quantizers_clamp_levels_to(qtype):
    impl = {QT.IQ2_XXS: "quantize_row_iq2_xxs_impl", QT.IQ2_XS: "quantize_row_iq2_xs_impl",
            QT.IQ2_S: "quantize_row_iq2_s_impl", QT.IQ3_XXS: "quantize_row_iq3_xxs_impl",
            QT.IQ3_S: "quantize_row_iq3_s_impl"}.get(qtype)
    if impl is None:      # IQ1_S/IQ1_M: the split sets levels 0, 1, 2 (and 2 - L when the scale is negative)
        body = c_function(f"quantize_row_{qtype.name.lower()}_impl")
        assert set(re.findall(r"\bL\[[^=\n]*\] = (\d)", body)) == {"0", "1", "2"}
        assert grids.grid_tables(qtype).reach == 3
    else:
        kmax = re.search(r"const int kMaxQ = (\d+);", c_function(impl))
        assert grids.grid_tables(qtype).reach == int(kmax.group(1))
        assert "MAX(0, MIN(kMaxQ-1, l))" in c_function(impl)


@pytest.mark.interop
@pytest.mark.parametrize("qtype", list(grids.INITS), ids=lambda q: q.name)
def test_kmap_and_neighbour_lists_follow_ggmls_rule(qtype):
    tables, init = grids.grid_tables(qtype), ggml_init(qtype)
    kgrid, bits = init["kgrid"], init["bits"]
    dim = tables.grid.shape[1]
    assert [tables.kmap[g] for g in kgrid] == list(range(len(kgrid)))
    off = [u for u in reachable(tables, bits) if tables.kmap[u] < 0]
    assert len(off) + len(kgrid) == tables.reach ** dim
    sample = sorted({off[0], off[-1], *random.Random(int(qtype)).sample(off, SAMPLE)})
    for u in sample:
        assert tables.neighbour_list(u).tolist() == ggml_neighbours(kgrid, bits, dim, init["nwant"], u), u


@pytest.mark.interop
@pytest.mark.parametrize("qtype", list(grids.INITS), ids=lambda q: q.name)
def test_the_lists_lie_in_index_order_and_unreachable_indices_read_an_empty_list(qtype):
    tables = grids.grid_tables(qtype)
    bits = ggml_init(qtype)["bits"]
    nb, kmap = tables.neighbours, tables.kmap
    offset = 0
    for u in reachable(tables, bits):              # every reachable off-grid list, back to back, in u order
        if kmap[u] >= 0:
            continue
        assert -kmap[u] - 1 == offset, u
        assert nb[offset] > 0
        offset += 1 + int(nb[offset])
    assert offset == len(nb) - 1 and nb[-1] == 0
    unreachable = set(range(len(kmap))) - set(reachable(tables, bits))
    assert unreachable or tables.reach == 1 << bits
    assert all(kmap[u] == -len(nb) for u in unreachable)
    for a, dtype in zip(tables.arrays, (np.int8, np.int32, np.uint16)):
        assert a.dtype == dtype and a.flags.c_contiguous and not a.flags.writeable


def test_iq1_m_reads_iq1_s_tables():
    assert grids.grid_tables(QT.IQ1_M) is grids.grid_tables(QT.IQ1_S)
    with pytest.raises(ValueError, match="Q4_K is not a grid type"):
        grids.grid_tables(QT.Q4_K)
