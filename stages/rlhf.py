"""Preference optimisation (DPO) of the SFT model against itself, frozen, as the reference.

Before training, the starting weights (init_from) score every preference pair the run will use, once,
with a no-grad forward pass; the log-probs are cached in ``out_dir/reference_logps.npy`` so a resumed job
(whose weights are no longer the reference) reuses them. The step then needs only the policy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import PipelineConfig, TrainStage
from pipeline.fsio import atomic_write
from stages.context import StageContext

REFERENCE_FILE = "reference_logps.npy"


def main(cfg: PipelineConfig, ctx: StageContext) -> dict[str, Any]:
    from stages.engine.run import data_dir, train_stage
    from stages.engine.steps import make_step

    def sources(tokenizer: Any, st: TrainStage, seq_length: int, chunks: list, ckpt: Any) -> tuple[Any, Any]:
        from stages.engine.trainer import WithReference

        prefs = _preferences(data_dir(ctx), tokenizer, seq_length, st.seed)
        ref = _reference(ctx.out_dir / REFERENCE_FILE, prefs, st, seq_length, chunks, ckpt)
        return WithReference(prefs, ref, 0), None

    step = make_step(cfg.rlhf.algorithm, beta=cfg.rlhf.beta)
    return train_stage(cfg, ctx, step=step, sources=sources)


def _preferences(d: Path, tokenizer: Any, seq_length: int, seed: int) -> Any:
    """Users' pairs (data.pref_paths, rendered by data_prep) when given, else the generated pref_train.jsonl."""
    from stages.engine.data import preference_source, read_manifest

    chat_file = read_manifest(d, verify=False).get("pref_file")
    if chat_file:
        from stages.engine.chat import chat_preference_source

        return chat_preference_source(d / chat_file, tokenizer, seq_length, seed)
    return preference_source(d / "pref_train.jsonl", tokenizer, seq_length, seed)


def _reference(
    path: Path, prefs: Any, st: TrainStage, seq_length: int, chunks: list, ckpt: Any
) -> np.ndarray:
    """Reference log-probs [iters * G, 2]: from the cache, or computed with the init_from weights."""
    from stages.engine import distributed as D
    from stages.engine.trainer import reference_logps

    rows = st.iters * st.parallel.global_batch_size
    if D.any_rank(not path.is_file()):
        ckpt.load_init_weights(chunks)
        ckpt.init_weights_loaded = True
        ref = reference_logps(chunks, prefs, first_step=0, steps=st.iters, stage=st, seq_length=seq_length)
        if D.is_rank0():
            _save_atomic(path, ref)
        D.barrier()
        return ref
    ref = np.load(path)
    if ref.shape != (rows, 2):
        raise ValueError(
            f"{path}: shape {ref.shape}, expected ({rows}, 2) for rlhf.iters x global_batch_size"
        )
    return ref


def _save_atomic(path: Path, array: np.ndarray) -> None:
    atomic_write(path, lambda f: np.save(f, array), binary=True)
