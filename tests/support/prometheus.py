"""A real Prometheus server for tests (Debian's ``prometheus``), and reading PromQL of the shipped rules."""

from __future__ import annotations

import contextlib
import functools
import json
import re
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import yaml

from pipeline.slurm.job_env import free_port
from tests.support.env import REPO
from tests.support.timing import scaled

RULES_DIR = REPO / "slurm" / "prometheus"
T = TypeVar("T")
KEYWORDS = {
    "by",
    "without",
    "and",
    "or",
    "unless",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers that are no function, keyword or label."""
    text = re.sub(r'"[^"]*"', "", expr)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        if text[m.end() :].lstrip().startswith("(") or m.group() in KEYWORDS:
            continue
        if m.start() and text[m.start() - 1].isdigit():  # the e of 1e5
            continue
        names.add(m.group())
    return names


def exprs_of_dashboard(dash: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=scaled(10)) as r:
        out: dict[str, Any] = json.loads(r.read())
    return out


def poll(what: str, fn: Callable[[], T | None], timeout: float, every: float = 0.25) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, KeyError):
            got = fn()
            if got:
                return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@contextlib.contextmanager
def prometheus_server(workdir: Path, target: str, rules: str) -> Iterator[str]:
    """Prometheus on a free local port scraping ``target`` every second with ``rules`` (alerts.yml text)
    evaluated every second; yields its base URL; stopped (killed if need be) on exit."""
    workdir.mkdir(parents=True)
    (workdir / "rules.yml").write_text(rules)
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(workdir / "rules.yml")],
        "scrape_configs": [{"job_name": "llm", "static_configs": [{"targets": [target]}]}],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    proc, base = _start(workdir)
    try:
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=scaled(20))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _start(workdir: Path, tries: int = 5) -> tuple[subprocess.Popen[bytes], str]:
    """Prometheus started and ready on a free port. The port is free when picked, not when Prometheus binds
    it (a test beside this one may take it meanwhile): a start that lost the port tries another one."""
    for _ in range(tries):
        port = free_port()
        cmd = [
            "prometheus",
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ]
        with (workdir / "prometheus.log").open("w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            poll("Prometheus ready", functools.partial(_ready, base, proc), timeout=scaled(60))
            return proc, base
        except AssertionError:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if "address already in use" not in (workdir / "prometheus.log").read_text():
                raise
    raise AssertionError(f"prometheus found no free port in {tries} tries ({workdir / 'prometheus.log'})")


def _ready(base: str, proc: subprocess.Popen[bytes]) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"prometheus exited with {proc.returncode}")
    with urllib.request.urlopen(f"{base}/-/ready", timeout=scaled(5)) as r:
        return bool(r.status == 200)
