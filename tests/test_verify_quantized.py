"""kimi-verify on quantized files (issue 7 §8): every quantized tensor must be, byte for byte, our quantization
of its HF source (with the imatrix the file was made with), the runtime must match the reference run on the
file's dequantized weights within the F32 tolerance, and what quantization costs is reported (a gate with
--max-kl). Files from kimi-quantize and from llama-quantize's own code (llama_model_quantize, in process)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

from kimi_convert.convert.converter import build_plan, convert
from kimi_convert.fixtures.imatrix import k3_entries, write_gguf_imatrix
from kimi_convert.fixtures.make_checkpoint import make_checkpoint
from kimi_convert.gguf_io import open_gguf
from kimi_interop import llama_quantize
from kimi_convert.quant.driver import FILE_TYPE, quantize_file
from kimi_convert.quant.imatrix import load_imatrix
from kimi_convert.quant.plan import PlanOptions
from kimi_convert.quant.policy import parse_policy
from kimi_convert.verify.check import TOLERANCES, Part, check_tensors, verify
from kimi_convert.cli.verify import app

N = 12                      # tokens: every part runs, the file stays fast
QUANTIZED_F32 = TOLERANCES["quantized"]


def failures(report) -> dict:
    return {p.key: p.failures for p in report.parts if p.ok is False}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("verify-quantized")


@pytest.fixture(scope="module")
def hf(work) -> Path:
    """K3 with rows that are multiples of 256 (K- and IQ-quants apply; KDA head rows of 16 still take the
    shape fallback) and BF16 experts (quantized like any matrix)."""
    return make_checkpoint(work / "Kimi-K3-q", arch="k3", n_layers=4, experts_mxfp4=False, hidden=256,
                           moe_intermediate_size=256, routed_expert_hidden_size=256, intermediate_size=512, seed=3)


@pytest.fixture(scope="module")
def bf16(work, hf) -> Path:
    out = work / "k3-bf16.gguf"
    convert(build_plan(hf, "bf16"), out)
    return out


@pytest.fixture(scope="module")
def imatrices(work, bf16) -> dict[str, Path]:
    shapes = {n: t.shape for n, t in open_gguf(bf16).tensors.items()}
    return {name: write_gguf_imatrix(work / f"{name}.imatrix.gguf", k3_entries(shapes, seed=seed), chunk_count=12)
            for name, seed in (("calib", 5), ("other", 6))}


@pytest.fixture(scope="module")
def ours(work, bf16, imatrices):
    """(type, with the imatrix) -> kimi-quantize's output with `default = TYPE`, made once."""
    made: dict[tuple[str, bool], Path] = {}

    def get(name: str, with_imatrix: bool) -> Path:
        if (name, with_imatrix) not in made:
            out = work / f"ours-{name}{'-imatrix' if with_imatrix else ''}.gguf"
            imatrix = load_imatrix(imatrices["calib"]) if with_imatrix else None
            made[name, with_imatrix] = quantize_file(bf16, out, parse_policy(f'default = "{name}"\n', "test.toml"),
                                                     imatrix=imatrix).paths[0]
        return made[name, with_imatrix]
    return get


@pytest.fixture(scope="module")
def theirs(work, bf16, imatrices):
    """(with the imatrix) -> llama-quantize's Q4_K_M (its own type mix: Q4_K, Q6_K, Q5_0 fallbacks, ...)."""
    made: dict[bool, Path] = {}

    def get(with_imatrix: bool) -> Path:
        if with_imatrix not in made:
            vectors = None
            if with_imatrix:
                im, gf = load_imatrix(imatrices["calib"]), open_gguf(bf16)
                vectors = {n: v for n in im.names if (v := im.vector(n, gf.tensors[n].shape)) is not None}
            out = work / f"llama-Q4_K_M{'-imatrix' if with_imatrix else ''}.gguf"
            made[with_imatrix] = llama_quantize(bf16, out, int(FILE_TYPE[QT.Q4_K]), pure=False, imatrix=vectors)
        return made[with_imatrix]
    return get


def assert_passes_for_the_right_reason(report, n_quantized: int):
    """Every part passes; the quantized tensors were recomputed byte for byte; the logits agree per position
    within the F32 bounds although quantization moved them by far more than that (the cost part): the
    reference really ran on the file's weights."""
    assert report.ok, failures(report)
    assert report.tolerance["file_class"] == "quantized" and report.tolerance["reference"] == "file"
    t = report.part("tensors").figures
    assert t["matched"] == t["total"] and t["by_mode"]["quantized"] == n_quantized > 0
    logits, cost = report.part("logits").figures, report.part("cost").figures
    assert logits["judged"] == N and logits["kl_max"] <= QUANTIZED_F32.kl_max
    assert cost["kl_mean"] > 1e4 * QUANTIZED_F32.kl_max


def n_quantized(path: Path) -> int:
    """Tensors in a type the converter does not write (F16 fallbacks included) in files quantized from its
    BF16 output; MXFP4 (here only the copied experts of an MXFP4 checkpoint) is not counted."""
    return sum(t.qtype not in (QT.F32, QT.BF16, QT.MXFP4) for t in open_gguf(path).tensors.values())


# ------------------------------------------------------------------------------------
# quantized files pass, ours and llama-quantize's

@pytest.mark.parametrize("with_imatrix", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "IQ4_XS"])
def test_our_quantizations_pass(hf, ours, imatrices, name, with_imatrix):
    q = ours(name, with_imatrix)
    report = verify(q, hf, length=N, imatrix=imatrices["calib"] if with_imatrix else None)
    assert_passes_for_the_right_reason(report, n_quantized(q))
    rows = [r for r in report.part("tensors").rows if r["mode"] == "quantized"]
    # the imatrix was used for every tensor it has an entry for (llama-imatrix collects the blk.* matrices)
    # whose type takes one (Q8_0 ignores it, as ggml's quantize_q8_0 does)
    assert all(r["imatrix"] == (with_imatrix and r["uses_imatrix"] and r["tensor"].startswith("blk."))
               for r in rows)
    assert {r["type"] for r in rows} >= {name}


@pytest.mark.interop
@pytest.mark.parametrize("with_imatrix", [False, True], ids=["plain", "imatrix"])
def test_llama_quantize_outputs_pass(hf, theirs, imatrices, tmp_path, with_imatrix):
    q = theirs(with_imatrix)
    assert {QT.Q4_K, QT.Q6_K} <= {t.qtype for t in open_gguf(q).tensors.values()}
    args = ["check", str(hf), str(q), "--length", str(N), "--json", str(tmp_path / "r.json")]
    res = CliRunner().invoke(app, args + (["--imatrix", str(imatrices["calib"])] if with_imatrix else []))
    assert res.exit_code == 0, res.output
    assert "the reference runs on the file's dequantized weights" in res.output
    parts = {p["key"]: p for p in json.loads((tmp_path / "r.json").read_text())["parts"]}
    assert parts["tensors"]["figures"]["by_mode"]["quantized"] == n_quantized(q)
    assert parts["cost"]["ok"] is None and parts["cost"]["info"] and parts["cost"]["figures"]["kl_mean"] > 0


@pytest.mark.parametrize("requantize", [False, True], ids=["experts-copied", "experts-requantized"])
def test_k31_with_mxfp4_experts_and_protected_indexer_passes(tmp_path, requantize):
    """K3.1, the rest Q4_K, the indexer keeping its type: MXFP4 experts copied (a lossless repack, judged
    bit-exact), or re-quantized with --allow-requantize (recomputed from the decoded MXFP4, and handed to
    the reference under their weight_packed names); the K3.1 part compares runtime and reference (on the
    file's weights) at top_k < T."""
    hf = make_checkpoint(tmp_path / "Kimi-K3.1-q", arch="k31", n_layers=4, hidden=256, q_lora_rank=256, seed=6)
    src = tmp_path / "k31-bf16.gguf"
    convert(build_plan(hf, "bf16"), src)
    q = quantize_file(src, tmp_path / "k31-Q4_K.gguf", parse_policy('default = "Q4_K"\n', "test.toml"),
                      PlanOptions(allow_requantize=requantize)).paths[0]
    report = verify(q, hf, length=N)
    assert_passes_for_the_right_reason(report, n_quantized(q))
    assert report.part("k31").ok
    rows = {r["tensor"]: r for r in report.part("tensors").rows}
    experts = rows["blk.3.ffn_up_exps.weight"]
    assert (experts["type"] != "MXFP4", experts["mode"]) == ((True, "quantized") if requantize else (False, "exact"))
    assert (rows["blk.3.indexer.attn_k.weight"]["type"], rows["blk.3.indexer.attn_k.weight"]["mode"]) == ("BF16", "exact")


def f32_checkpoint(hf: Path, out: Path) -> Path:
    """hf with every BF16 tensor widened to F32 and moved off the BF16 grid (x (1 + 1e-3 noise)), so that
    converting it to BF16 rounds and to F32 does not."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    shutil.copytree(hf, out)
    noise = torch.Generator().manual_seed(0)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(out / shard), "pt") as f:
            meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
        for k, t in tensors.items():
            if t.dtype == torch.bfloat16:
                tensors[k] = t.float() * (1 + 1e-3 * torch.randn(t.shape, generator=noise))
        save_file(tensors, str(out / shard), metadata=meta)
    index["metadata"]["total_size"] = sum((out / s).stat().st_size for s in set(index["weight_map"].values()))
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


@pytest.mark.parametrize("outtype", ["bf16", "f32"])
def test_an_f32_checkpoint_is_quantized_from_the_values_the_converter_wrote(tmp_path, hf, outtype):
    """From an F32 checkpoint, `kimi-convert --outtype bf16` rounds before kimi-quantize quantizes, --outtype
    f32 does not: both files pass, each recomputed from its own conversion (and the F16 fallback of the
    rows of 16 rounds the BF16 values once more, as kimi-quantize does)."""
    f32_hf = f32_checkpoint(hf, tmp_path / "Kimi-K3-f32")
    converted = tmp_path / f"{outtype}.gguf"
    convert(build_plan(f32_hf, outtype), converted)
    q = quantize_file(converted, tmp_path / "q.gguf", parse_policy('default = "Q4_K"\n', "test.toml")).paths[0]
    part = check_tensors(Part("tensors", "t"), build_plan(f32_hf, "f32"), open_gguf(q), lambda s: None)
    assert part.ok, part.failures[:3]
    rows = [r for r in part.rows if r["mode"] == "quantized"]
    assert {r["type"] for r in rows} >= {"Q4_K", "F16"}
    assert {r["converted_as"] for r in rows} == {outtype.upper()}


@pytest.mark.interop
def test_lone_check_passes_on_quantized_files(ours, theirs):
    for q in (ours("Q4_K", True), theirs(True)):
        report = verify(q, length=N)
        assert report.ok, failures(report)
        assert report.part("tensors").summary.endswith("valid blocks and finite values")


# ------------------------------------------------------------------------------------
# and fail, naming what is wrong

@pytest.mark.parametrize("name,with_imatrix,tensor,block", [
    ("Q4_K", True, "blk.1.ffn_up_exps.weight", 300),      # inside a stacked expert tensor, with an imatrix
    ("Q8_0", False, "output.weight", 1000),               # a Q8_0 block's quants
    ("IQ4_XS", True, "blk.3.attn_q_b.weight", 5),         # rows of 32: IQ4_NL, llama-quantize's fallback
])
def test_a_flipped_byte_in_a_quantized_block_is_named(tmp_path, hf, ours, imatrices, name, with_imatrix, tensor, block):
    src = ours(name, with_imatrix)
    t = open_gguf(src).tensors[tensor]
    assert t.qtype not in (QT.F32, QT.F16, QT.BF16)
    block_size, type_size = GGML_QUANT_SIZES[t.qtype]
    bad = tmp_path / "bad.gguf"
    shutil.copy(src, bad)
    with open(bad, "r+b") as f:                # a byte in the middle of block `block`
        f.seek(t.offset + block * type_size + type_size // 2)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 0x10]))
    imatrix = load_imatrix(imatrices["calib"]) if with_imatrix else None
    part = check_tensors(Part("tensors", "t"), build_plan(hf, "f32"), open_gguf(bad), lambda s: None, imatrix)
    assert part.figures["mismatched"] == [tensor]
    row, k = divmod(block, t.shape[-1] // block_size)
    assert len(part.failures) == 1 and part.failures[0].startswith(
        f"{tensor}: 1/{t.raw.size // type_size} {t.qtype.name} blocks differ from our quantization")
    assert f"first at row {row}, block {k}" in part.failures[0] and "imatrix differs" not in part.failures[0]


@pytest.mark.interop
@pytest.mark.parametrize("case", ["made with it, checked without", "made with it, checked with another",
                                  "made without, checked with one", "llama-quantize, checked without"])
def test_another_imatrix_fails_saying_the_imatrix_differs(hf, ours, theirs, imatrices, case):
    q, given = {
        "made with it, checked without": (ours("Q4_K", True), None),
        "made with it, checked with another": (ours("Q4_K", True), "other"),
        "made without, checked with one": (ours("Q4_K", False), "calib"),
        "llama-quantize, checked without": (theirs(True), None),     # records no quantize.imatrix.* keys
    }[case]
    imatrix = load_imatrix(imatrices[given]) if given else None
    part = check_tensors(Part("tensors", "t"), build_plan(hf, "f32"), open_gguf(q), lambda s: None, imatrix)
    assert part.ok is False
    assert part.failures[0].startswith("the imatrix differs"), part.failures[:2]
    # only tensors of types that use an imatrix differ; the Q8_0 / F32 / BF16 ones match
    rows = {r["tensor"]: r for r in part.rows}
    assert part.figures["mismatched"] and all(rows[n]["uses_imatrix"] for n in part.figures["mismatched"])
    if case == "made with it, checked without":
        assert "give it with --imatrix" in part.failures[0] and str(imatrices["calib"]) in part.failures[0]


def test_the_imatrix_message_reaches_the_command_line(hf, ours):
    res = CliRunner().invoke(app, ["check", str(hf), str(ours("IQ4_XS", True)), "--length", "4"],
                             env={"COLUMNS": "200"})
    assert res.exit_code == 1
    assert "the imatrix differs: the file was quantized with the imatrix" in res.output


def test_max_kl_is_a_gate(tmp_path, hf, ours):
    q = ours("Q8_0", False)
    res = CliRunner().invoke(app, ["check", str(hf), str(q), "--length", str(N), "--max-kl", "1e-4",
                                   "--json", str(tmp_path / "r.json")])
    report = json.loads((tmp_path / "r.json").read_text())
    cost = next(p for p in report["parts"] if p["key"] == "cost")
    kl = cost["figures"]["kl_mean"]
    assert res.exit_code == 1 and kl > 1e-4
    assert [p["key"] for p in report["parts"] if p["ok"] is False] == ["cost"]     # everything else passes
    assert cost["failures"] == [f"mean KL {kl:.3e} against the checkpoint is above --max-kl 0.0001"]
    report = verify(q, hf, length=N, max_kl=2 * kl)
    assert report.ok and report.part("cost").ok is True, failures(report)


def test_lone_check_catches_an_fp16_nan_scale(tmp_path, ours):
    src = ours("Q8_0", False)
    t = open_gguf(src).tensors["blk.1.attn_q.weight"]
    bad = tmp_path / "nan-scale.gguf"
    shutil.copy(src, bad)
    blocks_per_row, type_size = t.shape[-1] // 32, 34
    with open(bad, "r+b") as f:                # row 1, block 2: its fp16 d becomes a NaN
        f.seek(t.offset + (blocks_per_row + 2) * type_size)
        f.write(np.array([0x7E00], np.uint16).tobytes())
    report = verify(bad, length=4)
    assert [f for f in report.part("tensors").failures if f.startswith(t.name)] == [
        f"{t.name}: invalid Q8_0 data (as ggml_validate_row_data): nan scale at row 1, block 2"]
    assert report.part("forward").ok is False


def test_usage_errors_are_one_line(tmp_path, hf, ours):
    q = str(ours("Q8_0", False))
    garbage = tmp_path / "garbage.imatrix"
    garbage.write_bytes(b"\x01\x02")
    for args, says in ((["check", q, "--max-kl", "0.1"], "--max-kl needs the checkpoint"),
                       (["check", q, "--imatrix", str(garbage)], "--imatrix needs the checkpoint"),
                       (["check", str(hf), q, "--imatrix", str(garbage)], str(garbage)),
                       (["check", str(hf), q, "--max-kl", "-1"], "--max-kl -1.0: must be a number >= 0")):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 1 and res.output.startswith("error:") and says in res.output, res.output
        assert res.output.count("\n") == 1
