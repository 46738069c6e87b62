"""The GGUF reader (kimi_convert/gguf_io/reader.py), reached directly: the same values as gguf-py's GGUFReader on
every valid file, one clear CheckpointError line for every fault class, and nothing else on mutated files."""
from __future__ import annotations

import itertools
import os
import re
import struct
import subprocess
import sys
import threading
import tracemalloc
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kimi_convert.errors import CheckpointError
from kimi_convert.gguf_io import open_gguf, read_gguf

VT = GGUFValueType
u32, u64 = struct.Struct("<I").pack, struct.Struct("<Q").pack


# ------------------------------------------------------------------ the same values as gguf's reader

def assert_same_as_gguf(path: Path) -> None:
    """Keys (in order, with Python types), stored types, tensor infos, data views and layout equal GGUFReader's."""
    ours, theirs = read_gguf(path), GGUFReader(path)
    want = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert repr(ours.fields) == repr(want)          # repr: order, bool vs int and float bits all count
    for k, f in theirs.fields.items():
        if not k.startswith("GGUF."):
            main = VT(f.types[0])
            assert ours.types[k] == (main, VT(f.types[-1]) if main == VT.ARRAY else None), k
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        o = ours.tensors[t.name]
        assert (o.qtype, o.shape, o.offset, o.nbytes) == \
            (QT(t.tensor_type), tuple(reversed(t.shape.tolist())), t.data_offset, t.n_bytes), t.name
        assert (o.raw.dtype, o.raw.shape) == (t.data.dtype, t.data.shape), t.name
        assert o.raw.tobytes() == t.data.tobytes() and not o.raw.flags.writeable, t.name
    (part,) = ours.parts
    assert (part.alignment, part.data_offset, part.version, part.n_tensors) == \
        (theirs.alignment, theirs.data_offset, theirs.fields["GGUF.version"].contents(), len(theirs.tensors))


def write_all_types(path: Path, alignment: int = 64) -> Path:
    """Every value type as a key and as an array, and tensors of every kind of view: typed values
    (F32, F16, F64, I8..I64), bytes per row (BF16, Q8_0, Q4_K, MXFP4), 1 to 4 dimensions."""
    w = GGUFWriter(path, "kimi-k3")
    w.add_custom_alignment(alignment)
    scalars = [(VT.UINT8, 255), (VT.INT8, -128), (VT.UINT16, 65535), (VT.INT16, -32768), (VT.UINT32, 2**32 - 1),
               (VT.INT32, -2**31), (VT.FLOAT32, 0.1), (VT.UINT64, 2**64 - 1), (VT.INT64, -2**63),
               (VT.FLOAT64, float("nan")), (VT.BOOL, True), (VT.STRING, "héllo ✓ 🙂")]
    for vtype, value in scalars:
        w.add_key_value(f"t.{vtype.name.lower()}", value, vtype)
        w.add_key_value(f"t.{vtype.name.lower()}.array", [value, value], VT.ARRAY, vtype)
    w.add_key_value("t.bools", [True, False, True], VT.ARRAY, VT.BOOL)
    w.add_key_value("t.strings", ["a", "", "ü€"], VT.ARRAY, VT.STRING)
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 4)).astype(np.float32))
    w.add_tensor("f32.4d", rng.standard_normal((2, 1, 3, 4)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 8)).astype(np.float16))
    w.add_tensor("f64", rng.standard_normal(5))
    for dtype in (np.int8, np.int16, np.int32, np.int64):
        w.add_tensor(f"{np.dtype(dtype).name}", rng.integers(-100, 100, (2, 3)).astype(dtype))
    for qtype, byte_shape in ((QT.BF16, (3, 16)), (QT.Q8_0, (2, 34 * 2)), (QT.Q4_K, (2, 144)),
                              (QT.MXFP4, (4, 2, 17))):
        w.add_tensor(qtype.name.lower(), rng.integers(0, 256, byte_shape).astype(np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def llama_q8(tmp_path_factory, converted):
    """A file that llama.cpp's own writer (gguf.cpp, through llama_model_quantize) made."""
    import llama_cpp

    import kimi_interop as interop
    out = tmp_path_factory.mktemp("llama-q8") / "k3-q8_0.gguf"
    return interop.llama_quantize(converted("k3", "f32"), out, llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, pure=False,
                                  allow_requantize=True)


@pytest.mark.parametrize("alignment", [32, 64, 4096])
def test_every_value_and_tensor_type_reads_as_gguf_reads_it(tmp_path, alignment):
    assert_same_as_gguf(write_all_types(tmp_path / "all.gguf", alignment))


@pytest.mark.interop
@pytest.mark.parametrize("which", ["k3-bf16", "k31-f32", "llama.cpp q8_0"])
def test_converted_and_llama_cpp_files_read_as_gguf_reads_them(converted, llama_q8, which):
    path = llama_q8 if which == "llama.cpp q8_0" else converted(*which.split("-"))
    assert_same_as_gguf(path)
    assert {t.qtype for t in read_gguf(path).tensors.values()} >= ({QT.Q8_0} if "q8" in which else {QT.F32})


def test_split_file_is_the_union_of_its_parts(tmp_path, k31_dir, converted):
    from kimi_convert.convert.converter import build_plan, convert
    res = convert(build_plan(k31_dir), tmp_path / "split.gguf", split_max_tensors=60)
    gf = open_gguf(res.paths[1])
    assert gf.paths == res.paths and [p.path for p in gf.parts] == res.paths
    for p in res.paths:
        assert_same_as_gguf(p)
    whole = open_gguf(converted("k31"))
    assert list(gf.tensors) == list(whole.tensors)
    assert all(gf.tensors[n].raw.tobytes() == t.raw.tobytes() for n, t in whole.tensors.items())


def test_empty_array_keeps_its_element_type(tmp_path):
    # gguf's reader drops it (types == [ARRAY]); llama.cpp keeps it, and so must a copy of the key
    path = tmp_path / "empty.gguf"
    path.write_bytes(build(kvs=[*BASE_KVS, kv("t.empty", VT.ARRAY, u32(VT.INT32) + u64(0))]))
    gf = open_gguf(path)
    assert gf.fields["t.empty"] == [] and gf.types["t.empty"] == (VT.ARRAY, VT.INT32)


def test_as_shape_views_the_same_bytes(tmp_path):
    gf = read_gguf(write_all_types(tmp_path / "all.gguf"))
    t = gf.tensors["q8_0"]
    wide = t.as_shape((1,) + t.shape)
    assert wide.raw.shape == (1,) + t.raw.shape and wide.raw.tobytes() == t.raw.tobytes() and wide.offset == t.offset


# ------------------------------------------------------------------ a GGUF built byte by byte, to break

def gstr(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return u64(len(b)) + b


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return gstr(key) + u32(vtype) + payload


def tinfo(name: str | bytes, dims: list[int], qtype: int = QT.F32, offset: int = 0) -> bytes:
    return gstr(name) + u32(len(dims)) + b"".join(u64(d) for d in dims) + u32(qtype) + u64(offset)


def strings(*items: str | bytes) -> bytes:
    return u32(VT.STRING) + u64(len(items)) + b"".join(gstr(s) for s in items)


BASE_KVS = [kv("general.architecture", VT.STRING, gstr("kimi-k3")),
            kv("general.alignment", VT.UINT32, u32(32)),
            kv("t.tokens", VT.ARRAY, strings("a", "b", "c")),
            kv("t.flags", VT.ARRAY, u32(VT.BOOL) + u64(3) + bytes([1, 0, 2])),
            kv("t.eps", VT.FLOAT32, struct.pack("<f", 1e-5))]
BASE_TENSORS = [tinfo("a", [4, 2], QT.F32, 0), tinfo("b", [8], QT.F32, 32)]
BASE_DATA = np.arange(16, dtype=np.float32).tobytes()


def build(kvs=None, tensors=None, data=BASE_DATA, version: int | bytes = 3, counts=None, magic=b"GGUF") -> bytes:
    kvs = BASE_KVS if kvs is None else kvs
    tensors = BASE_TENSORS if tensors is None else tensors
    n_tensors, n_kv = counts or (len(tensors), len(kvs))
    head = magic + (version if isinstance(version, bytes) else u32(version)) + u64(n_tensors) + u64(n_kv)
    body = head + b"".join(kvs) + b"".join(tensors)
    return body + bytes(-len(body) % 32) + data


def replaced(items: list[bytes], i: int, item: bytes) -> list[bytes]:
    return items[:i] + [item] + items[i + 1:]


LONG_KVS = replaced(BASE_KVS, 2, kv("t.tokens", VT.ARRAY, strings("alpha" * 4, "b", "c")))


def inside_tokens() -> int:
    """An offset 18 bytes into the 20 of t.tokens' first string, in a file with LONG_KVS."""
    return 24 + len(LONG_KVS[0]) + len(LONG_KVS[1]) + len(gstr("t.tokens")) + 4 + 4 + 8 + 8 + 18


def not_utf8(data: bytes, bad: bytes, k: int, where: str, reason: str) -> tuple[bytes, str]:
    """A file whose one copy of `bad` holds the fault at its byte k, and the message that must name it: what the
    string is, why, the byte, where it is in the string and in the file."""
    assert data.count(bad) == 1
    return data, (rf"{where} is not valid UTF-8 \({reason}: byte 0x{bad[k]:02x} at byte {k} of it, "
                  rf"file offset {data.index(bad) + k}\)$")


BAD = {
    "magic": (build(magic=b"GGML"), r"not a GGUF file \(it does not start with the GGUF magic\)"),
    "version 1": (build(version=1), r"GGUF version 1: only versions 2 and 3 are supported"),
    "version 4": (build(version=4), r"GGUF version 4: only versions 2 and 3"),
    "big-endian": (build(version=struct.pack(">I", 3)), r"GGUF version 50331648 \(a big-endian file\?"),
    "huge key count": (build(counts=(2, 2**64 - 1)), r"header counts 18446744073709551615 keys, which the \d+ bytes"),
    "huge tensor count": (build(counts=(2**40, 5)), r"header counts 1099511627776 tensors"),
    "key length past the end": (build(kvs=replaced(BASE_KVS, 1, u64(2**63) + b"x")),
                                r"truncated: key 2 of 5: the name needs 9223372036854775808 bytes at offset \d+"),
    "key not UTF-8": not_utf8(build(kvs=replaced(BASE_KVS, 1, kv(b"gen\xff", VT.UINT32, u32(32)))), b"gen\xff", 3,
                              r"key 2 of 5: the name", "invalid start byte"),
    "empty key": (build(kvs=replaced(BASE_KVS, 2, kv("", VT.UINT8, b"\0"))), r"key 3 of 5: the name is empty"),
    "duplicate key": (build(kvs=BASE_KVS + [BASE_KVS[2]]), r"key t\.tokens: appears twice"),
    "unknown value type": (build(kvs=replaced(BASE_KVS, 4, kv("t.eps", 13, u32(0)))),
                           r"key t\.eps: unknown value type 13"),
    "unknown element type": (build(kvs=replaced(BASE_KVS, 3, kv("t.flags", VT.ARRAY, u32(77) + u64(0)))),
                             r"key t\.flags: unknown value type 77"),
    "array of arrays": (build(kvs=replaced(BASE_KVS, 3, kv("t.flags", VT.ARRAY, u32(VT.ARRAY) + u64(0)))),
                        r"key t\.flags: an array of arrays \(llama\.cpp refuses it\)"),
    "array length 2^32": (build(kvs=replaced(BASE_KVS, 3, kv("t.flags", VT.ARRAY, u32(VT.UINT8) + u64(2**32)))),
                          r"key t\.flags: an array of 4294967296 UINT8 needs 4294967296 bytes, \d+ are left"),
    "string array length 2^61": (build(kvs=replaced(BASE_KVS, 2, kv("t.tokens", VT.ARRAY, u32(VT.STRING) + u64(2**61)))),
                                 r"key t\.tokens: an array of 2305843009213693952 strings needs at least"),
    "string length past the end": (build(kvs=replaced(BASE_KVS, 0, kv("general.architecture", VT.STRING,
                                                                      u64(2**40) + b"kimi"))),
                                   r"truncated: key general\.architecture: the string needs 1099511627776 bytes"),
    "string not UTF-8": not_utf8(build(kvs=replaced(BASE_KVS, 0, kv("general.architecture", VT.STRING,
                                                                   gstr(b"k\xc3\x28")))), b"k\xc3\x28", 1,
                                 r"key general\.architecture: the string", "invalid continuation byte"),
    "array string not UTF-8": not_utf8(build(kvs=replaced(BASE_KVS, 2, kv("t.tokens", VT.ARRAY,
                                                                         strings("a", b"\xed\xa0\x80")))),
                                       b"\xed\xa0\x80", 0, r"key t\.tokens: element 1 \(string 2 of 2\)",
                                       "invalid continuation byte"),
    "array string with 0x80": not_utf8(build(kvs=replaced(BASE_KVS, 2, kv("t.tokens", VT.ARRAY,
                                                                          strings("a", "b", b"x\x80y")))),
                                       b"x\x80y", 1, r"key t\.tokens: element 2 \(string 3 of 3\)",
                                       "invalid start byte"),
    "cut inside a value": (build(kvs=LONG_KVS)[:inside_tokens()],
                           rf"truncated: key t\.tokens: string 1 of 3 needs 20 bytes at offset "
                           rf"{inside_tokens() - 18}, the file ends at byte {inside_tokens()}$"),
    "alignment type": (build(kvs=replaced(BASE_KVS, 1, kv("general.alignment", VT.UINT64, u64(32)))),
                       r"key general\.alignment: stored as UINT64, it must be UINT32"),
    "alignment 48": (build(kvs=replaced(BASE_KVS, 1, kv("general.alignment", VT.UINT32, u32(48)))),
                     r"key general\.alignment: 48 is not a power of two"),
    "alignment 0": (build(kvs=replaced(BASE_KVS, 1, kv("general.alignment", VT.UINT32, u32(0)))),
                    r"key general\.alignment: 0 is not a power of two"),
    "tensor name not UTF-8": not_utf8(build(tensors=replaced(BASE_TENSORS, 1, tinfo(b"\x80b", [8], QT.F32, 32))),
                                      b"\x80b", 0, r"tensor 2 of 2: the name", "invalid start byte"),
    "tensor name too long": (build(tensors=replaced(BASE_TENSORS, 1, tinfo("b" * 64, [8], QT.F32, 32))),
                             r"tensor b{64}: the name takes 64 bytes, ggml allows at most 63"),
    "duplicate tensor": (build(tensors=[BASE_TENSORS[0], tinfo("a", [8], QT.F32, 32)]), r"tensor a: appears twice"),
    "n_dims 0": (build(tensors=replaced(BASE_TENSORS, 1, tinfo("b", [], QT.F32, 32))),
                 r"tensor b: n_dims is 0, it must be 1\.\.4"),
    "n_dims 5": (build(tensors=replaced(BASE_TENSORS, 1, tinfo("b", [2, 2, 2, 1, 1], QT.F32, 32))),
                 r"tensor b: n_dims is 5, it must be 1\.\.4"),
    "dim 0": (build(tensors=replaced(BASE_TENSORS, 1, tinfo("b", [8, 0], QT.F32, 32))),
              r"tensor b: dims \[8, 0\]: every dim must be a positive int64"),
    "negative dim": (build(tensors=replaced(BASE_TENSORS, 1, tinfo("b", [2**64 - 8], QT.F32, 32))),
                     r"tensor b: dims \[18446744073709551608\]: every dim must be a positive int64"),
    "elements beyond int64": (build(tensors=replaced(BASE_TENSORS, 1, tinfo("b", [2**32, 2**32], QT.F32, 32))),
                              r"tensor b: dims \[4294967296, 4294967296\] hold 18446744073709551616 elements, "
                              r"more than an int64 counts"),
    "unknown ggml type": (build(tensors=replaced(BASE_TENSORS, 1, tinfo("b", [8], 99, 32))),
                          r"tensor b: unknown ggml type 99"),
    "removed ggml type": (build(tensors=replaced(BASE_TENSORS, 1, tinfo("b", [8], 4, 32))),
                          r"tensor b: unknown ggml type 4"),
    "rows not whole blocks": (build(tensors=replaced(BASE_TENSORS, 1, tinfo("b", [16], QT.Q8_0, 32))),
                              r"tensor b: rows of 16 values are not a whole number of Q8_0 blocks of 32"),
    "misaligned offset": (build(tensors=replaced(BASE_TENSORS, 1, tinfo("b", [8], QT.F32, 36))),
                          r"tensor b: data offset 36 is not a multiple of the alignment 32"),
    "tensor past the end": (build(data=BASE_DATA[:32]),
                            r"truncated: tensor b starts at byte \d+, the file has \d+ bytes"),
    "offset past the end": (build(tensors=replaced(BASE_TENSORS, 1, tinfo("b", [8], QT.F32, 2**40))),
                            r"tensor b: data offset 1099511627776, expected 32 \(tensors must be packed in order"),
    "truncated data": (build()[:-10], r"truncated: tensor b ends at byte (\d+), the file has \d+ bytes \(10 missing\)"),
    "overlap": (build(tensors=replaced(BASE_TENSORS, 1, tinfo("b", [8], QT.F32, 0))),
                r"tensor b: data offset 0, expected 32 \(tensors must be packed in order, each padded to the "
                r"alignment\)$"),
    # a dim of a shrunk after writing (as the campaign does): a gap of 32 bytes before b, which llama.cpp refuses
    "gap after a shrunk dim": (build(tensors=[tinfo("a", [4, 1], QT.F32, 0), tinfo("b", [8], QT.F32, 64)],
                                     data=BASE_DATA + bytes(64)),
                               r"tensor b: data offset 64, expected 32 \(tensors must be packed in order"),
    "out of info order": (build(tensors=[tinfo("b", [8], QT.F32, 32), tinfo("a", [4, 2], QT.F32, 0)]),
                          r"tensor b: data offset 32, expected 0 \(tensors must be packed in order"),
    "one line for a name with a newline": (build(kvs=BASE_KVS + [kv("a\nb", VT.UINT8, b"\0")] * 2),
                                           r"key 'a\\nb': appears twice$"),
}


def one_error(path: Path, named: Path | None = None) -> str:
    """The message of opening `path`, which must be one line about `named` (path itself by default)."""
    named = named or path
    with pytest.raises(CheckpointError) as e:
        open_gguf(path)
    text = str(e.value)
    assert text.startswith(f"{named}: ") and "\n" not in text, text
    return text[len(f"{named}: "):]


def test_the_base_file_is_valid(tmp_path):
    path = tmp_path / "base.gguf"
    path.write_bytes(build())
    assert_same_as_gguf(path)
    gf = open_gguf(path)
    assert gf.fields["t.flags"] == [True, False, True] and gf.tensors["b"].raw.tolist() == list(range(8, 16))


@pytest.mark.parametrize("case", list(BAD))
def test_each_fault_is_one_line_naming_it(tmp_path, case):
    data, message = BAD[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    tracemalloc.start()
    try:
        text = one_error(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert re.search(message, text), text
    assert peak < 1 << 20, peak          # the file is < 1 KB; a length taken on trust would need GBs


def test_a_cut_c_string_of_llama_quantize_is_kept_as_bytes(tmp_path):
    # llama-quantize stores quantize.imatrix.file cut at 127 bytes, which can split a UTF-8 character;
    # llama.cpp loads such a file, and a copy of the key must keep its bytes
    cut = ("d" * 125 + "é").encode()[:126]
    path = tmp_path / "cut.gguf"
    path.write_bytes(build(kvs=[*BASE_KVS, kv("quantize.imatrix.file", VT.STRING, gstr(cut))]))
    assert open_gguf(path).fields["quantize.imatrix.file"] == cut
    path.write_bytes(build(kvs=[*BASE_KVS, kv("general.name", VT.STRING, gstr(cut))]))
    assert re.search(r"key general\.name: the string is not valid UTF-8 \(unexpected end of data", one_error(path))


def test_a_tensor_in_two_parts_of_a_split_file(tmp_path):
    for i in (1, 2):
        (tmp_path / f"m-0000{i}-of-00002.gguf").write_bytes(build())
    text = one_error(tmp_path / "m-00001-of-00002.gguf", named=tmp_path / "m-00002-of-00002.gguf")
    assert text == "tensor a: also in m-00001-of-00002.gguf"


def test_not_a_file(tmp_path):
    (tmp_path / "folder.gguf").mkdir()
    assert one_error(tmp_path / "folder.gguf") == "a folder, not a GGUF file"
    (tmp_path / "empty.gguf").write_bytes(b"")
    assert one_error(tmp_path / "empty.gguf") == "empty file, not a GGUF"
    assert one_error(tmp_path / "missing.gguf") == "cannot read it (No such file or directory)"


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    result: list[str] = []
    reader = threading.Thread(target=lambda: result.append(one_error(fifo)), daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():               # blocked in open(): a writer coming and going lets it end
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert result == ["not a regular file, not a GGUF"]


# the growth of the peak RSS while opening argv[1], in a fresh process (tracemalloc slows it down 25x)
_MEASURE = """
import sys
from kimi_convert.gguf_io import open_gguf

def status(key):
    return int(next(line for line in open("/proc/self/status") if line.startswith(key)).split()[1]) * 1024

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")                                # peak RSS := RSS
before = status("VmRSS")
gf = open_gguf(sys.argv[1])
assert gf.fields["tokenizer.ggml.tokens"][-1] == "tok163839\u0120"
print(status("VmHWM") - before)
"""


def test_a_real_size_vocabulary_is_lean(tmp_path):
    """163,840 tokens, their types and 163,328 merges, as the K3 header holds: the values as Python objects
    take about 30 MB; gguf's reader took 552 MiB and 27 s here (two numpy arrays per string)."""
    n = 163_840
    path = tmp_path / "vocab.gguf"
    path.write_bytes(build(kvs=[
        *BASE_KVS,
        kv("tokenizer.ggml.tokens", VT.ARRAY, strings(*(f"tok{i:06d}\u0120" for i in range(n)))),
        kv("tokenizer.ggml.token_type", VT.ARRAY, u32(VT.INT32) + u64(n) + np.ones(n, "<i4").tobytes()),
        kv("tokenizer.ggml.merges", VT.ARRAY, strings(*(f"t{i} k{i}" for i in range(n - 512))))]))
    res = subprocess.run([sys.executable, "-c", _MEASURE, str(path)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    grown = int(res.stdout)
    assert grown < 80 << 20, f"{grown / 2**20:.0f} MiB"


# ------------------------------------------------------------------ mutated files: a GGUFFile or a CheckpointError

@lru_cache(maxsize=None)
def seeds(folder: str) -> tuple[tuple[bytes, int, tuple[int, ...], tuple[int, ...]], ...]:
    """Small valid files to mutate: (bytes, where the data section starts, the offsets of every 64-bit and
    32-bit header field: counts, lengths, types, dims, offsets; found by gguf's reader, not ours)."""
    out = []
    for i, data in enumerate((build(), Path(write_all_types(Path(folder) / "seed.gguf", 32)).read_bytes())):
        path = Path(folder) / f"seed-{i}.gguf"
        path.write_bytes(data)
        r = GGUFReader(path)
        base = r.data.__array_interface__["data"][0]
        parts = [part for f in [*r.fields.values(), *(t.field for t in r.tensors)] for part in f.parts]
        where = {w: tuple(sorted({part.__array_interface__["data"][0] - base for part in parts
                                  if part.dtype.itemsize == w and part.size >= 1})) for w in (8, 4)}
        out.append((data, int(r.data_offset), where[8], where[4]))
    return tuple(out)


HUGE = [0, 1, 7, 31, 2**31, 2**32, 2**32 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1]


@st.composite
def mutations(draw, folder: str) -> bytes:
    data, header_end, fields64, fields32 = draw(st.sampled_from(seeds(folder)))
    data = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        if not data:
            break
        kind = draw(st.sampled_from(["field", "flip", "u64", "u32", "cut", "delete", "insert"]))
        in_header = draw(st.booleans()) or draw(st.booleans())          # 3 in 4 in the header
        top = max(1, min(len(data), header_end if in_header else len(data)))
        low = 0 if draw(st.integers(0, 15)) == 0 else min(4, top - 1)      # the magic stays, mostly
        pos = draw(st.integers(low, top - 1))
        if kind == "field":             # a count, length, type, dim or offset set to an edge value
            width = draw(st.sampled_from([8, 4]))
            pos = draw(st.sampled_from(fields64 if width == 8 else fields32))
            value = draw(st.sampled_from(HUGE) | st.integers(0, 2 ** (8 * width) - 1)) % 2 ** (8 * width)
            data[pos:pos + width] = value.to_bytes(width, "little")
        elif kind == "flip":
            data[pos] ^= draw(st.integers(1, 255))
        elif kind in ("u64", "u32"):
            width = 8 if kind == "u64" else 4
            value = draw(st.sampled_from(HUGE) | st.integers(0, 2 ** (8 * width) - 1)) % 2 ** (8 * width)
            data[pos:pos + width] = value.to_bytes(width, "little")
        elif kind == "cut":
            del data[pos:]
        elif kind == "delete":
            del data[pos:pos + draw(st.integers(1, 16))]
        else:
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
    return bytes(data)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mutated")


_names = itertools.count()


def test_mutated_files_open_or_fail_with_one_line(scratch):
    """Byte flips, truncations, inserted or deleted bytes and length fields set to huge values: the reader
    returns a file whose every tensor view holds its bytes (and equals gguf's reading when gguf reads it),
    or raises one CheckpointError line; never another exception, never more than 8 MiB (the seeds are < 4 KB,
    a length taken on trust would allocate up to 2^64)."""
    folder = str(scratch)

    @settings(max_examples=2000, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(mutations(folder))
    def check(data: bytes) -> None:
        path = scratch / f"m{next(_names)}.gguf"
        path.write_bytes(data)
        tracemalloc.start()
        try:
            try:
                gf = open_gguf(path)
            except CheckpointError as e:
                text, gf = str(e), None
                assert text.startswith(f"{path}: ") and "\n" not in text, text
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 8 << 20, peak
        if gf is not None:
            assert all(t.raw.nbytes == t.nbytes and t.offset + t.nbytes <= len(data) for t in gf.tensors.values())
            _same_when_gguf_reads_it(path, gf)
        path.unlink()

    check()


def _same_when_gguf_reads_it(path: Path, gf) -> None:
    try:
        theirs = GGUFReader(path)
        want = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    except Exception:           # gguf's reader fails on some files ours reads (a key "GGUF.version", say)
        return
    assert repr({k: v for k, v in gf.fields.items() if not k.startswith("GGUF.")}) == repr(want)
    assert [(t.name, t.offset, t.raw.tobytes()) for t in gf.tensors.values()] == \
        [(t.name, t.data_offset, t.data.tobytes()) for t in theirs.tensors]
