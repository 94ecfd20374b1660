"""Models for the lm-eval backend: a Hugging Face directory imported into the engine (one rank when lm-eval's
registry builds the backend itself), and the stop tokens a directory's config.json names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.schema.hf_arch import read_config


def hf_stop_tokens(hf_dir: Path) -> list[int]:
    """config.json's ``eos_token_id`` (an id or a list): where transformers' generation stops too."""
    eos = read_config(hf_dir).get("eos_token_id")
    if eos is None:
        return []
    return [int(x) for x in (eos if isinstance(eos, list) else [eos])]


def has_chat_template(hf_dir: str | Path) -> bool:
    """Whether ``hf_dir`` carries a chat template (chat_template.jinja, or tokenizer_config.json's)."""
    from engine.data.chat import load_template

    try:
        load_template("tokenizer", str(hf_dir))
    except (ValueError, OSError):
        return False
    return True


def dir_template(hf_dir: str | Path, tok: Any) -> Any:
    """``hf_dir``'s own chat template (an engine.data.chat.ChatTemplate) with ``tok``'s eos/bos, or None."""
    from engine.data.chat import run_template

    return run_template("tokenizer", str(hf_dir), tok) if has_chat_template(hf_dir) else None


def load_hf_dir(
    hf_dir: str | Path, max_length: int | None = None, tp: int = 1, threads: int = 1, pp: int = 1
) -> tuple[list[Any], Any, list[int], int]:
    """(model chunks, tokenizer, stop tokens, max_length) for ``hf_dir`` on one rank, or this rank's shard of a
    ``tp``-way tensor-parallel, ``pp``-stage layout (the ranks from torch's rendezvous variables); starts the
    engine's process group when none is up. ``max_length``: default config.json's positions (at most 4096)."""
    from engine.data.datasets import load_tokenizer
    from engine.models.gpt import build_model
    from engine.models.hf_weights import load_hf
    from engine.runtime import distributed as D
    from pipeline.schema.hf_arch import model_config
    from pipeline.schema.sections import ParallelConfig

    path = Path(hf_dir)
    model = model_config(path) if max_length is None else model_config(path, seq_length=int(max_length))
    par = ParallelConfig(tp=tp, pp=pp, micro_batch_size=1, global_batch_size=1)
    D.init(tp, pp, seed=0, threads=threads)
    tok = load_tokenizer(path)
    chunks = build_model(model, par, model.vocab_size or tok.vocab_size, trainable=False)
    load_hf(chunks, path, model)
    return chunks, tok, hf_stop_tokens(path), model.seq_length
