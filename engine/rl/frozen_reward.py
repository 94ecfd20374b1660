"""The trained reward model, frozen, as the RL reward and eval's scorer; loading a backbone into a model with the
reward head (PPO's critic from the SFT model). The head itself: engine.models.reward.

``RewardModel`` loads the reward_model stage's final checkpoint, frozen, and is the callable RL uses:
``reward_model(prompts, responses) -> float32 array`` (token id lists; a trailing eod of a response is
dropped, as in training, where the score is read at the last response token before the eod).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.models.reward import HEAD, build, scores


def load_backbone(init_from: Path, chunks: list[Any]) -> None:
    """Load a GPT checkpoint (or a Hugging Face directory) into a model with the head (PPO's critic from the
    SFT model): the head, which the source lacks, keeps the values it was drawn with."""
    from engine.checkpoint.latest import find_latest
    from engine.checkpoint.layout import MARKER
    from engine.checkpoint.load import load_weights
    from pipeline.schema.hf_arch import is_hf_dir

    if is_hf_dir(init_from):
        from engine.models.hf_weights import load_hf
        from pipeline.schema.hf_arch import model_config

        load_hf(chunks, init_from, model_config(init_from))
        return
    path = init_from if (init_from / MARKER).is_file() else find_latest(init_from)
    if path is None:
        raise ValueError(f"{init_from}: no complete checkpoint there")
    load_weights(path, chunks, fresh=(HEAD,))


class RewardModel:
    """A trained reward model, frozen: ``rm(prompts, responses) -> np.ndarray`` (float32, one score each).

    ``prompts`` / ``responses``: token id lists (the prompt as the model saw it: the run's chat template up
    to its generation prompt).
    Batched forward passes (``batch_size`` sequences) through megatron's forward-only schedule, so any TP/PP
    layout works. The ranks of one model-parallel group (TP x PP) pass the same rows and each gets every
    score; data-parallel ranks may pass different rows (RL scores each rank's own rollouts). Call after
    ``engine.runtime.distributed.init``.
    """

    def __init__(
        self,
        checkpoints: str | Path,
        model_cfg: Any,
        par: Any,
        vocab_size: int,
        *,
        pad_id: int,
        eod_id: int,
        seq_length: int | None = None,
        batch_size: int = 16,
        chunks: list[Any] | None = None,
    ) -> None:
        from engine.checkpoint.latest import find_latest
        from engine.checkpoint.layout import MARKER
        from engine.checkpoint.load import load_weights

        root = Path(checkpoints)
        path = root if (root / MARKER).is_file() else find_latest(root)
        if path is None:
            raise ValueError(f"reward model: no verified checkpoint under {root}")
        self.checkpoint = path
        self.chunks = chunks if chunks is not None else build(model_cfg, par, vocab_size, trainable=False)
        load_weights(path, self.chunks)
        for c in self.chunks:
            c.eval()
            for p in c.parameters():
                p.requires_grad_(False)
        self.pad, self.eod = pad_id, eod_id
        self.seq_length = seq_length or model_cfg.seq_length
        self.batch_size = batch_size

    def rows(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> dict[str, Any]:
        """Right-padded ``tokens`` [n, s] and the index of each sequence's last token ``index`` [n]."""
        if len(prompts) != len(responses):
            raise ValueError(f"reward model: {len(prompts)} prompts but {len(responses)} responses")
        n, s = len(prompts), self.seq_length
        tokens = np.full((n, s), self.pad, dtype=np.int64)
        index = np.zeros(n, dtype=np.int64)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            r = list(r)
            if r and r[-1] == self.eod:
                r = r[:-1]
            ids = (list(p) + r)[-s:]  # the end of a long sequence (its last token is what is scored)
            tokens[i, : len(ids)] = ids
            index[i] = max(len(ids) - 1, 0)
        return {"tokens": tokens, "index": index}

    @torch.no_grad()
    def __call__(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> np.ndarray:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from engine.runtime import distributed as D

        data = self.rows(prompts, responses)
        n = len(data["tokens"])
        out = np.zeros(n, dtype=np.float64)
        bs = self.batch_size
        batches = [{k: torch.from_numpy(v[i : i + bs]) for k, v in data.items()} for i in range(0, n, bs)]
        # the schedule needs equal micro batches: the last one is padded with copies of its first row
        sizes = [len(b["tokens"]) for b in batches]
        for b in batches:
            short = bs - len(b["tokens"])
            if short:
                b.update({k: torch.cat([v, v[:1].expand(short, *v.shape[1:])]) for k, v in b.items()})
        if batches:
            chunks = self.chunks
            outputs = get_forward_backward_func()(
                forward_step_func=_score_step,
                data_iterator=iter(batches) if len(chunks) == 1 else [iter(batches) for _ in chunks],
                model=chunks if len(chunks) > 1 else chunks[0],
                num_microbatches=len(batches),
                seq_length=self.seq_length,
                micro_batch_size=bs,
                forward_only=True,
            )
            if D.owns_loss():
                got = torch.cat([o["scores"][:k] for o, k in zip(outputs, sizes)]).cpu().numpy()
                out[:] = got
        return D.mp_all_reduce_sum(out).astype(np.float32)  # data-parallel ranks may score different rows


def _score_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
    """Forward-only step of ``RewardModel``: scores on the last stage, hidden states elsewhere."""
    from engine.models.gpt import unwrap
    from engine.runtime import distributed as D

    dev = D.device()
    batch = {k: v.to(dev) for k, v in next(data_iterator).items()}
    tokens = batch["tokens"]
    b, s = tokens.shape
    pos = torch.arange(s, device=dev).unsqueeze(0).expand(b, s)
    out = model(tokens, pos, None)
    gpt = unwrap(model)
    if not gpt.post_process:
        return out, _no_loss
    r = scores(gpt, batch["index"])
    return r, _scores_out


def _no_loss(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    return output.sum() * 0, torch.tensor(1, dtype=torch.int, device=output.device), {}


def _scores_out(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    count = torch.tensor(output.shape[0], dtype=torch.int, device=output.device)
    return output.sum() * 0, count, {"scores": output.detach()}
