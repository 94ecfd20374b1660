"""What the tracking sinks share: metrics.jsonl's lines forwarded by kind, and a run id kept across resumes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from engine.train.callback import Callback, StepView
from pipeline.records.files import atomic_write_text


class LineSink(Callback):
    """Forwards the train (logged steps), valid and checkpoint lines to ``_log(kind, view)``."""

    def _log(self, kind: str, view: StepView) -> None:
        raise NotImplementedError

    def on_step_end(self, view: StepView) -> None:
        if view.logged:
            self._log("train", view)

    def on_eval(self, view: StepView) -> None:
        self._log("valid", view)

    def on_save(self, view: StepView) -> None:
        self._log("checkpoint", view)


def kept_run_id(folder: Path, new: Callable[[], str]) -> tuple[str, bool]:
    """(the id stored in ``folder/run_id``, True), or (a ``new()`` one, now stored there, False)."""
    path = folder / "run_id"
    if path.exists():
        return path.read_text().strip(), True
    rid = new()
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, rid + "\n")
    return rid, False
