"""The front door, through the CLI: every class of config mistake gives one line
``config error: <key>=<value>: <what is allowed>``, exit 2 and no run directory; a sweep with one bad trial
runs nothing; a failed SLURM submission exits 3 with SLURM's message and the fix; run identity classifies
every schema field."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
from pathlib import Path

import pytest

from pipeline.__main__ import main
from pipeline.schema import build, compose, domains, graph, identity, sections
from pipeline.schema.config import PipelineConfig
from pipeline.schema.identity import stage_own_config

LINE = re.compile(r"^config error: \S+=.*: .+$")


def run_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = main([*args, f"run.root={tmp_path / 'runs'}", "experiment=tiny"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    return code, err


def assert_config_error(tmp_path: Path, code: int, err: list[str], *needles: str) -> None:
    assert code == 2, err
    assert len(err) == 1 and LINE.match(err[0]), err
    for n in needles:
        assert n in err[0], err
    assert not (tmp_path / "runs").exists(), "a config error must write nothing"


def _checkpoint(root: Path, hidden_size: int | None = None, vocab: int = 512) -> Path:
    """A committed checkpoint in a run directory whose recorded model has ``hidden_size`` and ``vocab``."""
    run = root / "old-run"
    (run / "ledger").mkdir(parents=True)
    if hidden_size is not None:
        (run / "provenance").mkdir()
        text = f"model:\n  hidden_size: {hidden_size}\ndata:\n  vocab_size: {vocab}\n  tokenizer_path: null\n"
        (run / "provenance" / "config.yaml").write_text(text)
    ckpt = run / "stages" / "pretrain" / "checkpoints" / "iter_0000002"
    ckpt.mkdir(parents=True)
    (ckpt / "w.distcp").write_bytes(b"x")
    (ckpt / "COMPLETE.json").write_text(
        json.dumps({"iteration": 2, "files": {"w.distcp": {"size": 1, "sha256": "0"}}})
    )
    return ckpt.parent


def _tokenizer(path: Path, n: int) -> Path:
    vocab = {f"t{i}": i for i in range(n)}
    path.write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab, "merges": []}, "added_tokens": []}))
    return path


CASES = {
    "hydra grammar": (["pretrain.lr=[1,"], ["pretrain.lr=[1,", "not a valid override"]),
    "unknown key": (["pretrain.lrr=1"], ["pretrain.lrr=1", "did you mean 'pretrain.lr'"]),
    "unknown appended key": (["+pretrain.lrr=1"], ["did you mean 'lr'"]),
    "unknown section": (["pretrainn.lr=1"], ["did you mean 'pretrain'"]),
    "wrong type": (["pretrain.iters=abc"], ["pretrain.iters=abc", "an integer >= 1"]),
    "null": (["pretrain.iters=null"], ["pretrain.iters=null", "not null"]),
    "missing value": (["pretrain.iters=???"], ["pretrain.iters=???", "missing value"]),
    "unknown group option": (["model=tinyy"], ["model=tinyy", "did you mean 'tiny'"]),
    "unknown per-stage option": (["parallel@sft.parallel=dp3"], ["did you mean 'dp2'"]),
    "non-finite": (["pretrain.lr=nan"], ["pretrain.lr=nan", "finite"]),
    "infinite": (["sft.clip_grad=inf"], ["sft.clip_grad=inf", "finite"]),
    "negative": (["rlhf.weight_decay=-0.1"], ["rlhf.weight_decay=-0.1", ">= 0"]),
    "warmup == iters": (
        ["pretrain.iters=6", "pretrain.warmup_iters=6"],
        ["pretrain.warmup_iters=6", "< iters=6"],
    ),
    "zero time limit": (["sft.time_min=0"], ["sft.time_min=0", ">= 1"]),
    "ignored per-stage key": (["pretrain.beta=0.5"], ["pretrain.beta=0.5", "only rlhf"]),
    "sweep syntax without -m": (["pretrain.lr=1e-3,2e-3"], ["add -m"]),
    "unknown key in a list item": (
        ["data.corpus=sources", "data.sources=[{path: a.txt}, {path: b.txt, txt_field: body}]"],
        [
            "data.sources[1].txt_field=body",
            "did you mean 'data.sources[1].text_field'",
            "keys of data.sources[1]",
        ],
    ),
    "wrong type in a list item": (
        ["data.corpus=sources", "data.sources=[{path: a.txt, weight: heavy}]"],
        ["data.sources[0].weight=heavy", "a finite number > 0"],
    ),
    "unknown key in a list item, appended": (
        ["data.corpus=sources", "+data.sources=[{path: a.txt, formt: text}]"],
        ["data.sources[0].formt=text", "did you mean 'data.sources[0].format'"],
    ),
    "missing lm-eval task folder": (
        ["eval.tasks=[arc_easy]", "eval.task_paths=[/no/such/tasks]"],
        ["eval.task_paths[0]='/no/such/tasks'", "no such folder"],
    ),
    "empty lm-eval task name": (["eval.tasks=['']"], ["eval.tasks[0]=''", "a non-empty string"]),
    "missing file": (
        ["data.corpus=files", "data.text_paths=[/no/such/file.txt]"],
        ["data.text_paths", "does not exist"],
    ),
    "signal after time limit": (
        ["cluster=slurm", "cluster.time_min=1", "cluster.signal_delay_s=120", "run.dry_run=true"],
        ["cluster.signal_delay_s=120", "before the time limit"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_config_mistake_one_line_exit_2_nothing_written(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides, needles = CASES[case]
    code, err = run_cli(tmp_path, capsys, *overrides)
    assert_config_error(tmp_path, code, err, *needles)


def test_empty_text_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty.txt").write_text("")
    code, err = run_cli(tmp_path, capsys, "data.corpus=files", f"data.text_paths=[{tmp_path / 'empty.txt'}]")
    assert_config_error(tmp_path, code, err, "is empty")


def test_too_little_text_for_one_batch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "small.txt").write_text("to be or not to be\n")
    code, err = run_cli(tmp_path, capsys, "data.corpus=files", f"data.text_paths=[{tmp_path / 'small.txt'}]")
    assert_config_error(tmp_path, code, err, "one global batch")


def test_init_from_incomplete_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ckpts"
    (root / "tmp.iter_0000004.abcd").mkdir(parents=True)
    code, err = run_cli(tmp_path, capsys, f"sft.init_from={root}")
    assert_config_error(tmp_path, code, err, "sft.init_from=", "only incomplete saves", "COMPLETE.json")


def test_init_from_other_model_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpts = _checkpoint(tmp_path / "elsewhere", hidden_size=32)  # experiment=tiny has hidden_size 64
    code, err = run_cli(tmp_path, capsys, f"sft.init_from={ckpts}")
    assert_config_error(tmp_path, code, err, "hidden_size=32", "model.hidden_size=64")
    other_vocab = _checkpoint(tmp_path / "vocab", hidden_size=64, vocab=1024)
    code, err = run_cli(tmp_path, capsys, f"sft.init_from={other_vocab}")
    assert_config_error(tmp_path, code, err, "vocabulary has 1024 tokens, this run's 512")
    good = _checkpoint(tmp_path / "good", hidden_size=64)
    from pipeline.cli.compose import load

    load([f"sft.init_from={good}", "experiment=tiny"])  # same shape: accepted


def test_tokenizer_larger_than_model_vocab(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tok = _tokenizer(tmp_path / "tokenizer.json", 600)
    code, err = run_cli(tmp_path, capsys, f"data.tokenizer_path={tok}", "model.vocab_size=512")
    assert_config_error(tmp_path, code, err, "model.vocab_size=512", "604 tokens")


def test_sweep_with_one_bad_trial_runs_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(tmp_path, capsys, "-m", "pretrain.lr=1e-3,-1", "run.dry_run=true")
    assert_config_error(tmp_path, code, err, "pretrain.lr=-1", "sweep trial 1 of 2", "nothing ran")


def test_help_lists_commands_groups_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for needle in (
        "python -m pipeline.status",
        "python -m pipeline.plan",
        "model ",
        "llama3.2-1b",
        "exit codes",
    ):
        assert needle in out
    assert ", schema" not in out and "schema," not in out and "hydra/" not in out
    assert re.search(r"^  3  submission failed", out, re.M)


def test_companion_commands_share_the_error_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline.cli import cancel, status
    from pipeline.cli import plan as plan_cli

    assert plan_cli.main(["model=tinyy"]) == 2
    assert LINE.match(capsys.readouterr().err.strip())
    for cmd in (status.main, cancel.main):
        assert cmd([str(tmp_path / "nope")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and LINE.match(err[0]), err


def test_pipeline_imports_no_torch_for_the_front_door() -> None:
    import subprocess
    import sys

    code = "import sys, pipeline.__main__, pipeline.submit.preflight, pipeline.cli.compose; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_preflight_constants_match_the_engine() -> None:
    from pipeline.submit import preflight

    root = Path(build.__file__).resolve().parents[2] / "engine"
    checkpointing = "".join(p.read_text() for p in (root / "checkpoint").glob("*.py"))
    assert f'MARKER = "{preflight.CHECKPOINT_MARKER}"' in checkpointing
    data = (root / "data" / "datasets.py").read_text()
    for tok in preflight.SPECIAL_TOKENS:
        assert f'"{tok}"' in data


# ---------------------------------------------------------------------------- SLURM submission failures


def _fake_bin(tmp_path: Path, sbatch: str) -> Path:
    b = tmp_path / "bin"
    b.mkdir()
    scripts = {
        "sbatch": sbatch,
        "srun": "exit 0",
        "sinfo": "echo debug",
        "scancel": "exit 0",
        "squeue": "exit 0",
    }
    for name, body in scripts.items():
        p = b / name
        p.write_text("#!/bin/sh\n" + body + "\n")
        p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return b


REJECT = 'echo "sbatch: error: Batch job submission failed: Invalid partition name specified" >&2; exit 1'


def test_no_sbatch_exit_3_nothing_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    code, err = run_cli(tmp_path, capsys, "cluster=slurm")
    assert code == 3 and len(err) == 1 and "sbatch not found on PATH" in err[0], err
    assert not (tmp_path / "runs").exists()


def test_sbatch_rejects_exit_3_nothing_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", f"{_fake_bin(tmp_path, REJECT)}:{os.environ['PATH']}")
    code, err = run_cli(tmp_path, capsys, "cluster=slurm", "cluster.partition=nope")
    assert code == 3, err
    assert len(err) == 1 and "Invalid partition name specified" in err[0] and "cluster.partition" in err[0], (
        err
    )
    assert not list((tmp_path / "runs").glob("*")), "SLURM took nothing: no run directory is left"


def test_sbatch_rejects_second_stage_leaves_a_readable_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    count = tmp_path / "count"
    body = f"n=$(cat {count} 2>/dev/null || echo 0); echo $((n+1)) > {count}\n"
    body += f'if [ "$n" = 0 ]; then echo "Submitted batch job 101"; exit 0; fi\n{REJECT}'
    monkeypatch.setenv("PATH", f"{_fake_bin(tmp_path, body)}:{os.environ['PATH']}")
    code, err = run_cli(tmp_path, capsys, "cluster=slurm", "run.stages=[data_prep,pretrain]")
    assert code == 3 and len(err) == 1 and "sbatch rejected stage 'pretrain'" in err[0], err
    (run_dir,) = (tmp_path / "runs").glob("tiny-*")
    from pipeline.cli.status import main as status_main
    from pipeline.records.ledger import Ledger
    from pipeline.submit.orchestrate import decide

    ledger = Ledger(run_dir)
    assert ledger.read("data_prep").status == "cancelled"  # type: ignore[union-attr]
    assert "Invalid partition" in (ledger.read("pretrain").error or "")  # type: ignore[union-attr]
    assert status_main([str(run_dir)]) == 1  # status reads it and shows the failure
    assert "submission failed" in capsys.readouterr().out
    cfg = compose.load_config(
        [
            "experiment=tiny",
            "cluster=slurm",
            "run.stages=[data_prep,pretrain]",
            f"run.root={tmp_path / 'runs'}",
        ]
    )
    assert decide(cfg, ledger).submit == ["data_prep", "pretrain"]  # a re-run submits everything again


# ---------------------------------------------------------------------------- run identity


def _leaves(prefix: str, obj: object) -> list[str]:
    out = []
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        v = getattr(obj, f.name)
        path = f"{prefix}.{f.name}" if prefix else f.name
        out += _leaves(path, v) if dataclasses.is_dataclass(v) else [path]
    return out


def test_run_identity_classifies_every_schema_field() -> None:
    pc = PipelineConfig()
    included: set[str] = set()
    for stage in graph.STAGES:
        own = stage_own_config(pc, stage)
        for k, v in own.items():
            if k in ("data", "model"):
                included |= {f"{k}.{x}" for x in v}
            elif k == "parallel":
                included |= {f"{stage}.parallel.{x}" for x in v}
            elif isinstance(v, dict):  # a nested stage section hashed whole (peft)
                included |= {f"{stage}.{k}.{x}" for x in v}
            else:
                included.add(f"{stage}.{k}")
    included |= {f"model.{f.name}" for f in dataclasses.fields(pc.model) if identity.hashed_when_set(f.name)}
    for stage in graph.STAGES:  # stage keys hashed only away from their defaults
        names = identity.IDENTITY_STAGE_HASHED_WHEN_SET
        included |= {
            f"{stage}.{f.name}"
            for f in dataclasses.fields(pc.stage(stage))
            if identity.hashed_when_set(f.name, names)
        }
    unclassified, both = [], []
    for leaf in _leaves("", pc):
        parts = leaf.split(".")
        reason = (
            identity.IDENTITY_EXCLUDED_SECTIONS.get(parts[0])
            or (
                len(parts) >= 2 and identity.IDENTITY_EXCLUDED_STAGE_KEYS.get(parts[1])
            )  # a whole sub-config (monitor)
            or (
                len(parts) == 3 and parts[1] == "parallel" and parts[2] not in identity.IDENTITY_PARALLEL_KEYS
            )
        )
        if leaf in included and reason:
            both.append(leaf)
        if leaf not in included and not reason:
            unclassified.append(leaf)
    assert not unclassified, f"fields neither in the run identity nor excluded with a reason: {unclassified}"
    assert not both, f"fields both hashed and excluded: {both}"
    assert all(identity.IDENTITY_EXCLUDED_SECTIONS.values()) and all(
        identity.IDENTITY_EXCLUDED_STAGE_KEYS.values()
    )


def test_spike_threshold_changes_the_run_identity_policy_does_not() -> None:
    base = identity.run_hash(PipelineConfig())
    pc = PipelineConfig()
    pc.pretrain = dataclasses.replace(pc.pretrain, grad_spike_factor=3.0)
    assert identity.run_hash(pc) != base, "dropping spiking updates changes the trajectory"
    for change in ({"nan_policy": "rollback"}, {"max_bad_steps": 3}):  # skip == rollback, bit for bit
        pc = PipelineConfig()
        pc.pretrain = dataclasses.replace(pc.pretrain, **change)  # type: ignore[arg-type]
        assert identity.run_hash(pc) == base, change


def test_every_numeric_field_has_a_domain() -> None:
    missing = []
    for cls in build._DATACLASSES.values():
        for f in dataclasses.fields(cls):
            if re.search(r"\b(int|float)\b", str(f.type)) and domains.domain_of(f) is None:
                missing.append(f"{cls.__name__}.{f.name}")
    assert not missing, missing


def test_controller_unreachable_exit_3_nothing_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    b = _fake_bin(tmp_path, "exit 0")
    (b / "sinfo").write_text(
        "#!/bin/sh\necho 'slurm_load_partitions: Unable to contact slurm controller (connect failure)' >&2\nexit 1\n"
    )
    monkeypatch.setenv("PATH", f"{b}:{os.environ['PATH']}")
    code, err = run_cli(tmp_path, capsys, "cluster=slurm")
    assert code == 3 and len(err) == 1, err
    assert "Unable to contact slurm controller" in err[0] and "scontrol ping" in err[0], err
    assert not (tmp_path / "runs").exists()


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_real_sbatch_rejects_a_nonexistent_partition(cluster: object, tmp_path: Path) -> None:
    from tests.support.slurm_helpers import TINY, fail_text, pipeline

    r = pipeline(cluster, *TINY, "cluster.partition=nope", f"run.root={tmp_path}")
    assert r.returncode == 3, fail_text(r)
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "invalid partition" in err[0].lower() and "cluster.partition" in err[0], err
    assert not any(tmp_path.iterdir()), "SLURM took nothing: nothing is left behind"


def test_stage_without_its_upstream_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(tmp_path, capsys, "run.stages=[sft]")
    assert_config_error(
        tmp_path, code, err, "run.stages=['sft']", "add them (run.stages=[data_prep,pretrain,sft])"
    )


def test_task_prompt_count_matches_the_task_code() -> None:
    from stages import tasks

    for task in ("counting", "arithmetic"):
        for n in (1, 9, 99, 999):
            assert sections.task_prompts(task, n) == tasks.space_size(n, task)


def test_slurm_only_key_with_the_local_executor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(tmp_path, capsys, "cluster.partition=gpu")
    assert_config_error(
        tmp_path, code, err, "cluster.partition='gpu'", "only cluster.executor=slurm reads it"
    )


def test_prepared_data_too_small_for_one_batch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """data_prep completed earlier (ledger + manifest) with fewer tokens than one pretrain batch."""
    from pipeline.cli.compose import load
    from pipeline.records.ledger import COMPLETED, Ledger

    cfg = load(["experiment=tiny", f"run.root={tmp_path / 'runs'}", "run.stages=[data_prep]"])
    run_dir = identity.run_dir_for(cfg)
    Ledger(run_dir).update("data_prep", status=COMPLETED, hash=identity.stage_hashes(cfg)["data_prep"])
    out = run_dir / "stages" / "data_prep"
    out.mkdir(parents=True)
    (out / "manifest.json").write_text(json.dumps({"counts": {"tokens_train": 100}}))
    code = main(["experiment=tiny", f"run.root={tmp_path / 'runs'}", "run.stages=[pretrain]"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(err) == 1 and LINE.match(err[0]), err
    assert "holds 100 tokens" in err[0] and "one global batch of pretrain: 520" in err[0], err
    assert sorted(p.name for p in run_dir.iterdir()) == ["ledger", "stages"], "nothing more written"
