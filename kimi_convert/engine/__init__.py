"""The streamed engine: a model run layer by layer over every token (kimi-imatrix, kimi-verify kld)."""
