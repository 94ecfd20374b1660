"""The rlhf stage's algorithms, declared torch-free: one ``RLAlgorithm`` per ``rlhf.algorithm`` value.

The schema (validation of ``rlhf.algorithm`` and its keys) and the stage graph (what rlhf reads) read these
declarations; the engine's implementation of each is the module named by ``module`` (engine.rl.registry
imports it). Adding an algorithm: its declaration here, its engine module, its ``conf/rlhf/<name>.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.schema.errors import ConfigError

INPUTS = ("preferences", "prompts", "reward")
"""What an algorithm may read: preferences (data_prep's preference pairs or users' data.pref_paths), prompts
(the task's prompt stream with each prompt's answer), reward (``rlhf.reward``: the task verifier and/or the
reward_model stage's model)."""

REWARD_MODEL_SOURCES = ("model", "both")
"""``rlhf.reward`` values that read the reward_model stage."""

ONLINE_KEYS = (
    "beta",
    "reward",
    "group_size",
    "temperature",
    "top_p",
    "max_new_tokens",
    "clip_eps",
    "ppo_epochs",
)
"""The rlhf keys of rollout-based algorithms (sampling, rewards, clipped policy updates)."""
ASYMMETRIC_KEYS = (*(k for k in ONLINE_KEYS if k != "clip_eps"), "clip_low", "clip_high")
"""The online keys of the algorithms that clip the ratio to [1 - clip_low, 1 + clip_high] (not clip_eps)."""


@dataclass(frozen=True)
class RLAlgorithm:
    """One value of ``rlhf.algorithm``."""

    name: str
    summary: str
    """One line for the docs and error messages."""
    keys: tuple[str, ...]
    """The rlhf keys it reads besides the shared training-stage ones (pipeline.schema.stage_sections.RLHFStage fields)."""
    reads: tuple[str, ...]
    """Its inputs, a subset of ``INPUTS``."""
    module: str = ""
    """The engine module that registers its step and unit (default ``engine.rl.<name>``)."""
    scaled_by_beta: bool = False
    """Its loss is scaled by ``rlhf.beta`` (DPO), so beta must be > 0; elsewhere beta 0 turns the KL term off."""

    def __post_init__(self) -> None:
        unknown = set(self.reads) - set(INPUTS)
        if unknown:
            raise ValueError(f"RL algorithm {self.name!r} reads {sorted(unknown)}: not among {INPUTS}")

    @property
    def engine_module(self) -> str:
        return self.module or f"engine.rl.{self.name}"


REGISTRY: tuple[RLAlgorithm, ...] = (
    RLAlgorithm(
        "dpo",
        "offline preference optimisation against the frozen starting model",
        keys=("beta",),
        reads=("preferences",),
        scaled_by_beta=True,
    ),
    RLAlgorithm(
        "grpo",
        "online: group-normalised advantages, clipped policy loss, k3 KL penalty",
        keys=ONLINE_KEYS,
        reads=("prompts", "reward"),
    ),
    RLAlgorithm(
        "ppo",
        "online with a trained critic: GAE advantages, clipped policy and value losses",
        keys=(*ONLINE_KEYS, "gamma", "lam", "value_clip", "critic_lr"),
        reads=("prompts", "reward"),
    ),
    RLAlgorithm(
        "dr_grpo",
        "GRPO without the std division of the advantages and the per-response length normalisation",
        keys=ONLINE_KEYS,
        reads=("prompts", "reward"),
    ),
    RLAlgorithm(
        "dapo",
        "GRPO with clip-higher, dynamic sampling (groups of equal rewards dropped and refilled), overlong shaping",
        keys=(*ASYMMETRIC_KEYS, "sampling_rounds", "overlong_buffer", "overlong_penalty", "overlong_filter"),
        reads=("prompts", "reward"),
    ),
    RLAlgorithm(
        "gspo",
        "GRPO's advantages with a sequence-level importance ratio, clipped per sequence",
        keys=ASYMMETRIC_KEYS,
        reads=("prompts", "reward"),
    ),
)

NAMES: tuple[str, ...] = tuple(a.name for a in REGISTRY)


def algorithm(name: str) -> RLAlgorithm:
    """The declaration of ``rlhf.algorithm=name``."""
    for a in REGISTRY:
        if a.name == name:
            return a
    raise ConfigError(f"rlhf.algorithm={name!r}: must be one of {list(NAMES)}")


def reads_reward_model(name: str, reward: str) -> bool:
    """Whether algorithm ``name`` with ``rlhf.reward=reward`` reads the reward_model stage."""
    return "reward" in algorithm(name).reads and reward in REWARD_MODEL_SOURCES
