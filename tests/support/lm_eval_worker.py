"""Subprocess worker: lm-eval's simple_evaluate on the engine backend (``engine.evaluation.lm.EngineLM``).

SPEC keys: hf_dir, task_dir (an include_path; lm-eval's bundled tasks are not indexed: ~25 s), tasks, num_fewshot,
limit, max_length, batch_size, registry (build the backend through lm-eval's registry by name, ``llm-pipeline``,
instead of from engine objects), chat (lm-eval's apply_chat_template, with the directory's own template), out (set
by launch), pp (pipeline stages), shared_rows (instead: score ``shared_rows``'s requests through EngineLM and
each alone; see ``shared_rows``). Every rank runs it (ranks beyond pp are data-parallel replicas).
Writes {"results": simple_evaluate's results, "resps": {task: [per-doc responses]}, "prompts", "served" (each
rank's count of requests it computed)} to ``out``.
"""

from __future__ import annotations

import json
from typing import Any


def responses(samples: dict[str, list[dict]]) -> dict[str, list[Any]]:
    """Per task, each document's raw responses (one per request), in document order."""
    return {t: [s["resps"] for s in sorted(rows, key=lambda s: s["doc_id"])] for t, rows in samples.items()}


def shared_rows(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec["shared_rows"]``: [[context text, continuation token ids], ...]. Returns {"got": EngineLM's
    (loglikelihood, is_greedy) per request, "alone": each request scored as its own row, "rows": the batch
    sizes of the forwards EngineLM ran}."""
    import engine.models.generate as G
    from engine.evaluation.lm import EngineLM, score_rows
    from engine.evaluation.load import load_hf_dir
    from engine.runtime import distributed as D

    try:
        chunks, tok, stops, _ = load_hf_dir(spec["hf_dir"], spec["max_length"])
        lm = EngineLM(chunks, tok, max_length=spec["max_length"], batch_size=4, stop_tokens=stops)
        reqs = [(None, lm.tok_encode(text), cont) for text, cont in spec["shared_rows"]]
        alone = [score_rows(chunks, [(c + k)[:-1]], [k])[0] for _, c, k in reqs]
        rows: list[int] = []
        forward = G.forward_logits

        def counted(c: Any, t: Any, p: Any, **kw: Any) -> Any:
            rows.append(t.shape[0])
            return forward(c, t, p)

        G.forward_logits = counted
        got = lm._loglikelihood_tokens(reqs)
    finally:
        D.shutdown()
    return {"got": got, "alone": alone, "rows": rows}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    if spec.get("shared_rows"):
        return shared_rows(spec)
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from engine.evaluation.lm import EngineLM
    from engine.evaluation.load import dir_template, load_hf_dir
    from engine.runtime import distributed as D

    args = {"max_length": spec["max_length"], "batch_size": spec["batch_size"]}
    if spec.get("registry"):
        model: Any = "llm-pipeline"
        model_args = f"pretrained={spec['hf_dir']},max_length={spec['max_length']}"
    else:
        chunks, tok, stops, _ = load_hf_dir(spec["hf_dir"], spec["max_length"], pp=spec.get("pp", 1))
        chat = dir_template(spec["hf_dir"], tok)
        model, model_args = EngineLM(chunks, tok, stop_tokens=stops, chat=chat, **args), None
    try:
        out = simple_evaluate(
            model=model,
            model_args=model_args,
            tasks=spec["tasks"],
            num_fewshot=spec.get("num_fewshot"),
            limit=spec.get("limit"),
            batch_size=spec["batch_size"],
            log_samples=True,
            task_manager=TaskManager(include_path=spec["task_dir"], include_defaults=False),
            random_seed=0,
            numpy_random_seed=0,
            torch_random_seed=0,
            fewshot_random_seed=0,
            apply_chat_template=bool(spec.get("chat")),
            fewshot_as_multiturn=bool(spec.get("chat")),
        )
        served = D.all_gather_object(model.served) if isinstance(model, EngineLM) else []
    finally:
        D.shutdown()
    if out is None:  # lm-eval returns results on LOCAL_RANK 0 only
        return {"served": served}
    prompts = {
        t: [json.dumps(s["arguments"], default=str) for s in rows] for t, rows in out["samples"].items()
    }
    return {
        "results": out["results"],
        "resps": responses(out["samples"]),
        "prompts": prompts,
        "served": served,
    }


if __name__ == "__main__":
    from tests.support.engine_worker import serve

    serve(run)
