"""--sensitivity kld (kimi_convert/quant/target/sensitivity.py) on the trained K3 fixture: a decision's measured KL
cost is the output's divergence with that decision alone quantized (the layers after it run once for all its
types, equal to running each type alone), it orders types by what they lose, embeddings and the output head are
measured through their own paths, and the solver spends the budget by these costs and nothing else."""
from __future__ import annotations


import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from kimi_convert.convert.converter import build_plan, convert
from kimi_convert.engine.tokens import chunk_tokens, model_tokenizer, text_tokens
from kimi_convert.fixtures import trained
from kimi_convert.fixtures.imatrix import k3_entries, write_gguf_imatrix
from kimi_convert.gguf_io import open_gguf
from kimi_convert.quant.driver import plan_file
from kimi_convert.quant.imatrix import load_imatrix
from kimi_convert.quant.plan import PlanOptions
from kimi_convert.quant.target.budget import parse_budget
from kimi_convert.quant.target.choose import choose, no_base
from kimi_convert.quant.target.sensitivity import KldCosts, Sensitivity, sampled_layers
from kimi_convert.quant.target.units import split_decisions

CHUNKS = 2
REQUANTIZE = PlanOptions(allow_requantize=True)       # --allow-requantize: the MXFP4 experts free


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("sensitivity")
    gguf = d / "k3.gguf"
    convert(build_plan(trained.write(d / "hf", "k3"), "bf16"), gguf)
    gf = open_gguf(gguf)
    shapes = {n: tuple(t.shape) for n, t in gf.tensors.items()}
    imatrix = load_imatrix(write_gguf_imatrix(d / "imatrix.gguf", k3_entries(shapes), chunk_size=128))
    text = d / "train.txt"
    text.write_text(trained.read_text("heldout")[:60_000])
    ids = chunk_tokens(text_tokens(text, model_tokenizer(gguf)), 128, CHUNKS, None, text)
    plan = plan_file(gf, no_base(), REQUANTIZE, imatrix=True)
    units = {u.key: u for u in split_decisions(plan, lambda d: imatrix.has_vector(d.name, d.shape)).units}
    return gguf, imatrix, text, ids, units


def test_types_run_together_equal_each_alone_and_fewer_bits_lose_more(model):
    gguf, imatrix, _, ids, units = model
    sens = Sensitivity(gguf, ids, imatrix)
    unit = units["blk.2.ffn_gate_up_exps"]
    joined = sens.costs(unit, [QT.IQ1_S, QT.Q4_K, unit.source])
    alone = {t: Sensitivity(gguf, ids, imatrix)._measure(unit, [t])[0] for t in (QT.IQ1_S, QT.Q4_K)}
    for t, v in alone.items():
        assert joined[t] == pytest.approx(v, rel=1e-3, abs=1e-7), t
    assert joined[unit.source] == 0.0                              # keeping the stored type loses nothing
    assert joined[QT.IQ1_S] > 3 * joined[QT.Q4_K] > 0


def test_embedding_and_output_have_their_own_paths(model):
    gguf, imatrix, _, ids, units = model
    sens = Sensitivity(gguf, ids, imatrix)
    out = sens.costs(units["output.weight"], [QT.Q2_K, QT.Q8_0])
    emb = sens.costs(units["token_embd.weight"], [QT.Q2_K])
    assert out[QT.Q2_K] > 10 * out[QT.Q8_0] > 0
    assert emb[QT.Q2_K] > 0


def test_costs_are_cached_by_model_tokens_and_type(model, tmp_path):
    gguf, imatrix, _, ids, units = model
    unit = units["blk.3.attn_q_b.weight"]
    first = Sensitivity(gguf, ids, imatrix, cache_dir=tmp_path)
    a = first.costs(unit, [QT.Q2_K])
    second = Sensitivity(gguf, ids, imatrix, cache_dir=tmp_path)
    assert second.costs(unit, [QT.Q2_K]) == a and (second.measured, second.cached) == (0, 1)
    other = Sensitivity(gguf, ids[:1], imatrix, cache_dir=tmp_path)         # other tokens: measured again
    other.costs(unit, [QT.Q2_K])
    assert other.measured == 1


class Stated:
    """Costs stated, not measured: one decision loses nothing at its smallest type, every other one loses
    in proportion to the bits it gives up; asked of the weight errors' hull types only, as KldCosts."""
    hull_only = True

    def __init__(self, free: str):
        self.free, self.asked = free, []

    def __call__(self, units, types, errors):
        self.asked = [(u.key, ts) for u, ts in zip(units, types)]
        out = []
        for u, ts in zip(units, types):
            top = u.nbytes(u.candidates[-1])
            out.append({t: 0.0 if (u.key == self.free or t == u.source) else (top - u.nbytes(t)) / top * 1e3
                        for t in ts})
        return out

    def describe(self) -> str:
        return "stated costs (test)"


def test_the_solver_spends_the_budget_by_the_measured_costs(model):
    gguf, imatrix, *_ = model
    gf = open_gguf(gguf)
    free = "blk.1.ffn_down_exps"
    stated = Stated(free)
    choice = choose(gf, no_base(), parse_budget("12MB", None), imatrix, sensitivity=stated, options=REQUANTIZE)
    assert "stated costs (test)" in choice.text                      # the policy says what it was chosen by
    asked = dict(stated.asked)
    smallest = asked[free][0]                                              # the hull is ordered by bytes
    plan = plan_file(gf, choice.policy, REQUANTIZE, imatrix=True)
    chosen = {d.name: d.target for d in plan.decisions}
    assert chosen["blk.1.ffn_down_exps.weight"] == smallest                # free: the smallest type it was offered
    assert chosen["blk.2.ffn_down_exps.weight"] != smallest                # the same tensor elsewhere is not free
    assert choice.nbytes <= 12_000_000
    units = {u.key: u for u in split_decisions(plan_file(gf, no_base(), REQUANTIZE, imatrix=True),
                                               lambda d: imatrix.has_vector(d.name, d.shape)).units}
    for key, ts in stated.asked:                             # offered: the weight errors' hull, smallest first
        sizes = [units[key].nbytes(t) for t in ts]
        assert set(ts) <= set(units[key].candidates) and sizes == sorted(sizes), key


def test_kld_costs_describe_what_they_measured(model):
    gguf, imatrix, text, ids, units = model
    costs = KldCosts(Sensitivity(gguf, ids, imatrix), text)
    assert f"{CHUNKS} chunks of 128 tokens of {text}" in costs.describe()


class Key:
    def __init__(self, key: str):
        self.key = key


def test_sampled_layers_take_each_kind_evenly_first_and_last():
    """K3's 93 layers: a dense first layer, then KDA and MLA layers with routed experts (every 4th is MLA);
    layers are of one kind when their decisions have the same roles."""
    keys = [Key("token_embd.weight"), Key("output.weight")]
    for il in range(93):
        attn = ["attn_q_a.weight", "attn_kv_a_mqa.weight"] if il % 4 == 3 else ["attn_q.weight", "ssm_beta.weight"]
        ffn = ["ffn_gate.weight", "ffn_down.weight"] if il == 0 else ["ffn_gate_up_exps", "ffn_down_exps"]
        keys += [Key(f"blk.{il}.{r}") for r in attn + ffn]
    mla = [il for il in range(93) if il % 4 == 3]
    kda = [il for il in range(1, 93) if il % 4 != 3]
    assert sampled_layers(keys, 0) == set(range(93))
    assert sampled_layers(keys, 1) == {0, mla[0], kda[0]}
    four = sampled_layers(keys, 4)
    assert len(four) == 9 and {0, mla[0], mla[-1], kda[0], kda[-1]} <= four
    assert len(mla) == 23 and sorted(il for il in four if il in mla) == [mla[0], mla[7], mla[15], mla[22]]  # 22/3
    assert sampled_layers(keys, 100) == set(range(93))


def test_unsampled_decisions_cost_their_weight_error_times_their_roles_measured_scale(model):
    gguf, imatrix, text, ids, units = model
    picked = [units[f"blk.{il}.attn_output.weight"] for il in range(4)] + \
             [units[f"blk.{il}.ffn_gate_up_exps"] for il in (1, 2, 3)]
    types = [[QT.Q4_0] if u.expert else [QT.Q4_0, QT.Q8_0] for u in picked]       # fast kernels: the scaling is tested
    errors = [{t: 1e-3 * (i + 1) * (4 if t == QT.Q4_0 else 1) for t in ts} for i, ts in enumerate(types)]
    sens, notes = Sensitivity(gguf, ids, imatrix), []
    costs = KldCosts(sens, text, notes.append, layers_per_kind=2)(picked, types, errors)
    # said before measuring: what is measured and what it costs (the passes: 8 variants from layers 0, 1, 3)
    assert notes[0].startswith("sensitivity: 5 of 7 decisions measured (layers [0, 1, 3]): "
                               f"{4 + 2 * 4 + 3 * 3 + 3 * 1:,} layer passes over 256 tokens"), notes[0]
    assert " s a pass" in notes[0]
    # the kinds: layer 0 (attention only here), layers 1-3 (attention and experts): 0, 1 and 3 are measured
    assert sens.measured == 3 * 2 + 2 * 1
    for k in (2, 5):                                    # layer 2's two decisions: estimated
        same_role = [i for i in range(len(picked)) if i != k and picked[i].key.split(".", 2)[2] ==
                     picked[k].key.split(".", 2)[2]]
        for t in types[k]:
            ratios = [costs[i][t] / errors[i][t] for i in same_role if LAYER_OF(picked[i]) in (0, 1, 3)]
            assert costs[k][t] == pytest.approx(errors[k][t] * float(np.exp(np.mean(np.log(ratios)))), rel=1e-9)
    described = KldCosts(sens, text, layers_per_kind=2)
    described(picked, types, errors)
    assert "the decisions of 2 layer(s) of each kind measured" in described.describe()
    assert "layer(s) of each kind" not in KldCosts(sens, text).describe()


def LAYER_OF(u) -> int:
    return int(u.key.split(".")[1])


def test_the_decisions_of_one_layer_run_together_equal_each_alone(model):
    """costs_of joins every variant that starts at a layer (the layers after it read once for all of them);
    max_variants=1 runs each variant alone."""
    gguf, imatrix, _, ids, units = model
    picked = [units["blk.2.attn_output.weight"], units["blk.2.ffn_gate_up_exps"], units["token_embd.weight"],
              units["blk.0.attn_output.weight"]]
    types = [[QT.Q4_0, QT.Q8_0], [QT.Q4_0], [QT.Q4_0], [QT.Q4_0]]
    together = Sensitivity(gguf, ids, imatrix)
    assert together.max_variants >= 3
    joined = together.costs_of(picked, types)
    alone = Sensitivity(gguf, ids, imatrix, max_variants=1).costs_of(picked, types)
    for j, a in zip(joined, alone):
        for t in a:
            assert j[t] == pytest.approx(a[t], rel=1e-3, abs=1e-7), t
    assert joined[0][QT.Q4_0] > joined[0][QT.Q8_0] > 0 and together.measured == 5
