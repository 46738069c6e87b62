"""MXFP4 between compressed-tensors and ggml, bit-exactly (never through floats).

compressed-tensors `mxfp4-pack-quantized`, per row: `weight_packed` holds two E2M1
codes a byte (element 2i in the low nibble, 2i+1 in the high one) and `weight_scale`
one E8M0 byte per 32 elements. ggml's block_mxfp4 is 17 bytes per 32 elements: the
same E8M0 byte, then 16 bytes where byte j holds element j (low) and j+16 (high).
ggml's code table is the E2M1 values doubled and its scale halved, so codes and
scale bytes carry over unchanged: only the nibble order moves.
"""
from __future__ import annotations

import numpy as np

from ..kernel import Kernel

BLOCK = 32
BLOCK_BYTES = 17
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


REPACK_KERNEL = Kernel("kimi_convert.convert.mxfp4_kernel", "repack_blocks", "u8_1d", "u8_1d", "u8_1d")


def repack(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """compressed-tensors (packed [rows, n/2], scale [rows, n/32]) -> ggml bytes [rows, n/32*17]."""
    rows, half = packed.shape
    out = np.empty((rows, half * 2 // BLOCK * BLOCK_BYTES), np.uint8)
    repack_into(packed, scale, out)
    return out


def repack_into(packed: np.ndarray, scale: np.ndarray, out: np.ndarray) -> None:
    """repack, into `out` (uint8 [rows, n/32*17], C-contiguous), by the compiled loop of mxfp4_kernel (numba,
    loaded on the first call; it releases the GIL, so experts repack on several threads)."""
    rows, half = packed.shape
    nb = half * 2 // BLOCK
    if half % (BLOCK // 2) or scale.shape != (rows, nb):
        raise ValueError(f"weight_scale shape {scale.shape} does not fit weight_packed {packed.shape}")
    if out.shape != (rows, nb * BLOCK_BYTES) or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise ValueError(f"output {out.dtype}{list(out.shape)} is not uint8 [{rows}, {nb * BLOCK_BYTES}], C-contiguous")
    REPACK_KERNEL(np.ascontiguousarray(packed, dtype=np.uint8).reshape(-1),
                  np.ascontiguousarray(scale, dtype=np.uint8).reshape(-1), out.reshape(-1))


def load_kernel() -> None:
    """Load the compiled repack now (~0.2 s with numba's import, from its cache; a cache miss compiles, 1-3 s),
    e.g. on a thread of its own while other work goes on, instead of at the first repack."""
    repack(np.zeros((1, BLOCK // 2), np.uint8), np.zeros((1, 1), np.uint8))


def unpack(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml bytes [rows, n/32*17] -> compressed-tensors (packed, scale): the inverse of repack."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, BLOCK_BYTES)
    scale, qs = b[..., 0], b[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)          # elements 0..15, 16..31
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.reshape(rows, -1), np.ascontiguousarray(scale)


def decode_compressed(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """compressed-tensors MXFP4 -> float32 [rows, n], by the format's own definition."""
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    factor = np.exp2(scale.astype(np.float32) - 127.0)
    return E2M1[codes] * np.repeat(factor, BLOCK, axis=1)
