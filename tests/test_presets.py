"""The shipped presets (kimi_convert/quant/presets/*.toml): they parse, every tensor of the real K3 / K3.1-Pro gets a
stated reason, their planned sizes on the real shapes agree with shared/reference/quant-presets.md, the protections
hold, and a preset's `requires` refuses a run that lacks what it needs, as one `error:` line before any work."""
from __future__ import annotations

import re
from functools import lru_cache

import pytest
from gguf import GGMLQuantizationType as QT

from kimi_convert.convert.converter import OUTTYPES, build_plan, convert
from kimi_convert.fixtures.imatrix import k3_entries, write_gguf_imatrix
from kimi_convert.fixtures.make_checkpoint import build_config, make_checkpoint
from kimi_convert.fixtures.real_size import REAL_VISION, real_spec
from kimi_convert.gguf_io import open_gguf, tensor_nbytes
from kimi_convert.model import KimiConfig
from kimi_convert.quant.driver import quantize_file
from kimi_convert.quant.mixtures import FILE_TYPES
from kimi_convert.quant.plan import PlanOptions, QuantPlan, plan_quantization
from kimi_convert.quant.policy import PRESETS, PolicyError, load_policy, parse_policy, preset_names
from kimi_convert.tensor_map import gguf_tensor_types
from test_convert_errors import assert_fails_cleanly
from test_quantize_cli import quantize

K3_PRESETS = ("k3-native", "k3-q4", "k3-q2", "k3-iq1", "k3-iq2")
IQ_PRESETS = {"k3-iq1": 600, "k3-iq2": 800}       # issue 17: at most these GB of tensor data on the real model
GB = 1e9                      # quant-presets.md sizes are decimal GB
EXPERTS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


@lru_cache(maxsize=2)
def real_tensors(arch: str) -> tuple:
    """(name, shape, type) of every tensor kimi-convert writes for the release's config: no file needed."""
    return tuple(gguf_tensor_types(KimiConfig.from_hf(build_config(real_spec(arch), REAL_VISION))))


@lru_cache(maxsize=16)
def real_plan(preset: str, arch: str) -> QuantPlan:
    """The one planning path (quant.plan), with what the preset requires given; strict: no rule of a shipped
    preset may name a protected tensor."""
    pol = load_policy(preset)
    return plan_quantization(real_tensors(arch), pol,
                             PlanOptions(allow_requantize="allow-requantize" in pol.requires, strict=True))


@pytest.mark.parametrize("arch,outtype,mxfp4", [("k3", "bf16", True), ("k31", "f32", True), ("k3", "bf16", False)])
def test_sizing_without_a_file_uses_the_converters_types(arch, outtype, mxfp4, tmp_path):
    """gguf_tensor_types(cfg) is what kimi-convert's plan writes, tensor for tensor, so the sizes below are the
    sizes of the files kimi-quantize and kimi-convert --policy would write."""
    hf = make_checkpoint(tmp_path / arch, arch=arch, experts_mxfp4=mxfp4)
    plan = build_plan(hf, outtype)
    assert {t.name: (tuple(t.shape), t.qtype) for t in plan.tensors} == {
        n: (s, q) for n, s, q in gguf_tensor_types(plan.config, OUTTYPES[outtype])}


def test_every_preset_parses_and_is_documented():
    assert set(preset_names()) >= {"q8_0", *K3_PRESETS}
    for name in preset_names():
        pol = load_policy(name)
        assert pol.description, name
        assert all(r.why for r in pol.rules), (name, [r.origin for r in pol.rules if not r.why])


@pytest.mark.parametrize("arch", ["k3", "k31"])
@pytest.mark.parametrize("preset", K3_PRESETS)
def test_every_real_tensor_has_a_reason(preset, arch):
    """Line by line: each tensor is held by a protection or named by a rule with its `why`; none is left to the
    default (which is there for files that are not the release, e.g. BF16 experts)."""
    plan = real_plan(preset, arch)
    for d in plan.decisions:
        assert not d.why.startswith("default"), d
        assert d.why.startswith("protected") or (d.rule is not None and d.rule.why in d.why), d


# The figures are quant-presets.md section 3's "size" row: k3-native "≈1,508 GB", k3-q2 "≈1,048 GB". They are
# rounded to the GB and computed from class totals given to three figures (56.1 B weights, 2.72 T experts), and
# count what k3-native keeps at BF16 (0.62 B weights: ssm_f_a/f_b/beta, attn_k_b/v_b/kv_a_mqa) at Q8_0, which is
# 0.58 GB less than BF16. 0.1 % (1.5 GB) covers both; a wrong type on any class above 1.5 B weights breaks it
# (KDA attention alone is 32.7 B, shared experts 12.2 B, the embeddings 2.35 B).
@pytest.mark.parametrize("preset,figure_gb", [("k3-native", 1508), ("k3-q2", 1048)])
def test_planned_size_on_real_k3_matches_quant_presets(preset, figure_gb):
    size = real_plan(preset, "k3").target_bytes
    assert abs(size / GB - figure_gb) <= 1e-3 * figure_gb, size / GB


def test_k3_q4_is_smaller_and_still_copies_the_experts():
    native, q4 = real_plan("k3-native", "k3"), real_plan("k3-q4", "k3")
    experts = sum(d.target_bytes for d in q4.decisions if d.name.endswith(EXPERTS))
    # quant-presets.md: "routed experts 2.72 T params (1,446 GB MXFP4)", rounded to the GB
    assert abs(experts / GB - 1446) <= 0.5
    assert experts < q4.target_bytes < native.target_bytes
    # the rest (56.1 B weights): k3-q4 puts 52.7 B of them at Q6_K (6.56 bits) instead of Q8_0 (8.5): a fifth less
    assert (q4.target_bytes - experts) < 0.8 * (native.target_bytes - experts)


@pytest.mark.parametrize("preset", ["q8_0", *K3_PRESETS])
def test_protections_hold_on_real_shapes(preset):
    k3, k31 = real_plan(preset, "k3"), real_plan(preset, "k31")
    indexer = [d for d in k31.decisions if ".indexer." in d.name]
    assert len(indexer) == 24 * 5 and all(d.copied for d in indexer)           # 24 MLA layers x 5 tensors
    # K3.1-Pro is K3 plus its indexer, at the indexer's source types: nothing else differs
    assert k31.target_bytes - k3.target_bytes == sum(tensor_nbytes(d.source, d.shape) for d in indexer)
    experts = [d for d in k31.decisions if d.name.endswith(EXPERTS)]
    assert len(experts) == 92 * 3 and all(d.source == QT.MXFP4 for d in experts)
    if preset == "k3-q2":
        assert {d.name.rsplit(".", 2)[-2]: d.target for d in experts} == {
            "ffn_gate_exps": QT.Q2_K, "ffn_up_exps": QT.Q2_K, "ffn_down_exps": QT.Q3_K}
    elif preset in IQ_PRESETS:
        assert not any(d.copied for d in experts)
    else:
        assert all(d.copied for d in experts)
    f32 = [d for d in k31.decisions if d.source == QT.F32 and ".indexer." not in d.name]
    assert f32 and all(d.copied and d.protection is not None for d in f32)     # norms, router, scores, conv


# K3 in 600 and 800 GB (issue 17): the budget, on both models, and the bits spent as the preset files say
BITS = {QT.IQ1_S: 1.5625, QT.IQ1_M: 1.75, QT.IQ2_XXS: 2.0625, QT.IQ2_XS: 2.3125, QT.IQ3_XXS: 3.0625}


@pytest.mark.parametrize("preset", IQ_PRESETS)
def test_iq_presets_fit_their_budget_on_k3_and_k31(preset):
    for arch in ("k3", "k31"):
        size = real_plan(preset, arch).target_bytes / GB
        # at most the budget, and not more than 1% below it: the preset spends what the machine has
        assert 0.99 * IQ_PRESETS[preset] <= size <= IQ_PRESETS[preset], (arch, size)


@pytest.mark.parametrize("preset", IQ_PRESETS)
def test_iq_presets_spend_the_bits_where_they_matter(preset):
    plan = real_plan(preset, "k3")
    by_name = {d.name: d for d in plan.decisions}
    always_active = [d for d in plan.decisions if not d.copied and not d.name.endswith(EXPERTS)]
    # KDA, MLA, shared experts, latent projections, blk.0, embeddings, output: Q8_0 (BF16 for KDA gate/beta)
    assert always_active and {d.target for d in always_active} <= {QT.Q8_0, QT.BF16}
    assert sum(d.target_bytes for d in always_active) / GB > 55

    def bits(layer: int, proj: str) -> float:
        return BITS[by_name[f"blk.{layer}.ffn_{proj}_exps.weight"].target]
    moe = range(1, 93)
    for layer in moe:
        assert bits(layer, "down") >= bits(layer, "gate") == bits(layer, "up")     # down above gate/up
        assert bits(1, "down") >= bits(layer, "down") and bits(1, "gate") >= bits(layer, "gate")
    assert bits(1, "down") > bits(92, "down")                                       # the first MoE layers above


@pytest.mark.parametrize("preset", IQ_PRESETS)
def test_iq_presets_require_imatrix_and_allow_requantize(preset):
    assert load_policy(preset).requires == ("imatrix", "allow-requantize")
    plan = plan_quantization(real_tensors("k3"), load_policy(preset), options=PlanOptions(allow_requantize=False))
    assert {c.protection.kind for c in plan.conflicts} == {"mxfp4"}


def test_k3_q2_without_allow_requantize_would_copy_the_experts():
    """Why k3-q2 requires --allow-requantize: without it the expert rules meet the MXFP4 protection, and the plan
    quietly becomes k3-native's size (each named tensor reported as a conflict)."""
    plan = plan_quantization(real_tensors("k3"), load_policy("k3-q2"), options=PlanOptions(allow_requantize=False))
    assert len(plan.conflicts) == 92 * 3 and {c.protection.kind for c in plan.conflicts} == {"mxfp4"}
    assert plan.target_bytes / GB > 1500


# ------------------------------------------------------------------ requires

def test_check_requirements_names_the_preset_and_what_is_missing():
    pol = load_policy("k3-q2")
    assert pol.requires == ("imatrix", "allow-requantize")
    at = pol.requires_origin
    assert at.startswith("k3-q2.toml:")
    line = int(at.rsplit(":", 1)[1])
    text = PRESETS.joinpath("k3-q2.toml").read_text().splitlines()
    assert text[line - 1].startswith("requires = ")
    wanted = re.escape(f"preset k3-q2 requires --imatrix FILE and --allow-requantize ({at}); missing: ")
    with pytest.raises(PolicyError, match=rf"^{wanted}--imatrix FILE \(low-bit"):
        pol.check_requirements(imatrix=False, allow_requantize=True)
    with pytest.raises(PolicyError, match=rf"^{wanted}--allow-requantize \(it re-quantizes"):
        pol.check_requirements(imatrix=True, allow_requantize=False)
    with pytest.raises(PolicyError, match=rf"^{wanted}--imatrix FILE, --allow-requantize "):
        pol.check_requirements(imatrix=False, allow_requantize=False)
    assert pol.check_requirements(imatrix=True, allow_requantize=True) == []
    # a plan (--explain / --dry-run) does not depend on the imatrix, but does on --allow-requantize
    notes = pol.check_requirements(imatrix=False, allow_requantize=True, plan_only=True)
    assert len(notes) == 1 and "writing the file needs --imatrix FILE" in notes[0]
    with pytest.raises(PolicyError, match="missing: --allow-requantize"):
        pol.check_requirements(imatrix=False, allow_requantize=False, plan_only=True)
    for name in ("q8_0", "k3-native", "k3-q4"):
        assert load_policy(name).check_requirements(imatrix=False, allow_requantize=False) == []
    # --tensor-type rules do not drop the preset's requirements
    assert pol.with_tensor_types([]).requires == pol.requires


@pytest.mark.parametrize("text,message", [
    ('requires = ["imatrx"]\ndefault = "Q8_0"\n', r"p.toml:1: unknown requirement 'imatrx'"),
    ('default = "Q8_0"\nrequires = "imatrix"\n', r"p.toml:2: requires must be a list of strings"),
])
def test_bad_requires_names_file_and_line(text, message):
    with pytest.raises(PolicyError, match=message):
        parse_policy(text, "p.toml")


def test_requires_of_a_policy_file(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text('default = "Q4_K"\nrequires = ["imatrix"]\n')
    wanted = f"{f} requires --imatrix FILE ({f}:2); missing: --imatrix FILE"
    with pytest.raises(PolicyError, match="^" + re.escape(wanted)):
        load_policy(f).check_requirements(imatrix=False, allow_requantize=False)


# ------------------------------------------------------------------ the command line, on the tiny fixtures

@pytest.fixture(scope="module")
def k31(tmp_path_factory):
    """K3.1-Pro (indexer, MXFP4 experts) with rows that are multiples of 256, so k3-q2's experts are Q2_K / Q3_K
    here as on the real model, not their 32-block shape fallback."""
    d = tmp_path_factory.mktemp("presets")
    hf = make_checkpoint(d / "Kimi-K3.1-tiny", arch="k31", n_layers=4, hidden=256, q_lora_rank=256,
                         moe_intermediate_size=256, routed_expert_hidden_size=256, intermediate_size=512, seed=8)
    convert(build_plan(hf, "bf16"), d / "k31.gguf")
    return d / "k31.gguf"


@pytest.fixture
def out_dir(tmp_path):
    d = tmp_path / "out"
    d.mkdir()
    return d


@pytest.mark.parametrize("preset", ["q8_0", *K3_PRESETS])
def test_explain_each_preset(preset, k31):
    requantizes = preset == "k3-q2" or preset in IQ_PRESETS
    extra = ["--allow-requantize"] if requantizes else []
    r = quantize("--policy", preset, k31, "--explain", *extra)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    pol = load_policy(preset)
    assert lines[0].startswith(f"# preset {preset}: {pol.description}")
    assert len(lines) == 1 + len(open_gguf(k31).tensors)
    assert any(".indexer.attn_q_b.weight" in x and "protected (indexer)" in x for x in lines)
    experts = [x for x in lines if "ffn_down_exps.weight" in x]
    if preset == "k3-q2":
        assert "(requires: imatrix, allow-requantize)" in lines[0]
        assert experts and all("MXFP4 -> Q3_K" in x and "llama-quantize's own Q2_K mixture" in x for x in experts)
        assert "writing the file needs --imatrix FILE" in r.stderr
    elif preset in IQ_PRESETS:
        assert "(requires: imatrix, allow-requantize)" in lines[0]
        assert experts and all(re.search(r"MXFP4 -> IQ\d", x) and "ffn_down" in x for x in experts)
        assert "writing the file needs --imatrix FILE" in r.stderr
    else:
        assert experts and all("MXFP4 -> MXFP4" in x and "protected (mxfp4)" in x for x in experts)
    if pol.rules:         # the rule's reason is on the line it decides
        q_a = next(x for x in lines if ".attn_q_a.weight" in x)
        assert "src/llama-quant.cpp:472-486" in q_a


def test_k3_q2_without_what_it_requires_is_one_error(k31, out_dir):
    r = quantize("--policy", "k3-q2", k31, out_dir / "q.gguf", "--allow-requantize")
    assert_fails_cleanly(out_dir, r, "preset k3-q2", "requires --imatrix FILE and --allow-requantize",
                         "missing: --imatrix FILE")
    r = quantize("--policy", "k3-q2", k31, "--explain")
    assert_fails_cleanly(out_dir, r, "preset k3-q2", "missing: --allow-requantize")
    # checked before any work: the input is not even opened
    r = quantize("--policy", "k3-q2", out_dir / "absent.gguf", out_dir / "q.gguf")
    assert_fails_cleanly(out_dir, r, "preset k3-q2", "missing: --imatrix FILE, --allow-requantize")


def test_k3_q2_library_call_checks_too(k31, out_dir):
    with pytest.raises(PolicyError, match="preset k3-q2 requires .* missing: --imatrix FILE"):
        quantize_file(k31, out_dir / "q.gguf", load_policy("k3-q2"), options=PlanOptions(allow_requantize=True))
    assert list(out_dir.iterdir()) == []


def test_k3_q2_with_what_it_requires_writes_requantized_experts(k31, out_dir):
    shapes = {n: t.shape for n, t in open_gguf(k31).tensors.items()}
    imatrix = write_gguf_imatrix(out_dir / "k31.imatrix.gguf", k3_entries(shapes))
    r = quantize("--policy", "k3-q2", k31, out_dir / "q.gguf", "--allow-requantize", "--imatrix", imatrix)
    assert r.returncode == 0, r.stderr
    assert "re-quantized" in r.stderr                     # the double-quantization warning
    out = open_gguf(out_dir / "q.gguf")
    types = {n: t.qtype for n, t in out.tensors.items()}
    src = open_gguf(k31).tensors
    for n, t in src.items():
        if n.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):
            assert types[n] == QT.Q2_K, n
        elif n.endswith("ffn_down_exps.weight"):
            assert types[n] == QT.Q3_K, n
        elif ".indexer." in n:
            assert types[n] == t.qtype and bytes(out.tensors[n].raw) == bytes(t.raw), n
    assert out.fields["quantize.imatrix.file"] == str(imatrix)


def test_list_presets():
    """Both kinds of name, each under its heading: our presets with their description, then llama-quantize's
    file types with what their mixture does, their general.file_type, and whether they can be written yet."""
    r = quantize("--list-presets")
    assert r.returncode == 0, r.stderr
    head, presets_part, mixtures_part = r.stdout.split("\n", 1)[0], *r.stdout.split("\nllama-quantize's mixtures")
    assert head.startswith("presets (ours, lower case)")
    rows = {line.split()[0]: line for line in presets_part.splitlines()[1:]}
    assert set(rows) == set(preset_names())
    for name, line in rows.items():
        assert load_policy(name).description in line
    assert "(requires: imatrix, allow-requantize)" in rows["k3-q2"]
    mixtures = {line.split()[0]: line for line in mixtures_part.splitlines()[1:]}
    assert set(mixtures) == set(FILE_TYPES) and not set(mixtures) & set(rows)
    assert "file type 15: Q4_K;" in mixtures["Q4_K_M"] and "alias of Q4_K_M" in mixtures["Q4_K"]
    assert "(requires: imatrix)" in mixtures["IQ2_XXS"] and "(requires: imatrix)" in mixtures["Q2_K_S"]
    from kimi_convert.quant.blocks import supported_types
    assert all(("cannot write" in mixtures[n]) == (ft.default not in supported_types()) for n, ft in FILE_TYPES.items())
    assert "file type 41: Q2_0" in mixtures["Q2_0"]
    assert "--list-presets" in quantize("--help").stdout


def test_an_imatrix_without_token_embd_refuses_an_iq2_xxs_token_embd_by_name():
    """llama-quantize exempts token_embd and output from its imatrix rule, but ggml asserts an imatrix for IQ1_S,
    IQ2_XXS and IQ2_XS on every tensor: the plan names the tensors the imatrix lacks before anything is written,
    instead of ggml's abort (or our kernel's ValueError) in the middle of the file."""
    from kimi_convert.quant.plan import write_blockers
    pol = parse_policy('default = "Q8_0"\n[[rules]]\npattern = \'^(token_embd|output)\\.weight$\'\ntype = "IQ2_XXS"\n',
                       "p.toml")
    plan = plan_quantization(real_tensors("k3"), pol)
    entries = {d.name for d in plan.decisions} - {"token_embd.weight", "output.weight"}
    [line] = write_blockers(plan, entries, "calib.imatrix")
    assert "calib.imatrix has no entry for 2 tensor(s)" in line and "token_embd.weight" in line, line
    assert "output.weight" in line
