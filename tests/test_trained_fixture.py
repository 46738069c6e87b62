"""The trained K3 / K3.1-Pro fixture (fixtures/trained.py, issue 27 part 2): it learned something real, it is
stored in the real format (MXFP4 experts), converts to a GGUF the engine runs to the same loss, its routers and
indexer make real decisions, and its training is reproducible byte for byte."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kimi_convert.fixtures import trained as tr
from kimi_convert.fixtures.make_checkpoint import read_safetensors_raw

HELDOUT_CHUNKS = 16            # 16 x 128 held-out tokens: enough for the bounds below, fast on 2 cores
PPL_FRACTION = 0.5             # the bound: held-out perplexity <= half the unigram perplexity
NEAR_TIE = 1e-3                # a router "near tie": k-th minus (k+1)-th biased score below this
NEAR_TIE_SHARE = 0.05          # at most this share of the routed tokens of any MoE layer
INDEXER_MASS = 0.75            # the kept tokens hold at least this share of the main attention (t >= top_k)


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory) -> Path:
    return tr.write(tmp_path_factory.mktemp("trained") / "k3", "k3")


@pytest.fixture(scope="module")
def k31_dir(tmp_path_factory) -> Path:
    return tr.write(tmp_path_factory.mktemp("trained") / "k31", "k31")


@pytest.fixture(scope="module")
def data(k3_dir):
    train_ids = tr.tokenize(tr.read_text("train"), k3_dir)
    held = tr.heldout_chunks(tr.tokenize(tr.read_text("heldout"), k3_dir), HELDOUT_CHUNKS)
    assert held.shape == (HELDOUT_CHUNKS, tr.CTX)
    return train_ids, held, tr.unigram_ppl(train_ids, held, tr.fixture_spec("k3").vocab_size)


@pytest.fixture(scope="module")
def k3_gguf(k3_dir, tmp_path_factory) -> Path:
    from kimi_convert.convert.converter import build_plan, convert
    out = tmp_path_factory.mktemp("trained_gguf") / "k3-bf16.gguf"
    convert(build_plan(k3_dir, "bf16"), out)
    return out


@pytest.fixture(scope="module")
def k3_eval(k3_dir, data):
    return tr.evaluate(k3_dir, data[1])


def test_heldout_perplexity_at_most_half_the_unigram(k3_eval, data):
    _, _, unigram = data
    assert unigram > 50                                     # a real vocabulary over real text
    assert k3_eval.ppl <= PPL_FRACTION * unigram, (k3_eval.ppl, unigram)


def test_converted_gguf_runs_to_the_same_loss(k3_gguf, k3_eval, data):
    """kimi-convert's BF16 GGUF on the engine (llama.cpp's activation rounding) keeps the trained loss."""
    ev = tr.evaluate(k3_gguf, data[1], rounding=True)
    assert abs(ev.nll - k3_eval.nll) < 0.005, (ev.nll, k3_eval.nll)        # measured 3e-4
    assert ev.ppl <= PPL_FRACTION * data[2]


def test_round_trip_of_the_trained_weights(k3_dir, k3_gguf, data):
    """The GGUF-space model read back from the checkpoint writes the same HF tensors bit for bit, and its
    forward (the trainer's) equals the engine on the converted file: the inversion of every rule is exact."""
    model = tr.model_from_checkpoint(k3_dir, "k3")
    again = tr.hf_values(model, "k3")
    stored = tr.read_hf_values(k3_dir)
    assert again.keys() == stored.keys()
    for name, v in stored.items():
        assert np.array_equal(again[name], v), name
    held = data[1]
    nll = tr.model_nll(model, held)
    ev = tr.evaluate(k3_gguf, held, rounding=False)
    assert abs(nll - ev.nll) < 1e-4, (nll, ev.nll)


def test_routers_have_margins_and_use_every_expert(k3_eval):
    assert len(k3_eval.margins) == 3
    for il, m in k3_eval.margins.items():
        assert (m < NEAR_TIE).mean() <= NEAR_TIE_SHARE, (il, (m < NEAR_TIE).mean())
        assert np.median(m) > 10 * NEAR_TIE, (il, np.median(m))
        load = k3_eval.expert_load[il]
        assert len(load) >= 32 and (load > 0).all(), (il, load)


def test_routed_experts_are_stored_as_mxfp4(k3_dir):
    spec = tr.fixture_spec("k3")
    cfg = json.loads((k3_dir / "config.json").read_text())["text_config"]
    assert cfg["quantization_config"]["format"] == "mxfp4-pack-quantized"
    assert cfg["num_experts"] >= 32 and cfg["num_experts_per_token"] * 8 <= cfg["num_experts"]
    headers = {}
    for f in sorted(k3_dir.glob("model-*.safetensors")):
        headers |= {n: (t.dtype, t.shape) for n, t in read_safetensors_raw(f)[1].items()}
    experts = [n for n in headers if ".experts." in n]
    assert len(experts) == 3 * spec.num_experts * 3 * 2          # 3 MoE layers, w1/w2/w3, packed + scale
    I, L = spec.moe_intermediate_size, spec.routed_expert_hidden_size
    assert I % 256 == 0 and L % 256 == 0                          # rows the low-bit types take whole
    m = "language_model.model.layers.1.block_sparse_moe.experts.0."
    assert headers[m + "w1.weight_packed"] == ("U8", [I, L // 2])
    assert headers[m + "w1.weight_scale"] == ("U8", [I, L // 32])
    assert headers[m + "w2.weight_packed"] == ("U8", [L, I // 2])


def test_k31_indexer_selects_the_attention_mass(k31_dir, data, k3_eval):
    cfg = json.loads((k31_dir / "config.json").read_text())["text_config"]
    assert cfg["dsa_config"]["index_topk"] < tr.CTX                # it really selects
    ev = tr.evaluate(k31_dir, data[1])
    assert len(ev.indexer_mass) == 2
    for il, mass in ev.indexer_mass.items():
        assert mass >= INDEXER_MASS, (il, mass)
        assert mass > ev.recent_mass[il], (il, mass, ev.recent_mass[il])   # better than the last top_k tokens
    assert ev.ppl <= PPL_FRACTION * data[2]
    assert abs(ev.nll - k3_eval.nll) < 0.05          # the sparse attention keeps the dense model's quality


def test_training_is_reproducible(tmp_path):
    """The same short training command twice writes the same bytes."""
    outs = []
    for k in range(2):
        out = tmp_path / f"run{k}"
        assert tr.main([str(out), "--arch", "k31", "--train", "--steps", "1"]) == 0
        outs.append(out)
    names = sorted(p.name for p in outs[0].iterdir())
    assert names == sorted(p.name for p in outs[1].iterdir())
    for n in names:
        assert (outs[0] / n).read_bytes() == (outs[1] / n).read_bytes(), n


def test_another_seed_is_another_model_and_needs_train(tmp_path):
    """--seed N (bench_quality.py --seed: an independent model of the same recipe) changes the weights; without
    --train, or with --save-shipped, it is a usage error (the shipped weights are seed 0's)."""
    a, b = (tr.train("k3", tr.Schedule.short(1), log=lambda s: None, seed=s) for s in (tr.SEED, tr.SEED + 1))
    assert a.keys() == b.keys()
    embed = next(n for n in sorted(a) if n.endswith("embed_tokens.weight"))
    assert not np.array_equal(a[embed], b[embed])
    for argv in ([str(tmp_path / "x"), "--seed", "1"], ["--train", "--save-shipped", "--seed", "1"]):
        with pytest.raises(SystemExit) as e:
            tr.main(argv)
        assert e.value.code == 2
    assert not (tmp_path / "x").exists()


def test_the_deep_shape_is_k3s_layer_pattern_and_converts(tmp_path):
    """--shape deep (bench_quality.py --shape deep: a model the role prior never saw) writes 8 layers in K3's
    3:1 KDA:MLA pattern with 64 experts, 4 a token, as MXFP4, which kimi-convert converts with every tensor; without
    --train, or with --save-shipped, it is a usage error (only the small shape is shipped)."""
    from kimi_convert.convert.converter import build_plan, convert
    from kimi_convert.engine.weights import open_source
    out = tmp_path / "deep"
    assert tr.main([str(out), "--arch", "k3", "--train", "--steps", "1", "--shape", "deep"]) == 0
    cfg = json.loads((out / "config.json").read_text())["text_config"]
    assert (cfg["num_hidden_layers"], cfg["num_experts"], cfg["num_experts_per_token"]) == (8, 64, 4)
    gguf = tmp_path / "deep.gguf"
    convert(build_plan(out, "bf16"), gguf)
    src = open_source(gguf)
    assert src.shape("blk.7.ffn_gate_exps.weight")[0] == 64
    mla = sorted({int(n.split(".")[1]) for n in src.names() if ".attn_kv_a_mqa." in n})
    assert mla == [3, 7]
    for argv in ([str(tmp_path / "x"), "--shape", "deep"], ["--train", "--save-shipped", "--shape", "deep"]):
        with pytest.raises(SystemExit) as e:
            tr.main(argv)
        assert e.value.code == 2
    assert not (tmp_path / "x").exists()
