"""Nothing lost (kimi_convert.paths): no command writes over a file it reads, reports included, with --force or
without; a report that cannot be written leaves no output; a policy pattern that backtracks for ever, a TOML nested
a thousand deep and a 250-byte output name each end as one line, not as a hang, a traceback or a refusal.

Every input here is a private copy, hashed before the run and compared after it: a test that fails leaves the
session's shared fixtures alone."""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import threading
from pathlib import Path

import pytest

from kimi_convert.fixtures.imatrix import k3_entries, write_gguf_imatrix
from kimi_convert.gguf_io import open_gguf
from kimi_convert.gguf_io.manifest import manifest_path

from test_cli_defence import listing, run, run_guarded

EVIL = r"^(.+)+x$"          # exponential backtracking: seconds a tensor name, doubling with each character


def digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def digests(paths) -> dict:
    return {Path(p): digest(p) for p in paths}


@pytest.fixture
def hf(k3_dir, tmp_path) -> Path:
    """A private copy of the K3 fixture checkpoint."""
    return Path(shutil.copytree(k3_dir, tmp_path / "Kimi-K3-tiny"))


@pytest.fixture(scope="module")
def k3_gguf(converted) -> Path:
    return converted("k3")


@pytest.fixture
def src(k3_gguf, tmp_path) -> Path:
    """A private copy of the converted K3 fixture."""
    return Path(shutil.copyfile(k3_gguf, tmp_path / "in.gguf"))


@pytest.fixture
def imatrix(k3_gguf, tmp_path) -> Path:
    shapes = {n: t.shape for n, t in open_gguf(k3_gguf).tensors.items()}
    return write_gguf_imatrix(tmp_path / "k3.imatrix.gguf", k3_entries(shapes))


@pytest.fixture
def policy(tmp_path) -> Path:
    p = tmp_path / "p.toml"
    p.write_text('default = "Q8_0"\n')
    return p


@pytest.fixture
def keep(tmp_path) -> Path:
    p = tmp_path / "keep.toml"
    p.write_text('default = "keep"\n')
    return p


@pytest.fixture
def split_in(k3_gguf, keep, tmp_path) -> list[Path]:
    """The K3 fixture as a split set of three parts or more, tensors as they are."""
    d = tmp_path / "split"
    d.mkdir()
    r = run("kimi-quantize", "--policy", keep, k3_gguf, d / "s.gguf", "--split-max-size", "1M")
    assert r.code == 0, r.err
    parts = sorted(d.glob("s-*-of-*.gguf"))
    assert len(parts) >= 3
    return parts


def refused(r, path: Path, what: str) -> None:
    """One error line, naming the output path and the input it would have overwritten."""
    line = r.one_error()
    assert line.startswith(f"error: {path}: the ") and "which this run reads" in line and what in line, line
    assert "--force never overwrites an input" in line, line
    assert r.fallback is None


# ------------------------------------------------------------------ kimi-convert

@pytest.mark.parametrize("target", ["model-00001-of-000005.safetensors", "config.json", "tiktoken.model",
                                    "model.safetensors.index.json"])
def test_convert_never_writes_over_a_file_of_the_checkpoint(hf, target):
    before = digests(hf.iterdir())
    r = run("kimi-convert", hf, hf / target, "--force")
    refused(r, hf / target, "checkpoint")
    assert digests(hf.iterdir()) == before
    assert sorted(p.name for p in hf.iterdir()) == sorted(p.name for p in before)    # no lock, no partial folder


def test_convert_dry_run_refuses_the_same(hf):
    r = run("kimi-convert", hf, hf / "config.json", "--force", "--dry-run")
    refused(r, hf / "config.json", "checkpoint's config")


def test_one_pass_never_writes_over_its_policy_or_imatrix(hf, policy, imatrix, tmp_path):
    before = digests([policy, imatrix])
    r = run("kimi-convert", hf, policy, "--policy", policy, "--force")
    refused(r, policy, "policy file")
    r = run("kimi-convert", hf, imatrix, "--policy", "q8_0", "--imatrix", imatrix, "--force")
    refused(r, imatrix, "imatrix")
    types = tmp_path / "types.txt"
    types.write_text("attn_q_a=q8_0\n")
    r = run("kimi-convert", hf, types, "--policy", "q8_0", "--tensor-type-file", types, "--force")
    refused(r, types, "tensor-type file")
    assert digests([policy, imatrix]) == before and types.read_text() == "attn_q_a=q8_0\n"


def test_convert_split_part_names_are_compared_too(hf, k3_gguf, tmp_path):
    """OUT is new, but its second split part would be the imatrix (a GGUF): refused when the parts are planned,
    before a byte is written."""
    from kimi_convert.convert.converter import build_plan
    n_parts = -(-len(build_plan(hf).tensors) // 100)
    imatrix = tmp_path / f"m-00002-of-{n_parts:05d}.gguf"
    shapes = {n: t.shape for n, t in open_gguf(k3_gguf).tensors.items()}
    write_gguf_imatrix(imatrix, k3_entries(shapes))
    before = digest(imatrix)
    r = run("kimi-convert", hf, tmp_path / "m.gguf", "--policy", "q8_0", "--imatrix", imatrix,
            "--split-max-tensors", "100", "--force")
    refused(r, imatrix, "imatrix")
    assert digest(imatrix) == before and not (tmp_path / f"m-00001-of-{n_parts:05d}.gguf").exists()


def test_convert_over_a_symlink_or_hard_link_to_an_input_replaces_the_link_only(hf, tmp_path):
    shard = hf / "model-00001-of-000005.safetensors"
    before = digest(shard)
    for kind in ("symlink", "hardlink"):
        out = tmp_path / f"{kind}.gguf"
        out.symlink_to(shard) if kind == "symlink" else os.link(shard, out)
        r = run("kimi-convert", hf, out, "--force")
        assert r.code == 0, r.err
        assert not out.is_symlink() and out.read_bytes()[:4] == b"GGUF"
        assert digest(shard) == before and shard.stat().st_nlink == 1


def test_a_lock_file_that_points_at_an_input_is_refused(hf, tmp_path):
    """The lock is opened in place: a symlink or a hard link there would truncate the file it names."""
    config = hf / "config.json"
    before = digest(config)
    out, lock = tmp_path / "out.gguf", tmp_path / ".out.gguf.lock"
    for link in (lock.symlink_to, lambda target: os.link(target, lock)):
        link(config)
        refused(run("kimi-convert", hf, out), lock, "checkpoint's config")
        lock.unlink()
    assert digest(config) == before and not out.exists()


# ------------------------------------------------------------------ kimi-quantize

def test_quantize_report_never_overwrites_an_input(src, policy, imatrix, tmp_path):
    out = tmp_path / "out.gguf"
    before = digests([src, policy, imatrix])
    for target, what in ((src, "input GGUF"), (policy, "policy file"), (imatrix, "imatrix")):
        for force in ((), ("--force",)):
            r = run("kimi-quantize", "--policy", policy, "--imatrix", imatrix, "--json", target, src, out, *force)
            refused(r, target, what)
    assert digests([src, policy, imatrix]) == before and not out.exists()
    assert not manifest_path(out).exists()


def test_quantize_report_and_output_cannot_be_one_file(src, tmp_path):
    out = tmp_path / "out.gguf"
    for target in (out, manifest_path(out)):
        r = run("kimi-quantize", "--policy", "q8_0", "--json", target, src, out)
        line = r.one_error()
        assert "the --json report and the" in line or "are the same file" in line, line
    assert listing(tmp_path) == {"in.gguf"}


def test_quantize_never_writes_over_its_imatrix(src, imatrix, tmp_path):
    before = digest(imatrix)
    r = run("kimi-quantize", "--policy", "q8_0", "--imatrix", imatrix, src, imatrix, "--force")
    refused(r, imatrix, "imatrix")
    assert digest(imatrix) == before


def test_quantize_into_its_own_input_is_refused(src):
    before = digest(src)
    for force in ((), ("--force",)):
        r = run("kimi-quantize", "--policy", "q8_0", src, src, *force)
        assert r.code == 1 and str(src) in r.one_error()
    assert digest(src) == before


def test_keep_split_never_writes_over_the_split_input(split_in):
    before = digests(split_in)
    out = split_in[0].with_name("s.gguf")          # --keep-split writes s-0000i-of-0000N.gguf: the input's names
    r = run("kimi-quantize", "--policy", "q8_0", "--keep-split", "--force", split_in[0], out)
    refused(r, split_in[0], "split part of the input")
    assert digests(split_in) == before


def test_split_output_parts_over_the_split_input_are_refused(split_in, keep):
    """--split-max-size decides the parts' count only when planning: the writer compares them before writing."""
    before = digests(split_in)
    out = split_in[0].with_name("s.gguf")
    r = run("kimi-quantize", "--policy", keep, "--split-max-size", "1M", "--force", split_in[1], out)
    line = r.one_error()
    assert "which this run reads" in line and "split part" in line, line
    assert digests(split_in) == before


def test_a_report_to_a_fifo_nobody_reads_fails_before_any_output(src, tmp_path):
    fifo = tmp_path / "r.json"
    os.mkfifo(fifo)
    out = tmp_path / "out.gguf"
    r = run_guarded("kimi-quantize", "--policy", "q8_0", src, out, "--json", fifo)
    assert r.one_error() == f"error: {fifo}: cannot write the report (no process reads this FIFO)"
    assert listing(tmp_path) == {"in.gguf", "r.json"}


def test_a_report_to_a_fifo_that_is_read_comes_with_the_output(src, tmp_path):
    fifo = tmp_path / "r.json"
    os.mkfifo(fifo)
    got: list[bytes] = []

    def read():
        with open(fifo, "rb") as f:
            got.append(f.read())
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    out = tmp_path / "out.gguf"
    while reader.is_alive() and not out.exists():       # the reader may open after the command: retry
        r = run("kimi-quantize", "--policy", "q8_0", src, out, "--json", fifo)
    reader.join(30)
    assert r.code == 0 and out.exists() and b'"policy": "preset q8_0"' in got[0]


def test_a_report_that_fails_at_the_commit_leaves_no_output(src, tmp_path, monkeypatch):
    from kimi_convert.paths import Report

    def fail(self, folder, text):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(Report, "stage", fail)
    out = tmp_path / "out.gguf"
    r = run("kimi-quantize", "--policy", "q8_0", src, out, "--json", tmp_path / "r.json")
    assert r.code != 0 and len(r.errors) == 1
    assert listing(tmp_path) == {"in.gguf"}


def test_the_report_is_renamed_with_the_output_and_needs_force_to_replace(src, tmp_path):
    out, report = tmp_path / "out.gguf", tmp_path / "r.json"
    report.write_text("an earlier report")
    r = run("kimi-quantize", "--policy", "q8_0", src, out, "--json", report)
    assert r.one_error() == f"error: {report}: already exists (use --force to overwrite)" and not out.exists()
    r = run("kimi-quantize", "--policy", "q8_0", src, out, "--json", report, "--force")
    assert r.code == 0 and '"policy": "preset q8_0"' in report.read_text()
    assert listing(tmp_path) == {"in.gguf", "out.gguf", "out.gguf.manifest.json", "r.json"}


# ------------------------------------------------------------------ kimi-verify

def test_verify_never_writes_its_report_over_the_file_under_check(src, hf, tmp_path):
    before = digest(src)
    for force in ((), ("--force",)):
        r = run("kimi-verify", "check", src, "--json", src, *force)
        refused(r, src, "input GGUF")
    assert digest(src) == before
    shard = hf / "model-00003-of-000005.safetensors"
    before_shard = digest(shard)
    r = run("kimi-verify", "check", hf, src, "--json", shard, "--force")
    refused(r, shard, "checkpoint shard")
    assert digest(shard) == before_shard


def test_verify_never_writes_its_report_over_the_manifest(k3_gguf, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    out = d / "q.gguf"
    assert run("kimi-quantize", "--policy", "q8_0", k3_gguf, out).code == 0
    m = manifest_path(out)
    before = digest(m)
    r = run("kimi-verify", "check", out, "--manifest", m, "--json", m, "--force")
    refused(r, m, "manifest")
    assert digest(m) == before


def test_slice_never_writes_into_its_own_checkpoint(hf, tmp_path):
    before = digests(hf.iterdir())
    link = tmp_path / "same-folder"
    link.symlink_to(hf)
    for out_dir in (hf, link):
        r = run("kimi-verify", "slice", hf, out_dir, "--layers", "2", "--force")
        line = r.one_error()
        assert "which this run reads" in line, line
    assert digests(hf.iterdir()) == before


# ------------------------------------------------------------------ patterns, TOML, long names

def test_a_pattern_that_backtracks_for_ever_is_named_not_run(src, tmp_path):
    evil = tmp_path / "evil.toml"
    evil.write_text(f'default = "Q8_0"\n\n[[rules]]\npattern = \'attn\'\ntype = "Q8_0"\n\n'
                    f'[[rules]]\npattern = \'{EVIL}\'\ntype = "Q4_0"\n')
    r = run_guarded("kimi-quantize", "--policy", evil, src, tmp_path / "o.gguf", timeout=30)
    line = r.one_error()
    assert line.startswith(f"error: {evil}:8: pattern ") and "backtracks" in line and EVIL in line, line
    r = run_guarded("kimi-quantize", "--policy", "q8_0", "--tensor-type", f"{EVIL}=q4_0", src, "--dry-run",
                    timeout=30)
    assert r.one_error().startswith(f"error: --tensor-type {EVIL}=q4_0: pattern ")


def test_one_pass_bounds_the_patterns_too(hf, tmp_path):
    r = run_guarded("kimi-convert", hf, tmp_path / "o.gguf", "--policy", "q8_0", "--tensor-type",
                    f"{EVIL}=q4_0", timeout=30)
    assert r.one_error().startswith(f"error: --tensor-type {EVIL}=q4_0: pattern ")
    assert not (tmp_path / "o.gguf").exists()


def test_patterns_that_recipes_use_still_work(src):
    """Alternation, classes, anchors and \\. (llama-quantize recipes) select what they select in Python's re."""
    recipe = r"^blk\.[0-2]\.(ffn_down|ffn_down_shexp|attn_q_a)\.weight$"
    r = run("kimi-quantize", "--policy", "q8_0", "--tensor-type", f"{recipe}=q4_0", "--tensor-type",
            r"token_embd|output\.weight=q5_0", src, "--explain")
    assert r.code == 0, r.err
    rows = [line.split() for line in r.out.splitlines() if line.startswith(("blk.", "token_embd", "output"))]
    chosen = {row[0] for row in rows if row[3] == "Q4_0"}
    assert chosen and chosen == {row[0] for row in rows if re.search(recipe, row[0]) and row[1] != "F32"}
    assert {row[3] for row in rows if row[0] in ("token_embd.weight", "output.weight")} == {"Q5_0"}


@pytest.mark.parametrize("nesting", ["array", "table"])
def test_a_policy_nested_a_thousand_deep_is_a_file_line_error(src, tmp_path, nesting):
    p = tmp_path / "deep.toml"
    value = "[" * 1000 + "]" * 1000 if nesting == "array" else "{a = " * 1000 + "1" + "}" * 1000
    p.write_text(f'default = "Q8_0"\ndescription = "deep"\nwhy = {value}\n')
    r = run("kimi-quantize", "--policy", p, src, "--dry-run")
    assert r.one_error().startswith(f"error: {p}:3: arrays or inline tables nested "), r.err
    assert r.fallback is None


def test_an_output_name_as_long_as_the_file_system_takes_works(hf, tmp_path):
    out = tmp_path / ("k" * 245 + ".gguf")               # 250 bytes: the lock and partial names would pass 255
    r = run("kimi-convert", hf, out)
    assert r.code == 0, r.err
    names = listing(tmp_path) - {hf.name} - {str(p.relative_to(tmp_path)) for p in hf.rglob("*")}
    assert out.name in names and all(len(n.encode()) <= 255 for n in names), names
    manifest = [n for n in names if n.endswith(".manifest.json")]
    assert len(manifest) == 1 and "~" in manifest[0]
    r = run("kimi-verify", "check", out, "--manifest", tmp_path / manifest[0])
    assert r.code == 0, r.out + r.err


def test_a_split_part_name_past_the_limit_is_one_line_before_writing(hf, tmp_path):
    out = tmp_path / ("k" * 245 + ".gguf")
    r = run("kimi-convert", hf, out, "--split-max-tensors", "100")
    assert "name is" in r.one_error() and "bytes, more than the 255" in r.one_error()
    assert listing(tmp_path) == {hf.name} | {str(p.relative_to(tmp_path)) for p in hf.rglob("*")}
