"""Run identity: each stage's hash (its result-deciding config plus its upstream stages' hashes) and the run
directory named by them; the keys that cannot change results are listed with the reason.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from pipeline.schema import graph
from pipeline.schema.config import PipelineConfig
from pipeline.schema.graph import STAGES

# Run identity. Every key changes a stage's hash unless it is listed here with the reason it cannot change
# results (tests/submit/test_frontdoor.py enumerates every schema field and checks each is classified).
IDENTITY_EXCLUDED_SECTIONS: dict[str, str] = {
    "run": "what to run now and where its records go: the name and root name the directory itself, "
    "stages picks a subset (each stage's hash covers its own inputs), dry_run/follow only change the command",
    "cluster": "where and how jobs run (executor, resources, time limits, environment, requeues)",
    "search": "how a -m sweep picks its trials (pipeline.search); each trial is an ordinary run of its own overrides",
    "planner": "assumptions of the resource planner (python -m pipeline.plan); no job reads them",
}
IDENTITY_EXCLUDED_STAGE_KEYS: dict[str, str] = {
    "time_min": "job time limit: a stage stopped by it resumes exactly",
    "threads": "CPU threads per rank: speed only",
    "launcher": "how data_prep's ranks meet: the output is byte-identical whatever the launcher",
    "hang_timeout_s": "watchdog: only decides when a hung rank gives up",
    "log_interval": "how often metrics are printed",
    "save_interval": "checkpoint cadence: resume and rollback replay exactly",
    "keep_last": "how many checkpoints are kept on disk",
    "keep_incomplete": "how many temp dirs of crashed saves are kept on disk",
    "max_bad_steps": "only decides whether a stage stops; a completed stage's result does not depend on it",
    "max_truncated_fraction": "only decides whether a stage starts; the examples it trains on (those with a "
    "trained token left) do not depend on it",
    "nan_policy": "skip and rollback give bit-identical weights (tests/engine/train/test_nan_policy.py); stop only ends "
    "the stage",
    "async_save": "checkpoint writing in the background: the saved state is the same",
    "checkpoint_verify": "how a resume checks checkpoint files: only decides which checkpoint is trusted",
    "monitor": "sinks (TensorBoard, W&B, MLflow) and alarm thresholds only observe the run",
}
IDENTITY_PARALLEL_KEYS = ("global_batch_size", "precision")
"""The only parallel keys that change results; the rest is the layout, which must not (same weights at step 0
and the same data order under any tp/pp/vpp/dp)."""
IDENTITY_HASHED_WHEN_SET = ("qk_layernorm", "num_experts", "moe_")
"""Model keys (names, or a prefix ending in _) added after runs existed: hashed only when they differ from their
default, so a dense model's run keeps its directory (num_experts 0 and None are both dense)."""
IDENTITY_STAGE_HASHED_WHEN_SET = (
    "clip_low",
    "clip_high",
    "sampling_rounds",
    "overlong_",
    "tasks",
    "task_paths",
    "num_fewshot",
    "limit",
    "fewshot_seed",
    "max_gen_toks",
    "log_samples",
    "apply_chat_template",
    "fewshot_as_multiturn",
    "eval_tasks",
    "eval_task_limit",
)
"""Stage keys added after runs existed (DAPO/GSPO's rlhf keys, eval's lm-eval keys): hashed only when they
differ from their default, so the runs made before them keep their directories."""
# grad_spike_factor stays in the identity: the spike threshold decides which updates are dropped, so it
# changes the trajectory whenever it is on.


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def stage_own_config(pc: PipelineConfig, name: str) -> dict[str, Any]:
    """The part of the config that decides a stage's result (cluster and resources excluded)."""
    section = pc.stage(name)
    st = _drop_new_at_default(section, dataclasses.asdict(section), IDENTITY_STAGE_HASHED_WHEN_SET)
    own = {k: v for k, v in st.items() if k not in IDENTITY_EXCLUDED_STAGE_KEYS}
    own["parallel"] = {k: st["parallel"][k] for k in IDENTITY_PARALLEL_KEYS}
    if name == "data_prep":
        own["data"] = dataclasses.asdict(pc.data)
    else:
        own["model"] = _model_identity(pc.model)
    return own


def hashed_when_set(key: str, names: tuple[str, ...] = IDENTITY_HASHED_WHEN_SET) -> bool:
    """Whether ``key`` is one of ``names`` (a name, or a prefix ending in _): hashed only away from its default.
    ``names``: the model's (IDENTITY_HASHED_WHEN_SET) or the stages' (IDENTITY_STAGE_HASHED_WHEN_SET)."""
    return any(key == k or (k.endswith("_") and key.startswith(k)) for k in names)


def _drop_new_at_default(section: Any, out: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """``out`` (``section`` as a dict) without the keys of ``names`` that are at their defaults."""
    for f in dataclasses.fields(section):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        value = (out[f.name] or None) if f.name == "num_experts" else out[f.name]
        if hashed_when_set(f.name, names) and value == default:
            del out[f.name]
    return out


def _model_identity(model: Any) -> dict[str, Any]:
    """The model section as hashed: keys of IDENTITY_HASHED_WHEN_SET left out at their defaults."""
    return _drop_new_at_default(model, dataclasses.asdict(model), IDENTITY_HASHED_WHEN_SET)


def stage_hashes(pc: PipelineConfig, with_inputs: bool = True) -> dict[str, str]:
    """Each stage's hash: its own result-deciding config plus its upstream stages' hashes.

    ``with_inputs``: data_prep's hash also covers the contents of its input files
    (``pipeline.schema.data_identity``), so editing a corpus file reruns data_prep and everything downstream.
    """
    out: dict[str, str] = {}
    for name in STAGES:
        ups = {u: out[u] for u in graph.hash_upstream(name, pc)}
        own = stage_own_config(pc, name)
        if name == "data_prep" and with_inputs:
            from pipeline.schema.data_identity import inputs_digest

            own["inputs"] = inputs_digest(pc)
        out[name] = _digest({"stage": name, "own": own, "upstream": ups})
    return out


def run_hash(pc: PipelineConfig) -> str:
    """Hash naming the run directory: every stage's result-deciding config (not which subset runs, not the data files' contents)."""
    return _digest(stage_hashes(pc, with_inputs=False))[:8]


def run_dir_for(pc: PipelineConfig) -> Path:
    """Deterministic run directory: experiment name + hash of everything that changes results."""
    return Path(pc.run.root).resolve() / f"{pc.run.name}-{run_hash(pc)}"
