"""Users' SFT and preference data: chat templates (project and Jinja from a HF tokenizer dir), loss masks, DPO data path."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.context import StageContext
from engine.data import chat
from engine.data.datasets import load_tokenizer, read_manifest
from pipeline.schema.config import DataConfig, PipelineConfig
from stages import data_prep

CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "You count."},
    {"role": "user", "content": "What comes after 4?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And after 9?"},
    {"role": "assistant", "content": "10"},
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("chat")
    rng = np.random.default_rng(0)
    words = "the king queen night day love war peace river stone after comes what count".split()
    (root / "c.txt").write_text("\n\n".join(" ".join(rng.choice(words, 30)) for _ in range(200)) + "\n")
    sft = write_jsonl(
        root / "sft.jsonl", [{"messages": CONVERSATION}, {"prompt": "What comes after 7?", "response": "8"}]
    )
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"messages": [CONVERSATION[1:3]]}), root / "sft.parquet")
    prefs = write_jsonl(
        root / "pref.jsonl",
        [
            {"prompt": "What comes after 3?", "chosen": "4", "rejected": "5"},
            {
                "prompt": [{"role": "user", "content": "What comes after 19?"}],
                "chosen": [
                    {"role": "user", "content": "What comes after 19?"},
                    {"role": "assistant", "content": "20"},
                ],
                "rejected": [{"role": "assistant", "content": "110"}],
            },
        ],
    )
    cfg = PipelineConfig()
    cfg.data = DataConfig(
        corpus="files",
        text_paths=[str(root / "c.txt")],
        vocab_size=300,
        num_sft_examples=10,
        num_pref_pairs=10,
        num_eval_examples=10,
        max_operand=99,
        sft_paths=[str(sft), str(root / "sft.parquet")],
        pref_paths=[str(prefs)],
    )
    cfg.data_prep.threads = 1
    cfg.run.stages = ["data_prep"]  # data_prep alone: no later stage's batch to fill
    out = root / "data_prep"
    data_prep.main(cfg, StageContext(run_dir=root, stage="data_prep", out_dir=out))
    return out


def trained_text(row: dict, tok) -> str:  # noqa: ANN001
    return tok.decode(row["labels"][row["loss_mask"] > 0])


def test_multi_turn_sft_trains_only_on_assistant_turns(prepared: Path) -> None:
    m = read_manifest(prepared)
    assert m["sft_file"] == "sft_chat.jsonl" and m["counts"]["sft_chat"] == 3
    tok = load_tokenizer(prepared / "tokenizer.json")
    src = chat.chat_sft_source(prepared / "sft_chat.jsonl", tok, 64, 0)
    rows = sorted((src.fetch(j) for j in range(3)), key=lambda r: -int(r["loss_mask"].sum()))
    assert trained_text(rows[0], tok) == "5<|endoftext|>10<|endoftext|>"
    full = tok.decode(rows[0]["tokens"][rows[0]["tokens"] != tok.pad])
    assert full.startswith("You count.\n\n<|user|>What comes after 4?<|assistant|>5")
    assert sorted(trained_text(r, tok) for r in rows[1:]) == [
        "5<|endoftext|>",
        "8<|endoftext|>",
    ]  # parquet, pair


def test_hf_tokenizer_chat_template_masks_assistant_turns(prepared: Path, tmp_path: Path) -> None:
    hf_dir = tmp_path / "tok"
    hf_dir.mkdir()
    (hf_dir / "tokenizer.json").write_bytes((prepared / "tokenizer.json").read_bytes())
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    tpl = chat.ChatTemplate(chat.load_template("tokenizer", str(hf_dir)))
    segs = tpl.segments(CONVERSATION)
    assert [t for t, trained in segs if trained] == ["5<|im_end|>\n", "10<|im_end|>\n"]
    assert "".join(t for t, _ in segs) == tpl.render(CONVERSATION)
    with pytest.raises(Exception, match="bad role"):
        tpl.render([{"role": "tool", "content": "x"}])


def test_preference_pairs_through_the_rlhf_data_path(prepared: Path) -> None:
    tok = load_tokenizer(prepared / "tokenizer.json")
    prefs = chat.train_preferences(prepared, tok, 48, 0)  # what the DPO and reward-model stages train on
    assert len(prefs) == 2
    rows = [prefs.fetch(j) for j in range(2)]
    got = sorted(
        (
            trained_text({k: v[0] for k, v in r.items()}, tok),
            trained_text({k: v[1] for k, v in r.items()}, tok),
        )
        for r in rows
    )
    assert got == [("20<|endoftext|>", "110<|endoftext|>"), ("4<|endoftext|>", "5<|endoftext|>")]
    r = rows[0]
    n = int((r["loss_mask"][0] == 0).argmin())  # same prompt tokens in both rows before the reply
    assert (r["tokens"][0][:n] == r["tokens"][1][:n]).all()


def test_bad_chat_records_name_file_and_line(tmp_path: Path) -> None:
    tpl = chat.ChatTemplate(chat.PROJECT_TEMPLATE)
    path = write_jsonl(
        tmp_path / "s.jsonl", [{"messages": CONVERSATION}, {"messages": [{"role": "user", "content": "hi"}]}]
    )
    with pytest.raises(ValueError, match=r"s\.jsonl:2: the conversation has no assistant turn"):
        [chat.render_sft(rec, where, tpl) for where, rec in chat.iter_records(path)]
    with pytest.raises(ValueError, match=r"p:1: 'chosen' must be one assistant reply"):
        chat.render_preference(
            {"prompt": "a", "chosen": [{"role": "user", "content": "b"}], "rejected": "c"}, "p:1", tpl
        )
