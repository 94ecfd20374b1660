"""lm-eval requests per second: the engine backend (engine.evaluation.lm, ``llm-pipeline``) against lm-eval's own
``hf`` backend (lm_eval.models.huggingface.HFLM) on the same model, the same requests, the same threads.

    python -m bench.bench_lm_eval [--docs 24] [--threads 2] [--hidden 256] [--layers 4] [--batch 8] [--rounds 3] [--json F]

A random Llama-style model (fp32, the tests' byte-level BPE tokenizer) saved as a Hugging Face directory; the
requests are those of the three local task files of tests/support/lm_tasks.py (multiple choice, rolling
perplexity, generate-until; one few-shot example), built by lm-eval in each backend's own fresh process. Each
request kind is timed per backend after one warm-up batch, the best of ``--rounds``; prints requests/s per kind and the ratio
engine / hf (goal >= 1.0), and checks that the per-request results agree (log-likelihoods within 1e-3, the
same generations).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("loglikelihood", "loglikelihood_rolling", "generate_until")
TASKS = ["local_mc", "local_ppl", "local_gen"]
MAX_LENGTH = 128


def make_model(out: Path, hidden: int, layers: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.support.hf_models import make_llama3_tokenizer

    vocab = make_llama3_tokenizer(out)
    torch.manual_seed(0)
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(out / "tokenizer.json"))
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LENGTH,
        vocab_size=vocab,
        bos_token_id=t.token_to_id("<|begin_of_text|>"),
        eos_token_id=[t.token_to_id("<|end_of_text|>"), t.token_to_id("<|eot_id|>")],
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(cfg).float().save_pretrained(out, safe_serialization=True)
    return out


def requests(task_dir: str, docs: int) -> dict[str, list[Any]]:
    """lm-eval's request instances of the local tasks, by kind."""
    from lm_eval.tasks import TaskManager, get_task_dict

    tasks = get_task_dict(TASKS, TaskManager(include_path=task_dir, include_defaults=False))
    out: dict[str, list[Any]] = {k: [] for k in KINDS}
    for task in tasks.values():
        task.set_config(key="num_fewshot", value=1)
        task.set_fewshot_seed(seed=1234)
        task.build_all_requests(limit=docs)
        for inst in task.instances:
            out[inst.request_type].append(inst)
    return out


def backend(side: str, model_dir: str, batch: int, threads: int) -> Any:
    import torch

    torch.set_num_threads(threads)
    if side == "hf":
        from lm_eval.models.huggingface import HFLM

        return HFLM(
            pretrained=model_dir, max_length=MAX_LENGTH, batch_size=batch, device="cpu", dtype="float32"
        )
    from engine.evaluation.lm import EngineLM
    from engine.evaluation.load import load_hf_dir
    from engine.runtime import distributed as D

    D.init(1, 1, seed=0, threads=threads)
    chunks, tok, stops, _ = load_hf_dir(model_dir, MAX_LENGTH)
    return EngineLM(chunks, tok, max_length=MAX_LENGTH, batch_size=batch, stop_tokens=stops)


def measure(
    side: str, model_dir: str, task_dir: str, docs: int, batch: int, threads: int, rounds: int
) -> dict[str, Any]:
    """One backend: {kind: {"n", "s", "rps", "results"}} (results: log-likelihoods or generations)."""
    lm = backend(side, model_dir, batch, threads)
    reqs = requests(task_dir, docs)
    out: dict[str, Any] = {}
    for kind in KINDS:
        call = getattr(lm, kind)  # lm-eval's three request kinds (its LM interface)
        call(reqs[kind][:batch], disable_tqdm=True)  # warm-up
        dt = float("inf")
        for _ in range(rounds):  # the best round: the machine is shared
            t0 = time.perf_counter()
            res = call(reqs[kind], disable_tqdm=True)
            dt = min(dt, time.perf_counter() - t0)
        vals = [r[0] if isinstance(r, tuple) else r for r in res]
        out[kind] = {"n": len(res), "s": dt, "rps": len(res) / dt, "results": vals}
    return out


def compare(engine: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    rows = {}
    for kind in KINDS:
        e, h = engine[kind], hf[kind]
        if kind == "generate_until":
            agree = sum(a == b for a, b in zip(e["results"], h["results"])) / max(1, len(h["results"]))
        else:
            agree = sum(abs(a - b) <= 1e-3 for a, b in zip(e["results"], h["results"])) / max(
                1, len(h["results"])
            )
        rows[kind] = {
            "n": e["n"],
            "engine_rps": e["rps"],
            "hf_rps": h["rps"],
            "ratio": e["rps"] / h["rps"],
            "agree": agree,
        }
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=24)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path)
    p.add_argument("--side", choices=("engine", "hf"), help=argparse.SUPPRESS)  # one backend's own process
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--tasks", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.side:
        print("RESULT " + json.dumps(measure(a.side, a.model, a.tasks, a.docs, a.batch, a.threads, a.rounds)))
        return 0
    from tests.support.lm_tasks import write_tasks

    tmp = Path(tempfile.mkdtemp(prefix="bench_lm_eval_"))
    model = make_model(tmp / "hf", a.hidden, a.layers)
    tasks = write_tasks(tmp / "tasks", docs=a.docs)
    got = {}
    env = {
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": str(a.threads),
    }
    import os

    for side in ("engine", "hf"):
        cmd = [
            sys.executable,
            "-m",
            "bench.bench_lm_eval",
            "--side",
            side,
            "--model",
            str(model),
            "--tasks",
            str(tasks),
        ]
        cmd += [
            "--docs",
            str(a.docs),
            "--batch",
            str(a.batch),
            "--threads",
            str(a.threads),
            "--rounds",
            str(a.rounds),
        ]
        r = subprocess.run(
            cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=1800
        )
        line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
        if r.returncode or line is None:
            print(r.stdout[-2000:] + r.stderr[-4000:], file=sys.stderr)
            return 1
        got[side] = json.loads(line[len("RESULT ") :])
    rows = compare(got["engine"], got["hf"])
    print(
        f"lm-eval requests/s, hidden {a.hidden} x {a.layers} layers, fp32 CPU, {a.threads} threads, batch {a.batch}"
    )
    print(f"{'kind':<24} {'n':>5} {'engine':>9} {'hf':>9} {'ratio':>7} {'agree':>6}")
    for kind, r in rows.items():
        print(
            f"{kind:<24} {r['n']:>5} {r['engine_rps']:>9.2f} {r['hf_rps']:>9.2f} {r['ratio']:>7.2f} {r['agree']:>6.0%}"
        )
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
