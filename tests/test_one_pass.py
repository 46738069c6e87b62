"""kimi-convert --policy: the one pass from checkpoint to quantized GGUF must write, byte for byte, the file that
kimi-convert followed by kimi-quantize with the same policy writes (every tensor's bytes, type and shape, every key
with its value type and order, quantize.* and general.file_type included), on K3 and K3.1, with and without an
imatrix, split or not; its dry run reads headers only; bad input is one error line and no output."""
from __future__ import annotations

import json
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import pytest
import numpy as np
from gguf import GGMLQuantizationType as QT

from kimi_convert.cli.common import human
from kimi_convert.convert.converter import build_plan, convert, plan_policy
from kimi_convert.fixtures.imatrix import k3_entries, write_gguf_imatrix
from kimi_convert.fixtures.make_checkpoint import make_checkpoint
from kimi_convert.gguf_io import open_gguf
from kimi_convert.quant import onepass
from kimi_convert.quant.driver import quantize_file
from kimi_convert.quant.imatrix import load_imatrix
from kimi_convert.quant.plan import PlanOptions
from kimi_convert.quant.policy import load_policy, tensor_type_rules
from test_convert_errors import assert_fails_cleanly, run_cli
from test_quantize_cli import AIMED_AT_PROTECTED, printed, protected_lines

# rules, `keep`, a shape fallback (KDA rows of 16), rules aimed at protected tensors (MXFP4 experts, norms, the
# K3.1 indexer), and --tensor-type tokens tried first
MIXED = '''description = "test mixture"
default = "Q4_K"
[[rules]]
pattern = "attn_(q_a|q_b|kv_a_mqa)"
type = "Q8_0"
[[rules]]
pattern = "ffn_down"
type = "Q6_K"
[[rules]]
pattern = "token_embd"
type = "keep"
[[rules]]
pattern = "indexer|_norm"
type = "Q8_0"
[[rules]]
pattern = "ssm_f_a|ssm_beta"
type = "BF16"
[[rules]]
pattern = "output\\\\.weight"
type = "IQ4_XS"
'''
MIXED_TOKENS = ["attn_output=q5_k", "shexp=q4_0"]


@dataclass
class Model:
    hf: Path
    converted: Path          # plain kimi-convert output: the two-pass route's input
    imatrix: str             # as the user spells it: it goes into quantize.imatrix.file


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> Model: the smallest checkpoints with every layer kind (a dense KDA layer, an MoE MLA layer) and
    rows of 256, so that the K-quants are not all shape fallbacks."""
    root = tmp_path_factory.mktemp("one_pass")
    made: dict[str, Model] = {}

    def get(arch: str, outtype: str = "bf16", f32_sources: str = "", **spec) -> Model:
        key = arch + outtype + "".join(f"-{k}{v}" for k, v in sorted(spec.items())) + ("-f32" if f32_sources else "")
        if key not in made:
            hf = make_checkpoint(root / key / "Kimi-tiny", arch=arch, n_layers=2, hidden=256, q_lora_rank=256,
                                 moe_intermediate_size=256, routed_expert_hidden_size=256, intermediate_size=512,
                                 seed=7, **spec)
            if f32_sources:
                widen_to_f32(hf, f32_sources)
            converted = root / key / "converted.gguf"
            convert(build_plan(hf, outtype), converted)
            shapes = {n: t.shape for n, t in open_gguf(converted).tensors.items()}
            imatrix = write_gguf_imatrix(root / key / "k.imatrix.gguf", k3_entries(shapes, seed=5), chunk_count=12)
            made[key] = Model(hf, converted, str(imatrix))
        return made[key]

    return get


def widen_to_f32(hf: Path, pattern: str) -> None:
    """Store the BF16 tensors whose names match `pattern` as F32 values that BF16 cannot hold (the low 16 bits
    of each set): the converter rounds them to BF16, so the two-pass route quantizes the rounded values."""
    for shard in hf.glob("*.safetensors"):
        raw = shard.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header, base = json.loads(raw[8:8 + n]), 8 + n
        entries = sorted(((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"])
        out = {k: v for k, v in header.items() if k == "__metadata__"}
        blobs, off = [], 0
        for name, info in entries:
            data = raw[base + info["data_offsets"][0]:base + info["data_offsets"][1]]
            if info["dtype"] == "BF16" and re.search(pattern, name):
                bits = np.frombuffer(data, "<u2").astype("<u4") << 16
                bits |= (np.arange(bits.size, dtype="<u4") * np.uint32(40503) + np.uint32(1)) & np.uint32(0xFFFF)
                data, info = bits.tobytes(), dict(info, dtype="F32")
            out[name] = dict(info, data_offsets=[off, off + len(data)])
            blobs.append(data)
            off += len(data)
        text = json.dumps(out).encode()
        text += b" " * (-len(text) % 8)
        shard.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def policy_of(spec: str, tmp_path: Path, tokens=()):
    if spec == "mixed":
        (tmp_path / "mixed.toml").write_text(MIXED)
        spec, tokens = str(tmp_path / "mixed.toml"), MIXED_TOKENS
    elif spec.startswith("default"):
        (tmp_path / "p.toml").write_text(spec + "\n")
        spec = str(tmp_path / "p.toml")
    return load_policy(spec).with_tensor_types(tensor_type_rules(list(tokens), []))


def one_pass(m: Model, out: Path, pol, imatrix=None, outtype="bf16", allow_requantize=False, **kw):
    plan = build_plan(m.hf, outtype)
    quant = plan_policy(plan, pol, PlanOptions(allow_requantize=allow_requantize), imatrix=imatrix)
    return convert(plan, out, quant=quant, **kw).paths


def two_pass(m: Model, out: Path, pol, imatrix=None, allow_requantize=False, **kw):
    return quantize_file(m.converted, out, pol, PlanOptions(allow_requantize=allow_requantize), imatrix=imatrix,
                         **kw).paths


def assert_identical(one: Path, two: Path) -> None:
    """Byte for byte; if not, the first key or tensor that differs, for the message."""
    if one.read_bytes() == two.read_bytes():
        return
    a, b = open_gguf(one), open_gguf(two)
    keys_a = [(k, a.types[k], a.fields[k]) for k in a.fields]
    keys_b = [(k, b.types[k], b.fields[k]) for k in b.fields]
    for x, y in zip(keys_a, keys_b):
        assert x == y, f"first differing key: {str(x)[:300]} != {str(y)[:300]}"
    assert len(keys_a) == len(keys_b), ([k for k, *_ in keys_a][-6:], [k for k, *_ in keys_b][-6:])
    assert list(a.tensors) == list(b.tensors), "tensor order differs"
    for name, t in a.tensors.items():
        u = b.tensors[name]
        assert (t.qtype, t.shape) == (u.qtype, u.shape), (name, t.qtype.name, t.shape, u.qtype.name, u.shape)
        assert t.raw_bytes().tobytes() == u.raw_bytes().tobytes(), f"{name}: bytes differ"
    raise AssertionError(f"{one} and {two} differ outside keys and tensors (padding or offsets)")


CASES = [(arch, pol, imat) for arch in ("k3", "k31") for pol in ("q8_0", 'default = "Q4_K"', "mixed")
         for imat in (False, True)] + [("k3", "Q4_K_M", False), ("k31", "Q2_K_S", True)]    # llama-quantize mixtures


@pytest.mark.parametrize("arch,spec,with_imatrix", CASES,
                         ids=[f"{a}-{p.split()[-1].strip(chr(34))}-{'imatrix' if i else 'plain'}" for a, p, i in CASES])
def test_one_pass_equals_convert_then_quantize(models, tmp_path, arch, spec, with_imatrix):
    m = models(arch)
    pol = policy_of(spec, tmp_path)
    imat = load_imatrix(m.imatrix) if with_imatrix else None
    one = one_pass(m, tmp_path / "one.gguf", pol, imat)[0]
    two = two_pass(m, tmp_path / "two.gguf", pol, imat)[0]
    assert_identical(one, two)
    out, src = open_gguf(one), open_gguf(m.converted)
    assert ("quantize.imatrix.file" in out.fields) == with_imatrix
    quantized = {n for n, t in out.tensors.items() if t.qtype != src.tensors[n].qtype}
    assert len(quantized) > len(out.tensors) // 3
    exps = "blk.1.ffn_down_exps.weight"       # MXFP4 experts: copied byte for byte, whatever the rules say
    assert out.tensors[exps].qtype == QT.MXFP4
    assert out.tensors[exps].raw_bytes().tobytes() == src.tensors[exps].raw_bytes().tobytes()
    for name in (n for n in src.tensors if ".indexer." in n):      # K3.1: the indexer keeps its type
        assert out.tensors[name].qtype == src.tensors[name].qtype, name
    if spec == "mixed":
        assert out.tensors["blk.1.attn_q_a.weight"].qtype == QT.Q8_0
        assert out.tensors["blk.1.ffn_down_shexp.weight"].qtype == QT.Q4_0       # the token beats the rule
        assert out.tensors["token_embd.weight"].qtype == QT.BF16                 # keep
        assert out.tensors["output.weight"].qtype == QT.IQ4_XS
    if with_imatrix and spec != "q8_0" and not pol.requires:     # the imatrix is used (Q8_0 ignores it, as ggml does)
        plain = one_pass(m, tmp_path / "plain.gguf", pol)[0]
        assert plain.read_bytes() != one.read_bytes()


@pytest.mark.parametrize("case", ["mxfp4-requantized", "bf16-experts-f32"])
def test_one_pass_equals_two_pass_on_other_sources(models, tmp_path, case):
    """MXFP4 experts re-quantized (--allow-requantize and a rule): dequantized per expert, as kimi-quantize
    dequantizes the converted file; BF16 experts converted to F32 (--outtype f32): the values the two-pass
    route reads back are the F32 ones."""
    if case == "mxfp4-requantized":
        m, outtype, kw = models("k3"), "bf16", {"allow_requantize": True}
        pol = policy_of("mixed", tmp_path).with_tensor_types(tensor_type_rules(["exps=q4_k"], []))
    else:
        m, outtype, kw = models("k3", experts_mxfp4=False, outtype="f32"), "f32", {}
        pol = policy_of('default = "Q4_K"', tmp_path)
    imat = load_imatrix(m.imatrix)
    one = one_pass(m, tmp_path / "one.gguf", pol, imat, outtype=outtype, **kw)[0]
    two = two_pass(m, tmp_path / "two.gguf", pol, imat, **kw)[0]
    assert_identical(one, two)
    assert open_gguf(one).tensors["blk.1.ffn_gate_exps.weight"].qtype == QT.Q4_K


def test_f32_sources_are_quantized_from_their_bf16_rounding(models, tmp_path):
    """F32 checkpoint tensors (layer 1's projections, kv_b split into attn_k_b / attn_v_b among them): the one
    pass quantizes the BF16 values the converter writes, as the two-pass route does; from the F32 values
    themselves (--outtype f32) the blocks would differ."""
    m = models("k3", f32_sources=r"layers\.1\..*(proj|shared_experts).*weight")
    pol = policy_of('default = "Q4_K"', tmp_path)
    imat = load_imatrix(m.imatrix)
    one = one_pass(m, tmp_path / "one.gguf", pol, imat)[0]
    assert_identical(one, two_pass(m, tmp_path / "two.gguf", pol, imat)[0])
    unrounded = open_gguf(one_pass(m, tmp_path / "f32.gguf", pol, imat, outtype="f32")[0]).tensors
    for name in ("blk.1.attn_q_a.weight", "blk.1.attn_k_b.weight", "blk.1.ffn_up_shexp.weight"):
        t = open_gguf(one).tensors[name]
        assert t.qtype == unrounded[name].qtype and t.raw_bytes().tobytes() != unrounded[name].raw_bytes().tobytes()


@pytest.mark.parametrize("mxfp4", [True, False], ids=["mxfp4-experts", "bf16-experts"])
def test_stacked_experts_are_quantized_one_expert_at_a_time(models, tmp_path, monkeypatch, mxfp4):
    """StreamedRows never holds more than one expert of a stacked tensor: the producer yields one expert at a
    time (an MXFP4 repack, or the byte ranges of a BF16 one), and quantize_rows asks for rows that never cross
    an expert."""
    m = models("k3", experts_mxfp4=mxfp4)
    held: dict[str, list[int]] = {}
    real_take = onepass.StreamedRows._take

    def spy(self, n):
        out = real_take(self, n)
        held.setdefault(self.name, []).append(n + self.n_held)     # asked for, plus what is left over
        return out

    monkeypatch.setattr(onepass.StreamedRows, "_take", spy)
    pol = policy_of('default = "Q4_K"', tmp_path)
    one_pass(m, tmp_path / "one.gguf", pol, allow_requantize=True)
    src = open_gguf(m.converted).tensors["blk.1.ffn_up_exps.weight"]
    n_expert = src.shape[0]
    assert len(held[src.name]) == n_expert > 1
    assert max(held[src.name]) == src.nbytes // n_expert


def test_split_output_equals_two_pass_split(models, tmp_path):
    m = models("k31")
    pol = policy_of("mixed", tmp_path)
    imat = load_imatrix(m.imatrix)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ones = one_pass(m, tmp_path / "a" / "q.gguf", pol, imat, split_max_size=1_000_000)
    twos = two_pass(m, tmp_path / "b" / "q.gguf", pol, imat, split_max_size=1_000_000)
    assert len(ones) > 2 and [p.name for p in ones] == [p.name for p in twos]
    for a, b in zip(ones, twos):
        assert_identical(a, b)


# --- the command line -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """The smallest K3 checkpoint (2 layers, default widths) for the command-line runs."""
    return make_checkpoint(tmp_path_factory.mktemp("cli") / "Kimi-K3-tiny", arch="k3", n_layers=2)


@pytest.fixture
def out_dir(tmp_path) -> Path:
    d = tmp_path / "out"
    d.mkdir()
    return d


def poisoned(hf: Path, dst: Path) -> Path:
    """A copy whose tensor data are all BF16 +Inf (bytes 80 7f), headers intact: a run that reads the data
    quantizes them into invalid blocks and fails; a run that reads headers only cannot tell."""
    shutil.copytree(hf, dst)
    for shard in dst.glob("*.safetensors"):
        raw = bytearray(shard.read_bytes())
        start = 8 + struct.unpack("<Q", raw[:8])[0]
        raw[start:] = b"\x80\x7f" * ((len(raw) - start) // 2)
        shard.write_bytes(raw)
    return dst


def test_dry_run_prints_the_quantized_plan_from_headers_only(small, tmp_path, out_dir):
    plan = build_plan(small)
    expected = plan_policy(plan, load_policy("q8_0"))
    bad = poisoned(small, tmp_path / "inf")
    r = run_cli(bad, out_dir / "q.gguf", "--policy", "q8_0", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "one-pass plan for q.gguf" in r.stdout
    assert "routed experts: copied MXFP4" in r.stdout and "BF16 -> Q8_0" in r.stdout
    assert f"tensor data {sum(expected.sizes):,} bytes" in r.stdout, r.stdout
    assert f"quantized by preset q8_0 ({human(plan.total_bytes)} unquantized)" in r.stdout
    total = [line for line in r.stdout.splitlines() if "total" in line]
    assert len(total) == 1 and f" {len(plan.tensors)} " in total[0], r.stdout
    assert list(out_dir.iterdir()) == []
    # the sizes are the real ones: the run on the good checkpoint writes exactly them
    written = convert(plan, tmp_path / "q.gguf", quant=expected).paths[0]
    assert sum(t.nbytes for t in open_gguf(written).tensors.values()) == sum(expected.sizes)
    # and the data of the poisoned copy are really read by a run, which refuses them: one line, no output
    r = run_cli(bad, out_dir / "q.gguf", "--policy", "q8_0")
    assert_fails_cleanly(out_dir, r, "token_embd.weight", "invalid Q8_0")


def policy_file(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "policy.toml"
    p.write_text(text)
    return p


def mismatched_imatrix(tmp_path: Path, hf: Path) -> Path:
    shapes = {t.name: t.shape for t in build_plan(hf).tensors}
    entries = k3_entries(shapes)
    sums, counts = entries["blk.0.attn_q.weight"]
    entries["blk.0.attn_q.weight"] = (sums[:, :-32], counts)
    return write_gguf_imatrix(tmp_path / "wrong.imatrix.gguf", entries)


ERRORS = {
    # the policy is read before the checkpoint: its error comes first, even when HF_DIR does not exist
    "policy line, before the checkpoint": (
        lambda t, hf: [t / "missing-checkpoint", "--policy",
                       policy_file(t, 'default = "Q8_0"\n[[rules]]\npattern = "x"\ntype = "Q3_KM"\n')],
        ["policy.toml:4", "unknown type 'Q3_KM'"]),
    "policy syntax": (lambda t, hf: [hf, "--policy", policy_file(t, 'default = "Q8_0"\n[[rules]\n')],
                      ["policy.toml", "TOML syntax error", "line 2"]),
    "unknown preset": (lambda t, hf: [hf, "--policy", "k9-tiny"], ["k9-tiny", "no such policy file or preset"]),
    "mismatched imatrix": (lambda t, hf: [hf, "--policy", "q8_0", "--imatrix", mismatched_imatrix(t, hf)],
                           ["wrong.imatrix.gguf", "blk.0.attn_q.weight"]),
    "imatrix without policy": (lambda t, hf: [hf, "--imatrix", t / "x.imatrix"], ["--imatrix", "--policy"]),
    "strict": (lambda t, hf: [hf, "--policy", "q8_0", "--strict", "--tensor-type", "exps=q4_k"],
               ["--strict", "1 rule(s) name protected tensors (mxfp4)", "--tensor-type exps=q4_k ('exps' -> Q4_K)"]),
}


@pytest.mark.parametrize("case", ERRORS)
def test_bad_input_is_one_error_line_and_no_output(case, small, tmp_path, out_dir):
    make_args, needles = ERRORS[case]
    hf, *rest = make_args(tmp_path, small)
    r = run_cli(hf, out_dir / "q.gguf", *rest)
    assert_fails_cleanly(out_dir, r, *needles)
    if case.startswith("policy line"):
        assert "missing-checkpoint" not in r.stderr



def test_strict_names_every_colliding_rule(k31_dir, tmp_path, out_dir):
    """kimi-convert --policy --strict, in its one pass, refuses as kimi-quantize --strict does: a line for each
    rule and protection (the MXFP4 experts, the K3.1 indexer, its 1-D k_norm), then the one error line."""
    pol = policy_file(tmp_path, AIMED_AT_PROTECTED)
    plan = build_plan(k31_dir)
    want = protected_lines(pol, [(t.name, t.qtype) for t in plan.tensors])
    r = run_cli(k31_dir, out_dir / "q.gguf", "--policy", pol, "--strict")
    assert_fails_cleanly(out_dir, r, "--strict: 2 rule(s) name protected tensors", f"{pol}:3 ('_exps' -> Q4_K)",
                         f"{pol}:6 ('indexer\\\\.' -> Q8_0)", "nothing is written")
    assert printed(r.stderr, "refused: ") == want, r.stderr
    notes = run_cli(k31_dir, out_dir / "q.gguf", "--policy", pol, "--dry-run")
    assert notes.returncode == 0, notes.stderr
    assert printed(notes.stderr, "note: ") == want, notes.stderr
