"""Every shipped YAML composes and validates; bad values fail with errors naming the key."""

from __future__ import annotations

import pytest

from pipeline.schema.build import build_config
from pipeline.schema.compose import CONF_DIR, compose, load_config
from pipeline.schema.config import PipelineConfig
from pipeline.schema.errors import ConfigError
from pipeline.schema.identity import run_hash

GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())


def shipped_options() -> list[tuple[str, str]]:
    out = []
    for group in GROUPS:
        for y in sorted((CONF_DIR / group).glob("*.yaml")):
            out.append((group, y.stem))
    return out


@pytest.mark.guard
def test_default_composes_and_validates() -> None:
    cfg = load_config([])
    assert isinstance(cfg, PipelineConfig)
    assert cfg.cluster.executor == "local"
    assert cfg.run.stages == ["data_prep", "pretrain", "sft", "rlhf", "eval"]


@pytest.mark.guard
@pytest.mark.parametrize(("group", "option"), shipped_options())
def test_every_shipped_yaml_composes_and_validates(group: str, option: str) -> None:
    if group == "parallel":
        overrides = [f"parallel@pretrain.parallel={option}"]
        if option.startswith("ep"):  # expert parallel layouts need a MoE model
            overrides.append("experiment=moe-tiny")
    else:
        overrides = [f"{group}={option}"]
    if group == "cluster" and option not in ("local", "debug"):
        overrides.append("run.dry_run=true")
    cfg = build_config(compose(overrides))
    assert isinstance(cfg, PipelineConfig)


def test_resolved_before_jobs() -> None:
    cfg = load_config(["experiment=tiny"])
    text = repr(cfg.to_dict())
    assert "${" not in text


def test_run_hash_ignores_resources_but_not_results() -> None:
    base = run_hash(load_config([]))
    assert run_hash(load_config(["pretrain.threads=1", "cluster=debug", "pretrain.time_min=5"])) == base
    assert run_hash(load_config(["pretrain.parallel.dp=2"])) == base
    assert run_hash(load_config(["pretrain.lr=0.1"])) != base
    assert run_hash(load_config(["run.stages=[data_prep]"])) == base


BAD = [
    (["pretrain.parallel.tp=3"], "pretrain.parallel.tp"),
    (["model.num_layers=3", "pretrain.parallel.pp=2"], "pretrain.parallel.pp"),
    (["pretrain.parallel.global_batch_size=10"], "pretrain.parallel.global_batch_size"),
    (["pretrain.parallel.recompute=fulll"], "pretrain.parallel.recompute"),
    (["pretrain.parallel.precision=fp8"], "pretrain.parallel.precision"),
    (["cluster.executor=slurmm"], "cluster.executor"),
    (["run.stages=[data_prep,pretrian]"], "run.stages"),
    (["pretrain.lr=-1"], "pretrain.lr"),
    (["pretrain.min_lr=1.0"], "pretrain.min_lr"),
    (["model.hidden_size=130"], "model.hidden_size"),
    (["model.normalization=BatchNorm"], "model.normalization"),
    (["data.corpus=files"], "data.text_paths"),
    (["data.vocab_size=100"], "data.vocab_size"),
    (
        ["pretrain.parallel.sequence_parallel=true", "pretrain.parallel.tp=2"],
        "pretrain.parallel.sequence_parallel",
    ),
    (["pretrain.parallel.dp=4", "pretrain.parallel.nodes=1"], "pretrain.parallel"),
    (["pretrain.warmup_iters=1000"], "pretrain.warmup_iters"),
    (["eval.models=[pretrain,dpo]"], "eval.models"),
    (["pretrain.parallel.vpp=2"], "pretrain.parallel.vpp"),
    (["rlhf.beta=-0.1"], "rlhf.beta"),
    (["rlhf=dpo", "rlhf.beta=0"], "rlhf.beta"),
    (
        ["cluster.max_nodes=1", "pretrain.parallel.nodes=2", "pretrain.parallel.dp=2"],
        "pretrain.parallel.nodes",
    ),
]


@pytest.mark.parametrize(("overrides", "key"), BAD, ids=[k for _, k in BAD])
def test_bad_config_names_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(overrides)
    assert str(e.value).startswith(key), str(e.value)


def test_typo_lists_choices() -> None:
    with pytest.raises(ConfigError, match=r"did you mean 'slurm'") as e:
        load_config(["cluster.executor=slurmm"])
    assert "['local', 'debug', 'slurm']" in str(e.value)


def test_unknown_key_in_dict_input_suggests() -> None:
    data = PipelineConfig().to_dict()
    data["model"]["num_layer"] = 2
    with pytest.raises(ConfigError, match=r"model.num_layer=2: unknown key \(did you mean 'num_layers'\?\)"):
        build_config(data)


def test_config_docs_are_current() -> None:
    from pipeline.cli.docs import render

    assert (CONF_DIR.parent / "docs" / "CONFIG.md").read_text() == render(), "run: python -m pipeline.docs"


def test_every_field_has_a_docstring() -> None:
    from pipeline.cli.docs import field_docs

    missing = [
        f"{c}.{n}"
        for c, rows in field_docs().items()
        if c != "PipelineConfig"
        for n, _, _, d in rows
        if not d
    ]
    assert not missing, missing
