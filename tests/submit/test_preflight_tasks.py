"""Pre-flight of eval.tasks: a missing task folder, an unknown task name (did-you-mean from lm-eval's registry),
a local task whose data file is missing and a bundled task whose dataset is not cached are config errors naming
the key and the fix, before any job starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.schema.config import PipelineConfig
from pipeline.schema.errors import ConfigError
from pipeline.submit.preflight import tasks as preflight_tasks
from tests.support.lm_tasks import write_tasks


def check(tmp_path: Path, tasks: list[str], paths: list[str] | None = None) -> None:
    cfg = PipelineConfig()
    cfg.eval.tasks = tasks
    cfg.eval.task_paths = [str(tmp_path / "tasks")] if paths is None else paths
    preflight_tasks._lm_tasks(cfg, "eval")


@pytest.fixture
def task_dir(tmp_path: Path) -> Path:
    return write_tasks(tmp_path / "tasks")


def test_local_tasks_with_their_files_pass(tmp_path: Path, task_dir: Path) -> None:
    check(tmp_path, ["local_mc", "local_ppl", "local_gen", "arc_easy_local"])


def test_missing_task_folder_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"eval\.task_paths\[0\]=.*nope.*no such folder"):
        check(tmp_path, [], [str(tmp_path / "nope")])


def test_missing_data_file_names_it(tmp_path: Path, task_dir: Path) -> None:
    (task_dir / "mc_test.jsonl").unlink()
    with pytest.raises(
        ConfigError, match=r"eval\.tasks\[1\]='local_mc': its data file .*mc_test\.jsonl does not"
    ):
        check(tmp_path, ["local_gen", "local_mc"])


def test_unknown_names_and_uncached_data_through_lm_evals_registry(
    tmp_path: Path, task_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One index of lm-eval's bundled tasks (~25 s) for the three cases that need it."""
    with pytest.raises(ConfigError, match=r"eval\.tasks\[1\]='local_mcc': unknown lm-eval task.*'local_mc'"):
        check(tmp_path, ["local_gen", "local_mcc"])
    with pytest.raises(ConfigError, match=r"eval\.tasks\[0\]='arc_esy': unknown lm-eval task.*'arc_easy'"):
        check(tmp_path, ["arc_esy"])
    from datasets import config
    from huggingface_hub import constants

    monkeypatch.setattr(config, "HF_DATASETS_CACHE", tmp_path / "empty_cache")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty_hub"))
    with pytest.raises(
        ConfigError, match=r"eval\.tasks\[0\]='arc_easy': .*allenai/ai2_arc \(ARC-Easy\).*not in the"
    ):
        check(tmp_path, ["arc_easy"])
    (tmp_path / "empty_cache" / "allenai___ai2_arc").mkdir(parents=True)
    check(tmp_path, ["arc_easy", "local_mc"])  # cached: passes


def test_a_chat_templated_run_refuses_a_hf_model_without_a_template(tmp_path: Path, task_dir: Path) -> None:
    base, chat = tmp_path / "base", tmp_path / "chat"
    for d in (base, chat):
        d.mkdir()
        (d / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    (chat / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    cfg = PipelineConfig()
    cfg.eval.tasks, cfg.eval.task_paths = ["local_mc"], [str(task_dir)]
    cfg.eval.models = ["sft", f"hf:{chat}", f"hf:{base}"]
    preflight_tasks._lm_tasks(cfg, "eval")  # without apply_chat_template a model needs none
    cfg.eval.apply_chat_template = True
    with pytest.raises(
        ConfigError, match=r"eval\.models\[2\]=.*base.*has no chat template.*apply_chat_template=false"
    ):
        preflight_tasks._lm_tasks(cfg, "eval")
    cfg.eval.models = ["sft", f"hf:{chat}"]
    preflight_tasks._lm_tasks(cfg, "eval")


def test_in_training_tasks_are_checked_under_their_own_key(tmp_path: Path, task_dir: Path) -> None:
    from pipeline.submit.preflight.tasks import _in_loop_tasks

    cfg = PipelineConfig()
    cfg.eval.task_paths = [str(task_dir)]
    cfg.sft.eval_tasks = ["local_gen", "local_mcc"]
    with pytest.raises(ConfigError, match=r"sft\.eval_tasks\[1\]='local_mcc': unknown lm-eval task"):
        _in_loop_tasks(cfg, "sft")
    cfg.sft.eval_tasks = ["local_mc"]
    _in_loop_tasks(cfg, "sft")
    cfg.sft.parallel.pp = 2
    _in_loop_tasks(cfg, "sft")  # pipeline stages serve lm-eval too (engine.evaluation.lm)
    cfg.reward_model.eval_tasks = ["local_mc"]
    with pytest.raises(ConfigError, match=r"reward_model\.eval_tasks=.*not a language model"):
        _in_loop_tasks(cfg, "reward_model")


def test_the_runs_own_task_needs_no_registry_and_runs_in_eval_only(tmp_path: Path, task_dir: Path) -> None:
    from pipeline.submit.preflight.tasks import _in_loop_tasks

    check(tmp_path, ["pipeline_task", "local_mc", "pipeline_pref"])  # defined by the eval stage itself
    with pytest.raises(ConfigError, match=r"eval\.tasks\[2\]='local_mcc': unknown lm-eval task"):
        check(tmp_path, ["pipeline_task", "local_mc", "local_mcc"])  # the index counts the own task
    cfg = PipelineConfig()
    cfg.eval.task_paths = [str(task_dir)]
    cfg.pretrain.eval_tasks = ["local_mc", "pipeline_task"]
    with pytest.raises(
        ConfigError, match=r"pretrain\.eval_tasks\[1\]='pipeline_task': .*put it in eval\.tasks"
    ):
        _in_loop_tasks(cfg, "pretrain")
    cfg.pretrain.eval_tasks = ["pipeline_pref"]
    with pytest.raises(
        ConfigError, match=r"pretrain\.eval_tasks\[0\]='pipeline_pref': .*put it in eval\.tasks"
    ):
        _in_loop_tasks(cfg, "pretrain")
