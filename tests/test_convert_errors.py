"""Bad input: one clear line naming the file and tensor, exit code 1, and no output left behind."""
from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, preexec=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="300")
    return subprocess.run([sys.executable, "-m", "kimi_convert", *map(str, args)], capture_output=True,
                          text=True, env=env, preexec_fn=preexec, timeout=120)


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


def assert_fails_cleanly(out_dir: Path, result, *needles: str) -> None:
    assert result.returncode == 1, result.stderr
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


def test_disk_full(tmp_path, ckpt):
    def small_disk():   # the kernel refuses writes past 1 MB: EFBIG, as a full disk would
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    r = run_cli(ckpt, tmp_path / "out.gguf", preexec=small_disk)
    assert_fails_cleanly(tmp_path, r, "out.gguf", "disk full")


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
    assert "total" in r.stderr and "peak RAM" in r.stderr and "split files: 1" in r.stderr
    assert "dropped (vision/projector): 18 tensors" in r.stderr
    assert not (tmp_path / "out.gguf").exists()
