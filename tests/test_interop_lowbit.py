"""kimi-quantize's IQ2_XXS and IQ1_M K3 files in the pinned llama.cpp, position by position, against our runtime,
and through kimi-verify (issue 17 §4).

One K3 fixture (BF16 experts, rows multiples of 256), converted to BF16 and quantized with an imatrix by
`kimi-quantize --policy IQ2_XXS` / `IQ1_M` (llama-quantize's stock mixtures: IQ2_XXS / IQ1_M matrices, Q2_K
token_embd and first ffn_down, Q4_K attn_v, Q5_K output, IQ4_NL / F16 shape fallbacks). Each file is first shown
to be, tensor for tensor and byte for byte, the file llama.cpp's own llama_model_quantize writes with the same
imatrix. Bounds as tests/test_interop_quantized.py (docs/verification.md §8.4): every f32 matmul input within 1e-5
of llama.cpp's, tie breaks adopted, then logits within 1e-4 at every position and bit for bit at half of them at
least. kimi-verify must pass both files, alone and against the checkpoint with the imatrix, every quantized block
recomputed byte for byte; without the imatrix, the IQ1_S/IQ2_XXS/IQ2_XS tensors (ggml makes them only with one)
are said to be not checked, never a pass. A third file holds MXFP4 made
from float wherever llama-quantize puts a type (token_embd, output, every matrix, the experts), to show that the
runtime runs MXFP4 everywhere, not only as the checkpoint's experts.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from test_interop_quantized import PROMPT, ROUNDED_BOUND, SIZES, compare_with_tie_breaks, repacked_here, table
from typer.testing import CliRunner

from kimi_convert.convert.converter import build_plan, convert
from kimi_convert.fixtures.imatrix import k3_entries, write_gguf_imatrix
from kimi_convert.fixtures.make_checkpoint import make_checkpoint
from kimi_convert.gguf_io import open_gguf
from kimi_interop import llama_quantize
from kimi_convert.quant.imatrix import load_imatrix
from kimi_convert.runtime.forward import Runtime
from kimi_convert.verify.check import verify
from kimi_convert.cli.verify import app
from kimi_convert.quant.driver import quantize_file
from kimi_convert.quant.policy import load_policy
from test_quantize import IMATRIX_KEYS, assert_same_file

pytestmark = pytest.mark.interop      # needs the llama.cpp builds (.ci/install-interop.sh)

MIXTURES = {"IQ2_XXS": QT.IQ2_XXS, "IQ1_M": QT.IQ1_M}
N = 12                                # kimi-verify's tokens, as tests/test_verify_quantized.py


@pytest.fixture(scope="module")
def lowbit(tmp_path_factory):
    """(checkpoint, imatrix file, {mixture: kimi-quantize's file}, {mixture: llama-quantize's file}), made once."""
    d = tmp_path_factory.mktemp("interop-lowbit")
    import llama_cpp        # imported here: `pytest -m "not interop"` collects this file without it
    hf = make_checkpoint(d / "Kimi-K3", arch="k3", experts_mxfp4=False, **SIZES)
    src = d / "k3-bf16.gguf"
    convert(build_plan(hf, "bf16"), src)
    gf = open_gguf(src)
    imatrix = write_gguf_imatrix(d / "calib.imatrix.gguf", k3_entries({n: t.shape for n, t in gf.tensors.items()},
                                                                      seed=5), chunk_count=12)
    im = load_imatrix(imatrix)
    vectors = {n: v for n in im.names if (v := im.vector(n, gf.tensors[n].shape)) is not None}
    theirs = {name: llama_quantize(src, d / f"llama-{name}.gguf", getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}"),
                                   pure=False, imatrix=vectors) for name in MIXTURES}
    files = {name: quantize_file(src, d / f"k3-{name}.gguf", load_policy(name), imatrix=im).paths[0]
             for name in MIXTURES}
    files["MXFP4"] = llama_quantize(src, d / "k3-MXFP4.gguf", llama_cpp.LLAMA_FTYPE_MOSTLY_MXFP4_MOE, pure=False,
                                    tensor_types=[(".*", int(QT.MXFP4))])
    return hf, imatrix, files, theirs


@pytest.mark.parametrize("name", MIXTURES)
def test_kimi_quantize_lowbit_is_llama_quantizes_file(lowbit, name):
    """The whole file: every tensor's type, shape and bytes, every key but the imatrix's provenance."""
    _, _, files, theirs = lowbit
    assert_same_file(files[name], theirs[name], key_differences=IMATRIX_KEYS)


def types_of(path) -> set[QT]:
    return {t.qtype for t in open_gguf(path).tensors.values()}


@pytest.mark.parametrize("name", MIXTURES)
def test_llama_cpp_lowbit_matches_emulation(lowbit, name):
    _, _, files, _ = lowbit
    path = files[name]
    assert MIXTURES[name] in types_of(path)
    theirs, rt, ties, delta = compare_with_tie_breaks(path, PROMPT)
    assert theirs.repacked == repacked_here(rt, theirs.inputs)        # here: the Q4_K attn_v only
    assert delta.max() <= ROUNDED_BOUND, table(delta)
    assert np.count_nonzero(delta == 0) >= len(PROMPT) // 2, table(delta)
    # the grid-typed experts ran both mul_mat_id kernels: tiled (>= 8 rows to an expert) and vec_dot (fewer)
    rows = np.concatenate([np.bincount(sel.ravel(), minlength=rt.cfg.n_expert)
                           for sel in rt.routing_margins.experts.values()])
    assert (rows >= 8).any() and ((rows > 0) & (rows < 8)).any(), rows
    print(f"{path.name} ({'/'.join(sorted(t.name for t in types_of(path)))}): {ties.count('code')} code and "
          f"{ties.count('scale')} scale tie breaks in {ties.n_rounded} rounded inputs; per position: {table(delta)}")
    plain = np.abs(Runtime(path).logits(PROMPT) - theirs.logits).max(1)     # without the emulation: whole units
    assert np.median(plain) > 100 * ROUNDED_BOUND


def test_llama_cpp_mxfp4_from_float_everywhere(lowbit):
    """MXFP4 as token_embd (get_rows), as 2-D weights repacked (ne[1] % 8 = 0) and not (ssm_beta's 4 rows: the
    paired vec_dot for every row count), as output and as experts made from BF16: bit for bit at every position."""
    path = lowbit[2]["MXFP4"]
    tensors = open_gguf(path).tensors
    mxfp4 = {n for n, t in tensors.items() if t.qtype == QT.MXFP4}
    assert {"token_embd.weight", "output.weight", "blk.0.ssm_beta.weight", "blk.1.ffn_up_exps.weight"} <= mxfp4
    theirs, rt, _, delta = compare_with_tie_breaks(path, PROMPT)
    assert theirs.repacked == repacked_here(rt, theirs.inputs) and "blk.0.ssm_beta.weight" not in theirs.repacked
    assert np.all(delta == 0), table(delta)


def test_llama_cpp_lowbit_short_batch(lowbit):
    """5 rows: the grid i-quants' vec_dot instead of the tiled kernel for every dense weight."""
    _, _, _, delta = compare_with_tie_breaks(lowbit[2]["IQ1_M"], PROMPT[:5])     # kimi-quantize's file
    assert np.all(delta == 0), table(delta)


@pytest.mark.parametrize("maker", ["ours", "llama"])
@pytest.mark.parametrize("name", MIXTURES)
def test_kimi_verify_recomputes_lowbit_files(lowbit, tmp_path, name, maker):
    hf, imatrix, files, theirs = lowbit
    path = (files if maker == "ours" else theirs)[name]
    report = verify(path, hf, length=N, imatrix=imatrix)
    assert report.ok, {p.key: p.failures for p in report.parts if p.ok is False}
    tensors = report.part("tensors").figures
    assert not tensors["unchecked"] and tensors["matched"] == tensors["total"]     # every block recomputed
    quantized = {QT[r["type"]] for r in report.part("tensors").rows if r.get("mode") == "quantized"}
    assert MIXTURES[name] in quantized and not tensors["mismatched"]
    assert report.tolerance["reference"] == "file" and report.part("logits").ok     # run on the file's weights

    res = CliRunner().invoke(app, ["check", str(path), "--json", str(tmp_path / "lone.json")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "lone.json").read_text())["ok"]


def test_kimi_verify_without_the_imatrix_does_not_pass_what_it_cannot_recompute(lowbit):
    """IQ2_XXS exists only with an imatrix (ggml asserts one): without it those tensors are not checked, and the
    report says why; never a pass for them."""
    hf, _, files, _ = lowbit
    report = verify(files["IQ2_XXS"], hf, length=N)
    tensors = report.part("tensors").figures
    assert "IQ2_XXS" in tensors["unchecked_types"]
    assert any("ggml quantizes IQ2_XXS only with an imatrix" in n for n in report.notes), report.notes
