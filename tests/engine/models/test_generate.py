"""Generation on the engine (engine/models/generate.py): the KV cache gives the tokens full recomputation
gives, under TP1, TP2 and PP2 from the same weights; stop tokens end a sequence; seeded sampling repeats.

Each layout is one subprocess run (tests/support/generate_worker.py) on a tiny fp32 model; prompts of different
lengths share one batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.engine_worker import launch
from tests.support.env import REPO

WORKER = REPO / "tests" / "support" / "generate_worker.py"
MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32}
PROMPTS = [[5, 17, 99, 3, 42, 8, 61], [200, 7], [1, 2, 3, 4], [250]]
NEW = 10


def spec(parallel: dict[str, Any] | None = None, **over: Any) -> dict[str, Any]:
    return {"model": dict(MODEL), "parallel": parallel or {}, "prompts": PROMPTS, "new": NEW, **over}


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """The single-rank run and the checkpoint root with its weights (the other layouts load them)."""
    tmp = tmp_path_factory.mktemp("gen1")
    weights = tmp / "weights"
    return launch(1, spec(save_weights=str(weights)), tmp / "run", script=WORKER), weights


def check(r: dict[str, Any]) -> None:
    greedy = r["greedy_cache"]["tokens"]
    assert [len(t) for t in greedy] == [NEW] * len(PROMPTS)
    assert greedy == r["greedy_full"]["tokens"]  # KV cache == full recomputation
    # stop tokens: each row is the greedy row cut before its first stop token, which ``ends`` names
    stops = set(r["stop_tokens"])
    first = [next((i for i, x in enumerate(t) if x in stops), None) for t in greedy]
    assert r["stopped"]["tokens"] == [t if i is None else t[:i] for t, i in zip(greedy, first)]
    assert r["stopped"]["ends"] == [None if i is None else t[i] for t, i in zip(greedy, first)]
    assert r["stopped"]["stopped"] == [i is not None for i in first]
    assert r["stopped"]["stopped"][0] and r["stopped"]["stopped"][1]
    # seeded sampling repeats, another seed differs, the cache does not change samples
    assert r["sample_a"] == r["sample_b"]
    assert r["sample_a"]["tokens"] != r["sample_c"]["tokens"]
    assert r["sample_a"]["tokens"] != greedy
    assert r["sample_full"] == r["sample_a"]
    assert r["top_k1"]["tokens"] == greedy


@pytest.mark.timeout(300)
def test_generate_single_rank(single: tuple[dict[str, Any], Path]) -> None:
    check(single[0])


@pytest.mark.timeout(300)
def test_generate_rope_with_keys_rotated_when_cached(tmp_path: Path) -> None:
    """RoPE: the cache holds keys rotated once, at their positions (engine.models.attention's
    RotatedCacheSelfAttention); generation equals full recomputation, grouped-query heads too. Large initial
    weights peak the attention, so a key rotated at a wrong position changes the tokens."""
    rope = {**MODEL, "position_embedding": "rope", "num_query_groups": 2, "init_method_std": 0.5}
    check(launch(1, spec(model=rope), tmp_path, script=WORKER))


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def test_generate_layouts_match_single_rank(
    layout: dict[str, Any], single: tuple[dict[str, Any], Path], tmp_path: Path
) -> None:
    r = launch(2, spec(layout, load_weights=str(single[1])), tmp_path, script=WORKER)
    check(r)
    assert r["greedy_cache"] == single[0]["greedy_cache"]


def test_unpad_sampling_params_and_top_p() -> None:
    import torch

    from engine.models.generate import SamplingParams, _sample, unpad

    t = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 1]])
    assert unpad(t, [2, 4], side="left") == [[5, 6], [7, 8, 9, 1]]
    assert unpad(torch.tensor([[5, 6, 0, 0]]), [2]) == [[5, 6]]
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    # top_p=0.5 keeps only the token holding 0.7 of the mass; top_k=2 never picks the third token
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).expand(200, 3)
    g = torch.Generator().manual_seed(0)
    assert set(_sample(logits, SamplingParams(temperature=1.0, top_p=0.5), g).tolist()) == {0}
    assert set(_sample(logits, SamplingParams(temperature=1.0, top_k=2), g).tolist()) == {0, 1}


def test_top_k_and_top_p_sample_the_filtered_distribution_by_token_id() -> None:
    import torch

    from engine.models.generate import SamplingParams, _sample

    # ids 0..3 hold 0.3, 0.1, 0.4, 0.2: top-k 3 keeps ids 2, 0, 3; top-p 0.6 of those keeps 2 and 0 (0.4 / 0.3)
    logits = torch.log(torch.tensor([[0.3, 0.1, 0.4, 0.2]])).expand(8000, 4)
    g = torch.Generator().manual_seed(1)
    for params in (
        SamplingParams(temperature=1.0, top_k=3, top_p=0.6),
        SamplingParams(temperature=1.0, top_p=0.6),
    ):
        counts = torch.bincount(_sample(logits, params, g), minlength=4).tolist()
        assert counts[1] == counts[3] == 0, params
        assert abs(counts[2] / 8000 - 4 / 7) < 0.02, (params, counts)
    # no filter: every token, in proportion
    counts = torch.bincount(_sample(logits, SamplingParams(temperature=1.0), g), minlength=4).tolist()
    assert [round(c / 8000, 1) for c in counts] == [0.3, 0.1, 0.4, 0.2]
