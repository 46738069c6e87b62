"""Bad input: one clear line naming the file and tensor, exit code 1, and no output left behind."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from in_process import run_command

ROOT = Path(__file__).resolve().parents[1]


def cli_command(args, patch: str = "") -> list[str]:
    """kimi-convert ARGS, with `patch` (Python run first, to fake a disk or slow the writer) if given."""
    if not patch:
        return [sys.executable, "-m", "kimi_convert", *map(str, args)]
    code = patch + "\nfrom kimi_convert.cli.convert import convert_main\nconvert_main()\n"
    return [sys.executable, "-c", code, *map(str, args)]


CLI_ENV = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="300")


def run_cli(*args: str, preexec=None, patch: str = "", process: bool = False) -> subprocess.CompletedProcess:
    """kimi-convert ARGS: in this process (tests/in_process.py), or in its own where the test needs one (`preexec`:
    a resource limit; `patch`: a faked disk or a slowed writer; `process`: a process id other than the test's)."""
    if preexec is None and not patch and not process:
        return run_command("kimi-convert", args)
    return subprocess.run(cli_command(args, patch), capture_output=True, text=True, env=CLI_ENV,
                          preexec_fn=preexec, timeout=120)


@pytest.fixture
def ckpt(tmp_path, k3_dir) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(k3_dir, dst)
    return dst


@pytest.fixture
def ckpt31(tmp_path, k31_dir) -> Path:
    dst = tmp_path / "ckpt31"
    shutil.copytree(k31_dir, dst)
    return dst


def index(d: Path) -> dict:
    return json.loads((d / "model.safetensors.index.json").read_text())


def write_index(d: Path, idx: dict) -> None:
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))


def shard_of(d: Path, tensor: str) -> Path:
    return d / index(d)["weight_map"][tensor]


def patch_header(path: Path, old: str, new: str) -> None:
    """Edit a safetensors header in place, keeping its length (so offsets stay valid)."""
    assert len(old) == len(new)
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = data[8:8 + n].decode()
    assert old in header, old
    path.write_bytes(data[:8] + header.replace(old, new, 1).encode() + data[8 + n:])


def assert_fails_cleanly(out_dir: Path, result, *needles: str, code: int = 1) -> None:
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    message = errors[0]
    for n in needles:
        assert n in message, (n, message)
    leftovers = [p.name for p in out_dir.iterdir() if p.suffix == ".gguf" or ".partial" in p.name]
    assert leftovers == []


LAYER1 = "language_model.model.layers.1."


def test_missing_shard(tmp_path, ckpt):
    shard = shard_of(ckpt, LAYER1 + "input_layernorm.weight")
    shard.unlink()
    r = run_cli(ckpt, tmp_path / "out.gguf")
    assert_fails_cleanly(tmp_path, r, shard.name, "missing shard")


def test_tensor_in_index_but_not_in_shard(tmp_path, ckpt):
    idx = index(ckpt)
    shard = idx["weight_map"][LAYER1 + "input_layernorm.weight"]
    idx["weight_map"][LAYER1 + "ghost.weight"] = shard
    write_index(ckpt, idx)
    r = run_cli(ckpt, tmp_path / "out.gguf")
    assert_fails_cleanly(tmp_path, r, shard, LAYER1 + "ghost.weight", "not in its shard")


def test_tensor_in_shard_but_not_in_index(tmp_path, ckpt):
    idx = index(ckpt)
    name = LAYER1 + "post_attention_layernorm.weight"
    shard = idx["weight_map"].pop(name)
    write_index(ckpt, idx)
    r = run_cli(ckpt, tmp_path / "out.gguf")
    assert_fails_cleanly(tmp_path, r, shard, name)


def test_truncated_shard(tmp_path, ckpt):
    shard = shard_of(ckpt, LAYER1 + "input_layernorm.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[:-1000])
    r = run_cli(ckpt, tmp_path / "out.gguf")
    assert_fails_cleanly(tmp_path, r, shard.name, "truncated")


def test_corrupt_header(tmp_path, ckpt):
    shard = shard_of(ckpt, LAYER1 + "input_layernorm.weight")
    data = bytearray(shard.read_bytes())
    data[8:40] = b"\xff" * 32
    shard.write_bytes(bytes(data))
    r = run_cli(ckpt, tmp_path / "out.gguf")
    assert_fails_cleanly(tmp_path, r, shard.name, "corrupt safetensors header")


def test_dtype_contradicts_config(tmp_path, ckpt):
    name = LAYER1 + "self_attn.dt_bias"
    shard = shard_of(ckpt, name)
    patch_header(shard, f'"{name}":{{"dtype":"F32"', f'"{name}":{{"dtype":"I32"')
    r = run_cli(ckpt, tmp_path / "out.gguf")
    assert_fails_cleanly(tmp_path, r, shard.name, name, "I32")


def test_shape_contradicts_config(tmp_path, ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["text_config"]["intermediate_size"] += 32
    (ckpt / "config.json").write_text(json.dumps(cfg))
    r = run_cli(ckpt, tmp_path / "out.gguf")
    assert_fails_cleanly(tmp_path, r, "language_model.model.layers.0.mlp.gate_proj.weight", "shape")


def test_missing_expert(tmp_path, ckpt):
    name = LAYER1 + "block_sparse_moe.experts.3.w1.weight_packed"
    shard = shard_of(ckpt, name)
    renamed = name.replace("experts.3.", "experts.X.")
    patch_header(shard, f'"{name}"', f'"{renamed}"')
    idx = index(ckpt)
    idx["weight_map"][renamed] = idx["weight_map"].pop(name)
    write_index(ckpt, idx)
    r = run_cli(ckpt, tmp_path / "out.gguf")
    assert_fails_cleanly(tmp_path, r, name, "missing")


def test_inconsistent_dsa_layer_list(tmp_path, ckpt31):
    cfg = json.loads((ckpt31 / "config.json").read_text())
    cfg["text_config"]["dsa_config"]["layers"] = cfg["text_config"]["dsa_config"]["layers"][:-1]
    (ckpt31 / "config.json").write_text(json.dumps(cfg))
    r = run_cli(ckpt31, tmp_path / "out.gguf")
    assert_fails_cleanly(tmp_path, r, "config.json", "dsa_config", "full_attn_layers")


def test_unknown_architecture(tmp_path, ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["KimiK9ForConditionalGeneration"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    r = run_cli(ckpt, tmp_path / "out.gguf")
    assert_fails_cleanly(tmp_path, r, "config.json", "unknown architecture", "KimiK9")


@pytest.mark.parametrize("limit", [1000, 1 << 20, 2_000_000],
                         ids=["in-the-header", "page-aligned", "not-page-aligned"])
def test_file_size_limit(tmp_path, ckpt, limit):
    """The kernel refuses writes past `limit` bytes (EFBIG, as a file system's size limit would).
    2,000,000 is not a multiple of the page: the O_DIRECT write is refused with EINVAL there, the
    writer falls back to buffered writes, and those end in EFBIG."""
    def small_file_limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)    # else the kernel kills the process instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    r = run_cli(ckpt, tmp_path / "out.gguf", preexec=small_file_limit)
    assert_fails_cleanly(tmp_path, r, str(tmp_path / "out.gguf"), "File too large", "nothing was written")


def refusing_pwrite(monkeypatch, error: int, direct_only: bool) -> list[int]:
    """Make os.pwrite fail with `error` (on O_DIRECT descriptors only, or on all); returns the refused fds."""
    real, refused = os.pwrite, []

    def pwrite(fd, data, offset):
        if not direct_only or fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(fd)
            raise OSError(error, os.strerror(error))
        return real(fd, data, offset)
    monkeypatch.setattr(os, "pwrite", pwrite)
    return refused


def test_o_direct_refused_at_the_first_write_falls_back_to_buffered(tmp_path, k3_dir, converted, monkeypatch):
    """Some file systems accept O_DIRECT at open and refuse the write (EINVAL): same file, buffered."""
    from kimi_convert.convert.converter import build_plan, convert
    refused = refusing_pwrite(monkeypatch, errno.EINVAL, direct_only=True)
    out = convert(build_plan(k3_dir), tmp_path / "out.gguf").paths[0]
    assert len(refused) == 1                # one refusal, then every write went the buffered way
    assert out.read_bytes() == converted("k3").read_bytes()


@pytest.mark.parametrize("error", [errno.EIO, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EINVAL],
                         ids=errno.errorcode.get)
def test_every_write_error_is_one_output_error(tmp_path, k3_dir, monkeypatch, error):
    from kimi_convert.convert.converter import build_plan, convert
    from kimi_convert.errors import DiskSpaceError, OutputError
    refusing_pwrite(monkeypatch, error, direct_only=False)
    out = tmp_path / "out.gguf"
    with pytest.raises(OutputError) as e:
        convert(build_plan(k3_dir), out)
    assert str(out) in str(e.value) and os.strerror(error) in str(e.value)
    assert isinstance(e.value, DiskSpaceError) == (error in (errno.ENOSPC, errno.EDQUOT))
    assert e.value.exit_code == (3 if error in (errno.ENOSPC, errno.EDQUOT) else 1)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("reader", ["staging", "producer"])
def test_a_read_error_blames_the_checkpoint(tmp_path, k3_dir, monkeypatch, reader):
    """EIO while reading a shard is the checkpoint's fault, not the output's: read straight into
    the O_DIRECT staging (os.preadv), or by the producer thread (Checkpoint.read_raw)."""
    from kimi_convert.convert.checkpoint import Checkpoint
    from kimi_convert.convert.converter import build_plan, convert
    from kimi_convert.errors import CheckpointError, OutputError
    plan = build_plan(k3_dir)

    def broken(*args):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    if reader == "staging":
        monkeypatch.setattr(os, "preadv", broken)
    else:
        monkeypatch.setattr(Checkpoint, "read_raw", broken)
    with pytest.raises(CheckpointError) as e:
        convert(plan, tmp_path / "out.gguf")
    message = str(e.value)
    assert not isinstance(e.value, OutputError) and "Input/output error" in message
    assert ".safetensors: cannot read" in message if reader == "staging" else "cannot read its source" in message
    assert list(tmp_path.iterdir()) == []


# --- signals -----------------------------------------------------------------------------

def slow_writes(seconds_per_chunk: float) -> str:
    """The fixture writes in milliseconds; a pause per chunk (~350 of them) lets a signal land mid-write."""
    return f"""
import time
from kimi_convert import gguf_io
_open_sink = gguf_io.writer.open_sink
def slow_sink(fout, nbytes=None):
    sink = _open_sink(fout, nbytes)
    put = sink.put
    sink.put = lambda chunk, sources: (time.sleep({seconds_per_chunk}), put(chunk, sources))[1]
    return sink
gguf_io.writer.open_sink = slow_sink
"""


def partial_dirs(d: Path) -> list[Path]:
    return [p for p in d.iterdir() if ".partial-" in p.name]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
def test_signal_mid_write_leaves_nothing(tmp_path, ckpt, sig):
    out = tmp_path / "out.gguf"
    proc = subprocess.Popen(cli_command([ckpt, out], slow_writes(0.02)), env=CLI_ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not any(p.stat().st_size > 0 for d in partial_dirs(tmp_path) for p in d.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    time.sleep(0.3)                         # well into the tensor data
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, stderr        # the shell's convention for "killed by sig"
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and sig.name in errors[0] and "nothing was written" in errors[0], stderr
    assert "Traceback" not in stderr and stdout == ""
    assert list(tmp_path.iterdir()) == [ckpt]


def test_an_ignored_signal_stays_ignored(tmp_path, ckpt):
    """nohup ignores SIGHUP before the program starts: then a hangup must not end the conversion."""
    out = tmp_path / "out.gguf"
    proc = subprocess.Popen(cli_command([ckpt, out], slow_writes(0.005)), env=CLI_ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    while not partial_dirs(tmp_path):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGHUP)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert stdout == f"{out}\n" and out.read_bytes()[:4] == b"GGUF"


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_partial_of_a_dead_process_is_removed(tmp_path, ckpt):
    """What SIGKILL (or a power cut) leaves: the next run removes it and says so; a live one stays."""
    stale = tmp_path / f".out.gguf.partial-{dead_pid()}"
    live = tmp_path / f".out.gguf.partial-{os.getpid()}"     # this test process: alive
    for d in (stale, live):
        d.mkdir()
        (d / "out.gguf").write_bytes(b"GGUF" + bytes(4096))
    r = run_cli(ckpt, tmp_path / "out.gguf", process=True)        # a pid other than the live partial's
    assert r.returncode == 0, r.stderr
    assert not stale.exists() and (live / "out.gguf").exists()
    notes = [line for line in r.stderr.splitlines() if str(stale) in line]
    assert len(notes) == 1 and "removed" in notes[0], r.stderr
    assert str(live) not in r.stderr


# --- paths that are not what they should be ---------------------------------------------------

def test_checkpoint_is_a_file(tmp_path, ckpt):
    r = run_cli(ckpt / "config.json", tmp_path / "a.gguf")
    assert_fails_cleanly(tmp_path, r, str(ckpt / "config.json"), "not a folder")


@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry-run"])
def test_output_folder_missing(tmp_path, ckpt, dry_run):
    r = run_cli(ckpt, tmp_path / "nonexistent-dir" / "a.gguf", *(["--dry-run"] if dry_run else []))
    assert_fails_cleanly(tmp_path, r, str(tmp_path / "nonexistent-dir"), "no such folder")
    assert r.stdout == ""


def test_output_folder_is_a_file(tmp_path, ckpt):
    (tmp_path / "file").write_text("x")
    r = run_cli(ckpt, tmp_path / "file" / "a.gguf")
    assert_fails_cleanly(tmp_path, r, str(tmp_path / "file"), "not a folder")


def test_output_is_a_folder(tmp_path, ckpt):
    (tmp_path / "out.gguf").mkdir()
    r = run_cli(ckpt, tmp_path / "out.gguf", "--force")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert [line for line in r.stderr.splitlines() if line.startswith("error:")] == [
        f"error: {tmp_path / 'out.gguf'}: is a folder; give the output file's name, e.g. "
        f"{tmp_path / 'out.gguf' / 'model.gguf'}"]
    assert list((tmp_path / "out.gguf").iterdir()) == []


def test_existing_output_needs_force(tmp_path, ckpt):
    out = tmp_path / "out.gguf"
    out.write_bytes(b"precious")
    r = run_cli(ckpt, out)
    assert r.returncode == 1 and "already exists" in r.stderr and "--force" in r.stderr
    assert out.read_bytes() == b"precious"
    r = run_cli(ckpt, out, "--force")
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:4] == b"GGUF"
    assert not [p for p in tmp_path.iterdir() if ".partial" in p.name]


def test_dry_run_writes_nothing(tmp_path, ckpt):
    r = run_cli(ckpt, tmp_path / "out.gguf", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "total" in r.stdout and "peak RAM" in r.stdout and "split files: 1" in r.stdout
    assert "dropped (vision/projector): 18 tensors" in r.stdout
    assert list(tmp_path.iterdir()) == [ckpt]


# --- the dry run checks what the real run checks -----------------------------------------------

@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry-run"])
def test_missing_vocabulary(tmp_path, ckpt, dry_run):
    (ckpt / "tiktoken.model").unlink()
    r = run_cli(ckpt, tmp_path / "out.gguf", *(["--dry-run"] if dry_run else []))
    assert_fails_cleanly(tmp_path, r, str(ckpt / "tiktoken.model"))


def test_dry_run_refuses_an_existing_output(tmp_path, ckpt):
    out = tmp_path / "out.gguf"
    out.write_bytes(b"precious")
    r = run_cli(ckpt, out, "--dry-run")
    assert r.returncode == 1 and f"error: {out}: already exists (use --force to overwrite)" in r.stderr
    r = run_cli(ckpt, out, "--dry-run", "--force")
    assert r.returncode == 0, r.stderr
    assert f"overwrites {out}" in r.stdout
    assert out.read_bytes() == b"precious"


@pytest.mark.parametrize("size", ["10", "-5G"])
def test_split_size_below_the_minimum(tmp_path, ckpt, size):
    r = run_cli(ckpt, tmp_path / "out.gguf", f"--split-max-size={size}")
    assert_fails_cleanly(tmp_path, r, f"--split-max-size {size}", "at least 1M (1,000,000 bytes)")


def test_split_size_minimum_is_1m():
    from kimi_convert.cli.common import parse_size
    from kimi_convert.gguf_io import check_split_max_size
    from kimi_convert.errors import OutputError
    for size in ("10", "999999", "0.5M", "0", "-5G", "-1M"):
        with pytest.raises(OutputError, match="at least 1M"):
            check_split_max_size(parse_size(size), size)
    for size, n in (("1M", 10**6), ("1000000", 10**6), ("1.5G", 15 * 10**8), ("50G", 5 * 10**10)):
        assert parse_size(size) == n
        check_split_max_size(n, size)


def test_split_size_at_the_minimum(tmp_path, ckpt):
    from kimi_convert.convert.converter import build_plan
    r = run_cli(ckpt, tmp_path / "out.gguf", "--split-max-size", "1M", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert f"split files: {build_plan(ckpt).n_files(0, 1_000_000)};" in r.stdout


def fake_free_disk(free: int) -> str:
    return f"""
import shutil
_disk_usage = shutil.disk_usage
shutil.disk_usage = lambda path: _disk_usage(path)._replace(free={free})
"""


@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry-run"])
def test_not_enough_disk_has_its_own_exit_code(tmp_path, ckpt, dry_run):
    """Exit 3 = the disk is too small, 1 = anything else; the dry run decides exactly as the run does:
    tensor bytes + 64 MiB, or more, free."""
    from kimi_convert.convert.converter import build_plan
    need = build_plan(ckpt).total_bytes + (64 << 20)
    args = [ckpt, tmp_path / "out.gguf"] + (["--dry-run"] if dry_run else [])
    r = run_cli(*args, patch=fake_free_disk(need - 1))
    assert_fails_cleanly(tmp_path, r, str(tmp_path), "not enough free disk", code=3)
    if dry_run:
        assert "NOT ENOUGH" in r.stdout
    r = run_cli(*args, patch=fake_free_disk(need))
    assert r.returncode == 0, r.stderr
    if dry_run:
        assert "(enough)" in r.stdout


def test_bad_input_wins_over_a_small_disk(tmp_path, ckpt):
    """Both wrong: exit 1, since more disk would not help."""
    (ckpt / "tiktoken.model").unlink()
    r = run_cli(ckpt, tmp_path / "out.gguf", "--dry-run", patch=fake_free_disk(0))
    assert_fails_cleanly(tmp_path, r, "tiktoken.model")
