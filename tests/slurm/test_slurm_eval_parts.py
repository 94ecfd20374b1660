"""Each evaluated model is its own eval job on the real local SLURM cluster (pipeline.schema.graph ``Stage.parts``).

The graph from a Hugging Face base model (SFT from ``hf:``, then RLHF) scores the base model, SFT and RLHF on an
lm-eval task: one job per model, each after only the stages it reads, and the eval stage's own job after them
gathers their results. One model's job is cancelled from outside (``scancel``) while it waits: the gathering job
never runs, status names the part, and the same command again submits only that part and the gathering job.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.hf_models import make
from tests.support.lm_tasks import write_tasks
from tests.support.slurm_cluster import wait_for
from tests.support.slurm_helpers import (
    TINY,
    events,
    fail_text,
    pipeline,
    run_dirs,
    run_story,
    submitted,
    wait_settled,
)
from tests.support.timing import scaled

pytestmark = pytest.mark.slurm

STAGES = ["data_prep", "sft", "rlhf", "eval"]


def parts_submitted(stdout: str) -> dict[str, tuple[str, list[str]]]:
    """{part: (job id, afterok job ids)} from '[eval:<part>] submitted job N (afterok:A:B)' lines."""
    found = re.findall(r"^\[eval:(\S+)\] submitted job (\d+)(?: \(afterok:([\d:]+)\))?", stdout, flags=re.M)
    return {p: (j, deps.split(":") if deps else []) for p, j, deps in found}


def starts(run_dir: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in events(run_dir, "part_started", "eval"):
        out[e["part"]] = out.get(e["part"], 0) + 1
    return out


@pytest.mark.timeout(900)
def test_each_model_is_its_own_eval_job_and_a_rerun_redoes_only_the_cancelled_one(
    cluster: Any, tmp_path: Path
) -> None:
    base = make("llama3", tmp_path / "base", tokenizer="llama3")
    tasks = write_tasks(tmp_path / "tasks")
    hf = f"hf:{base}"
    args = [
        *TINY,
        f"run.root={tmp_path / 'runs'}",
        f"sft.init_from={hf}",
        f"run.stages=[{','.join(STAGES)}]",
        f"eval.models=[{hf},sft,rlhf]",
        "eval.tasks=[local_mc]",
        f"eval.task_paths=[{tasks}]",
        "eval.limit=3",
        "eval.num_task_examples=2",
        "eval.max_new_tokens=4",
    ]
    r = pipeline(cluster, *args)
    assert r.returncode == 0, fail_text(r)
    [run_dir] = run_dirs(r.stdout)
    jobs, pieces = submitted(r.stdout), parts_submitted(r.stdout)
    # each model's job waits for what it reads only: the base model for data_prep, a stage for its own job
    assert pieces == {
        hf: (pieces[hf][0], [jobs["data_prep"]]),
        "sft": (pieces["sft"][0], [jobs["data_prep"], jobs["sft"]]),
        "rlhf": (pieces["rlhf"][0], [jobs["data_prep"], jobs["rlhf"]]),
    }, r.stdout
    assert re.search(
        rf"^\[eval\] submitted job {jobs['eval']} \(afterok:.*{pieces['rlhf'][0]}\)$", r.stdout, re.M
    )
    cluster.run("scancel", pieces["rlhf"][0])  # it waits for rlhf: cancelled before it ever ran

    views = wait_settled(run_dir, STAGES, deadline_s=scaled(600))
    assert [views[s].state for s in STAGES] == ["completed", "completed", "completed", "blocked"], views
    # the other models' jobs run to their end all the same (a re-run waits while any of them is queued)
    ran = [pieces[hf][0], pieces["sft"][0]]
    wait_for(lambda: all(cluster.squeue(j) is None for j in ran), 300, lambda: run_story(run_dir))
    assert f"part rlhf (job {pieces['rlhf'][0]}: CANCELLED)" in views["eval"].detail, views["eval"]
    assert starts(run_dir) == {hf: 1, "sft": 1}, run_story(run_dir)
    assert not (run_dir / "stages" / "eval" / "results.json").exists()

    again = pipeline(cluster, *args)
    assert again.returncode == 0, fail_text(again)
    assert f"[eval:{hf}] done earlier with the same config: skipped" in again.stdout, again.stdout
    assert "[eval:sft] done earlier with the same config: skipped" in again.stdout, again.stdout
    assert set(parts_submitted(again.stdout)) == {"rlhf"} and set(submitted(again.stdout)) == {"eval"}
    views = wait_settled(run_dir, STAGES, deadline_s=scaled(600))
    assert views["eval"].state == "completed", (views["eval"], run_story(run_dir))
    assert starts(run_dir) == {hf: 1, "sft": 1, "rlhf": 1}, run_story(run_dir)

    results = json.loads((run_dir / "stages" / "eval" / "results.json").read_text())
    assert set(results["models"]) == {hf, "sft", "rlhf"}
    for m in results["models"].values():
        acc = m["lm_eval"]["local_mc"]["metrics"]["acc"]
        assert 0.0 <= acc["value"] <= 1.0 and acc["stderr"] is not None
    table = "".join(p.read_text() for p in (run_dir / "jobs" / "eval").rglob("*_log.out"))
    assert "local_mc" in table and "±" in table, table[-2000:]  # the gathering job's table
