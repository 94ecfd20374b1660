"""Alarms: loss spike, gradient-norm explosion, throughput drop, no progress, MoE routing collapse (rank 0 only).

Each firing writes ``{"kind": "alarm", "alarm", "step", "message", "value", "threshold"}`` to the stage's
metrics.jsonl and a warning to the log; ``pipeline.submit.launch`` copies the alarm lines into the run's
events.jsonl when the stage's job ends and ``python -m pipeline.status`` lists them while it runs.
Thresholds: ``<stage>.monitor.alarm_*`` (pipeline.schema.stage_sections.MonitorConfig).
"""

from __future__ import annotations

import logging
import math
import re
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from engine.train.callback import Callback, StepView
from pipeline.schema.stage_sections import MonitorConfig

log = logging.getLogger(__name__)

LOSS_SPIKE, GRAD_NORM, THROUGHPUT, STALL = "loss_spike", "grad_norm", "throughput_drop", "stall"
ROUTING_COLLAPSE = "routing_collapse"
_TOKENS_MAX = re.compile(r"^moe_layer(\d+)_tokens_max$")


class Alarms(Callback):
    def __init__(
        self,
        cfg: MonitorConfig,
        write: Callable[[dict[str, Any]], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg, self.write, self.clock = cfg, write, clock
        self.losses: list[float] = []
        self.speeds: list[float] = []
        self.fired: list[dict[str, Any]] = []
        self.step = 0
        self.last_progress = clock()
        self._stalled_at: int | None = None
        self._collapsed: dict[int, int] = {}
        """MoE layer -> logged lines in a row with a collapsed routing."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def fire(self, alarm: str, step: int, message: str, value: float, threshold: float) -> None:
        rec = {"kind": "alarm", "alarm": alarm, "step": step, "message": message}
        rec |= {"value": value, "threshold": threshold}
        self.fired.append(rec)
        log.warning("ALARM %s at step %d: %s", alarm, step, message)
        self.write(rec)

    # ------------------------------------------------------------------ hooks

    def on_train_start(self, view: StepView) -> None:
        self.step, self.last_progress = view.step, self.clock()
        if self.cfg.alarm_stall_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="stall-alarm", daemon=True)
            self._thread.start()

    def on_step_end(self, view: StepView) -> None:
        self.step, self.last_progress, self._stalled_at = view.step, self.clock(), None
        if view.logged and not view.metrics.get("skipped"):
            self.check(view.step, view.metrics)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    # ------------------------------------------------------------------ checks

    def check(self, step: int, m: Any) -> None:
        """Judge one logged train line against the thresholds and the running figures before it."""
        c = self.cfg
        loss, gn, tps = m.get("loss"), m.get("grad_norm"), m.get("tokens_per_s")
        if isinstance(gn, (int, float)) and c.alarm_grad_norm > 0 and not gn <= c.alarm_grad_norm:
            self.fire(
                GRAD_NORM, step, f"gradient norm {gn:.4g} > {c.alarm_grad_norm:.4g}", gn, c.alarm_grad_norm
            )
        if isinstance(loss, (int, float)) and math.isfinite(loss):
            if c.alarm_loss_spike and len(self.losses) >= max(c.alarm_warmup, 1):
                mean = statistics.fmean(self.losses)
                if loss > c.alarm_loss_spike * mean:
                    msg = f"loss {loss:.4g} > {c.alarm_loss_spike:g} x running mean {mean:.4g}"
                    self.fire(LOSS_SPIKE, step, msg, loss, c.alarm_loss_spike * mean)
            self.losses = (self.losses + [loss])[-50:]
        if isinstance(tps, (int, float)) and math.isfinite(tps):
            if c.alarm_throughput_drop and len(self.speeds) >= max(c.alarm_warmup, 1):
                med = statistics.median(self.speeds)
                if tps < c.alarm_throughput_drop * med:
                    msg = f"{tps:,.0f} tokens/s < {c.alarm_throughput_drop:g} x running median {med:,.0f}"
                    self.fire(THROUGHPUT, step, msg, tps, c.alarm_throughput_drop * med)
            self.speeds = (self.speeds + [tps])[-50:]
        self.check_routing(step, m)

    def check_routing(self, step: int, m: Any) -> None:
        """Routing collapse: one expert gets >= alarm_routing_collapse of a MoE layer's tokens (and some expert
        less: top-k of few experts gives every expert all tokens), alarm_routing_steps logged lines in a row."""
        c = self.cfg
        if not c.alarm_routing_collapse:
            return
        for key, top in m.items():
            match = _TOKENS_MAX.match(key)
            if not match or not isinstance(top, (int, float)):
                continue
            layer = int(match.group(1))
            low = m.get(f"moe_layer{layer}_tokens_min", 0.0)
            collapsed = top >= c.alarm_routing_collapse and low < c.alarm_routing_collapse
            self._collapsed[layer] = self._collapsed.get(layer, 0) + 1 if collapsed else 0
            if self._collapsed[layer] == c.alarm_routing_steps:
                msg = (
                    f"MoE layer {layer}: one expert got {top:.0%} of the tokens for {c.alarm_routing_steps} "
                    "logged steps (routing collapse; raise model.moe_aux_loss_coeff)"
                )
                self.fire(ROUTING_COLLAPSE, step, msg, top, c.alarm_routing_collapse)

    def check_stall(self) -> None:
        """Fire once per stalled step when no step ended for ``alarm_stall_s``."""
        idle = self.clock() - self.last_progress
        if idle > self.cfg.alarm_stall_s and self._stalled_at != self.step:
            self._stalled_at = self.step
            msg = f"no step finished for {idle:.0f} s (after step {self.step})"
            self.fire(STALL, self.step, msg, idle, self.cfg.alarm_stall_s)

    def _watch(self) -> None:
        period = min(max(self.cfg.alarm_stall_s / 4, 0.05), 5.0)
        while not self._stop.wait(period):
            self.check_stall()
