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

BLOCK = 32
BLOCK_BYTES = 17
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


_LOW = np.uint64(0x0F0F0F0F0F0F0F0F)
_HIGH = np.uint64(0xF0F0F0F0F0F0F0F0)
_FOUR = np.uint64(4)


def repack(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """compressed-tensors (packed [rows, n/2], scale [rows, n/32]) -> ggml bytes [rows, n/32*17].

    A block's 16 packed bytes are read as two words: a = bytes 0-7 (elements 0-15) and
    b = bytes 8-15 (elements 16-31). ggml's byte 2m is element 2m | element 2m+16 << 4, and
    byte 2m+1 is element 2m+1 | element 2m+17 << 4, so eight nibble moves at a time give the
    even output bytes (lo) and the odd ones (hi). This runs ~4x faster than per-nibble arrays.
    """
    rows, half = packed.shape
    nb = half * 2 // BLOCK
    if scale.shape != (rows, nb):
        raise ValueError(f"weight_scale shape {scale.shape} does not fit weight_packed {packed.shape}")
    words = np.ascontiguousarray(packed).reshape(rows * nb, 2, 8).view(np.uint64)[..., 0]
    a, b = words[:, 0], words[:, 1]
    lo = (a & _LOW) | ((b & _LOW) << _FOUR)
    hi = ((a >> _FOUR) & _LOW) | (b & _HIGH)
    out = np.empty((rows * nb, BLOCK_BYTES), np.uint8)
    out[:, 0] = scale.reshape(-1)
    out[:, 1::2] = lo.view(np.uint8).reshape(-1, 8)
    out[:, 2::2] = hi.view(np.uint8).reshape(-1, 8)
    return out.reshape(rows, nb * BLOCK_BYTES)


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
