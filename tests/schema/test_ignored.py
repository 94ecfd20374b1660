"""Keys that do nothing in a mode (pipeline/schema/ignored.py: RULES, the audit) are rejected when the user sets
them there, even to their default value; read in another mode they pass; a shipped preset's value gives way.

Every rule has a row here (a new rule without one fails ``test_every_rule_has_a_case``); every key of every rule
is set to its schema default on the front door's compose path and must fail naming the key and the mode.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeline.__main__ import main
from pipeline.cli.compose import load
from pipeline.schema import ignored, rl
from pipeline.schema.config import PipelineConfig
from pipeline.schema.errors import ConfigError

TOK = "/nonexistent/tokenizer.json"
SOURCES = ["data.corpus=sources", "data.sources=[{path: /nonexistent/a.txt}]"]
FILES = ["data.corpus=files", "data.text_paths=[/nonexistent/a.txt]"]

# rule name -> (overrides of the mode where its keys are unread, words of that mode in the error,
#               overrides of a mode where its first key is read, or None when no mode reads it)
CASES: dict[str, tuple[list[str], str, list[str] | None]] = {
    "corpus=sources keys": (FILES, "(data.corpus=files)", SOURCES),
    "corpus=files keys": ([], "(data.corpus=shakespeare)", FILES),
    "corpus cap": (SOURCES, "data.corpus=sources reads every source whole", []),
    "tokenizer training": ([f"data.tokenizer_path={TOK}"], f"data.tokenizer_path='{TOK}'", []),
    "users' SFT data": (["data.sft_paths=[/nonexistent/s.jsonl]"], "data.sft_paths replaces", []),
    "users' preference data": (["data.pref_paths=[/nonexistent/p.jsonl]"], "data.pref_paths replaces", []),
    "learned positions": ([], "model.position_embedding=learned_absolute", ["model.position_embedding=rope"]),
    "rope without scaling": (
        ["model.position_embedding=rope"],
        "model.rotary_scaling=false",
        ["model.position_embedding=rope", "model.rotary_scaling=true"],
    ),
    "biases everywhere": ([], "model.add_bias_linear=true", ["model.add_bias_linear=false"]),
    "SLURM keys": ([], "executor is local", ["cluster=slurm"]),
    "follow": ([], "executor is local", ["cluster=slurm"]),
    "prefork": (["cluster=debug"], "executor is debug", []),
    "MPI plugin": (
        ["cluster=slurm"],
        "data_prep.launcher=files",
        ["cluster=slurm", "data_prep.launcher=mpi"],
    ),
    "ranks per node with GPUs": (["cluster.gpus_per_node=2"], "cluster.gpus_per_node=2", []),
    "rlhf algorithm keys": (
        [],
        "rlhf.algorithm=",
        [],
    ),  # modes per key from the declarations: _algorithm_mode
    "pretrain: truncation limit": ([], "pretrain cuts nothing", None),
    **{f"{s}: rlhf keys": ([], "only rlhf reads it", None) for s in ("pretrain", "sft", "reward_model")},
    **{f"{s}: packing": ([], "only sft packs", None) for s in ("pretrain", "reward_model", "rlhf")},
    **{
        f"{s}: LoRA settings": (
            [],
            f"{s}.peft.method=none",
            None if s == "pretrain" else [f"{s}.peft.method=lora"],
        )
        for s in ("pretrain", "sft", "reward_model", "rlhf")
    },
    **{
        f"{s}: {k}": ([], f"{s}.monitor.sinks=['tensorboard']", [f"{s}.monitor.sinks=[tensorboard,{sink}]"])
        for s in ("pretrain", "sft", "reward_model", "rlhf")
        for k, sink in (("wandb_project", "wandb"), ("mlflow_uri", "mlflow"))
    },
    **{f"{s} parallel": ([], f"{s} does not read it", None) for s in ("data_prep", "eval", "export")},
}


READ_KEY = {"corpus=sources keys": "data.shard_mb", "corpus=files keys": "data.jsonl_text_key"}
"""The key the acceptance test sets where the first one is the list the mode itself needs."""


def _rule(name: str) -> ignored.Rule:
    return next(r for r in ignored.RULES if r.name == name)


def _default(key: str) -> Any:
    obj: Any = PipelineConfig()
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _text(value: Any) -> str:
    """A value as a Hydra override writes it."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ",".join(_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def _algorithm_mode(key: str) -> list[str] | None:
    """``rlhf=<an algorithm that does not read key>`` (None: every algorithm reads it)."""
    name = key.removeprefix("rlhf.")
    free = [a.name for a in rl.REGISTRY if name not in a.keys]
    return [f"rlhf.algorithm={free[0]}"] if free else None


def _cases() -> list[tuple[str, str]]:
    return [(r.name, k) for r in ignored.RULES for k in r.keys]


def test_every_rule_has_a_case() -> None:
    assert sorted(CASES) == sorted(r.name for r in ignored.RULES)


@pytest.mark.parametrize(("rule", "key"), _cases(), ids=[f"{r}:{k}" for r, k in _cases()])
def test_unread_key_set_to_its_default_is_rejected(rule: str, key: str) -> None:
    mode, words, _ = CASES[rule]
    if rule == "rlhf algorithm keys":
        algo = _algorithm_mode(key)
        if algo is None:  # read by every declared algorithm: nothing to reject
            assert all(key.removeprefix("rlhf.") in a.keys for a in rl.REGISTRY)
            return
        mode = algo
    setting = f"{key}={_text(_default(key))}"
    load(mode, inputs=False)  # the mode alone is fine
    with pytest.raises(ConfigError) as e:
        load([*mode, setting], inputs=False)
    msg = str(e.value)
    assert msg.startswith(f"{key}="), msg
    assert words in msg, msg


@pytest.mark.parametrize("rule", [n for n, c in CASES.items() if c[2] is not None])
def test_the_same_key_is_accepted_where_it_is_read(rule: str) -> None:
    reads = CASES[rule][2]
    assert reads is not None
    key = READ_KEY.get(rule, _rule(rule).keys[0])
    load([*reads, f"{key}={_text(_default(key))}"], inputs=False)


@pytest.mark.parametrize(
    ("rule", "args", "needle"),
    [
        ("corpus cap", [*SOURCES, "data.max_corpus_mb=0.5"], "data.max_corpus_mb=0.5"),
        ("corpus=sources keys", [*FILES, "data.bad_records=fail"], "data.bad_records='fail'"),
        ("prefork", ["cluster=debug", "cluster.prefork=true"], "cluster.prefork=True"),
        ("rlhf algorithm keys", ["rlhf=dpo", "rlhf.group_size=4"], "rlhf.group_size=4"),
    ],
)
def test_through_the_cli_one_line_exit_2(
    rule: str, args: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    code = main([*args, f"run.root={tmp_path / 'runs'}", "experiment=tiny"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(err) == 1 and err[0].startswith(f"config error: {needle}: "), err
    assert CASES[rule][1].split("=")[0] in err[0], err
    assert not (tmp_path / "runs").exists()


def test_a_shipped_preset_gives_way() -> None:
    """experiment=tiny sets data.max_corpus_mb and data.vocab_size for the default corpus and tokenizer; with
    sources or a given tokenizer they do nothing and are not the user's: no error."""
    pc = load(["experiment=tiny", *SOURCES], inputs=False)
    assert pc.data.max_corpus_mb == 0.5
    load(["experiment=tiny", f"data.tokenizer_path={TOK}"], inputs=False)
    load(["rlhf=grpo", "rlhf.algorithm=dpo"], inputs=False)  # the grpo file's online keys give way too


def test_a_users_file_is_the_users(tmp_path: Path) -> None:
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ndata:\n  corpus: sources\n  max_corpus_mb: 2\n  sources:\n    - path: a.txt\n"
    )
    with pytest.raises(ConfigError) as e:
        load([f"hydra.searchpath=[file://{tmp_path}]", "experiment=mine"], inputs=False)
    assert str(e.value).startswith("data.max_corpus_mb=2.0: data.corpus=sources"), e.value
    assert f"[data.max_corpus_mb set at {tmp_path.resolve()}/experiment/mine.yaml:4 (experiment=mine)" in str(
        e.value
    )


def test_rules_name_schema_keys() -> None:
    """Every key of the audit is a field of the schema (a renamed field cannot leave a rule checking nothing)."""
    for r in ignored.RULES:
        for k in r.keys:
            _default(k)
