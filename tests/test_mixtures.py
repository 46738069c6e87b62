"""llama-quantize's named mixtures (quant/mixtures.py) against llama.cpp's own type selection.

- llama.cpp's snapshots (tests/snapshots/*.schema of the pinned tree, unpacked by .ci/install-interop.sh): every
  file type of every model whose rules need no arch-specific branch, type for type;
- llama.cpp's code itself (llama_quant_compute_types through ctypes, src/llama-ext.h) on the real kimi-k3 tensor
  list, for every file type, with K3's facts and with facts that turn the n_expert == 8 and n_gqa() >= 4 rules on;
  on the real kimi-k31 list, where the indexer stays as it is;
- the policy names (did you mean), --explain's rule names, and the refusals before writing (a type not writable
  yet, a missing imatrix or imatrix entry, --tensor-type with a float file type), from the command line.
The byte parity of whole files is tests/test_interop_mixtures.py, the one pass tests/test_one_pass.py.
"""
from __future__ import annotations

import re
from dataclasses import replace
from functools import lru_cache

import pytest
from gguf import GGMLQuantizationType as QT

from kimi_convert.convert.converter import build_plan, convert
from kimi_convert.fixtures.imatrix import k3_entries, write_gguf_imatrix
from kimi_convert.fixtures.make_checkpoint import build_config, make_checkpoint
from kimi_convert.fixtures.real_size import REAL_VISION, real_spec
from kimi_convert.gguf_io import ggml_type, open_gguf
from kimi_interop import llama_quant_types
from kimi_interop.llama_cpp_convert import upstream_snapshots
from kimi_convert.model import KimiConfig
from kimi_convert.quant.mixtures import FILE_TYPES, ModelFacts
from kimi_convert.quant.plan import plan_quantization
from kimi_convert.quant.policy import load_policy, mixture_policy
from kimi_convert.tensor_map import gguf_tensor_types
from test_convert_errors import assert_fails_cleanly, run_cli
from test_quantize_cli import quantize

PLANNABLE = list(FILE_TYPES.values())

# ------------------------------------------------------------------------------------ the snapshots

# Per snapshot model, the row length (ne0) of each tensor kind that is not n_embd wide, from the model's published
# config (heads x head_dim, FFN and expert widths, MLA ranks, Mamba / gated-delta-net value widths). Only
# ne0 % 256, ne0 % 32 and whether a tensor is 3-D reach the rules. 3-D: the stacked experts and DeepSeek's
# MLA attn_k_b. The tensors are those the snapshot names (every one that differs from the default in some
# file type: all 2-D ones do under MXFP4_MOE, every attn_v-like and ffn_down one under Q2_K, so every counter
# counts the same tensors as upstream's; a 3-D tensor never named reaches no rule that another tensor reads).
ROWS = {
    "deepseek-v3.1": {"attn_q_b": 1536, "attn_k_b": 128, "attn_output": 128 * 128, "ffn_down": 18432,
                      "ffn_down_exps": 2048, "ffn_down_shexp": 2048},
    "gemma-3-4b-it": {"attn_output": 8 * 256, "ffn_down": 10240},
    "glm-4.6v": {"attn_output": 96 * 128, "ffn_down": 10944, "ffn_down_exps": 1408, "ffn_down_shexp": 1408},
    "gpt-oss-120b": {"attn_output": 64 * 64},
    "nvidia-nemotron-3-nano-30b-a3b": {"attn_output": 32 * 128, "ssm_out": 64 * 64, "ffn_down_exps": 1856,
                                       "ffn_down_shexp": 3712},
    "qwen3-0.6b": {"attn_output": 16 * 128, "ffn_down": 3072},
    "qwen3-14b": {"attn_output": 40 * 128, "ffn_down": 17408},
    "qwen3-coder-next": {"attn_output": 16 * 256, "ssm_out": 32 * 128, "ffn_down_exps": 512, "ffn_down_shexp": 512},
    "qwen3.5-397b-a17b": {"attn_output": 32 * 256, "ssm_out": 64 * 128, "ffn_down_exps": 1024,
                          "ffn_down_shexp": 1024},
    "qwen3.6-27b": {"attn_output": 24 * 256, "ssm_out": 48 * 128, "ffn_down": 17408},
    "step-3.5-flash": {"attn_output": 64 * 128, "ffn_down": 11264, "ffn_down_exps": 1280, "ffn_down_shexp": 1280},
}
# LLaMA-3.1-70B's attn_v takes its arch's 70B branch (llama-quant.cpp: model.type == LLM_TYPE_70B), which is not
# ported (it cannot apply to kimi-k3)
ARCH_SPECIFIC = {"meta-llama-3.1-70b-instruct"}


def read_schema(text: str) -> tuple[dict[str, int], dict[str, tuple[QT, dict[str, QT]]]]:
    """The model's header numbers, and per file type: (default type, {tensor: type} of the tensors that differ)."""
    header = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", text.splitlines()[1])}
    sections: dict[str, tuple[QT, dict[str, QT]]] = {}
    current: dict[str, QT] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            ftype, default = re.fullmatch(r"\[(\w+)\] (\w+)", line).groups()
            current = {}
            sections[ftype] = (QT[default.upper()], current)
        else:
            name, qtype = line.rsplit(" ", 1)
            current[name] = QT[qtype.upper()]
    return header, sections


def snapshot_tensors(model: str, header: dict, sections: dict) -> list[tuple[str, tuple[int, ...], QT]]:
    names = sorted({n for _, differing in sections.values() for n in differing})
    out = []
    for name in names:
        kind = re.sub(r"^blk\.\d+\.", "", name).removesuffix(".weight")
        row = ROWS[model].get(kind, header["n_embd"])
        shape = (header["n_head"] if kind.startswith("attn_k_b") else header["n_expert"], 256, row) \
            if kind.endswith("_exps") or kind == "attn_k_b" else (256, row)
        out.append((name, shape, QT.BF16))
    return out


@lru_cache(maxsize=None)
def snapshot(model: str):
    return read_schema((upstream_snapshots() / f"{model}.schema").read_text())


@pytest.mark.interop
def test_every_snapshot_model_is_compared_or_excused():
    assert {p.stem for p in upstream_snapshots().glob("*.schema")} == set(ROWS) | ARCH_SPECIFIC


@pytest.mark.interop
@pytest.mark.parametrize("model", sorted(ROWS))
def test_types_equal_llama_cpp_snapshot(model):
    """Every file type of the snapshot, tensor for tensor: its type, from our mixture and fallback."""
    header, sections = snapshot(model)
    tensors = snapshot_tensors(model, header, sections)
    facts = ModelFacts(header["n_layer"], header.get("n_expert", 0),
                       header["n_head"] // header["n_head_kv"] if header["n_head_kv"] else 0)
    # every file type but the aliases, Q1_0 and Q2_0 (test-quant-type-selection.cpp's name table lacks both)
    assert set(sections) == {ft.name for ft in PLANNABLE if not ft.alias_of} - {"Q1_0", "Q2_0"}
    wrong = []
    for name, (default, differing) in sections.items():
        ftype = FILE_TYPES[name]
        assert ftype.default == default, name
        for d in plan_quantization(tensors, mixture_policy(ftype), model=facts).decisions:
            assert d.protection is None, d
            want = differing.get(d.name, default)
            if d.target != want:
                wrong.append(f"[{name}] {d.name}: ours {d.target.name}, llama.cpp {want.name} ({d.why})")
    assert not wrong, f"{len(wrong)} differ:\n" + "\n".join(wrong[:20])


# ------------------------------------------------------------------------------------ llama.cpp's code, on K3

@lru_cache(maxsize=1)
def real_k3():
    """The release's config with BF16 experts (MXFP4 ones are protected: nothing to compare) and its tensors."""
    config = replace(KimiConfig.from_hf(build_config(real_spec("k3"), REAL_VISION)), experts_mxfp4=False)
    return config, tuple(gguf_tensor_types(config))


@pytest.mark.interop
@pytest.mark.parametrize("n_expert,n_head_kv", [(None, 0), (8, 1), (0, 24)],
                         ids=["k3", "8-experts-gqa96", "dense-gqa4"])
def test_types_equal_llama_quant_compute_types_on_real_k3(n_expert, n_head_kv):
    """llama.cpp's own choice (a mock kimi-k3 model, llama_quant_compute_types) for the 2,573 tensors of the real
    K3, every file type; also with 8 experts and n_gqa() 96, and no experts and n_gqa() 4, which turn on the rules
    K3's own facts (896 experts, KDA layer 0: n_gqa() 0) leave off. What llama-quantize may quantize
    (llama_quant_tensor_allows_quantization) is exactly what our protections leave to the policy."""
    config, tensors = real_k3()
    n_expert = config.n_expert if n_expert is None else n_expert
    facts = ModelFacts(config.n_layer, n_expert, config.n_head // n_head_kv if n_head_kv else 0)
    assert (n_expert, n_head_kv) != (config.n_expert, 0) or facts == ModelFacts.of(config)
    theirs = llama_quant_types("kimi-k3", [(n, s) for n, s, _ in tensors], sorted({ft.ftype for ft in PLANNABLE}),
                               n_layer=config.n_layer, n_head=config.n_head, n_head_kv=n_head_kv, n_expert=n_expert)
    wrong = []
    for ftype in PLANNABLE:
        plan = plan_quantization(tensors, mixture_policy(ftype), model=facts)
        ours = {d.name: d for d in plan.decisions if d.protection is None}
        expected = theirs[ftype.ftype]
        assert set(ours) == set(expected), ftype.name
        wrong += [f"[{ftype.name}] {n}: ours {ours[n].target.name}, llama.cpp {ggml_type(t).name} ({ours[n].why})"
                  for n, t in expected.items() if ggml_type(t) != ours[n].target]
    assert not wrong, f"{len(wrong)} differ:\n" + "\n".join(wrong[:20])


@pytest.mark.interop
def test_k31_indexer_stays_as_it_is_where_llama_quantize_would_quantize_it():
    """The real K3.1 tensors: llama.cpp's choice (its kimi-k3 rules; the pinned build has no kimi-k31) quantizes
    the indexer; ours keeps it, and decides every other tensor as llama.cpp does."""
    config = replace(KimiConfig.from_hf(build_config(real_spec("k31"), REAL_VISION)), experts_mxfp4=False)
    tensors = gguf_tensor_types(config)
    ftypes = [FILE_TYPES[n] for n in ("Q4_K_M", "IQ3_XS", "Q2_K")]
    theirs = llama_quant_types("kimi-k3", [(n, s) for n, s, _ in tensors], [ft.ftype for ft in ftypes],
                               n_layer=config.n_layer, n_head=config.n_head, n_head_kv=0, n_expert=config.n_expert)
    for ftype in ftypes:
        decisions = {d.name: d for d in plan_quantization(tensors, mixture_policy(ftype),
                                                          model=ModelFacts.of(config)).decisions}
        indexer = [n for n in theirs[ftype.ftype] if ".indexer." in n]
        assert len(indexer) == 3 * 24
        for n, t in theirs[ftype.ftype].items():
            if ".indexer." in n:
                assert ggml_type(t) != QT.BF16 and decisions[n].copied and decisions[n].protection.kind == "indexer", n
            else:
                assert decisions[n].target == ggml_type(t), (ftype.name, n, decisions[n].why)


# ------------------------------------------------------------------------------------ policies and the command line

@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A 4-layer K3 with BF16 experts and rows of 256 (its checkpoint beside it, `hf`), its imatrix, and one that
    lacks blk.0.attn_q's entry."""
    d = tmp_path_factory.mktemp("mixture-cli")
    hf = make_checkpoint(d / "Kimi-K3-tiny", arch="k3", n_layers=4, experts_mxfp4=False, hidden=256,
                         moe_intermediate_size=256, routed_expert_hidden_size=256, intermediate_size=512, seed=3)
    src = d / "k3.gguf"
    convert(build_plan(hf, "bf16"), src)
    entries = k3_entries({n: t.shape for n, t in open_gguf(src).tensors.items()}, seed=5)
    full = write_gguf_imatrix(d / "full.imatrix.gguf", entries)
    del entries["blk.0.attn_q.weight"]
    holed = write_gguf_imatrix(d / "holed.imatrix.gguf", entries)
    return src, full, holed


@pytest.fixture
def out_dir(tmp_path):
    d = tmp_path / "out"
    d.mkdir()
    return d


@pytest.mark.parametrize("name,needles", [
    ("q4_k_m", ["q4_k_m: no such preset; did you mean llama-quantize's mixture Q4_K_M?", "upper case"]),
    ("K3-Q4", ["K3-Q4: no such file type; did you mean the preset k3-q4?"]),
    ("Q9_K", ["Q9_K: no such policy file or preset", "presets: k3-iq1, k3-iq2, k3-native", "mixtures: Q1_0, Q2_0"]),
])
def test_a_name_of_the_other_kind_is_refused_with_what_it_may_mean(files, out_dir, name, needles):
    src, _, _ = files
    assert_fails_cleanly(out_dir, quantize("--policy", name, src, out_dir / "q.gguf"), *needles)


def test_preset_and_file_type_of_one_spelling_are_two_policies():
    """`q8_0` is our preset (pure Q8_0, no mixture), `Q8_0` llama-quantize's file type (its mixture)."""
    assert load_policy("q8_0").mixture is None and load_policy("q8_0").source == "preset q8_0"
    assert load_policy("Q8_0").mixture is FILE_TYPES["Q8_0"] and load_policy("Q8_0").source == "mixture Q8_0"
    assert load_policy("Q4_K").mixture.rules == "Q4_K_M" and load_policy("Q4_K").mixture.ftype == 15


def test_explain_names_the_mixture_rule(files):
    src, _, _ = files
    r = quantize("--policy", "Q4_K_M", src, "--explain")
    assert r.returncode == 0, r.stderr
    lines = {line.split()[0]: line for line in r.stdout.splitlines()[1:]}
    assert r.stdout.startswith("# mixture Q4_K_M: llama-quantize's Q4_K_M (general.file_type 15)")
    # 4 layers: use_more_bits is true for layers 2 and 3 (7n/8 = 3, (i - n/8) % 3 == 2); attn_v #2 of 3 likewise
    assert "BF16 -> Q6_K" in lines["blk.2.ffn_down_exps.weight"]
    assert lines["blk.2.ffn_down_exps.weight"].endswith("llama-quantize Q4_K_M: ffn_down, use_more_bits(layer 2 of 4)")
    assert lines["blk.1.ffn_down_exps.weight"].endswith("llama-quantize Q4_K_M: ffn_down: the default Q4_K")
    assert lines["blk.2.attn_v.weight"].endswith("llama-quantize Q4_K_M: attn_v, use_more_bits(attn_v 2 of 3)")
    assert lines["output.weight"].endswith("llama-quantize Q4_K_M: output: Q6_K")
    assert ("llama-quantize Q4_K_M: other (no rule): the default Q4_K; row length 16 is not a multiple of 256: "
            "Q4_K -> F16") in lines["blk.0.ssm_f_b.weight"]
    assert "protected (llama.cpp)" in lines["blk.0.attn_norm.weight"]


def test_a_type_not_writable_yet_plans_and_is_refused_before_writing(files, out_dir, monkeypatch):
    """A file type whose default has no kernel here (none today; a ggml type llama.cpp adds tomorrow) plans and
    is refused before a byte is written: TQ1_0 taken out of the registry stands for it."""
    import kimi_convert.quant.plan as plan_mod
    from test_cli_defence import run
    writable = tuple(t for t in plan_mod.supported_types() if t != QT.TQ1_0)
    monkeypatch.setattr(plan_mod, "supported_types", lambda: writable)
    src, _, _ = files
    r = run("kimi-quantize", "--policy", "TQ1_0", src, "--explain")
    assert r.code == 0, r.err
    assert "BF16 -> TQ1_0" in next(x for x in r.out.splitlines() if x.startswith("blk.0.attn_q.weight "))
    assert "BF16 -> Q4_K" in next(x for x in r.out.splitlines() if x.startswith("token_embd.weight "))
    assert "note: writing this plan is refused: mixture TQ1_0: blk.0.attn_q.weight: TQ1_0 cannot be written yet" \
        in r.err
    d = run("kimi-quantize", "--policy", "TQ1_0", src, "--dry-run")
    assert d.code == 0 and "TQ1_0" in d.out and "TQ1_0 cannot be written yet" in d.err, d.err
    r = run("kimi-quantize", "--policy", "TQ1_0", src, out_dir / "q.gguf")
    line = r.one_error()
    assert "blk.0.attn_q.weight: TQ1_0 cannot be written yet (BF16 -> TQ1_0)" in line and \
        "kimi-quantize writes F32, F16, BF16, Q8_0" in line
    assert not list(out_dir.iterdir())


def test_imatrix_requirements_as_llama_quantize(files, out_dir):
    src, full, holed = files
    assert_fails_cleanly(out_dir, quantize("--policy", "Q2_K_S", src, out_dir / "q.gguf"),
                         "mixture Q2_K_S requires --imatrix FILE (llama-quantize's tensor_requires_imatrix, Q2_K)")
    r = quantize("--policy", "Q2_K_S", src, "--explain")
    assert r.returncode == 0 and "writing the file needs --imatrix FILE too" in r.stderr, r.stderr
    assert "writing this plan is refused: mixture Q2_K_S: blk.0.attn_q.weight: Q2_K needs an importance matrix" \
        in r.stderr
    # an entry missing for a tensor whose type needs one: refused, naming it; token_embd (Q2_K, no entry) is exempt
    r = quantize("--policy", "Q2_K_S", src, out_dir / "q.gguf", "--imatrix", holed)
    assert_fails_cleanly(out_dir, r, f"{holed} has no entry for 1 tensor(s) whose type needs one",
                         "blk.0.attn_q.weight")
    r = quantize("--policy", "Q2_K_S", src, out_dir / "q.gguf", "--imatrix", full)
    assert r.returncode == 0, r.stderr
    assert open_gguf(out_dir / "q.gguf").tensors["token_embd.weight"].qtype == QT.Q2_K
    assert open_gguf(out_dir / "q.gguf").fields["general.file_type"] == 21


def test_error_names_the_rule_that_chose_the_type(files, out_dir):
    """kimi-quantize without --imatrix, a policy rule asking IQ2_XXS: the one error line starts with the policy
    file and the rule's line (it named only the tensor), and so does --explain's note."""
    src, _, _ = files
    pol = out_dir.parent / "low.toml"
    pol.write_text('default = "Q8_0"\n\n[[rules]]\npattern = "attn_q\\\\.weight$"\ntype = "IQ2_XXS"\n')
    r = quantize("--policy", pol, src, out_dir / "q.gguf")
    assert_fails_cleanly(out_dir, r, f"{pol}:4: blk.0.attn_q.weight: IQ2_XXS needs an importance matrix")
    r = quantize("--policy", pol, src, "--explain")
    assert f"writing this plan is refused: {pol}:4: blk.0.attn_q.weight: IQ2_XXS needs" in r.stderr, r.stderr


def test_float_file_type_takes_no_tensor_type(files, out_dir):
    """llama-quantize applies no --tensor-type to F16/BF16/F32 files: refused here rather than ignored."""
    src, _, _ = files
    r = quantize("--policy", "F16", src, out_dir / "q.gguf", "--tensor-type", "exps=q8_0")
    assert_fails_cleanly(out_dir, r, "--tensor-type exps=q8_0: mixture F16 is a float file type",
                         'default = "F16"')


def test_q1_0_has_no_shape_fallback(files):
    """Q1_0's 128-value blocks do not fit the tiny fixture's 64-wide attn_output, and llama-quantize defines no
    fallback for it: the plan stops at the first such tensor in llama-quantize's order (blk.0's attn_output comes
    before its ssm_f_b there), naming it. On the real K3 every row is a multiple of 128."""
    from kimi_convert.quant.driver import plan_file
    from kimi_convert.quant.plan import QuantizeError
    src, _, _ = files
    with pytest.raises(QuantizeError, match=r"^mixture Q1_0: blk\.0\.attn_output\.weight: row length 64 is not a "
                                            r"multiple of the Q1_0 block \(128\) and Q1_0 has no fallback type"):
        plan_file(open_gguf(src), load_policy("Q1_0"))
    config, tensors = real_k3()
    plan = plan_quantization(tensors, load_policy("Q1_0"), model=ModelFacts.of(config))
    assert {d.target for d in plan.decisions if not d.copied} == {QT.Q1_0, QT.Q6_K}     # output Q6_K


def test_kimi_convert_takes_the_mixture_names(files, out_dir):
    """kimi-convert --policy reads the names as kimi-quantize does: a mixture plans in its dry run and writes."""
    src, _, _ = files
    hf = src.parent / "Kimi-K3-tiny"
    r = run_cli(str(hf), str(out_dir / "c.gguf"), "--policy", "TQ2_0", "--dry-run")
    assert r.returncode == 0 and "TQ2_0" in r.stdout, r.stderr
    r = run_cli(str(hf), str(out_dir / "c.gguf"), "--policy", "TQ2_0")
    assert r.returncode == 0, r.stderr
    assert QT.TQ2_0 in {t.qtype for t in open_gguf(out_dir / "c.gguf").tensors.values()}
    (out_dir / "c.gguf").unlink()
    (out_dir / "c.gguf.manifest.json").unlink()
    assert_fails_cleanly(out_dir, run_cli(str(hf), str(out_dir / "c.gguf"), "--policy", "iq2_xxs"),
                         "did you mean llama-quantize's mixture IQ2_XXS?")
