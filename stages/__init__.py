"""One module per stage (data_prep, pretrain, sft, rlhf, eval), each with ``main(cfg, ctx)``, plus the engine."""
