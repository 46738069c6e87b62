"""Structure checks for fixtures/make_checkpoint.py: the tiny checkpoints must look exactly like the real HF
release (names, dtypes, shapes, config keys, shards, index, tokenizer files; k3-hf-format.md)."""

from __future__ import annotations

import base64
import json
import math
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kimi_convert.fixtures.make_checkpoint import (
    FixtureSpec,
    bf16_bytes_to_f32,
    decode_raw,
    dequant_mxfp4,
    f32_to_bf16_bytes,
    make_checkpoint,
    read_safetensors_raw,
)

REPO = Path(__file__).resolve().parents[1]
DTYPE_SIZE = {"BF16": 2, "F32": 4, "U8": 1}
SHARD_RE = re.compile(r"model-(\d{5})-of-(\d{6})\.safetensors")


# ---------------------------------------------------------------- helpers

def load_all(path: Path) -> dict:
    """name -> RawTensor over every shard listed in the index."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        _, tensors = read_safetensors_raw(path / shard)
        out.update(tensors)
    return out


def expected_tensors(path: Path) -> dict[str, tuple[str, list[int]]]:
    """Independent re-derivation of the real inventory from config.json alone (k3-hf-format.md section 3)."""
    cfg = json.loads((path / "config.json").read_text())
    tc = cfg["text_config"]
    H, V, nh = tc["hidden_size"], tc["vocab_size"], tc["num_attention_heads"]
    la = tc["linear_attn_config"]
    dk, cw = la["head_dim"], la["short_conv_kernel_size"]
    Di = nh * dk
    qr, kr = tc["q_lora_rank"], tc["kv_lora_rank"]
    dn, dr, dv = tc["qk_nope_head_dim"], tc["qk_rope_head_dim"], tc["v_head_dim"]
    E, L, I = tc["num_experts"], tc["routed_expert_hidden_size"], tc["moe_intermediate_size"]
    S = I * tc["num_shared_experts"]
    mx = "quantization_config" in tc
    dsa = tc.get("dsa_config")
    exp: dict[str, tuple[str, list[int]]] = {}

    def add(name, dtype, shape):
        exp["language_model." + name] = (dtype, list(shape))

    for i in range(tc["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            add(p + n + ".weight", "BF16", [H])
        add(p + "self_attention_res_proj.weight", "BF16", [1, H])
        add(p + "mlp_res_proj.weight", "BF16", [1, H])
        a = p + "self_attn."
        if i + 1 in la["full_attn_layers"]:
            add(a + "q_a_proj.weight", "BF16", [qr, H])
            add(a + "q_a_layernorm.weight", "BF16", [qr])
            add(a + "q_b_proj.weight", "BF16", [nh * (dn + dr), qr])
            add(a + "kv_a_proj_with_mqa.weight", "BF16", [kr + dr, H])
            add(a + "kv_a_layernorm.weight", "BF16", [kr])
            add(a + "kv_b_proj.weight", "BF16", [nh * (dn + dv), kr])
            add(a + "g_proj.weight", "BF16", [nh * dv, H])
            add(a + "o_proj.weight", "BF16", [H, nh * dv])
            if dsa is not None:
                Hi, D = dsa["index_n_heads"], dsa["index_head_dim"]
                add(a + "indexer.wq_b.weight", "BF16", [Hi * D, qr])
                add(a + "indexer.wk.weight", "BF16", [D, H])
                add(a + "indexer.weights_proj.weight", "BF16", [Hi, H])
                add(a + "indexer.k_norm.weight", "BF16", [D])
                add(a + "indexer.k_norm.bias", "BF16", [D])
        else:
            for x in "qkv":
                add(a + f"{x}_proj.weight", "BF16", [Di, H])
                add(a + f"{x}_conv1d.weight", "F32", [Di, 1, cw])
            add(a + "f_a_proj.weight", "BF16", [dk, H])
            add(a + "f_b_proj.weight", "BF16", [Di, dk])
            add(a + "b_proj.weight", "BF16", [nh, H])
            add(a + "A_log", "F32", [math.ceil(nh / 128) * 128])
            add(a + "dt_bias", "F32", [Di])
            add(a + "o_norm.weight", "F32", [dk])
            add(a + "g_proj.weight", "BF16", [Di, H])
            add(a + "o_proj.weight", "BF16", [H, Di])
        if i < tc["first_k_dense_replace"]:
            F = tc["intermediate_size"]
            add(p + "mlp.gate_proj.weight", "BF16", [F, H])
            add(p + "mlp.up_proj.weight", "BF16", [F, H])
            add(p + "mlp.down_proj.weight", "BF16", [H, F])
            continue
        m = p + "block_sparse_moe."
        add(m + "gate.weight", "BF16", [E, H])
        add(m + "gate.e_score_correction_bias", "F32", [E])
        add(m + "routed_expert_down_proj.weight", "BF16", [L, H])
        add(m + "routed_expert_norm.weight", "BF16", [L])
        add(m + "routed_expert_up_proj.weight", "BF16", [H, L])
        add(m + "shared_experts.gate_proj.weight", "BF16", [S, H])
        add(m + "shared_experts.up_proj.weight", "BF16", [S, H])
        add(m + "shared_experts.down_proj.weight", "BF16", [H, S])
        for e in range(E):
            for w, (rows, cols) in {"w1": (I, L), "w2": (L, I), "w3": (I, L)}.items():
                b = f"{m}experts.{e}.{w}."
                if mx:
                    add(b + "weight_packed", "U8", [rows, cols // 2])
                    add(b + "weight_scale", "U8", [rows, cols // 32])
                else:
                    add(b + "weight", "BF16", [rows, cols])
    add("model.embed_tokens.weight", "BF16", [V, H])
    add("lm_head.weight", "BF16", [V, H])
    add("model.norm.weight", "BF16", [H])
    add("model.output_attn_res_norm.weight", "BF16", [H])
    add("model.output_attn_res_proj.weight", "BF16", [1, H])
    return exp


def replay_bpe(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """Lowest-rank-first merge replay restricted to ranks < max_rank (how converters rebuild merges)."""
    parts = [bytes([b]) for b in token]
    while True:
        cands = [(ranks[parts[k] + parts[k + 1]], k) for k in range(len(parts) - 1)
                 if ranks.get(parts[k] + parts[k + 1], max_rank) < max_rank]
        if not cands:
            return parts
        _, k = min(cands)
        parts[k:k + 2] = [parts[k] + parts[k + 1]]


def file_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def k3(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("k3"))


@pytest.fixture(scope="module")
def k31(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("k31"), arch="k31")


# ---------------------------------------------------------------- spec

def test_spec_defaults_and_layer_split():
    s = FixtureSpec()
    assert (s.arch, s.n_layers, s.hidden, s.n_heads, s.n_shards, s.seed) == ("k3", 8, 96, 4, 5, 0)
    assert s.full_attn_layers_1based() == [4, 8]
    assert s.kda_layers_1based() == [1, 2, 3, 5, 6, 7]
    # real K3: 93 layers -> 4, 8, ..., 92, 93
    real = FixtureSpec(n_layers=93).full_attn_layers_1based()
    assert len(real) == 24 and real[-2:] == [92, 93] and real[:2] == [4, 8]
    assert FixtureSpec(full_attn_layers=[2, 1]).full_attn_layers_1based() == [1, 2]


@pytest.mark.parametrize("bad", [
    {"arch": "k4"}, {"n_shards": 2}, {"moe_intermediate_size": 100}, {"routed_expert_hidden_size": 48},
    {"full_attn_layers": [0]}, {"full_attn_layers": [9]}, {"n_layers": 1, "n_shards": 5},
    {"vocab_size": 770},
])
def test_spec_rejects_invalid(bad):
    with pytest.raises(ValueError):
        FixtureSpec(**bad)


# ---------------------------------------------------------------- files, shards, index

def test_repository_files(k3):
    names = {p.name for p in k3.iterdir()}
    shards = {f"model-{i:05d}-of-000005.safetensors" for i in range(1, 6)}
    assert names == shards | {
        "config.json", "model.safetensors.index.json", "tiktoken.model", "tokenizer_config.json",
        "configuration_kimi_k3.py", "modeling_kimi_k3.py", "modeling_kimi_linear.py", "encoding_k3.py"}
    for stub in ("configuration_kimi_k3.py", "modeling_kimi_k3.py", "encoding_k3.py"):
        lines = (k3 / stub).read_text().splitlines()
        assert len(lines) == 1 and lines[0].startswith("#")


def test_index_matches_shards(k3):
    index = json.loads((k3 / "model.safetensors.index.json").read_text())
    assert set(index) == {"metadata", "weight_map"}
    wm = index["weight_map"]
    seen, total = {}, 0
    for shard in sorted(k3.glob("*.safetensors")):
        assert SHARD_RE.fullmatch(shard.name)
        meta, tensors = read_safetensors_raw(shard)
        assert meta == {"format": "pt"}
        for name, t in tensors.items():
            assert name not in seen, f"{name} in two shards"
            seen[name] = shard.name
            assert len(t.data) == math.prod(t.shape) * DTYPE_SIZE[t.dtype], name
            total += len(t.data)
    assert seen == wm
    assert index["metadata"]["total_size"] == total
    assert list(wm) == sorted(wm)          # written with sorted keys, like HF


def test_shard_layout(k3):
    wm = json.loads((k3 / "model.safetensors.index.json").read_text())["weight_map"]
    shard_of = {n: int(SHARD_RE.fullmatch(f).group(1)) for n, f in wm.items()}
    layer_shards = {}
    for name, k in shard_of.items():
        m = re.match(r"language_model\.model\.layers\.(\d+)\.", name)
        if m:
            layer_shards.setdefault(int(m.group(1)), set()).add(k)
        elif name.startswith("language_model."):
            assert k == 3, name
        elif name.startswith("mm_projector."):
            assert k == 4, name
        else:
            assert name.startswith("vision_tower.") and k == 5, name
    # each layer in exactly one of the first n-3 shards, contiguous and in layer order
    order = [layer_shards[i] for i in range(8)]
    assert all(len(s) == 1 for s in order)
    flat = [next(iter(s)) for s in order]
    assert flat == sorted(flat) and set(flat) == {1, 2}


def test_shard_files_are_well_formed(k3):
    # header offsets tile the data area exactly (no gaps, no overlap, nothing trailing)
    for shard in sorted(k3.glob("*.safetensors")):
        blob = shard.read_bytes()
        (n,) = struct.unpack("<Q", blob[:8])
        header = json.loads(blob[8:8 + n])
        header.pop("__metadata__")
        spans = sorted(v["data_offsets"] for v in header.values())
        assert spans[0][0] == 0 and spans[-1][1] == len(blob) - 8 - n
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


# ---------------------------------------------------------------- config

def test_config_top_level(k3):
    cfg = json.loads((k3 / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert cfg["model_type"] == "kimi_k3" and cfg["dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is False
    assert cfg["auto_map"]["AutoConfig"] == "configuration_kimi_k3.KimiK3Config"
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (768, 770, 1023)
    assert cfg["image_placeholder"] == "<|kimi_image_placeholder|>"
    assert "quantization_config" not in cfg and "torch_dtype" not in cfg
    assert {"vt_hidden_size", "mm_hidden_size", "patch_size"} <= set(cfg["vision_config"])
    assert list(cfg) == sorted(cfg)


def test_text_config(k3):
    tc = json.loads((k3 / "config.json").read_text())["text_config"]
    s = FixtureSpec()
    expect = {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "vocab_size": 1024,
        "hidden_size": 96, "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 4,
        "intermediate_size": 192, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "mla_use_nope": True, "mla_use_output_gate": True,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_experts": 16, "num_experts_per_token": 4,
        "num_shared_experts": 2, "moe_intermediate_size": 96, "routed_expert_hidden_size": 64,
        "latent_moe_use_norm": True, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 1.0, "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
        "topk_method": "noaux_tc", "hidden_act": "situ", "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0, "attn_res_block_size": 3, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1048576, "num_nextn_predict_layers": 0, "top_k": 50, "max_length": 20,
        "dtype": "bfloat16", "tie_word_embeddings": False,
    }
    assert {k: tc[k] for k in expect} == expect
    for absent in ("head_dim", "rope_theta", "rope_scaling", "torch_dtype", "n_routed_experts",
                   "num_experts_per_tok", "n_group", "dsa_config"):
        assert absent not in tc
    la = tc["linear_attn_config"]
    assert la == {"full_attn_layers": [4, 8], "kda_layers": [1, 2, 3, 5, 6, 7], "gate_lower_bound": -5.0,
                  "head_dim": s.kda_head_dim, "num_heads": 4, "short_conv_kernel_size": 4,
                  "use_full_rank_gate": True}
    q = tc["quantization_config"]
    assert (q["quant_method"], q["format"]) == ("compressed-tensors", "mxfp4-pack-quantized")
    w = q["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["type"], w["group_size"], w["scale_dtype"]) == (4, "float", 32, "torch.uint8")
    assert q["ignore"] == ["re:.*self_attn.*", "re:.*shared_experts.*",
                           "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*",
                           "re:.*vision_tower.*", "re:.*mm_projector.*"]
    raw = (k3 / "config.json").read_text()
    assert '"re:.*mlp\\\\.(gate|up|gate_up|down)_proj.*"' in raw   # one escaped backslash on disk


# ---------------------------------------------------------------- tensors

def test_tensor_inventory_k3(k3):
    tensors = load_all(k3)
    exp = expected_tensors(k3)
    text = {n: (t.dtype, t.shape) for n, t in tensors.items() if n.startswith("language_model.")}
    assert set(text) == set(exp)
    assert text == exp
    other = [n for n in tensors if not n.startswith("language_model.")]
    assert all(n.startswith(("vision_tower.", "mm_projector.")) for n in other)
    assert all(tensors[n].dtype == "BF16" for n in other)
    for n in ("vision_tower.patch_embed.proj.weight", "vision_tower.patch_embed.pos_emb.weight",
              "vision_tower.encoder.blocks.0.wqkv.weight", "vision_tower.encoder.blocks.1.mlp.fc1.weight",
              "vision_tower.encoder.final_layernorm.weight", "mm_projector.post_norm.weight",
              "mm_projector.proj.0.weight", "mm_projector.proj.2.weight"):
        assert n in tensors, n
    assert tensors["mm_projector.post_norm.weight"].shape == [96]
    assert tensors["mm_projector.proj.2.weight"].shape[0] == 96


def test_tensor_inventory_k31(k31):
    cfg = json.loads((k31 / "config.json").read_text())
    tc = cfg["text_config"]
    assert cfg["architectures"] == ["KimiK31ForConditionalGeneration"]
    assert tc["dsa_config"] == {"index_n_heads": 4, "index_head_dim": 16, "index_topk": 2048, "layers": [4, 8]}
    assert tc["dsa_config"]["layers"] == tc["linear_attn_config"]["full_attn_layers"]
    tensors = load_all(k31)
    text = {n: (t.dtype, t.shape) for n, t in tensors.items() if n.startswith("language_model.")}
    assert text == expected_tensors(k31)
    idx = sorted({int(n.split(".")[3]) for n in tensors if ".indexer." in n})
    assert idx == [3, 7]          # 0-based ids of the 1-indexed DSA layers 4 and 8


def test_k31_shares_k3_weights(k3, k31):
    a, b = load_all(k3), load_all(k31)
    assert set(a) < set(b) and all(".indexer." in n for n in set(b) - set(a))
    assert all(a[n] == b[n] for n in a)


def test_values_are_sane(k3):
    tensors = load_all(k3)
    for name, t in tensors.items():
        v = decode_raw(t)
        if t.dtype != "U8":
            assert np.isfinite(v).all(), name
    get = lambda n: decode_raw(tensors["language_model." + n])
    assert abs(get("model.norm.weight").mean() - 1) < 0.05
    emb = get("model.embed_tokens.weight")
    assert 0.9 < emb.std() < 1.1
    q = get("model.layers.0.self_attn.q_proj.weight")
    assert abs(q.std() * math.sqrt(96) - 1) < 0.1
    router = get("model.layers.1.block_sparse_moe.gate.weight")
    assert abs(router.std() * math.sqrt(96) - 2) < 0.2
    bias = get("model.layers.1.block_sparse_moe.gate.e_score_correction_bias")
    assert len(set(bias.tolist())) == len(bias) and np.abs(bias).max() < 0.1
    # routing depends on the input: different inputs pick different top-k sets
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 96)).astype(np.float32)
    scores = 1 / (1 + np.exp(-(x @ router.T))) + bias
    picks = {tuple(sorted(np.argsort(-s)[:4])) for s in scores}
    assert len(picks) > 16


def test_a_log_padding(k3):
    tensors = load_all(k3)
    for i in (0, 1, 2, 4, 5, 6):
        a = decode_raw(tensors[f"language_model.model.layers.{i}.self_attn.A_log"])
        assert a.shape == (128,)
        assert np.all((a[:4] >= 0) & (a[:4] <= math.log(16)))
        assert np.all(a[:4] != 0) and np.all(a[4:] == 0)


def test_a_log_padding_past_128_heads(tmp_path):
    path = make_checkpoint(tmp_path, n_heads=130, kda_head_dim=2, n_layers=1, n_shards=4, num_experts=4,
                           first_k_dense_replace=1, full_attn_layers=[])
    _, tensors = read_safetensors_raw(path / "model-00001-of-000004.safetensors")
    a = decode_raw(tensors["language_model.model.layers.0.self_attn.A_log"])
    assert a.shape == (256,) and np.all(a[:130] != 0) and np.all(a[130:] == 0)


def test_mxfp4_layout(k3):
    tensors = load_all(k3)
    m = "language_model.model.layers.2.block_sparse_moe.experts.5."
    for w, shape in (("w1", (96, 64)), ("w3", (96, 64)), ("w2", (64, 96))):
        packed = decode_raw(tensors[m + w + ".weight_packed"])
        scale = decode_raw(tensors[m + w + ".weight_scale"])
        assert packed.shape == (shape[0], shape[1] // 2) and scale.shape == (shape[0], shape[1] // 32)
        assert scale.min() >= 124 and scale.max() <= 126
        deq = dequant_mxfp4(packed, scale)
        assert deq.shape == shape and np.isfinite(deq).all()
        assert 0 < np.abs(deq).max() <= 3.0
        # nibble order: element 2i is the low nibble of byte i
        lo = {0: 0.0, 1: 0.5, 2: 1.0, 3: 1.5, 4: 2.0, 5: 3.0, 6: 4.0, 7: 6.0}
        code = int(packed[0, 0] & 0x0F)
        mag = lo[code & 7] * 2.0 ** (int(scale[0, 0]) - 127)
        assert deq[0, 0] == (-mag if code & 8 else mag)


def test_bf16_experts_equal_dequantised_mxfp4(k3, tmp_path):
    bf = load_all(make_checkpoint(tmp_path, experts_mxfp4=False))
    mx = load_all(k3)
    tc = json.loads((tmp_path / "config.json").read_text())["text_config"]
    assert "quantization_config" not in tc
    assert not any(n.endswith(("weight_packed", "weight_scale")) for n in bf)
    m = "language_model.model.layers.7.block_sparse_moe.experts.11.w2."
    ref = dequant_mxfp4(decode_raw(mx[m + "weight_packed"]), decode_raw(mx[m + "weight_scale"]))
    assert bf[m + "weight"].dtype == "BF16"
    np.testing.assert_array_equal(decode_raw(bf[m + "weight"]), ref)


# ---------------------------------------------------------------- bf16 helpers

def test_bf16_round_to_nearest_even():
    vals = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -2.5, np.inf, 0.0], dtype=np.float32)
    bits = np.frombuffer(f32_to_bf16_bytes(vals), dtype="<u2")
    assert bits.tolist() == [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0xC020, 0x7F80, 0x0000]
    nan = bf16_bytes_to_f32(f32_to_bf16_bytes(np.array([np.nan], np.float32)))
    assert np.isnan(nan).all()
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    back = bf16_bytes_to_f32(f32_to_bf16_bytes(x))
    assert np.all(np.abs(back - x) <= np.abs(x) * 2**-8)
    assert bf16_bytes_to_f32(f32_to_bf16_bytes(back)).tobytes() == back.tobytes()


# ---------------------------------------------------------------- determinism

def test_determinism_by_seed(k3, tmp_path):
    same = file_bytes(make_checkpoint(tmp_path / "again"))
    assert same == file_bytes(k3)
    other = file_bytes(make_checkpoint(tmp_path / "seed1", seed=1))
    assert other["config.json"] == same["config.json"]
    assert other["tiktoken.model"] == same["tiktoken.model"]
    for k in range(1, 6):
        name = f"model-{k:05d}-of-000005.safetensors"
        assert other[name] != same[name]


def test_rerun_with_fewer_shards_removes_stale(tmp_path):
    make_checkpoint(tmp_path, n_shards=6)
    make_checkpoint(tmp_path, n_shards=4)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [
        f"model-{k:05d}-of-000004.safetensors" for k in range(1, 5)]


# ---------------------------------------------------------------- tokenizer

def test_tiktoken_model(k3):
    lines = (k3 / "tiktoken.model").read_text().splitlines()
    assert len(lines) == 768
    ranks = {}
    for rank, line in enumerate(lines):
        tok_b64, r = line.split(" ")
        assert int(r) == rank
        tok = base64.b64decode(tok_b64)
        assert tok not in ranks
        ranks[tok] = rank
    assert [t for t, r in sorted(ranks.items(), key=lambda kv: kv[1])[:256]] == [bytes([i]) for i in range(256)]
    for tok, rank in ranks.items():
        if len(tok) > 1:
            parts = replay_bpe(ranks, tok, rank)
            assert len(parts) == 2 and b"".join(parts) == tok, tok


def test_tokenizer_config(k3):
    tk = json.loads((k3 / "tokenizer_config.json").read_text())
    cfg = json.loads((k3 / "config.json").read_text())
    dec = tk["added_tokens_decoder"]
    assert sorted(int(i) for i in dec) == list(range(768, 1024))
    assert all(v["special"] is True for v in dec.values())
    content = {int(i): v["content"] for i, v in dec.items()}
    assert [content[768 + k] for k in range(7)] == [
        "[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>", "<|kimi_image_placeholder|>"]
    assert content[1022] == "[UNK]" and content[1023] == "[PAD]"
    assert content[800] == "<|reserved_token_800|>"
    assert content[cfg["bos_token_id"]] == tk["bos_token"] == "[BOS]"
    assert content[cfg["eos_token_id"]] == "<|end_of_msg|>" and tk["eos_token"] == "[EOS]"
    assert content[cfg["pad_token_id"]] == tk["pad_token"] == "[PAD]"
    assert content[cfg["media_placeholder_token_id"]] == cfg["image_placeholder"]
    assert tk["unk_token"] == "[UNK]" and "model_max_length" in tk
    assert "chat_template" not in tk


# ---------------------------------------------------------------- script entry points

@pytest.mark.parametrize("how", ["module", "file"])
def test_cli(tmp_path, how):
    out = tmp_path / "ck"
    head = [sys.executable, "-m", "kimi_convert.fixtures.make_checkpoint"] if how == "module" else \
        [sys.executable, str(REPO / "fixtures" / "make_checkpoint.py")]
    args = [str(out), "--arch", "k31", "--layers", "4", "--seed", "3", "--n-shards", "4",
            "--no-experts-mxfp4", "--full-attn-layers", "2,4"]
    res = subprocess.run(head + args, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "RuntimeWarning" not in res.stderr
    tc = json.loads((out / "config.json").read_text())["text_config"]
    assert tc["num_hidden_layers"] == 4 and tc["linear_attn_config"]["full_attn_layers"] == [2, 4]
    assert tc["dsa_config"]["layers"] == [2, 4] and "quantization_config" not in tc
    same = make_checkpoint(tmp_path / "lib", arch="k31", n_layers=4, seed=3, n_shards=4,
                           experts_mxfp4=False, full_attn_layers=[2, 4])
    assert file_bytes(same) == file_bytes(out)
