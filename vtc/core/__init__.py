"""Backend-neutral core: hook specs, method registry, pipeline, `VideoTokens` / `Context`, stats.

Nothing here imports transformers or vLLM; every backend (`vtc.hf`, later vLLM) builds on it.
"""
