"""Converter: every GGUF tensor inverted through its transform equals its HF source.

The expected mapping below is written out again on purpose, independently of
kimi_convert.tensor_map, and the HF side is read with safetensors+torch rather
than our own reader: a mistake in the table cannot hide behind itself.
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import load_file

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def load_hf(hf_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(hf_dir.glob("model-*.safetensors")):
        out.update(load_file(shard))
    return out


def text_config(hf_dir: Path) -> dict:
    return json.loads((hf_dir / "config.json").read_text())["text_config"]


def gguf_tensors(path: Path) -> dict:
    return {t.name: t for t in GGUFReader(path).tensors}


def raw_bytes(t) -> np.ndarray:
    return np.asarray(t.data).reshape(-1).view(np.uint8)


def values(t) -> np.ndarray:
    shape = tuple(int(x) for x in reversed(t.shape.tolist()))
    return np.asarray(dequantize(t.data, QT(t.tensor_type)), np.float32).reshape(shape)


def f32(x: torch.Tensor) -> np.ndarray:
    return x.float().numpy()


# GGUF suffix -> HF suffix (per layer), for plain copies
COPIES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ssm_f_a.weight": "self_attn.f_a_proj.weight", "ssm_f_b.weight": "self_attn.f_b_proj.weight",
    "ssm_beta.weight": "self_attn.b_proj.weight", "ssm_dt.bias": "self_attn.dt_bias",
    "ssm_norm.weight": "self_attn.o_norm.weight", "ssm_g.weight": "self_attn.g_proj.weight",
    "attn_gate.weight": "self_attn.g_proj.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight", "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight", "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "indexer.attn_q_b.weight": "self_attn.indexer.wq_b.weight", "indexer.attn_k.weight": "self_attn.indexer.wk.weight",
    "indexer.proj.weight": "self_attn.indexer.weights_proj.weight",
    "indexer.k_norm.weight": "self_attn.indexer.k_norm.weight", "indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
    "exp_probs_b.bias": "block_sparse_moe.gate.e_score_correction_bias",
    "ffn_routed_down.weight": "block_sparse_moe.routed_expert_down_proj.weight",
    "ffn_routed_norm.weight": "block_sparse_moe.routed_expert_norm.weight",
    "ffn_routed_up.weight": "block_sparse_moe.routed_expert_up_proj.weight",
    "ffn_gate_shexp.weight": "block_sparse_moe.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "block_sparse_moe.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "block_sparse_moe.shared_experts.down_proj.weight",
}
GLOBAL_COPIES = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
                 "output_norm.weight": "model.norm.weight"}
RES = {"attn_res_score.weight": "self_attention_res", "ffn_res_score.weight": "mlp_res"}
EXPERTS = {"ffn_gate_exps.weight": "w1", "ffn_up_exps.weight": "w3", "ffn_down_exps.weight": "w2"}
MUST_BE_F32 = ("norm.weight", "res_score.weight", "ssm_conv1d", "ssm_a", "ssm_dt.bias", "ffn_gate_inp.weight",
               "exp_probs_b.bias", "indexer.proj.weight", "indexer.k_norm")


def check_tensor(name: str, t, hf: dict, cfg: dict, outtype: str) -> str:
    """Invert one GGUF tensor through its transform and compare with the HF source; returns the HF name(s)."""
    P = "language_model."
    m = re.match(r"blk\.(\d+)\.(.+)$", name)
    qtype = QT(t.tensor_type)
    want_float = QT.F32 if outtype == "f32" or any(s in name for s in MUST_BE_F32) else QT.BF16
    if m is None:
        if name == "output_res_score.weight":
            src = [P + "model.output_attn_res_norm.weight", P + "model.output_attn_res_proj.weight"]
            np.testing.assert_array_equal(values(t), f32(hf[src[0]]).reshape(-1) * f32(hf[src[1]]).reshape(-1))
            assert qtype == QT.F32
            return src
        src = P + GLOBAL_COPIES[name]
        return check_copy(t, hf[src], want_float) or [src]
    il, suffix = int(m[1]), m[2]
    L = f"{P}model.layers.{il}."
    if suffix in COPIES:
        check_copy(t, hf[L + COPIES[suffix]], want_float)
        return [L + COPIES[suffix]]
    if suffix in RES:
        src = [L + RES[suffix] + "_norm.weight", L + RES[suffix] + "_proj.weight"]
        np.testing.assert_array_equal(values(t), f32(hf[src[0]]).reshape(-1) * f32(hf[src[1]]).reshape(-1))
        assert qtype == QT.F32
        return src
    if suffix.startswith("ssm_conv1d_"):
        src = L + f"self_attn.{suffix[11]}_conv1d.weight"
        np.testing.assert_array_equal(values(t).reshape(hf[src].shape), f32(hf[src]))
        assert tuple(reversed(t.shape.tolist())) == (1, hf[src].shape[0], 1, hf[src].shape[2])
        return [src]
    if suffix == "ssm_a":
        src, n_head = L + "self_attn.A_log", cfg["num_attention_heads"]
        a_log = f32(hf[src])
        assert np.all(a_log[n_head:] == 0)   # the padding really is padding
        # correctly rounded: the double-precision exp, rounded once to float32
        correct = np.array([-math.exp(float(x)) for x in a_log[:n_head]], dtype=np.float32)
        np.testing.assert_array_equal(values(t), correct)
        # llama.cpp's value (torch's float32 exp) is within 1 ulp of it
        upstream = -torch.exp(torch.from_numpy(a_log[:n_head])).numpy()
        assert np.abs(upstream.view(np.int32).astype(np.int64) - correct.view(np.int32)).max() <= 1
        np.testing.assert_allclose(np.log(-values(t)), a_log[:n_head], rtol=1e-6)
        return [src]
    if suffix in ("attn_k_b.weight", "attn_v_b.weight"):
        return check_kv_b(L, suffix, t, hf, cfg, want_float)
    if suffix in EXPERTS:
        return check_experts(L, EXPERTS[suffix], t, hf, cfg)
    raise AssertionError(f"unexpected GGUF tensor {name}")


def check_copy(t, src: torch.Tensor, want: QT):
    qtype = QT(t.tensor_type)
    assert qtype == want, f"{t.name}: {qtype.name}, expected {want.name}"
    assert tuple(reversed(t.shape.tolist())) == tuple(src.shape)
    if qtype == QT.BF16 and src.dtype == torch.bfloat16:
        assert raw_bytes(t).tobytes() == src.contiguous().view(torch.int16).numpy().tobytes()
    else:
        np.testing.assert_array_equal(values(t), f32(src))


def check_kv_b(L, suffix, t, hf, cfg, want):
    src = L + "self_attn.kv_b_proj.weight"
    nh, dn, dv, r = (cfg[k] for k in ("num_attention_heads", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank"))
    kv = f32(hf[src]).reshape(nh, dn + dv, r)
    assert QT(t.tensor_type) == want
    if suffix == "attn_k_b.weight":
        np.testing.assert_array_equal(values(t).transpose(0, 2, 1), kv[:, :dn])   # stored transposed
    else:
        np.testing.assert_array_equal(values(t), kv[:, dn:])
    return [src]


def check_experts(L, w, t, hf, cfg):
    assert QT(t.tensor_type) == QT.MXFP4
    E = cfg["num_experts"]
    blocks = raw_bytes(t).reshape(E, -1, 17 * 0 + 17)
    decoded = values(t)
    names = []
    for e in range(E):
        base = L + f"block_sparse_moe.experts.{e}.{w}."
        packed, scale = hf[base + "weight_packed"].numpy(), hf[base + "weight_scale"].numpy()
        rows = packed.shape[0]
        b = blocks[e].reshape(rows, -1, 17)
        # bytes: the scale byte, then element j low / j+16 high
        assert np.array_equal(b[..., 0], scale)
        codes = np.stack([packed & 15, packed >> 4], -1).reshape(rows, -1, 32)
        assert np.array_equal(b[..., 1:], codes[..., :16] | (codes[..., 16:] << 4))
        # values: compressed-tensors' definition
        want = E2M1[codes.reshape(rows, -1)] * np.repeat(2.0 ** (scale.astype(np.float32) - 127), 32, axis=1)
        np.testing.assert_array_equal(decoded[e], want)
        names += [base + "weight_packed", base + "weight_scale"]
    return names


@pytest.mark.parametrize("arch", ["k3", "k31"])
@pytest.mark.parametrize("outtype", ["bf16", "f32"])
def test_every_tensor_inverts_to_its_source(arch, outtype, converted, k3_dir, k31_dir):
    hf_dir = k3_dir if arch == "k3" else k31_dir
    hf, cfg = load_hf(hf_dir), text_config(hf_dir)
    tensors = gguf_tensors(converted(arch, outtype))
    used = set()
    for name, t in tensors.items():
        used.update(check_tensor(name, t, hf, cfg, outtype))
    # every text tensor was used, every vision/projector tensor dropped
    text = {n for n in hf if n.startswith("language_model.")}
    assert used == text
    assert not any("vision" in n or "projector" in n or "mm_" in n for n in tensors)
    assert len([n for n in hf if not n.startswith("language_model.")]) > 0


def expected_keys(hf_dir: Path, arch: str) -> dict:
    raw = json.loads((hf_dir / "config.json").read_text())
    c = raw["text_config"]
    lac = c["linear_attn_config"]
    a = "kimi-k3" if arch == "k3" else "kimi-k31"
    full = lac["full_attn_layers"]
    n = c["num_hidden_layers"]
    keys = {
        "general.architecture": a,
        f"{a}.block_count": n, f"{a}.context_length": c["max_position_embeddings"],
        f"{a}.embedding_length": c["hidden_size"], f"{a}.feed_forward_length": c["intermediate_size"],
        f"{a}.vocab_size": c["vocab_size"], f"{a}.attention.head_count": c["num_attention_heads"],
        f"{a}.attention.head_count_kv": [1 if i + 1 in full else 0 for i in range(n)],
        f"{a}.attention.layer_norm_rms_epsilon": c["rms_norm_eps"],
        f"{a}.expert_count": c["num_experts"], f"{a}.expert_used_count": c["num_experts_per_token"],
        f"{a}.expert_gating_func": 2, f"{a}.expert_feed_forward_length": c["moe_intermediate_size"],
        f"{a}.expert_shared_count": c["num_shared_experts"],
        f"{a}.leading_dense_block_count": c["first_k_dense_replace"],
        f"{a}.expert_weights_scale": c["routed_scaling_factor"], f"{a}.expert_weights_norm": c["moe_renormalize"],
        f"{a}.expert_latent_length": c["routed_expert_hidden_size"],
        f"{a}.ssm.conv_kernel": lac["short_conv_kernel_size"], f"{a}.kda.head_dim": lac["head_dim"],
        f"{a}.kda.gate_lower_bound": lac["gate_lower_bound"],
        f"{a}.attention.q_lora_rank": c["q_lora_rank"], f"{a}.attention.kv_lora_rank": c["kv_lora_rank"],
        f"{a}.rope.dimension_count": c["qk_rope_head_dim"],
        f"{a}.attention.key_length": c["kv_lora_rank"] + c["qk_rope_head_dim"],
        f"{a}.attention.value_length": c["kv_lora_rank"],
        f"{a}.attention.key_length_mla": c["qk_nope_head_dim"] + c["qk_rope_head_dim"],
        f"{a}.attention.value_length_mla": c["v_head_dim"],
        f"{a}.activation.situ_beta": c["activation_situ_beta"],
        f"{a}.activation.situ_linear_beta": c["activation_situ_linear_beta"],
        f"{a}.attn_res.block_size": c["attn_res_block_size"],
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "kimi-k2",
        "tokenizer.ggml.eos_token_id": c.get("eos_token_id", raw["eos_token_id"]),
        "tokenizer.ggml.bos_token_id": c.get("bos_token_id", raw["bos_token_id"]),
    }
    if arch == "k31":
        d = c["dsa_config"]
        keys.update({f"{a}.attention.indexer.head_count": d["index_n_heads"],
                     f"{a}.attention.indexer.key_length": d["index_head_dim"],
                     f"{a}.attention.indexer.top_k": d["index_topk"],
                     f"{a}.attention.indexer.types": [i + 1 in d["layers"] for i in range(n)],
                     f"{a}.attention.layer_norm_epsilon": c["rms_norm_eps"]})
    return keys


# The value type of every key, as llama.cpp's converter writes it (conversion/kimi_k3.py and the gguf-py
# writer of the Oct-2026 tree: add_uint32 / add_float32 / add_bool, and Python int lists -> ARRAY[INT32]);
# the K3.1 indexer keys as llama.cpp b12211 reads them (k31-indexer.md). Written out here on purpose,
# independently of model.py. tests/test_upstream_convert.py compares with llama.cpp's own output.
U32, I32, F32, BOOL, STR, ARR = "UINT32", "INT32", "FLOAT32", "BOOL", "STRING", "ARRAY"
KEY_TYPES = {
    "general.architecture": [STR], "general.name": [STR], "general.file_type": [U32],
    "general.quantization_version": [U32],
    "{a}.context_length": [U32], "{a}.embedding_length": [U32], "{a}.block_count": [U32],
    "{a}.feed_forward_length": [U32], "{a}.vocab_size": [U32], "{a}.attention.head_count": [U32],
    "{a}.attention.head_count_kv": [ARR, I32], "{a}.attention.layer_norm_rms_epsilon": [F32],
    "{a}.expert_count": [U32], "{a}.expert_used_count": [U32], "{a}.expert_group_used_count": [U32],
    "{a}.expert_gating_func": [U32], "{a}.ssm.conv_kernel": [U32], "{a}.kda.head_dim": [U32],
    "{a}.attention.kv_lora_rank": [U32], "{a}.rope.dimension_count": [U32], "{a}.attention.key_length": [U32],
    "{a}.attention.value_length": [U32], "{a}.attention.key_length_mla": [U32],
    "{a}.attention.value_length_mla": [U32], "{a}.expert_feed_forward_length": [U32],
    "{a}.expert_shared_count": [U32], "{a}.leading_dense_block_count": [U32], "{a}.expert_weights_scale": [F32],
    "{a}.expert_weights_norm": [BOOL], "{a}.activation.situ_beta": [F32], "{a}.activation.situ_linear_beta": [F32],
    "{a}.attn_res.block_size": [U32], "{a}.attention.q_lora_rank": [U32], "{a}.kda.gate_lower_bound": [F32],
    "{a}.expert_latent_length": [U32],
    "tokenizer.ggml.model": [STR], "tokenizer.ggml.pre": [STR], "tokenizer.ggml.tokens": [ARR, STR],
    "tokenizer.ggml.token_type": [ARR, I32], "tokenizer.ggml.merges": [ARR, STR],
    "tokenizer.ggml.bos_token_id": [U32], "tokenizer.ggml.eos_token_id": [U32],
    "tokenizer.ggml.padding_token_id": [U32], "tokenizer.ggml.add_bos_token": [BOOL],
    "tokenizer.ggml.add_eos_token": [BOOL], "tokenizer.chat_template": [STR],
}
K31_KEY_TYPES = {
    "{a}.attention.indexer.head_count": [U32], "{a}.attention.indexer.key_length": [U32],
    "{a}.attention.indexer.top_k": [U32], "{a}.attention.indexer.types": [ARR, BOOL],
    "{a}.attention.layer_norm_epsilon": [F32],
}


@pytest.mark.parametrize("arch", ["k3", "k31"])
def test_every_key_has_llama_cpps_value_type(arch, converted):
    a = "kimi-k3" if arch == "k3" else "kimi-k31"
    want = {k.format(a=a): v for k, v in (KEY_TYPES | (K31_KEY_TYPES if arch == "k31" else {})).items()}
    reader = GGUFReader(converted(arch))
    got = {k: [t.name for t in f.types] for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert got == want


@pytest.mark.parametrize("arch", ["k3", "k31"])
def test_every_key_matches_the_config(arch, converted, k3_dir, k31_dir):
    hf_dir = k3_dir if arch == "k3" else k31_dir
    reader = GGUFReader(converted(arch))
    fields = {k: f.contents() for k, f in reader.fields.items()}
    for k, want in expected_keys(hf_dir, arch).items():
        assert k in fields, f"missing key {k}"
        got = fields[k]
        if isinstance(want, float):
            assert got == pytest.approx(want, rel=1e-7), k
        elif isinstance(want, list):
            assert [type(w)(g) for g, w in zip(got, want)] == want and len(got) == len(want), k
        else:
            assert got == want, k
    # indexer key types llama.cpp b12211 insists on
    if arch == "k31":
        from gguf import GGUFValueType as VT
        assert reader.fields["kimi-k31.attention.indexer.head_count"].types == [VT.UINT32]
        assert reader.fields["kimi-k31.attention.indexer.types"].types == [VT.ARRAY, VT.BOOL]
    n_vocab = text_config(hf_dir)["vocab_size"]
    assert len(fields["tokenizer.ggml.tokens"]) == n_vocab
    assert gguf_tensors(converted(arch))["token_embd.weight"].shape.tolist() == [
        text_config(hf_dir)["hidden_size"], n_vocab]
    assert fields["tokenizer.ggml.tokens"][fields["tokenizer.ggml.eos_token_id"]] == "<|end_of_msg|>"
    assert fields.get("tokenizer.chat_template")


def test_split_output_equals_unsplit(tmp_path, k31_dir, converted):
    from kimi_convert.convert.converter import build_plan, convert
    single = converted("k31")
    res = convert(build_plan(k31_dir), tmp_path / "split.gguf", split_max_tensors=60)
    assert len(res.paths) == 4 and res.paths[0].name == "split-00001-of-00004.gguf"
    whole = GGUFReader(single)
    parts = [GGUFReader(p) for p in res.paths]
    split_tensors = {t.name: t for r in parts for t in r.tensors}
    assert list(split_tensors) == [t.name for t in whole.tensors]
    for t in whole.tensors:
        s = split_tensors[t.name]
        assert s.tensor_type == t.tensor_type and s.shape.tolist() == t.shape.tolist()
        assert raw_bytes(s).tobytes() == raw_bytes(t).tobytes()
    meta = {k: f.contents() for k, f in parts[0].fields.items() if not k.startswith(("GGUF.", "split."))}
    assert meta == {k: f.contents() for k, f in whole.fields.items() if not k.startswith("GGUF.")}
    for i, r in enumerate(parts):
        assert r.fields["split.no"].contents() == i
        assert r.fields["split.count"].contents() == 4
        assert r.fields["split.tensors.count"].contents() == len(whole.tensors)


def test_split_by_size(tmp_path, k3_dir):
    from kimi_convert.convert.converter import build_plan, convert
    plan = build_plan(k3_dir)
    res = convert(plan, tmp_path / "s.gguf", split_max_size=1_000_000)
    assert len(res.paths) == plan.n_files(0, 1_000_000) > 1
    for p in res.paths:
        data = sum(int(t.n_bytes) for t in GGUFReader(p).tensors)
        assert data <= 1_000_000 or len(GGUFReader(p).tensors) == 1


def test_buffered_and_direct_writes_give_the_same_file(tmp_path, k31_dir, monkeypatch):
    """O_DIRECT staging (the default where the file system has it) and plain buffered writes agree."""
    from kimi_convert import gguf_io
    from kimi_convert.convert.converter import build_plan, convert
    sinks = []
    real_open_sink = gguf_io.writer.open_sink
    monkeypatch.setattr(gguf_io.writer, "open_sink",
                        lambda fout, nbytes=None: sinks.append(real_open_sink(fout, nbytes)) or sinks[-1])
    direct = convert(build_plan(k31_dir, "f32"), tmp_path / "direct.gguf", split_max_tensors=100).paths
    assert {type(s).__name__ for s in sinks} == {"DirectSink"}
    monkeypatch.setattr(gguf_io.writer, "open_sink", gguf_io.BufferedSink)
    buffered = convert(build_plan(k31_dir, "f32"), tmp_path / "buffered.gguf", split_max_tensors=100).paths
    assert len(direct) == len(buffered) == 3
    for a, b in zip(direct, buffered):
        assert a.read_bytes() == b.read_bytes()


def test_staging_buffers_are_sized_to_the_write(tmp_path, k31_dir, monkeypatch):
    """The O_DIRECT sink's three buffers are about 1/16 of what a file holds (a power of two, 1-32 MiB): memory
    touched for the first time is what costs here, and a small file does not need 96 MiB of it. The file
    itself does not change (test_buffered_and_direct_writes_give_the_same_file)."""
    from kimi_convert import gguf_io
    from kimi_convert.convert.converter import build_plan, convert
    sink = gguf_io.writer.DirectSink
    assert sink.stage_size(None) == sink.stage_size(16 * sink.STAGE) == sink.stage_size(10**12) == 32 << 20
    assert sink.stage_size(143_000_000) == 8 << 20 and sink.stage_size(16 * sink.STAGE - 1) == 16 << 20
    assert sink.stage_size(0) == sink.stage_size(5 << 20) == 1 << 20
    sinks = []
    real_open_sink = gguf_io.writer.open_sink
    monkeypatch.setattr(gguf_io.writer, "open_sink",
                        lambda fout, nbytes=None: sinks.append((real_open_sink(fout, nbytes), nbytes)) or sinks[-1][0])
    out = convert(build_plan(k31_dir, "f32"), tmp_path / "k31.gguf").paths[0]
    (made, nbytes), = sinks
    data = out.stat().st_size - gguf_io.open_gguf(out).parts[0].data_offset
    assert nbytes == data and made.stage == sink.stage_size(data), (nbytes, data, made.stage)


@pytest.mark.parametrize("sink", ["DirectSink", "BufferedSink"])
def test_the_output_is_flushed_as_it_is_written(tmp_path, k31_dir, monkeypatch, sink):
    """Both sinks flush in the background every `every` bytes (_Writeback), so the closing fsync has little
    left: with 1 MiB staging buffers and flushes, the file is synced several times before it is complete,
    each time with more of it written, and it still equals a file written without early flushes."""
    from kimi_convert import gguf_io
    from kimi_convert.convert.converter import build_plan, convert
    plain = convert(build_plan(k31_dir, "f32"), tmp_path / "plain.gguf").paths[0]
    cls = getattr(gguf_io.writer, sink)
    monkeypatch.setattr(gguf_io.writer, "open_sink", cls)
    monkeypatch.setattr(cls, "STAGE" if sink == "DirectSink" else "WRITEBACK", 1 << 20)
    flushed: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (flushed.append(os.fstat(fd).st_size), real(fd))[1])
    out = convert(build_plan(k31_dir, "f32"), tmp_path / "flushed.gguf").paths[0]
    size = out.stat().st_size
    assert size > 4 << 20 and len(flushed) >= 2, (size, flushed)
    assert flushed == sorted(flushed) and flushed[0] < size, flushed
    assert out.read_bytes() == plain.read_bytes()


@pytest.mark.parametrize("sink", ["DirectSink", "BufferedSink"])
def test_a_failed_background_flush_fails_the_write(tmp_path, k31_dir, monkeypatch, sink):
    """Linux reports a write-back error to a descriptor once: if an early flush took it, the closing fsync
    could succeed on a file the disk did not keep. The early flush's error must end the write instead,
    with nothing renamed into place."""
    import errno
    from kimi_convert import gguf_io
    from kimi_convert.convert.converter import build_plan, convert
    cls = getattr(gguf_io.writer, sink)
    monkeypatch.setattr(gguf_io.writer, "open_sink", cls)
    monkeypatch.setattr(cls, "STAGE" if sink == "DirectSink" else "WRITEBACK", 1 << 20)
    calls = []

    def failing(fd):
        calls.append(fd)
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(os, "fdatasync", failing)
    out = tmp_path / "out.gguf"
    with pytest.raises(Exception) as e:
        convert(build_plan(k31_dir, "f32"), out)
    assert calls and "Input/output error" in str(e.value), e.value
    assert not out.exists() and list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())
