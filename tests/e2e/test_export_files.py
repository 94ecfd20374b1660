"""What a run and its export leave on a shared filesystem, through the CLI: every file and directory (the
checkpoints, the exported safetensors shards and PEFT adapters, the ledger, metrics and lock files) has the
mode the umask gives, and an export of a model that started from ``hf:<dir>`` keeps that model's
``pad_token_id`` exactly (absent, null or set); an export stopped by Ctrl-C leaves nothing."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.convert.hf_export import pad_entry
from pipeline.records.files import follow_umask, umask
from tests.support.env import REPO
from tests.support.hf_models import make
from tests.support.timing import scaled


def cli(mask: int, *args: str) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=scaled(900),
        preexec_fn=lambda: os.umask(mask),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def base_model(tmp_path: Path, config: dict[str, object], generation: dict[str, object] | None) -> Path:
    """A Llama-3-style random model whose config.json has ``config``'s entries (None: the key removed) and
    whose generation_config.json has ``generation``'s (None: no such file)."""
    base = make("llama3", tmp_path / "base", tokenizer="llama3")
    cfg = json.loads((base / "config.json").read_text())
    for k, v in config.items():
        cfg.pop(k) if v is None else cfg.update({k: v})
    (base / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = base / "generation_config.json"
    if generation is None:
        gen.unlink()
    else:
        gen.write_text(json.dumps({**json.loads(gen.read_text()), **generation}, indent=2))
    return base


def train(tmp_path: Path, mask: int, base: Path, *overrides: str) -> Path:
    r = cli(
        mask,
        "pipeline",
        "experiment=tiny",
        f"run.root={tmp_path / 'runs'}",
        f"sft.init_from=hf:{base}",
        "run.stages=[data_prep,sft]",
        *overrides,
    )
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("run directory:"))
    return Path(line.split(":", 1)[1].strip())


def wrong_modes(root: Path, mask: int) -> list[str]:
    """Files and directories under ``root`` whose mode is not what the umask ``mask`` gives."""
    want = {"f": 0o666 & ~mask, "d": 0o777 & ~mask}
    bad = []
    for p in [root, *root.rglob("*")]:
        st = p.lstat()
        kind = "d" if stat.S_ISDIR(st.st_mode) else "f" if stat.S_ISREG(st.st_mode) else None
        if kind and stat.S_IMODE(st.st_mode) != want[kind]:
            bad.append(f"{oct(stat.S_IMODE(st.st_mode))} {p.relative_to(root)}")
    return bad


def export_stopped_by_ctrl_c(run_dir: Path, stage: str, target: Path) -> None:
    """SIGINT to the export's process group (as a terminal sends it) once its temporary folder exists: one line,
    exit 130, no traceback, neither ``target`` nor the temporary folder left."""
    log = target.parent / f"{target.name}.log"
    cmd = subprocess.Popen(
        [sys.executable, "-m", "pipeline.export", str(run_dir), stage, "--out", str(target)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"},
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + scaled(300)
        while not list(target.parent.glob(f".tmp.{target.name}.*")):
            assert cmd.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        os.killpg(cmd.pid, signal.SIGINT)
        rc = cmd.wait(timeout=scaled(120))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(cmd.pid, signal.SIGKILL)
        cmd.wait()
    said = log.read_text().splitlines()
    assert rc == 130 and said == [
        f"[export] stopped on Ctrl-C: nothing written to {target}; run the same command again"
    ], said
    assert not target.exists() and not list(target.parent.glob(".tmp.*")), list(target.parent.iterdir())
    log.unlink()


def pad(d: Path, name: str) -> object:
    data = json.loads((d / name).read_text())
    return data.get("pad_token_id", "absent")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_group_umask_run_and_export_pad_absent(tmp_path: Path) -> None:
    """umask 002 (a group-shared project directory): every file 0664, every directory 0775; the original has
    no pad_token_id and no generation_config.json, so neither does the export."""
    base = base_model(tmp_path, {"pad_token_id": None}, None)
    run_dir = train(tmp_path, 0o002, base)
    assert list((run_dir / "stages" / "sft" / "checkpoints").glob("iter_*/*.distcp"))
    export_stopped_by_ctrl_c(run_dir, "sft", tmp_path / "stopped")
    cli(0o002, "pipeline.export", str(run_dir), "sft")
    out = run_dir / "export" / "sft"
    assert list(out.glob("model-*.safetensors"))
    assert wrong_modes(tmp_path / "runs", 0o002) == []
    assert pad(out, "config.json") == "absent" and pad(out, "generation_config.json") == "absent"


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_default_umask_lora_export_and_adapters_pad_set_and_null(tmp_path: Path) -> None:
    """umask 022: 0644 / 0755 for the merged export and the PEFT adapters too; config.json's pad id 5 and
    generation_config.json's null stay as the original had them."""
    base = base_model(tmp_path, {"pad_token_id": 5}, {"pad_token_id": None})
    run_dir = train(tmp_path, 0o022, base, "sft.peft.method=lora")
    cli(0o022, "pipeline.export", str(run_dir), "sft")
    cli(0o022, "pipeline.export", str(run_dir), "sft", "--peft")
    assert (run_dir / "export" / "sft-peft" / "adapter_model.safetensors").is_file()
    assert wrong_modes(tmp_path / "runs", 0o022) == []
    out = run_dir / "export" / "sft"
    assert pad(out, "config.json") == 5 and pad(out, "generation_config.json") is None


def test_pad_entry_keeps_the_originals_and_defaults_to_the_tokenizer(tmp_path: Path) -> None:
    cases = {  # (config.json, generation_config.json or None: no file) -> (config entry, generation entry)
        "absent": (({}, None), ({}, {})),
        "null": (({"pad_token_id": None}, None), ({"pad_token_id": None}, {"pad_token_id": None})),
        "set": (({"pad_token_id": 0}, None), ({"pad_token_id": 0}, {"pad_token_id": 0})),
        "generation's own": (({"pad_token_id": 3}, {}), ({"pad_token_id": 3}, {})),
        "generation null": (({}, {"pad_token_id": None}), ({}, {"pad_token_id": None})),
    }
    for name, ((config, generation), want) in cases.items():
        d = tmp_path / name.replace(" ", "_")
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
        if generation is not None:
            (d / "generation_config.json").write_text(json.dumps(generation))
        got = (pad_entry(9, d, "config.json"), pad_entry(9, d, "generation_config.json"))
        assert got == want, name
    assert pad_entry(9, None, "config.json") == {"pad_token_id": 9}  # the run's own tokenizer: its pad id


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077, 0o007])
def test_follow_umask_gives_a_private_file_the_umasks_mode(mask: int, tmp_path: Path) -> None:
    f = tmp_path / "weights.safetensors"
    f.touch()
    f.chmod(0o600)
    old = os.umask(mask)
    try:
        assert umask() == mask
        follow_umask(f)
    finally:
        os.umask(old)
    assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~mask
