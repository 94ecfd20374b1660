"""Prometheus sink: rank 0's training figures as Prometheus metrics (``monitor.sinks: [prometheus]``).

Two ways out, both from one registry (prometheus-client):

- an HTTP endpoint (``monitor.prometheus_port``; 0 = a free port) on rank 0, its address written to
  ``<stage dir>/prometheus.json`` (``{"host", "port", "url"}``) so a scraper or a file_sd job can find it: a
  job's node and port change with every attempt, a file in the run directory does not;
- a textfile (``monitor.prometheus_textfile_dir``) for node_exporter's textfile collector, rewritten
  atomically at every logged step: for clusters that scrape only node exporters (no port opened by jobs).

Every series carries ``run`` (the run directory's name) and ``stage`` labels. Names (``NAMES``) are what
slurm/prometheus/alerts.yml and dashboard.json use; tests check both against this list.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from engine.train.callback import Callback, StageInfo, StepView
from pipeline.records.files import atomic_write_text
from pipeline.schema.stage_sections import MonitorConfig

GAUGES = {
    "llm_step": "Optimizer steps done",
    "llm_iters": "Optimizer steps the stage runs in all",
    "llm_loss": "Training loss of the last logged step",
    "llm_grad_norm": "Gradient norm of the last logged step",
    "llm_learning_rate": "Learning rate of the last logged step",
    "llm_tokens_per_second": "Training tokens per second over the last log interval",
    "llm_mfu_ratio": "Model FLOPs utilisation (0..1) over the last log interval",
    "llm_memory_used_bytes": "Peak memory of rank 0 over the last log interval (CUDA allocated, or CPU RSS)",
    "llm_memory_used_ratio": "llm_memory_used_bytes over the device's (or host's) total memory",
    "llm_gpu_utilization_ratio": "GPU utilisation of rank 0's device (0..1; NVML, GPU jobs only)",
    "llm_loss_swings_in_a_row": "Logged losses in a row each off the one before by more than monitor.loss_swing",
    "llm_valid_loss": "Validation loss of the last evaluation",
    "llm_attempt": "The stage's attempt number (1 = first start; the ledger's count)",
    "llm_goodput_ratio": "Seconds spent in training steps over seconds since this attempt's sink started",
    "llm_last_step_timestamp_seconds": "Unix time of the last finished optimizer step",
    "llm_checkpoint_save_seconds": "Duration of the last checkpoint save",
}
COUNTERS = {"llm_alarms": "Alarms raised by the stage (label alarm)"}
BY_NODE = {
    "llm_straggler_score": "A node's slowest rank's own step time over its pipeline stage's median at the last "
    "straggler check (label node; cluster.health.straggler_interval)"
}
NAMES = (*GAUGES, *BY_NODE, *(f"{c}_total" for c in COUNTERS))
"""Every metric name the sink exports (counters with Prometheus's ``_total`` suffix)."""
FIELDS = {
    "loss": "llm_loss",
    "grad_norm": "llm_grad_norm",
    "lr": "llm_learning_rate",
    "tokens_per_s": "llm_tokens_per_second",
    "mfu": "llm_mfu_ratio",
}
"""metrics.jsonl keys of a train line -> gauge."""
GiB = 1024**3


class Prometheus(Callback):
    def __init__(self, mon: MonitorConfig, info: StageInfo) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.mon, self.info = mon, info
        self.registry = CollectorRegistry()
        labels = {"run": info.run_dir.name if info.run_dir else "", "stage": info.name}
        self.gauges = {n: Gauge(n, h, list(labels), registry=self.registry) for n, h in GAUGES.items()}
        self.alarms = Counter(
            "llm_alarms", COUNTERS["llm_alarms"], [*labels, "alarm"], registry=self.registry
        )
        self.by_node = {n: Gauge(n, h, [*labels, "node"], registry=self.registry) for n, h in BY_NODE.items()}
        self.labels = labels
        self.server: Any = None
        self.started = time.time()
        self.last_end: float | None = None
        self.stepping_s = 0.0
        self.prev_loss: float | None = None
        self.swings = 0
        self._set("llm_iters", info.iters)
        self._set("llm_attempt", info.attempt)

    def _set(self, name: str, value: float) -> None:
        """A series exists from its first value on (a GPU figure on a CPU job is absent, never 0)."""
        self.gauges[name].labels(**self.labels).set(value)

    def on_train_start(self, view: StepView) -> None:
        self._set("llm_step", view.step)
        self._set("llm_last_step_timestamp_seconds", time.time())
        self.last_end = time.time()
        if self.mon.prometheus_http:
            self._serve()

    def _serve(self) -> None:
        from prometheus_client import start_http_server

        self.server, _ = start_http_server(self.mon.prometheus_port, self.mon.prometheus_addr, self.registry)
        port = int(self.server.server_port)
        host = socket.gethostname()
        where = {"host": host, "port": port, "url": f"http://{host}:{port}/metrics", "pid": os.getpid()}
        atomic_write_text(self.info.out_dir / "prometheus.json", json.dumps(where) + "\n")

    def on_step_end(self, view: StepView) -> None:
        now = time.time()
        if self.last_end is not None:
            self.stepping_s += now - self.last_end
        self.last_end = now
        self._set("llm_step", view.step)
        self._set("llm_last_step_timestamp_seconds", now)
        self._set("llm_goodput_ratio", self.stepping_s / max(now - self.started, 1e-9))
        if not view.logged:
            return
        for key, name in FIELDS.items():
            v = view.metrics.get(key)
            if isinstance(v, (int, float)):
                self._set(name, float(v))
        self._swing(view.metrics.get("loss"))
        self._memory(view.metrics)
        self._write_textfile()

    def _swing(self, loss: Any) -> None:
        """Count logged losses in a row that moved more than ``loss_swing`` (either way) from the one before."""
        if not isinstance(loss, (int, float)):
            return
        prev, self.prev_loss = self.prev_loss, float(loss)
        if prev is not None:
            moved = abs(loss - prev) > self.mon.loss_swing * abs(prev)
            self.swings = self.swings + 1 if moved else 0
        self._set("llm_loss_swings_in_a_row", self.swings)

    def _memory(self, m: Any) -> None:
        used_gb, total = memory_figures(m)
        if used_gb is not None:
            self._set("llm_memory_used_bytes", used_gb * GiB)
            if total:
                self._set("llm_memory_used_ratio", used_gb * GiB / total)
        util = gpu_utilization()
        if util is not None:
            self._set("llm_gpu_utilization_ratio", util)

    def on_eval(self, view: StepView) -> None:
        v = view.metrics.get("loss")
        if isinstance(v, (int, float)):
            self._set("llm_valid_loss", float(v))

    def on_save(self, view: StepView) -> None:
        v = view.metrics.get("save_s")
        if isinstance(v, (int, float)):
            self._set("llm_checkpoint_save_seconds", float(v))
            self.last_end = time.time()  # a save is not training time

    def on_alarm(self, view: StepView) -> None:
        self.alarms.labels(**self.labels, alarm=str(view.metrics.get("alarm", "unknown"))).inc()
        self._write_textfile()

    def on_straggler(self, view: StepView) -> None:
        for node, score in dict(view.metrics.get("nodes", {})).items():
            self.by_node["llm_straggler_score"].labels(**self.labels, node=str(node)).set(float(score))

    def on_train_end(self, view: StepView) -> None:
        self._write_textfile()

    def _write_textfile(self) -> None:
        if not self.mon.prometheus_textfile_dir:
            return
        from prometheus_client import generate_latest

        name = f"llm_{self.labels['run']}_{self.info.name}.prom"
        atomic_write_text(
            Path(self.mon.prometheus_textfile_dir) / name, generate_latest(self.registry).decode()
        )

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def memory_figures(m: Any) -> tuple[float | None, float | None]:
    """(GiB used by rank 0 from a train line, the device's or host's total bytes)."""
    if isinstance(m.get("mem_alloc_gb"), (int, float)):
        import torch

        return float(m["mem_alloc_gb"]), float(
            torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        )
    if isinstance(m.get("mem_rss_gb"), (int, float)):
        import psutil

        return float(m["mem_rss_gb"]), float(psutil.virtual_memory().total)
    return None, None


def gpu_utilization() -> float | None:
    """NVML's utilisation of this rank's device (0..1), or None without a GPU or NVML."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        return float(torch.cuda.utilization()) / 100.0
    except Exception:  # pynvml missing or NVML unavailable: the series is left out
        return None


def sink(mon: MonitorConfig, info: StageInfo) -> Callback:
    """``monitor.sinks: [prometheus]``: an HTTP endpoint on rank 0 and/or a textfile (see the module)."""
    return Prometheus(mon, info)
