"""data_prep on a tiny synthetic corpus: round trip, tokenizer contract, manifest, determinism, errors, MPI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.data.datasets import SPECIAL_TOKENS, load_tokenizer, read_manifest
from pipeline.schema.config import PipelineConfig
from stages import data_prep, tasks
from stages.data_prep.corpus import iter_task_documents
from tests.support.env import REPO
from tests.support.prep import OUTPUTS, run_prep, tiny_config, write_corpus
from tests.support.timing import scaled


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    write_corpus(root)
    return root


@pytest.fixture(scope="module")
def prepared(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[PipelineConfig, Path, dict]:
    cfg = tiny_config(corpus)
    out = tmp_path_factory.mktemp("run") / "data_prep"
    return cfg, out, run_prep(cfg, out)


def expected_documents(cfg: PipelineConfig) -> tuple[list[str], list[str]]:
    d = cfg.data
    docs, _ = data_prep.read_corpus(d)
    train, valid = data_prep.split_documents(docs, d.valid_fraction, d.seed)
    held = tasks.make_split(d.num_eval_examples, d.max_operand, np.random.default_rng([d.seed, 1]))
    mix = data_prep.task_documents(held, len(train), d.task_mix_fraction, d.seed)
    return train + mix, valid


def test_round_trip_text_tokens_indexed_dataset(prepared: tuple[PipelineConfig, Path, dict]) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    cfg, out, result = prepared
    tok = load_tokenizer(out)
    train, valid = expected_documents(cfg)
    assert result["counts"]["documents_task"] > 0 and any(d.startswith("What is") for d in train)
    for split, docs in (("train", train), ("valid", valid)):
        ds = IndexedDataset(str(out / f"text_{split}"))
        assert len(ds) == len(docs) > 0
        assert ds[0].dtype == np.uint16
        for i, doc in enumerate(docs):
            ids = ds[i].tolist()
            assert ids == tok.encode(doc) + [tok.eod]
            assert tok.decode(ids[:-1]) == doc


def test_digits_are_split_one_per_token(prepared: tuple[PipelineConfig, Path, dict]) -> None:
    tok = load_tokenizer(prepared[1])
    ids = tok.encode("In 1599 there were 2024 swords and 30 + 45 = 75.")
    pieces = [tok.decode([i]) for i in ids]
    assert "".join(pieces) == "In 1599 there were 2024 swords and 30 + 45 = 75."
    for p in pieces:
        assert not any(c.isdigit() for c in p) or (len(p) == 1 and p.isdigit()), p


def test_special_token_ids_are_fixed(prepared: tuple[PipelineConfig, Path, dict], tmp_path: Path) -> None:
    tok = load_tokenizer(prepared[1])
    assert [tok.eod, tok.pad, tok.user, tok.assistant] == [0, 1, 2, 3]
    manifest = read_manifest(prepared[1])
    assert {r: v["id"] for r, v in manifest["special_tokens"].items()} == {
        "eod": 0,
        "pad": 1,
        "user": 2,
        "assistant": 3,
    }
    other = data_prep.train_tokenizer(["completely different text, 42 times over"] * 20, 300)
    assert [other.token_to_id(t) for t in SPECIAL_TOKENS.values()] == [0, 1, 2, 3]
    # Special tokens in text are recognised whole.
    assert tok.encode("<|user|>hi<|assistant|>") == [2, *tok.encode("hi"), 3]


def test_manifest_written_last_and_checksums_verify(prepared: tuple[PipelineConfig, Path, dict]) -> None:
    _, out, result = prepared
    manifest = read_manifest(out, verify=True)
    assert sorted(manifest["files"]) == sorted(n for n in OUTPUTS if n != "manifest.json")
    assert manifest["vocab_size"] == result["vocab_size"] <= 320
    assert manifest["counts"]["sft_train"] == 60 and manifest["counts"]["eval_task"] == 20
    m_time = (out / "manifest.json").stat().st_mtime_ns
    assert all((out / n).stat().st_mtime_ns <= m_time for n in OUTPUTS)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")], "temporary files left behind"


def test_corrupted_file_fails_verification(
    prepared: tuple[PipelineConfig, Path, dict], tmp_path: Path
) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for n in OUTPUTS:
        (copy / n).write_bytes((prepared[1] / n).read_bytes())
    data = bytearray((copy / "text_valid.bin").read_bytes())
    data[0] ^= 1
    (copy / "text_valid.bin").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="text_valid.bin"):
        read_manifest(copy)


def test_failed_rerun_leaves_no_manifest(
    prepared: tuple[PipelineConfig, Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, out, _ = prepared
    rerun = tmp_path / "data_prep"
    rerun.mkdir()
    (rerun / "manifest.json").write_bytes((out / "manifest.json").read_bytes())

    def boom(*a: object, **k: object) -> None:
        raise RuntimeError("disk full")

    monkeypatch.setattr(data_prep, "write_task_files", boom)
    with pytest.raises(RuntimeError):
        run_prep(cfg, rerun)
    assert not (rerun / "manifest.json").exists()
    with pytest.raises(ValueError, match="no manifest"):
        read_manifest(rerun)


def test_same_seed_same_bytes(prepared: tuple[PipelineConfig, Path, dict], tmp_path: Path) -> None:
    cfg, out, _ = prepared
    again = tmp_path / "data_prep"
    run_prep(cfg, again)
    for n in OUTPUTS:
        assert (again / n).read_bytes() == (out / n).read_bytes(), n


def test_generated_sets_hold_out_eval_prompts(prepared: tuple[PipelineConfig, Path, dict]) -> None:
    cfg, out, _ = prepared

    def load(name: str) -> list[dict]:
        return [json.loads(line) for line in (out / name).read_text().splitlines()]

    held = {r["prompt"] for r in load("eval_task.jsonl")}
    assert held == {r["prompt"] for r in load("eval_pref.jsonl")} and len(held) == 20
    assert not held & {r["prompt"] for r in load("sft_train.jsonl")}
    assert not held & {r["prompt"] for r in load("pref_train.jsonl")}
    assert not held & {r["prompt"] for r in load("rl_train.jsonl")}
    train, _ = expected_documents(cfg)
    mixed = {
        line.rsplit("?", 1)[0] + "?"
        for doc in train
        if doc.startswith("What is")
        for line in doc.splitlines()
    }
    assert mixed and not held & mixed
    for r in load("sft_train.jsonl"):
        assert tasks.is_correct(r["response"], tasks.parse_prompt(r["prompt"]).value)


def test_any_range_of_the_task_documents_is_the_same_slice_of_all() -> None:
    """Document i of the task mix depends on the seed and i alone, so ranks make their ranges in parallel."""
    held = tasks.make_split(20, 99, np.random.default_rng([0, 1]))
    every = data_prep.task_documents(held, 90, 0.1, seed=7)
    assert len(every) == 10 and len(set(every)) == 10
    cut = [list(iter_task_documents(held, 90, 0.1, 7, 0, lo, hi)) for lo, hi in ((0, 3), (3, 7), (7, 99))]
    assert sum(cut, []) == every
    assert data_prep.task_documents(held, 90, 0.1, seed=8) != every


def test_max_corpus_mb_caps_the_text(corpus: Path, tmp_path: Path) -> None:
    cfg = tiny_config(corpus, max_corpus_mb=0.01)
    docs, files = data_prep.read_corpus(cfg.data)
    size = sum(len(d.encode()) for d in docs)
    assert 10_000 <= size < 10_000 + data_prep.DOC_CHARS * 2 and files == [str(corpus / "a.txt")]


def test_missing_input_names_key_and_file(corpus: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(ValueError, match=r"data\.text_paths.*nope\.txt"):
        run_prep(tiny_config(corpus, text_paths=[str(missing)]), tmp_path / "out")
    with pytest.raises(ValueError, match=r"data\.text_paths.*\*\.nothing"):
        data_prep.read_corpus(tiny_config(corpus, text_paths=[str(tmp_path / "*.nothing")]).data)
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match=r"data\.text_paths.*empty\.txt.*empty"):
        data_prep.read_corpus(tiny_config(corpus, text_paths=[str(tmp_path / "empty.txt")]).data)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"data\.jsonl_text_key='text'.*bad\.jsonl:1"):
        data_prep.read_corpus(tiny_config(corpus, text_paths=[str(tmp_path / "bad.jsonl")]).data)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_tokenizer_path_is_reused(
    prepared: tuple[PipelineConfig, Path, dict], corpus: Path, tmp_path: Path
) -> None:
    cfg = tiny_config(corpus, tokenizer_path=str(prepared[1] / "tokenizer.json"), vocab_size=4096)
    out = tmp_path / "data_prep"
    run_prep(cfg, out)
    assert (out / "tokenizer.json").read_bytes() == (prepared[1] / "tokenizer.json").read_bytes()
    with pytest.raises(ValueError, match=r"data\.tokenizer_path"):
        run_prep(tiny_config(corpus, tokenizer_path=str(tmp_path / "none.json")), tmp_path / "x")


@pytest.mark.dist
def test_mpi_two_ranks_byte_identical(prepared: tuple[PipelineConfig, Path, dict], tmp_path: Path) -> None:
    cfg, out, _ = prepared
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if not mpiexec.exists():
        pytest.skip("mpiexec not installed next to the interpreter (pip install mpi4py mpich)")
    two = tmp_path / "data_prep"
    script = (
        "import json, sys; from pathlib import Path; from pipeline.schema.build import from_dict; "
        "from stages import data_prep; from engine.context import StageContext; "
        "cfg = from_dict(json.loads(sys.argv[1])); out = Path(sys.argv[2]); "
        "r = data_prep.main(cfg, StageContext(run_dir=out.parent, stage='data_prep', out_dir=out)); "
        "print('RESULT', json.dumps(r))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [str(mpiexec), "-n", "2", sys.executable, "-c", script, json.dumps(cfg.to_dict()), str(two)],
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(240),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = [
        json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("RESULT")
    ]
    assert sorted(r.get("ranks", 0) for r in results) == [0, 2]
    for n in OUTPUTS:
        assert (two / n).read_bytes() == (out / n).read_bytes(), n


def test_launcher_ranks_meet_through_files_by_their_context(tmp_path: Path) -> None:
    """The ranks' place comes from StageContext.dist (the launcher), not from the environment."""
    from engine.context import DistEnv
    from stages.data_prep.world import FileWorld, make_world

    cfg = PipelineConfig()
    cfg.data.corpus = "sources"
    world = make_world(cfg, DistEnv(1, 2, 1, "node0", 20001), tmp_path)
    assert isinstance(world, FileWorld) and (world.rank, world.size) == (1, 2)
    assert world.folder == tmp_path / ".world-node0-20001"
    single = make_world(cfg, None, tmp_path)
    assert not isinstance(single, FileWorld) and (single.rank, single.size) == (0, 1)
