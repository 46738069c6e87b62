"""Verification: kimi-verify check (check: tensors, metadata, logits, K3.1 indexer, perplexity, cost) and
slice (an N-layer checkpoint cut from a real one)."""
