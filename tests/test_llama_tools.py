"""Smoke test of the real llama-imatrix and llama-quantize of the pinned llama.cpp tree (kimi_interop/llama_tools.py)
on a converted tiny K3: the importance matrix llama.cpp itself collects, and llama-quantize taking it.

The tools come from `bash .ci/install-interop.sh` (part 6); when they are missing this test FAILS
(InteropUnavailable), it never skips.
"""
from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

try:
    import kimi_interop  # noqa: F401
except ImportError:  # running without the repo root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGUFReader

from kimi_interop.llama_tools import llama_imatrix, llama_quantize

pytestmark = pytest.mark.interop      # needs the llama.cpp builds (.ci/install-interop.sh)

CTX, CHUNKS = 128, 2


def _text(path: Path) -> Path:
    # ordinary English and code: a few thousand tokens of the fixture's vocabulary, llama-imatrix wants >= 2 * CTX
    src = Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"
    path.write_text(src.read_text()[:16000])
    return path


def test_llama_imatrix_and_quantize_run(converted, tmp_path):
    model = converted("k3")
    imatrix = tmp_path / "imatrix.gguf"
    llama_imatrix(model, _text(tmp_path / "calib.txt"), imatrix, ctx=CTX, chunks=CHUNKS, threads=2)

    r = GGUFReader(imatrix)
    assert r.fields["general.type"].contents() == "imatrix"
    assert r.fields["imatrix.chunk_count"].contents() == CHUNKS
    assert r.fields["imatrix.chunk_size"].contents() == CTX
    tensors = {t.name: t for t in r.tensors}
    entries = {n.removesuffix(".in_sum2") for n in tensors if n.endswith(".in_sum2")}
    assert entries == {n.removesuffix(".counts") for n in tensors if n.endswith(".counts")}
    assert any(n.startswith("blk.0.") for n in entries), sorted(entries)
    assert all(n.startswith("blk.") for n in entries)              # no --process-output: not output.weight
    # a dense matrix saw every token of the chunks; all sums of squares are finite and >= 0
    counts = np.asarray(tensors["blk.0.ffn_down.weight.counts"].data).reshape(-1)
    assert counts.tolist() == [CTX * CHUNKS]
    assert all(np.all(np.asarray(tensors[f"{n}.in_sum2"].data) >= 0) for n in entries)

    out = tmp_path / "q4_k_m.gguf"
    res = llama_quantize(model, out, "Q4_K_M", imatrix=imatrix, threads=2, allow_requantize=True)  # MXFP4 experts
    assert "imatrix" in res.stdout + res.stderr
    q = GGUFReader(out)
    assert q.fields["quantize.imatrix.entries_count"].contents() == len(entries)
    assert q.fields["quantize.imatrix.chunks_count"].contents() == CHUNKS
