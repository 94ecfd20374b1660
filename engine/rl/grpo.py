"""GRPO (``rlhf.algorithm=grpo``): group-relative advantages, clipped policy loss, k3 KL to a frozen reference;
its unit (``GRPOUnit``: rollouts, rewards, scoring) is the base of the other online algorithms (engine.rl.ppo,
engine.rl.dr_grpo).

One global step of ``rlhf.algorithm=grpo`` (``GRPOUnit.updates`` + ``GRPOStep``, run by the one loop):

1. prompts: the next ``P = global_batch_size / group_size`` prompts of the task's prompt stream
   (stages/rlhf.py ``task_prompts``: data_prep's ``rl_train.jsonl`` rendered with the run's chat template up
   to its generation prompt, engine.data.chat; prompts that leave no room for ``max_new_tokens`` are left
   out and counted; a seeded order per epoch; the position is ``step * P``, saved in checkpoints);
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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from engine.data.truncation import Truncation
from engine.rl.policy import LogpStep, ScoreStep, clipped_policy_loss, kl_k3, model_logits, token_logps
from engine.rl.registry import Algorithm, RLInputs, register
from engine.rl.rollout import PromptStream, rollout_rows, sample_seed
from engine.runtime import distributed as D
from engine.train.step import Step
from engine.train.steps import Batch, LossOut, _next_batch, _report
from engine.train.units import NamedModel, TrainUnit, as_tensors, local_outputs, run_micro_batches

ADV_EPS = 1e-6


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


class GRPOStep(Step):
    """GRPO's loss on a rollout micro batch: ``tokens``/``labels``/``loss_mask`` [b, s], ``advantages`` [b] (per token [b, s]: PPO),
    ``ref_logp`` [b, s] and, after the first update of a rollout, ``old_logp`` [b, s] (module docstring)."""

    name = "grpo"
    sequences_per_sample = 1
    metric_names: tuple[str, ...] = ("loss", "kl", "entropy", "clip_frac")

    def __init__(
        self,
        beta: float = 0.04,
        clip_eps: float = 0.2,
        temperature: float = 1.0,
        clip_high: float | None = None,
    ) -> None:
        if beta < 0 or not 0 < clip_eps < 1 or temperature <= 0 or (clip_high is not None and clip_high <= 0):
            raise ValueError(
                f"beta={beta}, clip_eps={clip_eps}, clip_high={clip_high}, temperature={temperature}: out of range"
            )
        self.beta, self.clip_eps, self.temperature = beta, clip_eps, temperature
        self.clip_high = clip_high
        """Upper clip of the ratio (1 + clip_high); None: clip_eps (symmetric)."""

    def __call__(
        self, data_iterator: Iterator[Batch], model: Any
    ) -> tuple[torch.Tensor, Callable[..., LossOut]]:
        batch = _next_batch(data_iterator)
        return model_logits(model, batch["tokens"]), partial(self.loss, batch)

    def loss(self, batch: Batch, logits: torch.Tensor) -> LossOut:
        return self.loss_from_logps(batch, token_logps(logits, batch["labels"], self.temperature))

    def loss_count(self, mask: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """What the loss sum is divided by (summed over micro batches and ranks): GRPO's token mean, the
        number of response tokens ``tokens``."""
        return tokens

    def loss_from_logps(self, batch: Batch, logp: torch.Tensor) -> LossOut:
        """The loss sum over response tokens, their count and the reported metrics, from log-probs [b, s]."""
        mask = batch["loss_mask"].float()
        old = batch["old_logp"] if "old_logp" in batch else logp.detach()
        adv = batch["advantages"].float()
        adv = adv[:, None] if adv.dim() == 1 else adv
        pg, clipped = clipped_policy_loss(logp, old, adv, self.clip_eps, self.clip_high)
        kl = kl_k3(logp, batch["ref_logp"])
        loss = ((pg + self.beta * kl if self.beta else pg) * mask).sum()
        n = mask.sum()
        return policy_loss_out(
            loss, self.loss_count(mask, n), logp, kl, mask, _report((clipped * mask).sum(), n)
        )


def policy_loss_out(
    loss: torch.Tensor,
    count: torch.Tensor,
    logp: torch.Tensor,
    kl: torch.Tensor,
    mask: torch.Tensor,
    clip_frac: torch.Tensor,
) -> LossOut:
    """A policy step's loss sum, its count and the reported metrics: ``loss`` over ``count``, per-token means
    of the k3 ``kl`` and of ``-logp`` over ``mask``, and ``clip_frac`` as the step measures it."""
    n = mask.sum()
    return (
        loss,
        count.to(torch.int),
        {
            "loss": _report(loss, count),
            "kl": _report((kl * mask).sum(), n),
            "entropy": _report((-logp * mask).sum(), n),
            "clip_frac": clip_frac,
        },
    )


@dataclass(frozen=True)
class Sampled:
    """One sampled batch, as ``GRPOUnit._sample`` returns it."""

    arrays: dict[str, np.ndarray]
    """This rank's rows: ``tokens``/``labels``/``loss_mask`` (engine.rl.rollout.rollout_rows)."""
    whole: np.ndarray
    """[n, 3] float64, every row of the batch: reward, response length, new tokens (the stop token counted)."""
    own: range
    """The rows of the batch this data-parallel rank holds."""
    gen_s: float
    """The slowest rank's generation time."""
    stopped: list[bool]
    """Per row of this rank: whether it ended on a stop token (else it ran to max_new_tokens)."""


def rollout_metrics(whole: np.ndarray, gen_s: float) -> dict[str, float]:
    """The ``train`` line's rollout metrics of the rows ``whole`` (``Sampled.whole``) generated in ``gen_s``."""
    return {
        "reward_mean": float(whole[:, 0].astype(np.float32).mean()),
        "reward_std": float(whole[:, 0].astype(np.float32).std()),
        "response_len": float(whole[:, 1].mean()),
        "gen_tokens_per_s": float(whole[:, 2].sum()) / max(gen_s, 1e-9),
    }


@dataclass
class GRPOUnit(TrainUnit):
    """GRPO's unit: the policy (the trainer's) and a frozen ``reference``; rollouts per step (module docstring)."""

    prompts: PromptStream | None = None
    reward: Any = None
    tokenizer: Any = None
    settings: Any = None
    """The rlhf stage config (RLHFStage): group_size, temperature, top_p, max_new_tokens, ppo_epochs."""
    stop_tokens: tuple[int, ...] = ()
    """The tokens that end a response (data_prep's ``stop_token_ids``); the eos when empty."""
    position: int = 0
    """Prompts consumed so far (the prompt stream's position; saved in checkpoints)."""
    generated_rows: int = 0
    """Responses this rank has sampled since it started (its share of each rollout; not checkpointed)."""
    _last: dict[str, float] = field(default_factory=dict, repr=False)

    def _rollout(self, step: int) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """This data-parallel rank's share of the step's rollout (the rows it trains on) and the metrics of
        the whole rollout (per-row rewards and lengths gathered over the data-parallel ranks)."""
        st = self.settings
        n, g = st.parallel.global_batch_size, st.group_size
        start = step * (n // g)  # the stream's position is a function of the step (a skipped step too)
        share = self._sample(start, sample_seed(st.seed, step, D.dp_rank()))
        all_rewards = share.whole[:, 0].astype(np.float32)  # float32 -> float64 -> float32: exact
        self._credit(share.arrays, all_rewards, share.own)
        self.position = start + n // g
        return share.arrays, rollout_metrics(share.whole, share.gen_s)

    def _sample(self, start: int, seed: int) -> Sampled:
        """Sample the batch of prompts ``start..start + P`` x ``group_size``: this rank's rows (``own``), their
        training arrays, and every row's reward, length and new tokens over the data-parallel ranks."""
        from engine.data.datasets import sample_range
        from engine.models.generate import SamplingParams, generate

        t, st, tok = self._t(), self.settings, self.tokenizer
        assert self.prompts is not None and self.reward is not None
        n, g = st.parallel.global_batch_size, st.group_size
        everyone = [p for p in self.prompts.take(start, n // g) for _ in range(g)]
        own = sample_range(0, n, D.dp_rank(), D.dp_size())  # the rows it trains on (as units.micro_batches)
        rows = everyone[own.start : own.stop]
        params = SamplingParams(
            max_new_tokens=st.max_new_tokens,
            temperature=st.temperature,
            top_p=st.top_p,
            stop_tokens=self.stop_tokens or (tok.eod,),
            seed=seed,
        )
        t0 = time.perf_counter()
        with t.meter.time("generate"):
            gen = generate(t.chunks, rows, params, vocab_size=tok.vocab_size, pad_id=tok.pad)
        gen_s = time.perf_counter() - t0
        self.generated_rows += len(rows)
        rewards = self._shape(np.asarray(self.reward(rows, gen.tokens), dtype=np.float32), gen)
        arrays = rollout_rows(rows, gen.tokens, gen.ends, t.seq_length, tok.pad)
        per_row = np.stack(
            [rewards, [len(x) for x in gen.tokens], [len(x) + s for x, s in zip(gen.tokens, gen.stopped)]], 1
        )
        whole = D.dp_all_gather(per_row)  # [n, 3]: every row's reward, response length, new tokens
        return Sampled(arrays, whole, own, D.all_reduce_max(gen_s), gen.stopped)

    def _shape(self, rewards: np.ndarray, gen: Any) -> np.ndarray:
        """This rank's rewards as the algorithm credits them (GRPO: as the reward gives them)."""
        return rewards

    def _credit(self, arrays: dict[str, np.ndarray], rewards: np.ndarray, own: range) -> None:
        """Turn the rollout's rewards (``rewards``: the whole batch) into what the step reads for this rank's
        rows ``own``: GRPO's group-normalised ``advantages`` (group statistics over the whole batch)."""
        arrays["advantages"] = group_advantages(rewards, self.settings.group_size)[own.start : own.stop]

    def _score(
        self, chunks: list[Any], batches: list[Batch], key: str, step: ScoreStep | None = None
    ) -> None:
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


def online_unit(
    env: Any,
    inputs: RLInputs,
    unit_class: type[GRPOUnit] = GRPOUnit,
    models: Callable[[Any], dict[str, NamedModel]] | None = None,
) -> tuple[GRPOUnit, None]:
    """An online algorithm's unit of a stage (``unit_class``, GRPO's by default): the prompt stream
    (``inputs.prompts`` with their right ``inputs.answers``), the reward (``rlhf.reward``; the verifier applies
    ``inputs.check``), a frozen reference holding the stage's starting weights, then ``models(env)`` (PPO's
    critic)."""
    from engine.rl.rewards import make_reward

    st, tok = env.stage, env.tokenizer
    if inputs.check is None:
        raise ValueError(f"rlhf.algorithm={st.algorithm}: online RL reads prompts (no task checker given)")
    ids, answers, cut = _fitting_prompts(env, [tok.encode(p) for p in inputs.prompts], inputs.answers)
    reward = make_reward(
        st.reward,
        tokenizer=tok,
        answers={tuple(p): a for p, a in zip(ids, answers)},
        check=inputs.check,
        model=inputs.reward_model,  # rlhf.reward=model|both: the frozen reward model (engine.models.reward)
    )
    named = {"reference": NamedModel("reference", env.frozen_model(weights="built"), init="init_from")}
    if models is not None:
        named.update(models(env))
    unit = unit_class(
        source=None,
        models=named,
        prompts=PromptStream(ids, st.seed),
        truncation=cut,
        reward=reward,
        tokenizer=tok,
        settings=st,
        stop_tokens=inputs.stop_tokens,
    )
    return unit, None


def _fitting_prompts(
    env: Any, ids: list[list[int]], answers: list[str]
) -> tuple[list[list[int]], list[str], Truncation]:
    """The prompts (token ids) that leave room for a response of ``rlhf.max_new_tokens`` within the stage's
    sequence length, their answers, and how many were left out (checked against the stage's limit)."""
    from engine.data.truncation import stage_limit

    st, seq = env.stage, env.seq_length
    keep = [i for i, p in enumerate(ids) if len(p) + st.max_new_tokens <= seq]
    lost = len(ids) - len(keep)
    cut = Truncation(
        "prompts",
        len(ids),
        lost,
        lost,
        seq,
        needed=max(len(p) for p in ids) + st.max_new_tokens,
        cause=f"leave no room for rlhf.max_new_tokens={st.max_new_tokens} response tokens within "
        f"rlhf.seq_length={seq}",
    )
    stage_limit("rlhf", st.max_truncated_fraction, "or lower rlhf.max_new_tokens").check(cut)
    return [ids[i] for i in keep], [answers[i] for i in keep], cut


ALGORITHM = register(
    Algorithm(
        "grpo",
        step=lambda st: GRPOStep(beta=st.beta, clip_eps=st.clip_eps, temperature=st.temperature),
        unit=online_unit,
    )
)
