"""Export a training checkpoint (any saved layout) to a Hugging Face directory, streamed, verified by logits.

``export(model, checkpoint, out, tokenizer_dir)`` streams the checkpoint's weights layer by layer
(:func:`iter_checkpoint_tensors`: megatron's dist_checkpointing reads one tensor's global slice at a time,
whatever TP/PP/VPP/DP layout or distributed-optimizer setting saved it), converts each with
engine.models.hf_weights's table and hands it to a :class:`ShardWriter`, which writes size-capped
``model-XXXXX-of-YYYYY.safetensors`` shards as they fill, then ``model.safetensors.index.json``. Peak host
memory of the writer: one tensor plus one shard being filled (``max_shard_bytes``). It also writes config.json,
generation_config.json and the tokenizer files (tokenizer.json, tokenizer_config.json with the chat template).

Then it checks itself, each side in a fresh process: megatron (a one-rank model loading the checkpoint) and
transformers (loading the directory on CPU, fp32) compute logits on a fixed batch, which are compared.
``export_manifest.json`` records the checkpoint, the shards with their sha256, the batch and the maximum
absolute / relative logit difference. Everything is written into a temp directory that is renamed to ``out``
only when the difference is within tolerance; otherwise ExportError and nothing at ``out``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.records.files import follow_umask
from pipeline.schema.config import ModelConfig

MANIFEST = "export_manifest.json"
TOLERANCE = 1e-4
"""Largest relative logit difference (max |megatron - transformers| / max |megatron|) an export may show (fp32)."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
PIPELINE_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}<|assistant|>"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}<|endoftext|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt and messages[-1]['role'] == 'user' %}{% endif %}"
)
"""The pipeline's own prompt format (data_prep-trained tokenizers): ``<|user|>q<|assistant|>a<|endoftext|>``."""


class ExportError(RuntimeError):
    """The export could not be written or did not pass its logit check; nothing was left at ``out``."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write ``tensors`` to the safetensors file ``path`` with the mode of the export's other files (the
    library creates it 0600: nobody else could load the model)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})
    follow_umask(path)


class ShardWriter:
    """Safetensors shards written as they fill: ``add(name, tensor)`` keeps tensors until the next one would
    take the shard past ``max_shard_bytes``, then writes the shard (``model-XXXXX.safetensors.part``);
    ``close()`` writes the last one, names them ``model-XXXXX-of-YYYYY.safetensors`` and writes
    ``model.safetensors.index.json``. Holds at most one shard in memory."""

    def __init__(self, out: Path, max_shard_bytes: int = 2 << 30) -> None:
        self.out = Path(out)
        self.max = max_shard_bytes
        self.part: dict[str, torch.Tensor] = {}
        self.size = 0
        self.total = 0
        self.files: list[str] = []
        self.weight_map: dict[str, str] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.weight_map or name in self.part:
            raise ValueError(f"tensor {name!r} written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self.part and self.size + nbytes > self.max:
            self._flush()
        self.part[name] = tensor.contiguous()
        self.size += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        fname = f"model-{len(self.files) + 1:05d}.safetensors.part"
        save_safetensors(self.part, self.out / fname)
        self.weight_map |= {k: fname for k in self.part}
        self.files.append(fname)
        self.part, self.size = {}, 0

    def close(self) -> dict[str, Any]:
        if self.part or not self.files:
            self._flush()
        n = len(self.files)
        final = {f: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, f in enumerate(self.files)}
        for f, g in final.items():
            os.replace(self.out / f, self.out / g)
        self.weight_map = {k: final[f] for k, f in self.weight_map.items()}
        self.files = list(final.values())
        index = {"metadata": {"total_size": self.total}, "weight_map": self.weight_map}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return {"files": self.files, "total_size": self.total, "tensors": len(self.weight_map)}


def write_shards(
    tensors: Iterable[tuple[str, torch.Tensor]], out: Path, max_shard_bytes: int = 2 << 30
) -> dict[str, Any]:
    """Write (name, tensor) pairs as safetensors shards of at most ``max_shard_bytes`` plus the index."""
    w = ShardWriter(out, max_shard_bytes)
    for name, t in tensors:
        w.add(name, t)
    return w.close()


# ---------------------------------------------------------------------------- reading the checkpoint


def checkpoint_tensors(checkpoint: Path) -> dict[str, Any]:
    """``{key: TensorStorageMetadata}`` (global ``size``, ``properties.dtype``, stored ``chunks``) of every
    tensor in a dist checkpoint (torch_dist format)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(checkpoint)).read_metadata()
    return {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def read_slice(checkpoint: Path, key: str, offsets: tuple[int, ...], dest: torch.Tensor) -> torch.Tensor:
    """Fill ``dest`` with the region of global tensor ``key`` that starts at ``offsets`` (shape: dest's),
    reading only the stored chunks that overlap it. No process group needed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class SlicePlanner(DefaultLoadPlanner):
        def create_local_plan(self) -> LoadPlan:
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=dest.shape)
            md = self.metadata.state_dict_metadata[key]  # type: ignore[union-attr]
            assert isinstance(md, TensorStorageMetadata)  # key names a tensor (tensor_metadata's keys)
            return LoadPlan(create_read_items_for_chunk_list(key, md, [chunk]))

        def resolve_tensor(self, read_item: Any) -> torch.Tensor:
            t = dest
            for dim, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                t = t.narrow(dim, o, n)
            return t

        def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
            pass

    dcp.load(
        {key: dest}, storage_reader=FileSystemReader(str(checkpoint)), planner=SlicePlanner(), no_dist=True
    )
    return dest


STORAGE_ALIASES = {
    ".self_attention.linear_qkv.layer_norm_weight": ".input_layernorm.weight",
    ".mlp.linear_fc1.layer_norm_weight": ".pre_mlp_layernorm.weight",
}
"""Checkpoint key endings of megatron's layer specs (the norms fused into the next linear, as Transformer
Engine names them; the local spec saves under the same keys) -> the parameter names of the weight tables."""


def _storage_keys(name: str, layer: int | None) -> list[tuple[str, bool]]:
    """(dist-checkpoint key, layers stacked) a table row may be saved under, its alias included: a layer's
    tensors stacked over the layers (``{L}`` dropped, a dense decoder) or under the layer's own number (a
    decoder of MoE layers, which megatron saves as non-homogeneous); a routed expert's under ``experts.``
    with the global expert as an axis (megatron's SequentialMLP)."""
    name = name.replace("local_experts.{E}.", "experts.")
    keys = [(name, False)] if layer is None else [(name.replace("{L}", str(layer)), False)]
    if layer is not None:
        keys.append((name.replace("{L}.", ""), True))
    for key, stacked in list(keys):
        for alias, target in STORAGE_ALIASES.items():
            if key.endswith(target):
                keys.append((key.removesuffix(target) + alias, stacked))
    return keys


def iter_checkpoint_tensors(checkpoint: Path, model: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(global megatron name as in the model's weight table, full TP=1/EP=1 tensor) of every model weight of
    a dist checkpoint, layer by layer (expert by expert), one tensor in memory at a time (plus what the
    caller keeps).

    Each tensor is read as its global region (a layer's and an expert's slice of the stacked tensors, from
    the stored chunks that overlap it), so the layout that saved the checkpoint does not matter.
    Raises KeyError naming a model tensor of the checkpoint that the table does not map (e.g. an adapter).
    """
    from engine.models.hf_tables import fill, table_for
    from engine.models.hf_weights import stream_plan

    path = Path(checkpoint)
    meta = checkpoint_tensors(path)
    model_keys = {k for k in meta if k.startswith(("embedding.", "decoder.", "output_layer."))}
    model_keys = {k for k in model_keys if "_extra_state" not in k}
    plan = []
    for row, layer, expert in stream_plan(table_for(model), model):
        found = next(((k, st) for k, st in _storage_keys(row[0], layer) if k in model_keys), None)
        if found is not None:
            plan.append((fill(row[0], layer, expert), found[0], layer if found[1] else None, expert))
    unmapped = sorted(model_keys - {key for _, key, _, _ in plan})
    if unmapped:
        raise KeyError(f"{path}: model tensors without a Hugging Face mapping: {unmapped[:5]}")
    for name, key, layer, expert in plan:
        yield name, _read_region(path, key, meta[key], model, layer, expert)


def _read_region(
    path: Path, key: str, md: Any, model: ModelConfig, layer: int | None, expert: int | None
) -> torch.Tensor:
    """Global tensor ``key`` at index ``layer`` of its first axis (stacked layers) and ``expert`` of the next."""
    size, dtype = tuple(md.size), md.properties.dtype
    lead = [i for i in (layer, expert) if i is not None]
    if layer is not None and size[0] != model.num_layers:
        raise ValueError(f"{path}: {key} holds {size[0]} layers, model.num_layers={model.num_layers}")
    out = torch.empty(size[len(lead) :], dtype=dtype)
    read_slice(path, key, (*lead, *(0,) * (len(size) - len(lead))), out.view((1,) * len(lead) + out.shape))
    return out


def weight_stream(checkpoint: Path, model: ModelConfig) -> tuple[Iterator[tuple[str, torch.Tensor]], int]:
    """(stream of (global megatron name, full tensor), its padded vocabulary) of a committed checkpoint.

    A LoRA checkpoint (adapters only) streams its recorded base (a Hugging Face directory or a checkpoint,
    itself maybe LoRA) with ``scale * B @ A`` added to each adapted weight, as the engine merges them.
    """
    from engine.models import lora

    rec = lora.checkpoint_record(Path(checkpoint))
    if rec is None:
        return iter_checkpoint_tensors(checkpoint, model), padded_vocab(checkpoint_tensors(checkpoint))
    if not rec.get("base"):
        raise ExportError(f"{checkpoint}: a LoRA checkpoint without a recorded base")
    base, padded = _base_stream(str(rec["base"]), model)
    from engine.checkpoint.load import load_tensors

    deltas = lora.full_deltas(load_tensors(Path(checkpoint)), rec)

    def merged() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in base:
            delta = deltas.pop(name, None)
            yield name, tensor if delta is None else tensor + delta.to(tensor.dtype)
        if deltas:
            raise ExportError(f"{checkpoint}: adapters without a base weight: {sorted(deltas)[:3]}")

    return merged(), padded


def _base_stream(base: str, model: ModelConfig) -> tuple[Iterator[tuple[str, torch.Tensor]], int]:
    from engine.checkpoint.latest import find_latest
    from engine.checkpoint.layout import MARKER
    from engine.models.hf_weights import iter_hf_tensors
    from pipeline.schema.hf_arch import is_hf_dir, parse_ref

    path = parse_ref(base) or Path(base)
    if is_hf_dir(path):
        return iter_hf_tensors(path, model), int(model.vocab_size or 0)
    found = path if (path / MARKER).is_file() else find_latest(path, collective=False)
    if found is None:
        raise ExportError(f"LoRA base {base}: no complete checkpoint there")
    return weight_stream(found, model)


def padded_vocab(checkpoint_meta: dict[str, Any]) -> int:
    return int(checkpoint_meta["embedding.word_embeddings.weight"].size[0])


def _tokenizer_files(tokenizer_dir: Path, out: Path) -> dict[str, Any]:
    """Copy the tokenizer files; a pipeline-trained tokenizer gets a tokenizer_config.json with its template.

    Returns the files copied, the eos/pad/bos ids and the stop ids (eos + the data manifest's
    ``stop_token_ids``: a Hugging Face model's end-of-turn tokens) for generation_config.json."""
    from engine.data.datasets import MANIFEST as DATA_MANIFEST
    from engine.data.datasets import load_tokenizer

    src = Path(tokenizer_dir)
    copied = [f for f in TOKENIZER_FILES if (src / f).is_file()]
    for f in copied:
        shutil.copyfile(src / f, out / f)
    if "tokenizer_config.json" not in copied:
        from transformers import PreTrainedTokenizerFast

        fast = PreTrainedTokenizerFast(
            tokenizer_file=str(src / "tokenizer.json"), eos_token="<|endoftext|>", pad_token="<|pad|>"
        )
        fast.chat_template = PIPELINE_CHAT_TEMPLATE
        fast.save_pretrained(out)
    tok = load_tokenizer(out / "tokenizer.json")
    stop = [tok.eod]
    if (src / DATA_MANIFEST).is_file():
        stop += [
            i
            for i in json.loads((src / DATA_MANIFEST).read_text()).get("stop_token_ids", [])
            if i not in stop
        ]
    ids = {"eos": tok.eod, "pad": tok.pad, "bos": tok.special_ids.get("bos")}
    return {"copied": copied, "ids": ids, "stop": stop}


def pad_entry(pad: int, source: Path | None, name: str) -> dict[str, Any]:
    """The ``pad_token_id`` entry of the exported ``name`` (config.json, generation_config.json): a model that
    started from a Hugging Face directory keeps that model's entry as it was (absent stays absent, null stays
    null; its config.json's when it has no ``name``), any other the tokenizer's pad id."""
    if source is not None:
        for f in (name, "config.json"):
            if (source / f).is_file():
                data = json.loads((source / f).read_text())
                return {"pad_token_id": data["pad_token_id"]} if "pad_token_id" in data else {}
    return {"pad_token_id": pad}


def _batch(vocab: int, seq: int) -> torch.Tensor:
    rng = np.random.default_rng(1234)
    return torch.tensor(rng.integers(0, vocab, size=(2, min(seq, 32))), dtype=torch.long)


def export(
    model: ModelConfig,
    checkpoint: Path,
    out: Path,
    tokenizer_dir: Path,
    *,
    tolerance: float = TOLERANCE,
    max_shard_bytes: int = 2 << 30,
    threads: int = 2,
    source: Path | None = None,
) -> dict[str, Any]:
    """Write and verify the Hugging Face directory ``out``; returns the manifest. One process, one rank
    (plus the two check processes). ``source``: the config.json (and generation_config.json) of the Hugging
    Face model the run started from, whose ``pad_token_id`` the export keeps (:func:`pad_entry`)."""
    from engine.checkpoint.load import require_committed
    from engine.data.datasets import load_tokenizer
    from engine.models.hf_weights import to_hf_tensors
    from pipeline.schema.hf_arch import to_hf_config

    out = Path(out)
    if out.exists():
        raise ExportError(f"{out}: already exists; remove it or pass another --out")
    vocab = model.vocab_size or load_tokenizer(Path(tokenizer_dir) / "tokenizer.json").vocab_size
    to_hf_config(model, vocab)  # fails early, naming the keys, for an architecture without an HF twin
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp.{out.name}.{secrets.token_hex(4)}"
    tmp.mkdir()
    start = time.monotonic()
    try:
        require_committed(Path(checkpoint))
        torch.set_num_threads(threads)
        weights, padded = weight_stream(Path(checkpoint), model)
        first = next(weights)  # the embedding: its dtype is the export's
        dtype = first[1].dtype
        stream = to_hf_tensors(itertools.chain([first], weights), model, padded)
        shards = write_shards(stream, tmp, max_shard_bytes)
        tok = _tokenizer_files(Path(tokenizer_dir), tmp)
        eos, pad, bos = tok["ids"]["eos"], tok["ids"]["pad"], tok["ids"]["bos"]
        extra = {
            "eos_token_id": eos,
            "bos_token_id": bos,
            **pad_entry(pad, source, "config.json"),
            "torch_dtype": str(dtype).split(".")[-1],
        }
        (tmp / "config.json").write_text(json.dumps(to_hf_config(model, vocab, extra), indent=2))
        stop = tok["stop"][0] if len(tok["stop"]) == 1 else tok["stop"]
        gen = {"eos_token_id": stop, **pad_entry(pad, source, "generation_config.json")}
        gen |= {"bos_token_id": bos, "do_sample": False}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        tokens = _batch(vocab, model.seq_length)
        ours = megatron_logits(model, Path(checkpoint), tokens, vocab, threads)
        theirs = hf_logits(tmp, tokens)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    manifest = {
        "format": 1,
        "checkpoint": str(checkpoint),
        "model": model.name,
        "architecture": json.loads((tmp / "config.json").read_text())["architectures"][0],
        "vocab_size": vocab,
        "dtype": extra["torch_dtype"],
        "shards": {
            f: {"bytes": (tmp / f).stat().st_size, "sha256": _sha256(tmp / f)} for f in shards["files"]
        },
        "total_size": shards["total_size"],
        "tensors": shards["tensors"],
        "tokenizer": tok["copied"] or ["tokenizer.json", "tokenizer_config.json (written)"],
    }
    return commit_checked(tmp, out, manifest, ours, theirs, tolerance, start, "transformers")


def commit_checked(
    tmp: Path,
    out: Path,
    manifest: dict[str, Any],
    ours: torch.Tensor,
    theirs: torch.Tensor,
    tolerance: float,
    start: float,
    who: str,
) -> dict[str, Any]:
    """Add the logit check to ``manifest``, write it into ``tmp`` and rename ``tmp`` to ``out`` when the check
    passed; otherwise remove ``tmp`` and raise: an export that failed its check is never left behind."""
    diff = float((ours - theirs).abs().max())
    rel = diff / float(ours.abs().max())
    manifest["check"] = {
        "batch": list(ours.shape[:2]),
        "max_abs_diff": diff,
        "max_rel_diff": rel,
        "tolerance": tolerance,
        "passed": rel <= tolerance,
    }
    manifest["seconds"] = round(time.monotonic() - start, 2)
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    if rel > tolerance:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(
            f"{manifest['checkpoint']}: {who}'s logits differ from megatron's by {rel:.3g} (relative) > "
            f"{tolerance}; nothing written"
        )
    tmp.rename(out)
    return manifest


_MEGATRON_LOGITS = """
import dataclasses, json, sys, torch
from pathlib import Path
from pipeline.schema.sections import ModelConfig, ParallelConfig
from engine.runtime import distributed as D
from engine.checkpoint.load import load_weights
from engine.models.gpt import build_model, unwrap
model = ModelConfig(**json.loads(Path(sys.argv[1]).read_text()))
ckpt, vocab, threads = Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
tokens = torch.load(sys.argv[5])
D.init(1, 1, None, seed=0, threads=threads)
try:
    chunks = build_model(model, ParallelConfig(micro_batch_size=1, global_batch_size=1, precision="fp32"), vocab)
    load_weights(ckpt, chunks)
    gpt = unwrap(chunks[0]).eval()
    with torch.no_grad():
        pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        torch.save(gpt(tokens, pos, None)[..., :vocab].float(), sys.argv[6])
finally:
    D.shutdown()
"""


def _run(code: list[str], what: str) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")])
        ),
    }
    done = subprocess.run([sys.executable, "-c", *code], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise ExportError(f"{what}: {done.stderr[-2000:]}")


def fresh_logits(code: str, args: list[str], tokens: torch.Tensor, what: str) -> torch.Tensor:
    """Run ``code`` in a fresh interpreter with ``sys.argv[1:] = [*args, tokens.pt, logits.pt]`` and return
    the logits it saved: a process that ran megatron (its CPU patches, its process groups) is no clean room
    for a reference, and the exporting process never holds a second whole model."""
    with tempfile.TemporaryDirectory() as d:
        src, dst = Path(d) / "tokens.pt", Path(d) / "logits.pt"
        torch.save(tokens, src)
        _run([code, *args, str(src), str(dst)], what)
        return torch.load(dst)


def megatron_logits(
    model: ModelConfig, checkpoint: Path, tokens: torch.Tensor, vocab: int, threads: int = 2
) -> torch.Tensor:
    """The checkpoint's fp32 logits for ``tokens`` from a one-rank megatron model, in a fresh process."""
    import dataclasses

    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "model.json"
        cfg.write_text(json.dumps(dataclasses.asdict(model)))
        args = [str(cfg), str(checkpoint), str(vocab), str(threads)]
        return fresh_logits(
            _MEGATRON_LOGITS, args, tokens, f"{checkpoint}: megatron cannot compute the reference logits"
        )


def hf_logits(model_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 logits for ``tokens`` (CPU), computed in a fresh process."""
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()\n"
        "with torch.no_grad():\n"
        "    torch.save(m(torch.load(sys.argv[2])).logits.float(), sys.argv[3])\n"
    )
    return fresh_logits(code, [str(model_dir)], tokens, f"{model_dir}: transformers cannot load the export")
