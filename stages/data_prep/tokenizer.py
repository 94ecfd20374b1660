"""The run's tokenizer: a byte-level BPE trained on the training documents, or ``data.tokenizer_path`` (a Hugging
Face tokenizer directory used unchanged, a bare tokenizer.json or a SentencePiece model)."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from engine.data.datasets import SPECIAL_TOKENS, Tokenizer, hf_special_tokens
from pipeline.records.files import atomic_write_text as _atomic_write
from pipeline.schema.config import DataConfig


def train_tokenizer(docs: Iterable[str], vocab_size: int) -> Any:
    """A byte-level BPE trained on ``docs`` (any iterable: read once, never held): special tokens first, digits
    one per token. Long documents go in pieces cut where the pre-tokenizer splits anyway (engine.data.pieces),
    so the trainer counts the same words and memory does not follow a document's size."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from engine.data.pieces import text_pieces

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator((p for doc in docs for p in text_pieces(doc)), trainer=trainer)
    return hf


def hf_tokenizer_dir(d: DataConfig) -> Path | None:
    """The directory of ``data.tokenizer_path`` when it is a Hugging Face tokenizer used unchanged (its
    tokenizer_config.json names an eos token: engine.data.datasets.hf_special_tokens), else None."""
    if d.tokenizer_path is None:
        return None
    p = Path(d.tokenizer_path)
    folder = p if p.is_dir() else p.parent
    if p.suffix == ".model" or not (folder / "tokenizer.json").is_file():
        return None
    return folder if hf_special_tokens(folder) is not None else None


HF_TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
"""Copied next to tokenizer.json from a Hugging Face tokenizer directory (then listed in the manifest)."""


def tokenizer_text(d: DataConfig, train_docs: Iterable[str]) -> str:
    """The run's tokenizer.json text: a Hugging Face tokenizer's file as it is (byte for byte), else
    :func:`build_tokenizer`'s."""
    folder = hf_tokenizer_dir(d)
    if folder is not None:
        return (folder / "tokenizer.json").read_text(encoding="utf-8")
    return str(build_tokenizer(d, train_docs).to_str())


def copy_hf_tokenizer_files(d: DataConfig, out: Path) -> None:
    folder = hf_tokenizer_dir(d)
    for name in HF_TOKENIZER_FILES:
        if folder is not None and (folder / name).is_file():
            _atomic_write(out / name, (folder / name).read_text(encoding="utf-8"))
        elif (out / name).is_file():
            (out / name).unlink()


def build_tokenizer(d: DataConfig, train_docs: Iterable[str]) -> Any:
    """Train one, or load ``data.tokenizer_path``: a Hugging Face tokenizer directory (hf_tokenizer_dir) is
    used unchanged; a bare tokenizer.json or SentencePiece model gets any missing special token appended."""
    if d.tokenizer_path is None:
        return train_tokenizer(train_docs, d.vocab_size)
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    p = Path(d.tokenizer_path)
    if p.is_dir():
        p = p / "tokenizer.json"
    try:
        hf = sentencepiece_tokenizer(p) if p.suffix == ".model" else HFTokenizer.from_file(str(p))
    except Exception as e:  # missing file or bad JSON: tokenizers raises a plain Exception
        raise ValueError(f"data.tokenizer_path={d.tokenizer_path!r}: cannot load {p}: {e}") from e
    missing = [tok for tok in SPECIAL_TOKENS.values() if hf.token_to_id(tok) is None]
    if missing and hf_tokenizer_dir(d) is None:
        warnings.warn(
            f"data.tokenizer_path: {p} lacks {missing}; adding them at the end of the vocabulary",
            stacklevel=2,
        )
        hf.add_special_tokens([AddedToken(tok, special=True) for tok in missing])
    return hf


def sentencepiece_tokenizer(path: Path) -> Any:
    """A SentencePiece unigram ``.model`` as a HF ``tokenizers`` Tokenizer: the same pieces, scores and ids
    (unigram model, metaspace pre-tokenizer and decoder); normalization is NFKC with whitespace runs made one
    space (SentencePiece's default nmt_nfkc, up to its rare character rules)."""
    import sentencepiece as spm
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    sp = spm.SentencePieceProcessor(model_file=str(path))
    vocab = [(sp.id_to_piece(i), float(sp.get_score(i))) for i in range(sp.get_piece_size())]
    hf = HFTokenizer(models.Unigram(vocab, unk_id=sp.unk_id(), byte_fallback=False))
    hf.normalizer = normalizers.Sequence(
        [normalizers.NFKC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Strip()]
    )
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    hf.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    return hf


def tokenizer_from_str(text: str, d: DataConfig | None = None) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    folder = hf_tokenizer_dir(d) if d is not None else None
    special = hf_special_tokens(folder) if folder is not None else None
    return Tokenizer(HFTokenizer.from_str(text), source=str(folder or ""), special=special)


def token_dtype(vocab_size: int) -> type[np.number]:
    """uint16 when every id fits (megatron's own rule), else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def stop_token_ids(d: DataConfig, tokenizer: Tokenizer) -> list[int]:
    """Tokens that end a generated answer: the eos token, plus the ``eos_token_id`` of a Hugging Face model's
    generation_config.json next to its tokenizer (e.g. Llama 3's end-of-turn token)."""
    ids = [tokenizer.eod]
    folder = hf_tokenizer_dir(d)
    gen = folder / "generation_config.json" if folder is not None else None
    if gen is not None and gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and i not in ids and 0 <= i < tokenizer.vocab_size:
                ids.append(i)
    return ids
