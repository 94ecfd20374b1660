"""bench/bench_throughput.py (run as ``python -m bench.bench_throughput``): the plain-PyTorch comparator has the engine model's shape, and the GPU part runs;
bench/bench_attention.py prints its ratios against nanoGPT."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import bench_attention, bench_throughput
from pipeline.schema.config import ModelConfig
from pipeline.schema.params import param_count
from tests.support.env import REPO, python_env
from tests.support.timing import scaled


def run_bench(name: str, *args: str, timeout: float = scaled(560)) -> subprocess.CompletedProcess[str]:
    """``python -m bench.<name> <args>`` from the repository root, as the benchmarks are run."""
    cmd = [sys.executable, "-m", f"bench.{name}", *args]
    return subprocess.run(cmd, cwd=REPO, env=python_env(), capture_output=True, text=True, timeout=timeout)


def test_plain_gpt_has_the_engine_models_parameter_count() -> None:
    """Same layers, widths, biases, norms and tied output layer as the GPTModel the engine builds."""
    m = bench_throughput.CPU_MODEL
    plain = bench_throughput.PlainGPT(
        m["num_layers"], m["hidden_size"], m["num_attention_heads"], m["seq_length"], bench_throughput.VOCAB
    )
    expected = param_count(ModelConfig(**m, vocab_size=bench_throughput.VOCAB))
    assert sum(p.numel() for p in plain.parameters()) == expected


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_data_prep_bench_prints_memory_per_rank_and_the_scaling() -> None:
    args = ["--sizes", "0.2", "0.4", "--scaling-mb", "0.4", "--single-mb", "0.2", "--shard-mb", "0.1"]
    r = run_bench("bench_data_prep", *args)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "peak RSS per rank (largest rank) at 0.2 / 0.4 MB" in r.stdout and "largest/smallest" in r.stdout
    assert "one 0.2 MB document on one line, 1 rank: peak RSS" in r.stdout
    assert (
        "scaling 1 -> 2 ranks" in r.stdout and "serial (rank 0 alone" in r.stdout and "task mix" in r.stdout
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cpu_bench_prints_the_single_rank_ratio(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    args = ["--steps", "2", "--warmup", "1", "--rounds", "1", "--no-dist", "--json", str(out)]
    r = run_bench("bench_throughput", *args)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "1 rank" in r.stdout and "ratio" in r.stdout
    assert json.loads(out.read_text())["single_rank"]["ratio"] > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_attention_bench_prints_ratios_and_paired_ratios(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    args = [
        "--reps",
        "2",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--shapes",
        "demo",
        "--same-process",
        "--side-by-side",
        "--json",
        str(out),
    ]
    r = run_bench("bench_attention", *args)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "ratio" in r.stdout and "paired per repetition: sdpa median" in r.stdout, r.stdout
    demo = json.loads(out.read_text())["demo"]
    assert len(demo["paired"]["engine-sdpa"]) == 2 and min(demo["paired"]["engine-sdpa"]) > 0, demo
    assert "same process, steps alternating: engine sdpa / nanoGPT median" in r.stdout, r.stdout
    assert len(demo["same_process"]) == 2 and min(demo["same_process"]) > 0, demo
    assert "side by side, one core each: engine sdpa / nanoGPT median" in r.stdout, r.stdout
    assert len(demo["side_by_side"]) == 2 and min(demo["side_by_side"]) > 0, demo


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="side by side needs two cores")
def test_host_memory_bench_prints_the_pairs_and_their_faults() -> None:
    r = run_bench("bench_host_memory", "--reps", "1", "--steps", "2", "--warmup", "1", "--shapes", "demo")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    for pair in ("engine kept / engine default", "nanoGPT kept / nanoGPT default", "engine / nanoGPT"):
        assert f"{pair}" in r.stdout and "minor faults per step" in r.stdout, r.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.timeout(900)
def test_gpu_llama_1b_bench_reports_mfu(tmp_path: Path) -> None:
    """A few bf16 steps of the 1B Llama through the engine path, with its MFU."""
    out = tmp_path / "figures.json"
    args = ["--gpu-only", "--steps", "3", "--warmup", "2", "--gpu-seqs", "1024", "--gpu-tokens", "2048"]
    args += ["--gpu-models", "llama3.2-1b"]
    r = run_bench("bench_throughput", *args, "--json", str(out), timeout=scaled(880))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    gpu = json.loads(out.read_text())["gpu"]
    assert gpu["tokens_per_s"] > 0 and 0 < gpu["mfu"] < 1, gpu


def test_side_by_side_on_one_core_says_it_is_skipped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On one usable core the side-by-side pairs are skipped with a line saying why (no worker is pinned to a
    core it may not use)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    monkeypatch.setattr(bench_attention, "_launch", lambda *a, **k: pytest.fail("a worker was started"))
    assert bench_attention.side_by_side_ratios("demo", argparse.Namespace(reps=2)) == []
    assert "side by side: needs two cores" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lm_eval_bench_prints_the_ratios_and_the_results_agree(tmp_path: Path) -> None:
    out = tmp_path / "lm.json"
    args = [
        "--docs",
        "3",
        "--hidden",
        "64",
        "--layers",
        "1",
        "--rounds",
        "1",
        "--tp",
        "2",
        "--json",
        str(out),
    ]
    r = run_bench("bench_lm_eval", *args)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    got = json.loads(out.read_text())
    for rows in (got["vs_hf"], got["tp"]):  # the engine against hf at TP1, and at TP2 against TP1
        assert sorted(rows) == ["generate_until", "loglikelihood", "loglikelihood_rolling"]
        assert all(x["ratio"] > 0 and x["agree"] == 1.0 for x in rows.values()), rows
    assert "TP2 (1 thread(s) per rank) against TP1" in r.stdout
