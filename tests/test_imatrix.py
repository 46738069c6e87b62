"""Importance matrices (kimi_convert.quant.imatrix): both llama-imatrix formats, built here on the tensor
names and shapes of a converted K3 fixture, loaded into the vectors llama-quantize would hand ggml."""
from __future__ import annotations

import os
import re
import struct
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from kimi_convert.fixtures.imatrix import k3_entries, unrouted, write_dat, write_gguf_imatrix
from kimi_convert.gguf_io import open_gguf
from kimi_convert.quant.imatrix import (ImatrixError, coverage_lines, expert_slice, load_imatrix)

U32, STR = GGUFValueType.UINT32, GGUFValueType.STRING


def dat_values(sums: np.ndarray, counts: np.ndarray, ncall: int) -> np.ndarray:
    """What imatrix.cpp save_imatrix_legacy stores: (sum/count)*ncall, and 1*ncall for a matrix without data."""
    c = np.repeat(counts.astype(np.float32), sums.shape[1]).reshape(sums.shape)
    v = np.where(c == 0, np.float32(1), sums)
    c = np.where(c == 0, np.float32(1), c)
    return ((v / c) * np.float32(ncall)).astype(np.float32)


# ------------------------------------------------------------------ the independent expectation

def lround(c: float) -> int:
    return int(Decimal(float(c)).to_integral_value(rounding=ROUND_HALF_UP))


def expected_gguf(sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """in_sum2/lround(count), 1.0 where that is 0. The float64 quotient rounded once to float32 is the
    float32 quotient (double rounding is harmless for division when 53 >= 2*24 + 2)."""
    out = []
    for row, c in zip(sums, counts):
        n = lround(c)
        out.append(np.ones(row.size, np.float32) if n == 0
                   else (row.astype(np.float64) / float(np.float32(n))).astype(np.float32))
    return np.concatenate(out)


def bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).view(np.uint32)


# ------------------------------------------------------------------ a K3 imatrix

@pytest.fixture(scope="module")
def k3_shapes(converted) -> dict:
    return {n: t.shape for n, t in open_gguf(converted("k3")).tensors.items()}


@pytest.fixture(scope="module")
def k3_gguf(tmp_path_factory, k3_shapes):
    entries = k3_entries(k3_shapes)
    path = write_gguf_imatrix(tmp_path_factory.mktemp("im") / "k3.imatrix.gguf", entries,
                              datasets=("calib-k3.txt", "more.txt"), chunk_count=33)
    return path, entries


def test_gguf_vectors_are_llama_quantize_s(k3_gguf, k3_shapes):
    path, entries = k3_gguf
    im = load_imatrix(path)
    assert im.format == "gguf" and im.names == sorted(entries)
    n_checked = 0
    for name, (sums, counts) in entries.items():
        shape = k3_shapes[name]
        v = im.vector(name, shape)
        assert v.dtype == np.float32 and v.size == shape[-1] * (shape[-3] if len(shape) == 3 else 1)
        assert np.array_equal(bits(v), bits(expected_gguf(sums, counts))), name
        n_checked += 1
    assert n_checked > 100
    # stacked experts: expert e is quantized with its own slice; an unrouted one with 1.0 everywhere
    name = "blk.3.ffn_down_exps.weight"
    shape, (sums, counts) = k3_shapes[name], entries[name]
    v = im.vector(name, shape)
    for e in range(shape[0]):
        part = expert_slice(v, shape, e)
        assert part.size == shape[-1]
        want = np.ones(shape[-1], np.float32) if e in unrouted(name, shape[0]) else sums[e] / counts[e]
        assert np.array_equal(bits(part), bits(want)), e
    assert unrouted(name, shape[0])          # the fixture does have experts without tokens


def test_gguf_counts_are_rounded_as_lround(tmp_path):
    # lround: half away from zero (2.5 -> 3, 0.5 -> 1), 0.49 -> 0 (neutral 1.0); 2^24+1 is not a float32
    counts = np.array([2.5, 0.5, 0.49, 1.5, 7.0, 16777217.0], np.float32)
    sums = np.random.default_rng(1).random((6, 32)).astype(np.float32) * 1e3
    path = write_gguf_imatrix(tmp_path / "r.gguf", {"blk.0.ffn_up_exps.weight": (sums, counts)})
    v = load_imatrix(path).vector("blk.0.ffn_up_exps.weight", (6, 8, 32))
    assert np.array_equal(bits(v), bits(expected_gguf(sums, counts)))
    assert np.array_equal(v[64:96], np.ones(32, np.float32))
    assert np.array_equal(bits(v[:32]), bits((sums[0].astype(np.float64) / 3).astype(np.float32)))


def test_dat_vectors_are_llama_quantize_s(tmp_path, k3_shapes):
    entries = k3_entries(k3_shapes, seed=5)
    chunk = 512
    rows = []
    for name, (sums, counts) in sorted(entries.items()):
        ncall = -(-int(counts.max()) // chunk)                  # imatrix.cpp: ceiling division
        rows.append((name, ncall, dat_values(sums, counts, ncall)))
    rows.append(("blk.0.raw_kept.weight", 0, np.arange(1, 9, dtype=np.float32)))   # ncall 0: as stored
    path = write_dat(tmp_path / "k3.dat", rows, trailer=(77, b"calib.txt"))
    im = load_imatrix(path)
    assert im.format == "dat" and len(im.names) == len(rows)
    for name, ncall, stored in rows[:-1]:
        shape = k3_shapes[name]
        want = (stored.astype(np.float64).reshape(-1) / float(np.float32(ncall))).astype(np.float32)
        assert np.array_equal(bits(im.vector(name, shape)), bits(want)), name
    name = "blk.5.ffn_gate_exps.weight"
    shape = k3_shapes[name]
    v = im.vector(name, shape)
    for e in unrouted(name, shape[0]):       # stored as 1*ncall, read back as exactly 1.0
        assert np.array_equal(expert_slice(v, shape, e), np.ones(shape[-1], np.float32))
    assert np.array_equal(im.vector("blk.0.raw_kept.weight", (1, 8)), np.arange(1, 9, dtype=np.float32))


def test_dat_ncall_is_converted_to_float_first(tmp_path):
    # float / int64 in C++ converts the int to float: 16777217 becomes 16777216.0f
    values = np.random.default_rng(2).random(32).astype(np.float32) * 1e9
    path = write_dat(tmp_path / "n.dat", [("blk.0.attn_q.weight", 16777217, values)], trailer=None)
    v = load_imatrix(path).vector("blk.0.attn_q.weight", (4, 32))
    assert np.array_equal(bits(v), bits((values.astype(np.float64) / 16777216.0).astype(np.float32)))


# ------------------------------------------------------------------ lookups against tensors

def test_size_mismatch_names_the_tensor(tmp_path, k3_shapes):
    # an imatrix of another model: blk.2.attn_q.weight had 128 columns
    entries = {"blk.2.attn_q.weight": (np.ones((1, 128), np.float32), np.array([3], np.float32))}
    path = write_gguf_imatrix(tmp_path / "other.gguf", entries)
    im = load_imatrix(path)
    with pytest.raises(ImatrixError) as e:
        im.vector("blk.2.attn_q.weight", k3_shapes["blk.2.attn_q.weight"])
    assert str(e.value) == (f"{path}: imatrix entry blk.2.attn_q.weight has 128 values, tensor "
                            f"blk.2.attn_q.weight [64, 96] needs 96 (96 columns x 1 matrices)")


def test_size_mismatch_on_stacked_experts(tmp_path, k3_shapes):
    # per-expert sums of the right width but too few experts (an imatrix of a smaller MoE)
    shape = k3_shapes["blk.1.ffn_up_exps.weight"]                  # (16, 96, 64)
    entries = {"blk.1.ffn_up_exps.weight": (np.ones((8, 64), np.float32), np.ones(8, np.float32))}
    im = load_imatrix(write_gguf_imatrix(tmp_path / "moe8.gguf", entries))
    with pytest.raises(ImatrixError, match=r"blk\.1\.ffn_up_exps\.weight \[16, 96, 64\] needs 1024 "
                                           r"\(64 columns x 16 matrices\)"):
        im.vector("blk.1.ffn_up_exps.weight", shape)


def test_token_embd_mismatch_and_missing_entries_are_notes(tmp_path, k3_shapes):
    entries = {"token_embd.weight": (np.ones((1, 10), np.float32), np.array([3], np.float32)),
               "blk.0.attn_k.weight": (np.full((1, 96), 6, np.float32), np.array([3], np.float32))}
    im = load_imatrix(write_gguf_imatrix(tmp_path / "e.gguf", entries))
    notes: list[str] = []
    assert im.vector("token_embd.weight", k3_shapes["token_embd.weight"], notes.append) is None
    assert im.vector("output.weight", k3_shapes["output.weight"], notes.append) is None
    assert notes == ["imatrix entry token_embd.weight has 10 values, tensor token_embd.weight [1024, 96] needs "
                     "96 (96 columns x 1 matrices): quantized without it, as llama-quantize does",
                     "did not find weights for output.weight"]
    assert np.array_equal(im.vector("blk.0.attn_k.weight", (64, 96), notes.append), np.full(96, 2, np.float32))
    assert len(notes) == 2


# ------------------------------------------------------------------ metadata written into the output

def test_gguf_metadata(k3_gguf):
    path, entries = k3_gguf
    assert load_imatrix(str(path)).metadata() == [
        ("quantize.imatrix.file", str(path), STR),
        ("quantize.imatrix.dataset", "calib-k3.txt", STR),          # the first dataset only
        ("quantize.imatrix.entries_count", len(entries), U32),
        ("quantize.imatrix.chunks_count", 33, U32)]


@pytest.mark.parametrize("chunk_count", [0, 1 << 31, (1 << 32) - 1])
def test_chunks_count_only_when_positive_int32(tmp_path, chunk_count):
    # llama.cpp keeps imatrix.chunk_count in an int32 and writes it only when > 0
    entries = {"blk.0.attn_k.weight": (np.ones((1, 96), np.float32), np.ones(1, np.float32))}
    path = write_gguf_imatrix(tmp_path / "c.gguf", entries, chunk_count=chunk_count)
    keys = [k for k, _, _ in load_imatrix(path).metadata()]
    assert keys == ["quantize.imatrix.file", "quantize.imatrix.dataset", "quantize.imatrix.entries_count"]


def test_dat_metadata_and_c_string_rules(tmp_path):
    # a path of more than 127 bytes that a cut at 127 splits inside "é" (2 bytes), a dataset with a NUL
    n_d = 126 - len(os.fsencode(str(tmp_path))) - 1          # "é" takes bytes 126 and 127
    assert n_d >= 1
    folder = tmp_path / ("d" * n_d + "é")
    folder.mkdir()
    path = write_dat(folder / "imatrix.dat", [("blk.0.attn_k.weight", 2, np.full(96, 4, np.float32))],
                     trailer=(12, b"wiki.train.raw\0junk"))
    raw = os.fsencode(str(path))
    assert len(raw) > 127 and raw[126:128] == "é".encode()
    meta = load_imatrix(str(path)).metadata()
    assert meta == [("quantize.imatrix.file", raw[:127], STR),       # bytes: not valid UTF-8 any more
                    ("quantize.imatrix.dataset", "wiki.train.raw", STR),
                    ("quantize.imatrix.entries_count", 1, U32),
                    ("quantize.imatrix.chunks_count", 12, U32)]
    # the bytes go into a GGUF as they are, like gguf_set_val_str does
    w = GGUFWriter(tmp_path / "meta.gguf", "kimi-k3")
    for key, value, vtype in meta:
        w.add_key_value(key, value, vtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    f = GGUFReader(tmp_path / "meta.gguf").fields["quantize.imatrix.file"]
    assert bytes(f.parts[f.data[0]]) == raw[:127]


def test_dat_without_trailer_has_no_dataset_or_chunks(tmp_path):
    path = write_dat(tmp_path / "t.dat", [("blk.0.attn_k.weight", 2, np.full(96, 4, np.float32))], trailer=None)
    assert [k for k, _, _ in load_imatrix(path).metadata()] == ["quantize.imatrix.file",
                                                                "quantize.imatrix.entries_count"]


# ------------------------------------------------------------------ coverage

def test_coverage_per_layer(k3_gguf, k3_shapes):
    path, entries = k3_gguf
    im = load_imatrix(path)
    tensors = [(n, s) for n, s in k3_shapes.items() if len(s) >= 2 and "ssm_conv1d" not in n]
    rows = {r.tensor: r for r in im.coverage(tensors)}
    for name, r in rows.items():
        shape = k3_shapes[name]
        assert r.matrices == (shape[-3] if len(shape) == 3 else 1)
        assert r.found == (name in entries)
        if "_exps" in name:
            assert r.without_data == len(unrouted(name, shape[0])) and r.layer == int(name.split(".")[1])
            assert r.per_matrix
        elif r.found:
            assert r.without_data == 0 and not r.per_matrix
    assert rows["token_embd.weight"].found is False and rows["token_embd.weight"].layer is None
    lines = coverage_lines(rows.values())
    moe_layers = sorted({int(n.split(".")[1]) for n in entries if "_exps" in n})
    assert [ln.split(":")[0] for ln in lines[:-1]] == [f"blk.{i}" for i in moe_layers]
    n = len(unrouted("blk.1.x", 16))
    assert lines[0] == (f"blk.1: experts without data: ffn_gate_exps.weight {n}/16, ffn_down_exps.weight {n}/16, "
                        f"ffn_up_exps.weight {n}/16")
    assert lines[-1] == ("no imatrix entry (2, quantized without importance weights): token_embd.weight, "
                         "output.weight")


def test_coverage_of_a_dense_tensor_without_tokens(tmp_path):
    # one count for the 4 matrices of attn_k_b: 0 means all 4 get 1.0
    entries = {"blk.3.attn_k_b.weight": (np.zeros((1, 64), np.float32), np.zeros(1, np.float32))}
    im = load_imatrix(write_gguf_imatrix(tmp_path / "z.gguf", entries))
    (row,) = im.coverage([("blk.3.attn_k_b.weight", (4, 16, 16))])
    assert (row.layer, row.matrices, row.found, row.without_data, row.per_matrix) == (3, 4, True, 4, False)
    assert coverage_lines([row]) == ["blk.3: experts without data: attn_k_b.weight 4/4"]
    assert np.array_equal(im.vector("blk.3.attn_k_b.weight", (4, 16, 16)), np.ones(64, np.float32))


def test_dat_coverage_is_unknown(tmp_path):
    path = write_dat(tmp_path / "x.dat", [("blk.1.ffn_up_exps.weight", 1, np.ones(16 * 64, np.float32))])
    rows = load_imatrix(path).coverage([("blk.1.ffn_up_exps.weight", (16, 96, 64))])
    assert rows[0].found and rows[0].without_data is None
    assert coverage_lines(rows) == ["experts without data: unknown for 1 stacked tensors (a .dat imatrix has "
                                    "no per-expert counts)"]


# ------------------------------------------------------------------ bad files

def ok_entry(n_mat=2, ne0=32):
    return np.ones((n_mat, ne0), np.float32), np.full(n_mat, 3, np.float32)


NAME = "blk.1.ffn_up_exps.weight"


def gguf_case(entries=None, **kw):
    return lambda d: write_gguf_imatrix(d / "bad.gguf", {NAME: ok_entry()} if entries is None else entries, **kw)


def cut(build, n_bytes: int):
    def f(d: Path) -> Path:
        p = build(d)
        p.write_bytes(p.read_bytes()[:-n_bytes])
        return p
    return f


def patched(build, offset: int, data: bytes):
    def f(d: Path) -> Path:
        p = build(d)
        raw = bytearray(p.read_bytes())
        raw[offset:offset + len(data)] = data
        p.write_bytes(bytes(raw))
        return p
    return f


def appended(build, data: bytes):
    def f(d: Path) -> Path:
        p = build(d)
        p.write_bytes(p.read_bytes() + data)
        return p
    return f


def raw_file(data: bytes):
    def f(d: Path) -> Path:
        p = d / "bad.dat"
        p.write_bytes(data)
        return p
    return f


def dat_case(entries, trailer=(1, b"x")):
    return lambda d: write_dat(d / "bad.dat", entries, trailer)


nan_seen = np.ones((2, 32), np.float32)
nan_seen[1, 5] = np.nan
GOOD_DAT = [(NAME, 1, np.ones(32, np.float32))]
i32 = struct.Struct("<i").pack

BAD = {
    "model gguf": (gguf_case(general_type="model"), r"not an imatrix \(general.type is 'model'\)"),
    "no chunk_size": (gguf_case(drop=("imatrix.chunk_size",)),
                      r"not an imatrix: imatrix.chunk_size missing \(llama-quantize refuses it too\)"),
    "no keys": (gguf_case(drop=("imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size")),
                r"not an imatrix: imatrix.datasets, imatrix.chunk_count, imatrix.chunk_size missing"),
    "no entries": (gguf_case(entries={}, extra_tensors=[("token_embd.weight", np.ones((2, 2), np.float32))]),
                   r"no imatrix entries \(no tensor is named W.in_sum2 / W.counts\)"),
    "f16 sums": (gguf_case(entries={NAME: (np.ones((2, 32), np.float16), np.full(2, 3, np.float32))}),
                 rf"{NAME}.in_sum2 is F16, an imatrix tensor must be F32"),
    "sums without counts": (gguf_case(drop=(f"{NAME}.counts",)),
                            rf"entry {NAME} has {NAME}.in_sum2 but no {NAME}.counts"),
    "counts without sums": (gguf_case(drop=(f"{NAME}.in_sum2",)),
                            rf"entry {NAME} has {NAME}.counts but no {NAME}.in_sum2"),
    "shape mismatch": (gguf_case(entries={NAME: (np.ones((2, 32), np.float32), np.ones(3, np.float32))}),
                       rf"entry {NAME}: {NAME}.in_sum2 \[2, 32\] does not match {NAME}.counts \[3, 1\]"),
    "nan in a seen expert": (gguf_case(entries={NAME: (nan_seen, np.full(2, 3, np.float32))}),
                             rf"entry {NAME}: value 37 \(matrix 1, column 5\) is nan \(not finite\)"),
    "negative count": (gguf_case(entries={NAME: (np.ones((2, 32), np.float32), np.array([3, -1], np.float32))}),
                       rf"{NAME}.counts: count 1 is -1.0 \(a token count must be finite and >= 0\)"),
    "inf count": (gguf_case(entries={NAME: (np.ones((2, 32), np.float32), np.array([np.inf, 1], np.float32))}),
                  rf"{NAME}.counts: count 0 is inf"),
    "wrong key type": (gguf_case(chunk_count=(10, GGUFValueType.INT32)),
                       r"imatrix.chunk_count is INT32, expected UINT32"),
    "wrong datasets type": (gguf_case(drop=("imatrix.datasets",), extra_kv=[("imatrix.datasets", "calib", STR)]),
                            r"imatrix.datasets is STRING, expected ARRAY\[STRING\]"),
    "truncated gguf": (cut(gguf_case(), 100), r"truncated: tensor .* ends at byte \d+, the file has \d+ bytes"),
    "garbage tensor count": (patched(gguf_case(), 8, struct.pack("<Q", 1 << 40)), r"truncated|not a readable"),
    "empty": (raw_file(b""), r"empty file, not an imatrix"),
    "text file": (raw_file(b"hello, world\n"), r"not an imatrix: it says \d+ entries, which 9 bytes cannot hold"),
    "zero entries": (raw_file(i32(0)), r"no data \(the entry count is 0\)"),
    "huge entry count": (raw_file(i32(2**31 - 1) + bytes(40)), r"it says 2147483647 entries, which 40 bytes"),
    "negative name length": (raw_file(i32(1) + i32(-5) + bytes(20)), r"entry 1: name length -5 is not in 1\.\.20"),
    "name past the end": (raw_file(i32(1) + i32(1000) + bytes(20)), r"entry 1: name length 1000 is not in 1\.\.20"),
    "non-utf8 name": (dat_case([(b"\xff\xfe.weight", 1, np.ones(4, np.float32))]), r"entry 1: the name .* is not a"),
    "zero values": (raw_file(i32(1) + i32(1) + b"w" + i32(1) + i32(0) + bytes(8)),
                    r"entry w: the value count is 0$"),
    "huge value count": (raw_file(i32(1) + i32(1) + b"w" + i32(1) + i32(2**31 - 1) + bytes(8)),
                         r"entry w: 2147483647 values do not fit the 8 bytes left"),
    "values cut": (cut(dat_case(GOOD_DAT, trailer=None), 4), rf"entry {NAME}: 32 values do not fit the 124 bytes"),
    "duplicate": (dat_case(GOOD_DAT * 2), rf"entry 2 \({NAME}\) appears twice"),
    "nan in dat": (dat_case([(NAME, 2, np.array([1, np.nan], np.float32))]), rf"entry {NAME}: value 1 is nan"),
    "trailer cut": (cut(dat_case(GOOD_DAT, trailer=(3, b"")), 2), r"truncated: the trailer's dataset name length"),
    "dataset cut": (cut(dat_case(GOOD_DAT, trailer=(3, b"calib")), 2),
                    r"truncated: the dataset name length 5 is not in 0\.\.3"),
    "garbage after": (appended(dat_case(GOOD_DAT), b"zz"), r"2 unexpected bytes after the dataset name"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_imatrix_is_one_clear_error(tmp_path, case):
    build, message = BAD[case]
    path = build(tmp_path)
    with pytest.raises(ImatrixError) as e:
        load_imatrix(path)
    text = str(e.value)
    assert text.startswith(f"{path}: ") and "\n" not in text, text
    assert re.search(message, text), text


def test_nan_in_an_expert_without_tokens_is_accepted(tmp_path):
    # llama-quantize replaces that expert by 1.0 before it checks for non-finite values
    sums = np.ones((2, 32), np.float32)
    sums[1, 3] = np.nan
    im = load_imatrix(write_gguf_imatrix(tmp_path / "n.gguf", {NAME: (sums, np.array([3, 0], np.float32))}))
    v = im.vector(NAME, (2, 8, 32))
    assert np.array_equal(v[32:], np.ones(32, np.float32)) and np.isfinite(v).all()


def test_missing_file(tmp_path):
    with pytest.raises(ImatrixError, match=r"nope.dat: cannot read the imatrix \(No such file or directory\)"):
        load_imatrix(tmp_path / "nope.dat")
