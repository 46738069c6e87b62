"""kimi-verify accepts the files llama.cpp writes: llama-quantize's outputs (headers without trailing
1-dimensions), its converter's (per-layer arrays as INT32), and every per-layer array type its loader reads
(src/llama-model-loader.cpp get_arr: INT32, UINT32 or BOOL), and still fails what llama.cpp would refuse."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from typer.testing import CliRunner

import kimi_interop as interop
from kimi_convert.convert.converter import build_plan, convert
from kimi_convert.fixtures.make_checkpoint import make_checkpoint
from kimi_convert.gguf_io import open_gguf
from kimi_interop.llama_cpp_convert import upstream_convert
from kimi_convert.runtime.forward import Runtime
from kimi_convert.verify.check import Part, check_lone_tensors, check_metadata, check_tensors, token_sequence, verify
from kimi_convert.cli.verify import app

VT = GGUFValueType
N = 12          # tokens: enough for every part, short for speed


def failures(report) -> dict:
    return {p.key: p.failures for p in report.parts if p.ok is False}


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    """K3 with n_embd 256 (rows K-quants can take) and one attention head (so llama-quantize also drops
    the leading dimension of attn_k_b/v_b, [1, r, d] -> [r, d]), with BF16 experts (so llama-quantize
    needs no --allow-requantize)."""
    return make_checkpoint(tmp_path_factory.mktemp("wide") / "Kimi-K3-wide", arch="k3", hidden=256,
                           n_heads=1, kda_head_dim=64, experts_mxfp4=False)


@pytest.fixture(scope="module")
def wide_f32(tmp_path_factory, wide_dir):
    out = tmp_path_factory.mktemp("wide-gguf") / "wide-f32.gguf"
    convert(build_plan(wide_dir, "f32"), out)
    return out


def llama_quantize(src, dst, ftype: str):
    """llama-quantize's own code, in process, with its default parameters (its type mix, not --pure)."""
    import llama_cpp
    return interop.llama_quantize(src, dst, getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}"), pure=False)


Field = tuple[Any, VT, "VT | None"]          # value, type, array element type


def rewrite(src, dst, *, field: Callable[[str, Field], Field] = lambda name, f: f,
            raw: Callable[[str, np.ndarray], np.ndarray] = lambda name, a: a, keys: dict | None = None):
    """src copied through gguf's own writer, every key with its type and every tensor's bytes, with
    `field` and `raw` free to change a key or the stored shape of a tensor's bytes, and `keys`
    (name -> Field, or None) to set, add or drop keys."""
    keys = keys or {}
    r = GGUFReader(src)
    w = GGUFWriter(dst, r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in keys:
            continue
        main = VT(f.types[0])
        w.add_key_value(name, *field(name, (f.contents(), main, VT(f.types[-1]) if main == VT.ARRAY else None)))
    for name, f in keys.items():
        if f is not None:
            w.add_key_value(name, *f)
    for name, t in open_gguf(src).tensors.items():
        data = raw(name, np.array(t.raw))
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=t.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def ggml_n_dims(name: str, raw: np.ndarray) -> np.ndarray:
    """The bytes with the header llama.cpp writes: ggml_n_dims dimensions, i.e. without trailing ggml
    1-dims (leading numpy 1s); the last axis (values, or bytes per row) is the stored one."""
    shape = raw.shape
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return raw.reshape(shape)


def stored_type(path, key: str) -> tuple[VT, VT | None]:
    f = GGUFReader(path).fields[key]
    return VT(f.types[0]), VT(f.types[-1]) if VT(f.types[0]) == VT.ARRAY else None


def with_elements(keys: dict[str, VT]) -> Callable[[str, Field], Field]:
    def field(name: str, f: Field) -> Field:
        if name not in keys:
            return f
        sub = keys[name]
        return [bool(v) if sub == VT.BOOL else int(v) for v in f[0]], VT.ARRAY, sub
    return field


# ------------------------------------------------------------------------------------
# llama-quantize, and llama.cpp's headers

@pytest.mark.interop
@pytest.mark.parametrize("ftype,qtype", [("Q8_0", QT.Q8_0), ("Q4_K_M", QT.Q4_K)])
def test_llama_quantize_output_passes(tmp_path, wide_dir, wide_f32, ftype, qtype):
    q = llama_quantize(wide_f32, tmp_path / f"wide-{ftype}.gguf", ftype)
    gf = open_gguf(q)
    # what this test is about: llama-quantize's headers leave out the trailing ggml 1-dims
    assert gf.tensors["blk.0.ssm_conv1d_q.weight"].shape == (64, 1, 4)          # ours: (1, 64, 1, 4)
    assert gf.tensors["blk.3.attn_k_b.weight"].shape == (16, 16)                # ours: (1, 16, 16)
    assert qtype in {t.qtype for t in gf.tensors.values()}

    res = CliRunner().invoke(app, ["check", str(q), "--length", str(N)])
    assert res.exit_code == 0, res.output

    # every quantized tensor is our quantization of its source, byte for byte, and the runtime matches
    # the reference run on the file's dequantized weights per position (docs/verification.md §3)
    report = verify(q, wide_dir, length=N)
    assert report.ok, failures(report)
    t = report.part("tensors").figures
    assert t["matched"] == t["total"] == len(gf.tensors) and t["by_mode"]["quantized"] > 0
    assert report.tolerance["file_class"] == "quantized"


def test_runtime_reads_ggml_n_dims_headers_as_ours(tmp_path, wide_dir, wide_f32):
    """Same bytes, llama.cpp's headers: the runtime computes the same logits bit for bit, and the file
    passes every part (F32 class, logits per position) against the checkpoint and on its own."""
    squeezed = rewrite(wide_f32, tmp_path / "squeezed.gguf", raw=ggml_n_dims)
    assert open_gguf(squeezed).tensors["blk.3.attn_v_b.weight"].shape == (16, 16)
    ids = token_sequence(open_gguf(wide_f32), N)
    assert np.array_equal(Runtime(squeezed).logits(ids), Runtime(wide_f32).logits(ids))
    for report in (verify(squeezed, wide_dir, length=N), verify(squeezed, length=N)):
        assert report.ok, failures(report)


def test_a_really_different_shape_still_fails(tmp_path, wide_dir, wide_f32):
    """Equal up to leading 1s only: a conv stored as [64, 4] (its middle 1 gone) is another shape."""
    name = "blk.0.ssm_conv1d_q.weight"
    bad = open_gguf(rewrite(wide_f32, tmp_path / "bad.gguf", raw=lambda n, a: a.reshape(64, 4) if n == name else a))
    plan = build_plan(wide_dir, "f32")
    against_checkpoint = check_tensors(Part("tensors", "t"), plan, bad, lambda s: None)
    on_its_own = check_lone_tensors(Part("tensors", "t"), bad, plan.config, lambda s: None)
    for part in (against_checkpoint, on_its_own):
        assert [f.split(":")[0] for f in part.failures] == [name] and "shape [64, 4]" in part.failures[0]


# ------------------------------------------------------------------------------------
# metadata types: per-layer arrays of INT32, UINT32 or BOOL; scalars of exactly one type

PER_LAYER_KEYS = ("kimi-k31.attention.head_count_kv", "kimi-k31.attention.indexer.types")


@pytest.mark.parametrize("element", [VT.INT32, VT.UINT32])
def test_per_layer_arrays_of_either_int_type_pass(tmp_path, converted, k31_dir, element):
    """llama.cpp's converter writes per-layer int arrays as INT32, our earlier files UINT32 (and BOOL for
    indexer.types); the loader reads all of them. (A whole INT32 file against its checkpoint: the
    llama.cpp-conversion test below.)"""
    f = rewrite(converted("k31", "bf16"), tmp_path / f"{element.name}.gguf",
                field=with_elements({k: element for k in PER_LAYER_KEYS}))
    assert [stored_type(f, k) for k in PER_LAYER_KEYS] == [(VT.ARRAY, element)] * 2
    cfg = build_plan(k31_dir, "f32").config
    part = check_metadata(Part("metadata", "m"), cfg.gguf_metadata(), open_gguf(f), cfg.arch, cfg=cfg)
    assert part.ok, part.failures
    report = verify(f, length=N)
    assert report.ok, failures(report)


def test_a_bool_head_count_kv_passes_and_its_values_still_count(tmp_path, converted, k3_dir):
    key = "kimi-k3.attention.head_count_kv"
    as_bool = rewrite(converted("k3", "bf16"), tmp_path / "bool.gguf", field=with_elements({key: VT.BOOL}))
    assert stored_type(as_bool, key) == (VT.ARRAY, VT.BOOL)
    assert verify(as_bool, length=N).part("metadata").ok
    flipped = rewrite(as_bool, tmp_path / "flipped.gguf",
                      field=lambda n, f: ([not v for v in f[0]], *f[1:]) if n == key else f)
    cfg = build_plan(k3_dir, "f32").config
    part = check_metadata(Part("metadata", "m"), cfg.gguf_metadata(), open_gguf(flipped), cfg.arch, cfg=cfg)
    assert [f.split(":")[0] for f in part.failures] == [key]


def test_a_scalar_key_keeps_its_one_type(tmp_path, converted, k3_dir):
    """llama.cpp's get_key takes exactly one type: block_count stored as INT32 does not load, so it fails."""
    key = "kimi-k3.block_count"
    f = rewrite(converted("k3", "bf16"), tmp_path / "i32.gguf",
                field=lambda n, fl: (fl[0], VT.INT32, None) if n == key else fl)
    cfg = build_plan(k3_dir, "f32").config
    part = check_metadata(Part("metadata", "m"), cfg.gguf_metadata(), open_gguf(f), cfg.arch, cfg=cfg)
    assert part.failures == [f"{key}: stored as INT32, llama.cpp reads it only as UINT32"]


# ------------------------------------------------------------------------------------
# llama.cpp's own converter, and llama-quantize on its output

@pytest.mark.interop
def test_llama_quantize_of_llama_cpps_conversion_passes(tmp_path, k3_dir):
    """(llama.cpp's conversion itself: tests/test_upstream_convert.py.) Its per-layer arrays are INT32,
    and llama-quantize copies them verbatim; MXFP4_MOE keeps the (already MXFP4) experts and takes the
    other matrices to Q8_0, so nothing is requantized."""
    upstream = upstream_convert(k3_dir, tmp_path / "upstream-f32.gguf", "f32")
    q = llama_quantize(upstream, tmp_path / "upstream-mxfp4-moe.gguf", "MXFP4_MOE")
    assert stored_type(q, "kimi-k3.attention.head_count_kv") == (VT.ARRAY, VT.INT32)
    assert open_gguf(q).tensors["blk.0.ssm_conv1d_q.weight"].shape == (64, 1, 4)
    report = verify(q, k3_dir, length=N)
    assert report.ok, failures(report)
    assert report.part("tensors").figures["by_mode"]["quantized"] > 0
    assert verify(q, length=N).ok


# ------------------------------------------------------------------------------------
# special token ids: the checkpoint's config, in our files and in llama.cpp's alike

EOS, EOT, UNK = "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.unknown_token_id"
BOS, PAD = "tokenizer.ggml.bos_token_id", "tokenizer.ggml.padding_token_id"


@pytest.fixture(scope="module")
def made_by(tmp_path_factory, converted, k3_dir):
    """maker -> the k3 fixture converted by us or by llama.cpp's convert_hf_to_gguf.py."""
    upstream = upstream_convert(k3_dir, tmp_path_factory.mktemp("upstream-bf16") / "upstream.gguf", "bf16")
    return {"ours": converted("k3", "bf16"), "llama.cpp": upstream}


def config_ids(hf_dir) -> dict:
    """What the checkpoint's own files say, read here from the JSON (not through the converter)."""
    import json
    config = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer_config.json").read_text())
    text = {int(i): e["content"] for i, e in tok["added_tokens_decoder"].items()}
    ids = {kind: config["text_config"][f"{kind}_token_id"] for kind in ("bos", "eos", "pad")}
    return {"ids": ids, "text": text, "id_of": {t: i for i, t in text.items()}}


@pytest.mark.interop
@pytest.mark.parametrize("maker", ["ours", "llama.cpp"])
def test_an_eos_that_is_not_end_of_msg_fails(tmp_path, made_by, k3_dir, maker):
    """The converter bug that makes chat never stop: eos = the tokenizer's [EOS] (kimi-linear's choice), not
    config.json's <|end_of_msg|>. Fails against the checkpoint and on its own, through the CLI (exit 1)."""
    c = config_ids(k3_dir)
    eos, wrong = c["ids"]["eos"], c["id_of"]["[EOS]"]
    assert c["text"][eos] == "<|end_of_msg|>" and open_gguf(made_by[maker]).fields[EOS] == eos
    bad = rewrite(made_by[maker], tmp_path / "eos.gguf", keys={EOS: (wrong, VT.UINT32, None)})
    line = f"{EOS}: {wrong} ('[EOS]'), expected {eos} ('<|end_of_msg|>') from "
    for args, source in (([str(k3_dir), str(bad)], "config.json eos_token_id"), ([str(bad)], "Kimi-K3's tokenizer")):
        res = CliRunner().invoke(app, ["check", *args, "--length", str(N)])
        assert res.exit_code == 1 and line + source in res.output and "FAIL" in res.output, res.output


@pytest.mark.interop
@pytest.mark.parametrize("maker", ["ours", "llama.cpp"])
@pytest.mark.parametrize("case", ["bos is [PAD]", "pad is eos", "eot is [EOS]", "unk outside", "unk not [UNK]",
                                  "eos missing", "eos as INT32"])
def test_every_special_id_is_the_checkpoints(tmp_path, made_by, k3_dir, maker, case):
    """Each special-token key against config.json's id (or, where the config names none, tokenizer_config.json's
    token), and on its own against Kimi-K3's token texts: the key, the id found, the id expected, the texts."""
    c = config_ids(k3_dir)
    bos, eos, pad = (c["ids"][k] for k in ("bos", "eos", "pad"))
    n, unk, eos_tok = len(open_gguf(made_by[maker]).fields["tokenizer.ggml.tokens"]), c["id_of"]["[UNK]"], \
        c["id_of"]["[EOS]"]
    t = c["text"]
    u32 = VT.UINT32
    keys, with_ckpt, alone = {
        "bos is [PAD]": ({BOS: (pad, u32, None)},
                         [f"{BOS}: {pad} ('[PAD]'), expected {bos} ('[BOS]') from config.json bos_token_id"],
                         [f"{BOS}: {pad} ('[PAD]'), expected {bos} ('[BOS]') from Kimi-K3's tokenizer"]),
        "pad is eos": ({PAD: (eos, u32, None)},
                       [f"{PAD}: {eos} ('<|end_of_msg|>'), expected {pad} ('[PAD]') from config.json pad_token_id"],
                       [f"{PAD}: {eos} ('<|end_of_msg|>'), expected {pad} ('[PAD]') from Kimi-K3's tokenizer"]),
        # neither converter writes an eot; one that does must name the turn terminator, the config's eos
        "eot is [EOS]": ({EOT: (eos_tok, u32, None)},
                         [f"{EOT}: {eos_tok} ('[EOS]'), expected {eos} ('<|end_of_msg|>') from config.json eos_token_id"],
                         [f"{EOT}: {eos_tok} ('[EOS]'), expected {eos} ('<|end_of_msg|>') from Kimi-K3's tokenizer"]),
        "unk outside": ({UNK: (n, u32, None)},
                        [f"{UNK}: {n} is outside the vocabulary of {n} tokens, expected {unk} ('[UNK]') from "
                         f"tokenizer_config.json unk_token"],
                        [f"{UNK}: {n} is outside the vocabulary of {n} tokens, expected an id of the vocabulary "
                         f"of {n} tokens"]),
        "unk not [UNK]": ({UNK: (bos, u32, None)},
                          [f"{UNK}: {bos} ('[BOS]'), expected {unk} ('[UNK]') from tokenizer_config.json unk_token"],
                          []),          # Kimi-K3's unk text is not in the references: only its range is checked
        "eos missing": ({EOS: None},
                        [f"{EOS}: missing, expected {eos} ('<|end_of_msg|>') from config.json eos_token_id"],
                        [f"{EOS}: missing, expected {eos} ('<|end_of_msg|>') from Kimi-K3's tokenizer"]),
        "eos as INT32": ({EOS: (eos, VT.INT32, None)},
                         [f"{EOS}: {eos} stored as INT32, llama.cpp reads it only as UINT32; expected {eos} "
                          f"('<|end_of_msg|>') from config.json eos_token_id"],
                         [f"{EOS}: {eos} stored as INT32, llama.cpp reads it only as UINT32; expected {eos} "
                          f"('<|end_of_msg|>') from Kimi-K3's tokenizer"]),
    }[case]
    assert (t[bos], t[pad], t[unk]) == ("[BOS]", "[PAD]", "[UNK]")
    bad = rewrite(made_by[maker], tmp_path / "bad.gguf", keys=keys)
    assert failures(verify(bad, k3_dir, length=N)) == {"metadata": with_ckpt}
    assert failures(verify(bad, length=N)) == ({"metadata": alone} if alone else {})


# ------------------------------------------------------------------------------------
# GGUF strings are UTF-8: every string key and every element of a string array

def string_element_offset(path, key: str, index: int) -> int:
    """File offset of element `index` of the string array `key`, walked here from gguf's own reader's field offset
    (key length, key, type, element type, count, then per string its length and bytes)."""
    f = GGUFReader(path).fields[key]
    with open(path, "rb") as fh:
        fh.seek(f.offset)
        head = fh.read(8)
        at = f.offset + 8 + int.from_bytes(head, "little") + 4 + 4 + 8
        for _ in range(index):
            fh.seek(at)
            at += 8 + int.from_bytes(fh.read(8), "little")
    return at + 8


@pytest.mark.interop
@pytest.mark.parametrize("maker", ["ours", "llama.cpp"])
def test_a_merge_that_is_not_utf8_fails(tmp_path, made_by, k3_dir, maker):
    """One byte of a merge set to 0x80 (a continuation byte where a character starts): the file is no GGUF, whose
    strings are UTF-8. The structure part names the key, the element and the byte's file offset; exit 1."""
    src = made_by[maker]
    merges = open_gguf(src).fields["tokenizer.ggml.merges"]
    index = 99
    at = string_element_offset(src, "tokenizer.ggml.merges", index)
    data = bytearray(src.read_bytes())
    assert data[at:at + len(merges[index].encode())] == merges[index].encode()
    data[at] = 0x80
    bad = tmp_path / "merge.gguf"
    bad.write_bytes(bytes(data))
    line = (f"{bad}: key tokenizer.ggml.merges: element {index} (string {index + 1} of {len(merges)}) is not valid "
            f"UTF-8 (invalid start byte: byte 0x80 at byte 0 of it, file offset {at})")
    for args in ([str(bad)], [str(k3_dir), str(bad)]):
        res = CliRunner().invoke(app, ["check", *args, "--length", str(N)])
        assert res.exit_code == 1 and line in res.output, res.output
    assert failures(verify(bad, length=N)) == {"structure": [line]}
