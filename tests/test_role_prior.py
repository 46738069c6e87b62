"""The role prior (quant/target/prior.py): each role's scale is the geometric mean of KLD / weight error over its
measured pairs, the shipped file is what benchmarks/role_prior.py makes from the committed quality run, and a
role the prior does not know takes the mean of all and is named."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as QT

from kimi_convert.quant.target.prior import PRIOR_FILE, RolePrior, WeightErrors, role, role_scales, shipped_prior

ROOT = Path(__file__).resolve().parents[1]


class Unit:
    def __init__(self, key: str):
        self.key = key


def test_a_role_is_its_key_without_the_layer():
    assert role("blk.17.attn_q_b.weight") == "attn_q_b.weight"
    assert role("blk.3.ffn_gate_up_exps") == "ffn_gate_up_exps"
    assert role("token_embd.weight") == "token_embd.weight"


def test_scale_is_the_geometric_mean_of_kld_over_weight_error():
    pairs = [("blk.1.attn_q.weight", "Q4_K", 2.0, 8.0),            # ratio 4
             ("blk.2.attn_q.weight", "Q2_K", 10.0, 10.0),          # ratio 1
             ("blk.1.ffn_down_exps", "IQ1_S", 100.0, 1.0),         # ratio 0.01
             ("blk.1.ffn_up_exps", "IQ1_S", 0.0, 1.0),             # no weight error: says nothing
             ("output.weight", "Q4_K", 1.0, 0.0)]                  # no divergence: says nothing
    assert role_scales(pairs) == pytest.approx({"attn_q.weight": 2.0, "ffn_down_exps": 0.01})


def test_shipped_prior_is_the_committed_quality_runs_measurement():
    """role_prior.json = benchmarks/role_prior.py on docs/quality/quality-k3.json: one source of truth."""
    pairs = json.loads((ROOT / "docs/quality/quality-k3.json").read_text())["meta"]["correlation"]["pairs"]
    shipped = json.loads(PRIOR_FILE.read_text())["scales"]
    measured = role_scales(pairs)
    assert set(shipped) == set(measured)
    for r, s in measured.items():
        assert shipped[r] == pytest.approx(s, rel=1e-3), r
    # what the prior says: a unit of a routed expert's weight error costs the output an order of magnitude less
    # than one of the tensors every token runs through (geometric means over the roles; the token shares are
    # already in the weight error)
    def mean(xs):
        return math.exp(sum(map(math.log, xs)) / len(xs))
    experts = [s for r, s in shipped.items() if r.endswith("_exps")]
    assert experts and 10 * mean(experts) < mean([s for r, s in shipped.items() if not r.endswith("_exps")])


def test_costs_scale_each_decision_by_its_role_and_unknown_roles_take_the_mean():
    prior = RolePrior({"attn_q.weight": 4.0, "ffn_down_exps": 0.25}, "a test")
    units = [Unit("blk.1.attn_q.weight"), Unit("blk.1.ffn_down_exps"), Unit("blk.1.indexer.proj.weight")]
    types = [[QT.Q4_K, QT.Q2_K], [QT.IQ1_S], [QT.Q8_0]]
    errors = [{QT.Q4_K: 1.0, QT.Q2_K: 3.0}, {QT.IQ1_S: 8.0}, {QT.Q8_0: 2.0}]
    assert prior(units, types, errors) == [{QT.Q4_K: 4.0, QT.Q2_K: 12.0}, {QT.IQ1_S: 2.0}, {QT.Q8_0: 2.0}]
    assert "indexer.proj.weight" in prior.describe() and "a test" in prior.describe()
    assert WeightErrors()(units, types, errors) == errors
    assert not prior.hull_only and not WeightErrors().hull_only     # the exact search sees every candidate


@pytest.mark.parametrize("scales", [{}, {"a": 0.0}, {"a": -1.0}, {"a": math.inf}, {"a": math.nan}])
def test_a_prior_needs_a_positive_finite_scale_per_role(scales):
    with pytest.raises(ValueError, match="positive, finite"):
        RolePrior(scales, "bad.json")


def test_shipped_prior_loads_with_its_provenance():
    prior = shipped_prior()
    assert "trained K3 fixture" in prior.source and len(prior.scales) >= 20
