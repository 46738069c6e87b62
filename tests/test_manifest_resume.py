"""The per-tensor SHA-256 manifest both commands write, `kimi-verify check --manifest`, `--resume` after a
SIGKILL, the output lock, and SIGTERM at ~30 % written, for kimi-convert and kimi-quantize.

The fixture is the 8-layer K3 checkpoint with 64 experts (6.6 MB of GGUF): at --split-max-size 1M it
converts to 8 parts and quantizes (q8_0) to 6, so a run stopped a third of the way has finished parts to
keep. A run to be stopped is a subprocess whose sinks pause once 35 % of the tensor bytes have gone
through them (two parts finished and journaled, the third begun, for both commands), so that the signal
lands at the same point on a busy machine as on an idle one.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kimi_convert.convert.converter import build_plan, convert
from kimi_convert.errors import OutputError
from kimi_convert.fixtures.make_checkpoint import make_checkpoint
from kimi_convert.gguf_io import manifest_path
from kimi_convert.gguf_io.manifest import ManifestError, check_manifest, load_manifest, read_journal
from kimi_convert.quant.driver import quantize_file
from kimi_convert.quant.policy import load_policy
from kimi_convert.cli.verify import app as verify_app
from test_convert_errors import CLI_ENV

SPLIT = 1_000_000
QUANTIZE_MAIN = "\nfrom kimi_convert.cli.quantize import main\nmain()\n"
CONVERT_MAIN = "\nfrom kimi_convert.cli.convert import convert_main\nconvert_main()\n"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("k3x64") / "Kimi-K3-x64", arch="k3", num_experts=64)


@pytest.fixture(scope="module")
def converted(tmp_path_factory, ckpt) -> list[Path]:
    """The uninterrupted conversion (8 parts): what every interrupted one must end up equal to."""
    return convert(build_plan(ckpt), tmp_path_factory.mktemp("ref") / "s.gguf", split_max_size=SPLIT).paths


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, converted) -> list[Path]:
    out = tmp_path_factory.mktemp("qref") / "q.gguf"
    return quantize_file(converted[0], out, load_policy("q8_0"), split_max_size=SPLIT).paths


def run(main: str, *args, patch: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", patch + main, *map(str, args)], capture_output=True, text=True,
                          env=CLI_ENV, timeout=120)


PAUSED_AT = 0.35


def pause_writes(after: int, hold: Path, reached: Path) -> str:
    """Python run before the command: once `after` tensor bytes have been put into the sinks, touch `reached`
    and wait for `hold` to go away (or for a signal)."""
    return f"""
import os, time
from kimi_convert import gguf_io
_open_sink, _done = gguf_io.writer.open_sink, [0, False]
def paused_sink(fout, nbytes=None):
    sink = _open_sink(fout, nbytes)
    put = sink.put
    def paused_put(chunk, sources):
        if _done[0] >= {after} and not _done[1]:
            _done[1] = True
            open({str(reached)!r}, "w").close()
            while os.path.exists({str(hold)!r}):
                time.sleep(0.02)
        n = put(chunk, sources)
        _done[0] += n
        return n
    sink.put = paused_put
    return sink
gguf_io.writer.open_sink = paused_sink
"""


def tensor_bytes(parts: list[Path]) -> int:
    return sum(f.tensor_bytes for f in load_manifest(manifest_path(out_path(parts[0]))).files)


def start_paused(main: str, args: list, reference: list[Path], control: Path) -> tuple[subprocess.Popen, Path]:
    """The command, paused at PAUSED_AT of its tensor bytes: (process, the file whose removal lets it go on)."""
    control.mkdir(exist_ok=True)
    hold, reached = control / "hold", control / "reached"
    hold.touch()
    reached.unlink(missing_ok=True)
    code = pause_writes(int(PAUSED_AT * tensor_bytes(reference)), hold, reached) + main
    proc = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], env=CLI_ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for(proc, reached.exists, f"{PAUSED_AT:.0%} written")
    return proc, hold


def partials(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if ".partial-" in p.name)


def wait_for(proc: subprocess.Popen, ready, what: str):
    deadline = time.monotonic() + 90
    while not (found := ready()):
        assert proc.poll() is None, (what, proc.communicate())
        assert time.monotonic() < deadline, what
        time.sleep(0.02)
    return found


def journaled(d: Path, n_parts: int):
    """The run's partial folder once its journal lists `n_parts` finished parts, else None."""
    for p in partials(d):
        j = read_journal(p)
        if j is not None and len(j[1]) >= n_parts:
            return p
    return None


def errors(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def out_path(part: Path) -> Path:
    """OUT.gguf, given OUT.gguf or one of its parts OUT-0000i-of-0000N.gguf."""
    m = re.fullmatch(r"(.*)-\d{5}-of-\d{5}\.gguf", part.name)
    return part.with_name(m[1] + ".gguf") if m else part


def same_files(got: list[Path], want: list[Path]) -> None:
    """Byte for byte the same files, and the same manifest."""
    assert [p.name for p in got] == [p.name for p in want]
    for a, b in zip(got, want):
        assert a.read_bytes() == b.read_bytes(), a.name
    assert manifest_path(out_path(got[0])).read_bytes() == manifest_path(out_path(want[0])).read_bytes()


def output_of(d: Path, name: str) -> list[Path]:
    """The GGUF file(s) of output `name` in `d`."""
    return sorted(p for p in d.iterdir() if p.suffix == ".gguf" and out_path(p).name == name)


# --- the manifest ------------------------------------------------------------------------------

def tree_sha256(data: bytes, leaf: int = 1 << 20) -> str:
    """The manifest's tensor digest, written out from its definition in docs/formats.md: SHA-256 over the
    SHA-256 of each 1 MiB (`leaf`) of the bytes."""
    leaves = b"".join(hashlib.sha256(data[i:i + leaf]).digest() for i in range(0, len(data), leaf))
    return hashlib.sha256(leaves).hexdigest()


def independent_manifest(parts: list[Path], leaf: int = 1 << 20) -> list[dict]:
    """What the manifest must say, from the final files through gguf-py's own reader and hashlib."""
    files = []
    for p in parts:
        data = p.read_bytes()
        r = GGUFReader(p)
        start = min(t.data_offset for t in r.tensors)
        files.append({"name": p.name, "size": len(data), "header_bytes": start,
                      "header_sha256": hashlib.sha256(data[:start]).hexdigest(),
                      "tensors": [{"name": t.name, "type": t.tensor_type.name,
                                   "shape": [int(x) for x in reversed(t.shape.tolist())],
                                   "offset": int(t.data_offset), "nbytes": int(t.n_bytes),
                                   "sha256": tree_sha256(data[t.data_offset:t.data_offset + t.n_bytes], leaf)}
                                  for t in r.tensors]})
    return files


@pytest.mark.parametrize("command", ["kimi-convert", "kimi-quantize"])
def test_manifest_equals_hashes_of_the_final_files(command, converted, quantized):
    parts = converted if command == "kimi-convert" else quantized
    m = json.loads(manifest_path(out_path(parts[0])).read_text())
    assert m["format"] == "kimi-convert GGUF manifest" and m["version"] == 1 and m["tool"].startswith(command)
    assert m["hash"] == "sha256-tree-1MiB"
    assert m["files"] == independent_manifest(parts)
    assert len(m["files"]) == (8 if command == "kimi-convert" else 6)


def test_manifest_of_a_single_file_and_of_buffered_writes(tmp_path, ckpt, monkeypatch):
    """Both sinks hash (O_DIRECT staging, and plain writes where the file system refuses O_DIRECT, whose
    file ranges are read through a buffer instead of copy_file_range): same files, same manifests."""
    from kimi_convert import gguf_io
    for d in ("direct", "buffered"):
        (tmp_path / d).mkdir()
    direct = convert(build_plan(ckpt, "f32"), tmp_path / "direct" / "m.gguf").paths
    monkeypatch.setattr(gguf_io.writer, "open_sink", gguf_io.BufferedSink)
    buffered = convert(build_plan(ckpt, "f32"), tmp_path / "buffered" / "m.gguf").paths
    assert len(direct) == 1
    same_files(buffered, direct)
    assert json.loads(manifest_path(direct[0]).read_text())["files"] == independent_manifest(direct)


def test_one_thread_and_two_write_the_same_file_and_manifest(tmp_path, ckpt, monkeypatch):
    """--threads repacks the experts and hashes the leaves side by side: the bytes and the digests must not
    depend on it. The fixture's tensors are under 1 MiB, so the leaf is made 4 KiB here: each tensor then
    has up to 96 leaves, cut across the sink's staging buffers and hashed on two threads."""
    from kimi_convert.gguf_io import digest
    monkeypatch.setattr(digest, "LEAF", 4096)
    for n in (1, 2):
        (tmp_path / str(n)).mkdir()
    outs = {n: convert(build_plan(ckpt, "f32", threads=n), tmp_path / str(n) / "m.gguf").paths for n in (1, 2)}
    assert build_plan(ckpt, threads=3).threads == 3 and build_plan(ckpt).threads == len(os.sched_getaffinity(0))
    same_files(outs[1], outs[2])
    manifests = [json.loads(manifest_path(outs[n][0]).read_text())["files"] for n in (1, 2)]
    assert manifests[0] == manifests[1] == independent_manifest(outs[1], leaf=4096)
    assert manifests[0] != independent_manifest(outs[1])
    assert check_manifest(outs[2][0], manifest_path(outs[2][0]), threads=2).ok


@pytest.mark.parametrize("threads", [1, 3])
def test_the_tree_digest_does_not_depend_on_how_the_bytes_arrive(threads):
    from kimi_convert.gguf_io.digest import LEAF, TreeDigest
    rng = np.random.default_rng(7)
    for n in (0, 1, LEAF - 1, LEAF, LEAF + 1, 3 * LEAF, 5 * LEAF + 77):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        d, at = TreeDigest(threads), 0
        while at < n:
            step = int(rng.choice([1, 100, LEAF // 3, LEAF, 2 * LEAF + 5]))
            d.update(data[at:at + step])
            at += step
        assert d.hexdigest() == tree_sha256(data), n


def test_a_manifest_of_one_sha256_per_tensor_is_still_checked(copy):
    """Manifests written before the tree digest say "hash": "sha256", one SHA-256 over each tensor's bytes."""
    m = copy[0].with_name("s.gguf.manifest.json")
    doc = json.loads(m.read_text())
    doc["hash"] = "sha256"
    for f in doc["files"]:
        data = (m.parent / f["name"]).read_bytes()
        for t in f["tensors"]:
            t["sha256"] = hashlib.sha256(data[t["offset"]:t["offset"] + t["nbytes"]]).hexdigest()
    m.write_text(json.dumps(doc))
    assert check_manifest(copy[0], m).ok
    flip(copy[2], os.path.getsize(copy[2]) - 100)
    assert not check_manifest(copy[0], m).ok
    doc["hash"] = "md5"
    m.write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="hash 'md5': only sha256-tree-1MiB and sha256 are known"):
        check_manifest(copy[0], m)


def test_no_manifest_without_hashing_and_no_stale_one(tmp_path, ckpt):
    out = tmp_path / "m.gguf"
    convert(build_plan(ckpt), out)
    assert manifest_path(out).exists()
    convert(build_plan(ckpt, "f32"), out, force=True, manifest=False)
    assert not manifest_path(out).exists(), "a manifest of the earlier file would not describe this one"


# --- kimi-verify check --manifest ----------------------------------------------------------------

def verify(*args) -> tuple[int, list[str]]:
    res = CliRunner().invoke(verify_app, ["check", *map(str, args)])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    return res.exit_code, res.output.splitlines()


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.fixture
def copy(tmp_path, converted) -> list[Path]:
    for p in [*converted, manifest_path(converted[0].with_name("s.gguf"))]:
        shutil.copy2(p, tmp_path / p.name)
    return [tmp_path / p.name for p in converted]


def test_check_passes_from_any_part(copy):
    m = copy[0].with_name("s.gguf.manifest.json")
    for part in (copy[0], copy[5]):
        code, lines = verify(part, "--manifest", m)
        assert code == 0 and len(lines) == 1 and lines[0].startswith("PASS: all 218 tensors"), lines


def test_check_names_every_tensor_that_differs(copy):
    m = load_manifest(copy[0].with_name("s.gguf.manifest.json"))
    hit = [(m.files[1], m.files[1].tensors[3]), (m.files[4], m.files[4].tensors[0]),
           (m.files[4], m.files[4].tensors[-1])]
    for f, t in hit:
        flip(copy[0].with_name(f.name), t.offset + t.nbytes // 2)
    code, lines = verify(copy[0], "--manifest", copy[0].with_name("s.gguf.manifest.json"))
    assert code == 1 and len(lines) == len(hit) + 1, lines
    for line, (f, t) in zip(lines, hit):
        assert line.startswith(f"{f.name}: tensor {t.name}: {t.type}{list(t.shape)} at byte {t.offset:,}: "
                               f"its bytes differ"), line
    assert lines[-1].startswith("FAIL: 3 of 218 tensors differ;"), lines[-1]


def test_check_names_a_truncated_part_a_missing_part_and_a_header(copy):
    d = copy[0].parent
    m = load_manifest(d / "s.gguf.manifest.json")
    cut = m.files[2]
    os.truncate(d / cut.name, cut.tensors[-2].offset + 10)         # the last two tensors cut off
    (d / m.files[6].name).unlink()
    flip(d / m.files[0].name, 40)                                  # inside the first key
    result = check_manifest(copy[3], d / "s.gguf.manifest.json")
    lines = [x.line() for x in result.differences]
    assert not result.ok
    assert [x for x in lines if x.startswith(m.files[0].name)][0].startswith(
        f"{m.files[0].name}: the header (keys and tensor infos) differs"), lines
    assert f"{cut.name}: truncated: {cut.tensors[-2].offset + 10:,} bytes, the manifest says {cut.size:,}" in lines
    assert [x.tensor for x in result.differences if x.file == cut.name and x.kind == "tensor"] == \
        [t.name for t in cut.tensors[-2:]]
    assert f"{m.files[6].name}: missing (its {len(m.files[6].tensors)} tensors not checked)" in lines
    assert len(lines) == 5
    code, out = verify(copy[3], "--manifest", d / "s.gguf.manifest.json")
    assert code == 1 and out[-1].startswith("FAIL: 2 of 218 tensors differ") and len(out) == 6


def test_check_names_an_extra_part_and_refuses_a_bad_manifest(copy, tmp_path):
    d = copy[0].parent
    (d / "s-00009-of-00009.gguf").write_bytes(b"GGUF")
    code, lines = verify(copy[0], "--manifest", d / "s.gguf.manifest.json")
    assert code == 1 and lines[0] == "s-00009-of-00009.gguf: not in the manifest (a part of the same split set)"
    bad = tmp_path / "bad.json"
    m = json.loads((d / "s.gguf.manifest.json").read_text())
    m["files"][1]["tensors"][2]["nbytes"] += 1
    bad.write_text(json.dumps(m))
    code, lines = verify(copy[0], "--manifest", bad)
    tensor = m["files"][1]["tensors"][2]["name"]
    assert code == 1 and len(lines) == 1 and lines[0].startswith(f"error: {bad}: tensor {tensor}:"), lines
    code, lines = verify(tmp_path / "other.gguf", "--manifest", d / "s.gguf.manifest.json")
    assert code == 1 and "not one of the files" in lines[0] and len(lines) == 1


def test_check_catches_an_edited_manifest_whose_hashes_still_match(copy):
    """BF16 called F16 (same bytes, same hashes): the file's own tensor table, read by the GGUF reader, says so."""
    path = copy[0].with_name("s.gguf.manifest.json")
    m = json.loads(path.read_text())
    t = next(t for t in m["files"][2]["tensors"] if t["type"] == "BF16")
    t["type"] = "F16"
    path.write_text(json.dumps(m))
    code, lines = verify(copy[0], "--manifest", path)
    assert code == 1 and len(lines) == 2, lines
    assert lines[0] == (f"{m['files'][2]['name']}: the manifest does not match the file's header: tensor {t['name']} "
                        f"is BF16{t['shape']} at byte {t['offset']:,} in the file, F16{t['shape']} at byte "
                        f"{t['offset']:,} in the manifest")


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2, 2**70) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=6)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("scratch")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_damaged_manifest_is_one_manifest_error(converted, scratch, data):
    """Any field of a real manifest (of the last part alone, to keep each example short) replaced by any JSON
    value: one ManifestError naming the manifest, or it loads and the check runs, and passes only if the
    files' entries are still the true ones; never another exception."""
    m = json.loads(manifest_path(out_path(converted[0])).read_text())
    m["files"] = m["files"][-1:]
    true_files = json.loads(json.dumps(m["files"]))
    f = m["files"][0]
    target = data.draw(st.sampled_from([m, f, data.draw(st.sampled_from(f["tensors"]))]))
    key = data.draw(st.sampled_from(sorted(target)))
    target[key] = data.draw(JSON)
    bad = scratch / "damaged.json"
    bad.write_text(json.dumps(m))
    try:
        result = check_manifest(converted[-1], bad)
    except ManifestError as e:
        assert str(e).startswith((f"{bad}: ", f"{converted[-1]}: not one of the files")), e
        assert "\n" not in str(e)
    else:
        found = [d for d in result.differences if d.kind != "extra"]    # the set's other parts are extras:
        assert (not found) == (m["files"] == true_files), found       # this manifest lists the last one only


# --- resume after SIGKILL ------------------------------------------------------------------------

def killed_at_35_percent(main: str, args: list, out_dir: Path, reference: list[Path]) -> Path:
    """SIGKILL the run at 35 % of its tensor bytes, in its third part (two journaled: 26 % of the
    convert's bytes, 33 % of the quantize's); return the partial folder it leaves."""
    proc, _ = start_paused(main, args, reference, out_dir.parent / "control")
    proc.kill()
    proc.wait()
    folder = journaled(out_dir, 2)
    assert folder is not None and partials(out_dir) == [folder]
    return folder


@pytest.fixture(scope="module")
def convert_killed(tmp_path_factory, ckpt, converted) -> Path:
    """The folder a conversion into s.gguf (split 1M) leaves when SIGKILLed at 35 %; tests take copies."""
    out_dir = tmp_path_factory.mktemp("convert-killed") / "out"
    out_dir.mkdir()
    killed_at_35_percent(CONVERT_MAIN, [ckpt, out_dir / "s.gguf", "--split-max-size", "1M"], out_dir, converted)
    return out_dir


@pytest.fixture(scope="module")
def quantize_killed(tmp_path_factory, converted, quantized) -> Path:
    out_dir = tmp_path_factory.mktemp("quantize-killed") / "out"
    out_dir.mkdir()
    killed_at_35_percent(QUANTIZE_MAIN, ["--policy", "q8_0", converted[0], out_dir / "q.gguf", "--split-max-size",
                                         "1M"], out_dir, quantized)
    return out_dir


def leftovers(killed: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of what the killed run left (its partial folder, named after its dead pid, and its lock file):
    (the output folder, the partial folder)."""
    out_dir = tmp_path / "out"
    shutil.copytree(killed, out_dir, symlinks=True)
    assert any(p.name.endswith(".lock") for p in out_dir.iterdir())     # the dead run's: it must block nothing
    (folder,) = partials(out_dir)
    return out_dir, folder


def kept_parts(folder: Path) -> dict[str, tuple[int, int]]:
    """name -> (inode, mtime) of the parts the journal lists as finished."""
    _, entries = read_journal(folder)
    return {e.name: (os.stat(folder / e.name).st_ino, os.stat(folder / e.name).st_mtime_ns) for e in entries}


def assert_resumed(out_dir: Path, reference: list[Path], kept: dict[str, tuple[int, int]], stderr: str) -> None:
    """Byte for byte the uninterrupted run's files and manifest, the kept parts not written again (same
    inode, same mtime), and nothing else left."""
    got = output_of(out_dir, out_path(reference[0]).name)
    same_files(got, reference)
    for p in got:
        st = os.stat(p)
        if p.name in kept:
            assert (st.st_ino, st.st_mtime_ns) == kept[p.name], p.name
        else:
            assert st.st_mtime_ns > max(m for _, m in kept.values()), p.name
    assert 2 <= len(kept) < len(reference)
    assert f"kept {len(kept)} of {len(reference)} part(s)" in stderr, stderr
    assert [p.name for p in out_dir.iterdir() if p.name.startswith(".")] == []     # no partial folder, no lock


def test_convert_resume_keeps_the_finished_parts(tmp_path, ckpt, converted, convert_killed):
    out_dir, folder = leftovers(convert_killed, tmp_path)
    kept = kept_parts(folder)
    r = run(CONVERT_MAIN, ckpt, out_dir / "s.gguf", "--split-max-size", "1M", "--resume")
    assert r.returncode == 0 and errors(r.stderr) == [], r.stderr
    assert_resumed(out_dir, converted, kept, r.stderr)


def test_convert_resume_refuses_another_plan(tmp_path, ckpt, converted, convert_killed):
    out_dir, folder = leftovers(convert_killed, tmp_path)
    kept = kept_parts(folder)
    r = run(CONVERT_MAIN, ckpt, out_dir / "s.gguf", "--split-max-size", "2M", "--resume")
    (line,) = errors(r.stderr)
    assert r.returncode == 1 and f"--resume: {folder} was written by a run with another plan: " \
        "split (1,000,000 bytes then, 2,000,000 bytes now)" in line, line
    with pytest.raises(OutputError, match=r"outtype \(bf16 then, f32 now\)"):
        convert(build_plan(ckpt, "f32"), out_dir / "s.gguf", split_max_size=SPLIT, resume=True)
    shard = build_plan(ckpt).checkpoint.shard_paths[1]
    st = os.stat(shard)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1))      # an input changed since the run
    try:
        with pytest.raises(OutputError, match=r"another plan: input files \(path, size or time\) differ"):
            convert(build_plan(ckpt), out_dir / "s.gguf", split_max_size=SPLIT, resume=True)
    finally:
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert partials(out_dir) == [folder] and kept_parts(folder) == kept      # left as it was


def test_convert_without_resume_removes_what_sigkill_left(tmp_path, ckpt, converted, convert_killed):
    out_dir, folder = leftovers(convert_killed, tmp_path)
    notes: list[str] = []
    convert(build_plan(ckpt), out_dir / "s.gguf", split_max_size=SPLIT, log=notes.append)
    assert notes == [f"removed {folder}: a partial output of process {folder.name.rsplit('-', 1)[1]}, which is gone"]
    assert [p.name for p in out_dir.iterdir() if p.name.startswith(".")] == []
    same_files(output_of(out_dir, "s.gguf"), converted)


def test_resume_writes_again_a_part_that_no_longer_matches_its_journal(tmp_path, ckpt, converted, convert_killed):
    out_dir, folder = leftovers(convert_killed, tmp_path)
    _, entries = read_journal(folder)
    damaged = entries[0]
    flip(folder / damaged.name, damaged.tensors[1].offset)
    notes: list[str] = []
    convert(build_plan(ckpt), out_dir / "s.gguf", split_max_size=SPLIT, resume=True, log=notes.append)
    assert notes[0].startswith(f"--resume: checking the {len(entries)} finished part(s) that the journal of ")
    assert notes[1].startswith(f"--resume: {damaged.name} is not as its journal says (tensor "
                               f"{damaged.tensors[1].name}: "), notes
    assert f"kept {len(entries) - 1} of 8 part(s)" in notes[-1]
    same_files(output_of(out_dir, "s.gguf"), converted)


def test_ctrl_c_while_resuming_keeps_the_parts_taken_over(tmp_path, ckpt, converted, convert_killed, monkeypatch):
    """Ctrl-C during a --resume run must not remove what it took over from the killed run: the folder (now
    named after this process) keeps the finished parts and their journal, and the next --resume keeps them."""
    from kimi_convert.gguf_io.writer import GGUFStreamWriter
    out_dir, folder = leftovers(convert_killed, tmp_path)
    kept = kept_parts(folder)
    write_part = GGUFStreamWriter._write_part

    def interrupted(self, *args):
        raise KeyboardInterrupt
    monkeypatch.setattr(GGUFStreamWriter, "_write_part", interrupted)
    notes: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        convert(build_plan(ckpt), out_dir / "s.gguf", split_max_size=SPLIT, resume=True, log=notes.append)
    (ours,) = partials(out_dir)
    assert ours.name.endswith(f"-{os.getpid()}") and kept_parts(ours) == kept, notes
    assert notes[-1].startswith(f"--resume: interrupted; kept {ours} with the finished parts its journal lists")
    monkeypatch.setattr(GGUFStreamWriter, "_write_part", write_part)
    notes.clear()
    os.rename(ours, folder)              # as if the interrupted process were gone (its pid is ours, alive)
    convert(build_plan(ckpt), out_dir / "s.gguf", split_max_size=SPLIT, resume=True, log=notes.append)
    assert f"kept {len(kept)} of 8 part(s)" in notes[-1], notes
    same_files(output_of(out_dir, "s.gguf"), converted)


def test_resume_with_nothing_to_resume_writes_everything(tmp_path, ckpt, converted):
    notes: list[str] = []
    convert(build_plan(ckpt), tmp_path / "s.gguf", split_max_size=SPLIT, resume=True, log=notes.append)
    assert notes and notes[0].startswith("--resume: no partial output")
    same_files(output_of(tmp_path, "s.gguf"), converted)


def test_quantize_resume_keeps_the_finished_parts(tmp_path, converted, quantized, quantize_killed):
    out_dir, folder = leftovers(quantize_killed, tmp_path)
    kept = kept_parts(folder)
    r = run(QUANTIZE_MAIN, "--policy", "q8_0", converted[0], out_dir / "q.gguf", "--split-max-size", "1M", "--resume")
    assert r.returncode == 0 and errors(r.stderr) == [], r.stderr
    assert_resumed(out_dir, quantized, kept, r.stderr)


def test_quantize_resume_refuses_another_plan_and_without_resume_removes(tmp_path, converted, quantized,
                                                                         quantize_killed):
    out_dir, folder = leftovers(quantize_killed, tmp_path)
    kept = kept_parts(folder)
    with pytest.raises(OutputError, match=r"policy \(preset q8_0 then, preset k3-q4 now\)"):
        quantize_file(converted[0], out_dir / "q.gguf", load_policy("k3-q4"), split_max_size=SPLIT, resume=True)
    assert partials(out_dir) == [folder] and kept_parts(folder) == kept
    notes: list[str] = []
    quantize_file(converted[0], out_dir / "q.gguf", load_policy("q8_0"), split_max_size=SPLIT, log=notes.append)
    assert notes == [f"removed {folder}: a partial output of process {folder.name.rsplit('-', 1)[1]}, which is gone"]
    assert [p.name for p in out_dir.iterdir() if p.name.startswith(".")] == []
    same_files(output_of(out_dir, "q.gguf"), quantized)


# --- the lock, and SIGTERM at ~30 % --------------------------------------------------------------

COMMANDS = {
    "kimi-convert": (CONVERT_MAIN, lambda ckpt, src, out: [ckpt, out, "--split-max-size", "1M"]),
    "kimi-quantize": (QUANTIZE_MAIN, lambda ckpt, src, out: ["--policy", "q8_0", src, out, "--split-max-size", "1M"]),
}


def _convert_app():
    from kimi_convert.cli.convert import convert_app
    return convert_app


def _quantize_app():
    from kimi_convert.cli.quantize import app
    return app


APPS = {"kimi-convert": _convert_app, "kimi-quantize": _quantize_app}


@pytest.mark.parametrize("command", COMMANDS)
def test_second_run_into_the_same_output_refuses(command, tmp_path, ckpt, converted, quantized):
    main, args = COMMANDS[command]
    reference = converted if command == "kimi-convert" else quantized
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "o.gguf"
    first, hold = start_paused(main, args(ckpt, converted[0], out), reference, tmp_path / "control")
    second = CliRunner().invoke(APPS[command](), list(map(str, args(ckpt, converted[0], out))))
    (line,) = errors(second.output)
    assert second.exit_code == 1 and f"another run (process {first.pid}) is writing this output now" in line
    assert [p.name for p in partials(out_dir)] == [f".o.gguf.partial-{first.pid}"]   # the second wrote nothing
    hold.unlink()
    _, stderr = first.communicate(timeout=120)
    assert first.returncode == 0, stderr                  # and the first was not disturbed
    assert [p.read_bytes() for p in output_of(out_dir, "o.gguf")] == [p.read_bytes() for p in reference]
    assert [p.name for p in out_dir.iterdir() if p.name.startswith(".")] == []     # the lock is gone


@pytest.mark.parametrize("command", COMMANDS)
def test_sigterm_at_30_percent_leaves_nothing(command, tmp_path, ckpt, converted, quantized):
    main, args = COMMANDS[command]
    reference = converted if command == "kimi-convert" else quantized
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc, _ = start_paused(main, args(ckpt, converted[0], out_dir / "o.gguf"), reference, tmp_path / "control")
    assert journaled(out_dir, 2) is not None              # well into the data: two parts are down
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    (line,) = errors(stderr)
    assert proc.returncode == 128 + signal.SIGTERM and "interrupted by SIGTERM; nothing was written" in line
    assert list(out_dir.iterdir()) == []                  # no partial folder, no lock, no manifest
