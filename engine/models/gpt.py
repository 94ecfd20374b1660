"""The model: megatron-core GPTModel (TE layer spec where TE imports, else local), in mixed precision and DDP.

``build_model`` returns the list of model chunks (one per virtual pipeline stage on this rank), each wrapped
in megatron's DistributedDataParallel, with ``config.finalize_model_grads_func`` set (without it the
data-parallel gradients are never reduced). Call it after ``engine.runtime.distributed.init``.

The embedding and output tables are padded to a multiple of ``make_vocab_size_divisible_by x tp``
(``padded_vocab_size``); the padded entries are not tokens: their logits are -inf at the output layer
(``mask_padded_vocab``), so every softmax over the vocabulary (the loss, log-probs, perplexity, sampling)
is that of the real vocabulary, whatever the padding and the layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from engine.models import moe
from engine.models.init_weights import init_by_global_name
from engine.runtime import distributed as D
from engine.runtime.stragglers import SyncClock
from pipeline.schema.config import ModelConfig
from pipeline.schema.sections import ParallelConfig

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Vocabulary rounded up to a multiple of ``divisible_by x tp`` (megatron's embedding padding)."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def mask_padded_vocab(gpt: Any, vocab_size: int, tp_rank: int, tp_size: int) -> None:
    """Make the logits of the padded vocabulary entries (ids >= ``vocab_size``) -inf, in place, at the output
    layer of a last-stage GPTModel: probability 0 and no gradient in every consumer.

    Under tensor parallelism each rank masks the padded ids inside its own shard (an all-padding shard is
    all -inf; megatron's vocab-parallel cross entropy takes the max over all ranks, so it stays finite), or
    the padded tail of the gathered logits (generation's ``runtime_gather_output``). Nothing is done when
    nothing is padded (the numbers of an unpadded vocabulary are unchanged bit for bit).
    """
    padded = int(gpt.vocab_size)
    if padded <= vocab_size:
        return
    shard = padded // tp_size
    shard_start = min(max(vocab_size - tp_rank * shard, 0), shard)  # first padded id in this rank's shard

    def mask(_module: Any, _args: Any, out: tuple[torch.Tensor, Any]) -> None:
        logits = out[0]
        start = vocab_size if logits.shape[-1] == padded else shard_start  # gathered, or this rank's shard
        if start < logits.shape[-1]:
            logits[..., start:] = float("-inf")

    gpt.output_layer.register_forward_hook(mask)


def transformer_config(model: ModelConfig, par: ParallelConfig) -> Any:
    """megatron TransformerConfig from the schema (fp32/bf16/fp16, recompute, GQA, swiglu, norms)."""
    from megatron.core.transformer import TransformerConfig

    dtype = _DTYPES[par.precision]
    recompute: dict[str, Any] = {}
    if par.recompute == "full":
        recompute = {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        }
    elif par.recompute == "selective":
        recompute = {"recompute_granularity": "selective"}
    swiglu = model.activation == "swiglu"
    on_gpu = D.device().type == "cuda"
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        ffn_hidden_size=model.ffn_hidden_size or 4 * model.hidden_size,
        kv_channels=model.kv_channels,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        init_method_std=model.init_method_std,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp if par.vpp and par.vpp > 1 else None,
        sequence_parallel=par.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=par.precision == "bf16",
        fp16=par.precision == "fp16",
        calculate_per_token_loss=True,
        use_cpu_initialization=not on_gpu,
        batch_p2p_comm=on_gpu,  # gloo: the interleaved schedule learns only without it
        **recompute,
        # qk_layernorm; experts, router, EP (engine/models/moe.py); grouped GEMM needs TE's TEGroupedMLP
        **moe.transformer_kwargs(model, par, grouped_gemm=on_gpu and transformer_engine_available()),
    )


def transformer_engine_available() -> bool:
    """Whether Transformer Engine imports here (GPU clusters with TE; never on CPU or the lent H200)."""
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # ImportError, or a TE build that does not match this torch/CUDA
        return False
    return True


def attention_impl() -> str:
    """``te`` (Transformer Engine's layer spec: fused attention, TE norms, sequence parallel) where TE is
    installed, else ``local`` (megatron's local spec with torch modules)."""
    return "te" if transformer_engine_available() else "local"


def decoder_spec(model: ModelConfig, config: Any, vp_stage: int | None) -> tuple[Any, bool]:
    """The decoder's spec for ``attention_impl()`` and whether it is the local one: TE's, else megatron's local
    spec with the project's core attention and linears (every layer: dense MLP or MoE; the same checkpoint
    keys either way). Dense and MoE layers as engine/models/moe.py builds them."""
    from engine.models.attention import set_self_attention
    from engine.models.linear import use_in

    local = attention_impl() != "te"
    dense, sparse = moe.layer_specs(model, config, te=not local)
    for spec in (dense, sparse) if sparse is not None else (dense,):
        set_self_attention(spec)  # keys rotated once, when cached (engine/models/attention.py)
        if local:
            _set_core_attention(spec, model.attention_backend)
            use_in(spec)  # F.linear where megatron's linear is a plain product (engine/models/linear.py)
    return moe.block_spec(model, config, dense, sparse, vp_stage), local


def _gpt(model: ModelConfig, config: Any, vocab_size: int, padded: int, vp_stage: int | None) -> Any:
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from engine.models.linear import use_for_output

    spec, local = decoder_spec(model, config, vp_stage)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded,
        max_sequence_length=model.max_position_embeddings or model.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        share_embeddings_and_output_weights=model.tie_embeddings,
        position_embedding_type=model.position_embedding,
        rotary_base=model.rotary_base,
        rope_scaling=model.rotary_scaling,
        rope_scaling_factor=model.rotary_scaling_factor,
        vp_stage=vp_stage,
    )
    if local:  # the local spec: the logits' linear too (no spec reaches it)
        use_for_output(gpt)
    if model.rotary_scaling and model.position_embedding == "rope":
        _llama3_rope(gpt.rotary_pos_emb, model)
    if gpt.post_process:
        mask_padded_vocab(gpt, vocab_size, D.tp_rank(), config.tensor_model_parallel_size)
    return gpt


def _llama3_rope(rotary: Any, model: ModelConfig) -> None:
    """Llama-3 RoPE scaling with all four of the model's settings (megatron's constructor takes the factor only)."""
    dim = rotary.inv_freq.numel() * 2
    base = 1.0 / (
        model.rotary_base
        ** (torch.arange(0, dim, 2, dtype=torch.float32, device=rotary.inv_freq.device) / dim)
    )
    rotary.inv_freq = rotary._apply_scaling(
        base,
        factor=model.rotary_scaling_factor,
        low_freq_factor=model.rotary_low_freq_factor,
        high_freq_factor=model.rotary_high_freq_factor,
        original_max_position_embeddings=model.rotary_original_max_positions,
    )


def _set_core_attention(spec: Any, backend: str) -> None:
    """Put ``model.attention_backend``'s core attention (engine.models.attention) into the local spec."""
    from engine.models.attention import core_attention_class

    spec.submodules.self_attention.submodules.core_attention = core_attention_class(backend)


def build_model(
    model: ModelConfig,
    par: ParallelConfig,
    vocab_size: int,
    *,
    trainable: bool = True,
    peft: Any = None,
    customize: Callable[[Any], Any] | None = None,
) -> list[Any]:
    """This rank's model chunks (len = vpp or 1), in DDP, ready for get_megatron_optimizer.

    ``vocab_size`` is the tokenizer's (model.vocab_size when set); it is padded here, and the padded entries
    are drawn as zeros and masked out of the logits (``mask_padded_vocab``). ``trainable=False``: a
    frozen model (an RL reference): no DDP wrapper and no gradient buffers, gradients off, eval mode.
    ``peft`` (a PeftConfig with method=lora): LoRA adapters on the targeted linears, every other weight frozen
    (engine/models/lora.py). ``customize(gpt)``: adds modules to each GPTModel before its weights are drawn
    and it is wrapped (the reward model's head).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.transformer.module import Float16Module

    config = transformer_config(model, par)
    vocab = model.vocab_size or vocab_size
    padded = padded_vocab_size(vocab, model.make_vocab_size_divisible_by, par.tp)
    chunks = par.vpp if par.vpp and par.vpp > 1 else 1
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=par.precision != "fp32",
        overlap_grad_reduce=par.overlap_grad_reduce,
        use_distributed_optimizer=par.distributed_optimizer,
    )
    wrapped = []
    for i in range(chunks):
        module = _gpt(model, config, vocab, padded, i if chunks > 1 else None)
        if customize is not None:
            module = customize(module)
        expert_tp = (D.etp_rank(), D.etp_size())
        init_by_global_name(
            module, config, D.base_seed(), D.tp_rank(), par.tp, vocab, expert_tp
        )  # any layout
        moe.experts_apart(module)  # one optimizer structure at every EP: checkpoints reshard over EP
        if peft is not None and peft.method == "lora":
            from engine.models.lora import apply_lora

            apply_lora(module, peft, D.base_seed(), D.tp_rank(), par.tp)  # before DDP: it sees only adapters
        module.to(D.device())
        if par.precision != "fp32":
            module = Float16Module(config, module)
        if not trainable:
            module.requires_grad_(False)
            module.eval()
            wrapped.append(module)
            continue
        ddp = DistributedDataParallel(config, ddp_config, module, disable_bucketing=i > 0)
        ddp.broadcast_params()
        wrapped.append(ddp)
    if not trainable:
        return wrapped
    config.finalize_model_grads_func = SyncClock(finalize_model_grads)  # its wait: engine.runtime.stragglers
    config.no_sync_func = [m.no_sync for m in wrapped] if chunks > 1 else wrapped[0].no_sync
    if par.overlap_grad_reduce:
        config.grad_sync_func = (
            [m.start_grad_sync for m in wrapped] if chunks > 1 else wrapped[0].start_grad_sync
        )
    return wrapped


def sync_clock(chunks: list[Any]) -> SyncClock | None:
    """The clock of the trained model's gradient synchronisation (None: a frozen model)."""
    clock = model_config(chunks).finalize_model_grads_func
    return clock if isinstance(clock, SyncClock) else None


def unwrap(chunk: Any) -> Any:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def model_config(chunks: list[Any]) -> Any:
    """The TransformerConfig shared by the chunks."""
    from megatron.core.utils import get_model_config

    return get_model_config(chunks[0])


def num_parameters(chunks: list[Any]) -> int:
    """Parameters held by this rank."""
    return sum(p.numel() for c in chunks for p in c.parameters())
