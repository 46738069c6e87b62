"""The lattice tables of ggml's grid i-quants (IQ1_S/IQ1_M, IQ2_XXS/IQ2_XS/IQ2_S, IQ3_XXS/IQ3_S), built in NumPy.

ggml's quantizers project a vector of levels onto a codebook ("grid") of points through three tables that
``iq2xs_init_impl`` and ``iq3xs_init_impl`` (ggml-quants.c) build once per grid; ports of those quantizers
take them as kernel arguments (``GridTables.arrays``), laid out as ggml lays them out:

``grid``: int8 [n_points, dim], coordinate i of point j is ``2*l + 1`` for its level l (ggml's ``the_grid``,
  each point an uint64/uint32 read as dim int8s; ``pg[i]`` in the quantizers is ``grid[j, i]``). dim is 8 for
  the 2-bit and 1-bit grids, 4 for the 3-bit ones. The quantizers read nothing else of a point: the IQ2/IQ3
  ones ``(pg[i] - 1)/2`` (the level) and ``pg[i]`` as a float, IQ1's ``xg[(pg[i] - 1)/2]``.
``kmap``: int32 [kmap_size], indexed by a packed vector of levels ``u = sum(l[i] << bits*i)`` (bits 2 or 3,
  the quantizers' ``u``): the grid id of the point with those levels, or, for a vector off the grid,
  ``-(offset + 1)`` with ``offset`` its list's position in ``neighbours`` (``kneighbors - kmap[u] - 1``).
  kmap_size is ggml's: 43692 for the 2-bit/1-bit grids, 4096 for the 3-bit ones.
``neighbours``: uint16, one list per off-grid vector, ``[n, id_1, ..., id_n]``: the grid points whose
  squared distance ``sum((grid[id, i] - (2*l[i] + 1))**2)`` is among the ``nwant`` smallest distinct
  distances from the vector (all points, if fewer distinct distances exist), ordered by (distance, id) as
  ``iq2_compare_func`` sorts them. Lists lie in increasing order of ``u``, as in ggml.
``packed``: uint16 [n_points], each point's own ``u`` (= ggml's source table ``kgrid_*``: kmap[packed[j]] = j).

| grid (ggml) | types | points x dim | bits | nwant | lists (reachable) | neighbours u16 | ggml's u16 |
|---|---|---|---|---|---|---|---|
| kgrid_2bit_256 | IQ2_XXS | 256 x 8 | 2 | 2 | 6305 | 119,463 | 417,400 |
| kgrid_2bit_512 | IQ2_XS | 512 x 8 | 2 | 2 | 6049 | 187,771 | 551,722 |
| kgrid_2bit_1024 | IQ2_S | 1024 x 8 | 2 | 1 | 5537 | 50,254 | 209,100 |
| kgrid_1bit_2048 | IQ1_S, IQ1_M | 2048 x 8 | 2 | 3 | 4513 | 332,235 | 1,375,339 |
| kgrid_256 | IQ3_XXS | 256 x 4 | 3 | 2 | 3840 | 22,826 | 22,825 |
| kgrid_512 | IQ3_S | 512 x 4 | 3 | 3 | 3584 | 28,318 | 28,317 |

(neighbours: the array's length, the empty list included; ggml's: its lists of all 43692 - n_points or
4096 - n_points indices, as our builder gives them for every index, equal to the counts of
shared/reference/iq-family.md §1.6.)

Only the reachable part. Every quantizer clamps a level to 0..kMaxQ-1 before it packs ``u``: 0..2 for the 2-bit
grids (kMaxQ = 3) and 0..7 for the 3-bit ones (kMaxQ = 8); IQ1_S/IQ1_M set levels 0, 1 or 2 from their split.
So a 2-bit or 1-bit kmap is read only at the 3^8 = 6561 vectors of levels 0..2 (ggml builds lists for all
43692 - n_points indices, levels 3 included); a 3-bit one at all 4096. We build lists for those 6561 (4096)
vectors only: the list a quantizer reads at a reachable ``u`` is the same ``[n, ids...]`` as ggml's, only its
offset differs (ggml's lists of the unreachable vectors lie in between). ``kmap`` of an unreachable vector
points at one empty list ``[0]`` at the end of ``neighbours`` (ggml would hold a list there; its
``*_find_best_neighbour`` asserts n > 0, as a port reading it should). The full lists would cost 4-5x the time
(0.85 s against 0.17 s for all six, in one process) and 2.6x the memory, for indices no quantizer packs.

How they are derived: the points, in order, from gguf-py's dequantization grids (``gguf.quants.IQ2_XXS.grid``
etc., our pinned dependency, decoded by its ``init_grid``): each coordinate's value there is
``grid_map[l]`` (8/25/43 for IQ2, -1/0/1 for IQ1, ...), so its level is its index in ``grid_map``. kmap and the
lists follow ggml's rule, vectorized: the squared distances of every reachable off-grid vector to every point
(int16, each the sum of two look-ups in tables over half the coordinates), the nwant-th smallest distinct one
per vector by repeated minima, and a stable sort of the selected (vector, distance, id) triples.

Checked against ggml (tests/test_grids.py, with ggml-quants.c and ggml-common.h of the pinned llama.cpp sdist
that .ci/install-interop.sh unpacks): ``packed`` equals ggml's ``kgrid_*`` source table point for point; nwant and
kmap_size are read from ggml's init functions; kmap and the lists equal a plain Python loop that follows
ggml's init (sort by (distance, id), keep nwant distinct distances) on a sample of reachable vectors and the
on-grid ones, and every reachable vector is covered; the grid mapped through ggml-common.h's dequantization
values (``iq2xxs_grid`` ...) equals those tables and gguf-py's grid.

Build time, at first use in a process (then memoized; benchmarks/bench_grids.py, each grid in a new process,
best of 3, on the shared 2-core VM at load average 6): IQ2_XXS 0.04 s, IQ2_XS 0.08, IQ2_S 0.07, IQ1_S 0.14,
IQ3_XXS 0.02, IQ3_S 0.02: 0.37 s for all six (0.17 s one after another in one process); ggml's own init
(ggml_quantize_init in libggml-base.so) took 32 s for the same six there, IQ1_S 16.8 s. Memory (grid, packed,
kmap as int32 of 43692 or 4096, neighbours; ``GridTables.nbytes``): IQ2_XXS 0.40 MiB, IQ2_XS 0.53, IQ2_S 0.27,
IQ1_S 0.82, IQ3_XXS 0.06, IQ3_S 0.07: 2.15 MiB for all six, against 5.70 MiB for ggml's full lists.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import quants as _gguf_quants


@dataclass(frozen=True)
class _Init:
    """How ggml builds one grid's tables: its init call, source table, bits per packed level, kmap size,
    the number of distinct distances a list keeps, and the levels its quantizers clamp to (0..reach-1)."""
    call: str
    source: str
    bits: int
    kmap_size: int
    nwant: int
    reach: int


# ggml_quantize_init (ggml.c) -> iq2xs_init_impl / iq3xs_init_impl (ggml-quants.c)
INITS: dict[QT, _Init] = {
    QT.IQ2_XXS: _Init("iq2xs_init_impl(GGML_TYPE_IQ2_XXS)", "kgrid_2bit_256", 2, 43692, 2, 3),
    QT.IQ2_XS: _Init("iq2xs_init_impl(GGML_TYPE_IQ2_XS)", "kgrid_2bit_512", 2, 43692, 2, 3),
    QT.IQ2_S: _Init("iq2xs_init_impl(GGML_TYPE_IQ2_S)", "kgrid_2bit_1024", 2, 43692, 1, 3),
    QT.IQ1_S: _Init("iq2xs_init_impl(GGML_TYPE_IQ1_S)", "kgrid_1bit_2048", 2, 43692, 3, 3),
    QT.IQ3_XXS: _Init("iq3xs_init_impl(256)", "kgrid_256", 3, 4096, 2, 8),
    QT.IQ3_S: _Init("iq3xs_init_impl(512)", "kgrid_512", 3, 4096, 3, 8),
}
# types that read another's tables (ggml: iq2_data_index maps IQ1_M to IQ1_S's entry)
SHARED = {QT.IQ1_M: QT.IQ1_S}
GRID_TYPES = (*INITS, *SHARED)

_ROWS_PER_STEP = 512        # off-grid vectors whose distances are held at once: 2 MiB of int16 for IQ1_S


@dataclass(frozen=True, eq=False)
class GridTables:
    """One grid's tables, laid out as ggml's (see the module docstring); read-only arrays."""
    qtype: QT                   # the type whose init builds them (IQ1_S for IQ1_M)
    nwant: int
    reach: int
    packed: np.ndarray          # uint16 [n_points]: ggml's kgrid_* value of each point
    grid: np.ndarray            # int8 [n_points, dim]: 2*level + 1
    kmap: np.ndarray            # int32 [kmap_size]
    neighbours: np.ndarray      # uint16: [n, ids...] per reachable off-grid vector, then the empty list [0]

    @property
    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What a quantizer kernel takes: (grid, kmap, neighbours)."""
        return self.grid, self.kmap, self.neighbours

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.grid.nbytes + self.kmap.nbytes + self.neighbours.nbytes

    def neighbour_list(self, u: int) -> np.ndarray:
        """The grid ids listed for off-grid vector ``u`` (as a quantizer reads them: at -kmap[u] - 1)."""
        offset = -int(self.kmap[u]) - 1
        assert offset >= 0, f"{u} is on the grid"
        return self.neighbours[offset + 1:offset + 1 + int(self.neighbours[offset])]


_LOCK = threading.Lock()


def grid_tables(qtype: QT) -> GridTables:
    """The tables the quantizers of ``qtype`` read, built on first use (once per process, thread-safe)."""
    qtype = QT(qtype)
    if qtype not in GRID_TYPES:
        raise ValueError(f"{qtype.name} is not a grid type (have {', '.join(t.name for t in GRID_TYPES)})")
    with _LOCK:
        return _build(SHARED.get(qtype, qtype))


def _levels(qtype: QT) -> np.ndarray:
    """uint8 [n_points, dim]: each point's coordinate levels, in gguf-py's order (the index of each
    coordinate's dequantized value in its class's grid_map)."""
    cls = getattr(_gguf_quants, QT(qtype).name)
    cls.init_grid()
    values = cls.grid.reshape(cls.grid_shape)
    grid_map = np.asarray(cls.grid_map, np.float32)
    assert np.all(np.diff(grid_map) > 0), cls.grid_map
    lv = np.searchsorted(grid_map, values)
    assert np.array_equal(grid_map[lv], values), f"{qtype.name}: a grid value outside grid_map"
    return lv.astype(np.uint8)


def pack(lv: np.ndarray, bits: int) -> np.ndarray:
    """Vectors of levels [..., dim] -> their packed index sum(l[i] << bits*i) (the quantizers' ``u``)."""
    shifts = bits * np.arange(lv.shape[-1])
    return (lv.astype(np.int64) << shifts).sum(axis=-1)


@functools.cache
def _build(qtype: QT) -> GridTables:
    init = INITS[qtype]
    lv = _levels(qtype)
    n_points, dim = lv.shape
    grid = (2 * lv + 1).astype(np.int8)
    packed = pack(lv, init.bits).astype(np.uint16)
    kmap = np.full(init.kmap_size, -1, np.int32)
    kmap[packed] = np.arange(n_points, dtype=np.int32)
    # every vector a quantizer can pack, in increasing order of u, and those of them off the grid
    reachable = np.indices((init.reach,) * dim).reshape(dim, -1).T
    u = pack(reachable, init.bits)
    order = np.argsort(u)
    u, reachable = u[order], reachable[order]
    off = kmap[u] < 0
    counts, ids = _nearest(grid, reachable[off], init.reach, init.nwant)
    # list r starts after the r lists before it: their ids and one count each
    starts = np.concatenate([[0], np.cumsum(counts[:-1] + 1)])
    neighbours = np.empty(len(ids) + len(counts) + 1, np.uint16)
    neighbours[starts] = counts
    neighbours[np.arange(len(ids)) + np.repeat(np.arange(len(counts)) + 1, counts)] = ids
    neighbours[-1] = 0                                  # the empty list of the unreachable vectors
    kmap[kmap < 0] = -len(neighbours)                   # -(offset + 1) of that list
    kmap[u[off]] = -(starts + 1)
    for a in (packed, grid, kmap, neighbours):
        a.flags.writeable = False
    return GridTables(qtype, init.nwant, init.reach, packed, grid, kmap, neighbours)


def _nearest(grid: np.ndarray, lv: np.ndarray, reach: int, nwant: int) -> tuple[np.ndarray, np.ndarray]:
    """For each vector of levels ``lv`` [m, dim] (coordinates 2l+1): how many grid points lie at its nwant
    smallest distinct squared distances, and their ids, ordered by (vector, distance, id)."""
    # a squared distance is the sum of two halves' (the first dim/2 coordinates, the others), each looked
    # up in a table over the reach**(dim/2) level vectors of its half and the grid points
    halves = np.array_split(np.arange(grid.shape[1]), 2)
    tables, index = [], []
    for cols in halves:
        vectors = np.indices((reach,) * len(cols)).reshape(len(cols), -1).T       # first level slowest
        diff = (2 * vectors[:, None, :] + 1) - grid[None, :, cols].astype(np.int16)
        tables.append(np.square(diff).sum(axis=-1, dtype=np.int16))
        index.append(lv[:, cols] @ reach ** np.arange(len(cols) - 1, -1, -1))
    counts, ids = [], []
    for a in range(0, len(lv), _ROWS_PER_STEP):
        d2 = tables[0][index[0][a:a + _ROWS_PER_STEP]] + tables[1][index[1][a:a + _ROWS_PER_STEP]]
        limit = d2.min(axis=1)          # the smallest distance, then the next larger ones: the nwant-th
        for _ in range(nwant - 1):      # (or the largest, if a vector has fewer distinct ones)
            farther = np.where(d2 > limit[:, None], d2, np.int16(np.iinfo(np.int16).max)).min(axis=1)
            limit = np.where(farther < np.iinfo(np.int16).max, farther, limit)
        rows, cols = np.nonzero(d2 <= limit[:, None])                    # by vector, then id
        key = rows * (int(d2.max()) + 1) + d2[rows, cols]
        ids.append(cols[np.argsort(key, kind="stable")])                # by vector, distance, then id
        counts.append(np.bincount(rows, minlength=len(d2)))
    return np.concatenate(counts), np.concatenate(ids)
