"""The prometheus sink: its series over HTTP and in a textfile; the shipped alert rules (promtool) and dashboard
use only exported names; a real Prometheus server scrapes a running tiny job and fires the stall alert."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.callbacks.prometheus import NAMES, sink
from engine.train.callback import StageInfo, view
from pipeline.schema.stage_sections import MonitorConfig
from tests.support.prometheus import (
    RULES_DIR,
    exprs_of_dashboard,
    get_json,
    metric_names,
    poll,
    prometheus_server,
)
from tests.support.timing import scaled

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (scripts/install-test-deps.sh)"
)


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=scaled(10)) as r:
        return str(r.read().decode())


def test_sink_serves_its_series_and_writes_a_textfile(tmp_path: Path) -> None:
    info = StageInfo("pretrain", tmp_path / "stage", tmp_path / "run-x", iters=10, attempt=2)
    info.out_dir.mkdir()
    mon = MonitorConfig(
        sinks=["prometheus"], prometheus_addr="127.0.0.1", prometheus_textfile_dir=str(tmp_path)
    )
    s = sink(mon, info)
    try:
        s.on_train_start(view(info, 0))
        for step, loss in enumerate(
            [5.0, 6.0, 4.0, 6.0, 6.1], start=1
        ):  # swings: +20%, -33%, +50%, then calm
            s.on_step_end(
                view(info, step, {"loss": loss, "tokens_per_s": 99.0, "mfu": 0.2, "mem_rss_gb": 0.5}, True)
            )
            if step == 4:
                swings = _value(_scrape(_url(info)), "llm_loss_swings_in_a_row")
        s.on_alarm(view(info, 5, {"kind": "alarm", "alarm": "grad_norm"}))
        s.on_straggler(view(info, 5, {"kind": "straggler", "nodes": {"node1": 0.98, "node2": 1.43}}))
        text = _scrape(_url(info))
    finally:
        s.close()
    assert swings == 3.0 and _value(text, "llm_loss_swings_in_a_row") == 0.0
    assert (
        _value(text, "llm_step") == 5
        and _value(text, "llm_attempt") == 2
        and _value(text, "llm_mfu_ratio") == 0.2
    )
    assert 0 < _value(text, "llm_memory_used_ratio") < 1 and 0 < _value(text, "llm_goodput_ratio") <= 1
    assert 'llm_alarms_total{alarm="grad_norm",run="run-x",stage="pretrain"} 1.0' in text
    assert 'llm_straggler_score{node="node2",run="run-x",stage="pretrain"} 1.43' in text
    assert "llm_gpu_utilization_ratio{" not in text, "a CPU job has no GPU series (absent, never 0)"
    assert "llm_loss{" in (tmp_path / "llm_run-x_pretrain.prom").read_text()
    with pytest.raises(OSError):  # closed: nothing listens any more
        _scrape(_url(info))


def _url(info: StageInfo) -> str:
    where = json.loads((info.out_dir / "prometheus.json").read_text())
    return f"http://127.0.0.1:{where['port']}/metrics"


def _value(text: str, name: str) -> float:
    (line,) = [ln for ln in text.splitlines() if ln.startswith(name + "{")]
    return float(line.rsplit(" ", 1)[1])


def test_monitor_keys_are_checked() -> None:
    from pipeline.schema.errors import ConfigError

    with pytest.raises(ConfigError, match="prometheus_port"):
        MonitorConfig(prometheus_port=70000)
    with pytest.raises(ConfigError, match="loss_swing"):
        MonitorConfig(loss_swing=0)


def test_alert_rules_and_dashboard_use_only_exported_names() -> None:
    rules = yaml.safe_load((RULES_DIR / "alerts.yml").read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    assert alerts == {
        "LLMGPUUtilizationLow",
        "LLMMemoryHigh",
        "LLMLossSwinging",
        "LLMGradNormHigh",
        "LLMTrainingStalled",
    }
    dash = exprs_of_dashboard(json.loads((RULES_DIR / "dashboard.json").read_text()))
    assert len(dash) >= 10
    for expr in exprs + dash:
        names = metric_names(expr)
        assert names and names <= set(NAMES), f"{expr!r} uses {names - set(NAMES)}, not exported"
    assert metric_names('rate(llm_stepz{run="a"}[5m]) by (x)') == {"llm_stepz"}  # the checker can fail


@needs_promtool
def test_promtool_checks_the_rules_and_their_unit_tests_pass() -> None:
    for args in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"]):
        r = subprocess.run(
            [PROMTOOL, *args], cwd=RULES_DIR, capture_output=True, text=True, timeout=scaled(120)
        )
        assert r.returncode == 0, r.stdout + r.stderr
    tests = yaml.safe_load((RULES_DIR / "alerts_test.yml").read_text())["tests"]
    cases = [c for t in tests for c in t["alert_rule_test"]]
    for alert in (
        "LLMGPUUtilizationLow",
        "LLMMemoryHigh",
        "LLMLossSwinging",
        "LLMGradNormHigh",
        "LLMTrainingStalled",
    ):
        mine = [c for c in cases if c["alertname"] == alert]
        assert any(c["exp_alerts"] for c in mine) and any(not c["exp_alerts"] for c in mine), alert


@needs_promtool
def test_a_wrong_expectation_fails_promtool(tmp_path: Path) -> None:
    shutil.copy(RULES_DIR / "alerts.yml", tmp_path)
    text = (
        (RULES_DIR / "alerts_test.yml").read_text().replace("values: '1.5 99999 250000'", "values: '1.5 9 9'")
    )
    (tmp_path / "alerts_test.yml").write_text(text)
    r = subprocess.run(
        [PROMTOOL, "test", "rules", "alerts_test.yml"], cwd=tmp_path, capture_output=True, timeout=scaled(120)
    )
    assert r.returncode != 0


def _query(base: str, q: str) -> list[dict[str, Any]]:
    out = get_json(f"{base}/api/v1/query?query={urllib.parse.quote(q)}")
    return list(out["data"]["result"])


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed")
# the limit is above its waits' budgets (180 + 60 + 90 + 60 + 60 s): they fail first, naming the wait
@pytest.mark.timeout(480)
def test_real_prometheus_scrapes_a_running_job_and_its_stall_alert_fires(tmp_path: Path) -> None:
    import os
    import signal

    from tests.support import cli

    base = ["experiment=tiny", "run.stages=[data_prep,pretrain]", "pretrain.monitor.sinks=[prometheus]"]
    base += ["pretrain.monitor.prometheus_addr=127.0.0.1", "pretrain.hang_timeout_s=240"]
    job = cli.start(tmp_path / "runs", *base, fault="hang@step:3")  # steps 1-2, then no progress: a stall
    try:
        where = poll("the job's prometheus.json", lambda: _where(tmp_path / "runs"), timeout=scaled(180))
        target = f"127.0.0.1:{where['port']}"
        stall = (RULES_DIR / "alerts.yml").read_text().replace("> 600", "> 3")  # seconds, not 10 minutes
        with prometheus_server(tmp_path / "prom", target, stall) as api:
            got = poll(
                "llm_step == 2 in Prometheus",
                lambda: [r for r in _query(api, "llm_step") if r["value"][1] == "2"],
                timeout=scaled(90),
            )
            assert got[0]["metric"]["stage"] == "pretrain" and got[0]["metric"]["instance"] == target
            assert _query(api, "llm_loss") and _query(api, "llm_tokens_per_second"), "series scraped"
            firing = poll(
                "LLMTrainingStalled firing",
                lambda: [
                    a
                    for a in get_json(f"{api}/api/v1/alerts")["data"]["alerts"]
                    if a["labels"]["alertname"] == "LLMTrainingStalled" and a["state"] == "firing"
                ],
                timeout=scaled(60),
            )
            assert firing[0]["labels"]["stage"] == "pretrain"
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=scaled(60))


def _where(root: Path) -> dict[str, Any] | None:
    found = list(root.glob("*/stages/pretrain/prometheus.json"))
    return json.loads(found[0].read_text()) if found else None


def test_metric_name_checker_sees_through_functions_and_matchers() -> None:
    assert metric_names("time() - llm_last_step_timestamp_seconds > 600 and llm_step < llm_iters") == {
        "llm_last_step_timestamp_seconds",
        "llm_step",
        "llm_iters",
    }
