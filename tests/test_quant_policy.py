"""Policy files, --tensor-type tokens and the per-tensor decision (kimi_convert.quant.policy / .plan)."""
from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as QT

from kimi_convert.quant.plan import (PlanOptions, QuantizeError, StrictError, check_can_write, decide,
                                     plan_quantization)
from kimi_convert.quant.policy import (PolicyError, load_policy, parse_policy, preset_names, tensor_type_rules)


def policy(text: str):
    return parse_policy(text, "p.toml")


# ------------------------------------------------------------------ the file and its errors

def test_policy_file_shape(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text('default = "q4_k"\n\n[[rules]]\npattern = "attn_(q_a|q_b)"\ntype = "Q8_0"\n'
                 '[[rules]]\npattern = "token_embd"\ntype = "keep"\nwhy = "embeddings stay"\n')
    p = load_policy(f)
    assert p.default == QT.Q4_K and p.default_origin == f"{f}:1"
    assert [(r.pattern.pattern, r.target, r.origin) for r in p.rules] == [
        ("attn_(q_a|q_b)", QT.Q8_0, f"{f}:4"), ("token_embd", None, f"{f}:7")]
    assert p.rules[1].why == "embeddings stay"


@pytest.mark.parametrize("text,message", [
    ('default = Q4_K\n', r"p.toml: TOML syntax error: .*line 1"),
    ('default = "Q4_K"\n[[rules]]\npattern = "x"\ntype = "Q9_K"\n', r"p.toml:4: unknown type 'Q9_K'"),
    ('default = "Q4_K"\n[[rules]]\npattern = "x("\ntype = "Q8_0"\n', r"p.toml:3: bad regex 'x\('"),
    ('default = "Q4_K"\n[[rules]]\npattern = "x"\ntpye = "Q8_0"\n', r"p.toml:4: unknown key 'tpye' in a rule"),
    ('default = "Q4_K"\nrule = 1\n', r"p.toml:2: unknown key 'rule'"),
    ('[[rules]]\npattern = "x"\ntype = "Q8_0"\n', r"p.toml: no `default"),
    ('default = "Q4_K"\n[[rules]]\ntype = "Q8_0"\n', r"p.toml:2: rule 1 has no 'pattern'"),
    ('default = 8\n', r"p.toml:1: type must be a string"),
])
def test_policy_errors_name_file_and_line(text, message):
    with pytest.raises(PolicyError, match=message):
        policy(text)


def test_presets_ship_and_unknown_names_are_errors(tmp_path):
    assert "q8_0" in preset_names()
    assert load_policy("q8_0").default == QT.Q8_0
    with pytest.raises(PolicyError, match=r"q9: no such policy file or preset; presets: .*q8_0"):
        load_policy("q9")
    with pytest.raises(PolicyError, match="policy file not found"):
        load_policy(tmp_path / "missing.toml")


def test_tensor_type_tokens_read_as_llama_quantize_reads_them(tmp_path):
    f = tmp_path / "types.txt"
    f.write_text("ffn_down=Q6_K  attn_k_b=q8_0\nOUTPUT=bf16\n")
    rules = tensor_type_rules([r"blk\.1\.FFN=q5_k"], [f])
    # the regex is lower-cased (tools/quantize/quantize.cpp), the type is any case
    assert [(r.pattern.pattern, r.target) for r in rules] == [
        (r"blk\.1\.ffn", QT.Q5_K), ("ffn_down", QT.Q6_K), ("attn_k_b", QT.Q8_0), ("output", QT.BF16)]
    assert [r.origin for r in rules[1:]] == [f"{f}:1", f"{f}:1", f"{f}:2"]
    # split at the first '=', as upstream: the type is then 'b=Q4_0'
    with pytest.raises(PolicyError, match="unknown type 'b=Q4_0'"):
        tensor_type_rules(["a=b=Q4_0"], [])
    with pytest.raises(PolicyError, match="is not REGEX=TYPE"):
        tensor_type_rules(["Q4_K"], [])


# ------------------------------------------------------------------ decisions

K31_TENSORS = [
    ("token_embd.weight", (1024, 256), QT.BF16),
    ("blk.0.attn_norm.weight", (256,), QT.F32),
    ("blk.0.ssm_conv1d_q.weight", (1, 512, 1, 4), QT.F32),
    ("blk.0.ssm_a", (4,), QT.F32),
    ("blk.1.ffn_gate_inp.weight", (16, 256), QT.F32),
    ("blk.1.exp_probs_b.bias", (16,), QT.F32),
    ("blk.3.attn_q_a.weight", (512, 256), QT.BF16),
    ("blk.3.attn_k_b.weight", (4, 64, 128), QT.BF16),
    ("blk.3.indexer.attn_q_b.weight", (512, 512), QT.BF16),
    ("blk.3.indexer.attn_k.weight", (128, 256), QT.BF16),
    ("blk.3.indexer.proj.weight", (4, 256), QT.F32),
    ("blk.3.indexer.k_norm.weight", (128,), QT.F32),
    ("blk.1.ffn_up_exps.weight", (16, 96, 288), QT.MXFP4),
    ("blk.1.ffn_down_shexp.weight", (256, 192), QT.BF16),
]


def by_name(plan):
    return {d.name: d for d in plan.decisions}


def test_default_alone_is_llama_quantize_pure_with_its_protections_and_fallback():
    d = by_name(plan_quantization(K31_TENSORS, policy('default = "Q4_K"\n')))
    kept = {n for n, x in d.items() if x.copied}
    assert kept == {"blk.0.attn_norm.weight", "blk.0.ssm_conv1d_q.weight", "blk.0.ssm_a", "blk.1.ffn_gate_inp.weight",
                    "blk.1.exp_probs_b.bias", "blk.3.indexer.attn_q_b.weight", "blk.3.indexer.attn_k.weight",
                    "blk.3.indexer.proj.weight", "blk.3.indexer.k_norm.weight", "blk.1.ffn_up_exps.weight"}
    assert d["token_embd.weight"].target == QT.Q4_K and d["blk.3.attn_q_a.weight"].target == QT.Q4_K
    # rows of 128 and 192 are not multiples of 256: Q4_K falls back to Q5_0, as llama-quantize does
    assert d["blk.3.attn_k_b.weight"].target == QT.Q5_0 and "falls back" in d["blk.3.attn_k_b.weight"].why
    assert d["blk.1.ffn_down_shexp.weight"].target == QT.Q5_0
    assert d["blk.3.indexer.attn_k.weight"].protection.kind == "indexer"
    assert d["blk.1.ffn_up_exps.weight"].protection.kind == "mxfp4"


@pytest.mark.parametrize("target,row,want", [
    ("Q6_K", 128, QT.Q8_0), ("Q5_K", 96, QT.Q5_1), ("Q2_K", 64, QT.Q4_0), ("Q3_K", 32, QT.Q4_0),
    ("IQ4_XS", 160, QT.IQ4_NL), ("Q4_K", 48, QT.F16), ("Q8_0", 48, QT.F16), ("Q8_0", 96, QT.Q8_0),
    ("TQ1_0", 128, QT.Q4_0), ("TQ2_0", 96, QT.Q4_0), ("Q2_0", 32, QT.Q4_0), ("Q2_0", 16, QT.F16),
    ("MXFP4", 48, QT.F16), ("MXFP4", 96, QT.MXFP4), ("NVFP4", 192, QT.NVFP4), ("Q1_0", 384, QT.Q1_0),
])
def test_shape_fallback_ladder(target, row, want):
    d, _ = decide("blk.0.attn_q.weight", (8, row), QT.BF16, policy(f'default = "{target}"\n'), False)
    assert d.target == want


@pytest.mark.parametrize("target,block,row", [("Q1_0", 128, 192), ("NVFP4", 64, 96)])
def test_no_fallback_types_refuse_a_row_they_do_not_divide(target, block, row):
    """llama-quantize throws "no tensor type fallback is defined for type q1_0" (tensor_type_fallback's default
    branch, blocks above 32); so does the plan, in one line naming the tensor."""
    tensors = [*K31_TENSORS, ("blk.2.ffn_down_shexp.weight", (256, row), QT.BF16)]
    aimed = policy(f'default = "Q8_0"\n[[rules]]\npattern = "blk\\\\.2\\\\."\ntype = "{target}"\n')
    with pytest.raises(QuantizeError) as err:
        plan_quantization(tensors, aimed)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"p.toml:3: blk.2.ffn_down_shexp.weight: row length {row} ")
    assert f"{target} block ({block})" in text
    assert f"no tensor type fallback is defined for type {target.lower()}" in text


def test_rules_first_match_tensor_types_first_and_keep():
    p = policy('default = "Q4_K"\n[[rules]]\npattern = "attn_q_a"\ntype = "Q8_0"\n'
               '[[rules]]\npattern = "attn_"\ntype = "Q6_K"\n[[rules]]\npattern = "token_embd"\ntype = "keep"\n')
    d = by_name(plan_quantization(K31_TENSORS, p))
    assert d["blk.3.attn_q_a.weight"].target == QT.Q8_0 and "p.toml:3" in d["blk.3.attn_q_a.weight"].why
    assert d["token_embd.weight"].target == QT.BF16
    first = p.with_tensor_types(tensor_type_rules(["attn_q_a=bf16"], []))
    assert by_name(plan_quantization(K31_TENSORS, first))["blk.3.attn_q_a.weight"].target == QT.BF16


def test_rules_naming_protected_tensors_are_reported_and_strict_refuses():
    p = policy('default = "Q8_0"\n[[rules]]\npattern = "indexer|_exps|_norm"\ntype = "Q4_K"\n'
               '[[rules]]\npattern = "ssm_conv1d"\ntype = "keep"\n')
    plan = plan_quantization(K31_TENSORS, p)
    named = {c.tensor: c.protection.kind for c in plan.conflicts}
    assert named == {"blk.3.indexer.attn_q_b.weight": "indexer", "blk.3.indexer.attn_k.weight": "indexer",
                     "blk.3.indexer.proj.weight": "indexer", "blk.3.indexer.k_norm.weight": "llama.cpp",
                     "blk.1.ffn_up_exps.weight": "mxfp4", "blk.0.attn_norm.weight": "llama.cpp"}
    assert all(d.copied for d in plan.decisions if d.name in named)
    assert "p.toml:3" in plan.conflicts[0].describe()
    # one rule (`keep` names nothing), three protections: one error line, a detail line per protection
    with pytest.raises(QuantizeError, match=r"^--strict: 1 rule\(s\) name protected tensors \(llama\.cpp, indexer, "
                                            r"mxfp4\): p\.toml:3 \('indexer\|_exps\|_norm' -> Q4_K\); nothing is "
                                            r"written$") as refused:
        plan_quantization(K31_TENSORS, p, options=PlanOptions(strict=True))
    assert [line.split(" names ")[1].split(" protected")[0] for line in refused.value.details] == ["2", "3", "1"]


def test_strict_names_every_colliding_rule_one_line_each():
    """Rules aimed at the MXFP4 experts and at the K3.1 indexer: --strict names both rules, each with what it
    would have hit (how many, the first names) and why that is protected; the notes without --strict are the
    same lines."""
    p = policy('default = "Q8_0"\n[[rules]]\npattern = "_exps"\ntype = "Q4_K"\n'
               '[[rules]]\npattern = "indexer\\\\."\ntype = "Q8_0"\n')
    with pytest.raises(StrictError) as refused:
        plan_quantization(K31_TENSORS, p, options=PlanOptions(strict=True))
    e = refused.value
    # in the order the file's tensors first meet them
    assert str(e) == ("--strict: 2 rule(s) name protected tensors (indexer, llama.cpp, mxfp4): "
                      "p.toml:6 ('indexer\\\\.' -> Q8_0); p.toml:3 ('_exps' -> Q4_K); nothing is written")
    indexer = ["blk.3.indexer.attn_q_b.weight", "blk.3.indexer.attn_k.weight", "blk.3.indexer.proj.weight"]
    lines = [(line.split(";")[0], line.split("; protected ")[1].split(":")[0]) for line in e.details]
    assert lines == [
        (f"rule p.toml:6 ('indexer\\\\.' -> Q8_0) names 3 protected tensor(s): {', '.join(indexer)}", "(indexer)"),
        ("rule p.toml:6 ('indexer\\\\.' -> Q8_0) names 1 protected tensor(s): blk.3.indexer.k_norm.weight",
         "(llama.cpp)"),
        ("rule p.toml:3 ('_exps' -> Q4_K) names 1 protected tensor(s): blk.1.ffn_up_exps.weight", "(mxfp4)")]
    assert e.details == [g.describe() for g in plan_quantization(K31_TENSORS, p).conflict_groups]


def test_a_conflict_line_counts_past_the_names_it_shows():
    many = [(f"blk.{i}.ffn_up_exps.weight", (16, 96, 288), QT.MXFP4) for i in range(1, 6)]
    (line,) = plan_quantization(many, policy('default = "Q8_0"\n[[rules]]\npattern = "exps"\ntype = "Q4_K"\n'))\
        .conflict_groups
    assert line.describe().startswith("rule p.toml:3 ('exps' -> Q4_K) names 5 protected tensor(s): blk.1.ffn_up_exps."
                                      "weight, blk.2.ffn_up_exps.weight, blk.3.ffn_up_exps.weight and 2 more; "
                                      "protected (mxfp4): MXFP4 experts")


def test_mxfp4_experts_requantized_only_with_allow_requantize():
    p = policy('default = "Q8_0"\n[[rules]]\npattern = "_exps"\ntype = "Q2_K"\n')
    assert by_name(plan_quantization(K31_TENSORS, p))["blk.1.ffn_up_exps.weight"].copied
    plan = plan_quantization(K31_TENSORS, p, options=PlanOptions(allow_requantize=True))
    exps = by_name(plan)["blk.1.ffn_up_exps.weight"]
    # 288 is not a multiple of 256: Q2_K falls back to Q4_0
    assert exps.target == QT.Q4_0 and exps.requantized and "twice" in plan.warnings[0]
    # the indexer stays protected whatever the flags
    assert by_name(plan)["blk.3.indexer.attn_k.weight"].copied


def test_quantized_sources_and_mxfp4_targets():
    with pytest.raises(QuantizeError, match=r"blk\.0\.attn_q\.weight: is already Q8_0; .*--allow-requantize"):
        decide("blk.0.attn_q.weight", (8, 256), QT.Q8_0, policy('default = "Q4_K"\n'), False)
    d, _ = decide("blk.0.attn_q.weight", (8, 256), QT.Q8_0, policy('default = "Q8_0"\n'), False)
    assert d.copied
    # MXFP4 is made from float tensors; a quantized one needs --allow-requantize, as for any other target
    for source in (QT.BF16, QT.F16, QT.F32):
        d, _ = decide("blk.0.attn_q.weight", (8, 256), source, policy('default = "MXFP4"\n'), False)
        assert d.target == QT.MXFP4 and not d.copied and not d.requantized
    with pytest.raises(QuantizeError, match=r"blk\.0\.attn_q\.weight: is already Q8_0; .*--allow-requantize"):
        decide("blk.0.attn_q.weight", (8, 256), QT.Q8_0, policy('default = "MXFP4"\n'), False)
    # MXFP4 experts aimed at MXFP4 stay a byte copy, protected or not (--allow-requantize)
    for allow in (False, True):
        plan = plan_quantization(K31_TENSORS, policy('default = "MXFP4"\n'), PlanOptions(allow_requantize=allow))
        exps = by_name(plan)["blk.1.ffn_up_exps.weight"]
        assert exps.copied and not exps.requantized and not plan.warnings


def test_errors_about_a_chosen_type_name_the_policy_file_and_line(tmp_path):
    """An error about a tensor's type names the POLICY_FILE:LINE that chose it, as the policy's own errors do:
    a rule's line, the default's line, the --tensor-type token; a protection (no choice) names none."""
    from kimi_convert.quant.plan import write_blockers
    text = 'default = "Q8_0"\n\n[[rules]]\npattern = "attn_q\\\\.weight$"\ntype = "IQ2_XXS"\n'
    p = policy(text)
    plan = plan_quantization([("blk.0.attn_q.weight", (8, 256), QT.BF16), ("blk.0.attn_k.weight", (8, 256), QT.BF16)],
                             p)
    d = by_name(plan)["blk.0.attn_q.weight"]
    assert d.origin == "p.toml:4" and by_name(plan)["blk.0.attn_k.weight"].origin == "p.toml:1"
    line = write_blockers(plan, None)[0]
    assert line.startswith("p.toml:4: blk.0.attn_q.weight: IQ2_XXS needs an importance matrix"), line
    with pytest.raises(QuantizeError, match=r"^p\.toml:4: blk\.0\.attn_q\.weight: IQ2_XXS needs"):
        check_can_write(plan, None)
    line = write_blockers(plan, set(), "im.gguf")[0]        # an imatrix without the tensor
    assert "im.gguf has no entry for 1 tensor(s)" in line and "IQ2_XXS for blk.0.attn_q.weight chosen by p.toml:4" \
        in line, line
    # the default's line, and a --tensor-type token
    with pytest.raises(QuantizeError, match=r"^p\.toml:1: blk\.0\.attn_q\.weight: is already Q8_0"):
        decide("blk.0.attn_q.weight", (8, 256), QT.Q8_0, policy('default = "Q4_K"\n'), False)
    tt = policy('default = "Q8_0"\n').with_tensor_types(tensor_type_rules(["attn_q=iq2_xxs"], []))
    plan = plan_quantization([("blk.0.attn_q.weight", (8, 256), QT.BF16)], tt)
    assert write_blockers(plan, None)[0].startswith("--tensor-type attn_q=iq2_xxs: blk.0.attn_q.weight: IQ2_XXS")
    # a protection chose nothing: no origin
    d = by_name(plan_quantization(K31_TENSORS, p))["blk.3.indexer.attn_k.weight"]
    assert d.protection is not None and d.origin == "" and d.at == ""



BACKTRACKING = [r"^(.+)+x$", r"(a|ab)*c", r"(\.\d+)*\.weight", r"(a*)*", r"(a.*){3}", r"(?:a+|b)+", r"(a|aa)+$",
                r".*.*.*x", r"x*x*x*y", r"(?=.*x*x*y)"]
RECIPE_PATTERNS = [r"^blk\.([1-9]|1\d|20)\.ffn_down_exps\.weight$", r"^blk\.\d+\.ffn_(gate|up|down)_exps\.weight$",
                   "attn_", "ffn_(up|down)_exps", r"^blk\.0\.", "token_embd", "exps", r"blk\.[0-9]+\.ffn_.*_exps.*",
                   r"blk\.\d+\.attn_.*", r".*_exps", r"^.*_.*_.*$", r"blk\.(1[0-9]|2[0-9])\.ffn_.*_exps",
                   r"(?!.*exps).*attn", r"(a|b)+x", r"\.(\d+)\.", r"output\.weight", r"[a-z]+_[a-z]+\.weight",
                   r"blk\.\d+\.ffn_(gate|up)_exps\.weight|token_embd", r"ffn_down_exps", r"attn_kv_a_mqa",
                   "^(?:" + "|".join(rf"blk\.{i}\.attn_q\.weight" for i in range(60)) + ")$"]


@pytest.mark.parametrize("pattern", BACKTRACKING)
def test_backtracking_patterns_refused_from_the_pattern_alone(pattern):
    """Refused when read, before any name is searched, by a rule on the pattern (no timer: the verdict is the
    same on an idle machine and a busy one), in one line naming the policy file and line."""
    from kimi_convert.quant import policy as policy_module
    assert not hasattr(policy_module, "time_limit") and not hasattr(policy_module, "PATTERN_SECONDS")
    text = f'default = "Q8_0"\n\n[[rules]]\npattern = \'attn\'\ntype = "Q8_0"\n\n[[rules]]\npattern = \'{pattern}\'\n' \
           f'type = "Q4_0"\n'
    with pytest.raises(PolicyError) as e:
        parse_policy(text, "evil.toml")
    assert str(e.value).startswith("evil.toml:8: pattern ") and "\n" not in str(e.value)
    with pytest.raises(PolicyError, match=r"^--tensor-type "):
        tensor_type_rules([f"{pattern}=q4_0"], [])


@pytest.mark.parametrize("pattern", RECIPE_PATTERNS)
def test_recipe_patterns_accepted(pattern):
    p = parse_policy(f'default = "Q8_0"\n[[rules]]\npattern = \'{pattern}\'\ntype = "Q4_0"\n', "ok.toml")
    assert p.rules[0].pattern.pattern == pattern
    assert tensor_type_rules([f"{pattern}=q4_0"], [])[0].pattern.pattern == pattern.lower()


def test_a_long_pattern_is_refused_by_its_length_not_its_time():
    from kimi_convert.quant.policy import MAX_PATTERN_CHARS
    names = "|".join(f"n{i}" for i in range(MAX_PATTERN_CHARS // 4))
    assert len(names) > MAX_PATTERN_CHARS
    with pytest.raises(PolicyError, match=rf"^p\.toml:3: pattern of {len(names):,} characters: at most "):
        parse_policy(f'default = "Q8_0"\n[[rules]]\npattern = "{names}"\ntype = "Q4_0"\n', "p.toml")
    with pytest.raises(PolicyError, match="pattern of 1,048,576 characters"):      # the 1 MiB pattern
        parse_policy(f'default = "Q8_0"\n[[rules]]\npattern = "{"a" * 2**20}"\ntype = "Q4_0"\n', "p.toml")
