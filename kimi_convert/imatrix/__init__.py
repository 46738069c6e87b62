"""kimi-imatrix: llama-imatrix's importance matrix on the streamed engine."""
