"""Model formats out of the engine: Hugging Face export (architecture: pipeline.hf_arch; weight table:
stages.engine.hf_weights)."""
