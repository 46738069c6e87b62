"""The MXFP4 repack (compiled, kimi_convert.convert.mxfp4_kernel) against the two formats' definitions, and the
converter's expert reads (kimi_convert.convert.shard_io): bytes, one read per expert, and the errors they name."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from kimi_convert.convert import mxfp4, shard_io
from kimi_convert.convert.checkpoint import SourceTensor
from kimi_convert.errors import CheckpointError

RNG = np.random.default_rng(20261201)


def by_definition(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """ggml block_mxfp4 element by element: per 32 values, the E8M0 byte, then byte j = code j | code j+16 << 4;
    compressed-tensors holds code 2i in the low nibble of byte i and code 2i+1 in the high one."""
    rows = packed.shape[0]
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1, 32)
    blocks = np.concatenate([scale[..., None], codes[..., :16] | (codes[..., 16:] << 4)], axis=-1)
    return blocks.reshape(rows, -1)


def random_expert(rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    return (RNG.integers(0, 256, (rows, cols // 2), dtype=np.uint8),
            RNG.integers(0, 256, (rows, cols // 32), dtype=np.uint8))


@pytest.mark.parametrize("rows,cols", [(1, 32), (3, 64), (5, 1024), (64, 3584), (64, 3072)])
def test_repack_is_the_formats_byte_order(rows, cols):
    packed, scale = random_expert(rows, cols)
    out = mxfp4.repack(packed, scale)
    assert out.shape == (rows, cols // 32 * 17) and out.dtype == np.uint8
    assert np.array_equal(out, by_definition(packed, scale))
    back, back_scale = mxfp4.unpack(out)
    assert np.array_equal(back, packed) and np.array_equal(back_scale, scale)


def test_repack_takes_unaligned_and_strided_input():
    """The kernel loads 8-byte words at any address: a view that starts one byte into a buffer, and rows
    taken every other one (copied to contiguous first), give the same bytes."""
    packed, scale = random_expert(6, 256)
    want = by_definition(packed, scale)
    raw = np.empty(packed.size + 1, np.uint8)
    shifted = raw[1:].reshape(packed.shape)
    shifted[:] = packed
    assert shifted.ctypes.data % 8 != 0
    assert np.array_equal(mxfp4.repack(shifted, scale), want)
    assert np.array_equal(mxfp4.repack(packed[::2], scale[::2]), want[::2])


def test_repack_into_fills_the_given_rows_and_refuses_misfits():
    packed, scale = random_expert(4, 128)
    out = np.zeros((4, 4 * 17), np.uint8)
    mxfp4.repack_into(packed, scale, out)
    assert np.array_equal(out, by_definition(packed, scale))
    with pytest.raises(ValueError, match="weight_scale shape"):
        mxfp4.repack(packed, scale[:, :3])
    with pytest.raises(ValueError, match="not uint8 \\[4, 68\\]"):
        mxfp4.repack_into(packed, scale, np.zeros((4, 67), np.uint8))
    with pytest.raises(ValueError, match="C-contiguous"):
        mxfp4.repack_into(packed, scale, np.zeros((4, 136), np.uint8)[:, ::2])


# --- shard_io -----------------------------------------------------------------------------------------

def shard_with(tmp_path: Path, parts: list[tuple[str, np.ndarray, int]]) -> tuple[Path, list[SourceTensor]]:
    """A file holding each (name, array) at its byte offset (gaps are zeros), and their SourceTensors."""
    path = tmp_path / "model-00001-of-00001.safetensors"
    end = max(off + a.nbytes for _, a, off in parts)
    data = bytearray(end)
    tensors = []
    for name, a, off in parts:
        data[off:off + a.nbytes] = a.tobytes()
        tensors.append(SourceTensor(name, "U8", a.shape, path, off, a.nbytes))
    path.write_bytes(bytes(data))
    return path, tensors


def counting_preadv(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = os.preadv

    def spy(fd, buffers, offset, *flags):
        calls.append(offset)
        return real(fd, buffers, offset, *flags)
    monkeypatch.setattr(shard_io.os, "preadv", spy)
    return calls


@pytest.mark.parametrize("gap", [0, 4096 + 40], ids=["back-to-back", "apart"])
def test_read_tensors_reads_an_expert_once_when_its_parts_touch(tmp_path, monkeypatch, gap):
    packed, scale = random_expert(3, 512)
    start = 3 * 4096 + 24               # not page-aligned: the read starts at the page below
    path, tensors = shard_with(tmp_path, [("p", packed, start), ("s", scale, start + packed.nbytes + gap)])
    calls = counting_preadv(monkeypatch)
    fd = os.open(path, os.O_RDONLY)
    try:
        got_packed, got_scale = shard_io.read_tensors(tensors, [fd, fd])
    finally:
        os.close(fd)
    assert np.array_equal(got_packed, packed) and np.array_equal(got_scale, scale)
    assert got_packed.ctypes.data % shard_io.PAGE == start % shard_io.PAGE      # pages copied whole
    assert calls == ([3 * 4096] if gap == 0 else [3 * 4096, (start + packed.nbytes + gap) // 4096 * 4096])


def test_read_tensors_names_a_truncated_shard_and_a_read_error(tmp_path, monkeypatch):
    packed, scale = random_expert(2, 64)
    path, tensors = shard_with(tmp_path, [("p", packed, 0), ("s", scale, packed.nbytes)])
    with open(path, "r+b") as f:
        f.truncate(packed.nbytes + 1)             # the scale cut short
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(CheckpointError, match=rf"^{path}: truncated shard: tensor s cut short$"):
            shard_io.read_tensors(tensors, [fd, fd])

        def broken(*args):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        monkeypatch.setattr(shard_io.os, "preadv", broken)
        with pytest.raises(CheckpointError, match=rf"^{path}: cannot read tensor p \(Input/output error\)$"):
            shard_io.read_tensors(tensors, [fd, fd])
    finally:
        os.close(fd)


# --- the converter's expert producer ------------------------------------------------------------------

def open_files(under: Path) -> set[str]:
    """This process's open files inside `under` (only the test's own: earlier tests' threads may still be
    closing theirs)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:             # closed between listdir and readlink
            continue
        if target.startswith(str(under)):
            out.add(target)
    return out


def test_expert_producer_repacks_in_order_and_stops_cleanly(tmp_path):
    """_produce of a stacked MXFP4 tensor yields each expert's repack in expert order (jobs run threads +
    REPACK_AHEAD ahead on a pool of 2 threads); closed after the first, it cancels or waits for the jobs in flight and closes the shards
    it opened, so no job reads a closed (or reused) descriptor."""
    from kimi_convert.convert.converter import _produce, build_plan
    from kimi_convert.convert.transforms import REPACK_AHEAD
    from kimi_convert.fixtures.make_checkpoint import make_checkpoint
    n = 2 + REPACK_AHEAD + 4
    plan = build_plan(make_checkpoint(tmp_path / "k3", arch="k3", n_layers=2, num_experts=n), threads=2)
    p = next(t for t in plan.tensors if t.name.endswith("ffn_down_exps.weight"))
    ckpt, shard = plan.checkpoint, str(p.sources[0][0].path)
    before = open_files(tmp_path)
    got = list(_produce(p, ckpt, plan.config))
    want = [mxfp4.repack(ckpt.read(packed), ckpt.read(scale)) for packed, scale in p.sources]
    assert len(got) == len(want) == n and all(np.array_equal(a, b) for a, b in zip(got, want))
    assert open_files(tmp_path) == before
    chunks = _produce(p, ckpt, plan.config)
    assert np.array_equal(next(chunks), want[0]) and shard in open_files(tmp_path)
    chunks.close()
    assert open_files(tmp_path) == before


def test_compiled_dequantizer_is_ggml_s_for_every_scale_and_code():
    """quant.blocks' MXFP4 to_float (a compiled table lookup, used to re-quantize MXFP4 experts and by the streamed
    engine) against gguf-py's dequantize_blocks (ggml's dequantize_row_mxfp4): every E8M0 byte, every code, bits."""
    import gguf.quants
    from gguf import GGMLQuantizationType as QT
    from kimi_convert.quant.blocks import dequantize
    e = np.arange(256, dtype=np.uint8).repeat(8)                       # 8 blocks of each scale byte
    codes = np.random.default_rng(0).integers(0, 256, (e.size, 16), dtype=np.uint8)
    codes[:16] = np.arange(256, dtype=np.uint8).reshape(16, 16)        # every byte of codes
    raw = np.concatenate([e[:, None], codes], axis=1).reshape(64, -1)  # 64 rows of 32 blocks
    with np.errstate(over="ignore", invalid="ignore"):
        want = gguf.quants.dequantize(raw, QT.MXFP4)
    assert np.array_equal(dequantize(raw, QT.MXFP4).view(np.uint32), want.view(np.uint32))
