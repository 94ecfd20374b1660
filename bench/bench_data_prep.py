"""Data prep throughput: 1 vs 2 ranks, peak memory against corpus size, and Megatron-LM's preprocess_data.py.

    python -m bench.bench_data_prep --mb 50 [--megatron-lm /path/to/Megatron-LM checkout]
    python -m bench.bench_data_prep --mb 1000 --memory-only

Generates a JSON-lines corpus of ``--mb`` MB in a temp folder, trains one tokenizer on it, then times
``data_prep`` (corpus=sources, the given tokenizer) with 1 rank and with 2 ranks (two processes meeting
through files, as the pipeline starts them) and prints the scaling efficiency (goal >= 0.9) and each run's
peak RSS next to the corpus size (streaming: the peak must not grow with the corpus). With
``--megatron-lm`` (a checkout of NVIDIA/Megatron-LM; its code is run from there, never copied here) it
runs ``tools/preprocess_data.py`` on the same file, tokenizer (HuggingFaceTokenizer: needs
``transformers``) and worker count, and prints our throughput over its (goal >= 2x); when it cannot run,
it says why.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORDS = "the king queen sword crown night day love war peace river stone fire wind 17 2024 3".split()

PREP = """
import json, os, resource, sys, time
from pathlib import Path
from pipeline.schema.build import from_dict
from stages import data_prep
from engine.context import StageContext
cfg = from_dict(json.loads(sys.argv[1])); out = Path(sys.argv[2])
t = time.perf_counter()
data_prep.main(cfg, StageContext(run_dir=out.parent, stage="data_prep", out_dir=out))
print("RESULT", json.dumps({"wall_s": time.perf_counter() - t,
      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def make_corpus(path: Path, mb: float) -> int:
    import numpy as np

    rng = np.random.default_rng(0)
    size = 0
    with open(path, "w") as f:
        i = 0
        while size < mb * 1e6:
            line = json.dumps(
                {"text": f"doc {i}: " + " ".join(rng.choice(WORDS, size=int(rng.integers(50, 400))))}
            )
            f.write(line + "\n")
            size += len(line) + 1
            i += 1
    return size


def run_ranks(cfg: dict, out: Path, ranks: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore", "WORLD_SIZE": str(ranks)}
    env.update(MASTER_ADDR="bench", MASTER_PORT=str(os.getpid()))
    t = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PREP, json.dumps(cfg), str(out)],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(ranks)
    ]
    results = []
    for p in procs:
        stdout, _ = p.communicate()
        if p.returncode:
            raise SystemExit(f"data_prep rank failed ({p.returncode})")
        results += [json.loads(ln.split(" ", 1)[1]) for ln in stdout.splitlines() if ln.startswith("RESULT")]
    return {"wall_s": time.perf_counter() - t, "peak_rss_mb": max(r["peak_rss_mb"] for r in results)}


def megatron_baseline(
    mlm: Path, corpus: Path, tok_dir: Path, workers: int, tmp: Path, python: str
) -> float | str:
    script = mlm / "tools" / "preprocess_data.py"
    if not script.is_file():
        return f"no {script}"
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "its HuggingFaceTokenizer needs the transformers package (pip install transformers)"
    cmd = [
        python,
        str(script),
        "--input",
        str(corpus),
        "--output-prefix",
        str(tmp / "mlm"),
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        str(tok_dir),
        "--workers",
        str(workers),
        "--append-eod",
    ]
    t = time.perf_counter()
    r = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(mlm)}, capture_output=True, text=True)
    wall = time.perf_counter() - t
    out = tmp / "mlm_text_document.bin"
    if r.returncode or not out.is_file() or out.stat().st_size == 0:  # a worker's error may still exit 0
        return "failed: " + (r.stderr.strip().splitlines() or ["?"])[-1]
    return wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=50.0, help="corpus size in MB")
    ap.add_argument("--megatron-lm", type=Path, default=None, help="a Megatron-LM checkout (baseline)")
    ap.add_argument(
        "--megatron-python",
        default=sys.executable,
        help="interpreter for the baseline (its megatron.core imports triton, which a CPU venv may lack)",
    )
    ap.add_argument(
        "--memory-only",
        action="store_true",
        help="one 2-rank run: peak RSS per rank against the corpus size (no scaling, no baseline)",
    )
    args = ap.parse_args()
    from pipeline.schema.config import DataConfig, PipelineConfig
    from pipeline.schema.sections import DataSource
    from stages import data_prep

    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        corpus = tmp / "corpus.jsonl"
        size = make_corpus(corpus, args.mb)
        sample = [json.loads(ln)["text"] for _, ln in zip(range(20000), open(corpus))]
        tok_dir = tmp / "tok"
        tok_dir.mkdir()
        (tok_dir / "tokenizer.json").write_text(data_prep.train_tokenizer(sample, 4096).to_str())
        # What transformers' AutoTokenizer (Megatron-LM's HuggingFaceTokenizer) needs to find the eod token
        eod = data_prep.SPECIAL_TOKENS["eod"]
        tok_cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": eod,
            "model_max_length": 1 << 30,
        }
        (tok_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
        cfg = PipelineConfig()
        cfg.data = DataConfig(
            corpus="sources",
            sources=[DataSource(path=str(corpus))],
            tokenizer_path=str(tok_dir),
            valid_fraction=0.0,
            task_mix_fraction=0.0,
            dedup=False,
            shard_mb=max(1.0, args.mb / 16),
        )
        cfg.data_prep.threads = 1
        if args.memory_only:
            r = run_ranks(cfg.to_dict(), tmp / "out2", 2)
            print(
                f"corpus {size / 1e6:.0f} MB, data_prep 2 ranks: {r['wall_s']:.1f} s, peak RSS "
                f"{r['peak_rss_mb']:.0f} MB per rank: the corpus is {size / 1e6 / r['peak_rss_mb']:.1f}x one rank's memory"
            )
            return 0
        runs = {n: run_ranks(cfg.to_dict(), tmp / f"out{n}", n) for n in (1, 2)}
        eff = runs[1]["wall_s"] / (2 * runs[2]["wall_s"])
        print(f"corpus {size / 1e6:.0f} MB")
        for n, r in runs.items():
            print(
                f"data_prep {n} rank(s): {r['wall_s']:.1f} s, {size / 1e6 / r['wall_s']:.1f} MB/s, peak RSS {r['peak_rss_mb']:.0f} MB per rank"
            )
        print(f"1 -> 2 ranks scaling efficiency: {eff:.2f} (goal >= 0.90)")
        if args.megatron_lm:
            base = megatron_baseline(args.megatron_lm, corpus, tok_dir, 1, tmp, args.megatron_python)
            if isinstance(base, float):
                ours = sum(f.stat().st_size for f in (tmp / "out1").glob("text_*.bin"))
                theirs = (tmp / "mlm_text_document.bin").stat().st_size
                print(
                    f"token bytes: ours {ours}, Megatron-LM {theirs} ({'same' if ours == theirs else 'DIFFER'})"
                )
                print(
                    f"Megatron-LM preprocess_data.py, 1 worker: {base:.1f} s; ratio ours/theirs: {base / runs[1]['wall_s']:.2f}x (goal >= 2)"
                )
            else:
                print(f"Megatron-LM baseline not run: {base}")
        else:
            print("Megatron-LM baseline not run: pass --megatron-lm <checkout>")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
