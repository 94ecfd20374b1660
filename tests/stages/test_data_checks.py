"""Data correctness through the CLI: one tokenizer per run (megatron prefixes), what remains after cleaning,
templates over null fields, the pre-flight of compressed JSON lines, one corpus estimate for every mode."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from pipeline.__main__ import main
from pipeline.records.ledger import FAILED, Ledger
from pipeline.schema import data_identity
from pipeline.schema.sections import DataSource
from tests.support import cli
from tests.support.prep import prep_config, run_prep

TINY = ["experiment=tiny", "cluster=debug"]


def words(n: int, seed: int) -> list[str]:
    """``n`` made-up words (many distinct ones, so a BPE fills its vocabulary)."""
    rng = np.random.default_rng(seed)
    letters = list("abcdefghijklmnoprstuvwy")
    return ["".join(rng.choice(letters, size=int(rng.integers(2, 9)))) for _ in range(n)]


def docs(n: int, seed: int, tag: str = "d") -> list[str]:
    rng = np.random.default_rng(seed)
    vocab = words(400, seed)
    return [
        f"{tag} {i}: " + " ".join(rng.choice(vocab, size=int(rng.integers(30, 60)))) + "." for i in range(n)
    ]


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def cli_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """The CLI (in process) exits 2 with one ``config error`` line and writes no run directory; returns it."""
    capsys.readouterr()
    code = main([*TINY, f"run.root={tmp_path / 'runs'}", *args])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(err) == 1 and err[0].startswith("config error: "), err
    assert not (tmp_path / "runs").exists() or not any(
        p for p in (tmp_path / "runs").iterdir() if not p.name.startswith(".")
    ), "a config error must write no run directory"
    return err[0]


def sources_arg(*srcs: dict[str, object]) -> str:
    return (
        "data.sources=["
        + ",".join("{" + ",".join(f"{k}: '{v}'" for k, v in s.items()) + "}" for s in srcs)
        + "]"
    )


# ---------------------------------------------------------------------------- one run, one tokenizer


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A data_prep output A (its own BPE of 512 tokens) and a second tokenizer C (300 tokens, other text)."""
    from stages.data_prep import train_tokenizer

    root = tmp_path_factory.mktemp("made")
    write_jsonl(root / "a.jsonl", [{"text": t} for t in docs(600, 1, "a")])
    cfg = prep_config(
        dict(
            corpus="sources",
            sources=[DataSource(path=str(root / "a.jsonl"))],
            vocab_size=512,
            valid_fraction=0.0,
            num_sft_examples=10,
            num_pref_pairs=10,
            num_eval_examples=10,
            max_operand=99,
        ),
        {},
    )
    run_prep(cfg, root / "A")
    train_tokenizer(docs(300, 2, "c"), 300).save(str(root / "C.json"))
    foreign = root / "foreign"
    foreign.mkdir()
    for ext in (".bin", ".idx"):  # the same ids, without the manifest that names their tokenizer
        shutil.copy(root / "A" / f"text_train-s0{ext}", foreign / f"ids{ext}")
    write_jsonl(root / "new.jsonl", [{"text": t} for t in docs(600, 3, "n")])
    return {
        "root": root,
        "A": root / "A",
        "C": root / "C.json",
        "foreign": foreign / "ids",
        "new": root / "new.jsonl",
    }


def test_a_prefix_without_the_tokenizer_that_made_it_is_refused(
    made: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The silent wrong model: a data_prep prefix blended with new JSON lines and no data.tokenizer_path
    trained a new BPE, so the prefix's ids meant other tokens; now a config error names the prefix's tokenizer."""
    prefix = made["A"] / "text_train-s0"
    err = cli_error(
        tmp_path,
        capsys,
        "run.stages=[data_prep,pretrain]",
        "data.corpus=sources",
        sources_arg({"path": prefix}, {"path": made["new"], "name": "new"}),
    )
    assert f"data.sources[0].path='{prefix}'" in err
    assert f"data.tokenizer_path={made['A'] / 'tokenizer.json'}" in err and "manifest.json" in err
    # the same with the prefix given as format: megatron, second in the list
    err = cli_error(
        tmp_path,
        capsys,
        "run.stages=[data_prep]",
        "data.corpus=sources",
        sources_arg({"path": made["new"]}, {"path": prefix, "format": "megatron"}),
    )
    assert "data.sources[1].path=" in err and "data.tokenizer_path=None" in err


def test_a_prefix_of_another_tokenizer_names_both(
    made: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix, a_tok, c_tok = made["A"] / "text_train-s0", made["A"] / "tokenizer.json", made["C"]
    common = ["run.stages=[data_prep]", "data.corpus=sources", f"data.tokenizer_path={c_tok}"]
    err = cli_error(tmp_path, capsys, *common, sources_arg({"path": prefix}, {"path": made["new"]}))
    assert f"from the tokenizer {a_tok} (recorded in" in err and f"data.tokenizer_path={c_tok}" in err
    assert "vocabulary" in err and " in the first, " in err  # the first id that means another token
    # a foreign prefix whose tokenizer the user names: compared the same way
    err = cli_error(
        tmp_path,
        capsys,
        *common,
        sources_arg({"path": made["foreign"], "tokenizer": a_tok}, {"path": made["new"]}),
    )
    assert f"from the tokenizer {a_tok} (the source's tokenizer" in err and str(c_tok) in err
    # a foreign prefix nobody names: its ids are checked against the vocabulary at least
    err = cli_error(tmp_path, capsys, *common, sources_arg({"path": made["foreign"]}, {"path": made["new"]}))
    assert "holds token id" in err and "beyond the vocabulary" in err and "data.sources[0].tokenizer" in err
    # and without any tokenizer for the run
    err = cli_error(
        tmp_path,
        capsys,
        "run.stages=[data_prep]",
        "data.corpus=sources",
        sources_arg({"path": made["foreign"]}),
    )
    assert "data.tokenizer_path (and data.sources[0].tokenizer)" in err
    # a tokenizer named on a text source is a mistake
    err = cli_error(tmp_path, capsys, *common, sources_arg({"path": made["new"], "tokenizer": c_tok}))
    assert "data.sources[0].tokenizer=" in err and "only a megatron prefix is token ids" in err


def test_a_prefix_with_its_own_tokenizer_prepares(made: dict[str, Path], tmp_path: Path) -> None:
    """The fix the errors name works: data_prep completes, the manifest records the tokenizer's identity."""
    a_tok = made["A"] / "tokenizer.json"
    r = cli.run(
        tmp_path / "runs",
        *TINY,
        "run.stages=[data_prep]",
        "data.corpus=sources",
        f"data.tokenizer_path={a_tok}",
        sources_arg(
            {"path": made["A"] / "text_train-s0"},
            {"path": made["foreign"], "tokenizer": a_tok},
            {"path": made["new"]},
        ),
    )
    cli.ok(r)
    (shared,) = (tmp_path / "runs" / ".data").glob("data_prep-*[0-9a-f]")
    manifest = json.loads((shared / "manifest.json").read_text())
    a = json.loads((made["A"] / "manifest.json").read_text())["tokenizer"]
    assert manifest["tokenizer"]["vocab_sha256"] == a["vocab_sha256"] and manifest["tokenizer"][
        "from"
    ] == str(a_tok)
    assert a["from"] == "trained" and a["vocab_size"] == 512
    assert manifest["sources"]["s0"]["tokens_train"] > 0  # the prefix's tokens counted


def test_data_prep_itself_refuses_a_prefix_without_its_tokenizer(
    made: dict[str, Path], tmp_path: Path
) -> None:
    """Without the pre-flight (a job started otherwise) data_prep checks the same before tokenizing."""
    cfg = prep_config(
        dict(
            corpus="sources",
            sources=[DataSource(path=str(made["foreign"])), DataSource(path=str(made["new"]))],
            vocab_size=300,
            num_sft_examples=10,
            num_pref_pairs=10,
            num_eval_examples=10,
            max_operand=99,
        ),
        {},
    )
    with pytest.raises(ValueError, match=r"data\.sources\[0\]\.path=.*data\.tokenizer_path=None"):
        run_prep(cfg, tmp_path / "dp")
    cfg.data.tokenizer_path = str(made["C"])
    with pytest.raises(ValueError, match="beyond the vocabulary"):
        run_prep(cfg, tmp_path / "dp")
    assert not (tmp_path / "dp" / "manifest.json").exists()


def test_vocabularies_agree_up_to_the_special_tokens_data_prep_appends(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    from engine.data.datasets import SPECIAL_TOKENS
    from stages.data_prep import train_tokenizer

    assert tuple(SPECIAL_TOKENS.values()) == data_identity.SPECIAL_TOKEN_TEXTS
    hf = train_tokenizer(docs(100, 4), 300)
    full = data_identity.vocab_table(json.loads(hf.to_str()))
    bare = {i - 4: t for i, t in full.items() if i >= 4}  # the same ordinary tokens without the specials
    appended = {**bare, **{len(bare) + k: t for k, t in enumerate(SPECIAL_TOKENS.values())}}
    assert data_identity.vocab_difference(bare, appended) is None  # what data prep does to a bare tokenizer
    assert data_identity.vocab_digest(bare) == data_identity.vocab_digest(appended)
    assert data_identity.vocab_difference(full, bare) is not None  # specials first: every other id moved
    other = dict(full)
    other[100] = "zzz"
    assert (
        data_identity.vocab_difference(full, other)
        == f"id 100 is {full[100]!r} in the first, 'zzz' in the second"
    )
    hf.save(str(tmp_path / "t.json"))
    with pytest.raises(ValueError, match="not a readable tokenizers JSON"):
        data_identity.vocabulary(tmp_path / "missing")
    assert data_identity.vocabulary(tmp_path / "t.json") == full
    assert Tokenizer.from_file(str(tmp_path / "t.json")).get_vocab_size() == len(full)


# ---------------------------------------------------------------------------- what remains after cleaning


def failed_prep(tmp_path: Path, *args: str) -> str:
    """``python -m pipeline`` with data_prep and pretrain: data_prep fails after cleaning (exit 1, one line
    naming the problem), the ledger says failed, nothing is left that a later run could take as complete."""
    root = tmp_path / "runs"
    r = cli.run(root, *TINY, "run.stages=[data_prep,pretrain]", "pretrain.iters=2", *args)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error: stage 'data_prep' failed:")]
    assert "data_prep after cleaning" in line
    ledger = Ledger(cli.run_dir(root))
    assert ledger.read("data_prep").status == FAILED and ledger.read("pretrain") is None  # type: ignore[union-attr]
    for shared in (root / ".data").glob("data_prep-*[0-9a-f]"):
        assert not (shared / "manifest.json").exists() and not (shared / "outputs.json").exists()
    return line


def test_a_corpus_that_shrinks_below_one_batch_fails_data_prep(tmp_path: Path) -> None:
    """corpus=files: a small file passes the pre-flight's bound (one token per byte at most) but holds fewer
    tokens than one global batch (8 x 65 = 520): data_prep fails with the exact count; so does a re-run."""
    text = " ".join(words(120, 5))[:900]
    (tmp_path / "small.txt").write_text(text + "\n")
    assert 520 < len(text) < 1000
    args = ("data.corpus=files", f"data.text_paths=[{tmp_path / 'small.txt'}]")
    line = failed_prep(tmp_path, *args)
    assert "pretrain.parallel.global_batch_size=8: the training text after cleaning holds" in line
    assert (
        "data.corpus=files: documents read 1, for training 1" in line and "520 = global_batch_size 8" in line
    )
    assert "data.valid_fraction=0.02: the validation split holds 0 tokens (0 documents)" in line  # asked for
    assert failed_prep(tmp_path, *args) == line  # never taken as done: the same command prepares again
    assert Ledger(cli.run_dir(tmp_path / "runs")).read("data_prep").attempts == 2  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "case",
    ["skipped", "duplicates", "one_source_empty", "too_short", "valid_empty", "test_empty"],
)
def test_cleaning_that_leaves_too_little_fails_naming_sources_and_counts(tmp_path: Path, case: str) -> None:
    good = [{"text": t} for t in docs(400, 6, "g")]
    one = docs(1, 7, "one")[0]
    extra: list[str] = ["data.bad_records=skip", "data.valid_fraction=0"]
    if case == "skipped":  # 599 of 600 records malformed and skipped
        srcs = [{"path": write_jsonl(tmp_path / "s.jsonl", [{"text": one}] + ["{not json"] * 599)}]
        want = ["s0: 1 of 600 records kept (malformed 599)", "the training text after cleaning holds"]
    elif case == "duplicates":  # 600 copies of one document
        srcs = [{"path": write_jsonl(tmp_path / "s.jsonl", [{"text": one}] * 600)}]
        want = ["s0: 1 of 600 records kept (duplicates 599)", "fewer than one global batch of pretrain: 520"]
    elif case == "one_source_empty":  # a good source and one whose every record is skipped
        bad = write_jsonl(tmp_path / "b.jsonl", [{"text": ""}] + [{"other": i} for i in range(50)])
        srcs = [{"path": write_jsonl(tmp_path / "g.jsonl", good)}, {"path": bad, "name": "broken"}]
        want = [
            f"data.sources[1].path='{bad}': source 'broken' contributes nothing: 0 of 51 records kept "
            "(malformed 50, empty 1), 0 training tokens; e.g. ",
            "b.jsonl:2: no string field 'text'",
        ]
    elif case == "too_short":  # a length filter that keeps nothing of the second source
        srcs = [
            {"path": write_jsonl(tmp_path / "g.jsonl", good)},
            {"path": write_jsonl(tmp_path / "x.jsonl", [{"text": "short"}] * 20)},
        ]
        extra += ["data.min_chars=10"]
        want = ["source 's1' contributes nothing: 0 of 20 records kept (too_short 20)"]
    elif case == "valid_empty":  # a validation split was asked for and came out empty
        srcs = [{"path": write_jsonl(tmp_path / "g.jsonl", good)}]
        extra = ["data.valid_fraction=0.0001"]
        want = [
            "data.valid_fraction=0.0001: the validation split holds 0 tokens, fewer than one sequence of pretrain (64 + 1 tokens)"
        ]
    else:
        srcs = [{"path": write_jsonl(tmp_path / "g.jsonl", good)}]
        extra = ["data.valid_fraction=0", "data.test_fraction=0.0001"]
        want = [
            "data.test_fraction=0.0001: the test split holds 0 tokens, fewer than a split that was asked for"
        ]
    line = failed_prep(tmp_path, "data.corpus=sources", sources_arg(*srcs), *extra)
    for w in want:
        assert w in line, line


def test_data_prepared_for_a_smaller_batch_is_refused_before_any_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Prepared data is shared by identity: a run needing more than it holds is refused before any job, by
    the counts in its manifest (data prepared in an earlier command, or by another run)."""
    src = sources_arg({"path": write_jsonl(tmp_path / "s.jsonl", [{"text": docs(1, 8)[0]}] * 50)})
    base = ["data.corpus=sources", src, "data.valid_fraction=0", f"run.root={tmp_path / 'runs'}"]
    assert main([*TINY, "run.stages=[data_prep]", *base]) == 0  # enough for data_prep alone
    for stages in ("[data_prep,pretrain]", "[pretrain]"):
        capsys.readouterr()
        assert main([*TINY, f"run.stages={stages}", *base]) == 2
        (err,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert err.startswith("config error: pretrain.parallel.global_batch_size=8: the training text after")
        assert "s0: 1 of 50 records kept (duplicates 49)" in err and "(data prepared in " in err


def test_the_preflight_estimate_is_the_same_for_every_corpus_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One bound, one bytes-per-token assumption: 300 bytes hold at most 300 tokens as corpus=files or as a
    source, plain or compressed."""
    text = ("x" * 299) + "\n"
    (tmp_path / "t.txt").write_text(text)
    with gzip.open(tmp_path / "t.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "y" * 287}) + "\n")  # 300 bytes of JSON lines once decompressed
    for args in (
        ["data.corpus=files", f"data.text_paths=[{tmp_path / 't.txt'}]"],
        ["data.corpus=sources", sources_arg({"path": tmp_path / "t.txt"})],
        ["data.corpus=sources", sources_arg({"path": tmp_path / "t.jsonl.gz"})],
    ):
        err = cli_error(tmp_path, capsys, "run.stages=[data_prep,pretrain]", *args)
        assert (
            "the corpus holds at most 300 training tokens (300 bytes of text at one token per byte at most)"
            in err
        )
        assert "fewer than one global batch of pretrain: 520" in err
    # a compressed source is decompressed only until it holds one batch
    from engine.data.formats import source_size

    with gzip.open(tmp_path / "big.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": "z" * 90}) + "\n" for _ in range(1000)))  # 100 kB of text
    size, _ = source_size(DataSource(path=str(tmp_path / "big.jsonl.gz")), "k", 1000)
    assert 1000 <= size < 1200


# ---------------------------------------------------------------------------- templates over null fields


def test_a_template_over_a_null_or_missing_field_is_a_bad_record(tmp_path: Path) -> None:
    """Every format: a record whose templated field is null (JSON null, Arrow null, NaN, an empty CSV cell) or
    absent is malformed, never the text "None"."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from engine.data import sources as ds

    rows = [{"title": i, "body": None if i % 5 == 0 else f"body {i}"} for i in range(20)]
    write_jsonl(tmp_path / "a.jsonl", [*rows, {"title": 99}])  # and one record without the field
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    nan = [float("nan") if i % 5 == 0 else float(i) for i in range(20)]
    pq.write_table(pa.table({"title": list(range(20)), "body": nan}), tmp_path / "d.parquet")
    (tmp_path / "e.csv").write_text(
        "title,body\n" + "".join(f"{r['title']},{r['body'] or ''}\n" for r in rows)
    )
    (tmp_path / "f.tsv").write_text(
        "title\tbody\n" + "".join(f"{r['title']}\t{r['body'] or ''}\n" for r in rows)
    )
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "g_hf"))
    for name in ("a.jsonl", "b.jsonl.gz", "c.parquet", "d.parquet", "e.csv", "f.tsv", "g_hf"):
        src = DataSource(path=str(tmp_path / name), template="{title}: {body}")
        units, _ = ds.plan_units([src], 1 << 20)
        out = [r for u in units for r in ds.unit_records(u, src)]
        bad = [r.message() for r in out if not isinstance(r, str)]
        kept = [r for r in out if isinstance(r, str)]
        assert len(kept) == 16 and not any("None" in r or "nan" in r for r in kept), (name, kept)
        assert len(bad) == 4 + (name == "a.jsonl"), (name, bad)
        assert all("field 'body' is null" in b for b in bad[:4]), (name, bad)
        assert "1: template" in bad[0] or "row 1: template" in bad[0] or ":2: template" in bad[0], bad[0]
        if name == "a.jsonl":
            assert "a.jsonl:21: template '{title}: {body}': missing field 'body'" in bad[-1]


def test_parquet_nulls_under_a_template_are_counted_or_fail_through_the_cli(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from engine.data.datasets import load_tokenizer

    texts = docs(600, 9, "p")
    pq.write_table(
        pa.table(
            {"title": list(range(600)), "body": [None if i % 5 == 4 else t for i, t in enumerate(texts)]}
        ),
        tmp_path / "p.parquet",
        row_group_size=200,
    )
    common = [
        *TINY,
        "run.stages=[data_prep]",
        "data.corpus=sources",
        "data.valid_fraction=0",
        sources_arg({"path": tmp_path / "p.parquet", "template": "{title}: {body}"}),
    ]
    r = cli.run(tmp_path / "fail", *common)
    assert (
        r.returncode == 1 and "p.parquet row 5: template '{title}: {body}': field 'body' is null" in r.stderr
    ), r.stderr[-2000:]
    r = cli.run(tmp_path / "skip", *common, "data.bad_records=skip")
    cli.ok(r)
    (shared,) = (tmp_path / "skip" / ".data").glob("data_prep-*[0-9a-f]")
    manifest = json.loads((shared / "manifest.json").read_text())
    assert manifest["sources"]["s0"]["malformed"] == 120 and manifest["sources"]["s0"]["documents"] == 480
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tok = load_tokenizer(shared / "tokenizer.json")
    d = IndexedDataset(str(shared / "text_train-s0"))
    assert not any("None" in tok.decode(d[i]) for i in range(len(d)))


# ---------------------------------------------------------------------------- compressed JSON lines


def test_compressed_json_lines_get_the_preflight_of_plain_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import zstandard

    good = [{"text": t} for t in docs(300, 10)]
    gz = tmp_path / "nofield.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write("".join(json.dumps({"body": r["text"]}) + "\n" for r in good))
    (tmp_path / "damaged.jsonl.gz").write_bytes(b"not gzip at all")
    full = gzip.compress("".join(json.dumps(r) + "\n" for r in good).encode())
    (tmp_path / "truncated.jsonl.gz").write_bytes(full[:200])
    (tmp_path / "damaged.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd garbage")
    zst = tmp_path / "tpl.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(b'{"title": "t"}\n'))
    sft = tmp_path / "sft.jsonl.gz"
    with gzip.open(sft, "wt") as f:
        f.write("{broken\n")
    pref = tmp_path / "pref.jsonl.zst"
    pref.write_bytes(zstandard.ZstdCompressor().compress(b'{"prompt": "p", "chosen": "c"}\n'))
    plain = write_jsonl(tmp_path / "plain.jsonl", good)
    cases = [
        (sources_arg({"path": gz}), f"data.sources[0]: {gz}:1: no string field 'text'"),
        (sources_arg({"path": tmp_path / "damaged.jsonl.gz"}), "damaged.jsonl.gz: not a readable gzip file"),
        (
            sources_arg({"path": tmp_path / "truncated.jsonl.gz"}),
            "truncated.jsonl.gz: not a readable gzip file",
        ),
        (
            sources_arg({"path": tmp_path / "damaged.jsonl.zst"}),
            "damaged.jsonl.zst: not a readable zstd file",
        ),
        (sources_arg({"path": zst, "template": "{title} {body}"}), f"{zst}:1: no field 'body' for template"),
        (f"data.sft_paths=[{sft}]", f"data.sft_paths: {sft}:1: not valid JSON"),
        (f"data.pref_paths=[{pref}]", f"data.pref_paths: {pref}:1: a record needs prompt+chosen+rejected"),
    ]
    for arg, want in cases:
        extra = [] if arg.startswith("data.sources") else [sources_arg({"path": plain})]
        err = cli_error(tmp_path, capsys, "run.stages=[data_prep]", "data.corpus=sources", arg, *extra)
        assert want in err, err


def test_users_chat_data_must_fill_one_batch_of_each_stage_that_reads_it() -> None:
    """The needs of the selected stages: users' SFT data for sft, preference pairs for the reward model and
    for rlhf only when its algorithm reads preferences (DPO), the validation split for its readers."""
    from pipeline.schema.compose import load_config
    from pipeline.schema.data_needs import needs, prepared_problems

    base = ["experiment=tiny", "data.sft_paths=[x.jsonl]", "data.pref_paths=[y.jsonl]"]
    cfg = load_config([*base, "run.stages=[data_prep,pretrain,sft,reward_model,rlhf]", "rlhf=dpo"])
    got = {(n.what, n.key) for n in needs(cfg)}
    assert got == {
        ("tokens_train_text", "pretrain.parallel.global_batch_size"),
        ("tokens_valid", "data.valid_fraction"),
        ("sft_chat", "sft.parallel.global_batch_size"),
        ("pref_chat", "reward_model.parallel.global_batch_size"),
        ("pref_chat", "rlhf.parallel.global_batch_size"),
    }
    cfg = load_config([*base, "run.stages=[data_prep,sft,rlhf]", "rlhf=grpo", "sft.seq_length=48"])
    assert {n.what for n in needs(cfg)} == {"tokens_valid", "sft_chat"}  # GRPO reads prompts, not pairs
    (valid,) = [n for n in needs(cfg) if n.what == "tokens_valid"]
    assert valid.amount == 49 and "one sequence of sft (48 + 1 tokens)" in valid.why
    counts = {"tokens_valid": 500, "sft_chat": 3}
    (p,) = prepared_problems(cfg, counts)
    assert p.line() == (
        "sft.parallel.global_batch_size=8: data.sft_paths hold 3 examples, fewer than one global batch of sft "
        "(8): add examples or lower the batch"
    )
    assert (
        prepared_problems(load_config([*base, "run.stages=[data_prep]", "data.valid_fraction=0"]), {}) == []
    )
