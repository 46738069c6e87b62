"""kimi-verify kld: llama-perplexity's KL divergence on the streamed engine."""
