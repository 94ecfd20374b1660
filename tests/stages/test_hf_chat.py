"""A run starting from a Hugging Face model uses its tokenizer unchanged and renders every chat set (the
generated task included) with the model's own chat template, as transformers renders it; loss only on the
assistant's tokens; no token appended to the vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.context import StageContext  # noqa: E402
from engine.data import chat  # noqa: E402
from engine.data.datasets import load_tokenizer, read_manifest  # noqa: E402
from pipeline.cli.compose import load  # noqa: E402
from pipeline.schema.errors import ConfigError  # noqa: E402
from stages import data_prep  # noqa: E402
from tests.support.hf_models import make


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make("llama3", tmp_path_factory.mktemp("hf") / "tiny-llama", tokenizer="llama3")


@pytest.fixture(scope="module")
def prepared(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("run")
    rng = np.random.default_rng(0)
    words = "the king queen night day love war peace river stone after comes what count".split()
    (root / "c.txt").write_text("\n\n".join(" ".join(rng.choice(words, 30)) for _ in range(100)) + "\n")
    cfg = load(
        [
            f"sft.init_from=hf:{llama}",
            "run.stages=[data_prep,sft]",
            "data.corpus=files",
            f"data.text_paths=[{root / 'c.txt'}]",
            "data.num_sft_examples=8",
            "data.num_pref_pairs=8",
            "data.num_eval_examples=6",
            "eval.num_task_examples=6",
            "data.max_operand=99",
            "data_prep.threads=1",
        ],
        inputs=False,
    )
    assert cfg.data.chat_template == "tokenizer" and cfg.data.tokenizer_path == str(llama.resolve())
    out = root / "data_prep"
    data_prep.main(cfg, StageContext(run_dir=root, stage="data_prep", out_dir=out))
    return out


def test_tokenizer_kept_byte_for_byte(llama: Path, prepared: Path) -> None:
    assert (prepared / "tokenizer.json").read_bytes() == (llama / "tokenizer.json").read_bytes()
    m = read_manifest(prepared)
    tok = load_tokenizer(prepared / "tokenizer.json")
    assert m["vocab_size"] == tok.vocab_size == json.loads((llama / "config.json").read_text())["vocab_size"]
    assert m["special_tokens"]["eod"]["token"] == "<|eot_id|>" and tok.user is None
    assert tok.hf.token_to_id("<|user|>") is None  # nothing appended
    eot, eos = tok.hf.token_to_id("<|eot_id|>"), tok.hf.token_to_id("<|end_of_text|>")
    assert m["stop_token_ids"] == [eot, eos]  # eos + generation_config.json's
    assert {"sft_file", "pref_file", "eval_task_file", "eval_pref_file"} <= set(m)


def test_prompts_render_as_transformers_does(llama: Path, prepared: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(llama)
    tok = load_tokenizer(prepared / "tokenizer.json")
    raw = [json.loads(x) for x in (prepared / "eval_task.jsonl").read_text().splitlines()]
    rendered = [json.loads(x) for x in (prepared / "eval_task_chat.jsonl").read_text().splitlines()]
    for r, c in zip(raw, rendered, strict=True):
        msgs = [{"role": "user", "content": r["prompt"]}]
        want = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert c["prompt"] == want and c["question"] == r["prompt"] and c["answer"] == r["answer"]
        ids = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert tok.encode(c["prompt"]) == list(ids)


def test_loss_only_on_assistant_tokens(llama: Path, prepared: Path) -> None:
    tok = load_tokenizer(prepared / "tokenizer.json")
    src = chat.chat_sft_source(prepared / "sft_chat.jsonl", tok, 48, 0)
    sft = [json.loads(x) for x in (prepared / "sft_train.jsonl").read_text().splitlines()]
    trained = sorted(
        tok.decode(r["labels"][r["loss_mask"] > 0]) for r in (src.fetch(j) for j in range(len(src)))
    )
    assert trained == sorted(f"{r['response']}<|eot_id|>" for r in sft)
    row = src.fetch(0)
    text = tok.decode(row["tokens"][: int(row["loss_mask"].nonzero()[0][0]) + 1])
    assert text.startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n")
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    prefs = chat.chat_preference_source(prepared / "pref_chat.jsonl", tok, 48, 0)
    pair = prefs.fetch(0)
    for k in (0, 1):
        assert tok.decode(pair["labels"][k][pair["loss_mask"][k] > 0]).endswith("<|eot_id|>")


def test_no_template_and_no_role_tokens_is_a_config_error(llama: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in llama.iterdir():
        (bare / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ConfigError, match=r"has no chat_template .* lacks the pipeline's role tokens"):
        load([f"sft.init_from=hf:{bare}", "run.stages=[data_prep,sft]", f"run.root={tmp_path}"], inputs=True)


@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make("qwen2", tmp_path_factory.mktemp("hf") / "tiny-qwen", tokenizer="chatml")


def _prepare(model: Path, root: Path) -> Path:
    rng = np.random.default_rng(0)
    words = "the king queen night day love war peace river stone after comes what count".split()
    (root / "c.txt").write_text("\n\n".join(" ".join(rng.choice(words, 30)) for _ in range(100)) + "\n")
    overrides = [f"sft.init_from=hf:{model}", "run.stages=[data_prep,sft,rlhf]", "data.corpus=files"]
    overrides += [f"data.text_paths=[{root / 'c.txt'}]", "data.num_sft_examples=8", "data.num_pref_pairs=8"]
    overrides += ["data.num_eval_examples=6", "eval.num_task_examples=6", "data_prep.threads=1"]
    cfg = load(overrides, inputs=False)
    out = root / "data_prep"
    data_prep.main(cfg, StageContext(run_dir=root, stage="data_prep", out_dir=out))
    return out


@pytest.mark.parametrize("kind", ["llama3", "chatml"])
def test_rl_and_eval_prompts_are_the_templates_rendering(
    kind: str, llama: Path, chatml: Path, prepared: Path, tmp_path: Path
) -> None:
    """Online RL's prompt stream (the rlhf stage's ``task_prompts``, which the rollouts tokenize) and eval's
    prompts: string- and token-equal to transformers' apply_chat_template(add_generation_prompt=True), for a
    model without the pipeline's role tokens; the reward model's held-out pairs load too."""
    from transformers import AutoTokenizer

    from stages.rlhf import task_prompts

    model, data = (llama, prepared) if kind == "llama3" else (chatml, _prepare(chatml, tmp_path))
    hf = AutoTokenizer.from_pretrained(model)
    tok = load_tokenizer(data / "tokenizer.json")
    assert tok.user is None and read_manifest(data)["rl_file"] == "rl_chat.jsonl"
    prompts, answers = task_prompts(data, tok)
    raw = [json.loads(x) for x in (data / "rl_train.jsonl").read_text().splitlines()]
    assert answers == [r["answer"] for r in raw] and len(prompts) == len(raw)
    evals = chat.task_prompts(data, "eval_task", tok)
    for question, text in [
        *((r["prompt"], p) for r, p in zip(raw, prompts)),
        *((e["question"], e["prompt"]) for e in evals),
    ]:
        msgs = [{"role": "user", "content": question}]
        assert text == hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ids = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert tok.encode(text) == list(ids)
    pairs = chat.held_out_preferences(data, tok, 64, 0)
    assert pairs.truncation.examples == 6 and pairs.truncation.emptied == 0


def test_a_template_too_long_for_rlhf_seq_length_is_a_config_error(tmp_path: Path) -> None:
    """Qwen2-Instruct's default system turn makes every RL prompt longer than the GRPO default leaves room for:
    a config error before any job, naming the key and the length that fits."""
    qwen = make("qwen2", tmp_path / "qwen", tokenizer="qwen2-instruct")
    stages = [f"sft.init_from=hf:{qwen}", "run.stages=[data_prep,sft,rlhf]", f"run.root={tmp_path / 'runs'}"]
    with pytest.raises(
        ConfigError, match=r"^rlhf\.seq_length=32: the generated task's prompts .* raise it to \d+"
    ):
        load(stages, inputs=True)
    load([*stages, "rlhf.seq_length=64"], inputs=True)  # room for them: the pre-flight passes
    with pytest.raises(ConfigError, match=r"^sft\.seq_length=8: .*every sft example would lose"):
        load([*stages, "rlhf.seq_length=64", "sft.seq_length=8"], inputs=True)


def test_a_template_that_cannot_render_prompts_is_a_config_error(llama: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}{{ raise_exception('no turns') }}")
    runs = f"run.root={tmp_path / 'runs'}"
    with pytest.raises(ConfigError, match=r"data\.chat_template=.*bad\.jinja.*cannot render .*no turns"):
        load(["run.stages=[data_prep,sft]", f"data.chat_template={bad}", runs], inputs=True)
    # the project template on a tokenizer used unchanged that lacks its role tokens
    with pytest.raises(
        ConfigError, match=r"data\.chat_template='project': .*lacks: set data\.chat_template=tokenizer"
    ):
        load(
            ["run.stages=[data_prep,sft]", f"data.tokenizer_path={llama}", "model.vocab_size=null", runs],
            inputs=True,
        )
