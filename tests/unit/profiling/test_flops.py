"""The MFU numerator: ``ModelFlops`` against PyTorch's own FLOP counter on a real forward+backward."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from moe_families import CURRENT_MOE
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from anyfit.data.batching import collate
from anyfit.model.shape import shape_from_config
from anyfit.profiling.flops import ModelFlops, device_peak
from anyfit.training.loss import token_loss_sum


def _counted(model, examples) -> float:
    """Each example a micro-batch of its own: attention over that example only, as ModelFlops counts it (a packed
    row under eager attention computes the whole row's square and masks the other examples out)."""
    total = 0
    for example in examples:
        with FlopCounterMode(display=False) as counter:
            token_loss_sum(model, collate([example], pad_id=0, packed=True)).backward()
        total += counter.get_total_flops()
    return total


def _examples(lengths, prompt=3):
    return [{"input_ids": list(range(5, 5 + n)), "labels": [-100] * prompt + list(range(5 + prompt, 5 + n))}
            for n in lengths]


@pytest.mark.parametrize("lora", [False, True])
def test_model_flops_match_torch_flop_counter(tiny_llama_dir, lora):
    """6N (full) or 4N + 6 N_lora (LoRA) per token, the head on trained tokens only, 12 L q len^2 attention:
    within 1% of what torch.utils.flop_counter counts for the same examples. On the tiny model with the 1,000-token
    vocabulary the head is a quarter of the FLOPs, so the body and the attention are checked too."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="eager")
    shape = shape_from_config(model.config)
    lora_params = 0
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                       "gate_proj", "up_proj", "down_proj"]))
        lora_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    examples = _examples([40, 25, 12])
    flops = ModelFlops.of(shape, lora_params)
    expected = flops.of_examples([40, 25, 12], [40 - 3, 25 - 3, 12 - 3])
    counted = _counted(model, examples)
    if lora:
        # Under LoRA nothing before layer 0 trains, so autograd computes no gradient for that layer's input: its
        # q, k, v projections and their adapters' A skip 2 FLOPs per weight and token that 4N + 6 N_lora counts.
        # (Left in ModelFlops: 1/(6 x layers) of the body at most, 0.3% of a 24-layer model.)
        attention = model.base_model.model.model.layers[0].self_attn
        first = sum(m.base_layer.weight.numel() + m.lora_A["default"].weight.numel()
                    for m in (attention.q_proj, attention.k_proj, attention.v_proj))
        expected -= 2 * first * (40 + 25 + 12)
    assert expected == pytest.approx(counted, rel=0.01)
    # LoRA counts fewer FLOPs per token than full fine-tuning: no weight gradients for the frozen base.
    assert ModelFlops.of(shape, 1000).body_per_token < ModelFlops.of(shape).body_per_token


def test_padding_and_prompt_tokens_do_not_count():
    shape = dataclasses.make_dataclass("S", ["active_body_params", "vocab_size", "hidden_size", "num_layers",
                                             "q_dim"])(1000, 50, 8, 2, 16)
    f = ModelFlops.of(shape)
    assert f.of_examples([10], [10]) - f.of_examples([10], [4]) == pytest.approx(6 * 50 * 8 * 6)
    assert f.of_examples([10, 10], [0, 0]) == pytest.approx(2 * f.of_examples([10], [0]))


def test_cpu_peak_is_measured():
    peak = device_peak("cpu", "fp32")
    assert peak.tflops > 0 and "measured" in peak.source


@CURRENT_MOE
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "glm4_moe", "ernie4_5_moe"])
def test_moe_flops_count_the_active_experts(family):
    """A mixture of experts: 6 FLOPs per token per active weight (top_k of the routed experts, the shared experts, the
    routers), exactly what torch's counter counts over transformers' eager experts, one example per micro-batch so
    that attention is per example as in ModelFlops. LoRA on the experts: PEFT folds the adapter into the fused tensor,
    so the token's experts cost their weight gradient (the fold itself is per micro-batch: it cancels between two
    lengths)."""
    from moe_families import moe_config, moe_model

    from anyfit.config import LoraConfig
    from anyfit.model.loading import apply_lora, count_parameters
    from anyfit.model.moe import adapter_in_experts

    shape = shape_from_config(moe_config(family))
    model = moe_model(family, attn_implementation="eager", experts_implementation="eager")
    lengths = [40, 25, 12]
    counted = sum(_counted(model, _examples([n])) for n in lengths)
    assert ModelFlops.of(shape).of_examples(lengths, [n - 3 for n in lengths]) == counted

    per_length = {}
    for experts in (True, False):
        model = apply_lora(moe_model(family, attn_implementation="eager", experts_implementation="eager"),
                           LoraConfig(enabled=True, r=4, dropout=0.0, experts=experts, split_experts=False))
        flops = ModelFlops.of(shape, count_parameters(model)[0], adapter_in_experts(model))
        modelled = flops.of_examples([40], [37]) - flops.of_examples([12], [9])
        per_length[experts] = (_counted(model, _examples([40])) - _counted(model, _examples([12])), modelled)
    (counted_exp, modelled_exp), (counted_no, modelled_no) = per_length[True], per_length[False]
    assert modelled_exp - modelled_no == counted_exp - counted_no > 0


class _MatmulFlops(TorchDispatchMode):
    """FLOPs of the matrix products, torch's grouped ones included (torch's FlopCounterMode has no CPU formula for
    them; the split path runs them on CUDA, and one matmul per expert on the CPU): 2 per multiply-add; of a grouped
    product rows x columns of the 2-D x 3-D form, the group dimension summed over in the 2-D x 2-D (weight gradient)
    form."""

    PLAIN = (torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.default, torch.ops.aten.addmm_.default)

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._grouped_mm.default:
            a, b = args[0], args[1]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[-1]
        elif func in self.PLAIN:
            a, b = args[-2:] if "addmm" in func.__name__ else args[:2]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        elif func is torch.ops.aten.bmm.default:
            a, b = args[0], args[1]
            self.flops += 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
        return func(*args, **(kwargs or {}))


@CURRENT_MOE
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_split_expert_lora_flops_are_what_its_products_count(family):
    """LoRA on the experts as base plus low-rank path: per token, its active experts' adapters cost 6 per parameter
    plus the backward's recompute of x·A (ModelShape.split_lora_flops), what the matmuls of the run with
    expert adapters count beyond the frozen-expert run's (between two lengths; every token has top_k experts)."""
    from moe_families import moe_config, moe_model

    from anyfit.config import LoraConfig
    from anyfit.model.expert_lora import splits_in
    from anyfit.model.loading import apply_lora, count_parameters
    from anyfit.model.moe import adapter_in_experts

    shape = shape_from_config(moe_config(family))
    counted, modelled = {}, {}
    for experts in (True, False):
        model = apply_lora(moe_model(family), LoraConfig(enabled=True, r=4, dropout=0.0, experts=experts))
        assert splits_in(model) == experts
        flops = ModelFlops.of(shape, count_parameters(model)[0], adapter_in_experts(model), splits_in(model))
        modelled[experts] = flops.of_examples([40], [37]) - flops.of_examples([12], [9])
        per_length = []
        for n in (40, 12):
            with _MatmulFlops() as mode:
                token_loss_sum(model, collate(_examples([n]), pad_id=0, packed=True)).backward()
            per_length.append(mode.flops)
        counted[experts] = per_length[0] - per_length[1]
    assert modelled[True] - modelled[False] == counted[True] - counted[False] > 0
