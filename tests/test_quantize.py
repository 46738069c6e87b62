"""kimi-quantize against llama-quantize's own code (llama_model_quantize of llama-cpp-python 0.3.36, in-process):
`default = "T"` must equal `llama-quantize --pure T`, tensor for tensor (type, shape, bytes) and key for key
(value and value type), for every type, with and without an imatrix, and on MXFP4 input with `exps=mxfp4`;
NVFP4 and Q1_0 as --tensor-type targets, and Q1_0's refusal of a row it has no fallback for.
Fails, never skips, when llama-cpp-python is missing."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader

from kimi_convert.convert.converter import build_plan, convert
from kimi_convert.fixtures.imatrix import k3_entries, write_gguf_imatrix
from kimi_convert.fixtures.make_checkpoint import make_checkpoint
from kimi_convert.gguf_io import Q2_0, open_gguf
from kimi_interop import InteropError, llama_quantize
from kimi_convert.quant.driver import FILE_TYPE, quantize_file
from kimi_convert.quant.imatrix import load_imatrix
from kimi_convert.quant.plan import PlanOptions, QuantizeError
from kimi_convert.quant.policy import parse_policy

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "F16", "BF16", "F32",
         "TQ1_0", "TQ2_0", "MXFP4"]       # MXFP4: llama-quantize --pure MXFP4_MOE
IMATRIX_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]
IMATRIX_KEYS = {"quantize.imatrix.file", "quantize.imatrix.dataset", "quantize.imatrix.entries_count",
                "quantize.imatrix.chunks_count"}      # written by the llama-quantize tool, not by the library call


def policy(text: str):
    return parse_policy(text, "test.toml")


def fields(path) -> dict:
    return {k: ([t.name for t in f.types], f.contents()) for k, f in GGUFReader(path).fields.items()
            if not k.startswith("GGUF.")}


def assert_same_file(ours, theirs, *, key_differences=frozenset()):
    a, b = fields(ours), fields(theirs)
    differing = {k for k in set(a) | set(b) if a.get(k) != b.get(k)}
    assert differing == set(key_differences), {k: (a.get(k), b.get(k)) for k in differing}
    ta, tb = ({t.name: t for t in GGUFReader(p).tensors} for p in (ours, theirs))
    assert set(ta) == set(tb)
    for name, t in ta.items():
        u = tb[name]
        assert (QT(t.tensor_type), t.shape.tolist()) == (QT(u.tensor_type), u.shape.tolist()), name
        x, y = t.data.reshape(-1).view(np.uint8), u.data.reshape(-1).view(np.uint8)
        assert np.array_equal(x, y), f"{name} ({QT(t.tensor_type).name}): {(x != y).sum()} bytes differ"


@pytest.fixture(scope="module")
def k3_bf16(tmp_path_factory):
    """K3 with BF16 experts and rows that are multiples of 256 (KDA head rows of 16 still exercise the fallback)."""
    d = tmp_path_factory.mktemp("quantize")
    hf = make_checkpoint(d / "Kimi-K3-tiny", arch="k3", n_layers=4, experts_mxfp4=False, hidden=256,
                         moe_intermediate_size=256, routed_expert_hidden_size=256, intermediate_size=512, seed=3)
    out = d / "k3-bf16.gguf"
    convert(build_plan(hf, "bf16"), out)
    return out


@pytest.fixture(scope="module")
def k3_imatrix(k3_bf16):
    shapes = {n: t.shape for n, t in open_gguf(k3_bf16).tensors.items()}
    return write_gguf_imatrix(k3_bf16.with_name("k3.imatrix.gguf"), k3_entries(shapes, seed=5), chunk_count=12)


@pytest.mark.interop
@pytest.mark.parametrize("name", TYPES)
def test_default_type_equals_llama_quantize_pure(k3_bf16, tmp_path, name):
    ours = quantize_file(k3_bf16, tmp_path / "ours.gguf", policy(f'default = "{name}"\n')).paths[0]
    theirs = llama_quantize(k3_bf16, tmp_path / "theirs.gguf", int(FILE_TYPE[QT[name]]), pure=True)
    assert_same_file(ours, theirs)


@pytest.mark.interop
@pytest.mark.parametrize("name", IMATRIX_TYPES)
def test_with_imatrix_equals_llama_quantize(k3_bf16, k3_imatrix, tmp_path, name):
    imatrix = load_imatrix(k3_imatrix)
    ours = quantize_file(k3_bf16, tmp_path / "ours.gguf", policy(f'default = "{name}"\n'), imatrix=imatrix).paths[0]
    gf = open_gguf(k3_bf16)
    vectors = {n: v for n in imatrix.names if (v := imatrix.vector(n, gf.tensors[n].shape)) is not None}
    theirs = llama_quantize(k3_bf16, tmp_path / "theirs.gguf", int(FILE_TYPE[QT[name]]), imatrix=vectors)
    assert_same_file(ours, theirs, key_differences=IMATRIX_KEYS)
    written = fields(ours)
    assert written["quantize.imatrix.file"] == (["STRING"], str(k3_imatrix))
    assert written["quantize.imatrix.entries_count"] == (["UINT32"], len(imatrix.names))
    assert written["quantize.imatrix.chunks_count"] == (["UINT32"], 12)
    # the imatrix changed the bytes: without it the file differs
    plain = quantize_file(k3_bf16, tmp_path / "plain.gguf", policy(f'default = "{name}"\n')).paths[0]
    assert open_gguf(plain).tensors["blk.1.ffn_up_exps.weight"].raw.tobytes() != \
        open_gguf(ours).tensors["blk.1.ffn_up_exps.weight"].raw.tobytes()


def assert_same_file_by_our_reader(ours, theirs):
    """assert_same_file for a file gguf's GGUFReader cannot open (a Q2_0 tensor): keys (values and value types),
    tensor types, shapes and bytes through our reader."""
    a, b = open_gguf(ours), open_gguf(theirs)
    keys = {k for k in set(a.fields) | set(b.fields) if not k.startswith("GGUF.")}
    differing = {k for k in keys if (a.types.get(k), np.asarray(a.fields.get(k)).tolist()) !=
                 (b.types.get(k), np.asarray(b.fields.get(k)).tolist())}
    assert not differing, {k: (a.fields.get(k), b.fields.get(k)) for k in differing}
    assert set(a.tensors) == set(b.tensors)
    for name, t in a.tensors.items():
        u = b.tensors[name]
        assert (t.qtype, t.shape) == (u.qtype, u.shape), name
        assert t.raw.tobytes() == u.raw.tobytes(), f"{name} ({t.qtype.name})"


@pytest.mark.interop
def test_q2_0_file_equals_llama_quantize_pure(k3_bf16, tmp_path):
    """Q2_0, which the pinned gguf does not know (gguf_io.qtypes): written by our writer and read by our reader
    as llama-quantize writes it; gguf's own reader refuses both files alike."""
    ours = quantize_file(k3_bf16, tmp_path / "ours.gguf", policy('default = "Q2_0"\n')).paths[0]
    theirs = llama_quantize(k3_bf16, tmp_path / "theirs.gguf", int(FILE_TYPE[Q2_0]), pure=True)
    assert_same_file_by_our_reader(ours, theirs)
    assert open_gguf(ours).tensors["blk.1.ffn_up_exps.weight"].qtype == Q2_0
    assert open_gguf(ours).fields["general.file_type"] == 41               # LLAMA_FTYPE_MOSTLY_Q2_0
    assert "Q2_0" not in QT.__members__, "gguf now lists Q2_0: gguf_io.qtypes.NewerType can go"
    for path in (ours, theirs):
        with pytest.raises(ValueError, match=r"\b42\)? is not a valid GGMLQuantizationType"):
            GGUFReader(path)


@pytest.mark.interop
def test_nvfp4_and_q1_0_tensor_types_equal_llama_quantize(k3_bf16, tmp_path):
    """NVFP4 is no llama-quantize file type, only a --tensor-type target; Q1_0 as one too (its rows must be whole
    blocks of 128: the experts'). The file type is the default's."""
    rules = '[[rules]]\npattern = "ffn_(gate|up)_exps"\ntype = "NVFP4"\n' \
            '[[rules]]\npattern = "ffn_down_exps"\ntype = "Q1_0"\n'
    ours = quantize_file(k3_bf16, tmp_path / "ours.gguf", policy(f'default = "Q8_0"\n{rules}')).paths[0]
    theirs = llama_quantize(k3_bf16, tmp_path / "theirs.gguf", int(FILE_TYPE[QT.Q8_0]),
                            tensor_types=[("ffn_(gate|up)_exps", int(QT.NVFP4)), ("ffn_down_exps", int(QT.Q1_0))])
    assert_same_file(ours, theirs)
    types = {t.name: QT(t.tensor_type) for t in GGUFReader(ours).tensors}
    assert types["blk.1.ffn_up_exps.weight"] == QT.NVFP4 and types["blk.1.ffn_down_exps.weight"] == QT.Q1_0


@pytest.mark.interop
def test_q1_0_refuses_a_row_it_has_no_fallback_for_as_llama_quantize(k3_bf16, tmp_path):
    """This fixture has rows of 64 (attn_output): llama-quantize --pure Q1_0 throws; kimi-quantize refuses in
    one line naming the tensor, before writing anything."""
    with pytest.raises(InteropError, match="no tensor type fallback is defined for type q1_0"):
        llama_quantize(k3_bf16, tmp_path / "theirs.gguf", int(FILE_TYPE[QT.Q1_0]), pure=True)
    with pytest.raises(QuantizeError, match=r"^test\.toml:1: blk\.\d+\.\w+\.weight: row length \d+ .*no tensor type "
                                            r"fallback"):
        quantize_file(k3_bf16, tmp_path / "ours.gguf", policy('default = "Q1_0"\n'))
    assert not (tmp_path / "ours.gguf").exists()


@pytest.mark.interop
def test_mxfp4_experts_copied_as_llama_quantize_exps_mxfp4(tmp_path):
    hf = make_checkpoint(tmp_path / "Kimi-K3-mx", arch="k3", n_layers=4, hidden=256, moe_intermediate_size=256,
                         routed_expert_hidden_size=256, intermediate_size=512, seed=4)
    src = tmp_path / "k3-mx.gguf"
    convert(build_plan(hf, "bf16"), src)
    ours = quantize_file(src, tmp_path / "ours.gguf", policy('default = "Q4_K"\n')).paths[0]
    theirs = llama_quantize(src, tmp_path / "theirs.gguf", int(FILE_TYPE[QT.Q4_K]),
                            tensor_types=[("exps", int(QT.MXFP4))])
    assert_same_file(ours, theirs)
    exps = open_gguf(ours).tensors["blk.1.ffn_gate_exps.weight"]
    assert exps.qtype == QT.MXFP4 and exps.raw.tobytes() == open_gguf(src).tensors[exps.name].raw.tobytes()


def test_k31_indexer_protected_under_a_policy_aimed_at_it(tmp_path):
    hf = make_checkpoint(tmp_path / "Kimi-K3.1-tiny", arch="k31", n_layers=4, hidden=256, q_lora_rank=256,
                         seed=6)
    src = tmp_path / "k31.gguf"
    convert(build_plan(hf, "bf16"), src)
    aimed = policy('default = "Q4_K"\n[[rules]]\npattern = "indexer"\ntype = "Q8_0"\n')
    with pytest.raises(QuantizeError, match=r"--strict: 1 rule\(s\) name protected tensors \(indexer, llama\.cpp\): "
                                            r"test\.toml:3 \('indexer' -> Q8_0\)") as refused:
        quantize_file(src, tmp_path / "strict.gguf", aimed, options=PlanOptions(strict=True))
    assert [line.split("; protected ")[1].split(":")[0] for line in refused.value.details] == ["(indexer)",
                                                                                              "(llama.cpp)"]
    assert not (tmp_path / "strict.gguf").exists()
    result = quantize_file(src, tmp_path / "q.gguf", aimed, options=PlanOptions(allow_requantize=True))
    before, after = open_gguf(src).tensors, open_gguf(result.paths[0]).tensors
    indexer = [n for n in before if ".indexer." in n]
    assert len(indexer) == 5 * len([n for n in before if n.endswith("indexer.proj.weight")]) > 0
    for n in indexer:
        assert after[n].qtype == before[n].qtype and after[n].raw.tobytes() == before[n].raw.tobytes(), n
    assert {c.tensor for c in result.plan.conflicts} >= {n for n in indexer if n.endswith("attn_k.weight")}
    assert after["blk.0.attn_q.weight"].qtype == QT.Q4_K


def test_keep_split_and_split_max_size(k3_bf16, tmp_path):
    """--split-max-size makes llama.cpp-named parts; --keep-split quantizes each part into its own, and the
    parts hold the same tensors, quantized exactly as the single file is."""
    src = tmp_path / "split" / "k3.gguf"
    src.parent.mkdir()
    gf = open_gguf(k3_bf16)
    first = quantize_file(k3_bf16, src, policy('default = "keep"\n'), split_max_size=4_000_000).paths
    assert len(first) > 1 and all("-of-" in p.name for p in first)
    kept = quantize_file(first[0], tmp_path / "q.gguf", policy('default = "Q8_0"\n'), keep_split=True).paths
    assert [p.name.replace("q-", "") for p in kept] == [p.name.replace("k3-", "") for p in first]
    for a, b in zip(first, kept):
        assert GGUFReader(a).fields["split.count"].contents() == GGUFReader(b).fields["split.count"].contents()
        assert [t.name for t in GGUFReader(a).tensors] == [t.name for t in GGUFReader(b).tensors]
    whole = open_gguf(kept[0])
    assert set(whole.tensors) == set(gf.tensors)
    single = quantize_file(k3_bf16, tmp_path / "one.gguf", policy('default = "Q8_0"\n')).paths[0]
    assert all(whole.tensors[n].raw.tobytes() == t.raw.tobytes() for n, t in open_gguf(single).tensors.items())


def _quantize_peak_rss(src, out) -> int:
    """Peak RSS (bytes) of a fresh process that quantizes src to Q8_0, as its own VmHWM: the child's mm is
    new at exec (wait4's ru_maxrss would carry over the forking pytest process's peak)."""
    import subprocess
    import sys
    code = ("import sys\nfrom kimi_convert.quant.driver import quantize_file\n"
            "from kimi_convert.quant.policy import parse_policy\n"
            "quantize_file(sys.argv[1], sys.argv[2], parse_policy('default = \"Q8_0\"', 'test'))\n"
            "print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])\n")
    done = subprocess.run([sys.executable, "-c", code, str(src), str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1]) * 1024


def test_peak_rss_does_not_grow_with_the_file(tmp_path):
    """Rows are read with pread into a reused buffer, never through the memory map, whose touched pages would
    count in the RSS: a file 3x bigger (32 -> 96 BF16 experts, 0.2 -> 0.6 GB) must not raise the peak by more
    than 24 MiB (it grew by ~400 MiB through the map), once the writer's O_DIRECT staging buffers are taken
    out: they are sized to the output (DirectSink.stage_size, 3 x 1/16 of it up to 96 MiB), and are all
    touched by outputs this size."""
    from kimi_convert.gguf_io.writer import DirectSink
    peaks = []
    for n_experts in (32, 96):
        hf = make_checkpoint(tmp_path / f"hf{n_experts}", arch="k3", n_layers=2, experts_mxfp4=False,
                             hidden=1024, moe_intermediate_size=1024, routed_expert_hidden_size=1024,
                             num_experts=n_experts, num_experts_per_token=4, seed=2)
        src, out = tmp_path / f"k3-{n_experts}.gguf", tmp_path / f"q-{n_experts}.gguf"
        convert(build_plan(hf, "bf16"), src)
        peak = _quantize_peak_rss(src, out)
        data = out.stat().st_size - open_gguf(out).parts[0].data_offset
        peaks.append(peak - DirectSink.BUFFERS * DirectSink.stage_size(data))
        assert src.stat().st_size > (2 << 20) * n_experts      # the experts are most of the file
    assert peaks[1] - peaks[0] < 24 << 20, f"peak RSS {peaks[0] >> 20} -> {peaks[1] >> 20} MiB"
