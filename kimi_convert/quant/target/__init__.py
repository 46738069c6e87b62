"""--target-size / --target-bpw: every free tensor's type chosen to fit a byte budget, written down as a policy.

The pieces, in the order a run uses them (docs/policy.md, "Choosing types for a size"):
- budget.py: the budget from the command line (bytes of tensor data, or bits per weight), checked before any work;
- units.py: the decisions: one per (layer, projection) of the routed experts (gate and up share one), one per
  other tensor; protected tensors and those a --policy BASE rule names are fixed; each decision's candidate types;
- measure.py: each candidate's imatrix-weighted relative quantization error on sampled rows, with our own
  quantizers, cached beside the output;
- solver.py: per decision the lower convex hull of (bytes, error), one Lagrange multiplier found by bisection,
  then a greedy fill by error saved per byte;
- emit.py: the choice as an ordinary policy (one anchored rule per tensor), which kimi-quantize --policy turns
  into the same file.
"""
