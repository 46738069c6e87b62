#!/usr/bin/env python3
"""What `kimi-quantize --target-size ... --sensitivity kld` costs on a model, from its GGUF's header alone (not a
timing): for each --sensitivity-layers N, the layers measured, the variants (a decision at one of its hull types),
the weight bytes read and the layer passes over the token set.

    python benchmarks/sensitivity_cost.py MODEL.gguf [--tokens 2048] [--hull 5] [--ram 64G,768G]

MODEL.gguf may be the data-less GGUF of the real K3 (`python -m kimi_convert.fixtures.real_size DIR --arch k3
--gguf K3.gguf`). The variants that start at one layer run that layer each, then the layers after it once for all
of them (quant/target/sensitivity.py, costs_of), as many at once as a quarter of the RAM holds (each holds its
token states twice: the stream and every AttnRes bank); every group reads the layers after its start once.
--hull: the types a decision is measured at (its weight errors' lower hull: 4-6 on K3).
"""
from __future__ import annotations

import argparse
import math
from collections import defaultdict
from pathlib import Path

from kimi_convert.gguf_io import open_gguf
from kimi_convert.model import KimiConfig
from kimi_convert.quant.driver import plan_file
from kimi_convert.quant.plan import PlanOptions
from kimi_convert.quant.target.choose import no_base
from kimi_convert.quant.target.sensitivity import layer_passes, sampled_layers
from kimi_convert.quant.target.units import split_decisions
from kimi_convert.sizes import parse_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--tokens", type=int, default=16 * 128, help="tokens measured on (--sensitivity-chunks x 128)")
    ap.add_argument("--hull", type=int, default=5)
    ap.add_argument("--ram", default="64G,768G")
    a = ap.parse_args()
    gf = open_gguf(a.gguf)
    cfg = KimiConfig.from_gguf(gf.fields, gf.paths[0])
    plan = plan_file(gf, no_base(), imatrix=True, options=PlanOptions(allow_requantize=True))
    units = split_decisions(plan, lambda d: True).units
    layer_bytes = defaultdict(int)
    for name, t in gf.tensors.items():
        if name.startswith("blk."):
            layer_bytes[int(name.split(".")[1])] += t.nbytes
    banks = 2 + cfg.n_layer // max(cfg.attn_res_block_size, 1)
    per_variant = 2 * a.tokens * cfg.n_embd * 4 * banks
    print(f"{a.gguf.name}: {cfg.n_layer} layers, {len(units)} decisions, {a.tokens:,} tokens, {a.hull} types each; "
          f"{per_variant / 1e9:.2f} GB of token states a variant; {sum(layer_bytes.values()) / 1e12:.2f} TB of layers")
    for ram in (parse_size(r, "--ram") for r in a.ram.split(",")):
        fit = max(1, int(ram / 4 // per_variant))
        for per_kind in (0, 1, 2, 4):
            sampled = sampled_layers(units, per_kind)
            variants: dict[int, int] = defaultdict(int)        # start layer -> variants
            for u in units:
                il = int(u.key.split(".")[1]) if u.key.startswith("blk.") else None
                if il is None:
                    il = 0 if u.key.startswith("token_embd") else cfg.n_layer
                elif il not in sampled:
                    continue
                variants[il] += a.hull
            read = sum(math.ceil(v / fit) * sum(layer_bytes[j] for j in range(il, cfg.n_layer))
                       for il, v in variants.items())
            _, passes = layer_passes(units, [[None] * a.hull for _ in units], per_kind, cfg.n_layer)
            print(f"RAM {ram / 1e9:4.0f} GB ({fit} variants at once), --sensitivity-layers {per_kind}: "
                  f"{len(sampled)} layers, {sum(variants.values()):,} variants, {read / 1e12:6.1f} TB read, "
                  f"{passes:,} layer passes over the tokens")


if __name__ == "__main__":
    main()
