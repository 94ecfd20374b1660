"""Sample sources of engine.data.datasets: SFT / preference masks, epochs, megatron GPTDataset on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.data.chat import preference_source, sft_source
from engine.data.datasets import Tokenizer, collate, pretrain_source, sample_range, valid_source
from engine.data.truncation import stage_limit
from stages import data_prep, tasks

TEXT = [
    f"Line {i}: the quick brown fox jumps over {i * 7} lazy dogs.\n\nAnd then it slept." for i in range(60)
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    problems = [tasks.Problem(a, "+", b) for a in range(12) for b in range(12)]
    return Tokenizer(data_prep.train_tokenizer(TEXT + [tasks.text_document(problems)], 300))


@pytest.fixture(scope="module")
def data_dir(tok: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("data")
    for split, docs in (("train", TEXT[:50]), ("valid", TEXT[50:])):
        data_prep.write_shard(tok, docs, d / f"shard-{split}", np.uint16)
        data_prep.merge_shards([d / f"shard-{split}"], d / f"text_{split}", np.uint16)
    rng = np.random.default_rng(0)
    probs = [tasks.Problem(int(a), "+", int(b)) for a, b in rng.integers(0, 60, size=(30, 2))]
    (d / "sft.jsonl").write_text("".join(json.dumps(tasks.sft_record(p)) + "\n" for p in probs))
    (d / "pref.jsonl").write_text("".join(json.dumps(tasks.pref_record(p, rng)) + "\n" for p in probs))
    return d


def test_sft_loss_mask_covers_response_and_eod_only(tok: Tokenizer, data_dir: Path) -> None:
    src = sft_source(data_dir / "sft.jsonl", tok, 32, seed=3, pack=False)
    recs = [json.loads(line) for line in (data_dir / "sft.jsonl").read_text().splitlines()]
    assert len(src) == len(recs) and src.num_truncated == 0
    for i in range(len(src)):
        item = src[i]
        assert {k: (v.dtype, v.shape) for k, v in item.items()} == {
            "tokens": (np.int64, (32,)),
            "labels": (np.int64, (32,)),
            "loss_mask": (np.float32, (32,)),
            "position_ids": (np.int64, (32,)),
        }
        toks, labels, mask = item["tokens"], item["labels"], item["loss_mask"]
        real = toks[1:] != tok.pad
        assert np.array_equal(labels[:-1][real], toks[1:][real])  # shifted by one
        n_prompt = int(np.argmax(toks == tok.assistant)) + 1
        prompt = tok.decode(toks[1 : n_prompt - 1])
        rec = next(r for r in recs if r["prompt"] == prompt)
        assert tok.decode(labels[mask > 0]) == rec["response"] + "<|endoftext|>"
        assert mask[: n_prompt - 1].sum() == 0 and mask[toks == tok.pad].sum() == 0
        assert toks[0] == tok.user and (toks[n_prompt:][mask[n_prompt:] == 0] == tok.pad).all()


def test_sft_packs_whole_examples_into_rows(tok: Tokenizer, data_dir: Path) -> None:
    recs = [json.loads(line) for line in (data_dir / "sft.jsonl").read_text().splitlines()]
    src = sft_source(data_dir / "sft.jsonl", tok, 64, seed=3, pack=True)
    assert 1 < len(src) < len(recs) and src.num_examples == len(recs)
    rows = [src.fetch(j) for j in range(len(src))]  # file order
    text = ""
    for r in rows:
        n = int((r["tokens"] != tok.pad).sum())
        text += tok.decode([*r["tokens"][:n], r["labels"][n - 1]])  # a row's ids: tokens + last label
    expected = "".join(f"<|user|>{r['prompt']}<|assistant|>{r['response']}<|endoftext|>" for r in recs)
    assert text == expected
    responses = "".join(tok.decode(r["labels"][r["loss_mask"] > 0]) for r in rows)
    assert responses == "".join(r["response"] + "<|endoftext|>" for r in recs)
    for r in rows:
        assert r["tokens"][0] == tok.user and r["loss_mask"][r["labels"] == tok.user].sum() == 0


def test_sft_truncation_counts_cut_examples_and_leaves_out_those_without_a_trained_token(
    tok: Tokenizer, data_dir: Path
) -> None:
    recs = [json.loads(line) for line in (data_dir / "sft.jsonl").read_text().splitlines()]
    prompts = [len(tok.encode(f"<|user|>{r['prompt']}<|assistant|>")) for r in recs]
    whole = [p + len(tok.encode(r["response"])) + 1 for p, r in zip(prompts, recs)]
    seq = max(prompts) - 1  # the longest prompts fill the row
    emptied = sum(p > seq for p in prompts)  # label j is token j + 1: a prompt of seq + 1 leaves nothing
    assert 0 < emptied < len(recs)
    with pytest.warns(UserWarning, match="truncated"):
        src = sft_source(data_dir / "sft.jsonl", tok, seq, seed=0, pack=False)
    assert src.truncation is not None and src.truncation.as_dict() == {
        "what": "examples",
        "examples": len(recs),
        "truncated": sum(w > seq + 1 for w in whole),
        "emptied": emptied,
        "seq_length": seq,
        "needed": max(whole) - 1,
    }
    assert len(src) == len(recs) - emptied and src[0]["tokens"].shape == (seq,)
    assert all(src.fetch(j)["loss_mask"].sum() > 0 for j in range(len(src)))
    share = emptied / len(recs)
    with pytest.raises(ValueError, match=r"raise sft\.seq_length .*or raise sft\.max_truncated_fraction"):
        sft_source(data_dir / "sft.jsonl", tok, seq, seed=0, limit=stage_limit("sft", share / 2))
    sft_source(data_dir / "sft.jsonl", tok, seq, seed=0, limit=stage_limit("sft", share))  # at the limit
    with pytest.raises(
        ValueError, match=rf"all {len(recs)} examples lose every trained token .*sft\.seq_length=8"
    ):
        sft_source(data_dir / "sft.jsonl", tok, 8, seed=0, limit=stage_limit("sft", 1.0))


def test_preference_pairs_left_without_a_reply_token_are_left_out(tok: Tokenizer, data_dir: Path) -> None:
    recs = [json.loads(line) for line in (data_dir / "pref.jsonl").read_text().splitlines()]
    prompts = [len(tok.encode(f"<|user|>{r['prompt']}<|assistant|>")) for r in recs]
    seq = max(prompts) - 1
    emptied = sum(p > seq for p in prompts)
    src = preference_source(data_dir / "pref.jsonl", tok, seq, seed=0)
    assert (
        src.truncation is not None and src.truncation.emptied == emptied and len(src) == len(recs) - emptied
    )
    assert all((src.fetch(j)["loss_mask"].sum(-1) > 0).all() for j in range(len(src)))
    with pytest.raises(ValueError, match=r"preference pairs .*raise rlhf\.seq_length"):
        preference_source(data_dir / "pref.jsonl", tok, seq, seed=0, limit=stage_limit("rlhf", 0.0))


def test_preference_pairs_differ_only_in_response(tok: Tokenizer, data_dir: Path) -> None:
    src = preference_source(data_dir / "pref.jsonl", tok, 32, seed=1)
    for i in range(len(src)):
        item = src[i]
        assert item["tokens"].shape == (2, 32) and item["loss_mask"].dtype == np.float32
        n_prompt = int(np.argmax(item["tokens"][0] == tok.assistant)) + 1
        assert np.array_equal(item["tokens"][0, :n_prompt], item["tokens"][1, :n_prompt])
        chosen, rejected = (tok.decode(item["labels"][r][item["loss_mask"][r] > 0]) for r in (0, 1))
        assert chosen != rejected and chosen.endswith("<|endoftext|>") and rejected.endswith("<|endoftext|>")
        problem = tasks.parse_prompt(tok.decode(item["tokens"][0, 1 : n_prompt - 1]))
        assert chosen.removesuffix("<|endoftext|>") == problem.answer
        assert tasks.miss_kind(problem, rejected.removesuffix("<|endoftext|>")) is not None


def test_any_index_is_valid_and_epochs_are_seeded_permutations(tok: Tokenizer, data_dir: Path) -> None:
    src = sft_source(data_dir / "sft.jsonl", tok, 32, seed=5)
    n = len(src)
    epoch = [tuple(src[i]["tokens"]) for i in range(n)]
    epoch2 = [tuple(src[n + i]["tokens"]) for i in range(n)]
    assert sorted(epoch) == sorted(epoch2) and epoch != epoch2
    again = sft_source(data_dir / "sft.jsonl", tok, 32, seed=5)
    assert all(np.array_equal(again[i]["tokens"], src[i]["tokens"]) for i in (0, 7, n + 3, 10 * n + 1))
    with pytest.raises(IndexError):
        src[-1]


def test_pretrain_and_valid_sources_on_gpt_dataset(tok: Tokenizer, data_dir: Path) -> None:
    src = pretrain_source(data_dir / "text_train", tok, 16, num_samples=100, seed=1)
    assert len(src) >= 100
    item = src[0]
    assert {k: v.dtype for k, v in item.items()} == {
        "tokens": np.int64,
        "labels": np.int64,
        "loss_mask": np.float32,
        "position_ids": np.int64,
    }
    assert item["tokens"].shape == (16,) and np.array_equal(item["tokens"][1:], item["labels"][:-1])
    assert np.array_equal(src[5 * len(src) + 2]["tokens"], src[5 * len(src) + 2]["tokens"])
    again = pretrain_source(data_dir / "text_train", tok, 16, num_samples=100, seed=1)
    assert np.array_equal(again[3]["tokens"], src[3]["tokens"])
    assert (data_dir / "cache").is_dir()
    val = valid_source(data_dir / "text_valid", tok, 16, seed=1)
    assert 0 < len(val) < len(src)


def test_pretrain_source_with_torch_distributed_initialised(
    tok: Tokenizer, data_dir: Path, tmp_path: Path
) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        src = pretrain_source(data_dir / "text_train", tok, 16, num_samples=50, seed=2)
        assert len(src) >= 50 and src[60]["tokens"].shape == (16,)
    finally:
        dist.destroy_process_group()


def test_sample_range_follows_the_global_sample_index() -> None:
    assert sample_range(0, 16) == range(0, 16)
    assert sample_range(3, 16, dp_rank=1, dp_size=2) == range(56, 64)
    assert [i for r in range(4) for i in sample_range(2, 8, r, 4)] == list(range(16, 24))
    with pytest.raises(ValueError):
        sample_range(0, 10, 0, 3)
    batch = collate([{"x": np.zeros(3)}, {"x": np.ones(3)}])
    assert batch["x"].shape == (2, 3)


def test_valid_source_of_an_empty_dataset_is_none(tok: Tokenizer, tmp_path: Path) -> None:
    data_prep.write_shard(tok, [], tmp_path / "shard", np.uint16)
    data_prep.merge_shards([tmp_path / "shard"], tmp_path / "text_valid", np.uint16)
    assert valid_source(tmp_path / "text_valid", tok, 16, seed=0) is None


def test_max_truncated_fraction_has_a_domain_and_pretrain_does_not_read_it() -> None:
    from pipeline.cli.compose import load
    from pipeline.schema.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^sft\.max_truncated_fraction=1\.5: must be .* <= 1"):
        load(["sft.max_truncated_fraction=1.5"], inputs=False)
    with pytest.raises(ConfigError, match=r"^pretrain\.max_truncated_fraction=0\.5: pretrain cuts nothing"):
        load(["pretrain.max_truncated_fraction=0.5"], inputs=False)
    assert load(["rlhf.max_truncated_fraction=0.5"], inputs=False).rlhf.max_truncated_fraction == 0.5
