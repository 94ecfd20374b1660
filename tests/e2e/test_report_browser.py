"""One tiny run through ``python -m pipeline`` (cluster=debug, W&B offline): its HTML report in headless
Chromium, its W&B offline history, and ``pipeline.status --watch`` in a tmux terminal."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.support.env import REPO as ROOT
from tests.support.metrics import tb_scalars
from tests.support.timing import scaled

CHROMIUM = shutil.which("chromium")
TMUX = shutil.which("tmux")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}  # no credentials: offline
    r = subprocess.run(
        [sys.executable, "-m", "pipeline", "experiment=tiny", "cluster=debug", f"run.root={root}",
         "pretrain.monitor.sinks=[tensorboard,wandb]"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=scaled(900),
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (run,) = [p for p in root.iterdir() if (p / "ledger").is_dir()]
    assert f"report: {run / 'report.html'}" in r.stdout
    return run


def chromium(url: str, tmp: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM
    args = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp / 'profile'}",
        "--enable-logging=stderr", "--v=0", *extra, url,
    ]  # fmt: skip
    return subprocess.run(args, capture_output=True, text=True, timeout=scaled(180))


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (scripts/install-test-deps.sh)")
def test_report_renders_in_chromium_with_every_plot_and_the_eval_numbers(
    run_dir: Path, tmp_path: Path
) -> None:
    report = run_dir / "report.html"
    page = report.read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page), "the report must not load anything"
    r = chromium(report.as_uri(), tmp_path, "--dump-dom")
    dom = r.stdout
    assert "<body" in dom, r.stderr[-2000:]
    body = re.search(r"<body([^>]*)>", dom)
    assert body is not None
    attrs = dict(re.findall(r'([\w-]+)="([^"]*)"', body.group(1)))
    assert "data-errors" not in attrs, attrs  # the page's error handler writes errors there
    assert not re.search(r"CONSOLE.*(Uncaught|Error)", r.stderr), r.stderr[-2000:]
    plots = int(attrs["data-plots"])
    assert plots == 15 and int(attrs["data-plots-drawn"]) == plots  # 5 curves x pretrain, sft, rlhf
    for fig in re.findall(r'<figure class="plot" data-points="(\d+)"', dom):
        assert int(fig) > 0
    # the eval table's numbers are the results file's
    results = json.loads((run_dir / "stages" / "eval" / "results.json").read_text())["models"]
    table = re.search(r'<table class="eval-table">(.*?)</table>', dom, re.S)
    assert table is not None
    rows = re.findall(r"<tr><td>(\w+)</td>(.*?)</tr>", table.group(1), re.S)
    assert [name for name, _ in rows] == list(results)
    for name, cells in rows:
        values = [json.loads(v) for v in re.findall(r'data-value="([^"]*)"', cells)]
        want = [results[name][k] for k in ("iteration", "valid_loss", "perplexity", "task_accuracy",
                                           "pref_accuracy", "pref_margin")]  # fmt: skip
        assert values == want
    shot = tmp_path / "report.png"
    r = chromium(report.as_uri(), tmp_path, f"--screenshot={shot}", "--window-size=1300,2000")
    assert shot.exists() and shot.stat().st_size > 20_000, r.stderr[-2000:]
    if os.environ.get("REPORT_SCREENSHOT"):  # refresh docs/report.png: REPORT_SCREENSHOT=docs/report.png
        shutil.copy(shot, ROOT / os.environ["REPORT_SCREENSHOT"])


def wandb_history(offline_run: Path) -> list[dict[str, Any]]:
    """History rows of a W&B offline run file (LevelDB-style log of protobuf records, 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = offline_run.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf, rows = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        buf, pos = buf + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last fragment of one
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                rows.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                )
    return rows


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_wandb_offline_run_holds_the_history_and_tensorboard_the_same_values(run_dir: Path) -> None:
    stage = run_dir / "stages" / "pretrain"
    train = [json.loads(x) for x in (stage / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in train if x["kind"] == "train"]
    (run_file,) = glob.glob(str(stage / "wandb" / "offline-run-*" / "*.wandb"))
    rid = (stage / "wandb" / "run_id").read_text().strip()
    assert rid in run_file
    rows = [r for r in wandb_history(Path(run_file)) if "train/loss" in r]
    assert [r["_step"] for r in rows] == [x["step"] for x in train]
    assert [r["train/loss"] for r in rows] == pytest.approx([x["loss"] for x in train])
    tb = tb_scalars(stage / "tensorboard")
    assert [tb["train/mfu"][x["step"]] for x in train] == pytest.approx([x["mfu"] for x in train], rel=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(TMUX is None, reason="needs tmux (scripts/install-test-deps.sh)")
def test_status_watch_redraws_in_place_in_a_terminal(run_dir: Path, tmp_path: Path) -> None:
    """A stage marked running: --watch redraws one screen in place and shows new metrics lines."""
    from pipeline.records.ledger import Ledger

    run = tmp_path / "live"
    shutil.copytree(run_dir / "ledger", run / "ledger")
    Ledger(run).update("rlhf", status="running")
    metrics = run / "stages" / "rlhf" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)

    def step(n: int) -> None:
        rec = {
            "kind": "train",
            "step": n,
            "iters": 9,
            "loss": 1.5,
            "tokens_per_s": 10.0,
            "mfu": 0.25,
            "mem_rss_gb": 0.5,
        }
        with open(metrics, "a") as f:
            f.write(json.dumps(rec) + "\n")

    step(1)
    session = f"obs-{uuid.uuid4().hex[:8]}"
    cmd = f"cd {ROOT} && {sys.executable} -m pipeline.status {run} --watch 0.2"
    subprocess.run([TMUX, "new-session", "-d", "-s", session, "-x", "160", "-y", "50", cmd], check=True)
    try:

        def screen() -> str:
            return subprocess.run(
                [TMUX, "capture-pane", "-p", "-t", session], capture_output=True, text=True
            ).stdout

        def wait_for(text: str) -> str:
            deadline = time.monotonic() + scaled(60)
            while time.monotonic() < deadline:
                s = screen()
                if text in s:
                    return s
                time.sleep(0.1)
            raise AssertionError(f"{text!r} never shown:\n{screen()}")

        first = wait_for("[rlhf] step 1/9")
        assert "MFU 25.0%" in first and "mem 0.50 GiB" in first
        step(2)
        s = wait_for("[rlhf] step 2/9")
        assert s.count("run directory:") == 1 and "step 1/9" not in s  # redrawn in place, not appended
        Ledger(run).update("rlhf", status="completed")
        deadline = time.monotonic() + scaled(60)
        while (
            time.monotonic() < deadline
            and session in subprocess.run([TMUX, "ls"], capture_output=True, text=True).stdout
        ):
            time.sleep(0.1)
        assert session not in subprocess.run([TMUX, "ls"], capture_output=True, text=True).stdout  # it exited
    finally:
        subprocess.run([TMUX, "kill-session", "-t", session], capture_output=True)
