"""The front door on a machine that is not the cluster (a laptop, where jobs are prepared), through the CLI:
dry runs and plans need no SLURM command on PATH; a relative path that is not there names the directory it
was resolved against; ``cluster.gpus_per_node`` > 0 under the local executor on a machine without that many
GPUs is a config error instead of a silent CPU run."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.__main__ import main
from pipeline.submit.preflight import local_gpus
from tests.support.env import REPO
from tests.support.timing import scaled

SLURM_TOOLS = ("sbatch", "srun", "sinfo", "squeue", "scancel", "sacct", "scontrol")
BASIC_TOOLS = ("sh", "bash", "env", "cat", "ls", "uname", "id", "mkdir", "rm", "cp", "mv", "ln", "git", "sed")
LINE = re.compile(r"^config error: \S+=.*: .+$")


def no_slurm_path(tmp_path: Path) -> str:
    """A PATH with the venv's bin and links to the basic tools, and no SLURM command (even where the machine
    has SLURM installed in /usr/bin)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in BASIC_TOOLS:
        found = shutil.which(tool)
        if found and Path(found).name not in SLURM_TOOLS:
            (bin_dir / tool).symlink_to(found)
    path = f"{Path(sys.executable).parent}:{bin_dir}"
    assert all(shutil.which(t, path=path) is None for t in SLURM_TOOLS), path
    return path


def cli(
    tmp_path: Path, module: str, *overrides: str, path: str | None = None, cwd: Path = REPO
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if path is not None:
        env["PATH"] = path
    return subprocess.run(
        [sys.executable, "-m", module, "experiment=tiny", f"run.root={tmp_path / 'runs'}", *overrides],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )


# ---------------------------------------------------------------------------- no SLURM on PATH


DRY_RUNS = {
    "slurm profile": (["cluster=slurm"], ["#SBATCH --nodes=1", "srun "]),
    "gpu_ib, two nodes of TP4": (
        [
            "cluster=gpu_ib",
            "pretrain.parallel.tp=4",
            "pretrain.parallel.nodes=2",
            "pretrain.parallel.global_batch_size=64",
            "run.stages=[data_prep,pretrain]",
        ],
        ["#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu"],
    ),
    "local profile": (
        [],
        ["=== eval: {", "=== eval:sft: a job of its own after data_prep, sft", "#SBATCH --ntasks-per-node=1"],
    ),
    "data prep under MPI": (
        ["cluster=slurm", "data_prep.launcher=mpi", "run.stages=[data_prep]"],
        ["--mpi="],
    ),
}


@pytest.mark.parametrize("case", list(DRY_RUNS))
def test_dry_run_renders_sbatch_scripts_without_slurm(case: str, tmp_path: Path) -> None:
    overrides, needles = DRY_RUNS[case]
    r = cli(tmp_path, "pipeline", *overrides, "run.dry_run=true", path=no_slurm_path(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "dry run (nothing submitted)" in r.stdout and "#!/bin/bash" in r.stdout
    for n in needles:
        assert n in r.stdout, (n, r.stdout[-3000:])
    assert not (tmp_path / "runs").exists(), "a dry run writes nothing"


@pytest.mark.parametrize("profile", ["cluster=slurm", "cluster=gpu_ib"])
def test_plan_without_slurm(profile: str, tmp_path: Path) -> None:
    r = cli(tmp_path, "pipeline.plan", profile, path=no_slurm_path(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "checkpoint" in r.stdout


def test_real_submission_without_slurm_exits_3_in_one_line(tmp_path: Path) -> None:
    r = cli(tmp_path, "pipeline", "cluster=slurm", path=no_slurm_path(tmp_path))
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 3 and len(err) == 1, r.stderr[-2000:]
    assert err[0].startswith("submission failed: sbatch not found on PATH") and "cluster=local" in err[0]
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------- relative paths


RELATIVE = {
    "data.text_paths": ["data.corpus=files", "data.text_paths=[texts/a.txt]"],
    "data.text_paths (glob)": ["data.corpus=files", "data.text_paths=[texts/*.txt]"],
    "data.tokenizer_path (file)": ["data.tokenizer_path=tok/tokenizer.json"],
    "data.tokenizer_path (dir)": ["data.tokenizer_path=tok"],
    "data.chat_template": ["data.chat_template=templates/chat.jinja"],
    "sft.init_from": ["sft.init_from=old-run/checkpoints"],
    "rlhf.init_from": ["rlhf.init_from=old/sft/checkpoints"],
    "sft.init_from (hf:)": ["sft.init_from=hf:models/llama"],
    "eval.models (hf:)": ["eval.models=[hf:models/llama]"],
}
DATA_FILES = {  # pipeline.schema.data_identity.check_data_inputs: the resolved path (key not named yet)
    "data.sources[0].path": ["data.corpus=sources", "data.sources=[{path:texts/a.jsonl,format:jsonl}]"],
    "data.sft_paths": ["data.sft_paths=[chat/sft.jsonl]"],
    "data.pref_paths": ["data.pref_paths=[chat/pref.jsonl]"],
}


def in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str], *overrides: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = main(["experiment=tiny", f"run.root={tmp_path / 'runs'}", *overrides])
    return code, [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


def one_line(tmp_path: Path, code: int, err: list[str]) -> str:
    assert code == 2 and len(err) == 1 and LINE.match(err[0]), err
    assert not (tmp_path / "runs").exists(), "a config error writes nothing"
    return err[0]


@pytest.mark.parametrize("case", list(RELATIVE))
def test_missing_relative_path_names_the_directory_it_was_resolved_against(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd = tmp_path / "project"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    line = one_line(tmp_path, *in_process(tmp_path, capsys, *RELATIVE[case], "run.dry_run=true"))
    key, rel = RELATIVE[case][-1].split("=", 1)
    rel = rel.strip("[]").removeprefix("hf:")
    assert line.startswith(f"config error: {key}="), line
    assert (
        f"{rel} does not exist (a relative path, resolved against the working directory {cwd})" in line
        or (
            f"the pattern matches no file (a relative path, resolved against the working directory {cwd})"
            in line
        )
    ), line


@pytest.mark.parametrize("case", list(DATA_FILES))
def test_missing_relative_data_file_shows_where_it_was_looked_for(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd = tmp_path / "project"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    code, err = in_process(tmp_path, capsys, *DATA_FILES[case], "run.dry_run=true")
    assert code == 2 and len(err) == 1 and str(cwd) in err[0], err


def test_absolute_missing_path_says_nothing_about_directories(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = one_line(tmp_path, *in_process(tmp_path, capsys, f"sft.init_from={tmp_path}/gone"))
    assert line.endswith(f"{tmp_path}/gone does not exist"), line
    line = one_line(tmp_path, *in_process(tmp_path, capsys, f"sft.init_from=hf:{REPO / 'README.md'}"))
    assert line.endswith("README.md is not a directory"), line


# ---------------------------------------------------------------------------- GPUs of a local run


def _dev(root: Path, *names: str) -> Path:
    root.mkdir(parents=True)
    for n in names:
        (root / n).touch()
    return root


def test_local_gpus_counts_device_files_without_torch(tmp_path: Path) -> None:
    nvidia = (
        "nvidia0",
        "nvidia1",
        "nvidia3",
        "nvidiactl",
        "nvidia-uvm",
        "nvidia-uvm-tools",
        "nvidia-modeset",
    )
    assert local_gpus(_dev(tmp_path / "a", *nvidia), smi=None) == 3
    assert local_gpus(_dev(tmp_path / "b", "nvidiactl", "null"), smi=None) == 0  # a driver, no device
    assert local_gpus(_dev(tmp_path / "c", "kfd"), smi=None) is None  # ROCm: not counted, not refused
    assert local_gpus(_dev(tmp_path / "d", "dxg"), smi=None) is None  # WSL
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-1)'\necho 'GPU 1: NVIDIA H200 (UUID: GPU-2)'\n"
    )
    smi.chmod(0o755)
    assert local_gpus(_dev(tmp_path / "e"), smi=str(smi)) == 2
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    assert local_gpus(_dev(tmp_path / "f"), smi=str(smi)) == 0


def _more_gpus_than_here() -> int:
    have = local_gpus()
    if have is None:
        pytest.skip("this machine may have GPUs that /dev does not count (ROCm, WSL)")
    return have + 1


@pytest.mark.parametrize("executor", ["local", "debug"])
def test_more_gpus_than_this_machine_has_is_a_config_error(
    executor: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    n = _more_gpus_than_here()
    overrides = [f"cluster.executor={executor}", f"cluster.gpus_per_node={n}", f"pretrain.parallel.dp={n}"]
    overrides += [f"pretrain.parallel.global_batch_size={8 * n}", "pretrain.parallel.micro_batch_size=1"]
    for dry in ("false", "true"):
        line = one_line(tmp_path, *in_process(tmp_path, capsys, *overrides, f"run.dry_run={dry}"))
        assert line.startswith(f"config error: cluster.gpus_per_node={n}: pretrain would run"), line
        assert f"cluster.executor={executor}" in line and "cluster.gpus_per_node=0" in line, line


def test_gpus_are_not_checked_here_for_slurm_jobs_or_cpu_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", no_slurm_path(tmp_path))
    code, err = in_process(tmp_path, capsys, "cluster=gpu_ib", "run.dry_run=true")
    assert code == 0, err
    n = _more_gpus_than_here()
    code, err = in_process(
        tmp_path, capsys, f"cluster.gpus_per_node={n}", "run.stages=[data_prep]", "run.dry_run=true"
    )
    assert code == 0, err  # data prep runs on CPUs whatever the node has
    code, err = in_process(tmp_path, capsys, "cluster.gpus_per_node=0", "run.dry_run=true")
    assert code == 0, err
