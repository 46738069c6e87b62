"""From a downloaded checkpoint to a low-bit file, as a user types it: kimi-imatrix on the checkpoint, then
kimi-convert with the matrix (a preset, llama-quantize's IQ2_XXS mixture, a size budget), then kimi-verify check
with it. No intermediate GGUF is written anywhere: the matrix comes from the checkpoint itself."""
from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from in_process import run_command
from kimi_convert.fixtures.make_checkpoint import make_checkpoint

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="300",
           XDG_CACHE_HOME=tempfile.mkdtemp(prefix="kimi-xdg-"))    # --target-size's cache: not the user's
# rows of 256, so that IQ1_S / IQ2_XXS do not fall back to other types
WIDE = dict(n_layers=8, hidden=256, moe_intermediate_size=256, routed_expert_hidden_size=256, intermediate_size=256,
            num_experts=8, num_experts_per_token=2, num_shared_experts=1, seed=3)


def command(module: str, *args) -> subprocess.CompletedProcess:
    """kimi-imatrix, kimi-convert or kimi-verify, in this process (in_process.run_command), with its own cache."""
    p = run_command(f"kimi-{module}", args, {"XDG_CACHE_HOME": ENV["XDG_CACHE_HOME"]})
    assert p.returncode == 0, p.stderr[-3000:]
    return p


@pytest.fixture(scope="module")
def made(tmp_path_factory, calib_text):
    d = tmp_path_factory.mktemp("e2e")
    hf = make_checkpoint(d / "Kimi-K3-wide", arch="k3", **WIDE)
    text = calib_text
    work = d / "work"
    work.mkdir()
    command("imatrix", hf, "-f", text, "-o", work / "im.gguf", "--ctx", 128, "--chunks", 16)
    return hf, work / "im.gguf"


@pytest.mark.parametrize("how", [["--policy", "k3-iq1"], ["--policy", "IQ2_XXS"], ["--target-size", "3M"]])
def test_checkpoint_to_low_bit_file_that_verifies(made, how, tmp_path):
    hf, im = made
    out = tmp_path / "out.gguf"
    command("convert", hf, out, *how, "--imatrix", im, "--allow-requantize")
    p = command("verify", "check", hf, out, "--imatrix", im)
    assert p.stdout.strip().splitlines()[-1] == "PASS", p.stdout[-2000:]
    ggufs = sorted(x.name for x in tmp_path.rglob("*.gguf")) + sorted(x.name for x in im.parent.rglob("*.gguf"))
    assert ggufs == ["out.gguf", "im.gguf"]                   # no intermediate GGUF
