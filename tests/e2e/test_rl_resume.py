"""GRPO and PPO through the command line: a rollout stage killed mid-run resumes bit for bit; Dr. GRPO trains.

The SFT model comes from one short data_prep -> pretrain -> sft run (counting up to 9, so sampled answers
are sometimes right and the rewards vary); each scenario copies it and runs only the rlhf stage with
``rlhf=grpo`` (two updates per rollout, so the old log-probs path runs too), or ``rlhf.algorithm=ppo``
(the policy and a trained critic, each with its own checkpoint part).
"""

from __future__ import annotations

import json
import os
import signal
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from tests.support import cli
from tests.support.timing import scaled

BASE = [
    "experiment=tiny",
    "rlhf=grpo",
    "data.max_operand=9",
    "data.num_eval_examples=2",
    "eval.num_task_examples=2",
    "sft.iters=60",
    "sft.lr=5e-3",
    "sft.min_lr=5e-4",
    "sft.parallel.global_batch_size=16",
    "sft.warmup_iters=2",
    "sft.seq_length=32",
    "rlhf.iters=6",
    "rlhf.save_interval=2",
    "rlhf.warmup_iters=1",
    "rlhf.lr=1e-3",
    "rlhf.min_lr=1e-4",
    "rlhf.group_size=4",
    "rlhf.max_new_tokens=4",
    "rlhf.ppo_epochs=2",
    "rlhf.parallel.global_batch_size=8",
    "rlhf.parallel.micro_batch_size=4",
    "rlhf.hang_timeout_s=120",
    "rlhf.log_interval=1",
]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


run = partial(cli.run, base=BASE)
run_dir = cli.run_dir


def rlhf_dir(root: Path) -> Path:
    return run_dir(root) / "stages" / "rlhf"


def final_tensors(root: Path) -> dict[str, torch.Tensor]:
    from engine.checkpoint.latest import find_latest
    from engine.checkpoint.load import load_tensors

    latest = find_latest(rlhf_dir(root) / "checkpoints", collective=False)
    assert latest is not None and latest.name == "iter_0000006", latest
    return load_tensors(latest)


def metrics(root: Path) -> list[dict]:
    return cli.metrics(root, stage="rlhf")


@pytest.fixture(scope="module")
def sft_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sft")
    r = run(root, "run.stages=[data_prep,pretrain,sft]")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return root


def seeded(sft_root: Path, dest: Path) -> Path:
    """A copy of the run with data_prep, pretrain and sft completed (the prepared data is a symlink)."""
    return cli.seeded(sft_root, dest, stages=None)


@pytest.fixture(scope="module")
def baseline(sft_root: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[dict]]:
    root = seeded(sft_root, tmp_path_factory.mktemp("base"))
    r = run(root, "run.stages=[rlhf]")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return final_tensors(root), metrics(root)


def test_grpo_writes_the_rl_metrics_and_learns_from_varied_rewards(baseline: tuple[dict, list[dict]]) -> None:
    _, lines = baseline
    train = [m for m in lines if m["kind"] == "train"]
    assert [m["step"] for m in train] == [1, 2, 3, 4, 5, 6]
    for key in (
        "reward_mean",
        "reward_std",
        "kl",
        "entropy",
        "clip_frac",
        "response_len",
        "gen_tokens_per_s",
    ):
        assert all(key in m for m in train), key
    assert all(m["time_generate_s"] > 0 and m["time_fwd_bwd_s"] > 0 for m in train)
    assert any(m["reward_std"] > 0 for m in train[2:]), train  # advantages are not all zero after the kill
    assert any(m["clip_frac"] > 0 or m["kl"] > 0 for m in train[1:]), train


def first_divergence(want: list[dict], got: list[dict]) -> str:
    """The first train line (by step, each attempt's) whose losses differ from the baseline's: where to look."""
    keys = ("loss", "reward_mean", "kl", "value_loss", "grad_norm")
    ref = {m["step"]: m for m in want if m["kind"] == "train"}
    for m in (m for m in got if m["kind"] == "train"):
        diff = {k: (m.get(k), ref[m["step"]].get(k)) for k in keys if m.get(k) != ref[m["step"]].get(k)}
        if diff:
            return f"first at step {m['step']} (got, baseline): {diff}"
    return "no train line differs"


def _wait_for(what: str, cond: object, timeout: float = scaled(300)) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _progress(root: Path) -> int:
    try:
        return int(json.loads((rlhf_dir(root) / "progress.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return 0


def test_grpo_killed_mid_run_resumes_bit_identical(
    sft_root: Path, baseline: tuple[dict, list[dict]], tmp_path: Path
) -> None:
    from engine.checkpoint.load import load_tensors

    root = seeded(sft_root, tmp_path / "killed")
    cmd = cli.start(root, "run.stages=[rlhf]", base=BASE, fault="hang@step:4")  # waits before step 4
    try:
        ckpt = rlhf_dir(root) / "checkpoints" / "iter_0000002" / "COMPLETE.json"
        _wait_for("the step-2 checkpoint and step 3", lambda: ckpt.exists() and _progress(root) >= 3)
    finally:
        os.killpg(cmd.pid, signal.SIGKILL)  # the command, the job controller, the rank: the whole group
        cmd.wait()
    r = run(root, "run.stages=[rlhf]")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    resumes = [m for m in metrics(root) if m["kind"] == "resume"]
    assert [(m["from_step"], m["steps_lost"]) for m in resumes] == [(2, 1)], resumes
    final, want = baseline
    got = final_tensors(root)
    assert got.keys() == final.keys()
    diff = [k for k in final if not torch.equal(final[k], got[k])]
    assert not diff, f"tensors differ after the resume: {diff[:5]}; {first_divergence(want, metrics(root))}"
    # the policy moved away from the SFT weights it started from (so equality above means something)
    sft = load_tensors(run_dir(root) / "stages" / "sft" / "checkpoints" / "iter_0000060")
    moved = [k for k in sft if k in got and k.startswith("decoder") and not torch.equal(sft[k], got[k])]
    assert moved, "GRPO left every weight unchanged"


# ---------------------------------------------------------------------------- PPO: the policy and a critic

PPO = ("run.stages=[rlhf]", "rlhf.algorithm=ppo", "rlhf.critic_lr=1e-3")
DR_GRPO = ("run.stages=[rlhf]", "rlhf.algorithm=dr_grpo")


def seeded_ppo(sft_root: Path, dest: Path, overrides: tuple[str, ...] = PPO) -> Path:
    """``seeded``, with the run directory renamed to the config's of ``overrides`` (the run hash covers rlhf's
    keys; the completed stages' own hashes are unchanged)."""
    from pipeline.schema.compose import load_config
    from pipeline.schema.identity import run_dir_for

    root = seeded(sft_root, dest)
    want = run_dir_for(load_config([*BASE, f"run.root={root}", *overrides]))
    run_dir(root).rename(want)
    return root


def test_dr_grpo_trains_from_the_same_rollouts_with_its_own_loss(
    sft_root: Path, baseline: tuple[dict, list[dict]], tmp_path: Path
) -> None:
    root = seeded_ppo(sft_root, tmp_path / "dr_grpo", DR_GRPO)
    r = run(root, *DR_GRPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    train = [m for m in metrics(root) if m["kind"] == "train"]
    assert [m["step"] for m in train] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "kl", "entropy", "clip_frac", "reward_mean", "response_len"):
        assert all(key in m and m[key] == m[key] for m in train), key  # present and not NaN
    grpo_final, grpo_lines = baseline
    grpo_train = [m for m in grpo_lines if m["kind"] == "train"]
    # the same starting weights and sampler seed: step 1 draws GRPO's rollout; the updates differ
    assert train[0]["reward_mean"] == grpo_train[0]["reward_mean"]
    final = final_tensors(root)
    weights = [k for k in final if k.startswith("decoder") and k in grpo_final]
    assert weights and any(not torch.equal(final[k], grpo_final[k]) for k in weights)


@pytest.fixture(scope="module")
def ppo_baseline(sft_root: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[dict], Path]:
    root = seeded_ppo(sft_root, tmp_path_factory.mktemp("ppo"))
    r = run(root, *PPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return final_tensors(root), metrics(root), root


def test_ppo_trains_the_policy_and_the_critic_and_checkpoints_both(
    ppo_baseline: tuple[dict, list[dict], Path],
) -> None:
    from engine.checkpoint.load import load_tensors

    final, lines, root = ppo_baseline
    train = [m for m in lines if m["kind"] == "train"]
    assert [m["step"] for m in train] == [1, 2, 3, 4, 5, 6]
    for key in ("reward_mean", "kl", "clip_frac", "value_loss", "value_mean", "explained_var", "return_mean"):
        assert all(key in m and m[key] == m[key] for m in train), key  # present and not NaN
    assert all(m["time_critic_s"] > 0 for m in train)
    sft = load_tensors(run_dir(root) / "stages" / "sft" / "checkpoints" / "iter_0000060")
    weights = [k for k in sft if k.startswith("decoder") and k in final]
    assert weights and any(not torch.equal(sft[k], final[k]) for k in weights), "the policy did not move"
    critic = {k.removeprefix("critic."): v for k, v in final.items() if k.startswith("critic.")}
    assert any(k.startswith("reward_head") for k in critic), sorted(critic)[:5]
    assert any(".exp_avg.critic." in k for k in final), "no Adam moments of the critic"
    backbone = [k for k in weights if k in critic]
    assert backbone, sorted(critic)[:5]
    assert any(not torch.equal(sft[k], critic[k]) for k in backbone), "the critic did not move"
    assert any(not torch.equal(critic[k], final[k]) for k in backbone)  # two models, not one


def test_ppo_killed_mid_run_resumes_bit_identical(
    sft_root: Path, ppo_baseline: tuple[dict, list[dict], Path], tmp_path: Path
) -> None:
    root = seeded_ppo(sft_root, tmp_path / "killed")
    first = run(root, *PPO, fault="kill@step:4")  # SIGKILL before step 4's update (after the step-2 save)
    if first.returncode != 0:  # the launcher did not requeue it itself: start it again
        r = run(root, *PPO)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    resumes = [m for m in metrics(root) if m["kind"] == "resume"]
    assert [m["from_step"] for m in resumes] == [2], resumes
    final, want, _ = ppo_baseline
    got = final_tensors(root)
    assert got.keys() == final.keys()
    diff = [k for k in final if not torch.equal(final[k], got[k])]
    assert not diff, f"tensors differ after the resume: {diff[:5]}; {first_divergence(want, metrics(root))}"


# ---------------------------------------------------------------------------- DAPO and GSPO

DAPO = (
    "run.stages=[rlhf]",
    "rlhf.algorithm=dapo",
    "rlhf.beta=0",
    "rlhf.sampling_rounds=3",
    "rlhf.overlong_buffer=2",
)
GSPO = (
    "run.stages=[rlhf]",
    "rlhf.algorithm=gspo",
    "rlhf.beta=0",
    "rlhf.clip_low=3e-4",
    "rlhf.clip_high=4e-4",
)


@pytest.fixture(scope="module")
def dapo_baseline(sft_root: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[dict]]:
    root = seeded_ppo(sft_root, tmp_path_factory.mktemp("dapo"), DAPO)
    r = run(root, *DAPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return final_tensors(root), metrics(root)


def test_dapo_refills_groups_of_equal_rewards_and_trains(
    dapo_baseline: tuple[dict, list[dict]], baseline: tuple[dict, list[dict]]
) -> None:
    final, lines = dapo_baseline
    train = [m for m in lines if m["kind"] == "train"]
    assert [m["step"] for m in train] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "entropy", "clip_frac", "reward_mean", "sampling_rounds", "groups_kept"):
        assert all(key in m and m[key] == m[key] for m in train), key  # present and not NaN
    assert all(1 <= m["sampling_rounds"] <= 3 and 0 <= m["groups_kept"] <= 1 for m in train), train
    # a step whose first round had a group of equal rewards sampled again (the tiny policy often agrees)
    assert any(m["sampling_rounds"] > 1 for m in train), train
    grpo_final, _ = baseline
    weights = [k for k in final if k.startswith("decoder") and k in grpo_final]
    assert weights and any(not torch.equal(final[k], grpo_final[k]) for k in weights)


def test_dapo_killed_mid_run_resumes_bit_identical(
    sft_root: Path, dapo_baseline: tuple[dict, list[dict]], tmp_path: Path
) -> None:
    """The prompt stream's position is DAPO's state (refills consume prompts): a resume restores it."""
    root = seeded_ppo(sft_root, tmp_path / "killed", DAPO)
    first = run(root, *DAPO, fault="kill@step:4")  # SIGKILL before step 4's update (after the step-2 save)
    if first.returncode != 0:  # the launcher did not requeue it itself: start it again
        r = run(root, *DAPO)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert [m["from_step"] for m in metrics(root) if m["kind"] == "resume"] == [2]
    final, want = dapo_baseline
    got = final_tensors(root)
    diff = [k for k in final if not torch.equal(final[k], got[k])]
    assert not diff, f"tensors differ after the resume: {diff[:5]}; {first_divergence(want, metrics(root))}"


def test_gspo_trains_with_a_sequence_ratio(
    sft_root: Path, baseline: tuple[dict, list[dict]], tmp_path: Path
) -> None:
    root = seeded_ppo(sft_root, tmp_path / "gspo", GSPO)
    r = run(root, *GSPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    train = [m for m in metrics(root) if m["kind"] == "train"]
    assert [m["step"] for m in train] == [1, 2, 3, 4, 5, 6]
    assert all(m["loss"] == m["loss"] and 0 <= m["clip_frac"] <= 1 for m in train), train
    # two updates per rollout (BASE): the second's sequence ratios leave the narrow clip range somewhere
    assert any(m["clip_frac"] > 0 for m in train), train
    grpo_final, grpo_lines = baseline
    assert train[0]["reward_mean"] == [m for m in grpo_lines if m["kind"] == "train"][0]["reward_mean"]
    final = final_tensors(root)
    weights = [k for k in final if k.startswith("decoder") and k in grpo_final]
    assert weights and any(not torch.equal(final[k], grpo_final[k]) for k in weights)
