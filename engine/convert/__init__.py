"""Model formats out of the engine: Hugging Face export (architecture: pipeline.schema.hf_arch; weight table:
engine.models.hf_weights)."""
