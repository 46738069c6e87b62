"""Our conversion against llama.cpp's own converter (convert_hf_to_gguf.py of the Oct-2026 tree), on the same
checkpoint: the same tensors with the same bytes, the same keys with the same value types and values, except
the differences docs/formats.md lists (UPSTREAM_DIFFERENCES below). Fails, never skips, when the converter is
not unpacked (`bash .ci/install-interop.sh`).

llama.cpp's tree has no kimi-k31 converter (that came with b12180 and is not published as source here), so
this runs on kimi-k3 checkpoints; tests/test_convert.py holds the K3.1 key types.
"""
from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from gguf import GGUFReader
from safetensors import safe_open

from kimi_convert.convert.converter import build_plan, convert
from kimi_convert.fixtures.make_checkpoint import make_checkpoint
from kimi_interop import upstream_convert
from kimi_convert.verify.check import verify

pytestmark = pytest.mark.interop      # needs the llama.cpp builds (.ci/install-interop.sh)

# key -> why it differs (docs/formats.md, "Differences from llama.cpp's converter")
UPSTREAM_DIFFERENCES = {
    "general.name": "descriptive: llama.cpp title-cases the folder name, we keep it",
    "general.size_label": "descriptive: written by llama.cpp only",
    "general.type": "descriptive: written by llama.cpp only",
    "tokenizer.chat_template": "ours renders K3's chat format; llama.cpp bundles its own Kimi-K3.jinja",
    "tokenizer.ggml.add_bos_token": "ours only; false, which is llama.cpp's default for this vocabulary",
    "tokenizer.ggml.add_eos_token": "ours only; false, which is llama.cpp's default for this vocabulary",
}
COMPUTED_TENSORS = ".ssm_a"      # -exp(A_log): ours correctly rounded, llama.cpp's torch float32 exp


def fields(reader: GGUFReader) -> dict:
    return {k: ([t.name for t in f.types], f.contents()) for k, f in reader.fields.items()
            if not k.startswith("GGUF.")}


@pytest.fixture(scope="module", params=[(True, "bf16"), (False, "f32"), (True, "f32")],
                ids=["mxfp4-bf16", "bf16experts-f32", "mxfp4-f32"])
def pair(request, tmp_path_factory):
    mxfp4, outtype = request.param
    d = tmp_path_factory.mktemp(f"upstream-{mxfp4}-{outtype}")
    hf = make_checkpoint(d / "Kimi-K3-tiny", arch="k3", n_layers=6, experts_mxfp4=mxfp4, seed=7)
    ours = d / "ours.gguf"
    convert(build_plan(hf, outtype), ours)
    theirs = upstream_convert(hf, d / "upstream.gguf", outtype)
    return GGUFReader(ours), GGUFReader(theirs), hf, theirs


def test_same_keys_types_and_values_except_the_documented_ones(pair):
    ours, theirs = (fields(r) for r in pair[:2])
    differing = {k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k)}
    assert differing == set(UPSTREAM_DIFFERENCES), {k: (ours.get(k), theirs.get(k)) for k in
                                                    differing ^ set(UPSTREAM_DIFFERENCES)}
    assert ours["kimi-k3.attention.head_count_kv"][0] == ["ARRAY", "INT32"]


def test_same_tensors_byte_for_byte(pair):
    ours, theirs = ({t.name: t for t in r.tensors} for r in pair[:2])
    assert set(ours) == set(theirs)
    computed = 0
    for name, t in ours.items():
        u = theirs[name]
        assert (t.tensor_type, t.shape.tolist()) == (u.tensor_type, u.shape.tolist()), name
        a, b = t.data.reshape(-1).view(np.uint8), u.data.reshape(-1).view(np.uint8)
        if name.endswith(COMPUTED_TENSORS):
            computed += 1
            check_ssm_a(t.data.reshape(-1), u.data.reshape(-1), a_log(pair[2], name))
        else:
            assert np.array_equal(a, b), f"{name}: {(a != b).sum()} bytes differ"
    assert computed > 0


def a_log(hf_dir, gguf_name: str) -> np.ndarray:
    """The checkpoint's A_log of that layer, read with safetensors."""
    layer = re.match(r"blk\.(\d+)\.", gguf_name)[1]
    name = f"language_model.model.layers.{layer}.self_attn.A_log"
    shard = json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"][name]
    with safe_open(hf_dir / shard, framework="np") as f:
        return f.get_tensor(name)


def check_ssm_a(ours: np.ndarray, theirs: np.ndarray, a_log: np.ndarray) -> None:
    """Ours is -exp(A_log) correctly rounded; llama.cpp's is within 1 ulp of it (torch's float32 exp)."""
    correct = np.array([-math.exp(float(x)) for x in a_log[:ours.size]], dtype=np.float32)
    assert np.array_equal(ours, correct)
    ulp = np.abs(ours.view(np.int32).astype(np.int64) - theirs.view(np.int32))
    assert ulp.max() <= 1


def test_kimi_verify_passes_llama_cpps_conversion(pair):
    """kimi-verify accepts what llama.cpp's converter writes: against the checkpoint and on its own."""
    hf, upstream = pair[2], pair[3]
    with_checkpoint = verify(upstream, hf, log=lambda s: None)
    assert with_checkpoint.ok, [p.failures for p in with_checkpoint.parts if p.ok is False]
    alone = verify(upstream, None, log=lambda s: None)
    assert alone.ok, [p.failures for p in alone.parts if p.ok is False]
