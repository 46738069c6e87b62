"""kimi-verify check: passes on correct conversions, and fails, naming the culprit, on broken ones."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize
from typer.testing import CliRunner

from kimi_convert.runtime import forward as runtime_mod
from kimi_convert.convert.converter import build_plan, convert
from kimi_convert.fixtures.make_checkpoint import make_checkpoint
from kimi_convert.gguf_io import open_gguf
from kimi_convert.model import KimiConfig
from kimi_convert.runtime.margins import RoutingMargins
from kimi_convert.verify.check import (DIVERGENCE_MIN, TOLERANCES, Part, _Runs, check_cost, check_k31, check_perplexity,
                                       check_tensors, compare_logits, perplexity, perplexity_ratio, token_sequence, verify)
from kimi_convert.cli.verify import app

N = 24          # tokens: short keeps the file fast, and still > 4x the forced top_k


def failures(report) -> dict:
    return {p.key: p.failures for p in report.parts if p.ok is False}


def flip_byte(src: Path, dst: Path, tensor: str, at: int = 0) -> Path:
    shutil.copy(src, dst)
    off = open_gguf(dst).tensors[tensor].offset + at
    with open(dst, "r+b") as f:
        f.seek(off)
        b = f.read(1)[0]
        f.seek(off)
        f.write(bytes([b ^ 0x5A]))
    return dst


def set_field(src: Path, dst: Path, key: str, value) -> Path:
    shutil.copy(src, dst)
    r = GGUFReader(dst, "r+")
    f = r.fields[key]
    f.parts[f.data[0]][0] = value
    r.data.flush()
    del r
    return dst


def rewrite(src: Path, dst: Path, *, retype: dict | None = None, swap: dict | None = None,
            drop: tuple = (), add: dict | None = None) -> Path:
    """A copy of src through gguf's own writer: tensors re-typed (quantized), given another
    tensor's values, dropped, or added. Metadata is copied with its types."""
    retype, swap, add = retype or {}, swap or {}, add or {}
    r = GGUFReader(src)
    w = GGUFWriter(dst, r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        main = GGUFValueType(f.types[0])
        sub = GGUFValueType(f.types[-1]) if main == GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), main, sub)
    gf = open_gguf(src)
    for name, t in gf.tensors.items():
        if name in drop:
            continue
        qt = retype.get(name, t.qtype)
        if name in retype or name in swap:
            values = gf.tensors[swap.get(name, name)].to_float32()
            data = quantize(values, qt) if qt not in (QT.F32,) else values
            w.add_tensor(name, data, raw_dtype=qt)
        else:
            w.add_tensor(name, np.array(t.raw), raw_shape=t.raw.shape, raw_dtype=t.qtype)
    for name, arr in add.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


# ------------------------------------------------------------------------------------
# correct conversions pass

@pytest.mark.parametrize("arch", ["k3", "k31"])
@pytest.mark.parametrize("outtype", ["f32", "bf16"])
def test_passes_on_correct_conversions(arch, outtype, converted, k3_dir, k31_dir):
    hf = k3_dir if arch == "k3" else k31_dir
    report = verify(converted(arch, outtype), hf, length=N)
    assert report.ok, failures(report)
    assert report.tolerance["file_class"] == outtype
    t = report.part("tensors").figures
    assert t["matched"] == t["total"] == len(open_gguf(converted(arch, outtype)).tensors)
    assert t["by_mode"]["exact"] >= t["total"] - 6           # everything but ssm_a is bit-exact
    assert report.part("logits").figures["max_abs_diff"] < TOLERANCES["f32"].logits_rtol
    k31 = report.part("k31")
    if arch == "k3":
        assert k31.ok is None
    else:
        assert k31.ok and k31.figures["divergence_kl_max"] > 100 * DIVERGENCE_MIN
    assert 0.999 < report.part("perplexity").figures["ratio"] < 1.001
    cost = report.part("cost")            # nothing quantized: the file costs nothing against its checkpoint
    assert cost.ok is None and cost.info and cost.figures["kl_mean"] < TOLERANCES[outtype].kl_max


def test_lone_gguf_passes(converted):
    for arch, outtype in (("k3", "bf16"), ("k31", "f32")):
        report = verify(converted(arch, outtype), length=16)
        assert report.ok, failures(report)
        assert [p.key for p in report.parts] == ["structure", "metadata", "tensors", "forward", "k31"]


def test_split_file(tmp_path, k3_dir):
    out = tmp_path / "k3.gguf"
    convert(build_plan(k3_dir, "bf16"), out, split_max_tensors=60)
    parts = sorted(tmp_path.glob("k3-*-of-*.gguf"))
    assert len(parts) == 4
    report = verify(parts[2], k3_dir, length=16)          # any part names the whole file
    assert report.ok, failures(report)
    assert report.part("structure").figures["files"] == 4
    assert verify(parts[0], length=16).ok


# ------------------------------------------------------------------------------------
# broken files fail, naming what is wrong

def test_flipped_byte_fails_nonzero_and_names_the_tensor(tmp_path, converted, k3_dir):
    bad = flip_byte(converted("k3", "bf16"), tmp_path / "bad.gguf", "blk.1.attn_q.weight", at=1)
    res = CliRunner().invoke(app, ["check", str(k3_dir), str(bad), "--length", "16",
                                   "--json", str(tmp_path / "r.json")])
    assert res.exit_code == 1, res.output
    assert "blk.1.attn_q.weight" in res.output and "FAIL" in res.output
    report = json.loads((tmp_path / "r.json").read_text())
    tensors = next(p for p in report["parts"] if p["key"] == "tensors")
    assert report["ok"] is False and tensors["ok"] is False
    assert tensors["figures"]["mismatched"] == ["blk.1.attn_q.weight"]
    assert tensors["figures"]["matched"] == tensors["figures"]["total"] - 1


@pytest.mark.parametrize("arch,outtype,tensor,at", [
    ("k3", "f32", "blk.0.ffn_norm.weight", 2),            # F32
    ("k3", "bf16", "output.weight", 4001),                # BF16, deep inside a big tensor
    ("k3", "bf16", "blk.2.ffn_up_exps.weight", 17 * 5),   # MXFP4 expert: a scale byte
    ("k31", "bf16", "blk.3.indexer.attn_k.weight", 0),    # K3.1 indexer
    ("k31", "bf16", "blk.7.attn_k_b.weight", 7),          # split kv_b
    ("k3", "f32", "blk.0.ssm_conv1d_q.weight", 3),        # reshaped conv
    ("k3", "f32", "output_res_score.weight", 0),          # fused norm*proj
])
def test_any_corrupted_tensor_is_named(tmp_path, converted, k3_dir, k31_dir, arch, outtype, tensor, at):
    bad = flip_byte(converted(arch, outtype), tmp_path / "bad.gguf", tensor, at)
    part = check_tensors(Part("tensors", "tensors"), build_plan(k3_dir if arch == "k3" else k31_dir, "f32"),
                         open_gguf(bad), lambda s: None)
    assert part.ok is False
    assert part.figures["mismatched"] == [tensor]


def test_wrong_metadata_value_fails(tmp_path, converted, k3_dir):
    bad = set_field(converted("k3", "bf16"), tmp_path / "bad.gguf", "kimi-k3.context_length", 4096)
    report = verify(bad, k3_dir, length=16)
    assert not report.ok
    assert set(failures(report)) == {"metadata"}
    assert any("kimi-k3.context_length" in f and "4096" in f for f in report.part("metadata").failures)
    # and on its own the file's keys are still consistent (context_length is free)
    assert verify(bad, length=8).part("metadata").ok


def test_wrong_indexer_metadata_fails(tmp_path, converted, k31_dir):
    bad = set_field(converted("k31", "bf16"), tmp_path / "bad.gguf", "kimi-k31.attention.indexer.top_k", 5)
    report = verify(bad, k31_dir, length=16)
    assert not report.ok
    assert any("indexer.top_k" in f for f in report.part("metadata").failures)
    assert report.part("logits").ok is False        # top_k 5 < 16 tokens: the file computes otherwise


def test_k31_detects_a_top_k_that_does_not_bite(monkeypatch, converted, k31_dir):
    # a runtime that ignores a forced top_k: attention stays dense, nothing diverges
    monkeypatch.setattr(runtime_mod.KimiConfig, "with_top_k", lambda self, top_k: self)
    gguf = converted("k31", "bf16")
    cfg = KimiConfig.from_gguf(open_gguf(gguf).fields)
    ids = token_sequence(open_gguf(gguf), N)
    part = check_k31(Part("k31", "k31"), _Runs(gguf, k31_dir, ids), cfg, TOLERANCES["bf16"])
    assert part.ok is False
    assert any("does not diverge" in f for f in part.failures)
    assert any("runtime vs reference" in f for f in part.failures)


def test_k31_detects_a_wrong_selection(monkeypatch, converted, k31_dir):
    # an indexer that keeps the lowest scores still diverges, but no longer matches the reference
    real = runtime_mod.select_top_k
    monkeypatch.setattr(runtime_mod, "select_top_k", lambda score, k: real(
        np.where(np.isfinite(score), -score, score), k))
    gguf = converted("k31", "f32")
    cfg = KimiConfig.from_gguf(open_gguf(gguf).fields)
    ids = token_sequence(open_gguf(gguf), N)
    part = check_k31(Part("k31", "k31"), _Runs(gguf, k31_dir, ids), cfg, TOLERANCES["f32"])
    assert part.ok is False
    assert any("top_k=6 runtime vs reference" in f for f in part.failures)


def test_quantized_tensor_is_recomputed_byte_for_byte(tmp_path, converted, k3_dir):
    """Tensors quantized by another implementation (gguf-py's Q8_0 and Q4_0, which write ggml's bytes for
    these types) equal our quantization of their source; a tensor holding another one's values does not.
    (Files from kimi-quantize and llama-quantize: tests/test_verify_quantized.py.)"""
    src, plan = converted("k3", "bf16"), build_plan(k3_dir, "f32")
    good = rewrite(src, tmp_path / "q8.gguf", retype={"blk.1.attn_q.weight": QT.Q8_0,
                                                      "blk.2.ffn_up_shexp.weight": QT.Q4_0})
    part = check_tensors(Part("tensors", "t"), plan, open_gguf(good), lambda s: None)
    assert part.ok, part.failures
    rows = {r["tensor"]: r for r in part.rows}
    for name in ("blk.1.attn_q.weight", "blk.2.ffn_up_shexp.weight"):
        assert rows[name]["mode"] == "quantized" and rows[name]["n_diff"] == 0 < rows[name]["n_blocks"]
    assert verify(good, length=8).tolerance["file_class"] == "quantized"
    bad = rewrite(src, tmp_path / "swapped.gguf", retype={"blk.1.attn_q.weight": QT.Q8_0},
                  swap={"blk.1.attn_q.weight": "blk.1.attn_k.weight"})
    part = check_tensors(Part("tensors", "t"), plan, open_gguf(bad), lambda s: None)
    assert part.figures["mismatched"] == ["blk.1.attn_q.weight"]


def test_missing_and_extra_tensors(tmp_path, converted, k3_dir):
    src = converted("k3", "bf16")
    bad = rewrite(src, tmp_path / "bad.gguf", drop=("blk.2.ssm_a",),
                  add={"blk.2.attn_kv_b.weight": np.zeros((4, 4), np.float32)})
    for report in (verify(bad, k3_dir, length=8), verify(bad, length=8)):
        assert not report.ok
        text = " ".join(report.part("tensors").failures)
        assert "blk.2.ssm_a: missing" in text and "blk.2.attn_kv_b.weight" in text


def test_lone_gguf_catches_nan_and_truncation(tmp_path, converted):
    src = converted("k3", "f32")
    bad = tmp_path / "nan.gguf"
    shutil.copy(src, bad)
    t = open_gguf(bad).tensors["blk.4.attn_norm.weight"]
    with open(bad, "r+b") as f:
        f.seek(t.offset + 8)
        f.write(np.array([np.nan], np.float32).tobytes())
    report = verify(bad, length=8)
    assert [f for f in report.part("tensors").failures if f.startswith("blk.4.attn_norm.weight")] == [
        "blk.4.attn_norm.weight: invalid F32 data (as ggml_validate_row_data): nan value at row 0, element 2"]
    assert report.part("forward").ok is False
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(src.read_bytes()[:-1000])
    res = CliRunner().invoke(app, ["check", str(cut)])
    assert res.exit_code == 1 and "structure" in res.output


# ------------------------------------------------------------------------------------
# pieces

def test_token_sequence_is_fixed_and_ordinary(converted):
    gf = open_gguf(converted("k3", "bf16"))
    ids = token_sequence(gf, 32)
    assert ids == token_sequence(gf, 32) != token_sequence(gf, 32, seed=1)
    types = gf.fields["tokenizer.ggml.token_type"]
    assert len(ids) == 32 and all(types[i] == 1 for i in ids)          # no control / unused ids


def test_near_ties_are_excluded_only_where_flagged():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((8, 50)).astype(np.float32)
    run = ref.copy()
    run[5] += 0.5                                  # one position is off
    tol = TOLERANCES["f32"]
    assert not compare_logits(run, ref, tol, [])["ok"]
    c = compare_logits(run, ref, tol, [5])
    assert c["ok"] and c["excluded"] == [5] and c["judged"] == 7
    assert not compare_logits(run, ref, tol, [0, 1, 2, 3, 5])["ok"]   # too few positions left


class _FixedRuns:
    """Logits given, for the parts that only compare them (no forward pass)."""

    def __init__(self, run: np.ndarray, ref: np.ndarray, ids: list[int]):
        self._run, self._ref, self.ids, self.weights = run, ref, ids, None

    def runtime(self, **_):
        return self._run, RoutingMargins()

    def reference(self, **_):
        return self._ref, RoutingMargins()


def test_huge_logits_give_an_infinite_perplexity_not_an_overflow():
    # flipped data bytes can make logits of 1e30: exp(mean NLL) overflowed a float (OverflowError, seed 5 run 211)
    rng = np.random.default_rng(0)
    ids = [int(i) for i in rng.integers(0, 50, 8)]
    ref = rng.standard_normal((8, 50))
    run = ref.copy()
    run[:, 0] = 1e30                               # the file's logits put every token but 0 at -1e30
    assert perplexity(run, ids) == math.inf and np.isfinite(perplexity(ref, ids))
    log_ratio, ratio = perplexity_ratio(run, ref, ids)
    assert log_ratio > 1e29 and ratio == math.inf
    assert perplexity_ratio(ref, run, ids)[1] == 0.0
    part = check_perplexity(Part("perplexity", "perplexity"), _FixedRuns(run, ref, ids), TOLERANCES["f32"])
    assert part.ok is False and part.failures[0].startswith("perplexity ratio inf: |ln ratio| ")
    part = check_perplexity(Part("perplexity", "perplexity"), _FixedRuns(ref, run, ids), TOLERANCES["f32"])
    assert part.ok is False and part.failures[0].startswith("perplexity ratio 0.000000: |ln ratio| ")
    cost = check_cost(Part("cost", "cost"), _FixedRuns(run, ref, ids), None)
    assert cost.figures["ppl_runtime"] == math.inf and cost.figures["ppl_ratio"] == math.inf


def test_cli_usage_errors_are_one_line(tmp_path, converted):
    runner = CliRunner()
    res = runner.invoke(app, ["check", str(tmp_path / "missing.gguf")])
    assert res.exit_code == 1 and res.output.startswith("error:") and res.output.count("\n") == 1
    res = runner.invoke(app, ["check", str(tmp_path), str(converted("k3", "bf16"))])
    assert res.exit_code == 1 and "error:" in res.output                 # not a checkpoint
    res = runner.invoke(app, ["check", str(converted("k3", "bf16")), "--length", "12"])
    assert res.exit_code == 0, res.output


# ------------------------------------------------------------------------------------
# the report says the one thing that is wrong, and only what is true

NO_TORCH = '''
import sys
class NoTorch:
    """`import torch` fails as on an install without the [verify] extra."""
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTorch())
'''


def run_without_torch(tmp_path, *args) -> subprocess.CompletedProcess:
    blocker = tmp_path / "no-torch"
    blocker.mkdir(exist_ok=True)
    (blocker / "sitecustomize.py").write_text(NO_TORCH)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocker), *filter(None, [os.environ.get("PYTHONPATH")])]),
               COLUMNS="200")
    return subprocess.run([sys.executable, "-c", "from kimi_convert.cli.verify import main; main()", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=600)


def test_missing_torch_is_not_the_files_fault(tmp_path, converted, k31_dir):
    good = converted("k31", "bf16")
    res = run_without_torch(tmp_path, "check", k31_dir, good, "--length", 8, "--json", tmp_path / "r.json")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ModuleNotFoundError" not in res.stdout + res.stderr
    assert "the torch reference needs torch: pip install 'kimi-convert[verify]' (torch==2.13.0, CPU)" in res.stdout
    parts = {p["key"]: p for p in json.loads((tmp_path / "r.json").read_text())["parts"]}
    assert parts["logits"]["ok"] is None and parts["perplexity"]["ok"] is None       # n/a, not failed
    assert parts["cost"]["ok"] is None
    assert parts["tensors"]["ok"] and parts["metadata"]["ok"]                        # still judged
    assert parts["k31"]["ok"] and parts["k31"]["figures"]["divergence_kl_max"] > DIVERGENCE_MIN  # runtime half
    # and a broken file still fails, on the parts that need no torch
    bad = flip_byte(good, tmp_path / "bad.gguf", "blk.3.attn_q_b.weight", at=1)
    res = run_without_torch(tmp_path, "check", k31_dir, bad, "--length", 8)
    assert res.returncode == 1 and "blk.3.attn_q_b.weight" in res.stdout


def test_a_checkpoint_of_another_seed_is_one_line(tmp_path, converted):
    other = make_checkpoint(tmp_path / "seed1", arch="k3", seed=1)
    part = check_tensors(Part("tensors", "t"), build_plan(other, "f32"), open_gguf(converted("k3", "bf16")),
                         lambda s: None)
    assert part.failures == [f"none of the 218 tensors holds the values of its source in {other}: "
                             f"the file was not converted from this checkpoint"]
    assert part.summary == "0/218 tensors match their HF source (0/212 bit-exact, 0/6 ssm_a within 4 ulp)"
    assert len(part.rows) == 218 and not any(r["ok"] for r in part.rows)              # details in --json


def test_not_a_gguf_is_one_message(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_text("these are notes, not a model\n")
    report = verify(bad)
    assert [p.key for p in report.parts] == ["structure"]
    s = report.part("structure")
    assert s.failures == [f"{bad}: not a GGUF file (it does not start with the GGUF magic)"]
    assert s.summary == "not a readable GGUF file"
    res = CliRunner().invoke(app, ["check", str(bad)])
    assert res.exit_code == 1 and res.output.count("GGUF magic") == 1 and "aligned" not in res.output


def test_a_truncated_gguf_says_truncated(tmp_path, converted):
    data = converted("k3", "f32").read_bytes()
    size = len(data) - 1000
    cut = next(t for t in open_gguf(converted("k3", "f32")).tensors.values() if t.offset + t.nbytes > size)
    end = cut.offset + cut.nbytes
    for kept, says in ((data[:size], f"truncated: tensor {cut.name} ends at byte {end}, "
                                     f"the file has {size} bytes ({end - size} missing)"),
                       (data[:3000], "truncated, or a damaged count: the header counts 218 tensors, which the "
                                     "2976 bytes left cannot hold (each takes at least 32)")):
        f = tmp_path / "cut.gguf"
        f.write_bytes(kept)
        assert verify(f).part("structure").failures == [f"{f}: {says}"]


def test_another_architecture_is_one_line(converted, k31_dir):
    report = verify(converted("k3", "bf16"), k31_dir, length=8)
    assert failures(report) == {"metadata": [
        f"general.architecture is kimi-k3, but {k31_dir} is a kimi-k31 checkpoint: the file was not made from it"]}
    assert {p.key: p.ok for p in report.parts} == {"structure": True, "tensors": None, "metadata": False,
                                                  "logits": None, "perplexity": None, "cost": None}


def test_the_lone_check_names_no_reference_tolerance(converted):
    res = CliRunner().invoke(app, ["check", str(converted("k3", "bf16")), "--length", "8"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "reference" not in res.output                     # there is none: nothing is relative to it
    assert "no logits tolerance applies: logits are compared only against a checkpoint" in res.output


def test_the_json_path_is_checked_before_any_work(tmp_path, monkeypatch, converted):
    import kimi_convert.verify.check as verify_mod
    monkeypatch.setattr(verify_mod, "verify", lambda *a, **k: pytest.fail("the check ran before the path was checked"))
    gguf = str(converted("k3", "bf16"))
    for target, says in ((Path("/nonexistent/r.json"), "the folder /nonexistent does not exist"),
                         (tmp_path, "is a folder")):
        res = CliRunner().invoke(app, ["check", gguf, "--json", str(target)])
        assert res.exit_code == 1 and res.output.startswith(f"error: {target}: ") and says in res.output, res.output
        assert res.output.count("\n") == 1
