"""The stage's files: indexed datasets (shards tokenized, then merged), the generated task files, the manifest."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from engine.data.datasets import MANIFEST, Tokenizer, sha256_file
from engine.data.pieces import bounded_batches
from pipeline.records.files import atomic_write_text as _atomic_write
from pipeline.schema.config import DataConfig
from pipeline.schema.data_identity import tokenizer_record
from stages import tasks
from stages.data_prep.chat_files import CHAT_FILES
from stages.data_prep.corpus import EVAL_PREF, PREF, RL, SFT, SFT_NOISE, rng
from stages.data_prep.tokenizer import HF_TOKENIZER_FILES, stop_token_ids


def write_shards(
    tokenizer: Tokenizer, items: Iterable[tuple[str, str]], prefixes: dict[str, Path], dtype: type[np.number]
) -> dict[str, int]:
    """Tokenize (split, document) items into one indexed dataset per split, ``prefixes[split]``.bin/.idx (one
    entry per document, eod appended), a bounded batch at a time (engine.data.pieces); tokens per split."""
    from engine.data.indexed import IndexedWriter  # megatron's format without importing megatron.core

    builders = {s: IndexedWriter(f"{p}.bin", dtype=dtype) for s, p in prefixes.items()}
    total = dict.fromkeys(prefixes, 0)
    for batch in bounded_batches(items, lambda item: len(item[1])):
        for (split, _), ids in zip(batch, tokenizer.encode_arrays([doc for _, doc in batch])):
            builders[split].add_document(np.append(ids, tokenizer.eod))
            total[split] += len(ids) + 1
    for s, p in prefixes.items():
        builders[s].finalize(f"{p}.idx")
    return total


def write_shard(tokenizer: Tokenizer, docs: Iterable[str], prefix: Path, dtype: type[np.number]) -> int:
    """Tokenize ``docs`` into indexed dataset ``prefix``.bin/.idx (one entry per document, eod appended)."""
    return write_shards(tokenizer, (("", doc) for doc in docs), {"": prefix}, dtype)[""]


def merge_shards(shards: list[Path], prefix: Path, dtype: type[np.number]) -> None:
    """Concatenate shard datasets in order into ``prefix``.bin/.idx (temp names, then renamed), streamed: a
    block at a time (engine.data.indexed), whatever the shards' sizes."""
    from engine.data.indexed import IndexedWriter

    tmp = prefix.with_name(f".{prefix.name}.tmp")
    builder = IndexedWriter(f"{tmp}.bin", dtype=dtype)
    for shard in shards:
        builder.add_index(str(shard))
    builder.finalize(f"{tmp}.idx")
    for ext in (".bin", ".idx"):
        os.replace(f"{tmp}{ext}", f"{prefix}{ext}")


def write_task_files(out: Path, d: DataConfig, held: tasks.TaskSplit) -> dict[str, int]:
    """SFT, preference and held-out eval sets; returns their counts."""
    sft = held.train_problems(d.num_sft_examples, rng(d.seed, SFT))
    pref_rng = rng(d.seed, PREF)
    pref = [tasks.pref_record(p, pref_rng) for p in held.train_problems(d.num_pref_pairs, pref_rng)]
    eval_rng = rng(d.seed, EVAL_PREF)
    sft_records, sft_wrong = tasks.noisy_sft_records(sft, d.sft_noise, rng(d.seed, SFT_NOISE))
    files = {
        "sft_train.jsonl": sft_records,
        "pref_train.jsonl": pref,
        "rl_train.jsonl": [
            tasks.eval_record(p) for p in held.train_problems(d.num_sft_examples, rng(d.seed, RL))
        ],
        "eval_task.jsonl": [tasks.eval_record(p) for p in held.held_out],
        "eval_pref.jsonl": [tasks.pref_record(p, eval_rng) for p in held.held_out],
    }
    for name, records in files.items():
        _atomic_write(out / name, "".join(json.dumps(r) + "\n" for r in records))
    counts: dict[str, int] = {name.removesuffix(".jsonl"): len(records) for name, records in files.items()}
    counts["sft_train_wrong"] = sft_wrong  # demonstrations given a systematic error (data.sft_noise)
    return counts


def write_manifest(
    out: Path,
    d: DataConfig,
    tokenizer: Tokenizer,
    dtype: type[np.number],
    counts: dict[str, Any],
    sources: list[str],
    text_files: list[str] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Checksum every output file and write ``manifest.json`` (last, atomically)."""
    names = ["tokenizer.json", "sft_train.jsonl", "pref_train.jsonl", "rl_train.jsonl", "eval_task.jsonl"]
    names += ["eval_pref.jsonl"]
    text_files = text_files if text_files is not None else [f"text_{s}" for s in ("train", "valid")]
    names += [f"{t}{ext}" for t in text_files for ext in (".bin", ".idx")]
    chat = {k: f for k, f in CHAT_FILES.items() if (out / f).is_file()}
    names += list(chat.values()) + [f for f in HF_TOKENIZER_FILES if (out / f).is_file()]
    manifest = {
        **(extra or {}),
        **chat,
        "chat_template": d.chat_template,
        "stop_token_ids": stop_token_ids(d, tokenizer),
        "format": 1,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer": tokenizer_record(tokenizer.hf.to_str(), d.tokenizer_path),  # the ids' identity
        "special_tokens": {
            role: {"token": tokenizer.special_tokens[role], "id": i}
            for role, i in tokenizer.special_ids.items()
        },
        "token_dtype": np.dtype(dtype).name,
        "task": {"name": d.task, "max_operand": d.max_operand, "ops": list(tasks.TASKS[d.task])},
        "corpus": {"kind": d.corpus, "files": len(sources), "max_corpus_mb": d.max_corpus_mb},
        "counts": counts,
        "files": {
            n: {"bytes": (out / n).stat().st_size, "sha256": sha256_file(out / n)} for n in sorted(names)
        },
    }
    _atomic_write(out / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest
