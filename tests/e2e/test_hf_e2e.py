"""End to end through the CLI from a Hugging Face directory: a tiny random Llama-3-style model with its own
tokenizer and chat template -> SFT (init_from=hf:) -> DPO -> eval (base model included) -> pipeline.cli.export;
transformers' greedy generation on the export gives the same tokens as the pipeline's eval on the same prompts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.env import REPO
from tests.support.hf_models import make
from tests.support.timing import scaled

GENERATE = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
d, prompts, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
tok = AutoTokenizer.from_pretrained(d)
model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
stop = model.generation_config.eos_token_id
stop = set(stop if isinstance(stop, list) else [stop])
out = []
for p in prompts:
    ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=n, do_sample=False)[0, ids.shape[1]:].tolist()
    cut = next((i for i, t in enumerate(gen) if t in stop), len(gen))
    out.append(tok.decode(gen[:cut], skip_special_tokens=False))
print(json.dumps(out))
"""


def run(*args: str, timeout: float = scaled(900)) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def chat_template(d: Path) -> str | None:
    """A directory's chat template: chat_template.jinja (newer transformers) or tokenizer_config.json's."""
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text()
    return json.loads((d / "tokenizer_config.json").read_text()).get("chat_template")


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("peft", ["none", "lora"])
def test_sft_dpo_from_hf_then_export_generates_like_eval(tmp_path: Path, peft: str) -> None:
    """Full fine-tuning, and LoRA on both stages (DPO's adapters on SFT's: the merged export streams the
    Hugging Face base plus both stages' adapters)."""
    base = make("llama3", tmp_path / "base-llama", tokenizer="llama3")
    lora = [f"{s}.peft.method=lora" for s in ("sft", "rlhf")] if peft == "lora" else []
    r = run(
        "-m",
        "pipeline",
        "experiment=tiny",
        f"run.root={tmp_path / 'runs'}",
        f"sft.init_from=hf:{base}",
        "run.stages=[data_prep,sft,rlhf,eval]",
        "rlhf=dpo",
        f"eval.models=[hf:{base},sft,rlhf]",
        "eval.max_new_tokens=6",
        "sft.lr=3e-3",
        *lora,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run_dir = _run_dir(r)
    data = run_dir / "stages" / "data_prep"
    assert (data / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()
    results = json.loads((run_dir / "stages" / "eval" / "results.json").read_text())
    assert set(results["models"]) == {f"hf:{base}", "sft", "rlhf"}, results["models"].keys()

    out = export_generates_like_eval(run_dir, "rlhf", tmp_path / "export", 6)
    assert chat_template(out) == chat_template(base) and chat_template(base)


def export_generates_like_eval(run_dir: Path, stage: str, out: Path, new_tokens: int) -> Path:
    """``pipeline.export`` of ``stage`` to ``out`` passes its check, and transformers' greedy generation on the
    export gives eval's generations for that stage on eval's prompts."""
    e = run("-m", "pipeline.export", str(run_dir), stage, "--out", str(out))
    assert e.returncode == 0, e.stdout[-3000:] + e.stderr[-3000:]
    manifest = json.loads((out / "export_manifest.json").read_text())
    assert manifest["check"]["passed"], manifest["check"]
    results = json.loads((run_dir / "stages" / "eval" / "results.json").read_text())
    samples = results["models"][stage]["samples"]
    prompts = [s["prompt"] for s in samples]
    g = run("-c", GENERATE, str(out), json.dumps(prompts), str(new_tokens), timeout=scaled(300))
    assert g.returncode == 0, g.stderr[-3000:]
    assert json.loads(g.stdout.strip().splitlines()[-1]) == [s["generated"] for s in samples]
    return out


def _run_dir(r: subprocess.CompletedProcess[str]) -> Path:
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("run directory:"))
    return Path(line.split(":", 1)[1].strip())


SHORT = ["data.max_corpus_mb=0.1", "eval.num_task_examples=4", "eval.max_new_tokens=4", "rlhf.iters=2"]
SHORT += ["rlhf.warmup_iters=0", "sft.iters=2", "sft.warmup_iters=0", "reward_model.iters=2"]
SHORT += ["reward_model.warmup_iters=0"]


END_TOKENS = {"chatml": ("<|im_end|>", "<|endoftext|>"), "llama3": ("<|end_of_text|>", "<|eot_id|>")}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "kind,tokenizer,rlhf",
    [("qwen2", "chatml", "grpo"), ("llama3", "llama3", "ppo"), ("qwen2", "chatml", "dpo")],
)
def test_readme_command_on_a_model_without_role_tokens(
    tmp_path: Path, kind: str, tokenizer: str, rlhf: str
) -> None:
    """docs/huggingface.md's first command (SFT -> RLHF -> eval from hf:, the base model scored too) on a model
    whose tokenizer has none of the pipeline's role tokens: GRPO (the default), PPO (with the reward model
    stage and rlhf.reward=both: the reward model trains, rewards and is scored by eval) and DPO complete, and
    the RL prompts are the model's template's rendering, string- and token-equal to transformers'."""
    from transformers import AutoTokenizer

    from engine.data.datasets import load_tokenizer
    from stages.rlhf import stop_tokens

    base = make(kind, tmp_path / "base", tokenizer=tokenizer)
    stages = "[data_prep,sft,reward_model,rlhf,eval]" if rlhf == "ppo" else "[data_prep,sft,rlhf,eval]"
    extra = ["rlhf.reward=both"] if rlhf == "ppo" else []
    r = run(
        "-m",
        "pipeline",
        f"sft.init_from=hf:{base}",
        f"run.stages={stages}",
        f"eval.models=[hf:{base},sft,rlhf]",
        "experiment=tiny",
        f"run.root={tmp_path / 'runs'}",
        f"rlhf={rlhf}",
        *extra,
        *SHORT,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run_dir = _run_dir(r)
    results = json.loads((run_dir / "stages" / "eval" / "results.json").read_text())
    assert set(results["models"]) == {f"hf:{base}", "sft", "rlhf"}
    assert results["data"]["pref_pairs_left_out"] == 0 and results["data"]["task_prompts_cut"] == 0
    if rlhf == "ppo":
        assert results["reward_model"]["pairs"] == results["data"]["pref_pairs"] > 0
    ledger = {s: json.loads((run_dir / "ledger" / f"{s}.json").read_text()) for s in ("sft", "rlhf")}
    what = "preference pairs" if rlhf == "dpo" else "prompts"
    assert ledger["rlhf"]["outputs"]["truncation"]["what"] == what
    assert ledger["rlhf"]["outputs"]["truncation"]["emptied"] == 0
    assert ledger["sft"]["outputs"]["truncation"]["emptied"] == 0
    assert f"[rlhf] 400 {what}: none left out by rlhf.seq_length=32" in r.stdout or rlhf == "dpo"

    data = run_dir / "stages" / "data_prep"
    hf, tok = AutoTokenizer.from_pretrained(base), load_tokenizer(data / "tokenizer.json")
    assert tok.user is None and tok.assistant is None
    # rollouts stop at the model's end-of-turn token as well as at its eos (generation_config.json's list)
    assert set(stop_tokens(data)) == {hf.convert_tokens_to_ids(t) for t in END_TOKENS[tokenizer]}
    rendered = [json.loads(x) for x in (data / "rl_chat.jsonl").read_text().splitlines()]
    for rec in rendered[:50]:
        msgs = [{"role": "user", "content": rec["question"]}]
        assert rec["prompt"] == hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ids = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        assert tok.encode(rec["prompt"]) == list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _long_prompt_pairs(path: Path, n: int, long: int) -> None:
    """Users' preference pairs; the first ``long`` with a prompt far longer than rlhf.seq_length=32 tokens."""
    words = "the river runs past the old stone bridge under a grey and quiet sky".split()
    with open(path, "w") as f:
        for i in range(n):
            prompt = " ".join(words * 4) if i < long else f"What comes after {i}?"
            f.write(json.dumps({"prompt": prompt, "chosen": str(i + 1), "rejected": str(i)}) + "\n")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dpo_on_pairs_that_truncation_empties_fails_before_training(tmp_path: Path) -> None:
    """DPO on users' pairs whose rendered prompts exceed rlhf.seq_length: with all of them, and with more than
    rlhf.max_truncated_fraction of them, the stage fails before training with one line naming the key to
    raise; within the limit it trains on the rest and the count is in the console, the ledger and the report."""
    base = make("llama3", tmp_path / "base", tokenizer="llama3")
    pairs = tmp_path / "pairs.jsonl"
    common = ["experiment=tiny", f"run.root={tmp_path / 'runs'}", "rlhf=dpo", f"rlhf.init_from=hf:{base}"]
    common += [
        "run.stages=[data_prep,rlhf]",
        f"data.pref_paths=[{pairs}]",
        "rlhf.iters=2",
        "rlhf.warmup_iters=0",
    ]
    common += ["data.max_corpus_mb=0.1"]

    _long_prompt_pairs(pairs, 16, 16)
    r = run("-m", "pipeline", *common)
    assert r.returncode != 0
    errors = [
        ln for ln in r.stdout.splitlines() + r.stderr.splitlines() if ln.startswith("error: stage 'rlhf'")
    ]
    assert len(errors) == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "all 16 preference pairs lose every trained token when cut at rlhf.seq_length=32" in errors[0]
    assert "raise rlhf.seq_length" in errors[0]

    _long_prompt_pairs(pairs, 16, 3)  # 3 of 16 (18.8%) > the default 5%
    r = run("-m", "pipeline", *common)
    assert r.returncode != 0
    both = r.stdout + r.stderr
    assert "3 of 16 preference pairs (18.8%)" in both and "rlhf.max_truncated_fraction=0.05 allows" in both

    r = run("-m", "pipeline", *common, "rlhf.max_truncated_fraction=0.2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[rlhf] 16 preference pairs: 3 (18.8%) lost every trained token to truncation" in r.stdout
    run_dir = _run_dir(r)
    out = json.loads((run_dir / "ledger" / "rlhf.json").read_text())["outputs"]
    assert out["truncation"]["emptied"] == 3 and out["truncation"]["examples"] == 16
    assert "3 of 16 preference pairs" in (run_dir / "report.html").read_text()


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_sft_of_a_qwen3_moe_at_ep2_then_export_generates_like_eval(tmp_path: Path) -> None:
    """SFT from a hf: Qwen3-MoE directory with expert parallelism 2 (two ranks, two experts each), eval at its
    own layout, export: transformers' greedy generation on the export gives eval's tokens."""
    base = make("qwen3_moe", tmp_path / "base-qwen3-moe", tokenizer="chatml")
    r = run(
        "-m",
        "pipeline",
        "experiment=tiny",
        f"run.root={tmp_path / 'runs'}",
        f"sft.init_from=hf:{base}",
        "run.stages=[data_prep,sft,eval]",
        "sft.parallel.ep=2",
        "eval.models=[sft]",
        "sft.lr=3e-3",
        *SHORT,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run_dir = _run_dir(r)
    ledger = json.loads((run_dir / "ledger" / "sft.json").read_text())
    assert ledger["status"] == "completed"
    out = export_generates_like_eval(run_dir, "sft", tmp_path / "export", 4)
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_moe"
