"""The one GGUF layer, shared by the converter, the quantizer, the verifier and the runtime.

`writer`: the streaming writer (atomic output, splits, direct I/O, disk checks, the output lock).
`manifest`: the per-tensor SHA-256 manifest the writer writes, its resume journal, and checking files against it.
`qtypes`: the ggml types (gguf-py's, plus those the pinned gguf lacks: Q2_0) and their block sizes.
`reader`: `open_gguf`, which memory-maps a file or every part of a split file (a hardened parser of
our own; `read_gguf` reads one part).
"""
from .qtypes import (MOSTLY_Q2_0, Q2_0, QUANT_SIZES, TYPES_BY_NAME, NewerType, ggml_type)  # noqa: F401
from .reader import (GGUFFile, GGUFPart, GGUFTensor, Shape, ValueTypes, dequantize, gguf_inputs,  # noqa: F401
                     gguf_parts, iter_chunks_of, open_gguf, read_gguf, same_shape)
from .writer import (COPY_CHUNK, HEADROOM, MIN_SPLIT_SIZE, BufferedSink, Chunk, DirectSink, DiskRoom,  # noqa: F401
                     FileRange, GGUFStreamWriter, OutTensor, Prefetch, SourceFiles, check_free_disk,
                     check_output_paths, check_split_max_size, copy_range, disk_bytes, disk_room, open_sink,
                     lock_path, output_lock, partial_dir, remove_stale, split_paths, stale_partials, tensor_nbytes,
                     written_paths)
from .manifest import check_manifest, load_manifest, manifest_path  # noqa: F401
