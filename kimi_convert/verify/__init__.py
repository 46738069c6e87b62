"""Verification: kimi-verify check (check.verify, its parts in report, logits, structure, tensors, weights,
metadata, lone and runs) and slice (an N-layer checkpoint cut from a real one)."""
