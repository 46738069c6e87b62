"""kimi-imatrix end to end: the file llama-imatrix writes (keys, tensors, .dat, --in-file), the same from the
checkpoint and from its GGUF, refused inputs with nothing left behind, and a run killed mid-layer that --resume
finishes byte for byte."""
from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from kimi_convert.engine.weights import open_source
from kimi_convert.quant.imatrix import load_imatrix
from in_process import run_command

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="300")
MAIN = "from kimi_convert.cli.imatrix import main; main()"
CTX, CHUNKS = 32, 4


def kimi_imatrix(*args, prelude: str = "", check: bool = True) -> subprocess.CompletedProcess:
    """kimi-imatrix ARGS: in this process (tests/in_process.py), or in its own after `prelude` (a patch)."""
    if prelude:
        p = subprocess.run([sys.executable, "-c", prelude + MAIN, *map(str, args)], capture_output=True, text=True,
                           env=ENV, timeout=300)
    else:
        p = run_command("kimi-imatrix", args)
    if check:
        assert p.returncode == 0, p.stderr
    return p


@pytest.fixture(scope="module")
def text(calib_text) -> Path:
    return calib_text


@pytest.fixture(scope="module")
def k3(k3_dir, converted, text, tmp_path_factory):
    """(hf, gguf, the imatrix from the GGUF)"""
    out = tmp_path_factory.mktemp("im") / "k3.imatrix.gguf"
    kimi_imatrix(converted("k3"), "-f", text, "-o", out, "--ctx", CTX, "--chunks", CHUNKS)
    return k3_dir, converted("k3"), out


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_the_file_is_llama_imatrix_s_gguf(k3, text):
    _, gguf, out = k3
    r = GGUFReader(out)
    assert list(r.fields)[3:] == ["general.type", "imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size"]
    assert r.fields["imatrix.chunk_size"].contents() == CTX
    assert r.fields["imatrix.chunk_count"].contents() == CHUNKS
    assert r.fields["imatrix.datasets"].contents() == [str(text)]
    names = [t.name for t in r.tensors]
    entries = [n.removesuffix(".in_sum2") for n in names[::2]]
    assert entries == sorted(entries, key=str.encode)             # std::sort of the names, then sums, counts
    assert names[1::2] == [n + ".counts" for n in entries] and names[::2] == [n + ".in_sum2" for n in entries]
    im = load_imatrix(out)
    expert = [n for n in im.names if "_exps" in n]
    assert expert and all(im.raw(n)[1].size > 1 for n in expert)
    dense = [n for n in im.names if "_exps" not in n]
    assert all(im.raw(n)[1].tolist() == [CTX * CHUNKS] for n in dense)
    used = open_source(gguf).config.n_expert_used
    for n in expert:                       # every (token, slot) pair lands on one expert
        assert im.raw(n)[1].sum() == CTX * CHUNKS * used
    assert not [n for n in im.names if not n.startswith("blk.")]


def test_from_the_checkpoint_and_from_the_gguf_the_same_bytes(k3, text, tmp_path):
    hf, _, out = k3
    from_hf = tmp_path / "hf.imatrix.gguf"
    kimi_imatrix(hf, "-f", text, "-o", from_hf, "--ctx", CTX, "--chunks", CHUNKS)
    assert from_hf.read_bytes() == out.read_bytes()


def test_dat_holds_the_means_times_ncall(k3, text, tmp_path):
    _, gguf, out = k3
    dat = tmp_path / "k3.dat"
    kimi_imatrix(gguf, "-f", text, "-o", dat, "--ctx", CTX, "--chunks", CHUNKS, "--output-format", "dat")
    g, d = load_imatrix(out), load_imatrix(dat)
    assert d.format == "dat" and d.names == [n for n in g.names if (g.raw(n)[1] > 0).any()]
    for n in g.names:
        sums, counts = g.raw(n)
        ncall = int(np.ceil(counts.max() / CTX))
        want = np.where(counts[:, None] > 0, sums / np.maximum(counts, 1)[:, None], 1.0) * ncall
        np.testing.assert_allclose(d.raw(n)[0].reshape(want.shape), want, rtol=1e-6, err_msg=n)
    raw = dat.read_bytes()
    assert raw.endswith(str(text).encode())
    assert struct.unpack("<i", raw[-len(str(text)) - 8:-len(str(text)) - 4])[0] == CHUNKS


def test_in_file_adds_sums_and_counts(k3, text, tmp_path):
    _, gguf, out = k3
    both = tmp_path / "both.gguf"
    kimi_imatrix(gguf, "-f", text, "-o", both, "--ctx", CTX, "--chunks", CHUNKS, "--in-file", out)
    a, b = load_imatrix(out), load_imatrix(both)
    assert b.names == a.names and b.chunk_count == 2 * CHUNKS
    assert b.datasets == [str(text).encode()] * 2
    for n in a.names:
        np.testing.assert_allclose(b.raw(n)[0], 2 * a.raw(n)[0], rtol=1e-6)
        assert np.array_equal(b.raw(n)[1], 2 * a.raw(n)[1])


def test_in_file_of_another_ctx_or_model_is_refused(k3, text, tmp_path, converted):
    _, gguf, out = k3
    p = kimi_imatrix(gguf, "-f", text, "-o", tmp_path / "x.gguf", "--ctx", 2 * CTX, "--chunks", 2, "--in-file", out,
                     check=False)
    assert p.returncode == 1 and "chunk size 32" in p.stderr and leftovers(tmp_path) == []
    k31 = tmp_path / "k31.gguf"
    kimi_imatrix(converted("k31"), "-f", text, "-o", k31, "--ctx", CTX, "--chunks", 2)
    p = kimi_imatrix(gguf, "-f", text, "-o", tmp_path / "y.gguf", "--ctx", CTX, "--chunks", 2, "--in-file", k31,
                     check=False)
    assert p.returncode == 1 and "indexer" in p.stderr and "another model" in p.stderr
    assert leftovers(tmp_path) == ["k31.gguf"]


@pytest.mark.parametrize("case", ["empty", "short", "not a model", "over the text", "over the model", "exists",
                                  "ctx"])
def test_bad_input_is_one_line_and_nothing_left(case, k3, text, tmp_path):
    _, gguf, _ = k3
    model, calib, out, extra = gguf, text, tmp_path / "o.gguf", []
    if case == "empty":
        calib = tmp_path / "empty.txt"
        calib.write_text("  \n")
    elif case == "short":
        calib = tmp_path / "short.txt"
        calib.write_text("def f():\n    return 1\n")
    elif case == "not a model":
        model = tmp_path / "m.gguf"
        model.write_bytes(b"GGUF" + b"\0" * 64)
    elif case == "over the text":
        calib = tmp_path / "t.txt"
        calib.write_text(text.read_text())
        out = calib
    elif case == "over the model":
        model = tmp_path / "copy.gguf"
        model.write_bytes(gguf.read_bytes())
        out = model
        extra = ["--force"]
    elif case == "exists":
        out.write_bytes(b"keep")
    elif case == "ctx":
        extra = ["--ctx", "8"]
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    p = kimi_imatrix(model, "-f", calib, "-o", out, "--chunks", 2, *extra, check=False)
    assert p.returncode == 1, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, p.stderr
    name = {"not a model": model, "over the model": model, "exists": out}.get(case, calib)
    if case != "ctx":
        assert str(name) in lines[0]
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before      # nothing written, nothing changed


PAUSE = """
import os, time
from kimi_convert.engine import forward
_ffn = forward.Engine.ffn
def paused_ffn(self, il, *a):
    if il == {layer}:
        open({reached!r}, "w").close()
        while True:
            time.sleep(0.05)
    return _ffn(self, il, *a)
forward.Engine.ffn = paused_ffn
"""


def start_paused(args: list, layer: int, reached: Path) -> subprocess.Popen:
    code = PAUSE.format(layer=layer, reached=str(reached)) + MAIN
    proc = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not reached.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return proc


def test_killed_mid_layer_and_resumed_is_byte_identical(k3, text, tmp_path):
    _, gguf, out = k3
    target = tmp_path / "r.gguf"
    args = [gguf, "-f", text, "-o", target, "--ctx", CTX, "--chunks", CHUNKS]
    proc = start_paused(args, 4, tmp_path / "reached")          # layers 0-3 done, layer 4 half run
    proc.kill()
    proc.wait()
    work = tmp_path / ".r.gguf.imatrix-work"
    assert json.loads((work / "progress.json").read_text())["done"] == 4
    p = kimi_imatrix(*args, "--resume")
    assert "resuming after layer 3" in p.stderr
    assert target.read_bytes() == out.read_bytes()
    assert leftovers(tmp_path) == ["r.gguf", "reached"]        # the resume folder is gone


def test_a_signal_before_any_layer_leaves_nothing(k3, text, tmp_path):
    _, gguf, _ = k3
    proc = start_paused([gguf, "-f", text, "-o", tmp_path / "s.gguf", "--ctx", CTX, "--chunks", CHUNKS], 0,
                        tmp_path / "reached")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM and "interrupted by SIGTERM" in err
    assert leftovers(tmp_path) == ["reached"]


def test_dry_run_writes_nothing_but_its_json(k3, text, tmp_path):
    _, gguf, _ = k3
    report = tmp_path / "plan.json"
    p = kimi_imatrix(gguf, "-f", text, "-o", tmp_path / "o.gguf", "--ctx", CTX, "--chunks", CHUNKS, "--dry-run",
                     "--json", report)
    plan = json.loads(report.read_text())
    assert {"bytes_read", "peak_bytes", "token_state_bytes", "seconds"} <= set(plan)
    assert plan["tokens"] == CTX * CHUNKS and plan["bytes_read"] > 0
    assert leftovers(tmp_path) == ["plan.json"] and "bytes read" in p.stdout


def test_k31_with_top_k_over_ctx_is_its_k3_twin_plus_the_indexer(k3, k31_dir, text, tmp_path):
    """The K3.1 fixture is the K3 one plus an indexer (same seed, same tensors). With top_k (2048) >= ctx the
    indexer keeps every earlier token, so every entry K3.1 shares with K3 is the twin's, bit for bit; and the
    indexer's matrices read the inputs of others (k31-indexer.md): q_b the q latent c_q, as attn_q_b does; k and
    proj the attention-normed h, as attn_q_a (and attn_kv_a_mqa, attn_gate) do."""
    hf3, _, _ = k3
    ours3, ours31 = tmp_path / "k3.gguf", tmp_path / "k31.gguf"
    kimi_imatrix(hf3, "-f", text, "-o", ours3, "--ctx", CTX, "--chunks", CHUNKS)
    kimi_imatrix(k31_dir, "-f", text, "-o", ours31, "--ctx", CTX, "--chunks", CHUNKS)
    a, b = load_imatrix(ours3), load_imatrix(ours31)
    indexer = [n for n in b.names if ".indexer." in n]
    assert sorted(set(b.names) - set(a.names)) == indexer and set(a.names) <= set(b.names)
    for n in a.names:
        assert np.array_equal(a.raw(n)[0], b.raw(n)[0]) and np.array_equal(a.raw(n)[1], b.raw(n)[1]), n
    reads = {"indexer.attn_q_b": "attn_q_b", "indexer.attn_k": "attn_q_a", "indexer.proj": "attn_q_a"}
    assert len(indexer) == 2 * len(reads)                   # two MLA layers
    for n in indexer:
        layer, what = n.split(".")[1], n.split(".", 2)[2].removesuffix(".weight")
        twin = f"blk.{layer}.{reads[what]}.weight"
        assert np.array_equal(b.raw(n)[0], b.raw(twin)[0]) and np.array_equal(b.raw(n)[1], b.raw(twin)[1]), n


def test_kimi_quantize_without_an_imatrix_names_kimi_imatrix(k3, tmp_path):
    _, gguf, _ = k3
    code = "from kimi_convert.cli.quantize import main; main()"
    for policy in (["--policy", "k3-iq1", "--allow-requantize"], ["--policy", "IQ2_XXS", "--allow-requantize"]):
        p = subprocess.run([sys.executable, "-c", code, *policy, str(gguf), str(tmp_path / "q.gguf")],
                           capture_output=True, text=True, env=ENV, timeout=300)
        assert p.returncode == 1 and "kimi-imatrix" in p.stderr.splitlines()[-1], p.stderr
    assert leftovers(tmp_path) == []
