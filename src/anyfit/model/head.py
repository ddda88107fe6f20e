"""The fused head (``train.fused_loss``): the output layer hands the loss its *inputs* (the final hidden states
of the trained positions) instead of logits, and the loss computes logits, log-sum-exp and their gradients one
chunk of rows at a time (``anyfit.training.loss.FusedHeadCrossEntropy``), so the ``tokens x vocabulary`` logits
never exist: at 32k trained tokens and Qwen's 152k vocabulary they are 9 GiB in bf16, with their gradient 18.

The head stays the model's own module, wrapped (``FusedHead``) through transformers' ``set_output_embeddings``,
with the same weight (tied or not) under the same name, so checkpoints, exports and generation see the model as it
was; only inside ``FusedHead.handing_inputs()`` does it pass its input through. That hand-off is right only where
the model's forward does nothing to the logits after the head (no soft-capping, no scale): the families below,
read in their transformers modeling code; others are refused in one line.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from anyfit.config import ConfigError

# model_type -> the CausalLM forward ends with ``logits = self.lm_head(hidden_states[:, slice_indices, :])`` and
# uses them as they are (Gemma soft-caps, Cohere and Granite scale: not here).
PLAIN_HEAD = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "phi3", "smollm3", "olmo2")


class FusedHead(nn.Module):
    """``head`` (a linear layer), which inside ``handing_inputs()`` returns its input unchanged."""

    def __init__(self, head: nn.Module):
        super().__init__()
        if not isinstance(head, nn.Linear):
            raise ConfigError(f"train.fused_loss: the output layer is a {type(head).__name__}, not a linear layer; "
                              "set train.fused_loss=false.")
        self.weight = head.weight
        self.bias = head.bias
        self.in_features, self.out_features = head.in_features, head.out_features
        self.pass_through = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pass_through:
            return x
        return nn.functional.linear(x, self.weight, self.bias)

    @contextlib.contextmanager
    def handing_inputs(self):
        self.pass_through = True
        try:
            yield self
        finally:
            self.pass_through = False


def fuse_head(model: nn.Module) -> FusedHead:
    """Wrap ``model``'s output layer (before PEFT or sharding wrap the model)."""
    model_type = model.config.get_text_config().model_type
    if model_type not in PLAIN_HEAD:
        raise ConfigError(f"train.fused_loss: {model_type} models change the logits after the output layer (or are "
                          f"not read here yet); it runs for {', '.join(PLAIN_HEAD)}. Set train.fused_loss=false.")
    head = FusedHead(model.get_output_embeddings())
    model.set_output_embeddings(head)
    return head


def fused_head_of(model: nn.Module) -> FusedHead | None:
    """The fused head inside ``model`` (under DDP, FSDP2 or PEFT wrappers), or None."""
    return next((m for m in model.modules() if isinstance(m, FusedHead)), None)
