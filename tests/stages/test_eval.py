"""The eval stage on tiny data and random-init checkpoints (in a subprocess: the engine patches torch on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from tests.support.env import REPO
from tests.support.prep import run_prep, tiny_config, write_corpus
from tests.support.timing import scaled

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from pipeline.schema.build import from_dict
    from engine.context import StageContext

    cfg = from_dict(json.loads(Path(sys.argv[1]).read_text()))
    run = Path(sys.argv[2])
    data = run / "stages" / "data_prep"

    from engine.runtime import distributed as D
    from engine.checkpoint.save import save
    from engine.data.datasets import load_tokenizer
    from engine.models.gpt import build_model
    from stages import eval as ev

    D.init(1, 1, seed=1, threads=1)
    tok = load_tokenizer(data)
    chunks = build_model(cfg.model, cfg.eval.parallel, tok.vocab_size)
    for stage in ("pretrain", "sft"):
        save(run / "stages" / stage / "checkpoints", 3, model_chunks=chunks, optimizer=None,
             scheduler=None, state={}, final=True)
    # Batched greedy generation (prompts of different lengths, KV cache) equals one prompt at a time.
    prompts = ["What is 1 + 2?", "What is 12 - 3?", "What is 29 + 30?"]
    chunks[0].eval()
    batched = ev.generate(chunks, tok, prompts, 5, cfg.model.seq_length)
    single = [ev.generate(chunks, tok, [p], 5, cfg.model.seq_length)[0] for p in prompts]
    assert batched == single, (batched, single)
    D.shutdown()

    inputs = {s: run / "stages" / s for s in ("data_prep", "pretrain", "sft")}
    ctx = StageContext(run_dir=run, stage="eval", out_dir=run / "stages" / "eval", inputs=inputs)
    print("RESULT", json.dumps(ev.main(cfg, ctx)))
    """
)


def run_eval_stage(tmp_path: Path, cfg: Any, run: Path, env: dict[str, str] | None = None) -> Any:
    """SCRIPT on ``cfg`` (written to tmp_path/cfg.json) over the prepared ``run``, in a fresh single-rank
    process with ``env`` added; asserts it succeeded and returns the completed process."""
    (tmp_path / "cfg.json").write_text(json.dumps(cfg.to_dict()))
    full = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore", **(env or {})}
    for k in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"):
        full.pop(k, None)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "cfg.json"), str(run)],
        env=full,
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def small_config(tmp_path: Path, task_examples: int = 6, perplexity_batches: int = 2) -> Any:
    """The tiny config on a corpus written under ``tmp_path``, with a 2-layer 64-wide model and a small eval."""
    corpus = tmp_path / "corpus"
    write_corpus(corpus)
    cfg = tiny_config(corpus)
    cfg.model.num_layers, cfg.model.hidden_size, cfg.model.seq_length = 2, 64, 64
    cfg.eval.num_task_examples, cfg.eval.perplexity_batches, cfg.eval.batch_size = (
        task_examples,
        perplexity_batches,
        4,
    )
    cfg.eval.max_new_tokens, cfg.eval.threads = 3, 1
    return cfg


def test_eval_writes_results_for_each_model(tmp_path: Path) -> None:
    cfg = small_config(tmp_path)
    run = tmp_path / "run"
    run_prep(cfg, run / "stages" / "data_prep")
    proc = run_eval_stage(tmp_path, cfg, run)
    assert "task acc" in proc.stdout  # the comparison table

    results = json.loads((run / "stages" / "eval" / "results.json").read_text())
    assert results["format"] == 1 and sorted(results["models"]) == ["pretrain", "sft"]
    assert results["skipped"] == {"rlhf": "not in this run"}
    assert results["data"]["task_examples"] == 6 and results["data"]["pref_pairs"] == 20
    for r in results["models"].values():
        assert r["iteration"] == 3 and r["checkpoint"].endswith("iter_0000003")
        assert 1.0 < r["perplexity"] < 2 * 320  # random init: about the vocabulary size
        assert 0.0 <= r["task_accuracy"] <= 1.0 and 0.0 <= r["pref_accuracy"] <= 1.0
        assert len(r["samples"]) == 5 and {"prompt", "answer", "generated", "correct"} <= set(r["samples"][0])
    # Same weights in both: same scores.
    a, b = results["models"]["pretrain"], results["models"]["sft"]
    assert (a["perplexity"], a["pref_accuracy"]) == (b["perplexity"], b["pref_accuracy"])
    lines = (run / "stages" / "eval" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["model"] for line in lines] == ["pretrain", "sft"]


def test_eval_takes_each_models_part_result_while_its_checkpoint_stands(tmp_path: Path) -> None:
    """Every model scored leaves a part result (pipeline.records.parts); the next eval job takes a model's from
    there while the checkpoint it scored is still the newest, and scores it again otherwise."""
    from pipeline.records.parts import part_file

    cfg = small_config(tmp_path, task_examples=2, perplexity_batches=1)
    run = tmp_path / "run"
    run_prep(cfg, run / "stages" / "data_prep")
    run_eval_stage(tmp_path, cfg, run)
    out = run / "stages" / "eval"
    first = json.loads((out / "results.json").read_text())["models"]
    for model, change in (("sft", {"perplexity": 123.0}), ("pretrain", {"checkpoint": "/elsewhere"})):
        path = part_file(out, model)
        doc = json.loads(path.read_text())
        doc["result"]["model"].update(change)
        path.write_text(json.dumps(doc))
    run_eval_stage(tmp_path, cfg, run)
    again = json.loads((out / "results.json").read_text())["models"]
    assert again["sft"]["perplexity"] == 123.0  # taken from its part result
    assert again["pretrain"] == first["pretrain"]  # another checkpoint in the file: scored again
