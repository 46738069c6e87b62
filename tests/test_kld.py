"""kimi-verify kld: llama-perplexity's base file (written, read, round trip), its statistics against a direct
float64 computation, the command's modes giving the same numbers, and refused inputs leaving nothing behind.
(Equality with the real llama-perplexity: tests/test_kld_llama.py.)"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kimi_convert.engine.tokens import TextInputError
from kimi_convert.fixtures.make_checkpoint import make_checkpoint
from kimi_convert.kld.basefile import BaseFile, BaseFileError, compress, expand, row_width
from kimi_convert.kld.job import KldInputError, KldOptions, KldRun
from kimi_convert.kld.stats import KldStats

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="300")
CTX, CHUNKS = 64, 3


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(1, keepdims=True)
    return x - np.log(np.exp(x).sum(1, keepdims=True))


def test_compressed_log_probs_are_within_half_a_step():
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((40, 1001)) * 4).astype(np.float32)
    logits[3] = 0.0                                       # all equal: scale 0, every code 0, log p = -log V
    rows = compress(logits)
    assert rows.shape == (40, row_width(1001)) and row_width(1001) == 1006
    got, want = expand(rows, 1001), log_softmax64(logits)
    scale = rows[:, :4].copy().view("<f4")[:, 0].astype(np.float64)
    kept = logits > logits.max(1, keepdims=True) - 16
    err = np.abs(got - want)
    assert (err[kept] <= (scale[:, None] * 0.5 + 1e-5).repeat(1001, 1)[kept]).all()
    assert np.allclose(got[3], -math.log(1001), atol=1e-6)
    assert (rows[:, 4:4 + 1001][~kept] == 0).all() and (~kept).any()


def test_stats_equal_a_direct_float64_computation():
    rng = np.random.default_rng(1)
    base = (rng.standard_normal((200, 300)) * 3).astype(np.float32)
    quant = base + (rng.standard_normal(base.shape) * 0.3).astype(np.float32)
    p = np.exp(log_softmax64(base))
    targets = np.array([rng.choice(300, p=row / row.sum()) for row in p])    # text the base model would write
    stats = KldStats()
    stats.add(quant[:100], compress(base[:100]), targets[:100])
    stats.add(quant[100:], compress(base[100:]), targets[100:])
    s = stats.summary()
    lp, lq = log_softmax64(base), log_softmax64(quant)
    kld = (np.exp(lp) * (lp - lq)).sum(1)
    assert s["kld_mean"] == pytest.approx(kld.mean(), rel=2e-3)
    assert s["kld_median"] == pytest.approx(np.median(kld), rel=5e-3)
    assert s["kld_max"] == pytest.approx(kld.max(), rel=5e-3)
    nll = -lq[np.arange(200), targets]
    assert s["ppl"] == pytest.approx(math.exp(nll.mean()), rel=1e-5)
    assert s["ppl_base"] == pytest.approx(math.exp((-lp[np.arange(200), targets]).mean()), rel=1e-3)
    assert s["same_top"] == pytest.approx((base.argmax(1) == quant.argmax(1)).mean())
    dp = np.exp(-nll) - np.exp(lp[np.arange(200), targets])
    assert s["rms_dp"] == pytest.approx(math.sqrt((dp ** 2).mean()), rel=2e-3)
    assert s["kld_unc"] == pytest.approx(kld.std() / math.sqrt(199), rel=1e-2)


@pytest.fixture(scope="module")
def models(converted, tmp_path_factory):
    """(the BF16 GGUF, its Q8_0 quantization, a text of a few chunks)"""
    from kimi_convert.quant.driver import quantize_file
    from kimi_convert.quant.policy import parse_policy
    d = tmp_path_factory.mktemp("kld")
    q8 = d / "q8.gguf"
    quantize_file(converted("k3"), q8, parse_policy('default = "Q8_0"\n', "test"))
    return converted("k3"), q8


@pytest.fixture(scope="module")
def text(calib_text) -> Path:
    return calib_text


def run(base, quant=None, **kw):
    return KldRun(KldOptions(Path(base), Path(quant) if quant else None, **kw)).run()


def test_a_file_against_itself_has_no_divergence(models, text):
    bf16, _ = models
    r = run(bf16, bf16, text=text, ctx=CTX, chunks=CHUNKS)
    s = r.summary
    assert s["tokens"] == CHUNKS * (CTX - 1 - CTX // 2)
    assert s["kld_mean"] < 1e-4 and s["same_top"] == 1.0
    assert s["ppl"] == pytest.approx(s["ppl_base"], rel=1e-3)
    assert r.base_ppl[0] == pytest.approx(s["ppl_base"], rel=1e-3)


def test_saved_base_gives_the_same_numbers_and_the_checkpoint_the_same_base(models, text, k3_dir, tmp_path):
    bf16, q8 = models
    direct = run(bf16, q8, text=text, ctx=CTX, chunks=CHUNKS).summary
    saved = tmp_path / "base.kld"
    r = run(bf16, save_base=saved, text=text, ctx=CTX, chunks=CHUNKS)
    assert r.summary is None and saved.is_file()
    again = run(saved, q8).summary
    assert {k: v for k, v in again.items()} == direct
    assert 0 < direct["kld_mean"] < 0.5
    from_hf = tmp_path / "hf.kld"
    run(k3_dir, save_base=from_hf, text=text, ctx=CTX, chunks=CHUNKS)
    assert from_hf.read_bytes() == saved.read_bytes()            # the checkpoint runs as its conversion
    f = BaseFile(saved)
    assert (f.header.n_ctx, f.header.n_chunk) == (CTX, CHUNKS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base.kld", "hf.kld"]


def test_refused_inputs_leave_nothing(models, text, tmp_path, converted):
    bf16, q8 = models
    saved = tmp_path / "base.kld"
    run(bf16, save_base=saved, text=text, ctx=CTX, chunks=CHUNKS)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(KldInputError, match="ctx 64, but --ctx 32"):
        run(saved, q8, ctx=32)
    other_vocab = make_checkpoint(tmp_path / "v", vocab_size=1100)
    with pytest.raises(KldInputError, match="vocabulary of 1,100 tokens.*has 1,024"):
        run(saved, other_vocab)
    with pytest.raises(KldInputError, match="not a file of the model"):
        run(bf16, converted("k31"), text=text, ctx=CTX, chunks=CHUNKS)
    short = tmp_path / "short.txt"
    short.write_text("def f(): pass\n")
    with pytest.raises(TextInputError, match="short.txt: .* tokens; llama-perplexity needs at least 128"):
        run(bf16, q8, text=short, ctx=CTX)
    truncated = tmp_path / "cut.kld"
    truncated.write_bytes(saved.read_bytes()[:-7])
    with pytest.raises(BaseFileError, match="cut.kld: .* bytes, but its header"):
        run(truncated, q8)
    short.unlink(), truncated.unlink()
    import shutil
    shutil.rmtree(other_vocab)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def nan_copy(src: Path, dst: Path, tensor: str) -> Path:
    from kimi_convert.gguf_io import open_gguf
    t = open_gguf(src).tensors[tensor]
    data = bytearray(src.read_bytes())
    data[t.offset:t.offset + 2] = b"\xc0\x7f"                    # one BF16 NaN
    dst.write_bytes(bytes(data))
    return dst


def test_non_finite_logits_are_named_and_the_command_fails_cleanly(models, text, tmp_path):
    bf16, _ = models
    bad = nan_copy(bf16, tmp_path / "nan.gguf", "output.weight")
    out = tmp_path / "base.kld"
    p = subprocess.run([sys.executable, "-c", "from kimi_convert.cli.verify import main; main()", "kld", str(bf16),
                        str(bad), "-f", str(text), "--ctx", str(CTX), "--chunks", "2", "--save-base", str(out)],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert p.returncode == 1, p.stderr
    assert "nan.gguf: non-finite logits (inf or NaN) at token" in p.stderr
    assert len(p.stderr.strip().splitlines()[-1]) < 300
    assert sorted(x.name for x in tmp_path.iterdir()) == ["nan.gguf"]       # no base file, no work folder


@pytest.mark.interop
def test_the_command_prints_llama_perplexity_s_labels(models, text, tmp_path):
    from kimi_interop.llama_tools import parse_kld_report
    bf16, q8 = models
    p = subprocess.run([sys.executable, "-c", "from kimi_convert.cli.verify import main; main()", "kld", str(bf16),
                        str(q8), "-f", str(text), "--ctx", str(CTX), "--chunks", str(CHUNKS),
                        "--json", str(tmp_path / "r.json")], capture_output=True, text=True, env=ENV, timeout=300)
    assert p.returncode == 0, p.stderr
    printed = parse_kld_report(p.stdout)
    import json
    stats = json.loads((tmp_path / "r.json").read_text())["statistics"]
    assert printed["Mean KLD"] == pytest.approx(stats["kld_mean"], abs=1e-6)
    assert printed["Same top p"] == pytest.approx(100 * stats["same_top"], abs=1e-3)
    assert printed["Mean PPL(Q)/PPL(base)"] == pytest.approx(stats["ppl_ratio"], abs=1e-6)
    for label in ("Mean PPL(base)", "99.9% KLD", "Median KLD", "RMS Δp", "Cor(ln(PPL(Q)), ln(PPL(base)))"):
        assert label in printed
    assert sorted(x.name for x in tmp_path.iterdir()) == ["r.json"]
