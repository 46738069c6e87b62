"""The tokens a streamed run pushes through the model: a text tokenized as llama.cpp tokenizes it for the model,
cut into chunks the way llama-imatrix and llama-perplexity cut it.

Both tools (tools/imatrix/imatrix.cpp, tools/perplexity/perplexity.cpp) read the text with `-f` (which drops one
trailing newline, common/arg.cpp), tokenize it once with `common_tokenize(ctx, text, add_special=true)`, need at
least 2 x ctx tokens, take `len // ctx` consecutive chunks (`--chunks` keeps the first N) and put BOS in place of
each chunk's first token when the vocabulary adds one.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import KimiError

MAX_TEXT_BYTES = 1 << 32       # a calibration or evaluation text is read whole


class TextInputError(KimiError):
    """The text, the model or an option cannot give the run's tokens; the message names the file."""


def read_text(path: Path) -> bytes:
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise TextInputError(f"{path}: not a regular file")
        if size > MAX_TEXT_BYTES:
            raise TextInputError(f"{path}: {size:,} bytes, more than a text of 4 GiB")
        return path.read_bytes()
    except OSError as e:
        raise TextInputError(f"{path}: cannot read the text ({e.strerror or e})") from None


def model_tokenizer(model: Path):
    """The tokenizer llama.cpp builds from the model: from the checkpoint's files or from the GGUF's keys."""
    from ..tokenizer import Tokenizer
    model = Path(model)
    return Tokenizer.from_checkpoint(model) if model.is_dir() else Tokenizer.from_gguf(model)


def text_tokens(path: Path, tokenizer) -> np.ndarray:
    """common_tokenize(ctx, text of -f, add_special=true)."""
    text = read_text(path)
    if text.endswith(b"\n"):          # llama.cpp's -f drops one trailing newline (common/arg.cpp)
        text = text[:-1]
    if not text.strip():
        raise TextInputError(f"{path}: the text is empty")
    return tokenizer.encode(text)


def chunk_tokens(ids: np.ndarray, ctx: int, chunks: int | None, bos: int | None, text: Path,
                 tool: str = "llama-imatrix") -> np.ndarray:
    """[n_chunks, ctx] as the tools cut the tokens (BOS in place of each first token); 2 x ctx are needed."""
    if len(ids) < 2 * ctx:
        raise TextInputError(f"{text}: {len(ids)} tokens; {tool} needs at least {2 * ctx} for a context "
                             f"of {ctx} (give more text or a smaller --ctx)")
    n = len(ids) // ctx if chunks is None else min(chunks, len(ids) // ctx)
    out = np.array(ids[:n * ctx], np.int64).reshape(n, ctx)
    if bos is not None:
        out[:, 0] = bos
    return out
