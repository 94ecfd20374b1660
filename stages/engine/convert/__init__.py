"""Model formats in and out of the engine: Hugging Face (architecture: pipeline.hf_arch; weights: hf)."""
