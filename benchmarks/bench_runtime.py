#!/usr/bin/env python3
"""NumPy runtime benchmark (not a test): tokens/s and peak RSS for one GGUF and sequence length.

    python benchmarks/bench_runtime.py [MODEL.gguf] [--tokens 32] [--top-k K] [--repeats 1] [--seed 0]

Without MODEL it generates the default 8-layer K3 fixture, converts it (F32) and runs that.

Prints the runtime's description and RAM estimate first, then runs `Runtime.logits` on random
token ids (all positions, one prefill) `--repeats` times in this process and reports, per run,
wall time and tokens/s, and at the end:
  * peak RSS from resource.getrusage (ru_maxrss). It counts the file pages the memory map has
    touched, which the kernel can drop at any time, so on a large file it overstates what the
    run needs;
  * peak anonymous RSS (RssAnon of /proc/self/status, sampled every 20 ms): the dequantised
    weights and activations, the number to compare with the estimate.
Also the closest routing decision (a near-tie makes comparisons with llama.cpp fragile) and the
number of routed experts dequantised.
"""
from __future__ import annotations

import argparse
import resource
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kimi_convert.runtime.forward import Runtime  # noqa: E402


def rss_anon_bytes() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakSampler(threading.Thread):
    def __init__(self, period: float = 0.02):
        super().__init__(daemon=True)
        self.period, self.peak, self.stop = period, rss_anon_bytes(), threading.Event()

    def run(self):
        while not self.stop.wait(self.period):
            self.peak = max(self.peak, rss_anon_bytes())


def gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB"


def fixture_model() -> Path:
    import tempfile
    from kimi_convert.fixtures.make_checkpoint import make_checkpoint
    from kimi_convert.convert.converter import build_plan, convert
    work = Path(tempfile.mkdtemp(prefix="bench-runtime-"))
    hf = make_checkpoint(work / "Kimi-K3-tiny", arch="k3")
    convert(build_plan(hf, "f32"), work / "k3-f32.gguf")
    print(f"model: 8-layer K3 fixture converted to {work / 'k3-f32.gguf'}")
    return work / "k3-f32.gguf"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path, nargs="?", help="a kimi-k3/k31 GGUF (default: the 8-layer fixture)")
    ap.add_argument("--tokens", type=int, default=32, help="sequence length (default 32)")
    ap.add_argument("--top-k", type=int, default=None, help="override the K3.1 indexer top_k")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    model = args.model or fixture_model()
    rt = Runtime(model, top_k=args.top_k)
    print(rt.describe())
    print(f"estimated RAM for {args.tokens} tokens: {gib(rt.estimate_ram_bytes(args.tokens))}")
    ids = np.random.default_rng(args.seed).integers(0, rt.cfg.n_vocab, args.tokens)

    sampler = PeakSampler()
    base_anon = sampler.peak
    sampler.start()
    for i in range(args.repeats):
        t0 = time.perf_counter()
        logits = rt.logits(ids)
        dt = time.perf_counter() - t0
        print(f"run {i + 1}: {args.tokens} tokens in {dt:.2f} s = {args.tokens / dt:.2f} tokens/s "
              f"(logits {logits.shape}, finite: {bool(np.isfinite(logits).all())})")
    sampler.stop.set()
    sampler.join()

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"peak RSS (getrusage, incl. mapped file pages): {gib(peak)}")
    print(f"peak anonymous RSS (sampled): {gib(sampler.peak)} (before the run: {gib(base_anon)})")
    closest = rt.routing_margins.smallest()
    if closest:
        kind, il, t, gap = closest
        print(f"closest routing decision: {kind} layer {il} position {t}, gap {gap:.3g}")
    print(f"routed experts dequantised: {len(rt.loaded_experts)}")
    hf_dir = model.parent / "Kimi-K3-tiny"
    if args.model is None and hf_dir.exists():          # baseline in the same run: the torch reference
        from kimi_convert.runtime.reference import ReferenceModel
        ref = ReferenceModel(hf_dir)
        ref.logits(list(ids))                            # warm-up (weights load, torch init)
        t0 = time.perf_counter()
        ref.logits(list(ids))
        ref_dt = time.perf_counter() - t0
        print(f"torch reference on the HF checkpoint: {args.tokens / ref_dt:.2f} tokens/s; "
              f"runtime / reference speed ratio: {ref_dt / dt:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
