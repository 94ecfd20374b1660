"""Users' SFT and preference data (and, with a model's own chat template, the generated sets) rendered with
``data.chat_template`` (engine.data.chat)."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Any

from engine.data.datasets import Tokenizer
from pipeline.schema.config import DataConfig

SFT_CHAT = "sft_chat.jsonl"


PREF_CHAT = "pref_chat.jsonl"


EVAL_TASK_CHAT = "eval_task_chat.jsonl"


EVAL_PREF_CHAT = "eval_pref_chat.jsonl"


RL_CHAT = "rl_chat.jsonl"


CHAT_FILES = {
    "sft_file": SFT_CHAT,
    "pref_file": PREF_CHAT,
    "eval_task_file": EVAL_TASK_CHAT,
    "eval_pref_file": EVAL_PREF_CHAT,
    "rl_file": RL_CHAT,
}
"""Manifest key -> rendered file; a key is present exactly when its file was written."""


def chat_template(d: DataConfig, tokenizer: Tokenizer) -> Any:
    """``data.chat_template`` compiled, with the tokenizer's own eos/bos tokens as template variables."""
    from engine.data import chat

    return chat.run_template(d.chat_template, d.tokenizer_path, tokenizer)


def write_chat_files(out: Path, d: DataConfig, tokenizer: Tokenizer | None = None) -> dict[str, int]:
    """Render chat data with ``data.chat_template`` (engine.data.chat).

    Users' ``data.sft_paths`` / ``data.pref_paths`` become ``sft_chat.jsonl`` (``{"segments": [[text,
    trained], ...]}``) and ``pref_chat.jsonl`` (rendered ``{"prompt", "chosen", "rejected"}``). With a template
    other than ``project`` (a run starting from a Hugging Face model: its own template) the generated task is
    rendered with it as well: its SFT and preference sets (when the user gave none), online RL's prompts
    ``rl_chat.jsonl`` and the held-out eval sets, ``eval_task_chat.jsonl`` (both ``{"prompt": rendered up
    to the generation prompt, "question", "answer"}``) and ``eval_pref_chat.jsonl``. The manifest names them
    (``sft_file``, ``pref_file``, ``rl_file``, ``eval_task_file``, ``eval_pref_file``); every stage then
    reads them instead of the plain task files (still written), through engine.data.chat.
    """
    from engine.data import chat

    for name in CHAT_FILES.values():
        (out / name).unlink(missing_ok=True)
    counts: dict[str, int] = {}
    generated = d.chat_template != "project"
    jobs: list[tuple[str, list[Path], str, Any]] = []
    for name, paths, own, render in (
        (SFT_CHAT, d.sft_paths, "sft_train.jsonl", chat.render_sft),
        (PREF_CHAT, d.pref_paths, "pref_train.jsonl", chat.render_preference),
    ):
        key = "data.sft_paths" if name == SFT_CHAT else "data.pref_paths"
        if paths:
            jobs.append((name, _expand_any(paths, key), key, render))
        elif generated:
            jobs.append((name, [out / own], own, render))
    if generated:
        jobs.append((RL_CHAT, [out / "rl_train.jsonl"], "rl_train.jsonl", chat.render_task_prompt))
        jobs.append((EVAL_TASK_CHAT, [out / "eval_task.jsonl"], "eval_task.jsonl", chat.render_task_prompt))
        jobs.append((EVAL_PREF_CHAT, [out / "eval_pref.jsonl"], "eval_pref.jsonl", chat.render_preference))
    if not jobs:
        return counts
    if tokenizer is None:
        from engine.data.datasets import load_tokenizer

        tokenizer = load_tokenizer(out / "tokenizer.json")
    tpl = chat_template(d, tokenizer)
    for name, files, key, render in jobs:
        tmp = out / f".{name}.tmp"
        n = 0
        with open(tmp, "w", encoding="utf-8") as f:
            for path in files:
                for where, rec in chat.iter_records(path):
                    f.write(json.dumps(render(rec, where, tpl)) + "\n")
                    n += 1
            f.flush()
            os.fsync(f.fileno())
        if not n:
            raise ValueError(f"{key}: no records in {[str(p) for p in files]}")
        os.replace(tmp, out / name)
        counts[name.removesuffix(".jsonl")] = n
    return counts


def _expand_any(patterns: list[str], key: str) -> list[Path]:
    files: list[Path] = []
    for pat in patterns:
        hits = (
            sorted(Path(p) for p in glob.glob(pat, recursive=True) if Path(p).is_file())
            if glob.has_magic(pat)
            else [Path(pat)]
        )
        for h in hits:
            if not h.is_file():
                raise ValueError(f"{key}: file not found: {h}")
        if not hits:
            raise ValueError(f"{key}: pattern {pat!r} matches no file")
        files += hits
    return files
