"""The quality table on a small setting (benchmarks/bench_quality.py is the full one): on the trained K3 fixture,
with an imatrix from kimi-imatrix on training text and the KL divergence on held-out text, --target-size (its
default measure: the role prior, quant/target/prior.py) is at least as good as llama-quantize's mixtures and our
low-bit presets of at most its bytes, and its KL divergence falls as the budget rises.
"Within noise" is two standard errors of the difference of chunk means (paired by chunk, as the table pairs them)."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from kimi_convert.convert.converter import build_plan, convert
from kimi_convert.fixtures import trained
from kimi_convert.gguf_io import open_gguf
from kimi_convert.imatrix.job import ImatrixOptions, ImatrixRun
from kimi_convert.kld.job import KldOptions, KldRun
from kimi_convert.quant.driver import quantize_file
from kimi_convert.quant.imatrix import load_imatrix
from kimi_convert.quant.plan import PlanOptions
from kimi_convert.quant.policy import load_policy
from kimi_convert.quant.target.budget import parse_budget
from kimi_convert.quant.target.choose import choose, no_base

CTX, TRAIN_CHUNKS, EVAL_CHUNKS = 128, 16, 8
MIXTURES = ("IQ2_XXS", "Q2_K", "k3-iq1", "k3-iq2")       # two of llama-quantize's mixtures, two presets


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    d = tmp_path_factory.mktemp("quality")
    hf = trained.write(d / "hf", "k3")
    gguf = d / "k3.gguf"
    convert(build_plan(hf, "bf16"), gguf)
    (d / "train.txt").write_text(trained.read_text("train")[:400_000])
    (d / "heldout.txt").write_text(trained.read_text("heldout"))
    im = d / "imatrix.gguf"
    ImatrixRun(ImatrixOptions(hf, d / "train.txt", im, ctx=CTX, chunks=TRAIN_CHUNKS)).run()
    base = d / "base.kld"
    KldRun(KldOptions(hf, None, d / "heldout.txt", CTX, EVAL_CHUNKS, save_base=base)).run()
    return d, gguf, load_imatrix(im), base


def chunk_kld(base: Path, gguf: Path) -> np.ndarray:
    return np.array(KldRun(KldOptions(base, gguf)).run().summary["chunk_kld"])


def not_worse(a: np.ndarray, b: np.ndarray) -> tuple[bool, float, float]:
    """a's KLD is below b's, or above by less than two standard errors of the paired difference."""
    diff = a - b
    se2 = 2 * diff.std(ddof=1) / math.sqrt(len(diff))
    return diff.mean() <= se2, float(diff.mean()), se2


def test_target_size_beats_the_mixtures_and_presets_and_falls_with_the_budget(setting):
    d, gguf, imat, base = setting
    mixtures = {}
    for name in MIXTURES:
        out = d / f"{name}.gguf"
        quantize_file(gguf, out, load_policy(name), imatrix=imat, options=PlanOptions(allow_requantize=True))
        mixtures[name] = (out.stat().st_size, chunk_kld(base, out))
    budgets = sorted(size for size, _ in mixtures.values())
    budgets.append(int(budgets[-1] * 1.3))
    targets = []
    gf = open_gguf(gguf)
    for b in budgets:
        choice = choose(gf, no_base(), parse_budget(str(b), None), imat,
                        cache_dir=d / "errors", options=PlanOptions(allow_requantize=True))
        out = d / f"target-{b}.gguf"
        quantize_file(gguf, out, choice.policy, imatrix=imat, options=PlanOptions(allow_requantize=True))
        assert out.stat().st_size <= b + 64 * 1024            # the budget is tensor data; the header is small
        targets.append((b, chunk_kld(base, out)))
    for name, (size, kld) in mixtures.items():
        for b, t in targets:
            if b >= size:
                ok, mean, se2 = not_worse(t, kld)
                assert ok, (f"--target-size {b} against {name} ({size} B)", mean, se2)
    for (b0, k0), (b1, k1) in zip(targets, targets[1:]):
        ok, mean, se2 = not_worse(k1, k0)
        assert ok, (f"--target-size {b1} against the smaller {b0}", mean, se2)
    assert targets[-1][1].mean() < targets[0][1].mean()        # and over the whole range it does fall
