"""An lm-evaluation-harness model backend on the engine's megatron-core GPT model (registered as ``llm-pipeline``).

``EngineLM(chunks, tok, max_length=...)`` serves lm-eval's three request kinds on this rank's model chunks (as
``engine.models.gpt.build_model`` returns them, weights loaded) with the run's tokenizer
(``engine.data.datasets.Tokenizer``):

- ``loglikelihood``: lm-eval's own encoding (``TemplateLM``: the context and continuation encoded together, then
  split; an empty context gets the prefix token, bos else eos), then one forward per batch of right-padded rows
  (causal attention: padding after a row never reaches it), the summed log-probs of the continuation tokens and
  whether each is the argmax, as lm-eval's ``hf`` backend computes them;
- ``loglikelihood_rolling``: lm-eval's disjoint rolling windows of ``max_length`` tokens (prefix token first),
  scored as above and summed per document;
- ``apply_chat_template``: with lm-eval's ``apply_chat_template``, every prompt rendered with the model's chat
  template (``chat``: an engine.data.chat.ChatTemplate; from a directory, its own);
- ``generate_until``: greedy (or sampled, when a task asks) generation with the engine's KV cache
  (``engine.models.generate``) up to ``max_gen_toks`` or a stop token (the tokenizer's eos, ``stop_tokens`` and
  any token whose text holds an ``until`` string), decoded without special tokens and cut at the first of the
  task's ``until`` strings.

Scored requests with the same input row share it; rows and generation requests are sorted longest first and
batched ``batch_size`` at a time; results come back in request order. One rank, or the ranks of one tensor-
parallel group serving the same requests (logits gathered over TP); data-parallel ranks (model replicas) each
serve every ``dp``-th request and gather the others' results, so lm-eval on every rank sees all of them (not
with expert parallelism, whose replicas must step together). With pipeline stages (and virtual ones) each
forward passes through them and the last stage's numbers go to every stage. ``served`` counts the requests
this rank computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    Collator,
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from engine.runtime import distributed as D

DEFAULT_MAX_GEN_TOKS = 256
"""New tokens per generation when a task does not say (lm-eval's ``hf`` backend's default)."""


@register_model("llm-pipeline")
class EngineLM(TemplateLM):
    """lm-eval's ``LM`` on the engine; see the module docstring."""

    def __init__(
        self,
        chunks: list[Any] | None = None,
        tok: Any = None,
        *,
        max_length: int = 2048,
        batch_size: int | str = 8,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        stop_tokens: Sequence[int] = (),
        chat: Any = None,
        pretrained: str | None = None,
        **_lm_eval_extras: Any,
    ) -> None:
        super().__init__()
        if chunks is None or tok is None:  # through lm-eval's registry: ``pretrained=<hf dir>`` (one rank)
            if not pretrained:
                raise ValueError("llm-pipeline: give model_args pretrained=<Hugging Face directory>")
            from engine.evaluation.load import dir_template, load_hf_dir

            chunks, tok, stop_tokens, max_length = load_hf_dir(pretrained, max_length)
            chat = dir_template(pretrained, tok)
        for c in chunks:
            c.eval()
        self.chunks = chunks
        self.tok = tok
        self._max_length = int(max_length)
        self._batch_size = int(batch_size) if str(batch_size).isdigit() else 8  # "auto": a fixed batch
        self._max_gen_toks = int(max_gen_toks)
        self.stop_tokens = tuple(dict.fromkeys([tok.eod, *stop_tokens]))
        self.chat = chat
        self._until_cache: dict[tuple[str, ...], tuple[int, ...]] = {}
        self._token_texts: list[str] = []
        self._dp = D.dp_size() if D.ep_size() == 1 else 1
        self.served = 0
        """Requests this rank computed (with data-parallel replicas: its share)."""

    # ------------------------------------------------------------------------ what lm-eval asks of a model

    @property
    def eot_token_id(self) -> int:
        return int(self.tok.special_ids.get("bos", self.tok.eod))

    @property
    def prefix_token_id(self) -> int:
        return int(self.tok.special_ids.get("bos", self.tok.eod))

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def tokenizer_name(self) -> str:
        return str(self.tok.source)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The template's source (lm-eval records and hashes it), None without one."""
        return self.chat.source if self.chat is not None and chat_template is not False else None

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """A task's prompt (few-shot turns included) rendered with the model's chat template."""
        return render_chat(self.chat, chat_history, add_generation_prompt)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """The tokenizer's own post-processing (e.g. a bos it adds) unless asked not to, as transformers' default;
        not when the string already starts with the prefix token's text."""
        add = True if add_special_tokens is None else add_special_tokens
        if add_special_tokens is None and string.startswith(self.tok.decode([self.prefix_token_id])):
            add = False
        return list(self.tok.hf.encode(string, add_special_tokens=add).ids)

    def tok_decode(self, ids: Sequence[int]) -> str:
        return str(self.tok.hf.decode([int(i) for i in ids], skip_special_tokens=True))

    # ------------------------------------------------------------------------ scoring

    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), continuation is greedy) per request, in request order."""
        out = self._spread(self._score, requests)
        for (key, _, _), r in zip(requests, out):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, r)
        return out

    def _score(self, requests: list[tuple[Any, list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Requests whose input rows are the same tokens (a multiple-choice question's one-token answers: the
        context alone) share one row of the forward; unique rows longest first, ``batch_size`` at a time."""
        index: dict[tuple[int, ...], int] = {}
        row_of = []
        for _, ctx, cont in requests:
            if not ctx or not cont:
                raise ValueError("llm-pipeline: a request with an empty context or continuation")
            row = tuple((ctx + cont)[-(self.max_length + 1) :][:-1])  # cut on the left to fit
            row_of.append(index.setdefault(row, len(index)))
        unique = list(index)
        users: list[list[int]] = [[] for _ in unique]
        for i, r in enumerate(row_of):
            users[r].append(i)
        order = sorted(range(len(unique)), key=lambda r: (-len(unique[r]), unique[r]))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            who = [i for r in batch for i in users[r]]
            pos = {r: k for k, r in enumerate(batch)}
            rows = [list(unique[r]) for r in batch]
            conts = [requests[i][2] for i in who]
            done = score_rows(self.chunks, rows, conts, [pos[row_of[i]] for i in who], pad_id=self.tok.pad)
            for i, res in zip(who, done):
                out[i] = res
        return out

    def _spread(self, work: Any, items: list[Any]) -> list[Any]:
        """``work`` over this data-parallel rank's share of ``items`` (every dp-th), every rank's results put
        back in item order on every rank (one replica: ``work(items)``)."""
        mine = items[D.dp_rank() :: self._dp] if self._dp > 1 else items
        done = work(mine)
        self.served += len(mine)
        if self._dp == 1:
            return list(done)
        out: list[Any] = [None] * len(items)
        for r, share in enumerate(D.dp_all_gather_object(list(done))):
            out[r :: self._dp] = share
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Summed log-likelihood of each whole document over lm-eval's disjoint windows of max_length tokens."""
        windows: list[tuple[Any, list[int], list[int]]] = []
        owners: list[int] = []
        for i, (text,) in enumerate(req.args for req in requests):
            for ctx, cont in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, list(ctx), list(cont)))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (ll, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[i] += ll
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ------------------------------------------------------------------------ generation

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Generations per request (same generation settings batched together), cut at the ``until`` strings."""
        args = [req.args for req in requests]
        out = self._spread(self._generate_all, args)
        for (ctx, gen_kwargs), text in zip(args, out):
            self.cache_hook.add_partial("generate_until", (ctx, gen_kwargs), text)
        return out

    def _generate_all(self, args: list[tuple[str, dict[str, Any]]]) -> list[str]:
        collator = Collator(
            args,
            sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]),
            group_by="gen_kwargs",
            group_fn=lambda r: r[1],
        )
        eos = self.tok.decode([self.eot_token_id])
        out: list[str] = []
        for batch in collator.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*batch)
            kwargs = dict(normalize_gen_kwargs(all_kwargs[0], self._max_gen_toks))
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            new = int(kwargs.pop("max_gen_toks"))
            room = self.max_length - new
            if room <= 0:
                raise ValueError(
                    f"llm-pipeline: max_gen_toks={new} leaves no room in max_length={self.max_length}"
                )
            prompts = [self.tok_encode(c)[-room:] for c in contexts]
            texts = self._generate(prompts, new, kwargs, self._until_tokens(tuple(until)))
            out += [postprocess_generated_text(generation=t, stop=until, think_end_token=None) for t in texts]
        return list(collator.get_original(out))

    def _until_tokens(self, until: tuple[str, ...]) -> tuple[int, ...]:
        """Tokens whose own text holds one of ``until``: a row that emits one has its cut point, so it stops
        there (the same text after the cut, fewer steps); an ``until`` split over tokens still cuts after."""
        if not self._token_texts:  # decoded once per backend: every until set filters the same texts
            size = int(self.tok.hf.get_vocab_size(with_added_tokens=True))
            self._token_texts = [self.tok_decode([i]) for i in range(size)]
        if until not in self._until_cache:
            self._until_cache[until] = tuple(
                i for i, t in enumerate(self._token_texts) if any(u and u in t for u in until)
            )
        return self._until_cache[until]

    def _generate(
        self, prompts: list[list[int]], new: int, kwargs: dict[str, Any], until_ids: tuple[int, ...] = ()
    ) -> list[str]:
        from engine.models.generate import SamplingParams, generate

        sample = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature") or 0.0) > 0
        params = SamplingParams(
            max_new_tokens=new,
            temperature=float(kwargs["temperature"]) if sample else 0.0,
            top_k=int(kwargs.get("top_k") or 0) if sample else 0,
            top_p=float(kwargs.get("top_p") or 1.0) if sample else 1.0,
            stop_tokens=tuple(dict.fromkeys([*self.stop_tokens, *until_ids])),
            seed=int(kwargs.get("seed") or 0),
        )
        got = generate(self.chunks, prompts, params, vocab_size=self.tok.vocab_size, pad_id=self.tok.pad)
        return [self.tok_decode(ids) for ids in got.tokens]


def render_chat(chat: Any, history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """``history`` rendered with ``chat`` (an engine.data.chat.ChatTemplate); a clear error without one."""
    if chat is None:
        raise ValueError(
            "llm-pipeline: apply_chat_template asked of a model without a chat template (add "
            "chat_template.jinja to its directory, or run without --apply_chat_template)"
        )
    return str(chat.render(history, add_generation_prompt=add_generation_prompt))


def score_rows(
    chunks: list[Any],
    rows: list[list[int]],
    conts: list[list[int]],
    row_of: list[int] | None = None,
    pad_id: int = 0,
) -> list[tuple[float, bool]]:
    """For each continuation ``conts[i]`` and its row ``rows[row_of[i]]`` (default: ``rows[i]``), which ends in
    the continuation shifted by one (it holds every token but the continuation's last): the continuation's
    summed log-probs and whether each token is the argmax. ``chunks``: this rank's model chunks; with pipeline
    stages the last one scores and every stage gets its numbers."""
    from engine.models.generate import forward_logits

    dev = D.device()
    width = max(len(r) for r in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long, device=dev)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r, dtype=torch.long, device=dev)
    pos = torch.arange(width, device=dev).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        logits = forward_logits(chunks, tokens, pos)
    row_of = list(range(len(conts))) if row_of is None else row_of
    out = _continuations(logits, rows, row_of, conts) if logits is not None else []
    return D.pp_broadcast_from_last(out) if D.pp_size() > 1 else out


def _continuations(
    logits: torch.Tensor, rows: list[list[int]], row_of: list[int], conts: list[list[int]]
) -> list[tuple[float, bool]]:
    """The log-softmax of the continuations' positions only (not of every position of every row)."""
    ends = [len(rows[r]) for r in row_of]
    spans = [logits[r, n - len(c) : n] for r, n, c in zip(row_of, ends, conts)]  # [len(c), V] each
    logp = torch.log_softmax(torch.cat(spans).float(), dim=-1)
    want = torch.tensor([t for c in conts for t in c], dtype=torch.long, device=logp.device)
    picked = logp.gather(-1, want[:, None]).squeeze(-1)
    hits = logp.argmax(-1) == want
    out, at = [], 0
    for c in conts:
        out.append((float(picked[at : at + len(c)].sum()), bool(hits[at : at + len(c)].all())))
        at += len(c)
    return out
