"""The converter: checkpoint reading (safetensors headers, index, shard reads), the MXFP4 repack, the vocabulary
and chat template, and the plan-and-stream pass (converter) behind kimi-convert."""
