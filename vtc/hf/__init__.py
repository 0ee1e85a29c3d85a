"""The HuggingFace transformers backend: patching a model instance, family adapters, sequence rebuild,
the in-LLM runtime for prefill plugins, vision-tower statistics and pre-pool features."""
