"""kimi-verify slice: an N-layer checkpoint cut from a full one is a real, consistent checkpoint."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from safetensors import safe_open
from typer.testing import CliRunner

from kimi_convert.fixtures.make_checkpoint import read_safetensors_raw
from kimi_convert.convert.checkpoint import Checkpoint
from kimi_convert.convert.converter import build_plan, convert
from kimi_convert.errors import KimiError, OutputError
from kimi_convert.model import KimiConfig
from kimi_convert.verify.slice import SliceError, default_layers, parse_layers, slice_checkpoint
from kimi_convert.verify.check import verify
from kimi_convert.cli.verify import app

LAYER = re.compile(r"layers\.(\d+)\.")


def kinds(cfg: KimiConfig, il: int) -> tuple[str, str, bool]:
    return ("mla" if cfg.is_mla(il) else "kda", "moe" if cfg.is_moe(il) else "dense", cfg.has_indexer(il))


def raw_tensors(d: Path) -> dict[str, tuple]:
    """(dtype, shape, bytes) of every tensor, read without our own reader."""
    out = {}
    for shard in sorted(d.glob("*.safetensors")):
        out.update(read_safetensors_raw(shard)[1])
    return out


@pytest.fixture(scope="module")
def sliced(tmp_path_factory, k31_dir):
    out = tmp_path_factory.mktemp("slice") / "k31-4"
    return slice_checkpoint(k31_dir, out, "0,3-4,7")


def test_config_of_the_slice_is_consistent(sliced, k31_dir):
    src, new = KimiConfig.from_hf_dir(k31_dir), sliced.config
    assert sliced.layers == [0, 3, 4, 7]
    assert new.n_layer == 4
    # every new layer has the kind of the layer it came from (attention, FFN, indexer)
    assert [kinds(new, k) for k in range(4)] == [kinds(src, il) for il in sliced.layers]
    tc = json.loads((sliced.out_dir / "config.json").read_text())["text_config"]
    lac = tc["linear_attn_config"]
    assert lac["full_attn_layers"] == [2, 4] and lac["kda_layers"] == [1, 3]       # 1-indexed
    assert tc["dsa_config"]["layers"] == lac["full_attn_layers"]
    assert tc["first_k_dense_replace"] == 1 and tc["num_hidden_layers"] == 4
    assert tc["attn_res_block_size"] == json.loads((k31_dir / "config.json").read_text())[
        "text_config"]["attn_res_block_size"]


def test_shards_index_and_bytes(sliced, k31_dir):
    d = sliced.out_dir
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    assert shards == [f"model-{k:05d}-of-000005.safetensors" for k in range(1, 6)]
    assert sorted(set(index["weight_map"].values())) == shards
    ckpt = Checkpoint(d)                      # index and headers agree, nothing truncated
    import torch
    for shard in shards:                      # and the safetensors library itself reads them
        with safe_open(str(d / shard), "pt") as f:
            assert all(isinstance(f.get_tensor(n), torch.Tensor) for n in f.keys())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in ckpt.tensors.values())
    # no vision / projector; every text tensor of a kept layer, renumbered, byte-identical
    src, new = raw_tensors(k31_dir), raw_tensors(d)
    assert not [n for n in new if n.startswith(("vision_tower.", "mm_projector."))]
    renumber = {str(il): str(k) for k, il in enumerate(sliced.layers)}
    expected = {}
    for name, data in src.items():
        if name.startswith(("vision_tower.", "mm_projector.")):
            continue
        m = LAYER.search(name)
        if m is None:
            expected[name] = data
        elif m[1] in renumber:
            expected[LAYER.sub(f"layers.{renumber[m[1]]}.", name, count=1)] = data
    assert new.keys() == expected.keys()
    assert all(new[n] == expected[n] for n in new)
    for f in ("tiktoken.model", "tokenizer_config.json"):
        assert (d / f).read_bytes() == (k31_dir / f).read_bytes()


def test_slice_of_8_layers_to_4_converts_and_verifies(tmp_path, k31_dir):
    r = slice_checkpoint(k31_dir, tmp_path / "s", "4")
    assert r.layers == [0, 1, 2, 3]
    out = tmp_path / "s.gguf"
    convert(build_plan(r.out_dir, "bf16"), out)
    report = verify(out, r.out_dir, length=16)
    assert report.ok, [(p.key, p.failures) for p in report.parts]
    assert report.part("k31").ok                 # the slice keeps a DSA layer, and it is exercised


def test_default_selection_keeps_every_kind(k3_dir, k31_dir):
    for d in (k3_dir, k31_dir):
        cfg = KimiConfig.from_hf_dir(d)
        for n in range(2, cfg.n_layer + 1):
            layers = default_layers(cfg, n)
            assert len(layers) == n and layers == sorted(set(layers))
            got = {k for il in layers for k in kinds(cfg, il)[:2]}
            assert got == {"kda", "mla", "dense", "moe"}, (n, layers)
    cfg = KimiConfig.from_hf_dir(k3_dir)
    assert default_layers(cfg, 2) == [0, 3]           # KDA+dense and MLA+MoE
    assert default_layers(cfg, 8) == list(range(8))   # a count is the first N when that covers all


def test_layer_specs(k3_dir):
    cfg = KimiConfig.from_hf_dir(k3_dir)
    assert parse_layers("0-2, 5-5,7", cfg) == [0, 1, 2, 5, 7]
    assert parse_layers("6,", cfg) == [6]
    for bad in ("0-9", "3-1", "1,1", "a", "-3", "0"):
        with pytest.raises(SliceError):
            parse_layers(bad, cfg)


def test_k31_slice_needs_a_dsa_layer(tmp_path, k31_dir):
    with pytest.raises(SliceError, match="DSA"):
        slice_checkpoint(k31_dir, tmp_path / "s", [0, 1])


def test_output_must_be_empty_unless_forced(tmp_path, k3_dir):
    out = tmp_path / "s"
    slice_checkpoint(k3_dir, out, "3")
    with pytest.raises(OutputError, match="--force"):
        slice_checkpoint(k3_dir, out, "3")
    r = slice_checkpoint(k3_dir, out, "2", force=True)      # fewer shards: the stale ones go
    assert sorted(p.name for p in out.glob("*.safetensors")) == r.shards
    Checkpoint(out)
    with pytest.raises(KimiError):
        slice_checkpoint(k3_dir, k3_dir, "2", force=True)


def test_cli(tmp_path, k3_dir):
    runner = CliRunner()
    res = runner.invoke(app, ["slice", str(k3_dir), str(tmp_path / "s"), "--layers", "0-3"])
    assert res.exit_code == 0, res.output
    assert KimiConfig.from_hf_dir(tmp_path / "s").n_layer == 4
    res = runner.invoke(app, ["slice", str(k3_dir), str(tmp_path / "t"), "--layers", "0-99"])
    assert res.exit_code == 1
    assert "error:" in res.output and "do not exist" in res.output
