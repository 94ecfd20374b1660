"""The search's input: Hydra's sweep grammar as Optuna distributions, the registries, and bad input refused
before anything is written (config errors in the one shape, exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from pipeline.__main__ import main
from pipeline.schema import search as schema
from pipeline.schema.errors import ConfigError
from pipeline.schema.search import SearchConfig
from pipeline.search import registry
from pipeline.search.space import parse

BASE = ["experiment=tiny", "search=optuna", "run.stages=[data_prep,pretrain]", "pretrain.min_lr=0"]


def test_grammar_to_distributions() -> None:
    s = parse(
        [
            *BASE,
            "search.n_trials=4",
            "pretrain.lr=tag(log, interval(1e-4, 1e-2))",
            "pretrain.warmup_iters=range(1, 5, 2)",
            "pretrain.seed=1,2",
            "model.normalization=choice(LayerNorm, RMSNorm)",
            "pretrain.weight_decay=interval(0, 0.1)",
            "pretrain.clip_grad=range(0.5, 1.5, 0.5)",
        ]
    )
    assert s.base == ["experiment=tiny", "run.stages=[data_prep,pretrain]", "pretrain.min_lr=0"]
    assert s.search == ["search=optuna", "search.n_trials=4"]
    assert s.dims == {
        "pretrain.lr": FloatDistribution(1e-4, 1e-2, log=True),
        "pretrain.warmup_iters": IntDistribution(1, 3, step=2),
        "pretrain.seed": CategoricalDistribution([1, 2]),
        "model.normalization": CategoricalDistribution(["LayerNorm", "RMSNorm"]),
        "pretrain.weight_decay": FloatDistribution(0.0, 0.1),
        "pretrain.clip_grad": CategoricalDistribution([0.5, 1.0]),
    }
    assert s.trial_overrides({**dict.fromkeys(s.dims, 1), "pretrain.lr": 0.001})[-6:] == [
        "pretrain.lr=0.001",
        *(f"{k}=1" for k in list(s.dims)[1:]),
    ]
    assert len(s.corners()) == 2 * 2 * 2 * 2 * 2 * 2


def test_registries_hold_the_schema_names() -> None:
    assert set(registry.SAMPLERS) == set(schema.SAMPLERS)
    assert set(registry.PRUNERS) == set(schema.PRUNERS)
    assert set(registry.STAGE_OBJECTIVES) == set(schema.STAGE_OBJECTIVES)


def test_grid_needs_choice_or_range() -> None:
    s = parse([*BASE, "pretrain.lr=interval(1e-4, 1e-2)"])
    with pytest.raises(ConfigError, match=r"pretrain.lr=interval\(...\): search.sampler=grid needs"):
        s.grid()


def test_valid_losses_and_objectives(tmp_path: Path) -> None:
    m = tmp_path / "stages" / "pretrain" / "metrics.jsonl"
    m.parent.mkdir(parents=True)
    m.write_text(
        '{"kind": "train", "step": 1, "loss": 7}\n{"kind": "valid", "step": 2, "loss": 6.0}\n'
        '{"kind": "valid", "step": 4, "loss": 5.5}\n{"kind": "valid", "step": 6, "loss": 5.7}\n'
        '{"kind": "eval_task", "step": 6, "task": "local_mc", "acc": 0.5, "acc_stderr": 0.2}\n'
        '{"kind": "eval_task", "step": 8, "task": "local_mc", "acc": 0.75}\n{"kind": "va'
    )
    assert registry.valid_losses(m) == [(2, 6.0), (4, 5.5), (6, 5.7)]
    assert registry.objective_value("pretrain.final_valid_loss", tmp_path) == 5.7
    assert registry.objective_value("pretrain.best_valid_loss", tmp_path) == 5.5
    assert registry.objective_value("sft.final_valid_loss", tmp_path) is None
    assert registry.task_values(m, "local_mc", "acc") == [(6, 0.5), (8, 0.75)]
    assert (
        registry.objective_value("pretrain.task.local_mc.acc", tmp_path) == 0.75
    )  # the end-of-training value
    assert registry.objective_value("pretrain.task.local_gen.acc", tmp_path) is None
    (tmp_path / "stages" / "eval").mkdir()
    (tmp_path / "stages" / "eval" / "results.json").write_text('{"arith": {"accuracy": 0.25}}')
    assert registry.objective_value("eval.arith.accuracy", tmp_path) == 0.25
    # the pruner's rungs, in the study's direction
    sc = SearchConfig(objective="pretrain.task.local_mc.acc", direction="maximize")
    assert registry.prune_points(sc, m) == [(6, 0.5), (8, 0.75)]  # the objective's own values
    sc = SearchConfig(objective="eval.arith.accuracy", direction="maximize")
    assert registry.prune_points(sc, m) == [(2, -6.0), (4, -5.5), (6, -5.7)]  # lower loss: higher value
    assert registry.prune_points(SearchConfig(), m) == [(2, 6.0), (4, 5.5), (6, 5.7)]
    sc = SearchConfig(objective="pretrain.task.local_mc.acc", direction="maximize", prune_stage="sft")
    assert registry.prune_points(sc, m) == [(2, -6.0), (4, -5.5), (6, -5.7)]  # another stage's task: losses


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["search.sampler=tpx"], "search.sampler='tpx': must be one of ['tpe', 'random', 'grid', 'cmaes']"),
        (["search.pruner=asa"], "search.pruner='asa': must be one of ['none', 'median', 'asha', "),
        (["search.objective=pretrain.loss"], "search.objective='pretrain.loss': must be <stage>.<name>"),
        (
            ["search.objective=sft.final_valid_loss"],
            "search.objective=sft.final_valid_loss: stage 'sft' is not",
        ),
        (
            ["search.objective=pretrain.task.local_mc.acc"],
            "search.objective=pretrain.task.local_mc.acc: 'local_mc' is not one of pretrain.eval_tasks=[]",
        ),
        (["search.poll_s=0.1"], "search.poll_s=0.1: must be a finite number >= 0.5"),
        (
            ["pretrain.lrr=interval(1e-4,1e-2)"],
            "pretrain.lrr=0.0001: unknown key (did you mean 'pretrain.lr'?)",
        ),
        (
            ["pretrain.warmup_iters=range(1,8)"],
            "pretrain.warmup_iters=7: must be < iters=6 [search space corner 2 of 4",
        ),
        (["pretrain.lr=interval(0,1e-2)"], "pretrain.lr=0.0: must be a finite number > 0"),
    ],
    ids=[
        "sampler",
        "pruner",
        "objective",
        "objective stage",
        "objective task",
        "poll floor",
        "unknown key",
        "box",
        "bound",
    ],
)
def test_bad_search_is_a_config_error_nothing_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], says: str
) -> None:
    lr = [] if any(e.startswith("pretrain.lr") for e in extra) else ["pretrain.lr=interval(1e-4, 1e-2)"]
    assert main(["-m", *BASE, f"run.root={tmp_path / 'r'}", *lr, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: ") and says in err, err
    assert not (tmp_path / "r").exists()


def test_search_without_a_searched_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-m", *BASE, f"run.root={tmp_path / 'r'}"]) == 2
    assert "no searched key" in capsys.readouterr().err


def test_search_imports_no_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, pipeline.search.controller, pipeline.search.launch, pipeline.search.manage, "
        "pipeline.status, pipeline.cancel; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_local_trials_threads_capped_by_the_machine_unless_the_command_line_sets_them() -> None:
    from pipeline.cli.compose import load
    from pipeline.search.controller import thread_caps

    def caps(*extra: str, cores: int = 2) -> list[str]:
        space = parse([*BASE, "pretrain.lr=choice(1e-3,2e-3)", *extra])
        return thread_caps(load([*space.base, *space.search]), space, cores)

    assert caps() == ["data_prep.threads=1", "pretrain.threads=1"]  # 2 cores, 2 trials at once (default)
    assert caps(cores=4) == []  # the default 2 threads fit
    assert caps("search.max_concurrent=3", cores=16) == []
    assert caps("search.max_concurrent=3", cores=3) == ["data_prep.threads=1", "pretrain.threads=1"]
    assert caps("pretrain.threads=2") == ["data_prep.threads=1"]  # set on the command line: kept
    assert caps("pretrain.threads=choice(1,2)") == ["data_prep.threads=1"]  # searched: kept
    assert caps("cluster=slurm") == []  # SLURM jobs have the CPUs they ask for
