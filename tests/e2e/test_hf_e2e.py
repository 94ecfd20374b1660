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


def run(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
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
    run_dir = Path(
        next(ln for ln in r.stdout.splitlines() if ln.startswith("run directory:")).split(":", 1)[1].strip()
    )
    data = run_dir / "stages" / "data_prep"
    assert (data / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()
    results = json.loads((run_dir / "stages" / "eval" / "results.json").read_text())
    assert set(results["models"]) == {f"hf:{base}", "sft", "rlhf"}, results["models"].keys()

    out = tmp_path / "export"
    e = run("-m", "pipeline.export", str(run_dir), "rlhf", "--out", str(out))
    assert e.returncode == 0, e.stdout[-3000:] + e.stderr[-3000:]
    manifest = json.loads((out / "export_manifest.json").read_text())
    assert manifest["check"]["passed"], manifest["check"]
    assert chat_template(out) == chat_template(base) and chat_template(base)

    samples = results["models"]["rlhf"]["samples"]
    prompts = [s["prompt"] for s in samples]
    g = run("-c", GENERATE, str(out), json.dumps(prompts), "6", timeout=300)
    assert g.returncode == 0, g.stderr[-3000:]
    assert json.loads(g.stdout.strip().splitlines()[-1]) == [s["generated"] for s in samples]
