"""Subprocess worker for the Hugging Face conversion tests: one rank imports a HF directory, runs a forward.

Run through ``engine_worker.launch(world, spec, tmp, script=<this file>)``. SPEC keys: hf_dir, parallel
(ParallelConfig overrides), tokens (a [b, s] list; with dp > 1 data-parallel rank r takes rows r::dp), logits
(an .npy path: written by the rank holding the last pipeline stage's TP rank 0, full vocabulary, unpadded; with
dp > 1 one file per data-parallel rank, ``<stem>.dp<r>.npy``), save_weights (a checkpoint root: save the
imported weights there as iteration 0), out (rank 0's result file).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def forward_logits(chunks: list[Any], tokens: Any, seq: int) -> Any:
    """Full-vocabulary logits [b, s, V] on the last pipeline stage (None elsewhere), through megatron's schedule."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    got: list[Any] = []

    def step(data_iterator: Any, model: Any) -> Any:
        toks = next(data_iterator)
        b, s = toks.shape
        pos = torch.arange(s).unsqueeze(0).expand(b, s)
        out = model(toks, pos, None)

        def loss(output: Any) -> Any:
            got.append(gather_from_tensor_model_parallel_region(output))
            zero = output.sum() * 0
            return zero, torch.tensor(1, dtype=torch.int), {"x": torch.stack([zero, zero])}

        return out, loss

    for c in chunks:
        c.eval()
    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=[iter([tokens]) for _ in chunks] if len(chunks) > 1 else iter([tokens]),
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=1,
            seq_length=seq,
            micro_batch_size=tokens.shape[0],
            forward_only=True,
        )
    return got[0] if got else None


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from engine.models.gpt import build_model
    from engine.models.hf_weights import load_hf
    from engine.runtime import distributed as D
    from pipeline.schema.hf_arch import model_config
    from pipeline.schema.sections import ParallelConfig

    tokens = torch.tensor(spec["tokens"], dtype=torch.long)
    seq = tokens.shape[1]
    model = model_config(Path(spec["hf_dir"]), seq_length=seq)
    b = len(spec["tokens"])
    par = ParallelConfig(**{"micro_batch_size": b, "global_batch_size": b, **spec.get("parallel", {})})
    D.init(par.tp, par.pp, par.vpp, ep=par.ep, etp=par.etp, seed=1, threads=1)
    try:
        chunks = build_model(model, par, model.vocab_size or 0)
        read = load_hf(chunks, Path(spec["hf_dir"]), model)
        if spec.get("save_weights"):
            from engine.checkpoint.save import save

            save(Path(spec["save_weights"]), 0, model_chunks=chunks, optimizer=None, scheduler=None, state={})
        mine = tokens[D.dp_rank() :: D.dp_size()]  # each data-parallel rank its own rows (EP dispatches them)
        logits = forward_logits(chunks, mine, seq)
        if logits is not None and D.tp_rank() == 0 and spec.get("logits"):
            path = Path(spec["logits"])
            if D.dp_size() > 1:
                path = path.with_suffix(f".dp{D.dp_rank()}.npy")
            np.save(path, logits[..., : model.vocab_size].float().numpy())
        return {"read": read, "rank": D.rank()}
    finally:
        D.shutdown()


if __name__ == "__main__":
    from tests.support.engine_worker import serve

    serve(run)
