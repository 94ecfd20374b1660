"""Keys that do nothing in some mode: set by the user there, each is a config error naming the key and the mode.

``RULES`` is the audit: for each group of keys, the mode in which nothing reads them. "Set by the user" comes
from the composition's origins (``pipeline.schema.origins``), not from comparing with the default, so a key
typed with its default value is caught too; values of shipped presets (conf/, e.g. ``experiment=tiny``'s
``data.max_corpus_mb``) give way silently in modes that do not read them. tests/schema/test_ignored.py runs
every rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.schema import rl
from pipeline.schema.config import PipelineConfig
from pipeline.schema.domains import fail
from pipeline.schema.graph import TRAIN_STAGES
from pipeline.schema.origins import Origins
from pipeline.schema.sections import ParallelConfig
from pipeline.schema.stage_sections import RLHFStage, TrainStage


@dataclass(frozen=True)
class Rule:
    """``keys`` do nothing when ``unread(pc, key)`` says why (a sentence naming the mode's key and value)."""

    name: str
    keys: tuple[str, ...]
    unread: Callable[[PipelineConfig, str], str | None]


def _corpus_not(mode: str) -> Callable[[PipelineConfig, str], str | None]:
    def unread(pc: PipelineConfig, _key: str) -> str | None:
        c = pc.data.corpus
        return None if c == mode else f"only data.corpus={mode} reads it (data.corpus={c})"

    return unread


_SOURCES_KEYS = ("sources", "test_fraction", "dedup", "min_chars", "max_chars", "bad_records", "shard_mb")
SLURM_ONLY = (
    "partition",
    "account",
    "qos",
    "constraint",
    "exclusive",
    "setup",
    "container_image",
    "env",
    "signal_delay_s",
    "mpi",
    "max_requeues",
)
"""cluster keys only the SLURM executor reads."""
SCALING_KEYS = (
    "rotary_scaling_factor",
    "rotary_low_freq_factor",
    "rotary_high_freq_factor",
    "rotary_original_max_positions",
)


def _train_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(TrainStage)}


RLHF_ALGORITHM_KEYS: tuple[str, ...] = (
    "beta",
    *(f.name for f in dataclasses.fields(RLHFStage) if f.name not in _train_fields()),
)
"""rlhf keys that only some algorithms read (each declares its own: pipeline/schema/rl.py)."""
PARALLEL_USED = {
    "data_prep": ("tp", "pp", "dp", "nodes"),
    "eval": ("tp", "pp", "vpp", "ep", "etp", "dp", "nodes", "precision"),
    "export": (),
}
"""The parallel keys of the stages that do not train (the rest of their ``parallel`` section is unread)."""


def _data_rules() -> list[Rule]:
    d = "data."
    return [
        Rule("corpus=sources keys", tuple(d + k for k in _SOURCES_KEYS), _corpus_not("sources")),
        Rule("corpus=files keys", (d + "text_paths", d + "jsonl_text_key"), _corpus_not("files")),
        Rule(
            "corpus cap",
            (d + "max_corpus_mb",),
            lambda pc, _k: (
                "data.corpus=sources reads every source whole (max_corpus_mb caps corpus=shakespeare "
                "and corpus=files)"
                if pc.data.corpus == "sources"
                else None
            ),
        ),
        Rule(
            "tokenizer training",
            (d + "vocab_size", d + "tokenizer_sample_mb"),
            lambda pc, _k: (
                f"data.tokenizer_path={pc.data.tokenizer_path!r} is used as it is; this key only shapes "
                "the tokenizer data_prep trains without one"
                if pc.data.tokenizer_path is not None
                else None
            ),
        ),
        Rule(
            "users' SFT data",
            (d + "sft_noise",),
            lambda pc, _k: (
                "data.sft_paths replaces the generated SFT set it shapes" if pc.data.sft_paths else None
            ),
        ),
        Rule(
            "users' preference data",
            (d + "num_pref_pairs",),
            lambda pc, _k: (
                "data.pref_paths replaces the generated preference pairs" if pc.data.pref_paths else None
            ),
        ),
    ]


def _model_rules() -> list[Rule]:
    return [
        Rule(
            "learned positions",
            tuple(f"model.{k}" for k in ("rotary_base", "rotary_scaling", *SCALING_KEYS)),
            lambda pc, _k: (
                "only model.position_embedding=rope reads it "
                f"(model.position_embedding={pc.model.position_embedding})"
                if pc.model.position_embedding != "rope"
                else None
            ),
        ),
        Rule(
            "rope without scaling",
            tuple(f"model.{k}" for k in SCALING_KEYS),
            lambda pc, _k: (
                "only model.rotary_scaling=true reads it (model.rotary_scaling=false)"
                if pc.model.position_embedding == "rope" and not pc.model.rotary_scaling
                else None
            ),
        ),
        Rule(
            "biases everywhere",
            ("model.add_qkv_bias",),
            lambda pc, _k: (
                "model.add_bias_linear=true already puts a bias on every linear, query/key/value included"
                if pc.model.add_bias_linear
                else None
            ),
        ),
    ]


def _cluster_rules() -> list[Rule]:
    return [
        Rule(
            "SLURM keys",
            tuple(f"cluster.{k}" for k in SLURM_ONLY),
            lambda pc, _k: (
                f"only cluster.executor=slurm reads it (executor is {pc.cluster.executor}); use a SLURM "
                "profile (cluster=slurm) or drop it"
                if pc.cluster.executor != "slurm"
                else None
            ),
        ),
        Rule(
            "follow",
            ("run.follow",),
            lambda pc, _k: (
                f"only cluster.executor=slurm reads it (executor is {pc.cluster.executor}, which always "
                "waits for its jobs)"
                if pc.cluster.executor != "slurm"
                else None
            ),
        ),
        Rule(
            "prefork",
            ("cluster.prefork",),
            lambda pc, _k: (
                f"only cluster.executor=local reads it (executor is {pc.cluster.executor})"
                if pc.cluster.executor != "local"
                else None
            ),
        ),
        Rule(
            "MPI plugin",
            ("cluster.mpi",),
            lambda pc, _k: (
                f"only data_prep.launcher=mpi reads it (data_prep.launcher={pc.data_prep.launcher})"
                if pc.data_prep.launcher != "mpi"
                else None
            ),
        ),
        Rule(
            "ranks per node with GPUs",
            ("cluster.ranks_per_node",),
            lambda pc, _k: (
                f"with GPUs a node runs one rank per GPU (cluster.gpus_per_node={pc.cluster.gpus_per_node})"
                if pc.cluster.gpus_per_node > 0
                else None
            ),
        ),
        Rule(
            "rlhf algorithm keys",
            tuple(f"rlhf.{k}" for k in RLHF_ALGORITHM_KEYS),
            _algorithm_unread,
        ),
    ]


def _rules() -> tuple[Rule, ...]:
    rules = [*_data_rules(), *_model_rules(), *_cluster_rules()]
    for name in TRAIN_STAGES:
        rules += _stage_rules(name)
    for name, used in PARALLEL_USED.items():
        rules.append(
            Rule(
                f"{name} parallel",
                tuple(
                    f"{name}.parallel.{f.name}"
                    for f in dataclasses.fields(ParallelConfig)
                    if f.name not in used
                ),
                _parallel_unread,
            )
        )
    return tuple(rules)


def _stage_rules(name: str) -> list[Rule]:
    out = []
    if name != "rlhf":
        out.append(
            Rule(
                f"{name}: rlhf keys",
                (f"{name}.beta", f"{name}.algorithm"),
                lambda pc, k: f"only rlhf reads it (set rlhf.{k.rpartition('.')[2]})",
            )
        )
    if name != "sft":
        out.append(
            Rule(f"{name}: packing", (f"{name}.pack_examples",), lambda pc, _k: "only sft packs examples")
        )
    if name == "pretrain":
        out.append(
            Rule(
                "pretrain: truncation limit",
                ("pretrain.max_truncated_fraction",),
                lambda pc, _k: "pretrain cuts nothing (its samples are windows of the token stream)",
            )
        )
    out.append(
        Rule(
            f"{name}: LoRA settings",
            tuple(f"{name}.peft.{k}" for k in ("rank", "alpha", "dropout", "target_modules")),
            _lora_unread,
        )
    )
    for key in ("wandb_project", "mlflow_uri"):
        out.append(Rule(f"{name}: {key}", (f"{name}.monitor.{key}",), _sink_unread))
    return out


def _stage_of(key: str) -> Any:
    return key.split(".", 1)[0]


def _parallel_unread(pc: PipelineConfig, key: str) -> str | None:
    name = _stage_of(key)
    return f"{name} does not read it (it reads {', '.join(PARALLEL_USED[name]) or 'none of them'})"


def _lora_unread(pc: PipelineConfig, key: str) -> str | None:
    n = _stage_of(key)
    method = getattr(pc, n).peft.method
    return f"only {n}.peft.method=lora reads it ({n}.peft.method={method})" if method == "none" else None


def _sink_unread(pc: PipelineConfig, key: str) -> str | None:
    n, sink = _stage_of(key), "wandb" if key.endswith("wandb_project") else "mlflow"
    sinks = getattr(pc, n).monitor.sinks
    return None if sink in sinks else f"only a {sink} sink reads it ({n}.monitor.sinks={sinks})"


def _algorithm_unread(pc: PipelineConfig, key: str) -> str | None:
    a = rl.algorithm(pc.rlhf.algorithm)
    if key.removeprefix("rlhf.") in a.keys:
        return None
    return f"rlhf.algorithm={a.name} does not read it (it reads {', '.join(a.keys)})"


RULES = _rules()


def _value(pc: PipelineConfig, key: str) -> Any:
    obj: Any = pc
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def check(pc: PipelineConfig, origins: Origins) -> None:
    """Every key of ``RULES`` the user set where it is unread: a ConfigError naming the key and the mode."""
    for rule in RULES:
        for key in rule.keys:
            if not origins.user_set(key):
                continue
            why = rule.unread(pc, key)
            if why is not None:
                fail(key, _value(pc, key), why if "drop it" in why else f"{why}; drop it")
