"""The same 8 variable-length sequences split as 1x8, 8x1 and 2x4, padded or packed, give the same gradient."""

import pytest
import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM

from anyfit.data.batching import IGNORE_INDEX, collate
from anyfit.model.attention import register
from anyfit.backends.replicated import Replicated
from anyfit.training.step import backward_window


def _sequences(vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for length in (5, 17, 9, 30, 3, 22, 12, 7):  # deliberately uneven: per-micro-batch means would differ
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        prompt = length // 3
        out.append({"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]})
    return out


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest deviation relative to the tensor's scale."""
    return ((got - ref).abs().max() / ref.abs().max().clamp(min=1e-12)).item()


def _grads(model_dir, seqs, micro: int, packed: bool = False, attn: str = "sdpa") -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    register()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)
    acc = Accelerator(cpu=True)
    model = acc.prepare(model)
    window_tokens = sum(sum(1 for t in s["labels"][1:] if t != IGNORE_INDEX) for s in seqs)
    batches = [collate(seqs[i:i + micro], pad_id=0, packed=packed) for i in range(0, len(seqs), micro)]
    backward_window(Replicated("test"), acc, model, batches, window_tokens)
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_same_gradient_for_every_split(arch, tiny_llama_dir, tiny_qwen2_dir):
    model_dir = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    seqs = _sequences(vocab=1000)
    ref = _grads(model_dir, seqs, micro=8)  # 1 padded micro-batch of 8
    # 8 x 1, 4 x 2, 2 x 4 padded; then packed (one row per micro-batch, no padding) at every split
    # (packed with transformers' block mask, and with anyfit's per-example attention)
    for micro, packed, attn in [(1, False, "sdpa"), (2, False, "sdpa"), (4, False, "sdpa"), (2, True, "sdpa"),
                                (8, True, "sdpa"), (1, True, "anyfit_varlen"), (4, True, "anyfit_varlen"),
                                (8, True, "anyfit_varlen")]:
        got = _grads(model_dir, seqs, micro=micro, packed=packed, attn=attn)
        assert got.keys() == ref.keys()
        for name in ref:
            # fp32 round-off only: the unpadded 8x1 split runs another attention kernel than padded batches.
            assert _relative_error(got[name], ref[name]) < 5e-5, f"{name} differs at micro={micro}, packed={packed}, {attn}"


def test_mean_per_micro_batch_would_differ(tiny_llama_dir):
    """Guard that the test above can fail: naive per-micro-batch averaging gives another gradient."""
    seqs = _sequences(vocab=1000)
    ref = _grads(tiny_llama_dir, seqs, micro=8)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    from anyfit.training.loss import token_loss_sum
    for i in range(0, 8, 2):
        batch = collate(seqs[i:i + 2], pad_id=0)
        n = batch["keep_targets"].numel()
        (token_loss_sum(model, batch) / n / 4).backward()
    worst = max(_relative_error(p.grad, ref[n]) for n, p in model.named_parameters() if p.grad is not None)
    assert worst > 1e-2, worst  # 200x the tolerance above
