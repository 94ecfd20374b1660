"""The RL algorithms' pieces against hand-computed values: advantages, the k3 KL estimator, the clipped loss,
rollout rows (GRPO), GAE and the value loss (PPO), Dr. GRPO's advantages and loss; the algorithm registry."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.rl.grpo import GRPOStep, group_advantages
from engine.rl.policy import clipped_policy_loss, kl_k3
from engine.rl.rollout import PromptStream, rollout_rows, sample_seed


def test_group_advantages_by_hand() -> None:
    # group 1: rewards 1,0,0,1: mean 0.5, population std 0.5 -> +-1; group 2: all equal -> 0
    adv = group_advantages(np.array([1, 0, 0, 1, 1, 1, 1, 1], dtype=np.float32), 4)
    scale = 0.5 / (0.5 + 1e-6)
    np.testing.assert_allclose(adv, [scale, -scale, -scale, scale, 0, 0, 0, 0], rtol=1e-6)
    assert adv.dtype == np.float32
    # rewards 0, 1, 2 (one group of 3): mean 1, std sqrt(2/3)
    std = math.sqrt(2 / 3)
    np.testing.assert_allclose(
        group_advantages(np.array([0.0, 1.0, 2.0]), 3), [-1 / std, 0, 1 / std], rtol=1e-5
    )
    with pytest.raises(ValueError, match="group_size=4"):
        group_advantages(np.zeros(6), 4)


def test_kl_k3_by_hand_and_unbiased() -> None:
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    # d = ref - logp = log 0.5: exp(d) - d - 1 = 0.5 + log 2 - 1
    assert float(kl_k3(logp, ref)) == pytest.approx(0.5 + math.log(2) - 1, abs=1e-7)
    assert float(kl_k3(ref, ref)) == 0.0
    # E_{x~pi}[k3(x)] = KL(pi || ref) exactly, for a categorical pi
    pi = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    expected = float((pi * (pi / q).log()).sum())
    assert float((pi * kl_k3(pi.log(), q.log())).sum()) == pytest.approx(expected, rel=1e-12)


def test_clipped_policy_loss_by_hand() -> None:
    ratio = torch.tensor([1.5, 0.5, 0.5, 1.5, 1.0])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 2.0])
    loss, clipped = clipped_policy_loss(ratio.log(), torch.zeros(5), adv, 0.2)
    # 1.5*1 vs 1.2*1 -> 1.2 (clipped); 0.5 vs 0.8 -> 0.5; -0.5 vs -0.8 -> -0.8 (clipped); -1.5 vs -1.2 -> -1.5
    torch.testing.assert_close(loss, torch.tensor([-1.2, -0.5, 0.8, 1.5, -2.0]))
    assert clipped.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]


def test_grpo_step_loss_by_hand() -> None:
    # two sequences of 3 positions; the loss covers positions 1-2 of the first and position 2 of the second
    logp = torch.log(torch.tensor([[0.9, 0.5, 0.25], [0.9, 0.9, 0.5]]))
    batch = {
        "loss_mask": torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]]),
        "advantages": torch.tensor([1.0, -1.0]),
        "ref_logp": torch.log(torch.tensor([[0.9, 0.25, 0.25], [0.9, 0.9, 0.25]])),
        "old_logp": torch.log(torch.tensor([[0.9, 0.25, 0.25], [0.9, 0.9, 0.25]])),
    }
    step = GRPOStep(beta=0.1, clip_eps=0.2, temperature=1.0)
    loss, n, rep = step.loss_from_logps(batch, logp)
    # ratios (logp / old): seq 1: 2.0 (A=+1 -> min(2, 1.2) = 1.2, clipped), 1.0 (-> 1.0)
    #                      seq 2: 2.0 (A=-1 -> min(-2, -1.2) = -2, not clipped)
    k3_half = 0.5 + math.log(2) - 1  # ref/pi = 0.5 at the two tokens where they differ
    pg = -1.2 - 1.0 + 2.0
    kl = 2 * k3_half + 0.0
    assert int(n) == 3
    assert float(loss) == pytest.approx(pg + 0.1 * kl, abs=1e-6)
    assert rep["kl"].tolist() == pytest.approx([kl, 3.0], abs=1e-6)
    assert rep["clip_frac"].tolist() == pytest.approx([1.0, 3.0])
    assert rep["entropy"].tolist() == pytest.approx([-(math.log(0.5) + math.log(0.25) + math.log(0.5)), 3.0])
    # without old_logp (the first update of a rollout) the ratio is 1: loss = -sum(A) + beta * kl
    del batch["old_logp"]
    loss1, _, rep1 = step.loss_from_logps(batch, logp)
    assert float(loss1) == pytest.approx(-(1 + 1 - 1) + 0.1 * kl, abs=1e-6)
    assert float(rep1["clip_frac"][0]) == 0.0


def test_rollout_rows_mask_the_response_and_eod() -> None:
    rows = rollout_rows([[5, 6], [5]], [[7, 8], [9]], [1, None], seq_length=5, pad=0)
    assert rows["tokens"].tolist() == [[5, 6, 7, 8, 0], [5, 0, 0, 0, 0]]  # the last token is never input
    assert rows["labels"].tolist() == [[6, 7, 8, 1, 0], [9, 0, 0, 0, 0]]
    assert rows["loss_mask"].tolist() == [[0, 1, 1, 1, 0], [1, 0, 0, 0, 0]]
    # a response ended by another stop token (a chat template's end of turn) is closed by that token
    turn = rollout_rows([[5, 6], [5]], [[7], [9, 8]], [3, 1], seq_length=5, pad=0)
    assert turn["labels"].tolist() == [[6, 7, 3, 0, 0], [9, 8, 1, 0, 0]]
    assert turn["loss_mask"].tolist() == [[0, 1, 1, 0, 0], [1, 1, 1, 0, 0]]
    with pytest.raises(ValueError, match="rlhf.max_new_tokens"):
        rollout_rows([[5, 6, 7]], [[1, 2, 3]], [1], seq_length=5, pad=0)


def test_prompt_stream_and_sampler_seed_are_functions_of_the_position() -> None:
    prompts = [[i] for i in range(5)]
    a, b = PromptStream(prompts, 3), PromptStream(prompts, 3)
    first = a.take(0, 12)
    assert sorted(map(tuple, first[:5])) == [(i,) for i in range(5)]  # each epoch is a permutation
    assert b.take(7, 5) == first[7:12]  # a fresh stream at position 7 continues the same order
    assert sample_seed(1, 2) == sample_seed(1, 2) != sample_seed(1, 3)


class _Tok:
    special_ids = {"eod": 0, "pad": 1}

    def decode(self, ids: object) -> str:
        return "".join(chr(ord("0") + int(i) - 10) for i in ids)  # token 10 + d is the digit d


def test_verifier_reward_checks_each_response_against_its_prompts_answer() -> None:
    from engine.rl.rewards import make_reward
    from stages.tasks import is_correct

    reward = make_reward("verifier", tokenizer=_Tok(), answers={(5,): "12", (6,): "3"}, check=is_correct)
    got = reward([[5], [5], [6], [6]], [[11, 12], [11, 13], [13], [13, 0]])
    assert got.dtype == np.float32 and got.tolist() == [1.0, 0.0, 1.0, 0.0]  # a special token: never right
    with pytest.raises(ValueError, match="needs the trained reward model"):
        make_reward("model", tokenizer=_Tok(), answers={}, check=is_correct)
    scores = lambda p, r: np.full(len(p), 0.5, dtype=np.float32)  # noqa: E731  (a reward model's scores)
    both = make_reward("both", tokenizer=_Tok(), answers={(5,): "12"}, check=is_correct, model=scores)
    assert both([[5], [5]], [[11, 12], [11, 13]]).tolist() == [1.5, 0.5]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rlhf.group_size=5"], "rlhf.parallel.global_batch_size=64: must be a multiple of group_size=5"),
        (["rlhf.algorithm=ppo2"], "rlhf.algorithm"),
        (["rlhf.clip_eps=1.5"], "rlhf.clip_eps=1.5"),
        (["rlhf.ppo_epochs=0"], "rlhf.ppo_epochs=0"),
    ],
)
def test_grpo_config_is_validated(overrides: list[str], message: str) -> None:
    from pipeline.schema.compose import load_config
    from pipeline.schema.errors import ConfigError

    assert load_config(["rlhf=grpo"]).rlhf.algorithm == "grpo"
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(["rlhf=grpo", *overrides])


def test_gae_by_hand() -> None:
    from engine.rl.ppo import gae

    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [1.0, 1.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the second row ends after 2 tokens
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.95)
    # row 1: deltas 0.1, 0.1, 0.3 -> A2 = 0.3, A1 = 0.1 + 0.95 * 0.3, A0 = 0.1 + 0.95 * A1
    a1 = 0.1 + 0.95 * 0.3
    torch.testing.assert_close(adv[0], torch.tensor([0.1 + 0.95 * a1, a1, 0.3]))
    torch.testing.assert_close(ret[0], adv[0] + values[0])
    adv2, ret2 = gae(rewards, values, mask, gamma=0.5, lam=0.5)
    # row 2 (gamma = lam = 0.5): delta1 = 2 - 1 = 1, delta0 = 0.5 * 1 - 1 = -0.5 -> A = [-0.5 + 0.25, 1, 0]
    torch.testing.assert_close(adv2[1], torch.tensor([-0.25, 1.0, 0.0]))
    torch.testing.assert_close(ret2[1], torch.tensor([0.75, 2.0, 0.0]))


# ---------------------------------------------------------------------------- PPO


def test_clipped_value_loss_and_value_step_by_hand() -> None:
    from engine.rl.ppo import ValueStep, clipped_value_loss

    values = torch.tensor([[1.0, 0.0, 2.0, 0.5]])
    old = torch.tensor([[0.5, 0.5, 1.0, 0.4]])
    returns = torch.tensor([[0.0, 1.0, 3.0, 0.5]])
    loss, clipped = clipped_value_loss(values, old, returns, 0.2)
    # V=1, clip -> 0.7, R=0: max(1, 0.49) = 1 | V=0, clip -> 0.3, R=1: max(1, 0.49) = 1
    # V=2, clip -> 1.2, R=3: max(1, 3.24) = 3.24 (clipped) | V=0.5 (within the clip), R=0.5: 0
    torch.testing.assert_close(loss, 0.5 * torch.tensor([[1.0, 1.0, 3.24, 0.0]]))
    assert clipped.tolist() == [[0.0, 0.0, 1.0, 0.0]]
    batch = {
        "loss_mask": torch.tensor([[0.0, 1.0, 1.0, 1.0]]),
        "old_values": old,
        "returns": returns,
    }
    total, n, rep = ValueStep(0.2).loss(batch, values)
    assert int(n) == 3 and float(total) == pytest.approx(0.5 * (1.0 + 3.24))
    assert rep["value_loss"].tolist() == pytest.approx([0.5 * 4.24, 3.0])
    assert rep["value_clip_frac"].tolist() == pytest.approx([1.0, 3.0])
    _, _, scored = ValueStep(0.2).loss({"loss_mask": batch["loss_mask"]}, values)  # forward-only scoring
    torch.testing.assert_close(scored["values"], values)


def test_token_rewards_and_gae_on_rollout_rows_by_hand() -> None:
    from engine.rl.ppo import gae, masked_whiten, token_rewards

    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0]])  # responses after 1 and 2 prompt tokens
    logp = torch.tensor([[-9.0, -1.0, -2.0, -9.0], [-9.0, -9.0, -0.5, -9.0]])
    ref = torch.tensor([[-5.0, -1.5, -1.0, -5.0], [-5.0, -5.0, -1.0, -5.0]])
    r = token_rewards(torch.tensor([1.0, 0.0]), mask, logp, ref, beta=0.1)
    # -0.1 * (logp - ref) on response tokens, the score on each row's last one
    torch.testing.assert_close(r, torch.tensor([[0.0, -0.05, 0.1 + 1.0, 0.0], [0.0, 0.0, -0.05, 0.0]]))
    values = torch.tensor([[7.0, 0.2, 0.4, 7.0], [7.0, 7.0, 0.3, 7.0]])  # outside the mask: ignored
    adv, ret = gae(r, values, mask, gamma=1.0, lam=0.9)
    # row 1: delta2 = 1.1 - 0.4 = 0.7, delta1 = -0.05 + 0.4 - 0.2 = 0.15 -> A = [0, 0.15 + 0.9 * 0.7, 0.7, 0]
    torch.testing.assert_close(adv[0], torch.tensor([0.0, 0.15 + 0.63, 0.7, 0.0]))
    torch.testing.assert_close(ret[0], torch.tensor([0.0, 0.78 + 0.2, 1.1, 0.0]))
    torch.testing.assert_close(adv[1], torch.tensor([0.0, 0.0, -0.35, 0.0]))
    # the same rows shifted to start at position 0 give the same advantages (the run need not start at 0)
    shifted, _ = gae(r[:1, 1:], values[:1, 1:], mask[:1, 1:], gamma=1.0, lam=0.9)
    torch.testing.assert_close(shifted[0], adv[0, 1:])
    w = masked_whiten(adv, mask, mean=0.5, std=2.0)
    torch.testing.assert_close(w[1], torch.tensor([0.0, 0.0, (-0.35 - 0.5) / (2.0 + 1e-8), 0.0]))


def test_ppo_step_loss_by_hand() -> None:
    from engine.rl.ppo import PPOStep

    logp = torch.log(torch.tensor([[0.9, 0.5, 0.25]]))
    batch = {
        "loss_mask": torch.tensor([[0.0, 1.0, 1.0]]),
        "advantages": torch.tensor([[5.0, 1.0, -1.0]]),  # per token
        "old_logp": torch.log(torch.tensor([[0.9, 0.25, 0.25]])),
        "ref_logp": torch.log(torch.tensor([[0.9, 0.25, 0.25]])),
    }
    loss, n, rep = PPOStep(clip_eps=0.2).loss_from_logps(batch, logp)
    # ratios 2 (A=+1 -> 1.2, clipped) and 1 (A=-1 -> -1): loss = -1.2 + 1; no KL term (it is in the rewards)
    assert int(n) == 2 and float(loss) == pytest.approx(-0.2, abs=1e-6)
    assert rep["clip_frac"].tolist() == pytest.approx([1.0, 2.0])
    assert float(rep["kl"][0]) == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)


def test_ppo_config_and_a_wrong_algorithm_lists_the_choices() -> None:
    from pipeline.schema.compose import load_config
    from pipeline.schema.errors import ConfigError

    cfg = load_config(["rlhf=ppo"]).rlhf
    assert (cfg.algorithm, cfg.gamma, cfg.lam, cfg.value_clip) == ("ppo", 1.0, 0.95, 0.2)
    with pytest.raises(
        ConfigError,
        match=r"rlhf.algorithm='ppx': must be one of \['dpo', 'grpo', 'ppo', 'dr_grpo', 'dapo', 'gspo'\]",
    ):
        load_config(["rlhf.algorithm=ppx"])
    with pytest.raises(ConfigError, match="rlhf.value_clip=0"):
        load_config(["rlhf=ppo", "rlhf.value_clip=0"])
    with pytest.raises(ConfigError, match="rlhf.lam=1.5"):
        load_config(["rlhf=ppo", "rlhf.lam=1.5"])


def test_dr_grpo_advantages_by_hand() -> None:
    from engine.rl.dr_grpo import dr_group_advantages

    # group 1: rewards 1,0,0,1: mean 0.5 -> +-0.5 (GRPO: +-1, over the std 0.5); group 2: 3,1: mean 2 -> +-1
    adv = dr_group_advantages(np.array([1, 0, 0, 1, 3, 1], dtype=np.float32), 2)
    np.testing.assert_allclose(adv, [0.5, -0.5, -0.5, 0.5, 1.0, -1.0])
    assert adv.dtype == np.float32
    np.testing.assert_allclose(group_advantages(np.array([1.0, 0.0]), 2), [1 / (1 + 2e-6), -1 / (1 + 2e-6)])
    with pytest.raises(ValueError, match="group_size=4"):
        dr_group_advantages(np.zeros(6), 4)


def test_dr_grpo_step_loss_by_hand_differs_from_grpo() -> None:
    from engine.rl.dr_grpo import DrGRPOStep

    # two responses: 2 loss tokens and 1 loss token, max_new_tokens 4; advantages +1 and -1
    logp = torch.log(torch.tensor([[0.9, 0.5, 0.25], [0.9, 0.9, 0.5]]))
    batch = {
        "loss_mask": torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]]),
        "advantages": torch.tensor([1.0, -1.0]),
        "ref_logp": torch.log(torch.tensor([[0.9, 0.25, 0.25], [0.9, 0.9, 0.25]])),
        "old_logp": torch.log(torch.tensor([[0.9, 0.25, 0.25], [0.9, 0.9, 0.25]])),
    }
    beta, L = 0.1, 4
    # per-token terms, from the GRPO test: seq 1: -1.2 + beta * k3, -1.0; seq 2: 2.0 + beta * k3
    k3_half = 0.5 + math.log(2) - 1
    terms = [-1.2 + beta * k3_half, -1.0 + 0.0, 2.0 + beta * k3_half]
    dr_loss, dr_n, dr_rep = DrGRPOStep(beta=beta, clip_eps=0.2, max_new_tokens=L).loss_from_logps(batch, logp)
    # the trainer divides the loss sum by the count: Dr. GRPO's is rows x max_new_tokens = 2 x 4
    assert int(dr_n) == 2 * L
    assert float(dr_loss) / int(dr_n) == pytest.approx(sum(terms) / (2 * L), abs=1e-6)
    assert dr_rep["loss"].tolist() == pytest.approx([sum(terms), 2 * L], abs=1e-6)
    assert dr_rep["kl"].tolist() == pytest.approx([2 * k3_half, 3.0], abs=1e-6)  # still a per-token mean
    g_loss, g_n, _ = GRPOStep(beta=beta, clip_eps=0.2).loss_from_logps(batch, logp)
    assert int(g_n) == 3 and float(g_loss) / int(g_n) == pytest.approx(sum(terms) / 3, abs=1e-6)
    assert float(dr_loss) / int(dr_n) != pytest.approx(float(g_loss) / int(g_n))
    # the gradient: d(loss / count) / d(logp) per token; the same terms, scaled by 1/8 instead of 1/3
    lp = logp.clone().requires_grad_(True)
    loss, n, _ = DrGRPOStep(beta=beta, clip_eps=0.2, max_new_tokens=L).loss_from_logps(batch, lp)
    (loss / n).backward()
    assert lp.grad is not None
    lp_g = logp.clone().requires_grad_(True)
    loss_g, n_g, _ = GRPOStep(beta=beta, clip_eps=0.2).loss_from_logps(batch, lp_g)
    (loss_g / n_g).backward()
    assert lp_g.grad is not None
    torch.testing.assert_close(lp.grad * (2 * L), lp_g.grad * 3)


def test_dr_grpo_config_and_every_declared_algorithm_is_registered() -> None:
    from engine.rl import registry
    from pipeline.schema import rl
    from pipeline.schema.compose import load_config

    cfg = load_config(["rlhf=dr_grpo"]).rlhf
    assert (cfg.algorithm, cfg.group_size, cfg.max_new_tokens) == ("dr_grpo", 8, 6)
    assert load_config(["rlhf=grpo", "rlhf.algorithm=dr_grpo"]).rlhf.algorithm == "dr_grpo"
    for name in rl.NAMES:
        algo = registry.get(name)
        assert algo.name == name
        assert set(rl.algorithm(name).keys) <= {f for f in vars(cfg)}  # declared keys are RLHFStage fields
    step = registry.get("dr_grpo").step(cfg)
    assert (step.name, step.max_new_tokens, step.beta) == ("dr_grpo", 6, cfg.beta)
