"""LoRA on routed experts as base plus low-rank path (anyfit.model.expert_lora) against PEFT's path (W + BA formed in
each forward): the same losses and gradients on every family, PEFT's checkpoint and merge, the one-line fallback."""

from __future__ import annotations

import math

import pytest
import torch
from moe_families import CURRENT_MOE, MOE, moe_model
from peft import PeftModel

from anyfit.config import LoraConfig
from anyfit.model.expert_lora import SplitProjection, check_split, grouped, grouped_outer, split_wrapper
from anyfit.model.loading import apply_lora
from anyfit.model.moe import peft_takes_parameters

if not peft_takes_parameters():
    pytest.skip("PEFT before 0.17 adapts no fused expert tensor (no target_parameters)", allow_module_level=True)
from peft.tuners.lora import ParamWrapper  # noqa: E402 - PEFT 0.17 and later

# The two paths sum the same products in another order: x·(W + sBA) against x·W + s(xA)B, over reductions of at most
# 64 terms (hidden 32, intermediate 32/64, rank 4), through 2 layers. fp32 round-off of one such sum is about
# eps·sqrt(64) of its size; a few dozen of them chained stay under 2^7·eps relative to the outputs' norms.
ROUND_OFF = 2**7 * torch.finfo(torch.float32).eps


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def _adapted(family: str, split: bool):
    model = apply_lora(moe_model(family), LoraConfig(enabled=True, r=4, dropout=0.0, split_experts=split))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero: a non-zero adapter to compare
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def _loss_and_grads(model, ids):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@CURRENT_MOE
@pytest.mark.parametrize("family", list(MOE))
def test_split_path_has_peft_paths_loss_and_gradients(family):
    ids = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    split, merged = _adapted(family, True), _adapted(family, False)
    wrappers = [m for m in split.modules() if isinstance(m, ParamWrapper) and m.num_experts > 1]  # not 2-D weights
    assert not any(isinstance(m, split_wrapper()) for m in merged.modules())
    if family == "llama4":  # its experts are not transformers' experts-interface class: PEFT's path, one line
        assert not any(isinstance(m, split_wrapper()) for m in wrappers)
    else:
        assert wrappers and all(isinstance(m, split_wrapper()) for m in wrappers)
    (loss, grads), (want_loss, want_grads) = _loss_and_grads(split, ids), _loss_and_grads(merged, ids)
    assert grads.keys() == want_grads.keys()
    assert abs(loss - want_loss) <= ROUND_OFF * want_loss
    for name, grad in grads.items():
        assert _rel(grad, want_grads[name]) <= ROUND_OFF, name


@CURRENT_MOE
def test_split_path_never_folds_the_adapter_into_the_experts():
    """No parametrization (PEFT's W + BA) is registered during the forward, and the tensors kept for the backward
    hold no expert-sized tensor beyond the weights themselves."""
    model = _adapted("gpt_oss", True)
    experts = [m for m in model.modules() if type(m).__name__ == "GptOssExperts"]
    seen = []
    hooks = [e.register_forward_pre_hook(lambda m, a: seen.append(m)) for e in experts]
    model(input_ids=torch.randint(3, 512, (1, 8))).logits.sum().backward()
    assert not seen  # the experts' own forward (where PEFT's parametrization is read) never ran
    assert not any(torch.nn.utils.parametrize.is_parametrized(e) for e in experts)
    for h in hooks:
        h.remove()


@CURRENT_MOE
@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_checkpoint_is_peft_and_merges_to_the_same_weights(family, tmp_path):
    """Saved from the split path, the adapter loads into stock PEFT; its merged weights are those of the split
    model's own merge, and the loaded model's outputs are the split model's up to round-off."""
    model = _adapted(family, True).eval()
    ids = torch.randint(3, 512, (2, 8))
    want = model(input_ids=ids).logits
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(moe_model(family), tmp_path).eval()
    assert not any(isinstance(m, split_wrapper()) for m in loaded.modules())
    assert _rel(loaded(input_ids=ids).logits, want) <= ROUND_OFF
    merged, stock = model.merge_and_unload().state_dict(), loaded.merge_and_unload().state_dict()
    assert merged.keys() == stock.keys()
    assert all(torch.equal(merged[k], stock[k]) for k in merged)


@CURRENT_MOE
def test_resumed_adapter_state_gives_the_same_step():
    """The adapter's state dict (what a checkpoint holds) goes back into a fresh split model unchanged."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    ids = torch.randint(3, 512, (2, 8))
    model = _adapted("qwen3_moe", True)
    state = {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}
    fresh = apply_lora(moe_model("qwen3_moe"), LoraConfig(enabled=True, r=4, dropout=0.0))
    result = set_peft_model_state_dict(fresh, state)
    assert not result.unexpected_keys
    assert torch.equal(fresh(input_ids=ids).logits, model(input_ids=ids).logits)


def test_a_class_whose_forward_computes_otherwise_keeps_peft_path():
    """The check compares with the class's own forward: an experts class that scales its output differently fails
    it (the split path would not reproduce it), and so does one without transformers' experts interface."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from moe_families import moe_config

    class Scaled(Qwen3MoeExperts):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return 1.5 * super().forward(hidden_states, top_k_index, top_k_weights)

    torch.manual_seed(0)
    experts = Scaled(moe_config("qwen3_moe"))
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    assert "base output differs" in check_split(experts, ["gate_up_proj", "down_proj"], 4)
    plain = Qwen3MoeExperts(moe_config("qwen3_moe"))
    plain.load_state_dict(experts.state_dict())
    assert check_split(plain, ["gate_up_proj", "down_proj"], 4) is None
    assert "experts interface" in check_split(torch.nn.Linear(2, 2), ["weight"], 4)


@pytest.mark.parametrize("rank", [3, 8])
def test_grouped_product_with_and_without_torch_kernel(rank):
    """Rank 3 fp32 rows are 12 bytes (torch's grouped kernel wants 16): the loop over experts; rank 8: the kernel.
    Both equal one matmul per expert's rows, empty experts included."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(10, rank, generator=gen), torch.randn(4, rank, 8, generator=gen)
    offsets = torch.tensor([3, 3, 7, 10], dtype=torch.int32)
    want = torch.cat([x[:3] @ w[0], x[3:7] @ w[2], x[7:] @ w[3]])
    assert _rel(grouped(x, w, offsets), want) <= 8 * torch.finfo(torch.float32).eps * math.sqrt(rank)


@pytest.mark.parametrize("loop", [True, False], ids=["per-expert", "grouped"])
@pytest.mark.parametrize("rebuilt", ["gathered", "activated"])
def test_split_projection_gradients_are_autograds(rebuilt, loop):
    """float64 (torch's grouped kernel takes no float64: the grouped form's per-expert fallback): the hand-written
    backward of both forms (one expert's rows at a time, as on the CPU; grouped calls, as on CUDA) against autograd's
    numerical Jacobian, x rebuilt from the token rows or from the pre-activation, an expert without rows included,
    the weight and a factor as transposed views; the gradient reaches x, W, A and B, never the source x is rebuilt
    from."""
    gen = torch.Generator().manual_seed(0)
    offsets = torch.tensor([3, 3, 7, 10], dtype=torch.int32)
    weight = torch.randn(4, 5, 6, generator=gen, dtype=torch.float64).transpose(-2, -1).requires_grad_()
    first = torch.randn(4, 6, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    second = torch.randn(4, 5, 2, generator=gen, dtype=torch.float64).transpose(-2, -1).requires_grad_()
    if rebuilt == "gathered":
        source, index, act = torch.randn(5, 6, generator=gen, dtype=torch.float64), torch.arange(10) % 5, None
    else:
        source, index, act = torch.randn(10, 6, generator=gen, dtype=torch.float64), None, torch.nn.functional.silu
    x = (source[index] if act is None else act(source)).requires_grad_()

    def path(x, weight, first, second):
        return SplitProjection.apply(x, weight, source, index, first, second, offsets, 0.5, act, loop)

    assert torch.autograd.gradcheck(path, (x, weight, first, second))
    want = torch.cat([x[a:b] @ weight[e] + 0.5 * x[a:b] @ first[e] @ second[e]
                      for e, a, b in ((0, 0, 3), (2, 3, 7), (3, 7, 10))])
    assert torch.allclose(path(x, weight, first, second), want)


def test_split_projection_forms_agree_in_fp32():
    """fp32 at widths where torch's grouped kernel runs (16-byte rows): the per-expert form (in-place sums) and the
    grouped form give the same output and gradients to the round-off of their reductions (at most 64 terms, plus
    the r-wide path's 4 and the sum of the two)."""
    gen = torch.Generator().manual_seed(0)
    offsets = torch.tensor([5, 5, 20, 32], dtype=torch.int32)
    weight = torch.randn(4, 64, 32, generator=gen).transpose(-2, -1)
    first = torch.randn(4, 32, 4, generator=gen).requires_grad_()
    second = torch.randn(4, 64, 4, generator=gen).transpose(-2, -1).requires_grad_()
    source, index = torch.randn(16, 32, generator=gen), torch.arange(32) % 16
    grad = torch.randn(32, 64, generator=gen)
    results = []
    for loop in (True, False):
        x = source[index].requires_grad_()
        y = SplitProjection.apply(x, weight, source, index, first, second, offsets, 2.0, None, loop)
        results.append((y, *torch.autograd.grad(y, (x, first, second), grad)))
    for got, want in zip(*results):
        assert _rel(got, want) <= 8 * torch.finfo(torch.float32).eps * math.sqrt(64)


def test_grouped_factor_gradient_with_and_without_torch_kernel():
    """aᵀ·b per expert's rows (zeros for an expert without rows): torch's 2-D grouped kernel (fp32, 16-byte rows)
    and the loop (float64) give the per-expert products."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(10, 8, generator=gen), torch.randn(10, 4, generator=gen)
    offsets = torch.tensor([3, 3, 7, 10], dtype=torch.int32)
    want = torch.stack([a[:3].t() @ b[:3], torch.zeros(8, 4), a[3:7].t() @ b[3:7], a[7:].t() @ b[7:]])
    for dtype in (torch.float32, torch.float64):
        got = grouped_outer(a.to(dtype), b.to(dtype), offsets).float()
        assert _rel(got, want) <= 8 * torch.finfo(torch.float32).eps * math.sqrt(10)


@CURRENT_MOE
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_split_path_under_gradient_checkpointing_has_peft_paths_gradients(family):
    """Every layer checkpointed (non-reentrant, as anyfit enables it): the recompute runs SplitProjection's forward
    again and its backward rebuilds x from the recomputed tensors; losses and gradients stay PEFT's path's."""
    ids = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    split, merged = _adapted(family, True), _adapted(family, False)
    split.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    split.train()
    (loss, grads), (want_loss, want_grads) = _loss_and_grads(split, ids), _loss_and_grads(merged, ids)
    assert abs(loss - want_loss) <= ROUND_OFF * want_loss
    for name, grad in grads.items():
        assert _rel(grad, want_grads[name]) <= ROUND_OFF, name
