"""data_prep as the stage tests run it: a tiny synthetic corpus, a config for it, the stage called in process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from engine.context import StageContext
from pipeline.schema.config import DataConfig, PipelineConfig
from stages import data_prep

WORDS = "the king queen sword crown night day love war peace river stone fire wind 17 2024 3".split()
OUTPUTS = [
    "tokenizer.json",
    "text_train.bin",
    "text_train.idx",
    "text_valid.bin",
    "text_valid.idx",
    "sft_train.jsonl",
    "pref_train.jsonl",
    "rl_train.jsonl",
    "eval_task.jsonl",
    "eval_pref.jsonl",
    "manifest.json",
]


def write_corpus(root: Path) -> None:
    """Four small files (.txt, .md, .jsonl) of random sentences, with numbers, ~60 KB in all."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)

    def para() -> str:
        return " ".join(rng.choice(WORDS, size=int(rng.integers(20, 60)))).capitalize() + "."

    for name in ("a.txt", "b.txt", "c.md"):
        (root / name).write_text("\n\n".join(para() for _ in range(120)) + "\n")
    (root / "d.jsonl").write_text("".join(json.dumps({"text": para(), "id": i}) + "\n" for i in range(30)))


def tiny_config(corpus: Path, **data: object) -> PipelineConfig:
    fields: dict[str, object] = dict(
        corpus="files",
        text_paths=[str(corpus / "*.txt"), str(corpus / "c.md"), str(corpus / "d.jsonl")],
        vocab_size=320,
        valid_fraction=0.1,
        num_sft_examples=60,
        num_pref_pairs=40,
        num_eval_examples=20,
        max_operand=30,
        task="arithmetic",
        task_mix_fraction=0.1,
    )
    return prep_config(fields, data)


def prep_config(fields: dict[str, object], overrides: dict[str, object]) -> PipelineConfig:
    """A default config whose ``data`` section is ``fields`` updated by ``overrides``, data_prep on 1 thread,
    ``run.stages=[data_prep]`` (so data_prep's checks after cleaning hold it to no later stage's batch)."""
    cfg = PipelineConfig()
    cfg.data = DataConfig(**{**fields, **overrides})  # type: ignore[arg-type]
    cfg.data_prep.threads = 1
    cfg.run.stages = ["data_prep"]
    return cfg


def run_prep(cfg: PipelineConfig, out: Path) -> dict:
    return data_prep.main(cfg, StageContext(run_dir=out.parent, stage="data_prep", out_dir=out))
