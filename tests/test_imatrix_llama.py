"""kimi-imatrix against the real llama-imatrix of the pinned tree (kimi_interop/llama_tools.py), on the same file and
text, --ctx 128, 16 chunks; llama-quantize and kimi-quantize on our matrix.

What equality is possible, measured (docs/verification.md, "kimi-imatrix against llama-imatrix"):
- F32 weights, llama-imatrix with flash attention off: the same computation up to float order. Every count is
  llama-imatrix's, every in_sum2 entry within 2e-4 relative (median 3e-6).
- With flash attention on (llama-imatrix's default), its CPU kernel moves the MLA attention output by ~4e-5
  relative (off: 5e-7); the layers before the first MLA layer stay at float-order distance.
- BF16 and MXFP4 weights: llama.cpp rounds every activation to bf16 / Q8_0 before the product, and so do we, but
  a value that lies within float-order distance of a rounding boundary rounds the other way, a jump of 2^-9
  (bf16) or half a Q8_0 step. On these random-weight fixtures such jumps grow layer by layer: perturbing the
  embeddings by 1e-6 relative in our own engine alone flips routing in the first MoE layer and moves layer 2's
  sums by 3e-4 (tests/test_engine.py measures the engine on its own). So the comparison holds exactly where the
  rounding has not yet fed back (layer 0 and the first MoE layer's routing), and on the set of tensors, the dense
  counts and the expert counts' totals everywhere.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kimi_convert.convert.converter import build_plan, convert
from kimi_convert.fixtures.make_checkpoint import make_checkpoint
from kimi_convert.quant.driver import quantize_file
from kimi_convert.quant.imatrix import load_imatrix
from kimi_convert.quant.policy import load_policy
from kimi_interop.llama_tools import llama_imatrix, llama_quantize
from test_quantize import assert_same_file

pytestmark = pytest.mark.interop      # needs the llama.cpp builds (.ci/install-interop.sh)

CTX, CHUNKS = 128, 16
FIRST_MLA = 3                       # the fixture's layers: 0 KDA+dense, 1-2 KDA+MoE, 3 MLA+MoE, ...


def kimi_imatrix(model: Path, text: Path, out: Path, *extra) -> Path:
    subprocess.run([sys.executable, "-m", "kimi_convert.cli.imatrix", str(model), "-f", str(text), "-o", str(out),
                    "--ctx", str(CTX), "--chunks", str(CHUNKS), *map(str, extra)], check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def text(calib_text) -> Path:
    return calib_text


@pytest.fixture(scope="module")
def models(tmp_path_factory, k3_dir, converted):
    """name -> GGUF: the K3 fixture with BF16 experts converted to F32 and to BF16, and with MXFP4 experts."""
    d = tmp_path_factory.mktemp("imatrix-llama")
    hf = make_checkpoint(d / "Kimi-K3-bf16-experts", arch="k3", experts_mxfp4=False)
    out = {"f32": d / "k3-f32.gguf", "bf16": d / "k3-bf16.gguf"}
    convert(build_plan(hf, "f32"), out["f32"])
    convert(build_plan(hf, "bf16"), out["bf16"])
    return out | {"mxfp4": converted("k3")}


def pair(models, name, text, tmp_path, *llama_extra):
    ours = kimi_imatrix(models[name], text, tmp_path / "ours.gguf")
    theirs = tmp_path / "theirs.gguf"
    llama_imatrix(models[name], text, theirs, ctx=CTX, chunks=CHUNKS, threads=2, batch=2048, extra=llama_extra)
    return load_imatrix(ours), load_imatrix(theirs)


def relative(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.abs(a - b) / np.maximum(np.abs(b), 1e-30)


def check_structure(a, b) -> None:
    """The same entries, every dense count identical, and every layer's expert counts adding up the same."""
    assert a.names == b.names
    assert (a.chunk_count, a.chunk_size) == (b.chunk_count, b.chunk_size) == (CHUNKS, CTX)
    for n in b.names:
        (sa, ca), (sb, cb) = a.raw(n), b.raw(n)
        assert sa.shape == sb.shape and ca.shape == cb.shape, n
        if "_exps" in n:
            assert ca.sum() == cb.sum(), n
        else:
            assert np.array_equal(ca, cb), n


def flipped_choices(a, b, layers) -> int:
    """Routing choices that differ in these layers: each moves one (token, slot) pair from one expert to another."""
    total = 0
    for il in layers:
        n = f"blk.{il}.ffn_gate_exps.weight"
        if n in b.names:
            total += int(np.abs(a.raw(n)[1] - b.raw(n)[1]).sum()) // 2
    return total


def sums_where_counts_agree(a, b, names):
    rel, pairs, same_pairs = [], 0, 0
    for n in names:
        (sa, ca), (sb, cb) = a.raw(n), b.raw(n)
        same = ca == cb
        pairs, same_pairs = pairs + same.size, same_pairs + int(same.sum())
        rel.append(relative(sa[same], sb[same]).ravel())
    return np.concatenate(rel), same_pairs / pairs


def test_f32_without_flash_attention_is_llama_imatrix_s(models, text, tmp_path):
    a, b = pair(models, "f32", text, tmp_path, "-fa", "off")
    check_structure(a, b)
    rel, same = sums_where_counts_agree(a, b, b.names)
    assert same >= 0.99
    assert np.mean(rel <= 1e-3) >= 0.99 and rel.max() <= 2e-2, (np.mean(rel <= 1e-3), rel.max())
    assert np.median(rel) <= 1e-5


def test_f32_with_llama_imatrix_s_defaults(models, text, tmp_path):
    a, b = pair(models, "f32", text, tmp_path)
    check_structure(a, b)
    before_mla = [n for n in b.names if int(n.split(".")[1]) < FIRST_MLA]
    rel, _ = sums_where_counts_agree(a, b, before_mla)
    assert flipped_choices(a, b, range(FIRST_MLA)) <= 1                  # measured 0
    assert np.mean(rel <= 1e-4) >= 0.99 and np.median(rel) <= 1e-5, (np.mean(rel <= 1e-4), np.median(rel))
    rel, _ = sums_where_counts_agree(a, b, b.names)
    assert np.mean(rel <= 2e-2) >= 0.999


@pytest.mark.parametrize("name", ["bf16", "mxfp4"])
def test_rounded_activations_agree_until_the_rounding_feeds_back(models, text, tmp_path, name):
    a, b = pair(models, name, text, tmp_path)
    check_structure(a, b)
    layer0 = [n for n in b.names if n.startswith("blk.0.")]
    rel, _ = sums_where_counts_agree(a, b, layer0)
    assert rel.max() <= 1e-4, rel.max()
    # the first MoE layer routes as llama.cpp does, but for a near tie that float order may tip (measured: none;
    # tipped by a 1e-6 perturbation of the embeddings, 4-6 of its 8,192 choices)
    assert flipped_choices(a, b, [1]) <= 2
    rel, _ = sums_where_counts_agree(a, b, b.names)
    assert np.mean(rel <= 2e-2) >= 0.9 and np.median(rel) <= 1e-3         # measured 0.95-0.98, 2e-4-4e-4


def agreement(a, b) -> tuple[float, float]:
    """(share of the expert counts that are equal, share of all in_sum2 entries within 1e-3 relative): issue 26's
    two measures of equality."""
    counts, rel = [], []
    for n in b.names:
        (sa, ca), (sb, cb) = a.raw(n), b.raw(n)
        if "_exps" in n:
            counts.append((ca == cb).ravel())
        rel.append(relative(sa, sb).ravel())
    return float(np.mean(np.concatenate(counts))), float(np.mean(np.concatenate(rel) <= 1e-3))


@pytest.fixture(scope="module")
def trained_models(tmp_path_factory):
    """The trained K3 (fixtures/trained.py: routers with real margins), with its MXFP4 experts and with them
    widened to BF16 (a checkpoint of its own, converted), and its training text."""
    from dataclasses import replace
    from kimi_convert.fixtures import trained
    from kimi_convert.fixtures.make_checkpoint import dequant_mxfp4
    d = tmp_path_factory.mktemp("trained")
    values = trained.load_shipped("k3")
    widened = {}
    for k, v in values.items():
        if k.endswith(".weight_packed"):
            widened[k[:-len("_packed")]] = dequant_mxfp4(v, values[k[:-len("packed")] + "scale"])
        elif not k.endswith(".weight_scale"):
            widened[k] = v
    spec = replace(trained.fixture_spec("k3"), experts_mxfp4=False)
    hf_bf16 = make_checkpoint(d / "hf-bf16", spec, values=widened, tokenizer_corpus=trained.tokenizer_corpus())
    out = {"bf16": d / "bf16.gguf", "mxfp4": d / "mxfp4.gguf"}
    convert(build_plan(hf_bf16, "bf16"), out["bf16"])
    convert(build_plan(trained.write(d / "hf-mxfp4", "k3"), "bf16"), out["mxfp4"])
    text = d / "train.txt"
    text.write_text(trained.read_text("train"))
    return out, text


@pytest.mark.parametrize("name", ["bf16", "mxfp4"])
def test_rounded_activations_are_as_close_to_llama_imatrix_as_it_is_to_itself(trained_models, tmp_path, name):
    """With rounded activations, llama-imatrix's own two attention paths (flash attention on, its default, and
    off) disagree about as much as we disagree with it: a routing choice near a tie tips with float order, and
    tips the tokens after it. Measured on the trained K3 (docs/verification.md): BF16 llama on/off 79.2% of the
    expert counts equal and 70.3% of in_sum2 within 1e-3, ours/llama 77.1% and 68.9%; MXFP4 62.5% / 49.7%
    against 62.5% / 52.5%; F32 100% for all. So we hold ours/llama to llama's own on/off distance, less 5 points
    (the spread of 288 counts between runs of the two tools on one file). On the random-weight fixture, whose
    routers are near ties everywhere, the rounding feeds back from the first layer and ours is further:
    25-33% of the counts equal against llama's own 46-48% (test_rounded_activations_agree_until_...)."""
    models, text = trained_models
    ours, default = pair(models, name, text, tmp_path)
    off = tmp_path / "theirs-fa-off.gguf"
    llama_imatrix(models[name], text, off, ctx=CTX, chunks=CHUNKS, threads=2, batch=2048, extra=["-fa", "off"])
    self_counts, self_sums = agreement(load_imatrix(off), default)
    our_counts, our_sums = agreement(ours, default)
    assert our_counts >= self_counts - 0.05 and our_sums >= self_sums - 0.05, \
        (our_counts, self_counts, our_sums, self_sums)
    assert self_counts < 0.99 or self_sums < 0.99        # llama.cpp itself misses issue 26's 99% here


def test_llama_imatrix_adds_our_file_as_its_own(models, text, tmp_path):
    ours = kimi_imatrix(models["mxfp4"], text, tmp_path / "ours.gguf")
    both = tmp_path / "both.gguf"
    llama_imatrix(models["mxfp4"], None, both, ctx=CTX, in_files=[ours, ours])
    a, b = load_imatrix(ours), load_imatrix(both)
    assert b.names == a.names and b.chunk_count == 2 * CHUNKS
    for n in a.names:
        assert np.array_equal(b.raw(n)[0], 2 * a.raw(n)[0]) and np.array_equal(b.raw(n)[1], 2 * a.raw(n)[1]), n


WIDE = dict(n_layers=8, hidden=256, moe_intermediate_size=256, routed_expert_hidden_size=256, intermediate_size=256,
            num_experts=8, num_experts_per_token=2, num_shared_experts=1, seed=3, experts_mxfp4=False)


@pytest.mark.parametrize("ftype", ["Q4_K_M", "IQ2_XXS"])
def test_llama_quantize_and_kimi_quantize_write_the_same_file_from_our_matrix(tmp_path, text, ftype):
    """Rows of 256, so that the i-quants do not fall back; --process-output, since IQ2_XXS needs output's entry."""
    hf = make_checkpoint(tmp_path / "Kimi-K3-wide", arch="k3", **WIDE)
    src = tmp_path / "k3.gguf"
    convert(build_plan(hf, "bf16"), src)
    im = kimi_imatrix(src, text, tmp_path / "im.gguf", "--process-output")
    ours = quantize_file(src, tmp_path / "ours.gguf", load_policy(ftype), imatrix=load_imatrix(im))
    theirs = tmp_path / "theirs.gguf"
    llama_quantize(src, theirs, ftype, imatrix=im, threads=2)
    assert_same_file(ours.paths[0], theirs)          # every key (quantize.imatrix.* too) and every byte
