"""kimi-quantize from the command line: the plan, explain and dry-run outputs, and every bad input as one
`error:` line naming it, exit 1 (3 for a disk that is too small), and no output left behind."""
from __future__ import annotations

import json
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gguf import GGUFValueType, GGUFWriter

from kimi_convert.fixtures.imatrix import k3_entries, write_gguf_imatrix
from kimi_convert.gguf_io import open_gguf
from in_process import run_command
from test_convert_errors import CLI_ENV, assert_fails_cleanly


def quantize(*args, preexec=None, patch: str = "") -> subprocess.CompletedProcess:
    """kimi-quantize ARGS: in this process (tests/in_process.py), or in its own for a resource limit
    (`preexec`) or a patched library (`patch`)."""
    if preexec is None and not patch:
        return run_command("kimi-quantize", args)
    code = patch + "\nfrom kimi_convert.cli.quantize import main\nmain()\n"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          env=CLI_ENV, preexec_fn=preexec, timeout=300)


@pytest.fixture(scope="module")
def src(converted) -> Path:
    return converted("k3")


@pytest.fixture
def out_dir(tmp_path) -> Path:
    d = tmp_path / "out"
    d.mkdir()
    return d


def test_quantizes_and_reports(src, out_dir):
    r = quantize("--policy", "q8_0", src, out_dir / "q.gguf", "--json", out_dir / "r.json")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(out_dir / "q.gguf")
    assert "wrote" in r.stderr and "Traceback" not in r.stderr
    report = json.loads((out_dir / "r.json").read_text())
    assert report["output_bytes"] == sum(t.nbytes for t in open_gguf(out_dir / "q.gguf").tensors.values())
    assert {row["protection"] for row in report["tensors"]} == {None, "llama.cpp", "mxfp4"}


def test_explain_and_dry_run_read_headers_only_and_go_to_stdout(src, out_dir):
    r = quantize("--policy", "q8_0", src, "--explain", "--tensor-type", "exps=q4_k")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("# preset q8_0")
    assert len(lines) == 1 + len(open_gguf(src).tensors)
    assert any("blk.1.ffn_up_exps.weight" in x and "MXFP4 -> MXFP4" in x and "protected (mxfp4)" in x for x in lines)
    assert "note: rule --tensor-type exps=q4_k" in r.stderr and "protected (mxfp4)" in r.stderr
    d = quantize("--policy", "q8_0", src, "--dry-run")
    assert d.returncode == 0, d.stderr
    assert "total" in d.stdout and "estimated peak RAM" in d.stdout
    assert list(out_dir.iterdir()) == []


def bad_arch(path: Path) -> Path:
    w = GGUFWriter(path, "llama")
    w.add_key_value("llama.block_count", 1, GGUFValueType.UINT32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def policy_file(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "policy.toml"
    p.write_text(text)
    return p


CASES = {
    "not a GGUF": (lambda t, s: ["--policy", "q8_0", _write(t / "x.gguf", b"hello")],
                   ["x.gguf", "not a GGUF file"]),
    "truncated": (lambda t, s: ["--policy", "q8_0", _write(t / "cut.gguf", s.read_bytes()[:s.stat().st_size // 2])],
                  ["cut.gguf", "truncated"]),
    "unknown architecture": (lambda t, s: ["--policy", "q8_0", bad_arch(t / "llama.gguf")], ["'llama'"]),
    "policy syntax": (lambda t, s: ["--policy", policy_file(t, 'default = "Q8_0"\n[[rules]\n'), s],
                      ["policy.toml", "TOML syntax error", "line 2"]),
    "unknown type": (lambda t, s: ["--policy", policy_file(t, 'default = "Q8_0"\n[[rules]]\npattern = "x"\n'
                                                           'type = "Q3_KM"\n'), s],
                     ["policy.toml:4", "unknown type 'Q3_KM'"]),
    "bad regex": (lambda t, s: ["--policy", policy_file(t, 'default = "Q8_0"\n[[rules]]\npattern = "(x"\n'
                                                        'type = "Q4_K"\n'), s], ["policy.toml:3", "bad regex"]),
    "unknown preset": (lambda t, s: ["--policy", "k9-tiny", s], ["k9-tiny", "no such policy file or preset"]),
    "bad tensor-type": (lambda t, s: ["--policy", "q8_0", "--tensor-type", "attn=Q4_KM", s],
                        ["--tensor-type attn=Q4_KM", "unknown type"]),
    "garbage imatrix": (lambda t, s: ["--policy", "q8_0", "--imatrix", _write(t / "im.dat", b"\x07" * 50), s],
                        ["im.dat"]),
    "mismatched imatrix": (lambda t, s: ["--policy", "q8_0", "--imatrix", _mismatched_imatrix(t, s), s],
                           ["blk.0.attn_q.weight"]),
    "strict": (lambda t, s: ["--policy", "q8_0", "--strict", "--tensor-type", "exps=q4_k", s],
               ["--strict", "1 rule(s) name protected tensors (mxfp4)", "--tensor-type exps=q4_k ('exps' -> Q4_K)"]),
    # the header counts 0 tensors: the keys still parse, and an empty "model" came out with exit 0
    "no tensors": (lambda t, s: ["--policy", "q8_0", _write(t / "none.gguf", _no_tensors(s.read_bytes()))],
                   ["none.gguf", "holds no tensors", "kimi-k3 GGUF with no tensors is not a model"]),
}


def _no_tensors(data: bytes) -> bytes:
    return data[:8] + (0).to_bytes(8, "little") + data[16:]


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _mismatched_imatrix(tmp_path: Path, src: Path) -> Path:
    shapes = {n: t.shape for n, t in open_gguf(src).tensors.items()}
    entries = k3_entries(shapes)
    sums, counts = entries["blk.0.attn_q.weight"]
    entries["blk.0.attn_q.weight"] = (sums[:, :-32], counts)
    return write_gguf_imatrix(tmp_path / "wrong.imatrix.gguf", entries)


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_error_line(case, src, tmp_path, out_dir):
    make_args, needles = CASES[case]
    r = quantize(*make_args(tmp_path, src), out_dir / "q.gguf")
    assert_fails_cleanly(out_dir, r, *needles)


def test_existing_output_and_input_as_output(src, out_dir):
    (out_dir / "q.gguf").write_bytes(b"mine")
    r = quantize("--policy", "q8_0", src, out_dir / "q.gguf")
    assert r.returncode == 1 and "already exists (use --force" in r.stderr
    assert (out_dir / "q.gguf").read_bytes() == b"mine"
    r = quantize("--policy", "q8_0", src, src, "--force")
    assert r.returncode == 1 and "the output would overwrite the input GGUF, which this run reads" in r.stderr


def test_file_size_limit_mid_write(src, out_dir):
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))
    r = quantize("--policy", "q8_0", src, out_dir / "q.gguf", preexec=limit)
    assert_fails_cleanly(out_dir, r, str(out_dir / "q.gguf"), "nothing was written")


def test_disk_too_small_is_exit_3(src, out_dir):
    fake = ("import shutil, collections\nU = collections.namedtuple('U', 'total used free')\n"
            "shutil.disk_usage = lambda p: U(10**6, 10**6 - 1000, 1000)\n")
    r = quantize("--policy", "q8_0", src, out_dir / "q.gguf", patch=fake)
    assert_fails_cleanly(out_dir, r, "not enough free disk", code=3)


def test_sigterm_mid_write_leaves_nothing(src, out_dir):
    slow = ("import time, kimi_convert.quant.driver as d\nreal = d.chunks\n"
            "def slow(*a):\n    for c in real(*a):\n        time.sleep(0.05)\n        yield c\n"
            "d.chunks = slow\n")
    code = slow + "\nfrom kimi_convert.cli.quantize import main\nmain()\n"
    p = subprocess.Popen([sys.executable, "-c", code, "--policy", "q8_0", str(src), str(out_dir / "q.gguf")],
                         env=CLI_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not any(".partial" in x.name for x in out_dir.iterdir()) and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "interrupted by SIGTERM; nothing was written" in err and "Traceback" not in err
    assert list(out_dir.iterdir()) == []


# rules aimed at the MXFP4 experts and at the K3.1 indexer (whose k_norm, 1-D, is llama.cpp's to keep)
AIMED_AT_PROTECTED = 'default = "Q8_0"\n[[rules]]\npattern = "_exps"\ntype = "Q4_K"\n' \
                     '[[rules]]\npattern = "indexer\\\\."\ntype = "Q8_0"\n'


def protected_lines(policy: Path, tensors: list[tuple[str, object]]) -> set[str]:
    """The start of each line a run must print for AIMED_AT_PROTECTED, from (name, type) in the file's order:
    the rule (file:line, pattern, type), how many tensors it names, the first three, the protection."""
    def line(origin: str, rule: str, names: list[str], protection: str) -> str:
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        return (f"rule {policy}:{origin} ({rule}) names {len(names)} protected tensor(s): {', '.join(names[:3])}"
                f"{more}; protected ({protection}): ")
    experts = [n for n, t in tensors if n.endswith("_exps.weight") and t.name == "MXFP4"]
    indexer = [n for n, _ in tensors if ".indexer." in n and n.endswith(("attn_q_b.weight", "attn_k.weight",
                                                                           "proj.weight"))]
    k_norm = [n for n, _ in tensors if ".indexer.k_norm." in n]          # weight and bias: 1-D
    assert experts and indexer and k_norm
    return {line("3", "'_exps' -> Q4_K", experts, "mxfp4"), line("6", "'indexer\\\\.' -> Q8_0", indexer, "indexer"),
            line("6", "'indexer\\\\.' -> Q8_0", k_norm, "llama.cpp")}


def printed(stderr: str, prefix: str) -> set[str]:
    """The lines after `prefix`, each cut after its protection's name (where the reason's text starts)."""
    return {re.match(r".*?; protected \([^)]*\): ", line[len(prefix):])[0]
            for line in stderr.splitlines() if line.startswith(prefix)}


def test_strict_names_every_colliding_rule(converted, tmp_path, out_dir):
    """--strict on a policy whose rules aim at the MXFP4 experts and at the K3.1 indexer: a line for each rule and
    protection (not only the first), then the one error line; exit 1, nothing written. Without --strict, the same
    lines are notes."""
    src = converted("k31")
    pol = policy_file(tmp_path, AIMED_AT_PROTECTED)
    want = protected_lines(pol, [(n, t.qtype) for n, t in open_gguf(src).tensors.items()])
    r = quantize("--policy", pol, "--strict", src, out_dir / "q.gguf")
    assert_fails_cleanly(out_dir, r, "--strict: 2 rule(s) name protected tensors", f"{pol}:3 ('_exps' -> Q4_K)",
                         f"{pol}:6 ('indexer\\\\.' -> Q8_0)", "nothing is written")
    assert printed(r.stderr, "refused: ") == want, r.stderr
    assert r.stderr.index("refused: ") < r.stderr.index("error: ")
    notes = quantize("--policy", pol, src, "--dry-run")
    assert notes.returncode == 0, notes.stderr
    assert printed(notes.stderr, "note: ") == printed(r.stderr, "refused: "), notes.stderr
