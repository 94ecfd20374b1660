"""LLM training pipeline: config, stage graph, submission, ledger, reports (no torch imports here)."""
