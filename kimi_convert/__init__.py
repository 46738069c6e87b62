"""kimi-convert: Kimi-K3 / K3.1-Pro checkpoints to GGUF, quantized by policy, verified by execution."""
__version__ = "0.1.0"
