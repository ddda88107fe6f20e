"""The accumulation window's forward and backward, scaled so the update is the mean over every trainable token
of the window on all processes, whatever the split into micro-batches and processes; the backend
(``anyfit.backends``) reduces the gradients and takes the update."""

from __future__ import annotations

import torch
from torch.profiler import record_function

from anyfit.backends import Backend
from anyfit.model.moe import router_balance_of
from anyfit.training.loss import token_loss_sum


def backward_window(backend: Backend, accelerator, model, micro_batches: list[dict[str, torch.Tensor]],
                    window_tokens: int, loss_fn=token_loss_sum) -> torch.Tensor:
    """Forward and backward over one accumulation window; returns this process's summed token loss (detached): one
    number, or one per source where the batches name their sources (``data.mix``; ``training.loss``).

    Each micro-batch's summed loss is divided by the trainable tokens of the *global* window and
    multiplied by the process count (DDP averages gradients over processes), so the accumulated gradient
    is d(mean token loss over the window) whatever the split into micro-batches and processes (FSDP's
    reduce-scatter and ZeRO-3's average over processes as DDP's all-reduce does). Gradients are reduced on the
    window's last micro-batch, or after every one where the backend does (``Backend.sync``): the sum is the same
    up to fp32 round-off (the mean over processes is linear).

    A mixture of experts with a load-balancing loss (``anyfit.model.moe.RouterBalance``) adds transformers' own
    ``aux_loss`` of each micro-batch times ``coef / micro-batches``: the update then follows the mean token loss
    plus ``coef`` x the mean of the micro-batches' aux losses over the window (processes averaged as above). That
    term is per micro-batch by nature (the balance of the tokens routed together, as in HF Trainer), so unlike
    the token loss it changes with the split into micro-batches; with one micro-batch the objective is exactly
    transformers' ``loss + router_aux_loss_coef x aux_loss``.
    """
    scale = accelerator.num_processes / max(1, window_tokens)
    total = None
    router = router_balance_of(model)
    for i, batch in enumerate(micro_batches):
        with backend.sync(accelerator, model, last=i == len(micro_batches) - 1):
            with record_function("anyfit.forward"):  # the phases anyfit.profiling reads from a trace
                loss_sum = loss_fn(model, batch)
                objective = loss_sum.sum() * scale
                if router is not None:
                    objective = objective + router.weighted(len(micro_batches))
            with record_function("anyfit.backward"):
                backend.backward(accelerator, model, objective)
        total = loss_sum.detach() if total is None else total + loss_sum.detach()
    return total
