"""Tests for kimi_convert.reference: the PyTorch reference that reads HF checkpoints directly."""

import pytest

torch = pytest.importorskip("torch")

from kimi_convert.reference import E2M1_VALUES, ReferenceModel, dequantize_mxfp4  # noqa: E402


def _make(tmp_path_factory, arch):
    from fixtures.make_checkpoint import make_checkpoint

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
    moe = m.last_routing_margins["moe"]
    assert moe and all(v.shape == (7,) for v in moe.values())
    assert all((v >= 0).all() for v in moe.values())
    assert m.last_routing_margins["dsa"] == {}


def test_k3_causality(k3_dir):
    m = ReferenceModel(k3_dir)
    a = _tokens(m, 9, seed=2)
    b = a[:5] + _tokens(m, 4, seed=3)
    la, lb = m.logits(a), m.logits(b)
    torch.testing.assert_close(la[:5], lb[:5], rtol=1e-5, atol=1e-5)
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
    for v in m.last_routing_margins["dsa"].values():
        assert torch.isnan(v).all()


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
    dsa = m.last_routing_margins["dsa"]
    assert set(dsa) == set(m.cfg.dsa_layers)
    for v in dsa.values():
        assert torch.isnan(v[:2]).all() and (v[2:] >= 0).all()


def test_k31_causality(k31_dir):
    m = ReferenceModel(k31_dir, top_k_override=3)
    a = _tokens(m, 8, seed=4)
    b = a[:4] + _tokens(m, 4, seed=5)
    torch.testing.assert_close(m.logits(a)[:4], m.logits(b)[:4], rtol=1e-5, atol=1e-5)
