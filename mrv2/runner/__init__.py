"""The Model Runner V2: slot state, staged writes, gathered inputs, KV cache, orchestration."""
