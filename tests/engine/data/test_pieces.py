"""engine.data.pieces: a long document is tokenized in pieces with exactly the ids of the whole document
(byte-level BPE: the pipeline's own, GPT-2's and Llama 3's split patterns), batches are bounded."""

from __future__ import annotations

import numpy as np
import pytest

from engine.data.datasets import SPECIAL_TOKENS, Tokenizer
from engine.data.pieces import PIECE_CHARS, bounded_batches, text_pieces
from stages.data_prep.tokenizer import train_tokenizer

LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def messy_text(n_words: int, seed: int = 0) -> str:
    """Words, digits, punctuation, unicode and every kind of whitespace run, with no document structure."""
    rng = np.random.default_rng(seed)
    words = "the King's  crown,\tnight 2024 3.14 café «quoted» (war) -- peace!\n\n  river\r\n x日本語 don't".split(
        " "
    )
    seps = [" ", " ", " ", "  ", "\n", " \n ", "\t", "   ", ""]
    return "".join(str(rng.choice(words)) + str(rng.choice(seps)) for _ in range(n_words))


def gpt_like(pattern: str | None, docs: list[str]) -> object:
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer(models.BPE())
    if pattern is None:  # GPT-2's pattern, inside ByteLevel
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        split = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
        hf.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(docs, trainer=trainer)
    return hf


def test_pieces_are_bounded_cover_the_text_and_cut_before_a_space() -> None:
    text = messy_text(3000) + "x" * 500 + messy_text(50, 1)
    for limit in (7, 40, 333):
        pieces = text_pieces(text, limit)
        assert "".join(pieces) == text and all(0 < len(p) <= limit for p in pieces)
        for p in pieces[1:]:  # each cut is before a space after a non-space, or forced in the run of x's
            assert p[0] == " " or "x" * limit in text
    assert text_pieces("short", 10) == ["short"] and text_pieces("", 10) == [""]


@pytest.mark.parametrize("kind", ["pipeline", "gpt2", "llama3"])
def test_pieces_give_the_ids_of_the_whole_document(kind: str) -> None:
    sample = [messy_text(400, s) for s in range(20)]
    hf = (
        train_tokenizer(sample, 700)
        if kind == "pipeline"
        else gpt_like(None if kind == "gpt2" else LLAMA3, sample)
    )
    text = messy_text(4000, 99)
    whole = hf.encode(text, add_special_tokens=False).ids  # type: ignore[attr-defined]
    for limit in (120, 200, 4096):
        pieces = text_pieces(text, limit)
        assert len(pieces) > 4 and all(p[0] == " " for p in pieces[1:])  # no cut forced by the bound
        ids = [i for p in pieces for i in hf.encode(p, add_special_tokens=False).ids]  # type: ignore[attr-defined]
        assert ids == whole, limit


def test_encode_batch_of_a_long_document_is_the_whole_documents_encoding() -> None:
    sample = [messy_text(400, s) for s in range(20)]
    tok = Tokenizer(train_tokenizer(sample, 700))
    long = messy_text(60000, 5)  # several pieces of PIECE_CHARS
    assert len(long) > 3 * PIECE_CHARS
    docs = ["a short one", long, "", messy_text(30, 6)]
    expected = [tok.hf.encode(d, add_special_tokens=False).ids for d in docs]
    assert tok.encode_batch(docs) == expected


def test_batches_are_bounded_in_count_and_characters() -> None:
    items = ["x" * n for n in (5, 1, 30, 2, 2, 2, 2, 50, 1)]
    batches = list(bounded_batches(items, len, max_items=3, max_chars=10))
    assert [x for b in batches for x in b] == items
    assert all(len(b) <= 3 and sum(map(len, b[:-1])) < 10 for b in batches)
    assert [len(b) for b in batches] == [3, 3, 2, 1]
