"""The real model's exact size without its data: kimi_convert.fixtures.real_size, the converter's dry run on
it, and the converter's RAM estimate against measured peaks.

The expected figures are written out here from shared/reference/k3-hf-format.md (sections 1-5) and
k31-indexer.md, not taken from the generator, so each test compares two independent sources.
Run time on 2 cores: 4-6 minutes for the module at a load of 3-6 (others' jobs): generating the real-size
K3 and K3.1 checkpoints (20-35 s each), the data-less GGUF of the real K3 (20-30 s) and its 3.4 GB imatrix
(holes, 3 s), the plain dry run and one dry run per preset in subprocesses (12-35 s each), kimi-quantize's
plan of the GGUF per preset (4-16 s each: k3-q2 reads the whole imatrix, as the run does) and a
73,284-tensor conversion (20-60 s). Disk use: about 500 MB (the shards are holes); the imatrix's 3.4 GB of holes pass
through the page cache.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import safetensors

from kimi_convert.convert import mxfp4
from kimi_convert.convert.checkpoint import Checkpoint
from kimi_convert.errors import CheckpointError, DiskSpaceError
from kimi_convert.convert.converter import (BASE_RSS, INDEX_BYTES_PER_TENSOR, VOCAB_BYTES_PER_TOKEN,
                                            WRITE_BUFFERS, _produce, build_plan)
from kimi_convert.fixtures.make_checkpoint import FixtureSpec, make_checkpoint, tensor_plan
from kimi_convert.gguf_io import DirectSink
from kimi_convert.fixtures.real_size import (make_sparse_checkpoint, real_spec, safetensors_header,
                                             write_sparse_gguf, write_sparse_model_imatrix)
from kimi_convert.model import KimiConfig
from kimi_convert.quant.plan import PlanOptions, plan_quantization
from kimi_convert.quant.policy import load_policy
from kimi_convert.tensor_map import gguf_tensor_types

MiB = 1 << 20

# --- the reference's figures (k3-hf-format.md) ---------------------------------------------
H, V, E, L, I, F = 7168, 163840, 896, 3584, 3072, 33792
N_LAYER, N_MLA, N_KDA, N_MOE = 93, 24, 69, 92
REF_TENSORS = 497_220                        # section 1 [IDX]
REF_TENSOR_BYTES = 1_560_860_324_864         # section 1 [IDX] total_tensor_bytes
REF_INDEX_SIZE = 59_764_096                  # section 1 [IDX] index.json size
REF_SHARD2_SIZE = 16_990_911_504             # section 1 [IDX] model-00002 (layer 1, experts included)
REF_EXPERT_TENSORS = N_MOE * E * 6           # section 3 count check: 494,592
REF_VISION_TENSORS = 168                     # section 4
# one routed expert: w1 and w3 [I, L/2] + [I, L/32], w2 [L, I/2] + [L, I/32], all U8 (section 3)
EXPERT_BYTES = 2 * (I * L // 2 + I * L // 32) + (L * I // 2 + L * I // 32)
# section 4: vision tower and projector, all BF16
VISION_BYTES = 2 * (1024 * 3 * 14 * 14 + 64 * 64 * 1024 + 1024 + 7168 + 4096 * 4096 + 7168 * 4096
                    + 27 * (4608 * 1024 + 1024 * 1536 + 2 * 1024 + 2 * 4096 * 1024))
# section 5: what the conversion changes in size. BF16 1-D norms (attn/ffn norm per layer, output
# norm, MLA q_a/kv_a norms, routed-expert norm) and the routers become F32; A_log [128] -> ssm_a [96];
# everything else keeps its bytes (MXFP4 is 17 bytes per 32 values on both sides)
K3_GGUF_BYTES = (REF_TENSOR_BYTES - VISION_BYTES
                 + 2 * (H * (2 * N_LAYER + 1) + N_MLA * (1536 + 512) + N_MOE * L)
                 + 2 * N_MOE * E * H
                 - N_KDA * (128 - 96) * 4)
# per layer: 4 norms/res scores; KDA 14, MLA 9 (kv_b split in two), dense FFN 3, MoE 8 + 3 stacked experts
K3_GGUF_TENSORS = 4 + 4 * N_LAYER + 14 * N_KDA + 9 * N_MLA + 3 + 11 * N_MOE          # 2,573
# K3.1 (k31-indexer.md): 5 indexer tensors on each MLA layer; weights_proj and k_norm become F32
INDEXER_BYTES = 2 * (4096 * 1536 + 128 * H + 32 * H + 128 + 128)
K31_GGUF_BYTES = K3_GGUF_BYTES + N_MLA * (INDEXER_BYTES + 2 * 32 * H + 2 * 2 * 128)


@pytest.fixture(scope="module")
def real_k3(tmp_path_factory):
    return make_sparse_checkpoint(tmp_path_factory.mktemp("real") / "Kimi-K3", arch="k3")


@pytest.fixture(scope="module")
def real_k31(tmp_path_factory):
    return make_sparse_checkpoint(tmp_path_factory.mktemp("real31") / "Kimi-K3.1-Pro", arch="k31")


@pytest.fixture(scope="module")
def real_k3_gguf(real_k3, tmp_path_factory):
    """What `kimi-convert` writes for the real K3, its 1.56 TB of data a hole."""
    return write_sparse_gguf(real_k3.path, tmp_path_factory.mktemp("gguf") / "Kimi-K3-BF16.gguf")


@pytest.fixture(scope="module")
def real_k3_imatrix(real_k3, tmp_path_factory):
    """An importance matrix of the real size for it (k3-q2 requires one): the counts real, the sums a hole."""
    return write_sparse_model_imatrix(real_k3.path, tmp_path_factory.mktemp("imatrix") / "Kimi-K3.imatrix.gguf")


PRESETS = ("q8_0", "k3-native", "k3-q4", "k3-q2")


def preset_options(preset: str, imatrix) -> list:
    """What a preset requires of a run: k3-q2 an imatrix and --allow-requantize."""
    return ["--imatrix", imatrix.path, "--allow-requantize"] if preset == "k3-q2" else []


def planned_by_config(hf_dir: Path, preset: str):
    """The preset's decisions from the config alone (tensor_map.gguf_tensor_types: the tensors kimi-convert
    writes), as docs/policy.md sizes the presets: the figure every dry run must agree with."""
    cfg = KimiConfig.from_hf_dir(hf_dir)
    return plan_quantization(gguf_tensor_types(cfg), load_policy(preset),
                             PlanOptions(allow_requantize=preset == "k3-q2"))


# Linux carries a process's peak RSS across exec, and a child forked from this test process (which
# has just generated a 497k-tensor checkpoint) would start with this process's peak. So a small
# python forks the command afresh and writes the command's own ru_maxrss (os.wait4) to a file.
_MEASURE = """
import os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
open(sys.argv[1], "w").write(str(usage.ru_maxrss * 1024))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def run_measured(cmd: list[str], report: Path) -> tuple[int, str, int]:
    """(exit status, stdout + stderr, the command's own peak RSS in bytes)."""
    with open(os.devnull, "rb") as stdin:
        p = subprocess.run([sys.executable, "-c", _MEASURE, str(report), *map(str, cmd)], stdin=stdin,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return p.returncode, p.stdout.decode(), int(report.read_text())


def kimi_convert(*args) -> list[str]:
    return [sys.executable, "-m", "kimi_convert", *map(str, args)]


def kimi_quantize(*args) -> list[str]:
    return [sys.executable, "-c", "from kimi_convert.cli.quantize import main; main()", *map(str, args)]


# --- the generator --------------------------------------------------------------------------

@pytest.mark.parametrize("metadata", [None, {"format": "pt"}])
def test_header_is_what_safetensors_writes(tmp_path, metadata):
    """Byte for byte the library's own serializer: the order of the data (dtype size, then name),
    the compact JSON, the padding, the offsets."""
    defs = [t for t in tensor_plan(FixtureSpec(n_layers=4, n_shards=4)) if t.shard == 1]
    assert {t.dtype for t in defs} == {"BF16", "F32", "U8"}
    blobs = {t.name: np.zeros(math.prod(t.shape), dtype={"BF16": np.uint16, "F32": np.float32,
                                                        "U8": np.uint8}[t.dtype]) for t in defs}
    specs = {t.name: safetensors.TensorSpec(dtype={"BF16": "bfloat16", "F32": "float32", "U8": "uint8"}[t.dtype],
                                            shape=list(t.shape), data_ptr=blobs[t.name].ctypes.data,
                                            data_len=blobs[t.name].nbytes) for t in defs}
    path = tmp_path / "lib.safetensors"
    safetensors.serialize_file(specs, str(path), metadata=metadata)
    ours, data = safetensors_header(defs, metadata)
    lib = path.read_bytes()
    assert lib[:len(ours)] == ours
    assert len(lib) == len(ours) + data


def test_k3_is_the_release_inventory(real_k3):
    info, d = real_k3, real_k3.path
    assert info.n_tensors == REF_TENSORS
    assert info.total_bytes == REF_TENSOR_BYTES
    assert sorted(info.shard_sizes) == [f"model-{k:05d}-of-000096.safetensors" for k in range(1, 97)]
    assert info.shard_sizes["model-00002-of-000096.safetensors"] == REF_SHARD2_SIZE
    assert (d / "model.safetensors.index.json").stat().st_size == REF_INDEX_SIZE
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == REF_TENSOR_BYTES
    names = index["weight_map"]
    experts = [n for n in names if ".experts." in n]
    vision = [n for n in names if n.startswith(("vision_tower.", "mm_projector."))]
    assert (len(names), len(experts), len(vision)) == (REF_TENSORS, REF_EXPERT_TENSORS, REF_VISION_TENSORS)
    assert len(names) - len(experts) - len(vision) == 2460            # section 3 count check
    # the shards' own headers give the same figures: experts and vision bytes by class
    ckpt = Checkpoint(d)
    by_class = {"experts": 0, "vision": 0}
    for name, t in ckpt.tensors.items():
        if ".experts." in name:
            by_class["experts"] += t.nbytes
        elif name.startswith(("vision_tower.", "mm_projector.")):
            by_class["vision"] += t.nbytes
    assert by_class == {"experts": N_MOE * E * EXPERT_BYTES, "vision": VISION_BYTES}
    assert ckpt.tensors["language_model.model.layers.0.self_attn.A_log"].shape == (128,)
    assert ckpt.tensors["language_model.model.layers.3.self_attn.kv_b_proj.weight"].shape == (24576, 512)


def test_shards_hold_what_the_release_puts_in_them(real_k3):
    """k3-hf-format.md section 1: shard k holds layer k-1 (model-00002: layer 1 with its experts), 94 the
    embeddings, head, final norm and output residual scores, 95 the projector, 96 the vision tower."""
    weight_map = json.loads((real_k3.path / "model.safetensors.index.json").read_text())["weight_map"]
    contents: dict[int, set[str]] = {}
    for name, shard in weight_map.items():
        layer = re.match(r"language_model\.model\.layers\.(\d+)\.", name)
        part = f"layer {layer[1]}" if layer else name.split(".")[0] if not name.startswith("language_model.") \
            else "globals"
        contents.setdefault(int(shard[6:11]), set()).add(part)
    assert contents == {**{k: {f"layer {k - 1}"} for k in range(1, 94)},
                        94: {"globals"}, 95: {"mm_projector"}, 96: {"vision_tower"}}
    globals_ = sorted(n for n, s in weight_map.items() if s.startswith("model-00094"))
    assert globals_ == ["language_model.lm_head.weight", "language_model.model.embed_tokens.weight",
                        "language_model.model.norm.weight", "language_model.model.output_attn_res_norm.weight",
                        "language_model.model.output_attn_res_proj.weight"]


def test_shards_are_holes_that_read_as_zeros(real_k3):
    d = real_k3.path
    with open(d / "model-00002-of-000096.safetensors", "rb") as f:
        f.seek(REF_SHARD2_SIZE // 2)
        assert f.read(1 << 16) == bytes(1 << 16)
    headers = 0
    for name in real_k3.shard_sizes:
        with open(d / name, "rb") as f:
            headers += 8 + struct.unpack("<Q", f.read(8))[0]
    # allocated blocks: the headers (~75 MB), plus at most 1 MiB a shard for block rounding and
    # extent metadata; the 1.56 TB of data take none
    assert real_k3.disk_usage() <= headers + 96 * MiB


def test_k3_config_is_the_release_config(real_k3):
    cfg = KimiConfig.from_hf_dir(real_k3.path)
    assert (cfg.n_layer, cfg.n_embd, cfg.n_vocab, cfg.n_head, cfg.n_ff) == (N_LAYER, H, V, 96, F)
    assert (cfg.n_expert, cfg.n_expert_used, cfg.n_expert_shared, cfg.n_ff_exp, cfg.n_latent) == (E, 16, 2, I, L)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.attn_res_block_size) == (1536, 512, 12)
    assert cfg.full_attn_layers == tuple(range(3, 92, 4)) + (92,)        # 0-based MLA layers
    raw = json.loads((real_k3.path / "config.json").read_text())
    assert (raw["bos_token_id"], raw["eos_token_id"], raw["pad_token_id"]) == (163584, 163586, 163839)
    assert raw["media_placeholder_token_id"] == 163605
    vc = raw["vision_config"]
    assert (vc["vt_hidden_size"], vc["vt_num_hidden_layers"], vc["init_pos_emb_height"]) == (1024, 27, 64)
    tok = json.loads((real_k3.path / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert tok["163605"]["content"] == "<|kimi_image_placeholder|>"
    lines = (real_k3.path / "tiktoken.model").read_text().splitlines()
    assert len(lines) == 163_584 and lines[-1].endswith(" 163583")


def test_k31_adds_the_indexer_on_the_mla_layers(real_k31):
    assert real_k31.n_tensors == REF_TENSORS + 5 * N_MLA
    assert real_k31.total_bytes == REF_TENSOR_BYTES + N_MLA * INDEXER_BYTES
    plan = build_plan(real_k31.path)
    assert (len(plan.tensors), plan.total_bytes) == (K3_GGUF_TENSORS + 5 * N_MLA, K31_GGUF_BYTES)
    assert plan.config.arch == "kimi-k31"
    ckpt = plan.checkpoint
    owners = sorted({int(m[1]) for n in ckpt.tensors if (m := re.search(r"layers\.(\d+)\.self_attn\.indexer\.", n))})
    assert owners == list(range(3, 92, 4)) + [92]
    x = "language_model.model.layers.3.self_attn.indexer."
    assert [ckpt.tensors[x + s].shape for s in ("wq_b.weight", "wk.weight", "weights_proj.weight",
                                                "k_norm.weight", "k_norm.bias")] == \
        [(4096, 1536), (128, H), (32, H), (128,), (128,)]
    idx = plan.config.indexer
    assert (idx.n_head, idx.head_dim, idx.top_k) == (32, 128, 2048)


# --- the compact index keeps every check of the index against the headers -----------------------

def _tiny(tmp_path: Path) -> Path:
    return make_checkpoint(tmp_path / "Kimi-K3-tiny", arch="k3", n_layers=2, n_shards=4)


def test_a_tensor_in_two_shards_names_both(tmp_path):
    """The index's names are struck off as headers are read; a second copy must still be caught."""
    from kimi_convert.fixtures.make_checkpoint import _write_safetensors, read_safetensors_raw
    d = _tiny(tmp_path)
    first, second = "model-00001-of-000004.safetensors", "model-00002-of-000004.safetensors"
    _, tensors = read_safetensors_raw(d / first)
    name, extra = next(iter(tensors.items()))
    _, others = read_safetensors_raw(d / second)
    _write_safetensors(d / second, {n: (t.dtype, t.shape, t.data) for n, t in {**others, name: extra}.items()})
    with pytest.raises(CheckpointError, match=rf"{second}: tensor {re.escape(name)} is in this shard but "
                                              rf"indexed in {first}"):
        Checkpoint(d)


def test_an_index_entry_that_is_not_a_file_name(tmp_path):
    d = _tiny(tmp_path)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = sorted(index["weight_map"])[3]
    index["weight_map"][name] = ["model-00001-of-000004.safetensors"]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"index.json: tensor {re.escape(name)} maps to \['model-"):
        Checkpoint(d)


def test_a_header_entry_with_bad_offsets(tmp_path):
    d = _tiny(tmp_path)
    path = d / "model-00001-of-000004.safetensors"
    blob = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"] = ["0", "8"]
    text = json.dumps(header, separators=(",", ":")).encode()
    blob[8:8 + n] = text + b" " * (n - len(text))              # same length: the data stay in place
    path.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=rf"corrupt safetensors header entry for tensor {re.escape(name)}"):
        Checkpoint(d)


# --- the converter's dry run at real size (CI) ------------------------------------------------

def test_dry_run_on_the_real_k3(real_k3, tmp_path):
    """`kimi-convert --dry-run` as a user runs it: the plan's figures against the reference's."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    rc, out, peak = run_measured(kimi_convert(real_k3.path, out_dir / "out.gguf", "--dry-run"), tmp_path / "rss")
    assert not list(out_dir.iterdir())                      # a dry run writes nothing
    room = shutil.disk_usage(out_dir).free >= K3_GGUF_BYTES + (64 << 20)
    assert rc == (0 if room else DiskSpaceError.exit_code), out
    assert re.search(rf"total\s*\S*\s+{K3_GGUF_TENSORS}\s", out), out
    assert f"tensor data {K3_GGUF_BYTES:,} bytes" in out, out
    assert "dropped (vision/projector): 168 tensors, 853.3 MiB" in out, out
    # RAM: the dry run needs what planning needs (index, plan, vocabulary); the run it plans
    # is estimated under 1 GiB
    planning = BASE_RSS + INDEX_BYTES_PER_TENSOR * REF_TENSORS + VOCAB_BYTES_PER_TOKEN * V
    assert 0.90 * planning <= peak <= 1.05 * planning, (peak / MiB, planning / MiB)
    estimate = float(re.search(r"estimated peak RAM (\d+\.\d) MiB", out)[1]) * MiB
    assert planning + WRITE_BUFFERS < estimate < 1 << 30


@pytest.mark.parametrize("preset", PRESETS)
def test_one_pass_dry_run_on_the_real_k3(preset, real_k3, real_k3_imatrix, tmp_path):
    """`kimi-convert --policy P --dry-run`: the quantized plan of all 497,220 source tensors, its size what the
    config alone implies for the preset, within 1 GiB (issue 8: "in seconds, what each preset will weigh").
    (K3.1-Pro's figures are in docs/performance.md; its plan is test_k31_adds_the_indexer_on_the_mla_layers'.)"""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    rc, out, peak = run_measured(kimi_convert(real_k3.path, out_dir / "q.gguf", "--dry-run", "--policy", preset,
                                              *preset_options(preset, real_k3_imatrix)), tmp_path / "rss")
    assert not list(out_dir.iterdir())
    planned = planned_by_config(real_k3.path, preset)
    room = shutil.disk_usage(out_dir).free >= planned.target_bytes + (64 << 20)
    assert rc == (0 if room else DiskSpaceError.exit_code), out
    assert f"tensor data {planned.target_bytes:,} bytes" in out, out
    assert re.search(rf"total\s*\S*\s+{K3_GGUF_TENSORS}\s", out), out
    # the index, plan, vocabulary and quantizer (numba and the kernels it times) are what it holds
    assert peak < 1 << 30, peak / MiB


# --- the data-less GGUF ------------------------------------------------------------------------

def test_sparse_gguf_is_the_converters_file_without_data(tmp_path):
    from kimi_convert.convert.converter import convert
    hf = make_checkpoint(tmp_path / "Kimi-K3-tiny", arch="k3")
    real = tmp_path / "real" / "k3.gguf"
    real.parent.mkdir()
    convert(build_plan(hf), real)
    sparse = write_sparse_gguf(hf, tmp_path / "k3.gguf")
    a, b = real.read_bytes(), sparse.path.read_bytes()
    assert len(a) == len(b) == sparse.size
    assert a[:sparse.data_offset] == b[:sparse.data_offset]        # header, every key, every tensor info
    assert b[sparse.data_offset:] == bytes(len(b) - sparse.data_offset)
    assert a[sparse.data_offset:] != bytes(len(a) - sparse.data_offset)


def test_sparse_gguf_of_the_real_k3(real_k3_gguf):
    g = real_k3_gguf
    with open(g.path, "rb") as f:
        magic, version, n_tensors, n_kv = struct.unpack("<4sIQQ", f.read(24))
    assert (magic, version, n_tensors) == (b"GGUF", 3, K3_GGUF_TENSORS)
    # the data section: every tensor padded to the 32-byte alignment
    assert K3_GGUF_BYTES <= g.size - g.data_offset < K3_GGUF_BYTES + 32 * K3_GGUF_TENSORS
    assert g.path.stat().st_size == g.size
    assert g.path.stat().st_blocks * 512 <= g.data_offset + MiB       # the header only is on disk


def test_sparse_imatrix_is_llama_imatrix_layout_at_the_real_size(real_k3, real_k3_imatrix):
    from kimi_convert.fixtures.imatrix import collected, unrouted
    from kimi_convert.gguf_io import read_gguf
    gf = read_gguf(real_k3_imatrix.path)
    shapes = {name: shape for name, shape, _ in gguf_tensor_types(KimiConfig.from_hf_dir(real_k3.path))}
    weights = collected(shapes)
    assert set(gf.tensors) == {n + s for n in weights for s in (".in_sum2", ".counts")}
    assert gf.fields["general.type"] == "imatrix" and gf.fields["imatrix.datasets"] == ["calib.txt"]
    name = "blk.7.ffn_gate_exps.weight"
    assert gf.tensors[name + ".in_sum2"].shape == (E, L)
    counts = np.asarray(gf.tensors[name + ".counts"].raw).reshape(-1)
    assert sorted(np.flatnonzero(counts == 0)) == sorted(unrouted(name, E)) and counts.max() > 0
    # 92 layers x (2 x 896 x 3584 + 896 x 3072) float32 sums, the 3.4 GB of a real K3 imatrix
    assert real_k3_imatrix.size > N_MOE * 4 * E * (2 * L + I)
    assert real_k3_imatrix.path.stat().st_blocks * 512 < 32 * MiB     # the header and the counts only


@pytest.mark.parametrize("preset", PRESETS)
def test_quantize_plan_of_the_real_k3_gguf(preset, real_k3, real_k3_gguf, real_k3_imatrix, tmp_path):
    """`kimi-quantize --policy P --explain --dry-run` on the real K3's GGUF header: every decision and the
    output size are the config's, within 1 GiB, and nothing is written."""
    report, out_file = tmp_path / "plan.json", tmp_path / "q.gguf"
    rc, out, peak = run_measured(kimi_quantize("--policy", preset, "--explain", "--dry-run", "--json", report,
                                               *preset_options(preset, real_k3_imatrix), real_k3_gguf.path,
                                               out_file), tmp_path / "rss")
    assert rc == 0, out[-3000:]
    assert not out_file.exists()
    planned = planned_by_config(real_k3.path, preset)
    assert f"({planned.target_bytes:,} bytes of tensor data)" in out, out[-3000:]
    doc = json.loads(report.read_text())
    assert doc["output_bytes"] == planned.target_bytes
    want = {d.name: d.target.name for d in planned.decisions}
    assert len(doc["tensors"]) == len(want) and {r["tensor"]: r["to"] for r in doc["tensors"]} == want
    # --explain: one line per tensor, "name  SOURCE -> TARGET  size  why"
    explained = dict(m.group(1, 3) for m in re.finditer(r"^(\S+)\s+(\w+) -> (\w+)\s", out, re.M))
    assert explained == want
    assert peak < 1 << 30, peak / MiB


# --- the RAM estimate against measured peaks ---------------------------------------------------

def _direct_io(folder: Path) -> bool:
    """Whether the writer's O_DIRECT staging buffers will be used there (tmpfs refuses O_DIRECT)."""
    try:
        fd = os.open(folder / ".direct-probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    os.unlink(folder / ".direct-probe")
    return True


def test_estimate_matches_a_measured_conversion(tmp_path):
    """A real run of kimi-convert in a subprocess, on a checkpoint with the real layer count, the
    real vocabulary and 128 experts a layer (73,284 tensors: the index is ~28 MiB of the estimate)
    but small widths, so that it converts in seconds."""
    spec = real_spec("k3", num_experts=128, hidden=256, n_heads=2, kda_head_dim=16, q_lora_rank=32,
                     kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                     intermediate_size=64, moe_intermediate_size=32, routed_expert_hidden_size=32)
    info = make_sparse_checkpoint(tmp_path / "scaled", spec)
    plan = build_plan(info.path)
    out = tmp_path / "out"
    out.mkdir()
    rc, log, peak = run_measured(kimi_convert(info.path, out / "scaled.gguf"), tmp_path / "rss")
    assert rc == 0, log
    estimate = plan.peak_ram_estimate
    if not _direct_io(out):
        estimate -= DirectSink.staging_bytes(plan.total_bytes)    # buffered writes: no staging buffers
    # the model's figures are measured ones: the real peak lies from 10% below to 5% above it
    assert 0.90 * estimate <= peak <= 1.05 * estimate, (peak / MiB, estimate / MiB)


@pytest.fixture(scope="module")
def real_widths(tmp_path_factory):
    """Layers 0 (KDA, dense FFN) and 1 (MLA, MoE with 896 experts) at the real widths."""
    spec = real_spec("k3", n_layers=2, full_attn_layers=(2,), n_shards=5)
    return make_sparse_checkpoint(tmp_path_factory.mktemp("widths") / "Kimi-K3-2L", spec).path


def _traced_peak(plan, first: str, measured: str, max_chunks: int = 8) -> int:
    """tracemalloc's peak while `measured` is produced, the plan's tensors being produced in order
    from `first` and the last IN_FLIGHT chunks kept alive, as the writer's queue keeps them. Each chunk of
    `measured` is held a moment, as a writer slower than the producer holds it: so the MXFP4 repack pool is
    threads + REPACK_AHEAD experts ahead at the peak, as in a real run, whatever else the machine is doing (a consumer
    faster than a slowed pool would catch a lower peak)."""
    from kimi_convert.convert.transforms import IN_FLIGHT
    names = [t.name for t in plan.tensors]
    kept: list = []
    tracemalloc.start()
    try:
        for p in plan.tensors[names.index(first):names.index(measured) + 1]:
            if p.name == measured:
                kept = kept[-(IN_FLIGHT - 1):] if kept else []
                tracemalloc.reset_peak()
            for i, chunk in enumerate(_produce(p, plan.checkpoint, plan.config)):
                kept = (kept + [chunk])[-IN_FLIGHT:]
                if p.name == measured:
                    time.sleep(0.05)
                if i + 1 >= max_chunks:
                    break
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("outtype, first, measured, mapped", [
    ("bf16", "blk.1.attn_k_b.weight", "blk.1.attn_k_b.weight", 0),
    ("bf16", "blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight", 0),       # k_b waits in the queue
    ("bf16", "blk.1.ffn_gate_inp.weight", "blk.1.ffn_gate_inp.weight", 0),
    ("bf16", "blk.1.ffn_gate_exps.weight", "blk.1.ffn_gate_exps.weight", "threads"),
    ("f32", "blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight", 0),
    ("f32", "token_embd.weight", "token_embd.weight", 0),
])
def test_work_estimate_at_real_widths(real_widths, outtype, first, measured, mapped):
    """Each transform's work figure against what its producer allocates (numpy's buffers are
    traced); the MXFP4 experts are read into a buffer per repack thread, an anonymous map outside
    tracemalloc, so those are added."""
    plan = build_plan(real_widths, outtype)
    p = next(t for t in plan.tensors if t.name == measured)
    mxfp4.repack(np.zeros((1, 16), np.uint8), np.zeros((1, 1), np.uint8))   # the kernel load is repack_rss, not work
    mapped = p.threads if mapped == "threads" else mapped            # a read buffer per repack thread
    used = _traced_peak(plan, first, measured) + mapped * sum(s.nbytes for s in p.sources[0])
    # within 1 MiB below (interpreter objects around the buffers) and at most 35% above
    assert used - MiB <= p.work_bytes <= 1.35 * used, (measured, used / MiB, p.work_bytes / MiB)


def stdlib_text(path: Path) -> Path:
    """About 100k tokens of text every machine has: six standard-library modules' source."""
    import argparse, ast, collections, difflib, inspect, pydoc, typing
    path.write_text("".join(inspect.getsource(m) for m in (argparse, ast, collections, difflib, pydoc, typing)))
    return path


def dry_run_json(module: str, args: list, tmp_path: Path) -> dict:
    """The --json plan of a streamed command's --dry-run at 200 chunks of 512 tokens and 12 GB of states in RAM,
    run as its own process (a real-size plan's memory stays out of the test's)."""
    report = tmp_path / "plan.json"
    p = subprocess.run([sys.executable, "-c", f"from {module} import main; main()", *map(str, args), "--ctx", "512",
                        "--chunks", "200", "--dry-run", "--json", str(report), "--state-ram", "12G"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    return json.loads(report.read_text())


def text_model_bytes(ckpt) -> int:
    """The checkpoint's bytes without the vision tower and projector (what the streamed engine may read)."""
    return sum(t.nbytes for t in ckpt.tensors.values() if not t.name.startswith(("vision_tower.", "mm_projector.")))


def test_imatrix_dry_run_on_the_real_k3_at_100k_tokens(real_k3, tmp_path):
    """kimi-imatrix --dry-run on the real K3 at 200 chunks of 512 tokens: it reads the text tensors' bytes (all
    but `output`, which only --process-output multiplies), holds 9 state vectors a token (the stream and 8 AttnRes
    banks) with those beyond the RAM budget spilled, and plans a peak under 64 GB. Nothing is written but --json."""
    text = stdlib_text(tmp_path / "calib.txt")
    plan = dry_run_json("kimi_convert.cli.imatrix", [real_k3.path, "-f", text, "-o", tmp_path / "k3.im"], tmp_path)
    ckpt = Checkpoint(real_k3.path)
    text_bytes = text_model_bytes(ckpt)
    head = sum(t.nbytes for t in ckpt.tensors.values() if t.name.endswith("lm_head.weight"))
    assert plan["bytes_read"] == text_bytes - head
    assert plan["tokens"] == 102_400
    assert plan["token_state_bytes"] == 102_400 * 7168 * 4 * 9
    assert plan["states_in_ram"] <= 12e9 < plan["token_state_bytes"]        # the rest spills beside the output
    assert plan["peak_bytes"] < 64e9 and plan["seconds"] > 0
    assert sorted(x.name for x in tmp_path.iterdir()) == ["calib.txt", "plan.json"]


def test_kld_dry_run_on_the_real_k3_at_100k_tokens(real_k3, tmp_path):
    """kimi-verify kld --dry-run, the real K3 checkpoint against itself at 200 chunks of 512 tokens: two passes,
    each reading every text tensor once (`output` too: the logits), the token states of one pass at a time, the
    base file's bytes (llama-perplexity's format: 2 bytes a vocabulary entry a scored token), a peak under 64 GB.
    Nothing is written but --json."""
    from kimi_convert.kld.basefile import BaseHeader
    text = stdlib_text(tmp_path / "eval.txt")
    plan = dry_run_json("kimi_convert.cli.verify", ["kld", real_k3.path, real_k3.path, "-f", text], tmp_path)
    ckpt = Checkpoint(real_k3.path)
    text_bytes = text_model_bytes(ckpt)
    assert plan["bytes_read"] == 2 * text_bytes
    assert len(plan["passes"]) == 2 and plan["chunks"] == 200
    assert plan["token_state_bytes"] == 102_400 * 7168 * 4 * 9
    assert plan["base_file_bytes"] == BaseHeader(512, 163_840, 200).nbytes() > 16e9
    assert plan["peak_bytes"] < 64e9 and plan["seconds"] > 0
    assert sorted(x.name for x in tmp_path.iterdir()) == ["eval.txt", "plan.json"]
