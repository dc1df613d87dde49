"""The worker process: model, paged KV cache, attention, sampler (the only place torch runs)."""
