"""Tests for kimi_convert.runtime.reference: the PyTorch reference that reads HF checkpoints directly."""

import numpy as np
import pytest

import torch  # noqa: E402  (the test extra installs it; missing torch is a failure)

from kimi_convert.runtime.reference import E2M1_VALUES, ReferenceModel, dequantize_mxfp4  # noqa: E402


def _make(tmp_path_factory, arch):
    from kimi_convert.fixtures.make_checkpoint import make_checkpoint

    return str(make_checkpoint(str(tmp_path_factory.mktemp(arch)), arch=arch, n_layers=8, seed=0))


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    return _make(tmp_path_factory, "k3")


@pytest.fixture(scope="module")
def k31_dir(tmp_path_factory):
    return _make(tmp_path_factory, "k31")


def _tokens(model, T, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.vocab_size, (T,), generator=g).tolist()


# -- MXFP4 -------------------------------------------------------------------------------------------


def test_e2m1_table():
    assert E2M1_VALUES[:8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert E2M1_VALUES[8:].tolist() == [-0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


def test_mxfp4_decode_hand_made_bytes():
    # Row 0: bytes 0x10, 0x32, ... -> element 2i is the low nibble, so codes run 0, 1, 2, 3, ... in order.
    # Scale byte 127 -> 2^0 for row 0; row 1 uses 128 (x2) on the first 32 inputs and 125 (x1/4) on the next 32.
    codes = torch.arange(64) % 16
    row0 = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8)  # [32] bytes
    row1 = torch.full((32,), 0x9F, dtype=torch.uint8)  # low nibble 0xF = -6, high nibble 0x9 = -0.5
    packed = torch.stack([row0, row1])
    scale = torch.tensor([[127, 127], [128, 125]], dtype=torch.uint8)
    w = dequantize_mxfp4(packed, scale)
    assert w.shape == (2, 64) and w.dtype == torch.float32
    lut = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert w[0].tolist() == [lut[c] for c in codes.tolist()]
    assert w[1, :32].tolist() == [-12.0, -1.0] * 16
    assert w[1, 32:].tolist() == [-1.5, -0.125] * 16


def test_mxfp4_extreme_scales_exact():
    packed = torch.tensor([[0x21] * 16, [0x21] * 16], dtype=torch.uint8)  # codes 1, 2 -> 0.5, 1.0
    scale = torch.tensor([[0], [254]], dtype=torch.uint8)
    w = dequantize_mxfp4(packed, scale)
    assert w[0, 0].item() == 0.5 * 2.0**-127 and w[0, 1].item() == 2.0**-127
    assert w[1, 1].item() == 2.0**127
    with pytest.raises(ValueError):
        dequantize_mxfp4(packed, torch.zeros((2, 2), dtype=torch.uint8))


# -- K3 ----------------------------------------------------------------------------------------------


def test_k3_logits_finite_and_shaped(k3_dir):
    m = ReferenceModel(k3_dir)
    toks = _tokens(m, 7)
    out = m.logits(toks)
    assert out.dtype == torch.float32 and out.shape == (7, m.vocab_size)
    assert torch.isfinite(out).all()
    # deterministic
    assert torch.equal(out, m.logits(toks))
    # routing margins recorded for every MoE layer and position
    moe = m.last_routing_margins.moe
    assert moe and all(v.shape == (7,) for v in moe.values())
    assert all((v >= 0).all() for v in moe.values())
    assert m.last_routing_margins.dsa == {}


def test_k3_causality(k3_dir):
    m = ReferenceModel(k3_dir)
    a = _tokens(m, 9, seed=2)
    b = a[:5] + _tokens(m, 4, seed=3)
    la, lb = m.logits(a), m.logits(b)
    # exact: every op is row-local or masked, and experts run one token at a time
    assert torch.equal(la[:5], lb[:5])
    assert not torch.allclose(la[5:], lb[5:])


def test_k3_hidden_states(k3_dir):
    m = ReferenceModel(k3_dir)
    toks = _tokens(m, 4)
    y, layers = m.hidden_states(toks, all_layers=True)
    assert len(layers) == m.cfg.n_layers and y.shape == (4, m.cfg.hidden_size)
    assert torch.equal(m.hidden_states(toks), y)


def test_hf_mla_eps_is_an_option(k3_dir):
    m = ReferenceModel(k3_dir)
    h = ReferenceModel(k3_dir, hf_mla_eps=True)
    assert m.mla_eps == m.cfg.rms_norm_eps and h.mla_eps == 1e-6
    toks = _tokens(m, 5)
    torch.testing.assert_close(m.logits(toks), h.logits(toks), rtol=1e-2, atol=1e-2)


def test_uncached_path_matches_cached(k3_dir):
    toks = _tokens(ReferenceModel(k3_dir), 5)
    a = ReferenceModel(k3_dir, cache_weights=True).logits(toks)
    b = ReferenceModel(k3_dir, cache_weights=False).logits(toks)
    assert torch.equal(a, b)


# -- K3.1 --------------------------------------------------------------------------------------------


def test_k31_logits_finite_and_shaped(k31_dir):
    m = ReferenceModel(k31_dir)
    assert m.is_k31
    out = m.logits(_tokens(m, 6))
    assert out.shape == (6, m.vocab_size) and torch.isfinite(out).all()


def test_k31_large_top_k_equals_dense(k31_dir):
    T = 8
    m = ReferenceModel(k31_dir, top_k_override=T)
    toks = _tokens(m, T)
    sparse = m.logits(toks)
    dense = ReferenceModel(k31_dir, use_indexer=False).logits(toks)
    assert torch.equal(sparse, dense)
    # every position keeps all its keys, so no DSA margin is defined
    for v in m.last_routing_margins.dsa.values():
        assert np.isnan(v).all()


def test_k31_small_top_k_differs_from_position_2(k31_dir):
    T = 8
    dense_model = ReferenceModel(k31_dir, use_indexer=False)
    toks = _tokens(dense_model, T)
    dense = dense_model.logits(toks)
    m = ReferenceModel(k31_dir, top_k_override=2)
    sparse = m.logits(toks)
    assert torch.equal(sparse[:2], dense[:2])
    for t in range(2, T):
        assert not torch.allclose(sparse[t], dense[t]), t
    dsa = m.last_routing_margins.dsa
    assert set(dsa) == set(m.cfg.dsa_layers)
    for v in dsa.values():
        assert np.isnan(v[:2]).all() and (v[2:] >= 0).all()


def test_k31_causality(k31_dir):
    m = ReferenceModel(k31_dir, top_k_override=3)
    a = _tokens(m, 8, seed=4)
    b = a[:4] + _tokens(m, 4, seed=5)
    assert torch.equal(m.logits(a)[:4], m.logits(b)[:4])


# -- checkpoint variants -----------------------------------------------------------------------------


def test_bf16_experts_match_mxfp4_experts(tmp_path):
    # the fixture's BF16 experts are the exact dequantisation of its MXFP4 ones
    from kimi_convert.fixtures.make_checkpoint import make_checkpoint

    mx = ReferenceModel(str(make_checkpoint(str(tmp_path / "mx"), arch="k3", n_layers=3, seed=0)))
    bf = ReferenceModel(str(make_checkpoint(str(tmp_path / "bf"), arch="k3", n_layers=3, seed=0,
                                            experts_mxfp4=False)))
    toks = _tokens(mx, 6)
    assert torch.equal(mx.logits(toks), bf.logits(toks))


@pytest.mark.parametrize("rename", [
    lambda n: n.replace("language_model.model.layers.", "language_model.layers."),  # vLLM-style export
    lambda n: n.removeprefix("language_model."),  # no outer prefix
])
def test_name_variants_and_unsharded_file(tmp_path, rename):
    import json
    import os
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    from kimi_convert.fixtures.make_checkpoint import make_checkpoint

    src = str(make_checkpoint(str(tmp_path / "src"), arch="k31", n_layers=4, seed=0))
    dst = tmp_path / "dst"
    dst.mkdir()
    shutil.copy(os.path.join(src, "config.json"), dst / "config.json")
    with open(os.path.join(src, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    tensors = {}
    for name, shard in weight_map.items():
        if name.startswith("language_model."):
            with safe_open(os.path.join(src, shard), framework="pt") as f:
                tensors[rename(name)] = f.get_tensor(name)
    save_file(tensors, str(dst / "model.safetensors"))  # no index.json: single-file path

    a = ReferenceModel(src, top_k_override=2)
    toks = _tokens(a, 5)
    assert torch.equal(a.logits(toks), ReferenceModel(str(dst), top_k_override=2).logits(toks))


def test_dsa_config_aliases_and_errors():
    from kimi_convert.runtime.reference import ReferenceConfig

    def cfg(dsa, arch="KimiK31ForConditionalGeneration", **extra):
        tc = {"num_hidden_layers": 4, "hidden_size": 8, "num_attention_heads": 2, "top_k": 50,
              "linear_attn_config": {"full_attn_layers": [4], "kda_layers": [1, 2, 3]}, **extra}
        if dsa is not None:
            tc["dsa_config"] = dsa
        return ReferenceConfig.from_hf({"architectures": [arch], "text_config": tc})

    c = cfg({"head_count": 2, "key_length": 4, "topk": 3, "indexer_layers": [4]})
    assert (c.index_n_heads, c.index_head_dim, c.index_topk, c.dsa_layers) == (2, 4, 3, frozenset({3}))
    c = cfg({"n_heads": 2, "head_dim": 4, "top_k": 3})  # no layer list: the full-attention layers
    assert c.dsa_layers == frozenset({3})
    # DeepSeek-style keys directly in text_config; the generic `top_k: 50` noise is never read
    c = cfg(None, index_n_heads=2, index_head_dim=4, index_topk=7)
    assert c.index_topk == 7
    with pytest.raises(ValueError):
        cfg(None)  # K3.1 architecture without indexer settings
    with pytest.raises(ValueError):
        cfg({"index_n_heads": 2, "index_head_dim": 4})  # no top_k
    with pytest.raises(ValueError):
        cfg({"index_n_heads": 2, "index_head_dim": 4, "index_topk": 3, "layers": [3]})  # not the MLA layers
    assert cfg(None, arch="KimiK3ForConditionalGeneration").dsa_layers == frozenset()
