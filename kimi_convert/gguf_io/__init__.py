"""The one GGUF layer, shared by the converter, the quantizer, the verifier and the runtime.

`writer`: the streaming writer (atomic output, splits, direct I/O, disk checks).
`reader`: `open_gguf`, which memory-maps a file or every part of a split file.
"""
from .reader import (GGUFFile, GGUFTensor, Shape, ValueTypes, gguf_parts, iter_chunks_of, open_gguf,  # noqa: F401
                     read_fields, read_gguf, read_types, same_shape)
from .writer import (COPY_CHUNK, HEADROOM, MIN_SPLIT_SIZE, BufferedSink, Chunk, DirectSink, DiskRoom,  # noqa: F401
                     FileRange, GGUFStreamWriter, OutTensor, Prefetch, SourceFiles, check_free_disk,
                     check_output_paths, check_split_max_size, copy_range, disk_bytes, disk_room, open_sink,
                     partial_dir, remove_stale, split_paths, stale_partials, tensor_nbytes)
