"""kimi-quantize's library: per-tensor policy, protections, imatrix, the file driver, and the block quantizers.

The quantizers (``blocks``: ``quantize``, ``dequantize``, ``validate_blocks``, one class per ggml type) write
exactly the bytes of ggml's ``ggml_quantize_chunk``; they are numba kernels (``kernels``), which a process
imports with numba on first use (``kimi_convert.kernel``), so the policy and planning modules load light.
"""
from __future__ import annotations

_BLOCKS_API = ("BlockType", "InvalidBlockError", "block_type", "default_threads", "dequantize", "quantize",
               "row_size", "supported_types", "validate_blocks")


def __getattr__(name):
    if name in _BLOCKS_API:
        from . import blocks

        return getattr(blocks, name)
    raise AttributeError(name)
