"""Online RL on the engine: GRPO (group-relative advantages, clipped policy loss, k3 KL to a frozen reference)
and PPO with a critic (GAE).

One global step of ``rlhf.algorithm=grpo`` (``GRPOUnit.updates`` + ``GRPOStep``, run by the one loop):

1. prompts: the next ``P = global_batch_size / group_size`` prompts of the task's prompt stream
   (stages/rlhf.py ``task_prompts``: data_prep's ``rl_train.jsonl``, else the SFT file's prompts; a seeded
   order per epoch; the position is ``step * P``, saved in checkpoints);
2. rollouts: ``group_size`` samples per prompt from the policy (engine.models.generate, KV cache). The
   batch's rows (each prompt's samples contiguous) are split over the data-parallel ranks exactly as the
   trainer splits a batch (``data.sample_range``: rank ``d`` of ``D`` holds rows ``[d * n/D, (d+1) * n/D)``),
   and each data-parallel rank generates only the rows it trains on (its tensor/pipeline-parallel peers
   generate the same rows with it). Seeded by ``sample_seed(seed, step, dp_rank)``: a resumed run on the same
   layout draws the same samples (another data-parallel size draws others);
3. rewards ``r`` (engine.rl.rewards) of each rank's rows, then every row's reward (and length) gathered
   over the data-parallel ranks (``distributed.dp_all_gather``: n scalars), so group statistics and metrics
   are those of the whole batch, whichever ranks a group's rows sit on; advantages
   ``A = (r - mean_g) / (std_g + 1e-6)`` per group (population std; a group with equal rewards has A = 0);
4. scoring: per-token log-probs of the frozen reference (and, with ``ppo_epochs > 1``, of the policy before
   the updates: the "old" log-probs), forward-only;
5. ``ppo_epochs`` optimizer updates over the rollout batch, each minimising, over response tokens (and the
   closing eod when sampled), the token mean of

       -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) + beta * k3,
       ratio = exp(logp - old_logp),   k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1

   (the first update is on-policy: old_logp = logp detached, ratio 1). Log-probs are those of the logits
   divided by ``temperature``, the distribution the samples were drawn from.

Metrics per step (the ``train`` line): ``loss``, ``kl`` (mean k3 per token), ``entropy`` (mean -log pi of
the sampled tokens: a Monte Carlo estimate of the policy's entropy), ``clip_frac`` (share of tokens whose
clipped term is active), ``reward_mean``, ``reward_std``, ``response_len`` (new tokens per response, eod
excluded), all over the whole batch; ``gen_tokens_per_s`` (the batch's new tokens over the slowest rank's
generation time); and the meter's ``time_generate_s`` / ``time_score_s`` next to
``time_fwd_bwd_s`` / ``time_optimizer_s`` (generation vs training time).

``rlhf.algorithm=ppo`` (``PPOUnit`` + ``PPOStep``) adds a trained critic ``V`` (the policy's architecture
with the reward model's scalar head at every token, ``ValueStep``; initialised from the stage's init_from,
the SFT model; its own optimizer and checkpoint part). Steps 1-2 as above; then:

3. scoring (each data-parallel rank its own rows): reference and old policy log-probs, the critic's values
   ``V_old`` at every position whose label is a response token (the value of the prefix before that token);
4. per-token rewards ``r_t = -beta * (old_logp_t - ref_logp_t)`` (the KL penalty, k1, in the rewards) plus
   the sequence's reward on its last token (``token_rewards``); GAE (``gae``, ``rlhf.gamma``, ``rlhf.lam``):
   advantages ``A`` and returns ``R = A + V_old``; ``A`` whitened over all response tokens of the rollout
   (the moments summed over the data-parallel ranks);
5. ``ppo_epochs`` critic updates minimising the token mean of
   ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)`` (c = ``rlhf.value_clip``), then
   ``ppo_epochs`` policy updates of the clipped loss of the per-token ``A`` (no KL term: it is in ``r``).

PPO's extra metrics: ``value_loss``, ``value_clip_frac``, ``value_grad_norm`` (of the critic's last update),
``value_mean`` and ``return_mean`` (over response tokens), ``explained_var`` (1 - Var(R - V_old) / Var(R)),
and ``time_critic_s``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from engine.runtime import distributed as D
from engine.train.steps import Batch, LossOut, _next_batch, _report
from engine.train.units import NamedModel, TrainUnit, as_tensors, local_outputs, run_micro_batches

ADV_EPS = 1e-6

# ---------------------------------------------------------------------------- the math


def group_advantages(rewards: np.ndarray, group_size: int, eps: float = ADV_EPS) -> np.ndarray:
    """GRPO advantages: each reward minus its group's mean, over the group's population std (+ eps).

    ``rewards``: [n_prompts * group_size], each prompt's samples contiguous. Returns float32, same shape.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or r.size % group_size:
        raise ValueError(f"rewards of shape {r.shape}: expected [n * group_size={group_size}]")
    g = r.reshape(-1, group_size)
    adv = (g - g.mean(axis=1, keepdims=True)) / (g.std(axis=1, keepdims=True) + eps)
    return adv.reshape(-1).astype(np.float32)


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens (for PPO with a critic): advantages, returns.

    ``rewards``, ``values``, ``mask``: [b, T]; ``mask`` 1 on each row's tokens (a contiguous run from
    position 0 after alignment, right-padded). The value after a row's last token is 0 (the episode ends):
    delta_t = r_t + gamma * V_{t+1} - V_t, A_t = delta_t + gamma * lam * A_{t+1}, returns = A + V; 0 on padding.
    """
    m = mask.float()
    r, v = rewards.float() * m, values.float() * m
    adv = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    next_value = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]
        running = (delta + gamma * lam * running) * m[:, t]
        adv[:, t] = running
        next_value = v[:, t]
    return adv, (adv + v) * m


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate k3 = exp(ref - logp) - (ref - logp) - 1 (>= 0, unbiased on samples of pi)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def clipped_policy_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip_eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss ``-min(ratio * A, clip(ratio, 1-eps, 1+eps) * A)`` and where the clip is active.

    ``advantages`` broadcasts against ``logp`` ([b, 1] per sequence for GRPO).
    """
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).float()


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, value_clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO value loss ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)`` and where the
    clipped term is the larger (the clip is active)."""
    clipped = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    plain, limited = (values - returns) ** 2, (clipped - returns) ** 2
    return 0.5 * torch.maximum(plain, limited), (limited > plain).float()


def token_rewards(
    scores: torch.Tensor, mask: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, beta: float
) -> torch.Tensor:
    """PPO's per-token rewards [b, s]: ``-beta * (logp - ref_logp)`` on every response token (the KL penalty
    to the reference, k1 estimator, folded into the rewards) plus the sequence's score [b] on its last one."""
    from engine.models.reward import last_index

    m = mask.float()
    r = -beta * (logp.float() - ref_logp.float()) * m
    rows = torch.arange(r.shape[0])
    r[rows, last_index(m)] += scores.float() * (m.sum(-1) > 0)
    return r


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, mean: float, std: float, eps: float = 1e-8
) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` where ``mask`` is 1, else 0 (PPO's advantages, with batch-wide moments)."""
    return (x - mean) / (std + eps) * mask.float()


def token_logps(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log pi(label) per position [b, s] from (tensor-parallel) logits [b, s, vocab / tp] divided by ``temperature``."""
    from megatron.core import tensor_parallel

    scaled = logits.float() / temperature  # a new tensor: megatron's cross entropy works in place
    return -tensor_parallel.vocab_parallel_cross_entropy(scaled, labels)


def _logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Model output: logits [b, s, vocab / tp] on the last pipeline stage, hidden states elsewhere."""
    b, s = tokens.shape
    position_ids = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    return model(tokens, position_ids, None)  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------- steps


class GRPOStep:
    """GRPO's loss on a rollout micro batch: ``tokens``/``labels``/``loss_mask`` [b, s], ``advantages`` [b] (per token [b, s]: PPO),
    ``ref_logp`` [b, s] and, after the first update of a rollout, ``old_logp`` [b, s] (module docstring)."""

    name = "grpo"
    sequences_per_sample = 1
    metric_names: tuple[str, ...] = ("loss", "kl", "entropy", "clip_frac")

    def __init__(self, beta: float = 0.04, clip_eps: float = 0.2, temperature: float = 1.0) -> None:
        if beta < 0 or not 0 < clip_eps < 1 or temperature <= 0:
            raise ValueError(f"beta={beta}, clip_eps={clip_eps}, temperature={temperature}: out of range")
        self.beta, self.clip_eps, self.temperature = beta, clip_eps, temperature

    def __call__(
        self, data_iterator: Iterator[Batch], model: Any
    ) -> tuple[torch.Tensor, Callable[..., LossOut]]:
        batch = _next_batch(data_iterator)
        return _logits(model, batch["tokens"]), partial(self.loss, batch)

    def loss(self, batch: Batch, logits: torch.Tensor) -> LossOut:
        return self.loss_from_logps(batch, token_logps(logits, batch["labels"], self.temperature))

    def loss_from_logps(self, batch: Batch, logp: torch.Tensor) -> LossOut:
        """The loss sum over response tokens, their count and the reported metrics, from log-probs [b, s]."""
        mask = batch["loss_mask"].float()
        old = batch["old_logp"] if "old_logp" in batch else logp.detach()
        adv = batch["advantages"].float()
        pg, clipped = clipped_policy_loss(logp, old, adv[:, None] if adv.dim() == 1 else adv, self.clip_eps)
        kl = kl_k3(logp, batch["ref_logp"])
        loss = ((pg + self.beta * kl if self.beta else pg) * mask).sum()
        n = mask.sum()
        return (
            loss,
            n.to(torch.int),
            {
                "loss": _report(loss, n),
                "kl": _report((kl * mask).sum(), n),
                "entropy": _report((-logp * mask).sum(), n),
                "clip_frac": _report((clipped * mask).sum(), n),
            },
        )


class PPOStep(GRPOStep):
    """PPO's policy loss on a rollout micro batch: the clipped loss of per-token (whitened GAE) ``advantages``
    [b, s] against ``old_logp`` (the policy's log-probs when it sampled), no KL term (the KL penalty is in the
    rewards, ``token_rewards``); ``kl`` reports k3 to ``ref_logp`` as GRPO's does."""

    name = "ppo"

    def __init__(self, clip_eps: float = 0.2, temperature: float = 1.0) -> None:
        super().__init__(beta=0.0, clip_eps=clip_eps, temperature=temperature)


class ValueStep:
    """The critic: per-token values [b, s] (the reward model's head at every position,
    engine.models.reward.token_values). With ``returns`` and ``old_values`` in the batch: the clipped
    value loss over response tokens (``clipped_value_loss``); without: forward-only scoring (``values``)."""

    name = "value"
    sequences_per_sample = 1
    metric_names: tuple[str, ...] = ("value_loss", "value_clip_frac")
    output_key = "values"

    def __init__(self, value_clip: float = 0.2) -> None:
        if value_clip <= 0:
            raise ValueError(f"value_clip={value_clip}: must be > 0")
        self.value_clip = value_clip

    def __call__(
        self, data_iterator: Iterator[Batch], model: Any
    ) -> tuple[torch.Tensor, Callable[..., LossOut]]:
        from engine.models.gpt import unwrap
        from engine.models.reward import token_values

        batch = _next_batch(data_iterator)
        output = _logits(model, batch["tokens"])
        gpt = unwrap(model)
        if gpt.post_process:
            output = token_values(gpt)
        return output, partial(self.loss, batch)

    def loss(self, batch: Batch, values: torch.Tensor) -> LossOut:
        if "returns" not in batch:
            n = torch.tensor(1, dtype=torch.int, device=values.device)
            return values.sum() * 0, n, {"values": values.detach()}
        mask = batch["loss_mask"].float()
        vl, clipped = clipped_value_loss(values, batch["old_values"], batch["returns"], self.value_clip)
        loss = (vl * mask).sum()
        n = mask.sum()
        return (
            loss,
            n.to(torch.int),
            {"value_loss": _report(loss, n), "value_clip_frac": _report((clipped * mask).sum(), n)},
        )


class LogpStep:
    """Forward-only scoring: per-token log-probs [b, s] at ``temperature`` (reported as ``logps``)."""

    name = "logp"
    sequences_per_sample = 1
    metric_names: tuple[str, ...] = ()
    output_key = "logps"

    def __init__(self, temperature: float = 1.0) -> None:
        self.temperature = temperature

    def __call__(
        self, data_iterator: Iterator[Batch], model: Any
    ) -> tuple[torch.Tensor, Callable[..., LossOut]]:
        batch = _next_batch(data_iterator)
        return _logits(model, batch["tokens"]), partial(self.logps, batch["labels"])

    def logps(self, labels: torch.Tensor, logits: torch.Tensor) -> LossOut:
        logp = token_logps(logits, labels, self.temperature).detach()
        n = torch.tensor(1, dtype=torch.int, device=logp.device)
        return logp.sum() * 0, n, {"logps": logp}


def make_online_step(rlhf: Any) -> GRPOStep:
    """The step of ``rlhf.algorithm`` (online algorithms; DPO is engine.train.steps.DPOStep)."""
    if rlhf.algorithm == "grpo":
        return GRPOStep(beta=rlhf.beta, clip_eps=rlhf.clip_eps, temperature=rlhf.temperature)
    if rlhf.algorithm == "ppo":
        return PPOStep(clip_eps=rlhf.clip_eps, temperature=rlhf.temperature)
    raise ValueError(f"rlhf.algorithm={rlhf.algorithm!r}: not an online algorithm (grpo, ppo)")


# ---------------------------------------------------------------------------- rollouts


@dataclass
class PromptStream:
    """Prompts (token ids, ``<|user|>...<|assistant|>``) in a seeded order per epoch; any index >= 0."""

    prompts: list[list[int]]
    seed: int
    _perms: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("prompt stream: no prompts")

    def take(self, start: int, n: int) -> list[list[int]]:
        out = []
        for i in range(start, start + n):
            epoch, j = divmod(i, len(self.prompts))
            if epoch not in self._perms:
                self._perms = {
                    epoch: np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))
                }
            out.append(self.prompts[int(self._perms[epoch][j])])
        return out


def sample_seed(seed: int, step: int, dp_rank: int = 0) -> int:
    """The sampler's seed of data-parallel rank ``dp_rank`` at global step ``step``: a function of (stage seed,
    step, dp_rank), so a resumed run on the same layout redraws alike. Rank 0 keeps ``(seed, step)``: a
    single-rank run draws as it did before rollouts were split over data-parallel ranks."""
    entropy = [seed, step] if dp_rank == 0 else [seed, step, dp_rank]
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0] >> 1)


def rollout_rows(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    stopped: Sequence[bool],
    seq_length: int,
    pad: int,
    eod: int,
) -> dict[str, np.ndarray]:
    """Training rows of prompt + response (+ eod when the sampler stopped on it), right-padded.

    ``tokens``/``labels`` (next token) int64 and ``loss_mask`` float32 [n, seq_length]; the loss covers the
    response tokens and the closing eod.
    """
    n = len(prompts)
    tokens = np.full((n, seq_length), pad, dtype=np.int64)
    labels = np.full((n, seq_length), pad, dtype=np.int64)
    mask = np.zeros((n, seq_length), dtype=np.float32)
    for i, (p, r, s) in enumerate(zip(prompts, responses, stopped)):
        ids = [*p, *r, *([eod] if s else [])]
        if len(ids) > seq_length + 1:
            raise ValueError(
                f"rollout of {len(ids)} tokens exceeds rlhf.seq_length={seq_length} + 1: lower "
                "rlhf.max_new_tokens or raise rlhf.seq_length"
            )
        k = len(ids) - 1
        tokens[i, :k] = ids[:-1]
        labels[i, :k] = ids[1:]
        mask[i, len(p) - 1 : k] = 1.0
    return {"tokens": tokens, "labels": labels, "loss_mask": mask}


@dataclass
class GRPOUnit(TrainUnit):
    """GRPO's unit: the policy (the trainer's) and a frozen ``reference``; rollouts per step (module docstring)."""

    prompts: PromptStream | None = None
    reward: Any = None
    tokenizer: Any = None
    settings: Any = None
    """The rlhf stage config (RLHFStage): group_size, temperature, top_p, max_new_tokens, ppo_epochs."""
    position: int = 0
    """Prompts consumed so far (the prompt stream's position; saved in checkpoints)."""
    generated_rows: int = 0
    """Responses this rank has sampled since it started (its share of each rollout; not checkpointed)."""
    _last: dict[str, float] = field(default_factory=dict, repr=False)

    def _rollout(self, step: int) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """This data-parallel rank's share of the step's rollout (the rows it trains on) and the metrics of
        the whole rollout (per-row rewards and lengths gathered over the data-parallel ranks)."""
        from engine.data.datasets import sample_range
        from engine.models.generate import SamplingParams, generate

        t, st, tok = self._t(), self.settings, self.tokenizer
        assert self.prompts is not None and self.reward is not None
        n = st.parallel.global_batch_size
        g = st.group_size
        start = step * (n // g)  # the stream's position is a function of the step (a skipped step too)
        everyone = [p for p in self.prompts.take(start, n // g) for _ in range(g)]
        own = sample_range(0, n, D.dp_rank(), D.dp_size())  # the rows it trains on (as units.micro_batches)
        rows = everyone[own.start : own.stop]
        params = SamplingParams(
            max_new_tokens=st.max_new_tokens,
            temperature=st.temperature,
            top_p=st.top_p,
            stop_tokens=(tok.eod,),
            seed=sample_seed(st.seed, step, D.dp_rank()),
        )
        t0 = time.perf_counter()
        with t.meter.time("generate"):
            gen = generate(t.chunks, rows, params, vocab_size=tok.vocab_size, pad_id=tok.pad)
        gen_s = time.perf_counter() - t0
        self.generated_rows += len(rows)
        rewards = np.asarray(self.reward(rows, gen.tokens), dtype=np.float32)
        arrays = rollout_rows(rows, gen.tokens, gen.stopped, t.seq_length, tok.pad, tok.eod)
        per_row = np.stack(
            [rewards, [len(x) for x in gen.tokens], [len(x) + s for x, s in zip(gen.tokens, gen.stopped)]], 1
        )
        whole = D.dp_all_gather(per_row)  # [n, 3]: every row's reward, response length, new tokens
        all_rewards = whole[:, 0].astype(np.float32)  # float32 -> float64 -> float32: exact
        self._credit(arrays, all_rewards, own)
        self.position = start + n // g
        return arrays, {
            "reward_mean": float(all_rewards.mean()),
            "reward_std": float(all_rewards.std()),
            "response_len": float(whole[:, 1].mean()),
            "gen_tokens_per_s": float(whole[:, 2].sum()) / max(D.all_reduce_max(gen_s), 1e-9),
        }

    def _credit(self, arrays: dict[str, np.ndarray], rewards: np.ndarray, own: range) -> None:
        """Turn the rollout's rewards (``rewards``: the whole batch) into what the step reads for this rank's
        rows ``own``: GRPO's group-normalised ``advantages`` (group statistics over the whole batch)."""
        arrays["advantages"] = group_advantages(rewards, self.settings.group_size)[own.start : own.stop]

    def _score(self, chunks: list[Any], batches: list[Batch], key: str, step: Any = None) -> None:
        """Forward-only pass of ``chunks`` (in eval mode) over ``batches``; its ``key`` output into each batch."""
        t = self._t()
        step = step or LogpStep(self.settings.temperature)
        modes = [c.training for c in chunks]
        for c in chunks:
            c.eval()
        with torch.no_grad():
            outputs = run_micro_batches(
                chunks,
                step,
                batches,
                seq_length=t.seq_length,
                micro_batch_size=self.settings.parallel.micro_batch_size,
                forward_only=True,
            )
        for c, m in zip(chunks, modes):
            c.train(m)
        for b, v in zip(batches, local_outputs(outputs, step.output_key, batches)):
            b[key] = v

    def _batches(self, arrays: dict[str, np.ndarray]) -> list[Batch]:
        """This data-parallel rank's micro batches of its share of the rollout (``arrays``: its rows only)."""
        mbs = self.settings.parallel.micro_batch_size
        rows = len(arrays["tokens"])
        return [as_tensors({k: v[s : s + mbs] for k, v in arrays.items()}) for s in range(0, rows, mbs)]

    def updates(self, step: int) -> list[list[Batch]]:
        t, st = self._t(), self.settings
        arrays, self._last = self._rollout(step)
        batches = self._batches(arrays)
        with t.meter.time("score"):
            self._score(self.models["reference"].chunks, batches, "ref_logp")
            if st.ppo_epochs > 1:
                self._score(t.chunks, batches, "old_logp")
        return [batches] * st.ppo_epochs

    def metrics(self) -> dict[str, float]:
        return dict(self._last)

    def state(self) -> dict[str, Any]:
        return {"prompt_position": self.position, "sampler_seed": "sample_seed(seed, step, dp_rank)"}

    def load_state(self, state: dict[str, Any]) -> None:
        self.position = int(state.get("prompt_position", 0))


@dataclass
class PPOUnit(GRPOUnit):
    """PPO's unit: the policy (the trainer's), a frozen ``reference`` and a trained ``critic`` (own optimizer,
    schedule and checkpoint part); one global step (the module docstring's PPO part):

    rollouts as GRPO's; scoring: reference and old policy log-probs, the critic's values; per-token rewards
    (``token_rewards``: KL penalty + the score on the last response token); GAE advantages and returns
    (``gae``), advantages whitened over the rollout's response tokens (all data-parallel ranks); then
    ``ppo_epochs`` critic updates (clipped value loss) here, and the trainer's ``ppo_epochs`` policy updates
    (``PPOStep``) over the same micro batches.
    """

    def _credit(self, arrays: dict[str, np.ndarray], rewards: np.ndarray, own: range) -> None:
        # placed on each response's last token once the log-probs are known
        arrays["score"] = rewards[own.start : own.stop]

    def updates(self, step: int) -> list[list[Batch]]:
        t, st = self._t(), self.settings
        critic = self.models["critic"]
        arrays, self._last = self._rollout(step)
        batches = self._batches(arrays)
        with t.meter.time("score"):
            self._score(self.models["reference"].chunks, batches, "ref_logp")
            self._score(t.chunks, batches, "old_logp")
            self._score(critic.chunks, batches, "old_values", ValueStep(st.value_clip))
        for b in batches:
            rewards = token_rewards(b["score"], b["loss_mask"], b["old_logp"], b["ref_logp"], st.beta)
            b["advantages"], b["returns"] = gae(rewards, b["old_values"], b["loss_mask"], st.gamma, st.lam)
        self._last.update(self._whiten(batches))
        with t.meter.time("critic"):
            self._last.update(self._train_critic(critic, batches))
        return [batches] * st.ppo_epochs

    def _whiten(self, batches: list[Batch]) -> dict[str, float]:
        """Whiten the advantages with the moments of all response tokens of the rollout (summed over the
        loss-owning ranks); the critic's metrics of the rollout: ``value_mean``, ``explained_var``."""
        sums = np.zeros(8, dtype=np.float64)
        if D.owns_loss():
            for b in batches:
                m = b["loss_mask"].double()
                a, v, r = (b[k].double() * m for k in ("advantages", "old_values", "returns"))
                d = r - v
                sums += [float(x.sum()) for x in (m, a, a * a, v, r, r * r, d, d * d)]
        n, sa, saa, sv, sr, srr, sd, sdd = D.all_reduce_sum(sums)
        n = max(n, 1.0)
        mean = sa / n
        std = float(np.sqrt(max(saa / n - mean * mean, 0.0)))
        for b in batches:
            b["advantages"] = masked_whiten(b["advantages"], b["loss_mask"], mean, std)
        var_r = srr / n - (sr / n) ** 2
        var_d = sdd / n - (sd / n) ** 2
        return {
            "value_mean": sv / n,
            "return_mean": sr / n,
            "explained_var": float(1 - var_d / var_r) if var_r > 1e-12 else 0.0,
        }

    def _train_critic(self, critic: NamedModel, batches: list[Batch]) -> dict[str, float]:
        """``ppo_epochs`` updates of the critic on the rollout (its own optimizer; its LR schedule advances
        once per global step). Its steps are not judged by nan_policy (the policy's are)."""
        t, st = self._t(), self.settings
        step = ValueStep(st.value_clip)
        sums: dict[str, list[float]] = {}
        grad_norm = None
        for c in critic.chunks:
            c.train()
        for _ in range(st.ppo_epochs):
            for c in critic.chunks:
                c.zero_grad_buffer()
            critic.optimizer.zero_grad()
            outputs = run_micro_batches(
                critic.chunks,
                step,
                batches,
                seq_length=t.seq_length,
                micro_batch_size=st.parallel.micro_batch_size,
                forward_only=False,
            )
            _, grad_norm, _ = critic.optimizer.step()
            for out in outputs:
                for k, v in out.items():
                    acc = sums.setdefault(k, [0.0, 0.0])
                    acc[0] += float(v[0])
                    acc[1] += float(v[1])
        critic.scheduler.step(increment=1)
        out = D.reduce_metrics({k: tuple(sums.get(k, (0.0, 0.0))) for k in step.metric_names})
        out["value_grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        return out


def critic_model(env: Any) -> NamedModel:
    """PPO's critic: the policy's architecture with the reward model's scalar head at every token,
    initialised from the stage's ``init_from`` (the SFT model; the head as drawn by its global name, bias 0),
    trained with its own optimizer (``rlhf.critic_lr``, the policy's schedule shape) and checkpointed as its
    own part (``critic.model`` / ``critic.optimizer``)."""
    import dataclasses

    from engine.models.reward import build
    from engine.rl.reward_model import load_backbone
    from engine.train.trainer import build_optimizer

    st = env.stage
    chunks = build(env.cfg.model, st.parallel, env.tokenizer.vocab_size, trainable=True)
    if env.checkpointer.init_from is not None:
        load_backbone(env.checkpointer.init_from, chunks)
    lr = st.critic_lr if st.critic_lr is not None else st.lr
    optimizer, scheduler = build_optimizer(
        chunks, dataclasses.replace(st, lr=lr, min_lr=min(st.min_lr, lr)), st.parallel
    )
    return NamedModel("critic", chunks, optimizer, scheduler)


def online_unit(
    env: Any,
    prompts: list[str],
    answers: list[str],
    check: Callable[[str, str], bool],
    reward_model: Any = None,
) -> tuple[GRPOUnit, None]:
    """The GRPO (or PPO: ``PPOUnit`` with its critic) unit of a stage (``train_stage(unit=lambda env: online_unit(env, ...))``): the prompt stream
    (``prompts`` with their right ``answers``), the reward (``rlhf.reward``; the verifier applies ``check``)
    and a frozen reference holding the stage's starting weights."""
    from engine.rl.rewards import make_reward

    st, tok = env.stage, env.tokenizer
    ids = [tok.prompt_ids(p) for p in prompts]
    longest = max(len(p) for p in ids)
    if longest + st.max_new_tokens > env.seq_length:
        raise ValueError(
            f"rlhf.max_new_tokens={st.max_new_tokens}: the longest prompt ({longest} tokens) + max_new_tokens "
            f"exceeds rlhf.seq_length={env.seq_length}; lower max_new_tokens or raise seq_length"
        )
    reward = make_reward(
        st.reward,
        tokenizer=tok,
        answers={tuple(p): a for p, a in zip(ids, answers)},
        check=check,
        model=reward_model,  # rlhf.reward=model|both: the frozen reward model (engine.models.reward)
    )
    models = {"reference": NamedModel("reference", env.frozen_model(weights="built"), init="init_from")}
    if st.algorithm == "ppo":
        models["critic"] = critic_model(env)
    unit = (PPOUnit if st.algorithm == "ppo" else GRPOUnit)(
        source=None,
        models=models,
        prompts=PromptStream(ids, st.seed),
        reward=reward,
        tokenizer=tok,
        settings=st,
    )
    return unit, None
