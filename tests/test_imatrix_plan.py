"""The dry run's measured rates (kimi_convert/imatrix/plan.py, also kimi-verify kld's): a rate is the work's, not
the one-off load of the compiled kernels its first call pays (about 0.5 s a process). Counted, that load made the
real K3's expert decoding 11-14 MB/s instead of ~400 and its 100k-token dry run say 62.8 h for 31.6."""
from __future__ import annotations

import time

from gguf import GGMLQuantizationType as QT

from kimi_convert.imatrix.plan import measure_decode_rate, measure_dense_rate

MB = 1 << 20
LOAD = 1.0                   # seconds the first call of a kind sleeps: the kernels' load
WORK = 0.01                  # seconds a call sleeps per MB: the work itself (sleeps only ever run long)


class SlowFirstCall:
    """A weight source of 8 experts of 1 MB and three dense tensors; the first expert and the first dense read
    each pay LOAD once."""

    DENSE = {"blk.0.attn_q_a.weight": 1, "blk.0.attn_output.weight": 4, "blk.0.ffn_gate_inp.weight": 1}

    def __init__(self):
        self.bytes_read, self.loaded, self.calls = 0, set(), []

    def names(self):
        return {"blk.0.ffn_down_exps.weight", *self.DENSE}

    def shape(self, name):
        return (8, 512, 1024)

    def nbytes(self, name):
        return self.DENSE[name] * MB

    def qtype(self, name):
        return QT.F32 if name.endswith("ffn_gate_inp.weight") else QT.BF16

    def _work(self, kind: str, mb: int):
        if kind not in self.loaded:
            self.loaded.add(kind)
            time.sleep(LOAD)
        time.sleep(WORK * mb)
        self.bytes_read += mb * MB

    def expert(self, name, e):
        self.calls.append((name, e))
        self._work("expert", 1)

    def values(self, name):
        self.calls.append((name, None))
        self._work("dense", self.DENSE[name])


def test_the_decode_rate_leaves_out_the_kernels_load():
    src = SlowFirstCall()
    rate = measure_decode_rate(src)
    timed = len(src.calls) - 1
    assert timed >= 1 and [e for _, e in src.calls] == list(range(len(src.calls)))   # distinct experts, in order
    assert rate > timed * MB / LOAD, rate / MB          # counted, the load alone would hold it below this
    assert src.bytes_read == 0                          # a plan reads nothing on the run's account


def test_the_dense_rate_times_the_largest_after_a_small_one_of_its_type():
    src = SlowFirstCall()
    rate = measure_dense_rate(src)
    assert src.calls == [("blk.0.attn_q_a.weight", None), ("blk.0.attn_output.weight", None)]
    assert rate > 4 * MB / LOAD, rate / MB
    assert src.bytes_read == 0
