"""MLflow sink (optional: ``pip install .[mlflow]``), rank 0 only, offline: a local SQLite tracking store.

One MLflow experiment per run directory (named after it), one MLflow run per stage (named after the stage), in
``monitor.mlflow_uri`` (default ``sqlite:///<run_dir>/mlflow.db``, artifacts in <run_dir>/mlartifacts;
``mlflow ui --backend-store-uri sqlite:///<run_dir>/mlflow.db`` shows them). Logged: the numbers of each
train/valid/checkpoint line as ``<kind>/<key>`` at its step, the resolved config flattened as params, and at
train end the summary (summary.json) and the stage's metrics.jsonl as artifacts. The MLflow run id is kept in
``<stage dir>/mlflow/run_id``, so a resumed stage continues the same run. MLflow's own usage telemetry follows
its switches (``MLFLOW_DISABLE_TELEMETRY=true`` or ``DO_NOT_TRACK=true`` in the job's environment).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.callbacks.lines import LineSink, kept_run_id
from engine.callbacks.tensorboard import scalars
from engine.train.callback import Callback, StageInfo, StepView
from pipeline.schema.stage_sections import MonitorConfig


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested mappings as dotted keys (MLflow's allowed characters), leaves as their text."""
    out: dict[str, str] = {}
    for k, v in config.items():
        key = re.sub(r"[^\w\-. /]", "_", f"{prefix}{k}")
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = str(v)
    return out


class MLflow(LineSink):
    def __init__(
        self,
        uri: str,
        artifact_location: str | None,
        experiment: str,
        name: str,
        out_dir: Path,
        config: Mapping[str, Any],
    ) -> None:
        self.uri, self.artifact_location, self.experiment, self.name = (
            uri,
            artifact_location,
            experiment,
            name,
        )
        self.dir, self.metrics_file = Path(out_dir) / "mlflow", Path(out_dir) / "metrics.jsonl"
        self.config = dict(config)
        self.client: Any = None
        self.run_id: str | None = None
        self.status = "FAILED"
        """How close() ends the MLflow run: FINISHED at train end, KILLED after a stop request (it resumes)."""

    def on_train_start(self, view: StepView) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as e:  # the sink is disabled (logged), training goes on
            raise ImportError(
                f"{view.stage.name}.monitor.sinks has mlflow but it is not installed (pip install '.[mlflow]')"
            ) from e
        client = MlflowClient(tracking_uri=self.uri)
        rid, resumed = kept_run_id(self.dir, lambda: self._new_run(client))
        if resumed:  # the same run, running again
            client.update_run(rid, status="RUNNING")
        self.client, self.run_id = client, rid
        self._log_params()

    def _new_run(self, client: Any) -> str:
        run = client.create_run(self._experiment_id(client), run_name=self.name, tags={"stage": self.name})
        return str(run.info.run_id)

    def _experiment_id(self, client: Any) -> str:
        from mlflow.exceptions import MlflowException

        exp = client.get_experiment_by_name(self.experiment)
        if exp is not None:
            return str(exp.experiment_id)
        try:
            return str(client.create_experiment(self.experiment, artifact_location=self.artifact_location))
        except MlflowException:  # another stage of the run created it meanwhile
            return str(client.get_experiment_by_name(self.experiment).experiment_id)

    def _log_params(self) -> None:
        """The config's params the run does not have yet (a resume keeps the first values: MLflow params are
        immutable, and only identity-excluded keys such as time_min may differ)."""
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        have = self.client.get_run(self.run_id).data.params
        params = [
            Param(k, v[:MAX_PARAM_VAL_LENGTH]) for k, v in flatten(self.config).items() if k not in have
        ]
        for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + MAX_PARAMS_TAGS_PER_BATCH])

    def _log(self, prefix: str, view: StepView) -> None:
        if self.client is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(f"{prefix}/{k}", v, now, view.step) for k, v in scalars(view.metrics).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def on_stop(self, view: StepView) -> None:
        self.status = "KILLED"

    def on_train_end(self, view: StepView) -> None:
        if self.client is None:
            return
        summary = json.dumps(dict(view.metrics), indent=1, default=str)
        self.client.log_text(self.run_id, summary, "summary.json")
        if self.metrics_file.exists():
            self.client.log_artifact(self.run_id, str(self.metrics_file))
        if self.status != "KILLED":
            self.status = "FINISHED"

    def close(self) -> None:
        if self.client is not None:
            self.client.set_terminated(self.run_id, status=self.status)
            self.client = None


def sink(mon: MonitorConfig, info: StageInfo) -> Callback:
    """``monitor.sinks: [mlflow]``: the store of ``monitor.mlflow_uri``, else a SQLite file in the run dir."""
    run_dir = (info.run_dir or info.out_dir).resolve()
    if mon.mlflow_uri:
        uri, artifacts = mon.mlflow_uri, None
    else:
        uri, artifacts = f"sqlite:///{run_dir / 'mlflow.db'}", (run_dir / "mlartifacts").as_uri()
    return MLflow(uri, artifacts, run_dir.name, info.name, info.out_dir, info.config)
