"""Batched sampling on megatron-core GPTModel chunks, with megatron's static KV cache, on the model's device.

One implementation for eval and RL. ``generate(chunks, prompts, SamplingParams(...))`` takes this rank's
model chunks (as ``build_model`` returns them) and token-id prompts of any lengths, and returns the new
tokens of each prompt. Every rank of a model-parallel group calls it with the same prompts; data-parallel
ranks may pass different ones.

How it works:
- Prompts are left-padded to one width. Pad keys are masked out by an explicit attention mask and position
  ids count real tokens only, so a prompt's continuation does not depend on the batch it sits in.
  ``unpad`` turns a left- or right-padded tensor into the prompt lists.
- KV cache: megatron's ``StaticInferenceContext`` passed as ``inference_context`` to ``GPTModel.forward``
  (one per model chunk): the prompt is encoded once (prefill), then each step feeds one token per sequence.
  ``use_cache=False`` recomputes the whole sequence every step (the reference the cache is tested against).
- Tensor parallel: logits are gathered over the TP group (``runtime_gather_output=True``); every TP rank
  samples the same token from the same seeded generator.
- Pipeline parallel (and virtual stages): each model chunk receives its hidden states from the previous
  stage and sends its output to the next one (``torch.distributed`` send/recv around the pipeline ring);
  the last stage samples and broadcasts the tokens over the pipeline group, so every rank agrees on when
  the batch is done.
- Sampling: greedy (``temperature=0``) or temperature with top-k/top-p, from a ``torch.Generator`` on the
  model's device seeded with ``seed``: the same seed gives the same samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from engine.models.gpt import model_config, unwrap
from engine.runtime import distributed as D


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    """0: greedy (argmax); otherwise logits are divided by it before sampling."""
    top_k: int = 0
    """Sample among the k most likely tokens (0: all)."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p (1: all)."""
    stop_tokens: tuple[int, ...] = ()
    """A sequence ends when it samples one of these (the stop token is not returned)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be >= 0")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}: must be >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")


@dataclass
class Generation:
    """New tokens per prompt (stop token excluded), whether a stop token ended the sequence, and which."""

    tokens: list[list[int]] = field(default_factory=list)
    ends: list[int | None] = field(default_factory=list)
    """The stop token that ended each sequence (None: it ran to max_new_tokens)."""

    @property
    def stopped(self) -> list[bool]:
        return [e is not None for e in self.ends]


def unpad(tokens: torch.Tensor, lengths: Sequence[int], side: str = "right") -> list[list[int]]:
    """Prompt lists from a [b, s] tensor padded on ``side`` ('left' or 'right') with real ``lengths``."""
    if side not in ("left", "right"):
        raise ValueError(f"side={side!r}: must be 'left' or 'right'")
    width = tokens.shape[1]
    rows = tokens.tolist()
    return [r[:n] if side == "right" else r[width - n :] for r, n in zip(rows, lengths)]


def _sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> torch.Tensor:
    """[b, vocab] float logits -> [b] token ids.

    Top-k and top-p work on the candidates only: the k best (``topk``, ties in its order) or, top-p alone, every
    token in descending order; the sample is drawn among them and mapped back to its id (no full-vocabulary
    sort, scatter and second softmax at each step)."""
    if p.temperature == 0 or p.top_k == 1:
        return logits.argmax(-1)
    logits = logits / p.temperature
    if p.top_k == 0 and p.top_p == 1:
        return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen).squeeze(-1)
    if p.top_k > 0:
        vals, ids = torch.topk(logits, min(p.top_k, logits.shape[-1]), dim=-1)  # descending
    else:
        vals, ids = torch.sort(logits, descending=True, dim=-1)
    if p.top_p < 1:
        probs = torch.softmax(vals, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the strictly more likely candidates
        vals = vals.masked_fill(before >= p.top_p, float("-inf"))
    pick = torch.multinomial(torch.softmax(vals, dim=-1), 1, generator=gen)
    return ids.gather(-1, pick).squeeze(-1)


class _Runner:
    """One forward of the whole (possibly pipelined) model on [b, s] tokens; logits on the last stage."""

    def __init__(self, chunks: list[Any], batch: int, max_len: int, use_cache: bool) -> None:
        self.chunks = chunks
        self.config = model_config(chunks)
        self.device = next(unwrap(chunks[0]).parameters()).device
        self.contexts: list[Any] = []
        if use_cache:
            from megatron.core.inference.contexts import StaticInferenceContext

            self.contexts = [StaticInferenceContext(batch, max_len) for _ in chunks]
        self.pp = D.pp_size()

    def forward(
        self,
        tokens: torch.Tensor,
        pos: torch.Tensor,
        mask: torch.Tensor | None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        b, s = tokens.shape
        h = self.config.hidden_size
        n = len(self.chunks)
        out = None
        for v, chunk in enumerate(self.chunks):
            vp = v if n > 1 else None
            model = unwrap(chunk)
            first = D.is_first_stage(vp) if n > 1 else D.is_first_stage()
            last = D.is_last_stage(vp) if n > 1 else D.is_last_stage()
            if not first:
                hidden = torch.empty(s, b, h, dtype=self.config.pipeline_dtype, device=self.device)
                dist.recv(hidden, src=D.pp_prev_rank())
                model.set_input_tensor(hidden)
            else:
                model.set_input_tensor(None)
            # with labels the loss is computed from TP-sharded logits (a gathered copy would be taken for one shard)
            kwargs: dict[str, Any] = {"runtime_gather_output": True} if labels is None else {"labels": labels}
            if self.contexts:
                kwargs["inference_context"] = self.contexts[v]
            out = chunk(tokens, pos, mask, **kwargs)
            if not last:
                dist.send(out.to(self.config.pipeline_dtype).contiguous(), dst=D.pp_next_rank())
                out = None
        for ctx in self.contexts:
            ctx.sequence_len_offset += s
        return out  # [b, s or 1, padded vocab] on the last stage


def forward_logits(
    chunks: list[Any], tokens: torch.Tensor, pos: torch.Tensor, labels: torch.Tensor | None = None
) -> torch.Tensor | None:
    """One causal forward of the whole (possibly pipelined) model on [b, s] ``tokens`` without a cache: the
    logits (gathered over TP, [b, s, padded vocab]) on the last pipeline stage, None on the others; with
    ``labels`` [b, s], megatron's per-token loss [b, s] instead. Every rank of the model-parallel group calls it
    with the same tokens."""
    runner = _Runner(chunks, tokens.shape[0], tokens.shape[1], use_cache=False)
    return runner.forward(tokens, pos, None, labels=labels)


def generate(
    chunks: list[Any],
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    vocab_size: int | None = None,
    pad_id: int = 0,
    use_cache: bool = True,
) -> Generation:
    """Continue each prompt (token ids, any lengths, none empty); see the module docstring.

    ``vocab_size``: the tokenizer's size: ids beyond it are never sampled (a Hugging Face model's spare rows;
    the padded vocabulary entries are never sampled anyway: their logits are -inf, engine.models.gpt's
    ``mask_padded_vocab``). The prompt plus ``max_new_tokens`` must fit in the model's position embeddings.
    """
    if not prompts:
        return Generation()
    if any(len(p) == 0 for p in prompts):
        raise ValueError("prompts: every prompt needs at least one token")
    model0 = unwrap(chunks[0])
    max_positions = int(getattr(model0, "max_sequence_length", 0) or 0)
    width = max(len(p) for p in prompts)
    total = width + params.max_new_tokens
    if max_positions and model0.position_embedding_type == "learned_absolute" and total > max_positions:
        raise ValueError(
            f"max_new_tokens={params.max_new_tokens}: longest prompt ({width}) + new tokens = {total} "
            f"exceeds the model's {max_positions} positions; shorten the prompts or max_new_tokens"
        )
    if model_config(chunks).sequence_parallel:
        raise ValueError("parallel.sequence_parallel=true: generation needs it off (one token per step)")
    modes = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    try:
        return _generate(chunks, prompts, params, vocab_size, pad_id, use_cache, width, total)
    finally:
        for c, m in zip(chunks, modes):
            c.train(m)


def _generate(
    chunks: list[Any],
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    vocab_size: int | None,
    pad_id: int,
    use_cache: bool,
    width: int,
    total: int,
) -> Generation:
    runner = _Runner(chunks, len(prompts), total, use_cache)
    dev = runner.device
    b = len(prompts)
    tokens = torch.full((b, total), pad_id, dtype=torch.long, device=dev)
    valid = torch.zeros((b, total), dtype=torch.bool, device=dev)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p) : width] = torch.tensor(list(p), dtype=torch.long, device=dev)
        valid[i, width - len(p) : width] = True
    pos_all = (valid.long().cumsum(-1) - 1).clamp(min=0)
    causal = torch.tril(torch.ones(total, total, dtype=torch.bool, device=dev))
    eye = torch.eye(total, dtype=torch.bool, device=dev)
    gen = (
        None if params.temperature == 0 else torch.Generator(device=dev).manual_seed(params.seed)
    )  # greedy: none
    stop = torch.tensor(list(params.stop_tokens) or [-1], dtype=torch.long, device=dev)
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    ended_on = torch.full((b,), -1, dtype=torch.long, device=dev)  # the stop token of each row; -1: none yet
    new_len = torch.zeros(b, dtype=torch.long, device=dev)
    is_last = D.is_last_stage()
    cur = width
    with torch.no_grad():
        for step in range(params.max_new_tokens):
            start = cur - 1 if use_cache and step > 0 else 0
            # allowed[q, k]: causal, and the key is a real token (pad queries see themselves only)
            allowed = causal[start:cur, :cur] & (valid[:, None, :cur] | eye[start:cur, :cur])
            mask = ~allowed[:, None]  # [b, 1, sq, sk], True = masked
            logits = runner.forward(tokens[:, start:cur], pos_all[:, start:cur], mask)
            nxt = torch.empty(b, dtype=torch.long, device=dev)
            if is_last:
                assert logits is not None
                last = logits[:, -1, : vocab_size or logits.shape[-1]].float()
                nxt = _sample(last, params, gen)
            if runner.pp > 1:
                dist.broadcast(nxt, src=D.pp_last_rank(), group=D.pp_group())
            hit = torch.isin(nxt, stop) & ~done
            ended_on = torch.where(hit, nxt, ended_on)
            done |= hit
            nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
            new_len += (~done).long()
            tokens[:, cur] = nxt
            valid[:, cur] = True  # the position exists for every row (finished rows are ignored)
            pos_all[:, cur] = pos_all[:, cur - 1] + 1
            cur += 1
            if bool(done.all()):
                break
    out = tokens[:, width:cur].tolist()
    lens = new_len.tolist()
    ends = [e if e >= 0 else None for e in ended_on.tolist()]
    return Generation([o[:n] for o, n in zip(out, lens)], ends)
