"""Small lm-eval task folders for the backend tests, written locally (no download), in the format of real tasks:
``local_mc`` (ARC-style multiple choice), ``local_ppl`` (wikitext-style rolling perplexity), ``local_gen``
(GSM8K-style generate-until with a regex filter), and ``arc_easy_local``: lm-eval's own bundled arc_easy
definition (``include``) pointed at a local JSON file in ARC's format."""

from __future__ import annotations

import json
import random
from pathlib import Path

import lm_eval

WORDS = "the quick brown fox jumps over lazy dog what comes after river user assistant".split()

MC = """task: local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    train: {dir}/mc_train.jsonl
    test: {dir}/mc_test.jsonl
training_split: train
fewshot_split: train
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{choices.label.index(answerKey)}}}}"
doc_to_choice: "{{{{choices.text}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

PPL = """task: local_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/ppl_test.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 2.0
"""

GEN = """task: local_gen
dataset_path: json
dataset_kwargs:
  data_files:
    train: {dir}/gen_train.jsonl
    test: {dir}/gen_test.jsonl
fewshot_split: train
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n", "Question:"]
  do_sample: false
  max_gen_toks: 12
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
filter_list:
  - name: strict-match
    filter:
      - function: regex
        regex_pattern: "(-?[0-9]+)"
      - function: take_first
metadata:
  version: 3.0
"""

ARC = """task: arc_easy_local
include: {bundled}
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files:
    train: {dir}/mc_train.jsonl
    validation: {dir}/mc_train.jsonl
    test: {dir}/mc_test.jsonl
"""


def _mc_doc(i: int) -> dict:
    labels = ["A", "B", "C", "D"]
    return {
        "id": f"q{i}",
        "question": f"What comes after {i}?",
        "choices": {"text": [str(i + 1), f"the {WORDS[i % 8]}", str(i + 7), "fox"], "label": labels},
        "answerKey": labels[i % 4],
    }


def _text(i: int, n: int) -> str:
    """Document i: n words drawn with seed i, so no two documents (nor windows of one) repeat, as in real text."""
    rng = random.Random(i)
    return " ".join(rng.choice(WORDS) for _ in range(n)) + f". What comes after {i}?"


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_tasks(out: Path, docs: int = 4) -> Path:
    """The four task YAMLs and their data files in ``out`` (an lm-eval include_path); returns ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    _write(out / "mc_train.jsonl", [_mc_doc(i + 50) for i in range(3)])
    _write(out / "mc_test.jsonl", [_mc_doc(i) for i in range(docs)])
    _write(out / "ppl_test.jsonl", [{"text": _text(i, 30 + 7 * i)} for i in range(docs)])
    gen = [{"question": f"What comes after {i}?", "answer": f"{i + 1}"} for i in range(docs + 2)]
    _write(out / "gen_train.jsonl", gen[docs:])
    _write(out / "gen_test.jsonl", gen[:docs])
    bundled = Path(lm_eval.__file__).parent / "tasks" / "arc" / "arc_easy.yaml"
    for name, text in {"local_mc": MC, "local_ppl": PPL, "local_gen": GEN, "arc_easy_local": ARC}.items():
        (out / f"{name}.yaml").write_text(text.format(dir=out, bundled=bundled))
    return out
