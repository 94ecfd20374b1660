"""Tiny in-memory sample sources of synthetic tokens (tests, smoke runs, benchmarks).

Same interface as engine.data.datasets's sources: ``__len__`` and ``__getitem__(i)`` for any ``i >= 0``
(index ``i`` maps to sample ``i % n``), items are dicts of numpy arrays.
"""

from __future__ import annotations

import numpy as np


def _sequence(rng: np.random.Generator, vocab: int, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """A learnable sequence: a random start followed by +1 steps (mod vocab), with a little noise."""
    start = rng.integers(0, vocab)
    ids = (start + np.arange(seq + 1)) % vocab
    noise = rng.random(seq + 1) < 0.1
    ids[noise] = rng.integers(0, vocab, noise.sum())
    return ids[:-1].astype(np.int64), ids[1:].astype(np.int64)


class SyntheticSource:
    """``n`` language-modelling samples: tokens, labels (shifted by one), loss_mask (all ones)."""

    def __init__(self, n: int, vocab_size: int, seq_length: int, seed: int = 0) -> None:
        if n < 1:
            raise ValueError(f"n={n}: must be >= 1")
        rng = np.random.default_rng(seed)
        pairs = [_sequence(rng, vocab_size, seq_length) for _ in range(n)]
        self.tokens = np.stack([p[0] for p in pairs])
        self.labels = np.stack([p[1] for p in pairs])

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        j = int(i) % len(self.tokens)
        mask = np.ones(self.tokens.shape[1], dtype=np.float32)
        return {"tokens": self.tokens[j], "labels": self.labels[j], "loss_mask": mask}


class SyntheticPreferenceSource:
    """``n`` (chosen, rejected) pairs sharing the first half (the prompt); loss on the rest. Arrays [2, seq].

    Chosen continues the +1 pattern; rejected continues with random tokens.
    """

    def __init__(self, n: int, vocab_size: int, seq_length: int, seed: int = 0) -> None:
        if n < 1:
            raise ValueError(f"n={n}: must be >= 1")
        rng = np.random.default_rng(seed)
        half = seq_length // 2
        ids = np.empty((n, 2, seq_length + 1), dtype=np.int64)
        for j in range(n):
            chosen = (rng.integers(0, vocab_size) + np.arange(seq_length + 1)) % vocab_size
            rejected = chosen.copy()
            rejected[half:] = rng.integers(0, vocab_size, seq_length + 1 - half)
            ids[j] = (chosen, rejected)
        self.ids = ids
        self.mask = np.zeros((2, seq_length), dtype=np.float32)
        self.mask[:, half - 1 :] = 1.0  # labels j >= half - 1 are response tokens

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        ids = self.ids[int(i) % len(self.ids)]
        return {"tokens": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": self.mask}
