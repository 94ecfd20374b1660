"""What cutting a stage's examples at its sequence length cost, and the stage's limit on it.

A source of chat examples (engine.data.chat) cuts every example at ``seq_length + 1`` tokens. An example cut
so short that none of its trained tokens is left (its prompt alone fills the sequence) would train on
nothing: such examples are left out and counted (``Truncation.emptied``); so are online RL's prompts that
leave no room for a response. ``TruncationLimit.check`` then stops the stage before training when all of
them, or more than ``<stage>.max_truncated_fraction`` of them, were lost, naming the key to raise. The
counts go to the stage's outputs (the ledger), its metrics file (the console line) and the report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Truncation:
    """Counts of one source: ``examples`` read, ``truncated`` cut at ``seq_length`` (``emptied`` included),
    ``emptied`` left out because they lost every trained token (or, prompts, left no room to respond)."""

    what: str
    """What the examples are, in messages: examples, preference pairs, prompts."""
    examples: int
    truncated: int
    emptied: int
    seq_length: int
    needed: int = 0
    """The sequence length that would keep every example whole (0: not known)."""
    cause: str = ""
    """How an emptied example lost everything, when not by a cut at seq_length (RL prompts)."""

    @property
    def kept(self) -> int:
        return self.examples - self.emptied

    def as_dict(self) -> dict[str, Any]:
        return {
            "what": self.what,
            "examples": self.examples,
            "truncated": self.truncated,
            "emptied": self.emptied,
            "seq_length": self.seq_length,
            "needed": self.needed,
        }


@dataclass(frozen=True)
class TruncationLimit:
    """How much truncation a stage accepts: any share of emptied examples up to ``max_fraction``, never all."""

    seq_key: str = "seq_length"
    """The key that sets the sequence length (named in messages: the one to raise)."""
    fraction_key: str | None = None
    """The key of ``max_fraction`` (None: a reader without one, such as eval: only "all of them" fails)."""
    max_fraction: float = 1.0
    extra_fix: str = ""
    """Another way out, added to the error (e.g. ``or lower rlhf.max_new_tokens``)."""

    def describe(self, t: Truncation) -> str:
        """One line for the console: how many examples the stage keeps and why any were left out."""
        seq = f"{self.seq_key}={t.seq_length}"
        cut = t.truncated - t.emptied
        tail = f"; {cut} cut at {seq} with trained tokens left" if cut else ""
        if not t.emptied:
            return f"{t.examples} {t.what}: none left out by {seq}{tail}"
        why = t.cause or f"lost every trained token to truncation at {seq}"
        share = t.emptied / t.examples
        return f"{t.examples} {t.what}: {t.emptied} ({share:.1%}) {why}, left out{tail}"

    def check(self, t: Truncation) -> None:
        """ValueError, naming the key to raise, when every example or more than ``max_fraction`` of them was
        emptied."""
        if not t.emptied:
            return
        why = t.cause or f"lose every trained token when cut at {self.seq_key}={t.seq_length}"
        whole = f" ({t.needed} keeps every one whole)" if t.needed > t.seq_length else ""
        fix = f"raise {self.seq_key}{whole}{f' {self.extra_fix}' if self.extra_fix else ''}"
        if t.emptied == t.examples:
            raise ValueError(f"all {t.examples} {t.what} {why}: nothing to train on; {fix}")
        share = t.emptied / t.examples
        if share > self.max_fraction:
            allowed = f"{self.fraction_key}={self.max_fraction:g}" if self.fraction_key else "none"
            raise ValueError(
                f"{t.emptied} of {t.examples} {t.what} ({share:.1%}) {why}, more than {allowed} allows; {fix}"
                + (f" (or raise {self.fraction_key} to leave them out)" if self.fraction_key else "")
            )


def stage_limit(stage: str, max_fraction: float, extra_fix: str = "") -> TruncationLimit:
    """The limit of training stage ``stage`` (its ``seq_length`` and ``max_truncated_fraction`` keys)."""
    return TruncationLimit(
        f"{stage}.seq_length", f"{stage}.max_truncated_fraction", max_fraction, extra_fix=extra_fix
    )
