"""Pre-flight: every file, directory and checkpoint a selected stage will read, checked before any job starts.

Each stage declares what it reads with ``@reads(stage, ...)``: a check gets the validated config and the
stage name and raises ConfigError (``<key>=<value>: <what is wrong and the fix>``). ``preflight(cfg)`` runs
the checks of every selected stage, after the files of the ``hf:<dir>`` model the run starts from (its
tokenizer and weights: ``pipeline.schema.hf_model.check_run_files``; the planner reads its config.json
alone); ``build_config(..., inputs=True)`` calls it, so a bad input stops the command before anything is
written. Add a source or an ``init_from`` kind by registering one more check
here (``reads``) or one more ``init_from`` scheme (``INIT_FROM_SCHEMES``). Never imports torch: checkpoints
are judged by their completion marker (JSON) and the run's recorded config.
"""

from __future__ import annotations

from pipeline.schema.config import PipelineConfig
from pipeline.schema.graph import order
from pipeline.schema.hf_model import check_run_files
from pipeline.submit.preflight import checkpoints, data, machine, prompts, tasks
from pipeline.submit.preflight.checks import CHECKPOINT_MARKER, CHECKS, INIT_FROM_SCHEMES, Check, reads
from pipeline.submit.preflight.data import SPECIAL_TOKENS, text_files, tokenizer_vocab_size
from pipeline.submit.preflight.machine import local_gpus

__all__ = [
    "CHECKPOINT_MARKER",
    "CHECKS",
    "INIT_FROM_SCHEMES",
    "SPECIAL_TOKENS",
    "local_gpus",
    "preflight",
    "reads",
    "text_files",
    "tokenizer_vocab_size",
]


MODULES = (data, prompts, checkpoints, tasks, machine)
"""The order their checks run in: inputs before what is built from them, the machine last."""


def _rank(check: Check) -> int:
    return [m.__name__ for m in MODULES].index(check.__module__)


def preflight(cfg: PipelineConfig) -> None:
    """Check the run's ``hf:<dir>`` model files (every stage reads what comes of them), then every selected
    stage's input checks (by ``MODULES``, then in registration order); the first problem raises ConfigError."""
    check_run_files(cfg)
    for stage in order(cfg.run.stages):
        for check in sorted(CHECKS.get(stage, []), key=_rank):
            check(cfg, stage)
