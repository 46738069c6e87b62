"""The MXFP4 repack (compressed-tensors -> ggml block_mxfp4) as a compiled loop; see mxfp4.repack.

A module of its own so that importing kimi_convert.convert.mxfp4 (unpack, decode_compressed) does not import numba:
mxfp4.repack loads this on its first call. The kernel releases the GIL (``nogil``), so the converter repacks
experts on several threads at once.

Per 32-element block, the 16 packed bytes are two little-endian words: a = bytes 0-7 (elements 0-15) and
b = bytes 8-15 (elements 16-31), each byte holding element 2i in its low nibble and 2i+1 in its high one.
ggml's byte 2m is element 2m | element 2m+16 << 4 and byte 2m+1 is element 2m+1 | element 2m+17 << 4, so
`lo` (the even output bytes) and `hi` (the odd ones) are eight nibble moves each, and spreading their bytes
apart and or-ing them gives the block's 16 code bytes as two words, stored after its scale byte. The output
blocks are 17 bytes, so the words land unaligned: they are stored (and the input words loaded) with align 1,
which x86 does at full speed; numpy cannot express that store, and byte stores ran 1.4x slower.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .. import numba_start
from .mxfp4 import BLOCK_BYTES

numba_start.start()     # before the kernel loads: numba's registries without its BLAS probe

_U = np.uint64
_LOW = _U(0x0F0F0F0F0F0F0F0F)
_HIGH = _U(0xF0F0F0F0F0F0F0F0)
_LOW32 = _U(0xFFFFFFFF)


@intrinsic
def _load_u64(typingctx, arr, byte):
    """The little-endian uint64 at byte offset `byte` of a C-contiguous uint8 array, any alignment."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.uint8):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        word = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(64).as_pointer())
        load = builder.load(word)
        load.align = 1
        return load
    return types.uint64(arr, byte), codegen


@intrinsic
def _store_u64(typingctx, arr, byte, value):
    """Store `value` little-endian at byte offset `byte` of a C-contiguous uint8 array, any alignment."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.uint8 and value == types.uint64):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        word = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(64).as_pointer())
        builder.store(args[2], word).align = 1
        return context.get_dummy_value()
    return types.void(arr, byte, value), codegen


@njit(inline="always")
def _spread(x):
    """The four low bytes of x, moved to bytes 0, 2, 4 and 6."""
    x = (x | (x << _U(16))) & _U(0x0000FFFF0000FFFF)
    return (x | (x << _U(8))) & _U(0x00FF00FF00FF00FF)


@njit(cache=True, nogil=True)
def repack_blocks(packed, scale, out):
    """packed: uint8 [n_blocks * 16], scale: uint8 [n_blocks], out: uint8 [n_blocks * 17], all 1-D and
    C-contiguous (the caller checks the sizes: the loads and stores are unchecked)."""
    for k in range(scale.size):
        a = _load_u64(packed, 16 * k)
        b = _load_u64(packed, 16 * k + 8)
        lo = (a & _LOW) | ((b & _LOW) << _U(4))
        hi = ((a >> _U(4)) & _LOW) | (b & _HIGH)
        o = BLOCK_BYTES * k
        out[o] = scale[k]
        _store_u64(out, o + 1, _spread(lo & _LOW32) | (_spread(hi & _LOW32) << _U(8)))
        _store_u64(out, o + 9, _spread(lo >> _U(32)) | (_spread(hi >> _U(32)) << _U(8)))
