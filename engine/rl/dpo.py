"""DPO (``rlhf.algorithm=dpo``): offline preference optimisation against the frozen starting weights.

The frozen reference (a frozen copy of the starting weights, ``init_from``) scores every preference pair the
run will use, once, before training (``reference_logps``); the log-probs are cached in
``out_dir/reference_logps.npy`` so a resumed job reuses them, and the frozen copy is freed. The step
(``DPOStep``) then needs only the policy: micro batches of pairs ``[b, 2, seq]`` plus ``ref_logp`` [b, 2]
(``WithReference``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from engine.data.datasets import sample_range
from engine.rl.registry import Algorithm, RLInputs, register
from engine.runtime import distributed as D
from engine.train.step import Step
from engine.train.steps import Batch, LossOut, _next_batch, _per_token_nll, _report
from engine.train.units import SampleSource, TrainUnit, micro_batches, run_micro_batches
from pipeline.records.files import atomic_write
from pipeline.schema.config import TrainStage

REFERENCE_FILE = "reference_logps.npy"


class DPOStep(Step):
    """Direct preference optimisation against precomputed reference log-probs (``ref_logp``).

    loss = -logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))), log-probs summed over response tokens;
    num_tokens = number of pairs. Chosen and rejected go through the model as one batch of 2b sequences.
    """

    name = "dpo"
    sequences_per_sample = 2
    metric_names: tuple[str, ...] = ("loss", "reward_margin", "pref_acc")

    def __init__(self, beta: float = 0.1) -> None:
        if beta <= 0:
            raise ValueError(f"beta={beta}: must be > 0")
        self.beta = beta

    def __call__(
        self, data_iterator: Iterator[Batch], model: Any
    ) -> tuple[torch.Tensor, Callable[..., LossOut]]:
        batch = _next_batch(data_iterator)
        output = _per_token_nll(model, batch["tokens"].flatten(0, 1), batch["labels"].flatten(0, 1))
        return output, partial(self.loss, batch["loss_mask"], batch["ref_logp"])

    def loss(self, loss_mask: torch.Tensor, ref_logp: torch.Tensor, output: torch.Tensor) -> LossOut:
        logp = sequence_logps(loss_mask, output)
        margin = self.beta * ((logp[:, 0] - ref_logp[:, 0]) - (logp[:, 1] - ref_logp[:, 1]))
        loss = -F.logsigmoid(margin).sum()
        pairs = torch.tensor(logp.shape[0], dtype=torch.int, device=logp.device)
        return (
            loss,
            pairs,
            {
                "loss": _report(loss, pairs),
                "reward_margin": _report(margin.sum(), pairs),
                "pref_acc": _report((margin > 0).float().sum(), pairs),
            },
        )


def sequence_logps(loss_mask: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """Per-sequence log-prob summed over masked tokens: [b, 2] from per-token NLL [2b, s] and mask [b, 2, s]."""
    b = loss_mask.shape[0]
    return -(output.float().reshape(b, 2, -1) * loss_mask.float()).sum(-1)


class ReferenceLogpStep(DPOStep):
    """Forward-only pass of the frozen reference: logs the per-pair log-probs (``logps`` [b, 2])."""

    name = "reference_logp"
    metric_names: tuple[str, ...] = ()

    def __init__(self) -> None:
        super().__init__(beta=1.0)

    def __call__(
        self, data_iterator: Iterator[Batch], model: Any
    ) -> tuple[torch.Tensor, Callable[..., LossOut]]:
        batch = _next_batch(data_iterator)
        output = _per_token_nll(model, batch["tokens"].flatten(0, 1), batch["labels"].flatten(0, 1))
        return output, partial(self.logps, batch["loss_mask"])

    @staticmethod
    def logps(loss_mask: torch.Tensor, output: torch.Tensor) -> LossOut:
        logp = sequence_logps(loss_mask, output).detach()
        pairs = torch.tensor(logp.shape[0], dtype=torch.int, device=logp.device)
        return logp.sum() * 0, pairs, {"logps": logp}


@torch.no_grad()
def reference_logps(
    chunks: list[Any],
    source: SampleSource,
    *,
    first_step: int,
    steps: int,
    stage: TrainStage,
    seq_length: int,
) -> np.ndarray:
    """Log-probs [n, 2] (chosen, rejected) of ``chunks`` for global samples [first_step*G, steps*G).

    A forward-only pass (DPO's frozen reference, before training); every rank gets the array.
    """
    G, mbs = stage.parallel.global_batch_size, stage.parallel.micro_batch_size
    step = ReferenceLogpStep()
    base = first_step * G
    out = np.zeros((max(steps - first_step, 0) * G, 2), dtype=np.float64)
    modes = [c.training for c in chunks]
    for chunk in chunks:
        chunk.eval()
    for s in range(first_step, steps):
        outputs = run_micro_batches(
            chunks,
            step,
            micro_batches(source, s, G, mbs),
            seq_length=seq_length,
            micro_batch_size=mbs * step.sequences_per_sample,
            forward_only=True,
        )
        if D.owns_loss():
            idx = sample_range(s, G, D.dp_rank(), D.dp_size())
            out[idx.start - base : idx.stop - base] = torch.cat([o["logps"] for o in outputs]).cpu().numpy()
    for chunk, mode in zip(chunks, modes):
        chunk.train(mode)
    return D.all_reduce_sum(out.reshape(-1)).reshape(-1, 2)


class WithReference:
    """A preference source with ``ref_logp`` added from precomputed log-probs of samples [offset, offset+n)."""

    def __init__(self, source: SampleSource, ref_logp: np.ndarray, offset: int) -> None:
        self.source, self.ref_logp, self.offset = source, ref_logp, offset

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        j = i - self.offset
        if not 0 <= j < len(self.ref_logp):
            raise IndexError(
                f"sample {i}: no reference log-probs (have [{self.offset}, {self.offset + len(self.ref_logp)}))"
            )
        return {**self.source[i], "ref_logp": self.ref_logp[j].astype(np.float32)}


def dpo_unit(env: Any, inputs: RLInputs) -> tuple[TrainUnit, None]:
    """DPO's unit: the preference pairs, each with the frozen reference's log-probs (cached in out_dir)."""
    from engine.data.chat import train_preferences
    from engine.data.truncation import stage_limit

    st = env.stage
    limit = stage_limit("rlhf", st.max_truncated_fraction)
    prefs = train_preferences(inputs.data_dir, env.tokenizer, env.seq_length, st.seed, limit)
    ref = _reference(env.ctx.out_dir / REFERENCE_FILE, prefs, env)
    return TrainUnit(WithReference(prefs, ref, 0), truncation=prefs.truncation), None


def _reference(path: Path, prefs: Any, env: Any) -> np.ndarray:
    """Reference log-probs [iters * G, 2]: from the cache, or computed by a frozen copy of the init_from weights."""
    st: TrainStage = env.stage
    rows = st.iters * st.parallel.global_batch_size
    if D.any_rank(not path.is_file()):
        reference = env.frozen_model()
        ref = reference_logps(
            reference, prefs, first_step=0, steps=st.iters, stage=st, seq_length=env.seq_length
        )
        del reference
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


ALGORITHM = register(Algorithm("dpo", step=lambda st: DPOStep(beta=st.beta), unit=dpo_unit))
