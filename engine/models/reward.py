"""The reward model: the GPT plus a scalar head (its frozen use as an RL reward: engine.rl.frozen_reward).

Head: ``reward_head`` = ``Linear(hidden_size, 1)`` on the last pipeline stage's GPTModel, applied to the final
hidden state (after the final norm: the input of the output layer) at each sequence's last token. Without
sequence parallel that hidden state is replicated over the tensor-parallel ranks and the head is a plain
(replicated) parameter drawn by its global name, so TP=2 gives the same scores as TP=1. Bradley–Terry:
``loss = -log sigmoid(r(chosen) - r(rejected))`` (``engine.train.steps.RewardStep``).
"""

from __future__ import annotations

from typing import Any

import torch

HEAD = "reward_head"
"""The head's attribute on the GPTModel (its parameters: ``reward_head.weight``, ``reward_head.bias``)."""


def attach_head(gpt: Any) -> Any:
    """Give a GPTModel chunk the scalar head (last pipeline stage only) and keep the output layer's input.

    Call before the weights are drawn (``init_by_global_name`` then draws the head by its global name) and
    before the DDP wrapper (so the head is trained, reduced and checkpointed like every parameter)."""
    if not getattr(gpt, "post_process", False) or hasattr(gpt, HEAD):
        return gpt
    cfg = gpt.config
    head = torch.nn.Linear(cfg.hidden_size, 1, bias=True, dtype=cfg.params_dtype)
    torch.nn.init.zeros_(head.bias)
    setattr(gpt, HEAD, head)

    def keep_hidden(_module: Any, args: tuple[Any, ...]) -> None:
        gpt._reward_hidden = args[0]  # [s, b, h]

    gpt.output_layer.register_forward_pre_hook(keep_hidden)
    return gpt


def last_index(loss_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last position whose label is trained ([b, s] mask -> [b]): the hidden state there has read
    the whole prompt and response (the label there is the closing eod). 0 for a row without one."""
    s = loss_mask.shape[-1]
    pos = torch.arange(s, device=loss_mask.device).expand_as(loss_mask)
    return torch.where(loss_mask > 0, pos, torch.zeros_like(pos)).amax(-1)


def scores(gpt: Any, index: torch.Tensor) -> torch.Tensor:
    """Scalar rewards [b] (fp32) from the hidden states of the last forward pass, read at ``index`` [b]."""
    hidden = gpt._reward_hidden  # [s, b, h]
    rows = hidden[index, torch.arange(hidden.shape[1], device=hidden.device)]  # [b, h]
    head = getattr(gpt, HEAD)
    return head(rows.to(head.weight.dtype)).squeeze(-1).float()


def token_values(gpt: Any) -> torch.Tensor:
    """The head at every position of the last forward pass: [b, s] (fp32). PPO's critic (engine.rl.ppo) is
    a model of this kind: the value of each prefix is the head on its last hidden state."""
    hidden = gpt._reward_hidden  # [s, b, h]
    head = getattr(gpt, HEAD)
    return head(hidden.to(head.weight.dtype)).squeeze(-1).float().transpose(0, 1)


def bradley_terry(rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed loss, correct-pair count and summed margin from rewards [b, 2] (chosen, rejected)."""
    margin = rewards[:, 0] - rewards[:, 1]
    loss = -torch.nn.functional.logsigmoid(margin).sum()
    return loss, (margin > 0).float().sum(), margin.sum()


def build(model_cfg: Any, par: Any, vocab_size: int, trainable: bool = True) -> list[Any]:
    """This rank's reward-model chunks (the GPT with the head): DDP-wrapped like any training model, or frozen."""
    from engine.models.gpt import build_model

    return build_model(model_cfg, par, vocab_size, trainable=trainable, customize=attach_head)
