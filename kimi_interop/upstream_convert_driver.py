"""Run llama.cpp's own converter (convert_hf_to_gguf.py of the Oct-2026 tree) on a checkpoint folder.

Usage: python upstream_convert_driver.py TREE HF_DIR --outfile OUT.gguf --outtype bf16|f32

TREE is the llama.cpp source tree that .ci/install-interop.sh unpacks from the llama-cpp-python 0.3.36 sdist
(convert_hf_to_gguf.py, conversion/, gguf-py/, models/templates/). Nothing of it is copied here: this script
only runs it, in its own process so that its gguf-py (newer than our pinned gguf) never meets ours.

Two stand-ins let the converter run without `transformers` and without a Hugging Face tokenizer class:
- `transformers.AutoConfig` raises, and the converter takes its documented fallback: it reads config.json.
- `AutoTokenizer.from_pretrained` returns `KimiTikToken`, which has exactly the attributes the kimi-linear
  vocabulary code reads from Moonshot's TikTokenTokenizer: `model._mergeable_ranks` (bytes -> rank from
  tiktoken.model), `special_tokens` (the 256 reserved names after the ranked tokens, overridden by
  tokenizer_config.json's added tokens) and `eos_id` (the id of `[EOS]`). Everything that turns these into
  GGUF keys (tokens, types, merges, special ids, chat template) is llama.cpp's code.
- `transformers.convert_slow_tokenizer.bytes_to_unicode` is GPT-2's fixed byte -> printable-character table.
- The pre-tokenizer check hashes the encoding of a fixed text and knows only the real Kimi vocabulary's hash,
  which a fixture's vocabulary cannot have, so it is answered with the name it would give: "kimi-k2".
"""
from __future__ import annotations

import base64
import json
import runpy
import sys
import types
from pathlib import Path

N_RESERVED_SPECIAL = 256


class KimiTikToken:
    def __init__(self, hf_dir: Path):
        ranks = {}
        for line in (hf_dir / "tiktoken.model").read_text(encoding="ascii").splitlines():
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
        self.model = types.SimpleNamespace(_mergeable_ranks=ranks)
        n_base = len(ranks)
        self.special_tokens = {f"<|reserved_token_{i}|>": i for i in range(n_base, n_base + N_RESERVED_SPECIAL)}
        config = json.loads((hf_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
        for token_id, entry in (config.get("added_tokens_decoder") or {}).items():
            self.special_tokens[entry["content"]] = int(token_id)
        self.eos_id = self.special_tokens["[EOS]"]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: printable Latin-1 bytes map to themselves, the other 68 to U+0100 onwards, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b], extra = chr(256 + extra), extra + 1
    return table


def _install_transformers_stand_in() -> None:
    tf = types.ModuleType("transformers")
    tf.__path__ = []                     # a package, so that the submodule below can be imported
    slow = types.ModuleType("transformers.convert_slow_tokenizer")
    slow.bytes_to_unicode = bytes_to_unicode

    class AutoConfig:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            raise OSError("transformers is not installed: read config.json")

    class AutoTokenizer:
        @staticmethod
        def from_pretrained(path, **kwargs):
            return KimiTikToken(Path(path))

    tf.AutoConfig, tf.AutoTokenizer, tf.convert_slow_tokenizer = AutoConfig, AutoTokenizer, slow
    sys.modules["transformers"], sys.modules[slow.__name__] = tf, slow


def main() -> None:
    tree, args = sys.argv[1], sys.argv[2:]
    sys.path[:0] = [str(Path(tree) / "gguf-py"), tree]
    _install_transformers_stand_in()
    from conversion.base import TextModel  # noqa: PLC0415  (from the tree, after the path is set)

    TextModel.get_vocab_base_pre = lambda self, tokenizer: "kimi-k2"
    sys.argv = [str(Path(tree) / "convert_hf_to_gguf.py"), *args]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
