"""The lm-eval backend on the engine equals lm-eval's own ``hf`` backend on the same small random Llama-style
model (fp32): per-request log-likelihoods within 1e-4 on a multiple-choice, a rolling-perplexity and a
generate-until task (identical greedy generations), and identical task metrics; once more through lm-eval's
registry (``llm-pipeline``) with lm-eval's bundled arc_easy definition pointed at local files, and once with the
model's chat template on every prompt (lm-eval's apply_chat_template, few-shot turns as a conversation)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.support.engine_worker import launch
from tests.support.env import REPO
from tests.support.hf_models import make
from tests.support.lm_eval_worker import responses
from tests.support.lm_tasks import write_tasks

WORKER = REPO / "tests" / "support" / "lm_eval_worker.py"
TOL = 1e-4
MAX_LENGTH = 48
"""Short enough that the rolling task's documents take several windows."""
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    for k, v in OFFLINE.items():
        os.environ.setdefault(k, v)
    root = tmp_path_factory.mktemp("lm")
    return {"hf": make("llama3", root / "hf", tokenizer="llama3"), "tasks": write_tasks(root / "tasks")}


def hf_backend(setup: dict[str, Path], tasks: list[str], **kw: Any) -> dict[str, Any]:
    """lm-eval's own ``hf`` backend on the same model, tasks and seeds."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=str(setup["hf"]), max_length=MAX_LENGTH, batch_size=3, device="cpu", dtype="float32")
    out = simple_evaluate(
        model=lm,
        tasks=tasks,
        log_samples=True,
        task_manager=TaskManager(include_path=str(setup["tasks"]), include_defaults=False),
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
        **kw,
    )
    return {"results": out["results"], "resps": responses(out["samples"])}


def engine_backend(
    setup: dict[str, Path], tasks: list[str], tmp: Path, ranks: int = 1, **kw: Any
) -> dict[str, Any]:
    spec = {
        "hf_dir": str(setup["hf"]),
        "task_dir": str(setup["tasks"]),
        "tasks": tasks,
        "max_length": MAX_LENGTH,
        "batch_size": 3,
        **kw,
    }
    return launch(ranks, spec, tmp, script=WORKER, extra_env=OFFLINE)


def flat(resps: list[Any]) -> list[Any]:
    """Every request's response of every document, in order: a float (log-likelihood) or a string."""
    out: list[Any] = []
    for doc in resps:
        for r in doc:
            x = r[0]
            out.append(x[0] if isinstance(x, (list, tuple)) else x)  # loglikelihood: (ll, is_greedy)
    return out


def metrics(results: dict[str, Any]) -> dict[str, Any]:
    return {t: {k: v for k, v in r.items() if k != "alias"} for t, r in results.items()}


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert sorted(got["resps"]) == sorted(want["resps"])
    for task in want["resps"]:
        g, w = flat(got["resps"][task]), flat(want["resps"][task])
        assert len(g) == len(w) > 0, task
        for a, b in zip(g, w):
            if isinstance(b, str):
                assert a == b, task
            else:
                assert abs(a - b) <= TOL, (task, a, b)
    for task, m in metrics(want["results"]).items():
        gm = metrics(got["results"])[task]
        assert sorted(gm) == sorted(m), task
        for k, v in m.items():
            if isinstance(v, float):
                assert gm[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (task, k)
            else:
                assert gm[k] == v, (task, k)


def test_parity_with_hf_backend(setup: dict[str, Path], tmp_path: Path) -> None:
    tasks = ["local_mc", "local_ppl", "local_gen"]
    got = engine_backend(setup, tasks, tmp_path, num_fewshot=1, limit=4)
    want = hf_backend(setup, tasks, num_fewshot=1, limit=4)
    assert_same(got, want)
    assert len(flat(got["resps"]["local_mc"])) == 16  # 4 docs x 4 choices
    assert any(g for g in flat(got["resps"]["local_gen"]))  # something was generated


def test_data_parallel_replicas_split_the_requests_and_agree_with_hf(
    setup: dict[str, Path], tmp_path: Path
) -> None:
    """Two ranks at tp=1 are two replicas: each computes every second request of each kind and gathers the
    other's, so lm-eval on each sees every result, the same as lm-eval's hf backend's."""
    tasks = ["local_mc", "local_ppl", "local_gen"]
    got = engine_backend(setup, tasks, tmp_path, ranks=2, num_fewshot=1, limit=4)
    assert_same(got, hf_backend(setup, tasks, num_fewshot=1, limit=4))
    (one,) = engine_backend(setup, tasks, tmp_path / "one", num_fewshot=1, limit=4)["served"]
    a, b = got["served"]
    assert a + b == one and abs(a - b) <= len(tasks), (got["served"], one)  # halves, to one per request kind


def test_two_pipeline_stages_agree_with_hf(setup: dict[str, Path], tmp_path: Path) -> None:
    """pp=2: each forward (scoring and every generation step) passes through both stages; the last stage's
    numbers reach lm-eval on both ranks."""
    tasks = ["local_mc", "local_ppl", "local_gen"]
    got = engine_backend(setup, tasks, tmp_path, ranks=2, pp=2, num_fewshot=1, limit=4)
    assert_same(got, hf_backend(setup, tasks, num_fewshot=1, limit=4))
    assert got["served"][0] == got["served"][1] > 0  # both stages serve every request


def test_registry_with_bundled_task_definition(setup: dict[str, Path], tmp_path: Path) -> None:
    got = engine_backend(setup, ["arc_easy_local"], tmp_path, registry=True, limit=3)
    want = hf_backend(setup, ["arc_easy_local"], limit=3)
    assert_same(got, want)
    assert {"acc,none", "acc_stderr,none", "acc_norm,none"} <= set(got["results"]["arc_easy_local"])


def test_parity_with_the_chat_template_applied(setup: dict[str, Path], tmp_path: Path) -> None:
    """The engine renders prompts with the directory's template (engine.data.chat), lm-eval's hf backend with
    transformers': the same requests, scores and generations."""
    tasks = ["local_mc", "local_gen"]
    got = engine_backend(setup, tasks, tmp_path, num_fewshot=1, limit=3, chat=True)
    want = hf_backend(
        setup, tasks, num_fewshot=1, limit=3, apply_chat_template=True, fewshot_as_multiturn=True
    )
    assert_same(got, want)
    assert "<|start_header_id|>" in got["prompts"]["local_mc"][0]  # the template was applied


def test_a_model_without_a_chat_template_cannot_apply_one(setup: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    from engine.evaluation.lm import render_chat
    from engine.evaluation.load import has_chat_template

    bare = tmp_path / "bare"
    shutil.copytree(setup["hf"], bare)
    cfg = bare / "tokenizer_config.json"
    cfg.write_text(cfg.read_text().replace('"chat_template"', '"no_chat_template"'))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    assert has_chat_template(setup["hf"]) and not has_chat_template(bare)
    with pytest.raises(ValueError, match="without a chat template"):
        render_chat(None, [{"role": "user", "content": "hi"}])


def test_requests_with_the_same_input_row_share_one_forward_row(
    setup: dict[str, Path], tmp_path: Path
) -> None:
    """One-token answers to one question are the same input row (the context): one row of the forward for all
    of them, with the numbers each request gets alone (in a worker: the engine patches torch on CPU)."""
    reqs = [["the quick brown fox", [t]] for t in (5, 6, 7, 8)] + [
        ["the quick brown fox", [5, 6]],
        ["a lazy dog", [9]],
    ]
    spec = {"hf_dir": str(setup["hf"]), "max_length": MAX_LENGTH, "shared_rows": reqs}
    out = launch(1, spec, tmp_path, script=WORKER, extra_env=OFFLINE)
    assert sum(out["rows"]) == 3  # ctx (four requests), ctx + [5], other
    for (ll, greedy), (want, want_greedy) in zip(out["got"], out["alone"], strict=True):
        assert abs(ll - want) <= TOL and greedy == want_greedy
