"""DAPO and GSPO by hand: the asymmetric clip, overlong shaping, the groups dynamic sampling keeps, the
sequence-level ratio; their presets and keys."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.rl.grpo import GRPOStep


def _batch(mask: list[list[float]], adv: list[float]) -> dict[str, torch.Tensor]:
    """old_logp 0, ref_logp 0: logp is the log-ratio itself."""
    z = torch.zeros(len(mask), len(mask[0]))
    return {
        "loss_mask": torch.tensor(mask),
        "advantages": torch.tensor(adv),
        "old_logp": z,
        "ref_logp": z,
    }


def test_dapo_clips_higher_above_than_below() -> None:
    from engine.rl.dapo import DAPOStep

    # one token each: ratio 1.5 with A = +1 (clipped at 1 + clip_high), ratio 0.5 with A = -1 (at 1 - clip_low)
    logp = torch.log(torch.tensor([[1.5], [0.5]]))
    batch = _batch([[1.0], [1.0]], [1.0, -1.0])
    step = DAPOStep(beta=0.0, clip_eps=0.2, clip_high=0.28)
    loss, n, rep = step.loss_from_logps(batch, logp)
    assert int(n) == 2  # token mean over the batch
    assert float(loss) == pytest.approx(-1.28 + 0.8, abs=1e-6)
    assert rep["clip_frac"].tolist() == pytest.approx([2.0, 2.0])
    sym, _, _ = GRPOStep(beta=0.0, clip_eps=0.2).loss_from_logps(batch, logp)
    assert float(sym) == pytest.approx(-1.2 + 0.8, abs=1e-6)  # GRPO's symmetric clip
    with pytest.raises(ValueError, match="clip_high=-0.1"):
        DAPOStep(clip_eps=0.2, clip_high=-0.1)


def test_overlong_penalty_by_hand() -> None:
    from engine.rl.dapo import overlong_penalty

    # max_new_tokens 6, buffer 2: free up to 4 tokens, then -0.5 per token of the buffer (factor 1)
    got = overlong_penalty(np.array([0, 4, 5, 6]), 6, 2, 1.0)
    np.testing.assert_allclose(got, [0.0, 0.0, -0.5, -1.0])
    assert got.dtype == np.float32
    np.testing.assert_allclose(overlong_penalty(np.array([3, 6]), 6, 0, 1.0), [0.0, 0.0])  # off


def test_dynamic_sampling_keeps_informative_groups_first_in_sampling_order() -> None:
    from engine.rl.dapo import informative_groups, select_groups

    np.testing.assert_array_equal(informative_groups(np.array([1, 1, 0, 1, 0, 0]), 2), [False, True, False])
    # two rounds of 2 groups of 2 rows; rows are numbered by their token
    r1 = ({"tokens": np.array([[0], [1], [2], [3]])}, np.array([[1, 2, 3], [1, 2, 3], [1, 2, 3], [0, 2, 3]]))
    r2 = ({"tokens": np.array([[4], [5], [6], [7]])}, np.array([[0, 2, 3], [0, 2, 3], [1, 2, 3], [0, 2, 3]]))
    batch, whole = select_groups([r1, r2], 2, 2)
    assert batch["tokens"].reshape(-1).tolist() == [2, 3, 6, 7]  # round 1's second group, round 2's second
    assert whole[:, 0].tolist() == [1, 0, 1, 0]
    # too few informative groups: the dropped ones fill up in order
    batch, _ = select_groups([r1], 2, 2)
    assert batch["tokens"].reshape(-1).tolist() == [2, 3, 0, 1]


def test_gspo_ratio_and_clip_are_per_sequence() -> None:
    from engine.rl.gspo import GSPOStep

    # sequence 1: 2 tokens, log-ratios 0.2 and 0.0 -> s = exp(0.1); A = +1, clipped at 1 + 0.05
    # sequence 2: 1 token, log-ratio -0.02 -> s = exp(-0.02) (inside [0.95, 1.05]); A = -1
    logp = torch.tensor([[0.0, 0.2, 0.0], [0.0, 0.0, -0.02]])
    batch = _batch([[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]], [1.0, -1.0])
    step = GSPOStep(beta=0.0, clip_eps=0.05, clip_high=0.05)
    lp = logp.clone().requires_grad_(True)
    loss, n, rep = step.loss_from_logps(batch, lp)
    assert int(n) == 2  # a mean over sequences, not tokens
    assert float(loss) == pytest.approx(-1.05 + math.exp(-0.02), abs=1e-6)
    assert rep["clip_frac"].tolist() == pytest.approx([1.0, 2.0])
    (loss / n).backward()
    assert lp.grad is not None
    # sequence 1 is clipped (no gradient); sequence 2's gradient is spread over its one token: A * s / 1 / 2
    torch.testing.assert_close(lp.grad[0], torch.zeros(3))
    assert float(lp.grad[1, 2]) == pytest.approx(math.exp(-0.02) / 2, abs=1e-6)
    # a row without response tokens counts for nothing
    empty = _batch([[0.0, 0.0, 0.0]], [1.0])
    loss, n, _ = step.loss_from_logps(empty, torch.zeros(1, 3))
    assert int(n) == 0 and float(loss) == 0.0


def test_dapo_and_gspo_presets_and_keys() -> None:
    from engine.rl import registry
    from pipeline.schema.compose import load_config
    from pipeline.schema.errors import ConfigError

    dapo = load_config(["rlhf=dapo"]).rlhf
    assert (dapo.algorithm, dapo.beta, dapo.clip_low, dapo.clip_high, dapo.sampling_rounds) == (
        "dapo",
        0.0,
        0.2,
        0.28,
        3,
    )
    step = registry.get("dapo").step(dapo)
    assert (step.name, step.clip_eps, step.clip_high) == ("dapo", 0.2, 0.28)
    gspo = load_config(["rlhf=gspo"]).rlhf
    step = registry.get("gspo").step(gspo)
    assert (step.name, step.clip_eps, step.clip_high, gspo.ppo_epochs) == ("gspo", 3e-4, 4e-4, 2)
    with pytest.raises(ConfigError, match=r"rlhf.clip_eps=0.1: rlhf.algorithm=dapo does not read it"):
        load_config(["rlhf=dapo", "rlhf.clip_eps=0.1"])
    with pytest.raises(ConfigError, match=r"rlhf.sampling_rounds=2: rlhf.algorithm=gspo does not read it"):
        load_config(["rlhf=gspo", "rlhf.sampling_rounds=2"])
    with pytest.raises(ConfigError, match=r"rlhf.overlong_buffer=7: must be at most max_new_tokens=6"):
        load_config(["rlhf=dapo", "rlhf.overlong_buffer=7"])
    with pytest.raises(ConfigError, match=r"rlhf.beta=0.0: must be > 0 for rlhf.algorithm=dpo"):
        load_config(["rlhf=dpo", "rlhf.beta=0"])
    with pytest.raises(ConfigError, match=r"must be one of \[.*'dapo', 'gspo'\]"):
        load_config(["rlhf.algorithm=dap"])
