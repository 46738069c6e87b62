"""Execution: the NumPy runtime (forward: the K3 forward pass over a GGUF), the products as ggml's CPU backend
computes them (ggml_cpu*), and the torch reference on the checkpoint (reference)."""
