"""A NaN or an infinity in a weight, quantized to a type whose ggml quantizer aborts the process on one (IQ2_XS,
IQ2_S, IQ3_XXS, IQ3_S: no grid point found), is refused with one line naming the file, the tensor, the row (the
expert) and the column, and no output left behind. Every other type writes ggml's bytes for such a value, as
llama-quantize does (its validation then refuses what has a NaN or infinite scale): tests/test_quant_kernels.py
compares those bytes, and IQ1_S, IQ1_M and IQ2_XXS, which ggml writes, are compared here."""
from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from kimi_convert.fixtures.imatrix import k3_entries, write_gguf_imatrix
from kimi_convert.fixtures.make_checkpoint import make_checkpoint
from kimi_convert.gguf_io import open_gguf
from kimi_convert.quant import quantize
from kimi_convert.quant.blocks import NonFiniteError, block_type, supported_types
from kimi_interop.ggml_quants import ggml_quantize
from test_convert_errors import assert_fails_cleanly, run_cli
from test_quantize_cli import quantize as quantize_cli

BF16_NAN, BF16_INF, BF16_NEG_INF = 0x7FC0, 0x7F80, 0xFF80
ABORTING = (QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS, QT.IQ3_S)
WRITTEN = (QT.IQ1_S, QT.IQ1_M, QT.IQ2_XXS)
VALUES = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}


def rows(n_rows: int = 4, n: int = 512, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n_rows, n)).astype(np.float32)


def weights(n: int = 512) -> np.ndarray:
    return np.random.default_rng(9).uniform(0.1, 2.0, n).astype(np.float32)


def test_the_refusing_types_are_those_ggml_aborts_on():
    assert sorted(t for t in supported_types() if block_type(t).refuses_nonfinite) == sorted(ABORTING)


GGML_CHILD = """
import sys
import numpy as np
from gguf import GGMLQuantizationType as QT
from kimi_interop.ggml_quants import ggml_quantize
x = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32)
x[2, 300] = float(sys.argv[2])
ggml_quantize(x, QT[sys.argv[1]], np.random.default_rng(9).uniform(0.1, 2.0, 512).astype(np.float32))
"""


@pytest.mark.interop       # the child runs ggml's own quantizer (kimi_interop.ggml_quants)
@pytest.mark.parametrize("qtype", ABORTING, ids=lambda t: t.name)
@pytest.mark.parametrize("bad", VALUES)
def test_ggml_aborts_and_we_refuse_naming_row_and_column(qtype, bad):
    child = subprocess.run([sys.executable, "-c", GGML_CHILD, qtype.name, bad], capture_output=True, timeout=120)
    assert child.returncode < 0 or child.returncode == 134, child.returncode     # SIGABRT: GGML_ASSERT
    x = rows()
    x[2, 300] = VALUES[bad]
    with pytest.raises(NonFiniteError) as err:
        quantize(x, qtype, weights(), threads=2)
    assert (err.value.row, err.value.column, err.value.count, err.value.what) == (2, 300, 1, bad)


@pytest.mark.interop
@pytest.mark.parametrize("qtype", WRITTEN, ids=lambda t: t.name)
@pytest.mark.parametrize("bad", VALUES)
def test_types_ggml_writes_on_a_non_finite_value_are_its_bytes(qtype, bad):
    x = rows()
    x[2, 300] = VALUES[bad]
    assert quantize(x, qtype, weights(), threads=2).tobytes() == np.asarray(ggml_quantize(x, qtype, weights())).tobytes()


@pytest.mark.parametrize("bits,what", [(BF16_NAN, "nan"), (BF16_INF, "inf"), (BF16_NEG_INF, "-inf"),
                                       (0x7F81, "nan"), (0xFFFF, "nan")])
def test_bf16_rows_are_checked_as_they_are_widened(bits, what):
    x = (np.frombuffer(rows(8, 1024).tobytes(), np.uint32) >> 16).astype(np.uint16).reshape(8, 1024)
    x[5, 7] = x[6, 1000] = bits
    with pytest.raises(NonFiniteError) as err:
        quantize(x, QT.IQ3_S, threads=1, source=QT.BF16)
    assert (err.value.row, err.value.column, err.value.what, err.value.count) == (5, 7, what, 2)


def test_finite_extremes_are_quantized_not_refused():
    x = rows(4, 256)
    x[0, :4] = [np.finfo(np.float32).max / 4, -np.finfo(np.float32).max / 4, np.finfo(np.float32).tiny / 8, -0.0]
    bf = (np.frombuffer(rows(4, 256).tobytes(), np.uint32) >> 16).astype(np.uint16).reshape(4, 256)
    bf[0, :4] = [0x7F7F, 0xFF7F, 0x0001, 0x8000]        # the largest BF16 either way, a subnormal, -0.0
    for qtype in ABORTING:
        assert quantize(x, qtype, weights(256), threads=2).shape[0] == 4
        assert quantize(bf, qtype, weights(256), threads=2, source=QT.BF16).shape[0] == 4


@pytest.fixture(scope="module")
def bf16_experts(tmp_path_factory):
    """A tiny K3 with BF16 routed experts of rows of 256, converted: (checkpoint, GGUF)."""
    from kimi_convert.convert.converter import build_plan, convert
    hf = make_checkpoint(tmp_path_factory.mktemp("nf") / "Kimi-K3-bf16-experts", arch="k3", experts_mxfp4=False,
                         moe_intermediate_size=256, routed_expert_hidden_size=256)   # expert rows the grids fit
    out = hf.parent / "k3-bf16.gguf"
    convert(build_plan(hf, "bf16"), out)
    return hf, out


def poke_gguf(src, dst, name: str, index: int, bits: int):
    shutil.copyfile(src, dst)
    t = open_gguf(dst).tensors[name]
    assert t.qtype == QT.BF16
    with open(dst, "r+b") as f:
        f.seek(t.offset + 2 * index)
        f.write(struct.pack("<H", bits))
    return t.shape


@pytest.mark.parametrize("name,policy,where,bits", [
    ("blk.1.ffn_down_exps.weight", "IQ3_S", "expert 3, row 5, column 17 is nan", BF16_NAN),
    ("blk.1.ffn_down_exps.weight", "IQ3_S", "expert 0, row 2, column 9 is -inf", BF16_NEG_INF),
])
def test_kimi_quantize_names_file_tensor_row_and_column(bf16_experts, tmp_path, name, policy, where, bits):
    bad = tmp_path / "in" / "bad.gguf"
    bad.parent.mkdir()
    shape = open_gguf(bf16_experts[1]).tensors[name].shape
    expert, row, column = (int(w) for w in where.replace(",", "").split()[1:6:2])
    poke_gguf(bf16_experts[1], bad, name, (expert * shape[-2] + row) * shape[-1] + column, bits)
    out = tmp_path / "out"
    out.mkdir()
    rules = tmp_path / "policy.toml"
    rules.write_text(f'default = "{policy}"\n')
    r = quantize_cli("--policy", rules, bad, out / "q.gguf")
    assert_fails_cleanly(out, r, f"{bad}: {name}: {where}", "non-finite", "llama-quantize aborts")


def test_kimi_quantize_with_an_imatrix_refuses_an_iq_type_on_inf(bf16_experts, tmp_path):
    """IQ2_XS with an imatrix, where ggml_quantize_chunk aborts the process on the same row."""
    name = "blk.1.ffn_down_exps.weight"
    bad = tmp_path / "bad.gguf"
    shape = poke_gguf(bf16_experts[1], bad, name, 7 * 2 + 1, BF16_INF)
    imatrix = write_gguf_imatrix(tmp_path / "k3.imatrix.gguf",
                                 k3_entries({n: t.shape for n, t in open_gguf(bad).tensors.items()}, seed=2))
    out = tmp_path / "out"
    out.mkdir()
    r = quantize_cli("--policy", "IQ2_XS", bad, out / "q.gguf", "--imatrix", imatrix, "--tensor-type",
                     "token_embd|output=q8_0")
    assert len(shape) == 3
    assert_fails_cleanly(out, r, str(bad), name, "expert 0, row 0, column 15 is inf")


def test_kimi_convert_one_pass_names_the_tensor(bf16_experts, tmp_path):
    """The same refusal in kimi-convert --policy's one pass, for a NaN in a checkpoint shard."""
    hf = tmp_path / "hf"
    shutil.copytree(bf16_experts[0], hf)
    name = "language_model.model.layers.1.block_sparse_moe.experts.2.w2.weight"        # down_proj: rows of 256
    shard = hf / json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"][name]
    with open(shard, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        entry = json.loads(f.read(n))[name]
        assert entry["dtype"] == "BF16"
        f.seek(8 + n + entry["data_offsets"][0] + 2 * (4 * entry["shape"][1] + 6))
        f.write(struct.pack("<H", BF16_NAN))
    out = tmp_path / "out"
    out.mkdir()
    rules = tmp_path / "policy.toml"
    rules.write_text('default = "IQ3_S"\n')
    r = run_cli(str(hf), str(out / "q.gguf"), "--policy", str(rules))
    assert_fails_cleanly(out, r, f"{shard}: {name}: blk.1.ffn_down_exps.weight: expert 2, row 4, column 6 is nan",
                         "non-finite")
