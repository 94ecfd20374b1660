"""data_prep's memory does not follow the corpus: one huge document, many shards merged, dedup of many documents.

Memory bounds, not timings: the peak RSS of a data_prep process (its own high-water mark, VmHWM) on a document
of 2 MB on a single line, and the Python heap's peak (tracemalloc) while shards are merged.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from pipeline.schema.config import DataConfig
from pipeline.schema.sections import DataSource
from stages import tasks
from tests.support.env import python_env
from tests.support.prep import WORDS, prep_config, run_prep
from tests.support.timing import scaled

PREP = """
import json, sys
from pathlib import Path
from engine.context import StageContext
from pipeline.schema.build import from_dict
from stages import data_prep
cfg = from_dict(json.loads(sys.argv[1])); out = Path(sys.argv[2])
data_prep.main(cfg, StageContext(run_dir=out.parent, stage="data_prep", out_dir=out))
hwm = [int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmHWM:")]
print("PEAK_MB", hwm[0] / 1024)
"""


def one_line(n_words: int) -> str:
    rng = np.random.default_rng(3)
    return " ".join(
        str(w) + str(p) for w, p in zip(rng.choice(WORDS, n_words), rng.choice(["", ",", "."], n_words))
    )


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads VmHWM from /proc")
@pytest.mark.parametrize("corpus", ["sources", "files"])
def test_one_huge_line_is_tokenized_in_bounded_memory_with_the_same_ids(corpus: str, tmp_path: Path) -> None:
    """A 2 MB document on one line took ~400 MB (5 MB: 1.8 GB) when tokenized whole; in pieces cut before a
    space it stays near the start-up's ~60 MB, and its ids are those of the whole document."""
    text = one_line(360_000)
    assert len(text) > 2_000_000
    if corpus == "sources":
        (tmp_path / "big.jsonl").write_text(json.dumps({"text": text}) + "\n")
        fields: dict[str, object] = {
            "corpus": "sources",
            "sources": [DataSource(path=str(tmp_path / "big.jsonl"))],
        }
    else:
        (tmp_path / "big.txt").write_text(text + "\n")
        fields = {"corpus": "files", "text_paths": [str(tmp_path / "big.txt")]}
    fields.update(vocab_size=300, valid_fraction=0.0, task_mix_fraction=0.0, num_sft_examples=8)
    fields.update(num_pref_pairs=8, num_eval_examples=8, max_operand=30, task="arithmetic")
    cfg = prep_config(fields, {})
    out = tmp_path / "data_prep"
    proc = subprocess.run(
        [sys.executable, "-c", PREP, json.dumps(cfg.to_dict()), str(out)],
        env=python_env(PYTHONWARNINGS="ignore"),
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    peak = float(proc.stdout.split("PEAK_MB")[-1])
    assert peak < 200, f"data_prep peaked at {peak:.0f} MB on one 2 MB line"

    from tokenizers import Tokenizer as HFTokenizer

    from engine.data.indexed import documents

    hf = HFTokenizer.from_file(str(out / "tokenizer.json"))
    prefix = out / ("text_train-s0" if corpus == "sources" else "text_train")
    tokens, offsets = documents(prefix)
    assert len(offsets) == 2  # one document
    assert tokens[:-1].tolist() == hf.encode(text, add_special_tokens=False).ids


def test_merging_many_shards_holds_none_of_them(tmp_path: Path) -> None:
    """40 shards of 5,000 documents: the merge's heap peak stays at a few blocks (it was 15 MB: every length
    and document end as Python ints), and the bytes are the shards' concatenation."""
    from engine.data.indexed import IndexedWriter, read_index
    from stages.data_prep.outputs import merge_shards

    shards = []
    for k in range(40):
        w = IndexedWriter(tmp_path / f"s{k}.bin", np.uint16)
        for i in range(5000):
            w.add_document(np.arange(i % 7 + 1) + k)
        w.finalize(tmp_path / f"s{k}.idx")
        shards.append(tmp_path / f"s{k}")
    tracemalloc.start()
    try:
        merge_shards(shards, tmp_path / "merged", np.uint16)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, f"merge peak {peak / 2**20:.1f} MB"
    assert (tmp_path / "merged.bin").read_bytes() == b"".join(
        (s.with_suffix(".bin")).read_bytes() for s in shards
    )
    _, lengths, doc_index = read_index(tmp_path / "merged.idx")
    assert len(lengths) == 200_000 and doc_index.tolist() == list(range(200_001))


def test_dedup_keeps_first_occurrences_in_compact_memory() -> None:
    """SeenHashes answers as a set of the hashes met so far (first occurrence kept, within and across
    batches), holding 16 bytes per document: 200,000 hashes peak far below a set's ~20 MB."""
    from engine.data.sources import SeenHashes

    rng = np.random.default_rng(0)
    pool = rng.integers(0, 256, size=(3000, 16), dtype=np.uint8)
    seen, reference = SeenHashes(), set()
    for _ in range(60):
        batch = pool[rng.integers(0, len(pool), size=int(rng.integers(0, 200)))]
        expected = []
        for row in batch:
            expected.append(row.tobytes() not in reference)
            reference.add(row.tobytes())
        assert seen.first_seen(batch).tolist() == expected
    tracemalloc.start()
    try:
        big = SeenHashes()
        for _ in range(20):
            big.first_seen(rng.integers(0, 256, size=(10_000, 16), dtype=np.uint8))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sum(len(r) for r in big.runs) == 200_000
    assert peak < 10 * 2**20, f"dedup peak {peak / 2**20:.1f} MB"


def test_streamed_corpus_gives_what_reading_it_whole_gave(tmp_path: Path) -> None:
    """corpus=files streamed (three passes, long documents in pieces) writes the documents, ids and tokenizer
    that reading every file whole, splitting in memory and tokenizing whole documents wrote before."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from engine.data.datasets import SPECIAL_TOKENS
    from engine.data.formats.text import pack_paragraphs
    from engine.data.indexed import documents
    from stages import data_prep

    rng = np.random.default_rng(5)
    (tmp_path / "a.txt").write_bytes(
        "\r\n".join(
            one_line(int(rng.integers(5, 60))) + str(rng.choice(["", "\x0c", "\u2028x", "  ", "\n"]))
            for _ in range(900)
        ).encode()
    )
    records = [{"text": one_line(int(rng.integers(10, 200)))} for _ in range(300)]
    records.insert(100, {"text": one_line(45_000)})  # ~250K characters on one line: four pieces
    lines = [json.dumps(r) for r in records]
    (tmp_path / "b.jsonl").write_text("\n".join(lines[:150]) + "\n\n   \n" + "\n".join(lines[150:]) + "\n")
    (tmp_path / "c.md").write_text("# Title\n\n" + "\n\n".join(one_line(30) for _ in range(50)))
    cfg = prep_config(
        {"corpus": "files", "text_paths": [str(tmp_path / n) for n in ("a.txt", "b.jsonl", "c.md")]},
        {"vocab_size": 400, "valid_fraction": 0.1, "task_mix_fraction": 0.1, "num_sft_examples": 8},
    )
    cfg.data.num_pref_pairs, cfg.data.num_eval_examples, cfg.data.max_operand = 8, 8, 30
    cfg.data.task = "arithmetic"
    out = tmp_path / "data_prep"
    run_prep(cfg, out)

    d = cfg.data  # the corpus as it was read before: every file whole, in memory
    docs = list(pack_paragraphs((tmp_path / "a.txt").read_text(encoding="utf-8").splitlines()))
    docs += [json.loads(ln)["text"] for ln in (tmp_path / "b.jsonl").read_text().splitlines() if ln.strip()]
    docs += list(pack_paragraphs((tmp_path / "c.md").read_text().splitlines()))
    assert max(map(len, docs)) > 200_000
    train, valid = data_prep.split_documents(docs, d.valid_fraction, d.seed)
    held = tasks_split(d)
    train += data_prep.task_documents(held, len(train), d.task_mix_fraction, d.seed)
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=d.vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(train, trainer=trainer, length=len(train))
    assert (out / "tokenizer.json").read_text() == hf.to_str()
    eod = hf.token_to_id(SPECIAL_TOKENS["eod"])
    for split, expected in (("train", train), ("valid", valid)):
        tokens, offsets = documents(out / f"text_{split}")
        assert len(offsets) - 1 == len(expected)
        for j, doc in enumerate(expected):
            assert tokens[offsets[j] : offsets[j + 1]].tolist() == hf.encode(doc).ids + [eod], (split, j)


def tasks_split(d: DataConfig) -> tasks.TaskSplit:
    return tasks.make_split(d.num_eval_examples, d.max_operand, np.random.default_rng([d.seed, 1]), d.task)
