"""The stage graph is declared in one place (pipeline.schema.graph.REGISTRY): everything else follows from it."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

import stages
from pipeline.schema import graph
from pipeline.schema.config import PipelineConfig
from pipeline.schema.errors import ConfigError
from pipeline.schema.graph import required
from pipeline.schema.identity import stage_hashes


def test_every_stage_has_its_module_and_config_section() -> None:
    fields = {f.name: f.type for f in dataclasses.fields(PipelineConfig)}
    for s in graph.REGISTRY:
        assert importlib.util.find_spec(f"stages.{s.name}") is not None, s.name
        assert callable(stages.entry(s.name)), s.name
        assert fields[s.name] == s.section, s.name


def test_derived_lists() -> None:
    assert graph.STAGES == ("data_prep", "pretrain", "sft", "reward_model", "rlhf", "eval", "export")
    assert graph.DEFAULT_STAGES == ("data_prep", "pretrain", "sft", "rlhf", "eval")
    assert PipelineConfig().run.stages == list(graph.DEFAULT_STAGES)
    assert graph.TRAIN_STAGES == ("pretrain", "sft", "reward_model", "rlhf")
    assert graph.LM_STAGES == ("pretrain", "sft", "rlhf")
    # init_from: auto loads the last language-model stage upstream (the reward model is not one)
    assert graph.weights_upstream("reward_model") == "sft" and graph.weights_upstream("rlhf") == "sft"
    assert graph.order(["eval", "reward_model", "sft"]) == ["sft", "reward_model", "eval"]


def test_optional_stages_are_read_only_when_used() -> None:
    cfg = PipelineConfig()
    assert required("rlhf", cfg) == ("data_prep", "sft")
    assert required("eval", cfg) == ("data_prep", "pretrain", "sft", "rlhf")
    cfg.rlhf.reward = "model"  # the RL reward from the reward model: only online RL reads it
    assert required("rlhf", cfg) == ("data_prep", "sft")
    cfg.rlhf.algorithm = "grpo"
    assert required("rlhf", cfg) == ("data_prep", "sft", "reward_model")
    cfg.rlhf.reward = "both"
    assert required("rlhf", cfg) == ("data_prep", "sft", "reward_model")
    cfg = PipelineConfig()
    cfg.run.stages = [*graph.DEFAULT_STAGES, "reward_model"]
    assert "reward_model" in required("eval", cfg)  # eval scores it on the held-out pairs
    cfg.sft.init_from = None
    assert required("sft", cfg) == ("data_prep",)
    cfg.run.stages = ["sft", "export"]
    assert required("export", cfg) == ("data_prep", "sft")
    cfg.export.stage = "pretrain"
    assert required("export", cfg) == ("data_prep", "pretrain")


def test_an_unused_optional_stage_does_not_change_other_stages_identity() -> None:
    base = stage_hashes(PipelineConfig(), with_inputs=False)
    cfg = PipelineConfig()
    cfg.reward_model.lr = 5e-4
    changed = stage_hashes(cfg, with_inputs=False)
    assert changed["reward_model"] != base["reward_model"]
    assert {k: v for k, v in changed.items() if k != "reward_model"} == {
        k: v for k, v in base.items() if k != "reward_model"
    }
    cfg.run.stages = [*graph.DEFAULT_STAGES, "reward_model"]  # now eval reads it: eval's identity follows
    assert stage_hashes(cfg, with_inputs=False)["eval"] != base["eval"]


def test_opt_in_stage_needs_its_upstream(tmp_path: Path) -> None:
    from pipeline.cli.compose import load

    with pytest.raises(ConfigError, match=r"reward_model reads the output of sft"):
        load([f"run.root={tmp_path}", "run.stages=[data_prep,reward_model]", "experiment=tiny"])
    with pytest.raises(ConfigError, match=r"rlhf reads the output of reward_model"):  # reward from the model
        load([f"run.root={tmp_path}", "rlhf=grpo", "rlhf.reward=both", "experiment=tiny"])
    with pytest.raises(ConfigError, match=r"export\.stage='dpo'"):
        load([f"run.root={tmp_path}", "export.stage=dpo"])


def test_registry_rejects_an_undeclared_upstream() -> None:
    bad = (*graph.REGISTRY, graph.Stage("late", ("nowhere",)))
    saved = graph.REGISTRY
    try:
        graph.REGISTRY = bad
        with pytest.raises(RuntimeError, match="late reads nowhere"):
            graph._check_registry()
    finally:
        graph.REGISTRY = saved
