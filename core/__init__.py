"""The EngineCore process: scheduler, KV cache manager, executor (pure Python, no torch)."""
