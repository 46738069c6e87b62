"""Hardened inputs (issue 9): the safetensors header reader, the config.json parser and the checkpoint's
paths. Each fault class is refused with one line naming the file and the tensor or field.

For headers, safetensors' own reader (`safe_open`) is the reference. Every header case here is also
given to it. The property tests check, on generated and mutated headers, that we accept exactly what
it accepts, except the two refusals of our own (kimi_convert/convert/safetensors_header.py's docstring).
"""
from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import struct
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from kimi_convert.convert.checkpoint import INDEX_NAME, MAX_INDEX_BYTES, Checkpoint, read_shard_header
from kimi_convert.errors import CheckpointError, ConfigError
from kimi_convert.fixtures.make_checkpoint import FixtureSpec, build_config
from kimi_convert.model import MAX_CONFIG_BYTES, KimiConfig
from kimi_convert.convert.safetensors_header import DTYPE_BITS, MAX_HEADER_BYTES
from test_convert_errors import assert_fails_cleanly, index, run_cli, shard_of, write_index

# deterministic (derandomize) and writing no example database into the tree
PROPERTY = settings(deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# --- safetensors files -----------------------------------------------------------------------

class Raw(str):
    """JSON text put into a header as is: what json.dumps cannot write (-0, 1e400, a lone \\ud800)."""


class Pairs(list):
    """A JSON object as (key, value) pairs, so that a key can be given twice."""


def dump(value) -> str:
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, Pairs):
        return "{" + ",".join(f"{json.dumps(k)}:{dump(v)}" for k, v in value) + "}"
    if isinstance(value, dict):
        return dump(Pairs(value.items()))
    if isinstance(value, list):
        return "[" + ",".join(dump(v) for v in value) + "]"
    return json.dumps(value)        # NaN and Infinity as Python writes them: not JSON


def st_bytes(header, data: bytes = b"", pad: int = 0, length_delta: int = 0, length: int | None = None) -> bytes:
    """A safetensors file: length, header (a value, or JSON text as bytes), padding, data."""
    text = header if isinstance(header, bytes) else dump(header).encode()
    text += b" " * pad
    n = len(text) + length_delta if length is None else length
    return struct.pack("<Q", n) + text + data


def reference(path: Path) -> dict | None:
    """{name: (dtype, shape)} as safetensors reads the file, or None if it refuses it."""
    try:
        with safe_open(str(path), framework="np") as f:
            return {n: (f.get_slice(n).get_dtype(), f.get_slice(n).get_shape()) for n in f.keys()}
    except Exception:           # safetensors_rust.SafetensorError, and OSError for what is no file
        return None


def ours(path: Path) -> dict:
    return {n: (t.dtype, list(t.shape)) for n, t in read_shard_header(path).items()}


TORCH_READABLE = {"BOOL", "U8", "I8", "I16", "BF16", "F16", "I32", "F32", "I64", "F64"}


def assert_same_bytes(path: Path) -> None:
    """Every tensor's bytes, read at our offsets, are the bytes safetensors gives for it."""
    import torch
    tensors = read_shard_header(path)
    blob = path.read_bytes()
    with safe_open(str(path), framework="pt") as f:
        for name, t in tensors.items():
            if t.dtype in TORCH_READABLE and t.nbytes:      # (torch cannot shape [0, 2^64-1])
                theirs = f.get_tensor(name).reshape(-1).view(torch.uint8).numpy().tobytes()
                assert blob[t.offset:t.offset + t.nbytes] == theirs, name


VISION = "vision_tower.patch_embed.proj.weight"      # a tensor the converter drops
NORM = "language_model.model.norm.weight"


def entry(dtype: str, shape, offsets) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


def two(vision=None, norm=None) -> dict:
    """A valid header: BF16[2, 3] (12 bytes) at 0, then F32[4] (16 bytes) at 12; 28 data bytes."""
    return {VISION: vision or entry("BF16", [2, 3], [0, 12]), NORM: norm or entry("F32", [4], [12, 28])}


DATA = bytes(range(28))
EXTRA = '{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":%s}'     # one tensor with an ignored field

REFUSED = {     # id: (file bytes, words the one error line must have)
    "overlap": (st_bytes(two(norm=entry("F32", [4], [8, 24])), DATA[:24]), f"overlap tensor {VISION}"),
    "same bytes twice": (st_bytes(two(vision=entry("F32", [4], [0, 16]), norm=entry("F32", [4], [0, 16])),
                                  DATA[:16]), "overlap"),
    "gap": (st_bytes(two(norm=entry("F32", [4], [13, 29])), DATA + b"x"), "leave a gap of 1 bytes"),
    "first not at 0": (st_bytes({NORM: entry("F32", [4], [4, 20])}, DATA[:20]), "must start at 0"),
    "span is not shape x dtype": (st_bytes(two(vision=entry("BF16", [2, 3], [0, 10]),
                                               norm=entry("F32", [4], [10, 26])), DATA[:26]),
                                  "spans 10 bytes but BF16[2, 3] needs 12"),
    "negative dims of a dropped tensor": (st_bytes(two(vision=entry("BF16", [-2, -3], [0, 12])), DATA),
                                          "shape must be a list of integers"),
    "dims as strings": (st_bytes(two(vision=entry("BF16", ["2", "3"], [0, 12])), DATA), "shape must be"),
    "dims as floats": (st_bytes(two(vision=entry("BF16", [2.0, 3], [0, 12])), DATA), "shape must be"),
    "dims as bools": (st_bytes(two(vision=entry("BF16", [True, 6], [0, 12])), DATA), "shape must be"),
    "dim -0": (st_bytes({VISION: entry("F32", [Raw("-0"), 3], [0, 0])}), "shape must be"),
    "shape null": (st_bytes(two(vision=entry("BF16", None, [0, 12])), DATA), "shape must be"),
    "data_offsets null": (st_bytes(two(vision=entry("BF16", [2, 3], None)), DATA), "data_offsets must be two"),
    "data_offsets of three": (st_bytes(two(vision=entry("BF16", [2, 3], [0, 12, 12])), DATA), "two integers"),
    "data_offsets as strings": (st_bytes(two(vision=entry("BF16", [2, 3], ["0", "12"])), DATA), "two integers"),
    "data_offsets reversed": (st_bytes({VISION: entry("BF16", [0], [12, 0])}, DATA[:12]), "end before"),
    "no dtype": (st_bytes(two(vision={"shape": [2, 3], "data_offsets": [0, 12]}), DATA), "no dtype"),
    "unknown dtype": (st_bytes(two(vision=entry("F31", [2, 3], [0, 12])), DATA), 'unknown dtype "F31"'),
    "entry not an object": (st_bytes({VISION: 5}), "not an object but a number"),
    "element count past 64 bits": (st_bytes({VISION: entry("U8", [2**40, 2**40], [0, 0])}),
                                   "more than 2^64-1 elements"),
    "overflow before a zero dim": (st_bytes({VISION: entry("U8", [2**40, 2**40, 0], [0, 0])}),
                                   "more than 2^64-1 elements"),
    "bit count past 64 bits": (st_bytes({VISION: entry("F32", [2**62], [0, 0])}), "more than 2^64-1 bits"),
    "not whole bytes": (st_bytes({VISION: entry("F4", [3], [0, 2])}, b"xx"), "not a whole number of bytes"),
    "trailing garbage": (st_bytes(two(), DATA + b"junk"), f"4 bytes of data after the last tensor ({NORM}"),
    "truncated data": (st_bytes(two(), DATA[:-1]), f"truncated shard: tensor {NORM} ends at byte"),
    "header length cut into its padding": (st_bytes(two(), DATA, pad=6, length_delta=-1),
                                           "the header length"),
    "header length past the file": (st_bytes(two(), DATA, length=10**6), "runs past the end of the file"),
    "header length past safetensors' limit": (st_bytes(two(), DATA, length=MAX_HEADER_BYTES + 1),
                                              "over safetensors' limit of 100,000,000"),
    "shorter than the length": (b"\x01\x02", "not a safetensors file: 2 bytes"),
    "empty header": (st_bytes(b""), "not valid JSON"),
    "not UTF-8": (st_bytes(b'{"\xff":' + dump(entry("F32", [0], [0, 0])).encode() + b"}"), "not UTF-8"),
    "not JSON": (st_bytes(b"{nope}"), "not valid JSON"),
    "two JSON values": (st_bytes(b"{}{}"), "not valid JSON"),
    "NaN in an ignored field": (st_bytes((EXTRA % "NaN").join(['{"a":', "}"]).encode(), bytes(8)), "NaN"),
    "a number past a double": (st_bytes((EXTRA % "1e400").join(['{"a":', "}"]).encode(), bytes(8)),
                               "out of a double's range"),
    "an integer past a double": (st_bytes((EXTRA % ("9" * 400)).join(['{"a":', "}"]).encode(), bytes(8)),
                                 "beyond a double's range"),
    "lone surrogate in a name": (st_bytes(b'{"a\\ud800":' + dump(entry("F32", [0], [0, 0])).encode() + b"}"),
                                 "lone UTF-16 surrogate"),
    "nested past serde_json's limit": (st_bytes((EXTRA % ("[" * 126 + "]" * 126)).join(['{"a":', "}"]).encode(),
                                                bytes(8)), "nested more than 127 deep"),
    "header a list": (st_bytes([]), "not a JSON object but a list"),
    "header null": (st_bytes(None), "not a JSON object but null"),
    "__metadata__ with a number": (st_bytes({"__metadata__": {"format": 1}, **two()}, DATA),
                                   "__metadata__ must be null or an object of strings"),
    "__metadata__ twice": (st_bytes(Pairs([("__metadata__", {}), ("__metadata__", {}), *two().items()]), DATA),
                           "__metadata__ is given twice"),
    "a field twice": (st_bytes(Pairs([(VISION, Pairs([("dtype", "U8"), *entry("BF16", [2, 3], [0, 12]).items()])),
                                      (NORM, two()[NORM])]), DATA), f"the entry for tensor {VISION} gives 'dtype' twice"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_header_safetensors_refuses_is_refused(tmp_path, case):
    content, words = REFUSED[case]
    path = tmp_path / "model-00001-of-000002.safetensors"
    path.write_bytes(content)
    assert reference(path) is None, "safetensors accepts it: not a fault"
    with pytest.raises(CheckpointError) as e:
        read_shard_header(path)
    message = str(e.value)
    assert message.startswith(f"{path}: ") and words in message, message
    assert "\n" not in message
    if re.search(r"\btensor\b", message[len(str(path)):]):     # a tensor, if named, is named in full
        names = (VISION, NORM, "a", "'a\\ud800'")
        assert any(f"tensor {n}" in message or f"({n}," in message for n in names), message


def test_the_header_length_cut_into_its_padding_says_so(tmp_path):
    """The silent-wrong-weights case: the JSON still parses, the data would start one byte early."""
    path = tmp_path / "x.safetensors"
    path.write_bytes(st_bytes(two(), DATA, pad=6, length_delta=-1))
    n = len(dump(two())) + 6 - 1
    with pytest.raises(CheckpointError, match=f"1 bytes of data after the last tensor .* they are spaces, the "
                                              f"header's padding: the header length {n} is 1 short"):
        read_shard_header(path)


STRICTER = {    # refused though safetensors accepts them: ambiguous, so refused on purpose
    "a tensor listed twice": (st_bytes(Pairs([(VISION, two()[VISION]), *two().items()]), DATA),
                              f"tensor {VISION} is listed twice"),
    "an entry written as a list": (st_bytes({"a": ["F32", [2], [0, 8]]}, bytes(8)), "not an object but a list"),
}


@pytest.mark.parametrize("case", sorted(STRICTER))
def test_what_we_refuse_beyond_safetensors(tmp_path, case):
    content, words = STRICTER[case]
    path = tmp_path / "x.safetensors"
    path.write_bytes(content)
    assert reference(path) is not None
    with pytest.raises(CheckpointError, match=words):
        read_shard_header(path)


ACCEPTED = {    # odd but valid: both readers accept, with the same tensors at the same bytes
    "offsets out of header order": st_bytes({NORM: two()[NORM], VISION: two()[VISION]}, DATA),
    "__metadata__ null": st_bytes({"__metadata__": None, **two()}, DATA),
    "__metadata__ of strings": st_bytes({"__metadata__": {"format": "pt", "": "é"}, **two()}, DATA),
    "zero-size tensors at one offset": st_bytes({"z0": entry("F32", [0], [0, 0]), "z1": entry("I8", [3, 0], [0, 0]),
                                                 "a": entry("U8", [4], [0, 4]), "z2": entry("F32", [0], [4, 4])},
                                                DATA[:4]),
    "scalar": st_bytes({"s": entry("F64", [], [0, 8])}, DATA[:8]),
    "no tensors": st_bytes({}),
    "ignored fields, 125 deep": st_bytes((EXTRA % ("[" * 125 + "]" * 125)).join(['{"a":', "}"]).encode(), DATA[:8]),
    "-0 in an ignored field": st_bytes((EXTRA % "-0").join(['{"a":', "}"]).encode(), DATA[:8]),
    "a float underflowing to 0 in an ignored field": st_bytes((EXTRA % "1e-400").join(['{"a":', "}"]).encode(),
                                                              DATA[:8]),
    "whitespace around the JSON": st_bytes(b" \t\n" + dump(two()).encode() + b"\r\n\t ", DATA),
    "four-bit dtype": st_bytes({"f4": entry("F4", [2, 3], [0, 3]), "f6": entry("F6_E2M3", [4], [3, 6])}, DATA[:6]),
    "escapes in names": st_bytes(b'{"caf\\u00e9 \\ud83d\\ude00 \\"q\\"":' + dump(entry("U8", [1], [0, 1])).encode()
                                 + b"}", DATA[:1]),
    "largest dimension with a zero": st_bytes({"z": entry("U8", [0, 2**64 - 1], [0, 0])}),
}


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_odd_but_valid_headers_read_as_safetensors_reads_them(tmp_path, case):
    path = tmp_path / "x.safetensors"
    path.write_bytes(ACCEPTED[case])
    theirs = reference(path)
    assert theirs is not None
    assert ours(path) == theirs
    assert_same_bytes(path)


def test_every_safetensors_dtype_is_known_with_its_size(tmp_path):
    """DTYPE_BITS is safetensors' own table: 8 elements of each dtype span exactly bits bytes."""
    path = tmp_path / "x.safetensors"
    for dtype, bits in DTYPE_BITS.items():
        path.write_bytes(st_bytes({"t": entry(dtype, [8], [0, bits])}, bytes(bits)))
        assert reference(path) == ours(path) == {"t": (dtype, [8])}
        path.write_bytes(st_bytes({"t": entry(dtype, [8], [0, bits + 1])}, bytes(bits + 1)))
        assert reference(path) is None
        with pytest.raises(CheckpointError, match=f"needs {bits}"):
            read_shard_header(path)


# --- the checkpoint's files and paths ----------------------------------------------------------

@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    from kimi_convert.fixtures.make_checkpoint import make_checkpoint
    return make_checkpoint(tmp_path_factory.mktemp("small") / "Kimi-K3-small", arch="k3", n_layers=2, n_shards=4)


@pytest.fixture
def ckpt_copy(tmp_path, small) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(small, dst)
    return dst


def some_shard(d: Path) -> Path:
    return d / sorted(set(index(d)["weight_map"].values()))[-1]


@pytest.mark.parametrize("name", ["../model-00001-of-000004.safetensors", "/tmp/model-00001-of-000004.safetensors",
                                  "sub/model-00001-of-000004.safetensors", "..", "", "a\\b.safetensors"])
def test_an_index_entry_must_be_a_plain_file_name(ckpt_copy, name):
    idx = index(ckpt_copy)
    tensor = sorted(idx["weight_map"])[0]
    idx["weight_map"][tensor] = name
    write_index(ckpt_copy, idx)
    with pytest.raises(CheckpointError) as e:
        Checkpoint(ckpt_copy)
    message = str(e.value)
    assert message.startswith(f"{ckpt_copy / INDEX_NAME}: tensor {tensor} maps to {name!r}, not a plain file name")


def test_the_hugging_face_cache_layout_is_followed(tmp_path, small):
    """snapshots/REV/x -> ../../blobs/SHA, as huggingface_hub lays a download out."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "0123abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for f in sorted(small.iterdir()):
        blob = blobs / f"sha-{f.name}"
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    linked, real = Checkpoint(snap), Checkpoint(small)
    assert sorted(linked.tensors) == sorted(real.tensors)
    for name, t in real.tensors.items():
        u = linked.tensors[name]
        assert (u.dtype, u.shape, u.offset, u.nbytes) == (t.dtype, t.shape, t.offset, t.nbytes)
        assert u.path == snap / t.path.name
    t = real.tensors["language_model.model.norm.weight"]
    assert linked.read_raw(linked.tensors[t.name]) == real.read_raw(t)
    assert KimiConfig.from_hf_dir(snap) == KimiConfig.from_hf_dir(small)


def test_a_dangling_shard_symlink_names_its_target(ckpt_copy):
    shard = some_shard(ckpt_copy)
    shard.unlink()
    shard.symlink_to("../../blobs/gone")
    with pytest.raises(CheckpointError, match=rf"{shard}: missing shard \(named in {INDEX_NAME}\) "
                                              r"\(a symlink to ../../blobs/gone, which does not exist\)"):
        Checkpoint(ckpt_copy)


def test_a_shard_that_is_a_folder(ckpt_copy):
    shard = some_shard(ckpt_copy)
    shard.unlink()
    shard.mkdir()
    with pytest.raises(CheckpointError, match=rf"^{shard}: is a folder, not a regular file$"):
        Checkpoint(ckpt_copy)


def test_a_shard_that_is_a_device(ckpt_copy):
    shard = some_shard(ckpt_copy)
    shard.unlink()
    shard.symlink_to("/dev/zero")        # would read as an endless stream of zeros
    with pytest.raises(CheckpointError, match=rf"^{shard}: is a character device, not a regular file$"):
        Checkpoint(ckpt_copy)


@pytest.mark.parametrize("which", ["shard", "index", "config"])
def test_a_fifo_is_refused_without_blocking(ckpt_copy, which):
    """A FIFO blocks open() until someone writes. A writer waits here the whole time, so a reader
    that does open it gets EOF and fails on other words instead of hanging the test."""
    path = {"shard": some_shard(ckpt_copy), "index": ckpt_copy / INDEX_NAME,
            "config": ckpt_copy / "config.json"}[which]
    path.unlink()
    os.mkfifo(path)
    writer = threading.Thread(target=lambda: open(path, "wb").close(), daemon=True)
    writer.start()
    started = time.monotonic()
    try:
        with pytest.raises((CheckpointError, ConfigError), match=rf"^{path}: is a FIFO \(named pipe\), not a regular file$"):
            if which == "config":
                KimiConfig.from_hf_dir(ckpt_copy)
            else:
                Checkpoint(ckpt_copy)
        assert time.monotonic() - started < 5
    finally:
        reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)       # lets the writer's open() return
        writer.join(5)
        os.close(reader)
        assert not writer.is_alive()


@pytest.mark.parametrize("which", ["shard", "index", "config"])
def test_an_unreadable_file_is_one_line(ckpt_copy, monkeypatch, which):
    """chmod 000 does not stop root (the CI user), so os.open is made to refuse, as the kernel would."""
    path = {"shard": some_shard(ckpt_copy), "index": ckpt_copy / INDEX_NAME,
            "config": ckpt_copy / "config.json"}[which]
    real_open = os.open

    def refusing(p, flags, *args, **kwargs):
        if Path(p) == path:
            raise PermissionError(13, "Permission denied", str(p))
        return real_open(p, flags, *args, **kwargs)
    monkeypatch.setattr(os, "open", refusing)
    with pytest.raises((CheckpointError, ConfigError), match=rf"^{path}: cannot read: Permission denied$"):
        KimiConfig.from_hf_dir(ckpt_copy) if which == "config" else Checkpoint(ckpt_copy)


def test_an_index_too_big_to_be_one_is_not_read(ckpt_copy):
    path = ckpt_copy / INDEX_NAME
    with open(path, "r+b") as f:
        f.truncate(MAX_INDEX_BYTES + 1)           # sparse: no disk, and never read
    with pytest.raises(CheckpointError, match=rf"^{path}: 1,073,741,825 bytes, more than the 1,073,741,824"):
        Checkpoint(ckpt_copy)


@pytest.mark.parametrize("content, words", [
    (b'{"weight_map": {}}', "empty weight_map"), (b"[]", "no weight_map object"),
    (b'{"weight_map": []}', "no weight_map object"), (b"{", "not JSON"), (b"\xff", "not UTF-8"),
    (b"[" * 100_000, "nested too deeply"), (b'{"weight_map": {"a": ' + b"9" * 5000 + b"}}", "not JSON"),
])
def test_an_index_that_is_not_one(ckpt_copy, content, words):
    (ckpt_copy / INDEX_NAME).write_bytes(content)
    with pytest.raises(CheckpointError, match=rf"^{ckpt_copy / INDEX_NAME}: .*{words}"):
        Checkpoint(ckpt_copy)


def test_a_shard_header_fault_in_a_dropped_tensor_is_found_through_the_checkpoint(ckpt_copy):
    """The vision tower is dropped, but its shard's header is validated all the same."""
    shard = shard_of(ckpt_copy, "vision_tower.patch_embed.proj.weight")
    rewrite_header(shard, lambda h: h["vision_tower.patch_embed.proj.weight"].update(shape=[-1, -1, 2, -4704]))
    with pytest.raises(CheckpointError, match=rf"^{shard}: corrupt safetensors header entry for tensor "
                                              r"vision_tower.patch_embed.proj.weight: shape must be"):
        Checkpoint(ckpt_copy)


def rewrite_header(path: Path, edit, length_delta: int = 0, pad: int | None = None) -> None:
    """Edit a shard's header (a dict, in file order) and write it back before the same data."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    edit(header)
    text = dump(header).encode()
    text += b" " * (-len(text) % 8 if pad is None else pad)
    path.write_bytes(struct.pack("<Q", len(text) + length_delta) + text + blob[8 + n:])


# --- config.json ----------------------------------------------------------------------------

def k3_config() -> dict:
    return build_config(FixtureSpec(arch="k3"))


def k31_config() -> dict:
    return build_config(FixtureSpec(arch="k31"))


def at(cfg: dict, dotted: str):
    """(the object holding the last key, the key) of text_config.linear_attn_config.num_heads."""
    *parents, key = dotted.split(".")
    for p in parents:
        cfg = cfg[p]
    return cfg, key


def with_value(cfg: dict, dotted: str, value) -> dict:
    holder, key = at(cfg, dotted)
    holder[key] = value
    return cfg


CONFIG_FAULTS = [       # (field, value, words of the error after "config.json: FIELD")
    ("text_config.num_hidden_layers", 9.5, "must be an integer in 1..2147483647, not 9.5"),
    ("text_config.num_hidden_layers", "8", 'must be an integer in 1..2147483647, not "8"'),
    ("text_config.num_hidden_layers", True, "must be an integer in 1..2147483647, not true"),
    ("text_config.num_hidden_layers", 0, "must be an integer in 1..2147483647, not 0"),
    ("text_config.hidden_size", 2**40, "must be an integer in 1..2147483647, not 1099511627776"),
    ("text_config.rms_norm_eps", float("nan"), "must be a finite float32, not NaN"),
    ("text_config.rms_norm_eps", float("inf"), "must be a finite float32, not Infinity"),
    ("text_config.rms_norm_eps", 1e39, "must be a finite float32, not 1e+39"),
    ("text_config.rms_norm_eps", "1e-5", 'must be a number, not "1e-5"'),
    ("text_config.rms_norm_eps", 0, "must be above 0, not 0"),
    ("text_config.rms_norm_eps", 1e-50, "must be above 0, not 1e-50"),        # 0 once a float32
    ("text_config.attn_res_block_size", -3, "must be an integer in 1..2147483647, not -3"),
    ("text_config.activation_situ_beta", 0.0, "must be above 0, not 0.0"),
    ("text_config.activation_situ_linear_beta", -1.0, "must be at least 0, not -1.0"),
    ("text_config.routed_scaling_factor", None, "must be a number, not null"),
    ("text_config.moe_renormalize", "false", 'must be true or false, not "false"'),
    ("text_config.num_experts_per_token", 17, "must be at most num_experts (16), not 17"),
    ("text_config.first_k_dense_replace", 9, "must be at most num_hidden_layers (8), not 9"),
    ("text_config.routed_expert_hidden_size", "64", 'must be an integer in 0..2147483647, not "64"'),
    ("text_config.q_lora_rank", -1, "must be an integer in 0..2147483647, not -1"),
    ("text_config.bos_token_id", "768", 'must be a token id or a list of them, not "768"'),
    ("text_config.linear_attn_config", "none", 'must be a JSON object, not "none"'),
    ("text_config.linear_attn_config.gate_lower_bound", "-5", 'must be a number, not "-5"'),
    ("text_config.linear_attn_config.head_dim", 16.0, "must be an integer in 1..2147483647, not 16.0"),
    ("text_config.linear_attn_config.full_attn_layers", [4, True], "must be a list of layer numbers, not [4, true]"),
    ("text_config.linear_attn_config.full_attn_layers", [4, 8, 8], "lists layer 8 more than once"),
    ("text_config.linear_attn_config.full_attn_layers", [4, 9], "has layers outside 1..8: [9]"),
    ("text_config.linear_attn_config.full_attn_layers", "4,8", 'must be a list of layer numbers, not "4,8"'),
    ("text_config.quantization_config", [], "must be a JSON object, not []"),
    ("text_config", None, "must be a JSON object, not null"),
    ("architectures", "KimiK3ForConditionalGeneration", None),
]


@pytest.mark.parametrize("field, value, words", CONFIG_FAULTS, ids=lambda v: str(v)[:40])
def test_a_bad_config_value_names_the_field(field, value, words):
    cfg = with_value(k3_config(), field, value)
    with pytest.raises(ConfigError) as e:
        KimiConfig.from_hf(cfg, source="/ckpt/config.json")
    message = str(e.value)
    if words is None:
        assert message.startswith("/ckpt/config.json: unknown architecture"), message
    else:
        assert message == f"/ckpt/config.json: {field} {words}", message


@pytest.mark.parametrize("field, value, words", [
    ("text_config.dsa_config.index_n_heads", 0, "must be an integer in 1..2147483647, not 0"),
    ("text_config.dsa_config.index_topk", 2.5, "must be an integer in 1..2147483647, not 2.5"),
    ("text_config.dsa_config.layers", [4, False], "must be a list of layer numbers, not [4, false]"),
    ("text_config.dsa_config", [], "must be a JSON object, not []"),
])
def test_a_bad_indexer_value_names_the_field(field, value, words):
    with pytest.raises(ConfigError) as e:
        KimiConfig.from_hf(with_value(k31_config(), field, value), source="config.json")
    assert str(e.value) == f"config.json: {field} {words}"


def test_a_missing_field_is_named():
    cfg = k3_config()
    del cfg["text_config"]["linear_attn_config"]["short_conv_kernel_size"]
    with pytest.raises(ConfigError, match=r"^config.json: text_config.linear_attn_config.short_conv_kernel_size "
                                          r"is missing$"):
        KimiConfig.from_hf(cfg)


@pytest.mark.parametrize("text, words", [
    (b"null", "config.json: must be a JSON object, not null"),
    (b"[1]", "config.json: must be a JSON object, not [1]"),
    (b'"x"', 'config.json: must be a JSON object, not "x"'),
    (b"{", "config.json: not valid JSON (Expecting property name"),
    (b"\xff{}", "config.json: not UTF-8 (byte 0)"),
    (b"[" * 100_000, "config.json: not valid JSON (nested too deeply)"),
    (b"9" * 5000, "config.json: not valid JSON (Exceeds the limit"),
])
def test_a_config_json_that_is_not_an_object(tmp_path, text, words):
    (tmp_path / "config.json").write_bytes(text)
    with pytest.raises(ConfigError) as e:
        KimiConfig.from_hf_dir(tmp_path)
    assert str(e.value).startswith(f"{tmp_path}/{words}"), str(e.value)


def test_config_json_that_is_a_folder_or_too_big(tmp_path):
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ConfigError, match=rf"^{tmp_path}/config.json: is a folder, not a regular file$"):
        KimiConfig.from_hf_dir(tmp_path)
    (tmp_path / "config.json").rmdir()
    with open(tmp_path / "config.json", "wb") as f:
        f.truncate(MAX_CONFIG_BYTES + 1)
    with pytest.raises(ConfigError, match=r"config.json: 16,777,217 bytes, more than the 16,777,216"):
        KimiConfig.from_hf_dir(tmp_path)


# --- through the command line: one error line, exit 1, nothing written ---------------------------

def test_cli_overlapping_offsets_in_a_dropped_tensor(tmp_path, ckpt_copy):
    name = "vision_tower.patch_embed.proj.weight"
    shard = shard_of(ckpt_copy, name)

    def overlap(h):
        second = [k for k in h if k != "__metadata__"][1]
        h[second]["data_offsets"] = [o - 2 for o in h[second]["data_offsets"]]
    rewrite_header(shard, overlap)
    r = run_cli(ckpt_copy, tmp_path / "out.gguf")
    assert_fails_cleanly(tmp_path, r, str(shard), "overlap tensor vision_tower.")


def test_cli_fractional_layer_count(tmp_path, ckpt_copy):
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    cfg["text_config"]["num_hidden_layers"] = 1.5
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    r = run_cli(ckpt_copy, tmp_path / "out.gguf")
    assert_fails_cleanly(tmp_path, r, str(ckpt_copy / "config.json"), "text_config.num_hidden_layers", "1.5")


def test_cli_header_length_cut_into_its_padding(tmp_path, ckpt_copy):
    shard = shard_of(ckpt_copy, "vision_tower.patch_embed.proj.weight")
    rewrite_header(shard, lambda h: None, pad=3, length_delta=-1)
    r = run_cli(ckpt_copy, tmp_path / "out.gguf")
    assert_fails_cleanly(tmp_path, r, str(shard), "the header's padding")


def test_cli_fifo_shard_does_not_hang(tmp_path, ckpt_copy):
    shard = some_shard(ckpt_copy)
    shard.unlink()
    os.mkfifo(shard)
    r = run_cli(ckpt_copy, tmp_path / "out.gguf")          # run_cli gives up after 120 s
    assert_fails_cleanly(tmp_path, r, str(shard), "is a FIFO (named pipe), not a regular file")


def test_cli_index_entry_escaping_the_folder(tmp_path, ckpt_copy):
    idx = index(ckpt_copy)
    tensor = sorted(idx["weight_map"])[0]
    idx["weight_map"][tensor] = "../ckpt/" + idx["weight_map"][tensor]
    write_index(ckpt_copy, idx)
    r = run_cli(ckpt_copy, tmp_path / "out.gguf")
    assert_fails_cleanly(tmp_path, r, str(ckpt_copy / INDEX_NAME), tensor, "not a plain file name")


def test_cli_unreadable_shard(tmp_path, ckpt_copy):
    shard = some_shard(ckpt_copy)
    refuse = f"""
import os
_open = os.open
def refusing(path, flags, *args, **kwargs):
    if str(path) == {str(shard)!r}:
        raise PermissionError(13, "Permission denied", str(path))
    return _open(path, flags, *args, **kwargs)
os.open = refusing
"""
    r = run_cli(ckpt_copy, tmp_path / "out.gguf", patch=refuse)
    assert_fails_cleanly(tmp_path, r, f"{shard}: cannot read: Permission denied")


# --- property tests: the header reader against safetensors -------------------------------------

NAMES = st.text(alphabet="abvé._0\\\"/ ", max_size=6).filter(lambda n: n != "__metadata__")
# JSON that Python's json and serde_json (safetensors') read differently -- -0, numbers past a double, lone
# surrogates, deep nesting, a repeated key -- and valid look-alikes
TRICKY = [Raw("-0"), Raw("1e400"), Raw("-0.0"), Raw("1E2"), Raw("1e-400"), Raw("9" * 400), Raw("9" * 30),
          Raw('"\\ud800"'), Raw('"\\ud83d\\ude00"'), Raw("[" * 126 + "]" * 126), Raw("[" * 125 + "]" * 125),
          Raw('{"k":1,"k":2}')]
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 40), st.sampled_from([2**63, 2**64 - 1, 2**64, -(2**63) - 1]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4), st.sampled_from(TRICKY))
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=3), inner, max_size=3), max_leaves=5)


@st.composite
def valid_files(draw):
    """A valid header (tensors in random header order and data order, any dtype, maybe
    __metadata__) as a dict of pairs, its data and its padding."""
    names = draw(st.lists(NAMES, max_size=5, unique=True))
    layouts = []
    for name in names:
        dtype = draw(st.sampled_from(sorted(DTYPE_BITS)))
        shape = draw(st.lists(st.sampled_from([1, 2, 3, 1, 2, 0]), max_size=3))
        if math.prod(shape) * DTYPE_BITS[dtype] % 8:
            shape.append(8)
        layouts.append((name, dtype, shape, math.prod(shape) * DTYPE_BITS[dtype] // 8))
    pos, header = 0, {}
    for name, dtype, shape, nbytes in draw(st.permutations(layouts)):
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    pairs = Pairs(draw(st.permutations(list(header.items()))))
    meta = draw(st.sampled_from(["none", "null", "strings"]))
    if meta != "none":
        pairs.insert(draw(st.integers(0, len(pairs))), ("__metadata__", None if meta == "null" else
                     draw(st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2))))
    data = random.Random(draw(st.integers(0, 2**32))).randbytes(pos)       # distinct bytes: a shift shows
    return pairs, data, draw(st.integers(0, 8))


def _offsets_ok(info) -> bool:
    o = info.get("data_offsets")
    return isinstance(o, list) and len(o) == 2 and all(type(v) is int for v in o)


def _tensor_entries(pairs: Pairs) -> list[int]:
    return [i for i, (name, info) in enumerate(pairs) if name != "__metadata__" and isinstance(info, dict)]


def neighbour_numbers(v: int) -> st.SearchStrategy:
    """Numbers next to a valid dimension or offset, as another tool or a careless edit writes them:
    the same value in another type (which json and serde_json read differently), or another value."""
    same_value = [float(v), str(v), Raw(f"{v}e0"), Raw(f"{v}.0")] + ([v == 1] if v in (0, 1) else []) \
        + ([Raw("-0")] if v == 0 else [])
    return st.sampled_from(same_value) | st.sampled_from([v + 1, v - 1, -v, -1, 0, 2**64, 2**64 - 1])


def mutate_entry(draw, pairs: Pairs) -> None:
    """Change one tensor entry: one number of its shape or offsets, a whole field, an ignored
    field, its place in the data, or the entry itself."""
    entries = _tensor_entries(pairs)
    if not entries:
        return
    i = draw(st.sampled_from(entries))
    name, info = pairs[i][0], dict(pairs[i][1])
    kind = draw(st.sampled_from(["number"] * 4 + ["field", "extra", "extra", "move", "move", "drop field",
                                                   "whole"]))
    lists = [f for f in ("shape", "data_offsets") if isinstance(info.get(f), list) and info[f]]
    if kind == "number" and lists:
        field = draw(st.sampled_from(lists))
        values = list(info[field])
        j = draw(st.integers(0, len(values) - 1))
        v = values[j]
        values[j] = draw(neighbour_numbers(v) if type(v) is int else JSON_VALUES)
        info[field] = values
    elif kind == "move" and _offsets_ok(info):     # the same span elsewhere: overlaps, gaps, another order
        begin, end = info["data_offsets"]
        starts = [pairs[k][1]["data_offsets"][0] for k in entries if _offsets_ok(pairs[k][1])]
        to = draw(st.sampled_from([begin - 1, begin + 1, 0, end, *starts]))
        info["data_offsets"] = [to, to + end - begin]
    elif kind in ("number", "move", "field"):
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        info[field] = draw(st.sampled_from(sorted(DTYPE_BITS) + ["f32", ""]) | JSON_VALUES)
    elif kind == "extra":
        info[draw(st.text(max_size=3))] = draw(st.sampled_from(TRICKY) | JSON_VALUES)
    elif kind == "drop field":
        info.pop(draw(st.sampled_from(["dtype", "shape", "data_offsets"])), None)
    else:
        info = draw(JSON_VALUES | st.just([info.get(f) for f in ("dtype", "shape", "data_offsets")]))
    pairs[i] = (name, info)


def edit_text(draw, text: bytearray) -> None:
    """Insert, replace or delete one byte of the header's JSON text."""
    at_ = draw(st.integers(0, len(text)))
    byte = draw(st.sampled_from(list(b'{}[],:"\\ -0.eEtn\xff\x00\t')) | st.integers(0, 255))
    edit = draw(st.sampled_from(["insert", "replace", "delete"]))
    if edit == "insert":
        text[at_:at_] = bytes([byte])
    elif at_ < len(text):
        text[at_:at_ + 1] = b"" if edit == "delete" else bytes([byte])


@st.composite
def mutated_files(draw) -> bytes:
    """A valid file with one to three faults (mostly one, so that it is the only one)."""
    pairs, data, pad = draw(valid_files())
    length_delta, text_edits = 0, 0
    for _ in range(draw(st.sampled_from([1, 1, 1, 2, 3]))):
        kind = draw(st.sampled_from(["entry"] * 8 + ["drop", "twice", "metadata", "top", "length", "data",
                                                     "text"]))
        if kind in ("entry", "drop", "twice", "metadata") and not isinstance(pairs, Pairs):
            continue            # the header is no longer an object
        if kind == "entry":
            mutate_entry(draw, pairs)
        elif kind == "drop" and pairs:
            pairs.pop(draw(st.integers(0, len(pairs) - 1)))
        elif kind == "twice" and pairs:
            pairs.insert(draw(st.integers(0, len(pairs))), draw(st.sampled_from(pairs)))
        elif kind == "metadata":
            pairs.append(("__metadata__", draw(JSON_VALUES)))
        elif kind == "top":
            pairs = draw(JSON_VALUES)
        elif kind == "length":
            length_delta += draw(st.integers(-9, 9))
        elif kind == "data":
            cut = draw(st.integers(-3, 3))
            data = data[:cut] if cut < 0 else data + bytes(cut)
        elif kind == "text":
            text_edits += 1
    text = bytearray(dump(pairs).encode() + b" " * pad)
    for _ in range(text_edits):
        edit_text(draw, text)
    return struct.pack("<Q", max(0, len(text) + length_delta)) + bytes(text) + data


def refused_on_purpose(content: bytes) -> bool:
    """Our two refusals beyond safetensors: a key given twice, an entry that is a list."""
    twice = []

    def watch(pairs):
        if len({k for k, _ in pairs}) < len(pairs):
            twice.append(True)
        return dict(pairs)
    try:
        (n,) = struct.unpack("<Q", content[:8])
        doc = json.loads(content[8:8 + n].decode("utf-8"), object_pairs_hook=watch)
    except Exception:
        return False
    return bool(twice) or (isinstance(doc, dict) and any(isinstance(v, list) for v in doc.values()))


@settings(PROPERTY, max_examples=1000)
@given(content=st.one_of(valid_files().map(lambda f: st_bytes(f[0], f[1], pad=f[2])), mutated_files()))
def test_the_header_reader_accepts_exactly_what_safetensors_accepts(tmp_path_factory, content):
    path = tmp_path_factory.getbasetemp() / "property.safetensors"
    path.write_bytes(content)
    theirs = reference(path)
    try:
        mine = ours(path)
    except CheckpointError as e:        # any other exception fails the test
        message = str(e)
        assert message.startswith(f"{path}: ") and "\n" not in message
        assert theirs is None or refused_on_purpose(content), f"safetensors accepts it; we said: {message}"
        return
    assert theirs is not None, "we accept what safetensors refuses"
    assert mine == theirs
    assert_same_bytes(path)


# --- property tests: the config parser ----------------------------------------------------------

SECTIONS = ["", "text_config", "text_config.linear_attn_config", "text_config.dsa_config",
            "text_config.quantization_config"]


def neighbours(value) -> st.SearchStrategy:
    """Values next to a valid one: what a careless edit or another tool writes."""
    if isinstance(value, bool):
        return st.sampled_from([not value, int(value), str(value).lower(), None])
    if isinstance(value, int):
        return st.sampled_from([value + 0.5, float(value), str(value), -value, 0, -1, 2**31, 2**32, True])
    if isinstance(value, float):
        return st.sampled_from([math.nan, math.inf, -value, 0.0, str(value), 1e39, 1e-50, None])
    if isinstance(value, list):
        return st.sampled_from([value[:-1], value + value[-1:], value + [0], [str(v) for v in value], {}]) \
            if value else st.sampled_from([[0], [True], "[]"])
    return JSON_VALUES


@st.composite
def mutated_configs(draw) -> dict:
    cfg = k31_config() if draw(st.booleans()) else k3_config()
    for _ in range(draw(st.integers(1, 3))):
        section = draw(st.sampled_from(SECTIONS))
        try:
            holder = at(cfg, section + ".x")[0] if section else cfg
        except (KeyError, TypeError):
            continue
        if not isinstance(holder, dict):
            continue
        key = draw(st.sampled_from(sorted(holder) + ["index_topk", "q_lora_rank"]) if holder else st.just("x"))
        action = draw(st.sampled_from(["neighbour", "neighbour", "value", "delete"]))
        if action == "delete":
            holder.pop(key, None)
        elif action == "neighbour" and key in holder:
            holder[key] = draw(neighbours(holder[key]))
        else:
            holder[key] = draw(JSON_VALUES)
    if draw(st.integers(0, 20)) == 0:
        cfg = draw(JSON_VALUES)
    return cfg


def assert_writable(cfg: KimiConfig) -> None:
    """Every GGUF key packs as its type (no struct.error at the writer), arrays one per layer."""
    from gguf import GGUFValueType as VT
    for k, value, vtype, sub in cfg.gguf_metadata():
        if vtype == VT.UINT32:
            assert type(value) is int, k
            struct.pack("<I", value)        # struct.error beyond 0..2^32-1
        elif vtype == VT.FLOAT32:
            assert math.isfinite(struct.unpack("<f", struct.pack("<f", value))[0]), k
        elif vtype == VT.BOOL:
            assert type(value) is bool, k
        elif vtype == VT.ARRAY:
            assert len(value) == cfg.n_layer, k
    assert all(0 <= i < cfg.n_layer for i in cfg.full_attn_layers)
    assert 0 <= cfg.n_dense_layers <= cfg.n_layer and 1 <= cfg.n_expert_used <= cfg.n_expert


@settings(PROPERTY, max_examples=600)
@given(raw=mutated_configs())
def test_the_config_parser_gives_a_config_or_one_error(raw):
    try:
        cfg = KimiConfig.from_hf(raw, source="/ckpt/config.json")
    except ConfigError as e:            # any other exception fails the test
        assert str(e).startswith("/ckpt/config.json: ") and "\n" not in str(e), str(e)
        return
    assert_writable(cfg)


@settings(PROPERTY, max_examples=300)
@given(edits=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(list(b'{}[],:"\\ -0.eEtnNI\xff')) |
                                st.integers(0, 255), st.booleans()), min_size=1, max_size=3))
def test_config_json_text_edits_give_a_config_or_one_error(tmp_path_factory, edits):
    folder = tmp_path_factory.getbasetemp() / "config-text"
    folder.mkdir(exist_ok=True)
    text = bytearray(json.dumps(k3_config()).encode())
    for pos, byte, insert in edits:
        pos %= len(text) + 1
        text[pos:pos + (0 if insert else 1)] = bytes([byte])
    (folder / "config.json").write_bytes(bytes(text))
    try:
        assert_writable(KimiConfig.from_hf_dir(folder))
    except ConfigError as e:
        assert str(e).startswith(f"{folder / 'config.json'}: ") and "\n" not in str(e), str(e)


# --- the architecture keys of a GGUF ----------------------------------------------------------

def gguf_fields(raw: dict) -> dict:
    """{key: value} as open_gguf gives them for the file this config converts to."""
    cfg = KimiConfig.from_hf(raw)
    return {"general.architecture": cfg.arch, **{k: v for k, v, _, _ in cfg.gguf_metadata()}}


@pytest.mark.parametrize("name, value, problem", [
    ("kimi-k3.block_count", "four", 'must be an integer in 1..2147483647, not "four"'),
    ("kimi-k3.block_count", 4.0, "must be an integer in 1..2147483647, not 4.0"),
    ("kimi-k3.expert_count", [64], "must be an integer in 1..2147483647, not [64]"),
    ("kimi-k3.attention.layer_norm_rms_epsilon", "1e-5", 'must be a finite number, not "1e-5"'),
    ("kimi-k3.attention.layer_norm_rms_epsilon", [1e-5], "must be a finite number, not [1e-05]"),
    ("kimi-k3.attention.layer_norm_rms_epsilon", float("nan"), "must be a finite number, not NaN"),
    ("kimi-k3.expert_weights_norm", 1, "must be true or false, not 1"),
    ("kimi-k3.attention.head_count_kv", "1", 'must be a per-layer array of 4 integers, not "1"'),
])
def test_a_gguf_key_of_the_wrong_type_is_one_error_naming_file_and_key(name, value, problem):
    # int() and float() of such values raised ValueError or TypeError, or took "4" for 4
    fields = gguf_fields(build_config(FixtureSpec(arch="k3", n_layers=4)))
    assert name in fields
    fields[name] = value
    with pytest.raises(ConfigError) as e:
        KimiConfig.from_gguf(fields, "/x/k3.gguf")
    assert str(e.value) == f"/x/k3.gguf: GGUF metadata key {name} {problem}"


GGUF_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4), st.lists(st.one_of(st.integers(-3, 2**32), st.booleans(), st.floats(), st.text(max_size=2)),
                                  max_size=6))


@settings(PROPERTY, max_examples=600)
@given(arch=st.sampled_from(["k3", "k31"]), data=st.data())
def test_gguf_keys_give_a_config_or_one_error(arch, data):
    fields = gguf_fields(build_config(FixtureSpec(arch=arch, n_layers=4)))
    assert KimiConfig.from_gguf(fields, "/x/a.gguf") == KimiConfig.from_gguf(dict(fields))      # the valid file
    for _ in range(data.draw(st.integers(1, 3))):
        name = data.draw(st.sampled_from(sorted(fields)))
        if data.draw(st.integers(0, 5)) == 0:
            fields.pop(name)
        else:
            fields[name] = data.draw(GGUF_VALUES)
    try:
        KimiConfig.from_gguf(fields, "/x/a.gguf")
    except ConfigError as e:            # any other exception fails the test
        assert str(e).startswith("/x/a.gguf: GGUF ") and "\n" not in str(e), str(e)
