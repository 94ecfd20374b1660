"""lm-eval tasks inside the training loop (``<stage>.eval_tasks``): run on the training ranks' model chunks with
each validation, without touching training: every RNG state (python, numpy, torch, CUDA, megatron's tracker) and
each chunk's train/eval mode are put back afterwards, and no data is drawn from the training sources.

Every rank takes part (the ranks of a tensor-parallel group serve one stream; data-parallel replicas split the
requests and gather the results, engine.evaluation.lm), so no rank waits at the next step's collectives; rank
0's trainer writes the values. The backend is built once, on the first validation, and kept for the stage (its
table of token texts for ``until`` strings is decoded once).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.evaluation.tasks import TaskRun, metric_fields, run_tasks


@dataclass
class InLoopTasks:
    """``tasks(chunks) -> {task: fields}``: each task's metrics as metrics-line fields (tasks.metric_fields)."""

    run: TaskRun
    manager: Any
    """lm-eval's TaskManager, built once for the stage."""
    tok: Any
    stop_tokens: list[int]
    max_length: int
    batch_size: int
    max_gen_toks: int
    _lm: Any = field(default=None, init=False, repr=False)
    """The backend on the chunks of the first call (a training stage keeps its chunks)."""

    def __call__(self, chunks: list[Any]) -> dict[str, Any]:
        from engine.checkpoint.rng import rng_state, set_rng_state

        saved, modes = rng_state(), [c.training for c in chunks]
        try:
            for c in chunks:
                c.eval()
            lm = self._backend(chunks)
            return {t: metric_fields(sec) for t, sec in run_tasks(lm, self.run, self.manager).items()}
        finally:
            for c, mode in zip(chunks, modes):
                c.train(mode)
            set_rng_state(saved)

    def _backend(self, chunks: list[Any]) -> Any:
        from engine.evaluation.lm import EngineLM

        if self._lm is None or self._lm.chunks is not chunks:
            self._lm = EngineLM(
                chunks,
                self.tok,
                max_length=self.max_length,
                batch_size=self.batch_size,
                max_gen_toks=self.max_gen_toks,
                stop_tokens=self.stop_tokens,
            )
        return self._lm


def in_loop_tasks(cfg: Any, st: Any, tok: Any, seq_length: int, stop_tokens: list[int]) -> InLoopTasks | None:
    """The stage's in-training tasks (``st.eval_tasks`` with eval's task settings), None when it has none."""
    if not st.eval_tasks:
        return None
    from engine.evaluation.tasks import task_manager

    ev = cfg.eval
    run = TaskRun(
        tasks=list(st.eval_tasks),
        task_paths=list(ev.task_paths),
        num_fewshot=ev.num_fewshot,
        limit=st.eval_task_limit,
        fewshot_seed=ev.fewshot_seed,
    )
    return InLoopTasks(
        run,
        task_manager(list(ev.task_paths), list(st.eval_tasks)),
        tok,
        stop_tokens,
        seq_length,
        ev.batch_size,
        ev.max_gen_toks,
    )
