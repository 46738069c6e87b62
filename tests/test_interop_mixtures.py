"""kimi-quantize --policy FTYPE against llama-quantize's own code (llama_model_quantize, FTYPE, no --pure) on one K3
fixture with BF16 experts: every tensor byte for byte, its type and shape, and every key (general.file_type too),
for every file type whose types kimi-quantize writes today (and F16); with an imatrix for the file type that
requires one (Q2_K_S) and for one of each rule that depends on having one (Q4_0: Q4_1 with it; IQ4_XS: Q5_K
without it; Q5_0 and IQ4_NL take the same two branches), and for the grid i-quants' mixtures, which require one.

The fixture has 8 layers, so that n_layer/8 = 1 and the rules for "the first n/8 layers" fire (on blk.0's
ffn_down), use_more_bits picks layers 0, 2, 5, 7, and Q3_K_M's "first 2 attn_v" and Q4_K_S's "first 4" split the
six KDA layers. It is small otherwise (6.4 M values, 2 experts, 1 shared): n_expert == 8 and n_gqa() >= 4 would take
other branches, which tests/test_mixtures.py compares with llama.cpp's own type choice. Rows are multiples of
256 except the KDA and MLA head-sized ones, which take the shape fallback.
"""
from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as QT

from kimi_convert.convert.converter import build_plan, convert
from kimi_convert.fixtures.imatrix import k3_entries, write_gguf_imatrix
from kimi_convert.fixtures.make_checkpoint import make_checkpoint
from kimi_convert.gguf_io import open_gguf
from kimi_interop import llama_quantize
from kimi_convert.quant.driver import quantize_file
from kimi_convert.quant.imatrix import load_imatrix
from kimi_convert.quant.mixtures import FILE_TYPES
from kimi_convert.quant.policy import load_policy
from test_quantize import IMATRIX_KEYS, assert_same_file

pytestmark = pytest.mark.interop      # needs the llama.cpp builds (.ci/install-interop.sh)

SIZES = dict(n_layers=8, hidden=256, moe_intermediate_size=256, routed_expert_hidden_size=256, intermediate_size=256,
             num_experts=2, num_experts_per_token=1, num_shared_experts=1, seed=3)
WRITABLE = ["Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0",
            "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS", "F16", "TQ1_0", "TQ2_0"]
WITH_IMATRIX = ["Q2_K_S", "Q4_0", "IQ4_XS"]
# the grid i-quants' mixtures, which llama-quantize makes only with an imatrix (IQ2_XXS and IQ1_M, on a bigger
# fixture, are tests/test_interop_lowbit.py's). Three files hold every other grid type here: IQ1_S; IQ2_S's mixture
# (IQ2_XS, IQ3_S); IQ3_XXS's (IQ3_XXS, IQ2_S, IQ3_S). Which type each tensor of the other grid mixtures gets is
# tests/test_mixtures.py's comparison with llama.cpp's own type choice; the bytes of a type do not depend on it.
GRID_MIXTURES = {"IQ1_S": {QT.IQ1_S}, "IQ2_S": {QT.IQ2_XS, QT.IQ3_S}, "IQ3_XXS": {QT.IQ3_XXS, QT.IQ2_S, QT.IQ3_S}}


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    """(the BF16 GGUF, its imatrix file, the vectors llama-quantize is handed)."""
    d = tmp_path_factory.mktemp("mixtures")
    hf = make_checkpoint(d / "Kimi-K3-8", arch="k3", experts_mxfp4=False, **SIZES)
    src = d / "k3-bf16.gguf"
    convert(build_plan(hf, "bf16"), src)
    gf = open_gguf(src)
    path = write_gguf_imatrix(d / "k3.imatrix.gguf", k3_entries({n: t.shape for n, t in gf.tensors.items()}, seed=5),
                              chunk_count=12)
    imatrix = load_imatrix(path)
    vectors = {n: v for n in imatrix.names if (v := imatrix.vector(n, gf.tensors[n].shape)) is not None}
    return src, imatrix, vectors


@pytest.mark.parametrize("name", WRITABLE)
def test_mixture_equals_llama_quantize(k3, tmp_path, name):
    src, _, _ = k3
    ours = quantize_file(src, tmp_path / "ours.gguf", load_policy(name))
    theirs = llama_quantize(src, tmp_path / "theirs.gguf", FILE_TYPES[name].ftype, pure=False)
    assert_same_file(ours.paths[0], theirs)
    if FILE_TYPES[name].quantized:        # the mixture did more than its default (output Q6_K, at least)
        assert len({d.target for d in ours.plan.decisions if not d.copied}) > 1, name
    if name == "IQ4_XS":                  # no imatrix: blk.0's ffn_down (the first n/8 layers) Q5_K
        assert {d.name: d for d in ours.plan.decisions}["blk.0.ffn_down.weight"].target == QT.Q5_K


@pytest.mark.parametrize("name", WITH_IMATRIX)
def test_mixture_with_imatrix_equals_llama_quantize(k3, tmp_path, name):
    src, imatrix, vectors = k3
    ours = quantize_file(src, tmp_path / "ours.gguf", load_policy(name), imatrix=imatrix)
    theirs = llama_quantize(src, tmp_path / "theirs.gguf", FILE_TYPES[name].ftype, pure=False, imatrix=vectors)
    assert_same_file(ours.paths[0], theirs, key_differences=IMATRIX_KEYS)
    down = {d.name: d for d in ours.plan.decisions}["blk.0.ffn_down.weight"]
    # with an imatrix, Q4_0 gives blk.0's ffn_down Q4_1 and IQ4_XS leaves it at IQ4_XS (Q5_K without one, as the
    # test above compares); Q2_K_S gives it Q4_K either way
    assert down.target == {"Q2_K_S": QT.Q4_K, "Q4_0": QT.Q4_1, "IQ4_XS": QT.IQ4_XS}[name], down
    assert "layer 0 of 8 < n/8" in down.why or name == "IQ4_XS", down


@pytest.mark.parametrize("name", GRID_MIXTURES)
def test_grid_mixture_equals_llama_quantize(k3, tmp_path, name):
    src, imatrix, vectors = k3
    ours = quantize_file(src, tmp_path / "ours.gguf", load_policy(name), imatrix=imatrix)
    theirs = llama_quantize(src, tmp_path / "theirs.gguf", FILE_TYPES[name].ftype, pure=False, imatrix=vectors)
    assert_same_file(ours.paths[0], theirs, key_differences=IMATRIX_KEYS)
    assert GRID_MIXTURES[name] <= {d.target for d in ours.plan.decisions}, name
