"""The one training loop, shared by pretrain, SFT and DPO; the step (engine.train.steps) is pluggable.

Per step: every data-parallel rank takes its slice of the global batch (the global sample index,
docs/ARCHITECTURE.md), megatron's ``get_forward_backward_func()`` runs the micro batches (no pipelining,
1F1B or interleaved), the megatron optimizer steps, the LR scheduler advances. Rank 0 writes the metrics
lines of docs/ARCHITECTURE.md. ``Checkpointer`` (engine.checkpoint.manager) does resume, init_from, saves
every ``save_interval`` and at the end. Set ``trainer.stop_requested = True`` to stop at the next step
boundary (with a checkpoint).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.checkpoint.manager import Checkpointer
from engine.context import MetricsWriter
from engine.models.moe import RoutingStats
from engine.runtime import distributed as D
from engine.runtime.fault_injection import FaultInjector
from engine.runtime.health import NodesExcluded
from engine.runtime.signals import StopFlag, Watchdog, stopped
from engine.runtime.stragglers import StragglerMonitor, Verdict
from engine.train.bad_steps import BadStepError, BadStepGuard, reason_code, reason_from_code
from engine.train.callback import Callbacks
from engine.train.meter import StepMeter
from engine.train.step import Batch, ForwardStep, Step
from engine.train.units import SampleSource, TrainUnit, micro_batches, run_micro_batches
from pipeline.records.files import atomic_write_text
from pipeline.schema.config import TrainStage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopServices:
    """What the loop reports to and is stopped by, besides the step and its data; each optional."""

    metrics: MetricsWriter | None = None
    """The stage's metrics.jsonl (rank 0 writes); None: nowhere."""
    checkpointer: Checkpointer | None = None
    """Resume, init_from and saves (engine.checkpoint.manager); None: no checkpoints."""
    faults: FaultInjector | None = None
    """Injected faults (engine.runtime.fault_injection): the ``nan`` fault poisons a step's loss."""
    stop_flag: StopFlag | None = None
    """Set by a signal: the loop saves and stops at the next step boundary."""
    watchdog: Watchdog | None = None
    """Beaten every step (a hang detector)."""
    callbacks: Callbacks | None = None
    """Sinks and alarms (engine.callbacks): called at train start/end, step end, eval, save, stop."""
    meter: StepMeter | None = None
    """Time split of each step, TFLOP/s, MFU and memory in the train lines (engine.train.meter)."""
    routing: RoutingStats | None = None
    """A MoE model's routing statistics and load-balancing losses, added to each step's metrics (engine.models.moe)."""
    stragglers: StragglerMonitor | None = None
    """Straggler checks every cluster.health.straggler_interval steps (engine.runtime.stragglers)."""
    tasks: Callable[[list[Any]], dict[str, Any]] | None = None
    """lm-eval tasks run with each validation (engine.evaluation.in_loop): ``tasks(chunks) -> {task: {metric:
    value, metric_stderr: stderr}}``, the fields of its metrics line."""


class Trainer:
    """Runs ``stage.iters`` optimizer steps of ``step`` over ``train_source``."""

    def __init__(
        self,
        chunks: list[Any],
        optimizer: Any,
        scheduler: Any,
        step: Step,
        *,
        stage: TrainStage,
        seq_length: int,
        train_source: SampleSource | None = None,
        valid_source: SampleSource | None = None,
        unit: TrainUnit | None = None,
        services: LoopServices | None = None,
    ) -> None:
        par = stage.parallel
        if par.global_batch_size % (par.micro_batch_size * D.dp_size()):
            raise ValueError(
                f"parallel.global_batch_size={par.global_batch_size}: must be divisible by "
                f"micro_batch_size x dp = {par.micro_batch_size} x {D.dp_size()}"
            )
        self.chunks, self.optimizer, self.scheduler, self.step = chunks, optimizer, scheduler, step
        self.stage, self.seq_length = stage, seq_length
        self.train_source, self.valid_source = train_source, valid_source
        if unit is None and train_source is None:
            raise ValueError("Trainer: give train_source or a unit")
        self.unit = unit or TrainUnit(train_source)
        """What each step trains (engine.train.units): the updates of a step, other named models, their state."""
        self.unit.bind(self)
        services = services or LoopServices()
        self.metrics = services.metrics or MetricsWriter(Path("/dev/null"), enabled=False)
        self.checkpointer = services.checkpointer
        self.faults, self.stop_flag, self.watchdog = services.faults, services.stop_flag, services.watchdog
        self.callbacks = services.callbacks or Callbacks()
        self.meter = services.meter or StepMeter()
        self.routing = services.routing
        self.tasks = services.tasks
        self.stragglers = services.stragglers
        self._excluding: dict[str, str] = {}
        """Straggling nodes to leave (policy exclude): the loop saves at this step and raises NodesExcluded."""
        self.iteration = 0
        self.resume_info: dict[str, Any] | None = None
        self._start, self._t0, self._window = (
            0,
            0.0,
            [0, 0.0],
        )  # set by fit(): first step, start time, log window
        self.stop_requested = False
        self.history: list[dict[str, float]] = []
        self.guard = BadStepGuard(stage.grad_spike_factor, stage.max_bad_steps)
        self.skipped_steps: set[int] = set()
        """Steps (1-based) whose batch is consumed without an update: bad batches found before a rollback."""
        self.verdict: dict[str, Any] | None = None
        """The last step's ``{"reason", "grad_norm"}`` (reason None: good); None when no update was tried."""
        self._poison = False
        self.overflow_steps = 0
        """fp16: steps whose scaled gradients overflowed (no update; megatron's dynamic scaler lowers the scale)."""

    @property
    def global_batch(self) -> int:
        return self.stage.parallel.global_batch_size

    def _forward_backward(
        self, batches: list[Batch], forward_only: bool, step: ForwardStep | None = None
    ) -> list[dict[str, torch.Tensor]]:
        return run_micro_batches(
            self.chunks,
            step or self.step,
            batches,
            seq_length=self.seq_length,
            micro_batch_size=self.stage.parallel.micro_batch_size * self.step.sequences_per_sample,
            forward_only=forward_only,
        )

    @staticmethod
    def _sums(outputs: Sequence[dict[str, torch.Tensor]]) -> dict[str, tuple[float, float]]:
        sums: dict[str, list[float]] = {}
        for out in outputs:
            for k, v in out.items():
                acc = sums.setdefault(k, [0.0, 0.0])
                acc[0] += float(v[0])
                acc[1] += float(v[1])
        return {k: (s, c) for k, (s, c) in sums.items()}

    def train_step(self, step: int) -> dict[str, float]:
        """One global step ``step``: the unit's updates (each an optimizer step); globally reduced metrics.

        The LR schedule advances once per global step when an update was applied. A bad update (nan_policy)
        ends the step's remaining updates; its verdict is handled by the loop.
        """
        if step + 1 in self.skipped_steps:
            return self._skip_known(step)
        par = self.stage.parallel
        updates = self.unit.updates(step)
        lr = float(self.optimizer.param_groups[0]["lr"])
        overflows = self.overflow_steps
        sums: dict[str, list[float]] = {}
        applied, grad_norm, micro = False, None, 0
        for batches in updates:
            micro += len(batches)
            for chunk in self.chunks:
                if not chunk.training:  # eval() / generation set the root's mode; train() walks every module
                    chunk.train()
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            with self.meter.time("fwd_bwd"):
                outputs = self._forward_backward(
                    batches, False, _poisoned(self.step) if self._poison else None
                )
            with self.meter.time("optimizer"):
                ok, grad_norm = self._judged_optimizer_step(outputs)
            applied = applied or ok
            for k, (s, c) in self._sums(outputs).items():
                acc = sums.setdefault(k, [0.0, 0.0])
                acc[0] += s
                acc[1] += c
            if self.verdict is not None and self.verdict.get("reason") is not None:
                break
        if applied:
            self.scheduler.step(increment=1)
        out = D.reduce_metrics({n: tuple(sums.get(n, (0.0, 0.0))) for n in self.step.metric_names})
        out.update(self.unit.metrics())
        if self.routing is not None:
            out.update(self.routing.collect(micro))
        out["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        out["lr"] = lr
        if par.precision == "fp16":
            out["loss_scale"] = float(self.optimizer.get_loss_scale())
            out["overflow"] = float(self.overflow_steps > overflows)
            out["overflow_steps"] = float(self.overflow_steps)
        return out

    def _judged_optimizer_step(self, outputs: Sequence[dict[str, torch.Tensor]]) -> tuple[bool, Any]:
        """``optimizer.step()``, which applies no update when the step is bad (``self.verdict`` says why).

        megatron's step first calls ``prepare_grads`` (grads to main grads, unscaled) and skips the update
        when it reports inf/NaN. We wrap it for this call: after it, the grad norm (reduced over the model
        and distributed-optimizer groups, as megatron's clipping computes it) and the local losses are
        judged, the verdict is max-reduced over all ranks, and a bad verdict is reported as inf/NaN found.
        The norm judged is the one the step clips with: ``get_grad_norm`` answers it for the rest of the call
        (megatron's chained optimizer would compute it a second time).
        """
        optimizer, verdict = self.optimizer, {}
        prepare, grad_norm = optimizer.prepare_grads, optimizer.get_grad_norm

        def judged_prepare() -> bool:
            found_inf = bool(prepare())  # fp16 only, agreed over ranks: inf/NaN in the scaled gradients
            if found_inf:
                judged = self._judge(outputs, float("inf"))
                if judged["reason"] == "nonfinite_grad":  # finite losses: an overflow, megatron's own skip
                    self.overflow_steps += 1
                else:  # a non-finite loss is a bad step in every precision: nan_policy applies
                    verdict.update(judged)
                return True
            norm = float(grad_norm())
            optimizer.get_grad_norm = lambda: norm
            verdict.update(self._judge(outputs, norm))
            return verdict.get("reason") is not None

        optimizer.prepare_grads = judged_prepare
        try:
            ok, norm, _ = optimizer.step()
        finally:
            del optimizer.prepare_grads
            optimizer.__dict__.pop("get_grad_norm", None)
        self.verdict = verdict or None
        return ok, norm if norm is not None else verdict.get("grad_norm")

    def _judge(self, outputs: Sequence[dict[str, torch.Tensor]], grad_norm: float) -> dict[str, Any]:
        loss_finite = all(bool(torch.isfinite(v[0])) for out in outputs for v in out.values())
        reason = self.guard.check(loss_finite, grad_norm)
        return {"reason": reason_from_code(D.all_reduce_max(reason_code(reason))), "grad_norm": grad_norm}

    def _skip_known(self, step: int) -> dict[str, float]:
        """Consume a batch in ``skipped_steps`` without computing it (no update, the schedule does not advance)."""
        log.warning("step %d: batch skipped (found bad before a rollback)", step + 1)
        self.verdict = None
        nan = float("nan")
        lr = float(self.optimizer.param_groups[0]["lr"])
        return {**{n: nan for n in self.step.metric_names}, "grad_norm": nan, "lr": lr, "skipped": 1.0}

    def _handle_bad_step(self) -> bool:
        """Apply ``nan_policy`` to the step just run (step ``self.iteration + 1``); True when it rolled back."""
        verdict, self.verdict = self.verdict, None
        step = self.iteration + 1
        if verdict is None:
            return False
        if verdict["reason"] is None:
            self.guard.good(step, verdict["grad_norm"])
            return False
        in_a_row = self.guard.bad(step)
        policy = "stop" if in_a_row >= self.stage.max_bad_steps else self.stage.nan_policy
        back_to = self._rollback(step) if policy == "rollback" else None
        action = "skip" if policy == "rollback" and back_to is None else policy
        self._report_bad_step(step, verdict, action, back_to)
        if action == "stop":
            raise BadStepError(
                f"step {step}: {verdict['reason']} (grad norm {verdict['grad_norm']:.4g}); "
                f"{in_a_row} bad step(s) in a row, stopping (nan_policy={self.stage.nan_policy}, "
                f"max_bad_steps={self.stage.max_bad_steps})"
            )
        return action == "rollback"

    def _report_bad_step(self, step: int, verdict: dict[str, Any], action: str, back_to: int | None) -> None:
        record = {"kind": "bad_step", "step": step, "reason": verdict["reason"], "action": action}
        record |= {"grad_norm": verdict["grad_norm"]} | ({"to_step": back_to} if back_to is not None else {})
        self.metrics.write(record)
        where = f" to the checkpoint of step {back_to}" if back_to is not None else ""
        log.warning(
            "bad step %d: %s (grad norm %.4g); %s%s",
            step,
            verdict["reason"],
            verdict["grad_norm"],
            action,
            where,
        )

    def _rollback(self, step: int) -> int | None:
        """Reload the newest checkpoint and skip ``step``'s batch from now on; the checkpoint's step, or None."""
        self.skipped_steps.add(step)
        if self.checkpointer is None:
            return None
        state = self.checkpointer.reload_latest(
            self.chunks, self.optimizer, self.scheduler, models=self.unit.trained_models()
        )
        if state is None:
            return None
        self.unit.load_state(state.get("unit", {}))
        self.iteration = int(state["iteration"])
        self.skipped_steps |= set(state.get("skipped_steps", []))
        self.guard.norms = [float(x) for x in state.get("bad_steps", {}).get("norms", [])]
        return self.iteration

    @torch.no_grad()
    def evaluate(self) -> dict[str, float] | None:
        """Validation loss and perplexity over ``eval_iters`` global batches of the valid source."""
        if self.valid_source is None:
            return None
        for chunk in self.chunks:
            chunk.eval()
        par = self.stage.parallel
        sums: dict[str, list[float]] = {}
        for i in range(self.stage.eval_iters):
            batches = micro_batches(self.valid_source, i, par.global_batch_size, par.micro_batch_size)
            for k, (s, c) in self._sums(self._forward_backward(batches, forward_only=True)).items():
                acc = sums.setdefault(k, [0.0, 0.0])
                acc[0] += s
                acc[1] += c
        for chunk in self.chunks:
            chunk.train()
        out = D.reduce_metrics(
            {n: (sums[n][0], sums[n][1]) if n in sums else (0.0, 0.0) for n in self.step.metric_names}
        )
        out["ppl"] = math.exp(min(out["loss"], 50.0))
        return out

    def state(self) -> dict[str, Any]:
        """The trainer's resumable values (plain, equal on every rank; checkpoint.save adds RNG states)."""
        return {
            "iteration": self.iteration,
            "consumed_samples": self.iteration * self.global_batch,
            "skipped_steps": sorted(self.skipped_steps),
            "bad_steps": self.guard.state(),
            "overflow_steps": self.overflow_steps,
            "unit": self.unit.state(),
        }

    def restore(self, init_weights: bool = True, attempt: int = 0) -> None:
        """Resume (model, optimizer, scheduler, RNG, iteration) or load init_from weights via the checkpointer.
        ``attempt``: the stage's attempt number (StageContext.attempt; 0 unknown), for the resume record.

        On a resume, the steps lost since the last run's furthest step and the time from its last step to
        now are written as a ``resume`` metrics record (the progress file says where the last run got to).
        """
        if self.checkpointer is None:
            return
        state = self.checkpointer.restore(
            self.chunks, self.optimizer, self.scheduler, init_weights, models=self.unit.trained_models()
        )
        self.unit.load_frozen(self.checkpointer)
        if state is not None:
            self.unit.load_state(state.get("unit", {}))
        if state is None and not (self.progress_path and self.progress_path.exists()) and attempt <= 1:
            return  # a first start
        if state is not None:
            self.iteration = int(state["iteration"])
            self.skipped_steps = set(state.get("skipped_steps", []))
            self.guard.load_state(state.get("bad_steps", {}))
            self.overflow_steps = int(state.get("overflow_steps", 0))
        reached, at = self._read_progress()
        self.resume_info = {
            "kind": "resume",
            "attempt": attempt or None,
            "from_step": self.iteration,
            "checkpoint": state is not None,
            "reached_step": reached,
            "steps_lost": max(reached - self.iteration, 0),
            "down_s": time.time() - at if at else None,
        }
        self.metrics.write(self.resume_info)

    @property
    def progress_path(self) -> Path | None:
        return self.checkpointer.root.parent / "progress.json" if self.checkpointer else None

    def _read_progress(self) -> tuple[int, float | None]:
        p = self.progress_path
        if p is None or not p.exists():
            return self.iteration, None
        try:
            data = json.loads(p.read_text())
            return int(data["step"]), float(data["time"])
        except (ValueError, KeyError):
            return self.iteration, None

    def _write_progress(self) -> None:
        """Rank 0 notes the step reached (temp + rename: a reader never sees half a file)."""
        p = self.progress_path
        if p is None or not D.is_rank0():
            return
        try:
            atomic_write_text(p, json.dumps({"step": self.iteration, "time": time.time()}), durable=False)
        except OSError as e:  # a full disk: the accounting is lost, the training goes on
            log.warning("could not write %s: %s", p, e)

    def _stop(self) -> bool:
        """Agreed over all ranks every step, so all stop (and save) at the same step."""
        local = self.stop_requested or (self.stop_flag is not None and self.stop_flag.requested)
        return D.any_rank(local)

    def _beat(self) -> None:
        if self.watchdog is not None:
            self.watchdog.beat()

    def fit(self) -> dict[str, Any]:
        """Train from ``self.iteration`` to ``stage.iters``; returns a summary (steps, final_loss, valid)."""
        st = self.stage
        self._start, self._t0, self._window = self.iteration, time.time(), [0, 0.0]
        last: dict[str, float] = {}
        stop = False
        self.callbacks.emit("on_train_start", self.iteration)
        while self.iteration < st.iters and not stop:
            self._beat()
            if self.faults:
                self._poison = self.faults.check("step", self.iteration + 1) == "nan"
            t_step = time.time()
            if self.stragglers is not None:
                self.stragglers.starting()
            last = self.train_step(self.iteration)
            if self._handle_bad_step():
                continue
            step_s = time.time() - t_step
            self.iteration += 1
            self.history.append(last)
            self._write_progress()
            logged = self._log_train(last, step_s)
            s = self.iteration
            self.callbacks.emit("on_step_end", s, logged or last, logged=logged is not None)
            if st.eval_interval and s % st.eval_interval == 0 and s < st.iters:
                self._write_valid(s)
            if self.stragglers is not None:
                self._check_stragglers(s)
            stop = self._stop() or bool(self._excluding)
            self._beat()
            self._checkpoint(s, stop, step_s)
        if self.checkpointer is not None:
            self.checkpointer.finalize(blocking=True)
        if self._excluding and self.iteration < st.iters:
            raise NodesExcluded(self._excluding)  # saved at this step: the job resumes without them
        if stop and self.iteration < st.iters:
            signum = self.stop_flag.signum if self.stop_flag else None
            self.metrics.write(
                {"kind": "info", "message": f"stopped at step {self.iteration} (signal {signum}), saved"}
            )
            self.callbacks.emit("on_stop", self.iteration, {"signal": signum})
            raise stopped(signum, self.iteration)
        valid = (
            self._write_valid(self.iteration)
            if self.iteration == st.iters and self.iteration > self._start
            else None
        )
        saved = self.checkpointer.last_saved if self.checkpointer else None
        summary = {
            "steps": self.iteration,
            "resume": self.resume_info,
            "checkpoint_save_s": self.checkpointer.save_seconds if self.checkpointer else [],
            "final_loss": last.get("loss"),
            "valid": valid,
            "stopped": self.iteration < st.iters,
            "checkpoint": str(saved) if saved else None,
        }
        self.callbacks.emit("on_train_end", self.iteration, summary)
        return summary

    def _check_stragglers(self, s: int) -> None:
        """Feed the straggler monitor; on a check: its scores, an alarm per straggling node, maybe leave them."""
        assert self.stragglers is not None
        verdict: Verdict | None = self.stragglers.observe(s)
        if verdict is None:
            return
        self.metrics.write(verdict.as_record())
        self.callbacks.emit("on_straggler", s, verdict.as_record())
        for host, why in verdict.stragglers.items():
            rec = {
                "kind": "alarm",
                "alarm": "straggler",
                "step": s,
                "host": host,
                "message": f"node {host}: {why}"
                + (f"; not excluded: {verdict.blocked}" if verdict.blocked else ""),
            }
            self.metrics.write(rec)
            self.callbacks.emit("on_alarm", s, rec)
        if verdict.leave:
            self._excluding = dict(verdict.stragglers)

    def _checkpoint(self, s: int, stop: bool, step_s: float) -> None:
        """After step ``s``: commit finished async saves, save when due, record the save and any interval choice."""
        if self.checkpointer is None:
            return
        ck, final = self.checkpointer, s == self.stage.iters
        ck.finalize()
        saves_before = len(ck.save_seconds)
        ck.maybe_save(
            s, final, stop, self.chunks, self.optimizer, self.scheduler, self.state(),
            models=self.unit.trained_models(), step_s=step_s,
        )  # fmt: skip
        if ck.auto_interval is not None:
            for record in ck.auto_interval.take_records():
                self.metrics.write(record)
        if len(ck.save_seconds) > saves_before:
            save_s = ck.save_seconds[-1]
            self.metrics.write(
                {
                    "kind": "checkpoint",
                    "step": s,
                    "save_s": save_s,
                    "async": ck.async_save and not (stop or final),
                }
            )
            self.meter.add("checkpoint", save_s)
            self.callbacks.emit("on_save", s, {"save_s": save_s})

    def _log_train(self, last: dict[str, float], step_s: float) -> dict[str, Any] | None:
        """A metrics line every log_interval steps; tokens/s over the steps' compute time since the last line."""
        st, s = self.stage, self.iteration
        self._window[0] += 1
        self._window[1] += step_s
        if not (s % st.log_interval == 0 or s == st.iters or s == self._start + 1):
            return None
        tokens = self._window[0] * self.global_batch * self.seq_length * self.step.sequences_per_sample
        elapsed = time.time() - self._t0
        record = {
            "kind": "train",
            "step": s,
            "iters": st.iters,
            **last,
            "tokens_per_s": tokens / max(self._window[1], 1e-9),
            "elapsed_s": elapsed,
            "eta_s": elapsed / (s - self._start) * (st.iters - s),
            **self.meter.fields(int(self._window[0]), self._window[1]),
        }
        self.metrics.write(record)
        self._window = [0, 0.0]
        return record

    def _write_valid(self, step: int) -> dict[str, float] | None:
        out = self.evaluate()
        if out is not None:
            self.metrics.write({"kind": "valid", "step": step, **out})
            self.callbacks.emit("on_eval", step, {"kind": "valid", "step": step, **out})
        if self.tasks is not None:
            self._write_tasks(step)
        return out

    def _write_tasks(self, step: int) -> None:
        """The in-training lm-eval tasks: one ``eval_task`` line per task (values, stderrs, the time taken)."""
        assert self.tasks is not None
        t = time.time()
        sections = self.tasks(self.chunks)
        took = time.time() - t
        for task, fields in sections.items():
            line = {"kind": "eval_task", "step": step, "task": task, **fields, "eval_task_s": took}
            self.metrics.write(line)
            self.callbacks.emit("on_eval", step, line)


def _poisoned(step: ForwardStep) -> ForwardStep:
    """``step`` with its loss, and so every gradient, multiplied by NaN (the ``nan`` fault, on ranks computing a loss)."""

    def forward(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
        output, loss_func = step(data_iterator, model)

        def poisoned_loss(*args: Any) -> Any:
            loss, count, reported = loss_func(*args)
            nan_sum = {k: v * v.new_tensor([float("nan"), 1.0]) for k, v in reported.items()}
            return loss * float("nan"), count, nan_sum

        return output, poisoned_loss

    return forward
