"""lm-evaluation-harness on the engine: a registered ``lm_eval`` model backend (``lm.EngineLM``, name
``llm-pipeline``) scoring and generating with the project's megatron-core GPT model."""
