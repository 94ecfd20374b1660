"""Padded vocabulary entries are not tokens: every layout gives the numbers of the unpadded vocabulary.

megatron pads the embedding and output tables to a multiple of ``make_vocab_size_divisible_by x tp``, so an
odd vocabulary gets padding that grows with tp. The padded logits are -inf at the output layer
(``engine.models.gpt.mask_padded_vocab``) and the padded rows are drawn as zeros
(``engine.models.init_weights``): training losses, validation and eval perplexity, DPO's and GRPO's log-probs
and sampling are those of one rank with no padding at all (``make_vocab_size_divisible_by=1``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.support.engine_worker import launch
from tests.support.env import REPO
from tests.support.metrics import FP32_REL, max_rel_delta

WORKER = REPO / "tests" / "support" / "vocab_worker.py"
MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}
# 63: one below the padding multiple (at tp=2 rank 1's shard is all padding); 257: prime (63 padded entries at
# tp=1, 127 at tp=2); 383: prime, one below a multiple of 64 x 2 (one padded entry at tp=1 and 2); 347 with no
# padding multiple (a Hugging Face vocabulary, as imported): padded at tp=2 only
CASES = [
    {"vocab": 63, "divisible_by": 64},
    {"vocab": 257, "divisible_by": 64},
    {"vocab": 383, "divisible_by": 64},
    {"vocab": 347, "divisible_by": 1},
]
LAYOUTS = {"tp1": {}, "tp2": {"tp": 2}, "tp2-pp2": {"tp": 2, "pp": 2}}
SCORE_REL = 1e-5
"""Relative tolerance of forward-only scores (log-probs, eval loss) across layouts (tests/stages/test_eval_tp.py)."""


def key(case: dict[str, Any]) -> str:
    return f"{case['vocab']}/{case['divisible_by']}"


def run(parallel: dict[str, Any], cases: list[dict[str, Any]], tmp: Path) -> dict[str, Any]:
    world = parallel.get("tp", 1) * parallel.get("pp", 1)
    return launch(world, {"parallel": parallel, "model": MODEL, "cases": cases}, tmp, script=WORKER)


@pytest.fixture(scope="module")
def unpadded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One rank, every case without any padding: the numbers every layout must give."""
    got = run({}, [{**c, "divisible_by": 1} for c in CASES], tmp_path_factory.mktemp("unpadded"))
    return {key(c): got[f"{c['vocab']}/1"] for c in CASES}


def rel(a: Any, b: Any) -> float:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(x - y) / np.maximum(np.abs(y), 1e-12)))


@pytest.mark.dist
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_padded_vocabulary_changes_nothing_at_any_layout(
    layout: str, unpadded: dict[str, Any], tmp_path: Path
) -> None:
    got = run(LAYOUTS[layout], CASES, tmp_path)
    for case in CASES:
        k, vocab = key(case), case["vocab"]
        g, w = got[k], unpadded[k]
        print(f"{layout} vocab {k}: train {g['train']} (unpadded {w['train']})")
        assert max_rel_delta(g["train"], w["train"]) < FP32_REL, (k, "train", g["train"], w["train"])
        assert rel(g["valid"]["loss"], w["valid"]["loss"]) < FP32_REL, (k, "valid", g["valid"], w["valid"])
        assert max_rel_delta(g["dpo"]["train"], w["dpo"]["train"]) < FP32_REL, (k, "dpo train")
        assert rel(g["dpo"]["ref_logps"], w["dpo"]["ref_logps"]) < SCORE_REL, (k, "dpo log-probs")
        assert rel(g["logps"], w["logps"]) < SCORE_REL, (k, "grpo log-probs")
        if "eval" in g:  # the eval stage's layouts (tensor parallel only)
            ev, want = g["eval"], w["eval"]
            assert rel(ev["valid_loss"], want["valid_loss"]) < SCORE_REL, (k, ev, want)
            assert ev["pref_margin"] == pytest.approx(want["pref_margin"], rel=1e-4, abs=1e-4)
        assert g["sampled"] < vocab, f"{k}: sampled padded id {g['sampled']} (vocabulary {vocab})"


# ---------------------------------------------------------------------------- the mask, in one process


class _Output(torch.nn.Module):
    """Stands for megatron's output layer: returns (logits, bias) of this rank's shard or of all ranks."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x.new_ones(*x.shape[:-1], self.width) * x.sum(-1, keepdim=True), None


class _Gpt(torch.nn.Module):
    def __init__(self, padded: int, width: int) -> None:
        super().__init__()
        self.vocab_size = padded
        self.output_layer = _Output(width)


@pytest.mark.parametrize(
    ("vocab", "padded", "tp", "rank", "gathered", "first_masked"),
    [
        (257, 320, 1, 0, False, 257),
        (257, 384, 2, 0, False, None),  # rank 0 holds ids 0..191: all real
        (257, 384, 2, 1, False, 257 - 192),
        (257, 384, 2, 1, True, 257),  # gathered logits (generation): the padded tail
        (63, 128, 2, 1, False, 0),  # a shard of padding only
        (256, 256, 2, 1, False, None),  # nothing padded: the logits are untouched
    ],
)
def test_mask_sets_the_padded_logits_of_this_rank_to_minus_inf(
    vocab: int, padded: int, tp: int, rank: int, gathered: bool, first_masked: int | None
) -> None:
    from engine.models.gpt import mask_padded_vocab

    width = padded if gathered else padded // tp
    gpt = _Gpt(padded, width)
    mask_padded_vocab(gpt, vocab, rank, tp)
    x = torch.ones(3, 2, 4, requires_grad=True)
    logits, _ = gpt.output_layer(x)
    start = width if first_masked is None else first_masked
    assert torch.isneginf(logits[..., start:]).all() and torch.isfinite(logits[..., :start]).all()
    if start > 0:  # a softmax over the shard: probability 0 for padding, finite gradients through the mask
        logp = torch.log_softmax(logits, -1)
        assert (logp[..., start:].exp() == 0).all()
        logp[..., 0].sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()


def test_vocabulary_tables_draw_the_real_rows_the_same_whatever_the_padding() -> None:
    from engine.models.init_weights import _draw

    def normal(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return torch.nn.init.normal_(t, 0.0, 0.02, generator=generator)

    real = _draw(normal, [257, 40], torch.Generator().manual_seed(3), None)
    for padded in (257, 320, 384):
        full = _draw(normal, [padded, 40], torch.Generator().manual_seed(3), 257)
        assert torch.equal(full[:257], real) and not full[257:].any()
