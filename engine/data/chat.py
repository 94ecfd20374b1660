"""Chat data, the one way every stage builds its prompts: conversations rendered with the run's chat template,
loss on assistant turns only.

Every prompt a model sees (SFT and preference examples, the reward model's pairs, online RL's rollout
prompts, eval's prompts) is the run's template's rendering, as transformers' ``apply_chat_template`` renders
it, tokenized without added special tokens. With ``data.chat_template`` other than ``project`` data_prep
renders every chat set into ``*_chat.jsonl`` files (named in its manifest); with ``project`` the stages
render the generated files with :data:`PROJECT_TEMPLATE` when they read them (the same ``ChatTemplate``).
The readers here choose between the two (``train_sft``, ``train_preferences``, ``held_out_pairs``,
``task_prompts``), so no stage builds a prompt of its own.

Records (JSON lines, ``.jsonl.gz``/``.jsonl.zst``, or Parquet):

- SFT: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}`` (multi-turn, the
  system message optional) or ``{"prompt": str, "response": str}`` (= one user and one assistant turn).
- Preference: ``{"prompt", "chosen", "rejected"}``; each a string or a message list (``prompt``: the
  conversation so far; ``chosen``/``rejected``: the assistant reply, alone or after the prompt's messages).
- Task prompts: ``{"prompt", "answer"}`` (the generated task's ``rl_train.jsonl``, ``eval_task.jsonl``).

Templates are Jinja, rendered as Hugging Face renders ``chat_template`` (an immutable sandboxed
environment with ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``tojson``, variables
``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``): ``data.chat_template`` is
``project`` (:data:`PROJECT_TEMPLATE`: ``<|user|>...<|assistant|>...<eos>``, the format of the
generated task), ``tokenizer`` (the ``chat_template`` of the HF tokenizer directory ``data.tokenizer_path``)
or a ``.jinja`` file.

Loss masks: a conversation is rendered turn by turn. For each assistant turn, the text up to the
generation prompt is context (no loss) and what the template adds for the turn itself is trained on; so
loss falls exactly on assistant turns (with whatever closing token the template writes after them). A
template whose rendering of a longer conversation does not extend the shorter one is refused.

Truncation: examples are cut at ``seq_length + 1`` tokens; one left without a trained token is left out and
counted, and the stage's limit (engine.data.truncation) decides whether it may start.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from engine.data.truncation import Truncation, TruncationLimit

PROJECT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}{{ eos_token }}"
    "{% else %}{{ raise_exception('unknown role ' ~ m['role']) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""The project's template: the generated task's format, with an optional system text first; an assistant turn
ends with the tokenizer's eos token (``<|endoftext|>`` for a tokenizer data_prep trains)."""


def load_template(name: str, tokenizer_path: str | None) -> str:
    """The Jinja source for ``data.chat_template``."""
    if name == "project":
        return PROJECT_TEMPLATE
    if name == "tokenizer":
        if not tokenizer_path or not Path(tokenizer_path).is_dir():
            raise ValueError(
                "data.chat_template=tokenizer: data.tokenizer_path must be a HF tokenizer directory"
            )
        d = Path(tokenizer_path)
        if (d / "chat_template.jinja").is_file():
            return (d / "chat_template.jinja").read_text()
        cfg_path = d / "tokenizer_config.json"
        tpl = json.loads(cfg_path.read_text()).get("chat_template") if cfg_path.is_file() else None
        if isinstance(tpl, list):  # named templates: the default one
            tpl = next((t["template"] for t in tpl if t.get("name") == "default"), None)
        if not isinstance(tpl, str):
            raise ValueError(f"data.chat_template=tokenizer: {d} has no chat_template")
        return tpl
    p = Path(name)
    if not p.is_file():
        raise ValueError(f"data.chat_template={name!r}: not project, tokenizer or a template file")
    return p.read_text()


class ChatTemplate:
    """A compiled chat template (HF semantics) that renders conversations into (text, trained) segments."""

    def __init__(self, source: str, eos_token: str = "<|endoftext|>", bos_token: str = "") -> None:
        from jinja2.exceptions import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii
        )
        env.globals["raise_exception"] = raise_exception
        self.template = env.from_string(source)
        self.source = source
        self.eos_token, self.bos_token = eos_token, bos_token

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        return str(
            self.template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                eos_token=self.eos_token,
                bos_token=self.bos_token,
            )
        )

    def segments(self, messages: list[dict[str, str]]) -> list[tuple[str, bool]]:
        """The rendered conversation as (text, trained) pieces: trained = an assistant turn."""
        out: list[tuple[str, bool]] = []
        done = ""
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prefix = self.render(messages[:k], add_generation_prompt=True)
            full = self.render(messages[: k + 1])
            if not prefix.startswith(done) or not full.startswith(prefix):
                raise ValueError(
                    "chat template does not render conversations incrementally; cannot mask turns"
                )
            out += [(prefix[len(done) :], False), (full[len(prefix) :], True)]
            done = full
        rest = self.render(messages)[len(done) :]
        if rest:
            out.append((rest, False))
        return [(t, trained) for t, trained in out if t]


# ---------------------------------------------------------------------------- records


def iter_records(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, record) of a JSON-lines (optionally .gz/.zst) or Parquet file, streamed; ValueError on bad JSON."""
    name = str(path)
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        row = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for rec in batch.to_pylist():
                row += 1
                yield f"{path} row {row}", rec
        return
    from engine.data.formats.base import Bad
    from engine.data.formats.jsonl import json_lines, numbered_lines

    for n, rec in json_lines(numbered_lines(path)):
        if isinstance(rec, Bad):
            raise ValueError(f"{path}:{n}: {rec.reason}")
        yield f"{path}:{n}", rec


def _messages(value: Any, where: str, key: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: {key!r} must be a string or a non-empty list of messages")
    out = []
    for m in value:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: {key!r}: every message needs string 'role' and 'content'")
        if m["role"] not in ("system", "user", "assistant"):
            raise ValueError(f"{where}: {key!r}: unknown role {m['role']!r}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def sft_messages(rec: Any, where: str) -> list[dict[str, str]]:
    """The conversation of an SFT record (``messages``, or ``prompt``/``response``)."""
    if isinstance(rec, dict) and "messages" in rec:
        msgs = _messages(rec["messages"], where, "messages")
    elif (
        isinstance(rec, dict) and isinstance(rec.get("prompt"), str) and isinstance(rec.get("response"), str)
    ):
        msgs = [{"role": "user", "content": rec["prompt"]}, {"role": "assistant", "content": rec["response"]}]
    else:
        raise ValueError(f"{where}: an SFT record needs 'messages' or string 'prompt' and 'response'")
    if not any(m["role"] == "assistant" for m in msgs):
        raise ValueError(f"{where}: the conversation has no assistant turn to train on")
    return msgs


def _reply(value: Any, prompt: list[dict[str, str]], where: str, key: str) -> dict[str, str]:
    if isinstance(value, str):
        return {"role": "assistant", "content": value}
    msgs = _messages(value, where, key)
    if msgs[: len(prompt)] == prompt and len(msgs) > len(prompt):
        msgs = msgs[len(prompt) :]
    if len(msgs) != 1 or msgs[0]["role"] != "assistant":
        raise ValueError(
            f"{where}: {key!r} must be one assistant reply (alone or after the prompt's messages)"
        )
    return msgs[0]


def render_sft(rec: Any, where: str, tpl: ChatTemplate) -> dict[str, Any]:
    """``{"segments": [[text, 0|1], ...]}``: what data_prep writes to ``sft_chat.jsonl``."""
    return {"segments": [[t, int(trained)] for t, trained in tpl.segments(sft_messages(rec, where))]}


def render_preference(rec: Any, where: str, tpl: ChatTemplate) -> dict[str, str]:
    """``{"prompt", "chosen", "rejected"}`` rendered: prompt with the generation prompt, replies as the template
    continues it (closing token included). What data_prep writes to ``pref_chat.jsonl``."""
    if not isinstance(rec, dict) or any(k not in rec for k in ("prompt", "chosen", "rejected")):
        raise ValueError(f"{where}: a preference record needs 'prompt', 'chosen' and 'rejected'")
    prompt = _messages(rec["prompt"], where, "prompt")
    head = tpl.render(prompt, add_generation_prompt=True)
    out = {"prompt": head}
    for key in ("chosen", "rejected"):
        full = tpl.render([*prompt, _reply(rec[key], prompt, where, key)])
        if not full.startswith(head):
            raise ValueError(f"{where}: chat template does not extend the prompt with the reply")
        out[key] = full[len(head) :]
    return out


def render_task_prompt(rec: Any, where: str, tpl: ChatTemplate) -> dict[str, Any]:
    """A task record ``{"prompt", "answer"}`` with its prompt rendered up to the generation prompt (what the
    model sees before it answers) and the plain text kept as ``question``. What data_prep writes to
    ``rl_chat.jsonl`` and ``eval_task_chat.jsonl``."""
    if not (
        isinstance(rec, dict) and isinstance(rec.get("prompt"), str) and isinstance(rec.get("answer"), str)
    ):
        raise ValueError(f"{where}: a task record needs string 'prompt' and 'answer'")
    messages = [{"role": "user", "content": rec["prompt"]}]
    return {**rec, "prompt": tpl.render(messages, add_generation_prompt=True), "question": rec["prompt"]}


PROBE = [
    {"role": "user", "content": "What comes after 1?"},
    {"role": "assistant", "content": "2"},
    {"role": "user", "content": "And after 2?"},
    {"role": "assistant", "content": "3"},
]
"""A conversation every stage's prompts look like (``check_template``)."""


def check_template(tpl: ChatTemplate) -> None:
    """ValueError unless ``tpl`` renders what the stages build from it: a generation prompt holding the
    user's text, turns masked one by one (SFT), a reply extending its prompt (DPO, the reward model)."""
    from jinja2.exceptions import TemplateError

    try:
        prompt = tpl.render(PROBE[:1], add_generation_prompt=True)
        tpl.segments(PROBE)
        render_preference({"prompt": PROBE[0]["content"], "chosen": "2", "rejected": "3"}, "probe", tpl)
    except (TemplateError, ValueError, TypeError) as e:
        raise ValueError(f"it cannot render a user/assistant conversation: {e}") from None
    if PROBE[0]["content"] not in prompt:
        raise ValueError(f"its generation prompt {prompt!r} does not hold the user's message")


def run_template(name: str, tokenizer_path: str | None, tokenizer: Any) -> ChatTemplate:
    """The run's template (``data.chat_template`` = ``name``) with the tokenizer's own eos/bos tokens as the
    template variables: how data_prep renders every chat set (and the pre-flight checks it)."""
    return ChatTemplate(
        load_template(name, tokenizer_path),
        eos_token=tokenizer.special_tokens["eod"],
        bos_token=tokenizer.special_tokens.get("bos", ""),
    )


def project_template(tokenizer: Any) -> ChatTemplate:
    """The project template for ``tokenizer``: the generated files of a run with data.chat_template=project
    are rendered with it when a stage reads them (data_prep renders them for any other template)."""
    return ChatTemplate(PROJECT_TEMPLATE, eos_token=tokenizer.special_tokens["eod"])


# ---------------------------------------------------------------------------- engine sources
#
# Every stage reads its chat data through these: data_prep's rendered files (``*_chat.jsonl``, named in its
# manifest) when the run's template is not the project's, else the generated files rendered here with the
# project template. Either way an example is text rendered by a ChatTemplate, tokenized piece by piece.


def _sft_examples(path: Path, tpl: ChatTemplate | None) -> list[list[tuple[str, bool]]]:
    """(text, trained) segments per example: rendered already (``tpl`` None) or rendered with ``tpl``."""
    out = []
    for where, rec in iter_records(Path(path)):
        if tpl is not None:
            segs = tpl.segments(sft_messages(rec, where))
        else:
            segs = [(str(t), bool(k)) for t, k in rec["segments"]]
        if not any(trained and text for text, trained in segs):
            raise ValueError(f"{where}: no trained token")
        out.append(segs)
    if not out:
        raise ValueError(f"{path}: no records")
    return out


def _sft_rows(
    examples: list[list[tuple[str, bool]]], tokenizer: Any, seq_length: int, pack: bool
) -> tuple[list[dict[str, np.ndarray]], Truncation]:
    """Rows of SFT examples (loss exactly on trained segments); an example cut at ``seq_length`` so short that
    no trained token is left is left out. ``pack``: whole examples share a row while they fit (sft_source)."""
    from engine.data.datasets import _row

    pieces = iter(tokenizer.encode_batch([text for ex in examples for text, _ in ex]))
    rows: list[dict[str, np.ndarray]] = []
    cur_ids: list[int] = []
    cur_loss: list[int] = []
    starts: list[int] = []
    truncated = emptied = longest = 0
    for ex in examples:
        ids: list[int] = []
        loss: list[int] = []
        for _, trained in ex:
            t = next(pieces)
            ids += t
            loss += [int(trained)] * len(t)
        longest = max(longest, len(ids) - 1)
        if len(ids) > seq_length + 1:
            ids, loss, truncated = ids[: seq_length + 1], loss[: seq_length + 1], truncated + 1
        if not any(loss[1:]):  # label j is ids[j + 1]: nothing left to learn
            emptied += 1
            continue
        if cur_ids and (not pack or len(cur_ids) + len(ids) > seq_length + 1):
            rows.append(_row(cur_ids, cur_loss, seq_length, tokenizer.pad, starts if pack else None))
            cur_ids, cur_loss, starts = [], [], []
        starts.append(len(cur_ids))
        cur_ids += ids
        cur_loss += loss
    if cur_ids:
        rows.append(_row(cur_ids, cur_loss, seq_length, tokenizer.pad, starts if pack else None))
    return rows, Truncation("examples", len(examples), truncated, emptied, seq_length, longest)


def _sft_source(
    path: Path, tpl: ChatTemplate | None, tokenizer: Any, seq_length: int, seed: int, pack: bool, limit: Any
) -> Any:
    from engine.data.datasets import _warn_truncated, stacked_source

    rows, cut = _sft_rows(_sft_examples(path, tpl), tokenizer, seq_length, pack)
    _warn_truncated(str(path), cut.truncated, cut.examples, seq_length)
    (limit or TruncationLimit()).check(cut)
    return stacked_source(rows, seed, f"sft_source({path})", truncation=cut)


def sft_source(
    path: Path,
    tokenizer: Any,
    seq_length: int,
    seed: int,
    pack: bool = False,
    limit: TruncationLimit | None = None,
) -> Any:
    """SFT samples from the generated ``{"prompt", "response"}`` lines, rendered with the project template
    (``<|user|>...<|assistant|>...<eos>``): loss on the response tokens and the closing eos.

    Default: one example per row. With ``pack`` (``sft.pack_examples``) consecutive examples of the file
    share a row while they fit, each one complete, so short examples do not waste the row on padding; a
    sample is then a row, not an example. Packed rows carry ``position_ids`` that restart at 0 for each
    example and ``segment_ids`` (the example's number in the row; padding is one more segment), from which
    the step builds a block-diagonal causal attention mask: each example sees only itself, so its loss is
    the one it has alone in a row (tests/engine/models/test_attention.py). With RoPE the positions are not
    used, but the scores depend only on relative positions within the example, so the result is the same.

    Examples longer than ``seq_length`` are cut on the right (counted, warned once); one left without a
    trained token is left out, and ``limit`` (the stage's, engine.data.truncation) decides whether the
    stage may start.
    """
    return _sft_source(path, project_template(tokenizer), tokenizer, seq_length, seed, pack, limit)


def chat_sft_source(
    path: Path,
    tokenizer: Any,
    seq_length: int,
    seed: int,
    pack: bool = False,
    limit: TruncationLimit | None = None,
) -> Any:
    """SFT samples from ``sft_chat.jsonl`` (segments rendered by data_prep), as ``sft_source``."""
    return _sft_source(path, None, tokenizer, seq_length, seed, pack, limit)


def _pairs(path: Path, tpl: ChatTemplate | None) -> list[tuple[str, str, str]]:
    """(prompt, chosen, rejected) texts: rendered already (``tpl`` None) or rendered with ``tpl``."""
    out = []
    for where, rec in iter_records(Path(path)):
        r = render_preference(rec, where, tpl) if tpl is not None else rec
        out.append((str(r["prompt"]), str(r["chosen"]), str(r["rejected"])))
    if not out:
        raise ValueError(f"{path}: no records")
    return out


def preference_rows(
    path: Path, tpl: ChatTemplate | None, tokenizer: Any, seq_length: int
) -> tuple[list[dict[str, np.ndarray]], Truncation]:
    """Rows [2, seq] of preference pairs (row 0 chosen, row 1 rejected, loss on the reply and its closing
    token); a pair in which either reply lost every token to the cut at ``seq_length`` is left out."""
    rows, _, cut = _kept_pairs(_pairs(path, tpl), tokenizer, seq_length)
    return rows, cut


def _kept_pairs(
    pairs: list[tuple[str, str, str]], tokenizer: Any, seq_length: int
) -> tuple[list[dict[str, np.ndarray]], list[tuple[str, str, str]], Truncation]:
    """``preference_rows``'s rows, the texts of the pairs they come from, and the truncation counts."""
    from engine.data.datasets import _row, _stack

    prompts, chosen, rejected = (tokenizer.encode_batch(list(x)) for x in zip(*pairs))
    rows, kept, truncated, emptied, longest = [], [], 0, 0, 0
    for text, p, *replies in zip(pairs, prompts, chosen, rejected):
        pair, cut, empty = [], False, False
        for r in replies:
            ids, loss = p + r, [0] * len(p) + [1] * len(r)
            longest = max(longest, len(ids) - 1)
            if len(ids) > seq_length + 1:
                ids, loss, cut = ids[: seq_length + 1], loss[: seq_length + 1], True
            empty = empty or not any(loss[1:])
            pair.append(_row(ids, loss, seq_length, tokenizer.pad))
        truncated += cut
        emptied += empty
        if not empty:
            rows.append(_stack(pair))
            kept.append(text)
    return rows, kept, Truncation("preference pairs", len(pairs), truncated, emptied, seq_length, longest)


def _preference_source(
    path: Path, tpl: ChatTemplate | None, tokenizer: Any, seq_length: int, seed: int, limit: Any
) -> Any:
    from engine.data.datasets import _warn_truncated, stacked_source

    rows, cut = preference_rows(path, tpl, tokenizer, seq_length)
    _warn_truncated(str(path), cut.truncated, cut.examples, seq_length)
    (limit or TruncationLimit()).check(cut)
    return stacked_source(rows, seed, f"preference_source({path})", truncation=cut)


def preference_source(
    path: Path, tokenizer: Any, seq_length: int, seed: int, limit: TruncationLimit | None = None
) -> Any:
    """DPO samples from the generated ``{"prompt", "chosen", "rejected"}`` lines rendered with the project
    template: arrays [2, seq], row 0 chosen, row 1 rejected (``preference_rows``)."""
    return _preference_source(path, project_template(tokenizer), tokenizer, seq_length, seed, limit)


def chat_preference_source(
    path: Path, tokenizer: Any, seq_length: int, seed: int, limit: TruncationLimit | None = None
) -> Any:
    """DPO samples from ``pref_chat.jsonl`` (rendered by data_prep), as ``preference_source``."""
    return _preference_source(path, None, tokenizer, seq_length, seed, limit)


def _manifest(data_dir: Path) -> dict[str, Any]:
    from engine.data.datasets import read_manifest

    return read_manifest(data_dir, verify=False)


def _rendered_or_project(data_dir: Path, key: str, plain: str, tokenizer: Any) -> tuple[Path, Any]:
    """data_prep's rendered file ``key`` (tpl None), else the generated ``plain`` file with the project
    template, which is then the run's (a data directory rendered with another must have ``key``)."""
    manifest = _manifest(data_dir)
    if manifest.get(key):
        return Path(data_dir) / manifest[key], None
    template = manifest.get("chat_template", "project")
    if template != "project":
        raise ValueError(
            f"{data_dir}: data_prep wrote no {key} rendered with data.chat_template={template} (the data "
            "directory of an older version): prepare the data again (python -m pipeline ... with data_prep)"
        )
    return Path(data_dir) / plain, project_template(tokenizer)


def train_sft(
    data_dir: Path, tokenizer: Any, seq_length: int, seed: int, pack: bool, limit: TruncationLimit
) -> Any:
    """What the SFT stage trains on: users' data.sft_paths or the generated examples, as the run renders them."""
    path, tpl = _rendered_or_project(data_dir, "sft_file", "sft_train.jsonl", tokenizer)
    return _sft_source(path, tpl, tokenizer, seq_length, seed, pack, limit)


def train_preferences(
    data_dir: Path, tokenizer: Any, seq_length: int, seed: int, limit: TruncationLimit | None = None
) -> Any:
    """The preference pairs DPO and the reward model train on: users' pairs (data.pref_paths, rendered by
    data_prep: the manifest's ``pref_file``) when given, else the generated pref_train.jsonl."""
    path, tpl = _rendered_or_project(data_dir, "pref_file", "pref_train.jsonl", tokenizer)
    return _preference_source(path, tpl, tokenizer, seq_length, seed, limit)


def held_out_pairs(
    data_dir: Path, tokenizer: Any, seq_length: int
) -> tuple[list[dict[str, np.ndarray]], list[tuple[str, str, str]], Truncation]:
    """The held-out preference pairs (eval_pref.jsonl as the run renders it) as rows, eval's and the reward
    model's validation set, with the (prompt, chosen, rejected) texts of the pairs kept (eval's lm-eval task)."""
    path, tpl = _rendered_or_project(data_dir, "eval_pref_file", "eval_pref.jsonl", tokenizer)
    return _kept_pairs(_pairs(path, tpl), tokenizer, seq_length)


TASK_PROMPTS = {"rl": ("rl_file", "rl_train.jsonl"), "eval_task": ("eval_task_file", "eval_task.jsonl")}
"""The task prompt sets: online RL's stream and eval's held-out prompts (manifest key, generated file)."""


def task_prompts(data_dir: Path, name: str, tokenizer: Any) -> list[dict[str, Any]]:
    """``{"prompt": rendered up to the generation prompt, "question": the plain text, "answer"}`` of task
    prompt set ``name`` (``TASK_PROMPTS``) as the run renders it: online RL's prompts and eval's."""
    key, plain = TASK_PROMPTS[name]
    path, tpl = _rendered_or_project(data_dir, key, plain, tokenizer)
    out = []
    for where, rec in iter_records(path):
        if tpl is not None:
            rec = render_task_prompt(rec, where, tpl)
        elif not all(isinstance(rec.get(k), str) for k in ("prompt", "question", "answer")):
            raise ValueError(
                f"{where}: a rendered task prompt needs string 'prompt', 'question' and 'answer'"
            )
        out.append(rec)
    if not out:
        raise ValueError(f"{path}: no records")
    return out


def held_out_preferences(
    data_dir: Path, tokenizer: Any, seq_length: int, seed: int, limit: TruncationLimit | None = None
) -> Any:
    """``held_out_pairs`` as a sample source (the reward model's validation set), checked against ``limit``."""
    from engine.data.datasets import stacked_source

    rows, _, cut = held_out_pairs(data_dir, tokenizer, seq_length)
    (limit or TruncationLimit()).check(cut)
    return stacked_source(rows, seed, f"held-out pairs ({data_dir})", truncation=cut)
