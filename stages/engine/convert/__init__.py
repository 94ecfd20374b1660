"""Model formats in and out of the engine: Hugging Face (hf_config: architecture, hf: weights)."""
