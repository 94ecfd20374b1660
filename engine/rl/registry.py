"""The RL algorithms' implementations, by name: each engine module (``engine.rl.<name>``, as its declaration in
pipeline/schema/rl.py names it) calls ``register`` with its step and unit factories; ``get`` imports the
module of a declared name and returns what it registered. stages/rlhf.py builds the ``RLInputs`` the
declaration says it reads and hands them to ``unit``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.train.step import Step
from pipeline.schema import rl as declared


@dataclass(frozen=True)
class RLInputs:
    """What the rlhf stage hands an algorithm's unit factory; the fields of inputs it does not read stay empty."""

    data_dir: Path
    """data_prep's output (preference pairs, prompt files, the tokenizer)."""
    prompts: list[str] = field(default_factory=list)
    """``prompts``: the task's prompt stream."""
    answers: list[str] = field(default_factory=list)
    """``prompts``: each prompt's right answer."""
    check: Callable[[str, str], bool] | None = None
    """``prompts``: the task checker (response, answer) -> correct, for the verifier reward."""
    reward_model: Any = None
    """``reward`` with ``rlhf.reward=model|both``: the reward_model stage's model, frozen."""
    stop_tokens: tuple[int, ...] = ()
    """``prompts``: the tokens that end a response (data_prep's ``stop_token_ids``: the eos, and a Hugging Face
    model's end-of-turn tokens); the eos when empty."""


@dataclass(frozen=True)
class Algorithm:
    """One algorithm's engine side: its training step and its unit (engine.train.units) for the stage."""

    name: str
    step: Callable[[Any], Step]
    """``step(rlhf_settings)``: the step (engine.train.steps shape) the trainer runs."""
    unit: Callable[[Any, RLInputs], tuple[Any, Any]]
    """``unit(env, inputs)``: ``(TrainUnit, valid_source)`` for ``train_stage(unit=...)``."""


_ALGORITHMS: dict[str, Algorithm] = {}


def register(algorithm: Algorithm) -> Algorithm:
    """Register ``algorithm`` (at its module's import); its name must be declared in pipeline/schema/rl.py."""
    declared.algorithm(algorithm.name)  # raises for an undeclared name
    if algorithm.name in _ALGORITHMS and _ALGORITHMS[algorithm.name] is not algorithm:
        raise ValueError(f"RL algorithm {algorithm.name!r} registered twice")
    _ALGORITHMS[algorithm.name] = algorithm
    return algorithm


def get(name: str) -> Algorithm:
    """The registered implementation of ``rlhf.algorithm=name`` (imports its declared engine module)."""
    decl = declared.algorithm(name)
    importlib.import_module(decl.engine_module)
    if name not in _ALGORITHMS:
        raise RuntimeError(
            f"{decl.engine_module} does not register RL algorithm {name!r} (engine.rl.registry.register)"
        )
    return _ALGORITHMS[name]
