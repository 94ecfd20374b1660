"""The one training engine, on megatron-core: distributed set-up, model, loop, steps, checkpoints, data."""
