"""Users' SFT and preference data: chat records rendered with a chat template, loss on assistant turns only.

Records (JSON lines, ``.jsonl.gz``/``.jsonl.zst``, or Parquet):

- SFT: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}`` (multi-turn, the
  system message optional) or ``{"prompt": str, "response": str}`` (= one user and one assistant turn).
- Preference: ``{"prompt", "chosen", "rejected"}``; each a string or a message list (``prompt``: the
  conversation so far; ``chosen``/``rejected``: the assistant reply, alone or after the prompt's messages).

Templates are Jinja, rendered as Hugging Face renders ``chat_template`` (an immutable sandboxed
environment with ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``tojson``, variables
``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``): ``data.chat_template`` is
``project`` (:data:`PROJECT_TEMPLATE`: ``<|user|>...<|assistant|>...<|endoftext|>``, the format of the
generated task), ``tokenizer`` (the ``chat_template`` of the HF tokenizer directory ``data.tokenizer_path``)
or a ``.jinja`` file.

Loss masks: a conversation is rendered turn by turn. For each assistant turn, the text up to the
generation prompt is context (no loss) and what the template adds for the turn itself is trained on; so
loss falls exactly on assistant turns (with whatever closing token the template writes after them). A
template whose rendering of a longer conversation does not extend the shorter one is refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

PROJECT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<|endoftext|>"
    "{% else %}{{ raise_exception('unknown role ' ~ m['role']) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""The project's template: the generated task's format, with an optional system text first."""


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


# ---------------------------------------------------------------------------- engine sources


def _row(ids: list[int], loss: list[int], seq_length: int, pad: int) -> dict[str, np.ndarray]:
    from engine.data.datasets import _row as row

    return row(ids, loss, seq_length, pad)


def chat_sft_source(path: Path, tokenizer: Any, seq_length: int, seed: int) -> Any:
    """SFT samples from ``sft_chat.jsonl`` (rendered segments): loss exactly on the trained segments' tokens."""
    from engine.data.datasets import _warn_truncated, stacked_source

    rows, truncated, n = [], 0, 0
    for where, rec in iter_records(Path(path)):
        ids: list[int] = []
        loss: list[int] = []
        for text, trained in rec["segments"]:
            t = tokenizer.encode(text)
            ids += t
            loss += [int(trained)] * len(t)
        if not any(loss):
            raise ValueError(f"{where}: no trained token")
        if len(ids) > seq_length + 1:
            ids, loss, truncated = ids[: seq_length + 1], loss[: seq_length + 1], truncated + 1
        rows.append(_row(ids, loss, seq_length, tokenizer.pad))
        n += 1
    if not rows:
        raise ValueError(f"{path}: no records")
    _warn_truncated(str(path), truncated, n, seq_length)
    return stacked_source(rows, seed, f"chat_sft_source({path})", truncated=truncated, examples=n)


def chat_preference_source(path: Path, tokenizer: Any, seq_length: int, seed: int) -> Any:
    """DPO samples from ``pref_chat.jsonl``: arrays [2, seq], row 0 chosen, row 1 rejected, loss on the reply."""
    from engine.data.datasets import _stack, _warn_truncated, stacked_source

    rows, truncated = [], 0
    for _, rec in iter_records(Path(path)):
        p = tokenizer.encode(rec["prompt"])
        pair = []
        for key in ("chosen", "rejected"):
            r = tokenizer.encode(rec[key])
            ids, loss = p + r, [0] * len(p) + [1] * len(r)
            if len(ids) > seq_length + 1:
                ids, loss = ids[: seq_length + 1], loss[: seq_length + 1]
                truncated += key == "chosen"
            pair.append(_row(ids, loss, seq_length, tokenizer.pad))
        rows.append(_stack(pair))
    if not rows:
        raise ValueError(f"{path}: no records")
    _warn_truncated(str(path), truncated, len(rows), seq_length)
    return stacked_source(rows, seed, f"chat_preference_source({path})", truncated=truncated)


def train_preferences(data_dir: Path, tokenizer: Any, seq_length: int, seed: int) -> Any:
    """The preference pairs DPO and the reward model train on: users' pairs (data.pref_paths, rendered by
    data_prep: the manifest's ``pref_file``) when given, else the generated pref_train.jsonl."""
    from engine.data.datasets import preference_source, read_manifest

    chat_file = read_manifest(data_dir, verify=False).get("pref_file")
    if chat_file:
        return chat_preference_source(data_dir / chat_file, tokenizer, seq_length, seed)
    return preference_source(data_dir / "pref_train.jsonl", tokenizer, seq_length, seed)
