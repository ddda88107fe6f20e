"""The loss: chunked cross-entropy equals torch's, selected logits equal full logits, packing respects
example boundaries."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from anyfit.data.batching import IGNORE_INDEX, collate
from anyfit.model.attention import register
from anyfit.training.loss import cross_entropy_sum, token_loss_sum


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_chunked_cross_entropy_matches_torch(dtype, chunk):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(7, 50, generator=g) * 4).to(dtype)
    targets = torch.randint(0, 50, (7,), generator=g)
    targets[2] = IGNORE_INDEX
    weight = torch.randn(7, 50, generator=g)  # a downstream use, so the incoming gradient is not all ones

    def run(chunk_tokens):
        x = logits.clone().requires_grad_(True)
        loss = cross_entropy_sum(x * 1.0, targets, chunk_tokens)
        (loss * 3.0 + (x.float() * weight).sum() * 0).backward()
        return loss.detach(), x.grad

    ref_loss, ref_grad = run(0)
    loss, grad = run(chunk)
    assert loss.dtype == torch.float32
    assert torch.allclose(loss, ref_loss, rtol=1e-5), (loss, ref_loss)
    assert grad.dtype == dtype
    assert torch.allclose(grad.float(), ref_grad.float(), atol=1e-2 if dtype == torch.bfloat16 else 1e-6)
    assert grad[2].abs().max() == 0  # an ignored row gets no gradient


def _examples(vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    out = []
    for length, prompt in [(9, 4), (14, 5), (6, 2)]:
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]})
    return out


def _reference(model, examples) -> torch.Tensor:
    """HF's own convention, one example at a time: full logits, shift by one, sum over labelled tokens."""
    total = torch.zeros(())
    for ex in examples:
        logits = model(input_ids=torch.tensor([ex["input_ids"]])).logits[0, :-1]
        total += F.cross_entropy(logits, torch.tensor(ex["labels"][1:]), ignore_index=IGNORE_INDEX, reduction="sum")
    return total


@pytest.mark.parametrize("packed, attn", [(False, "sdpa"), (True, "sdpa"), (True, "anyfit_varlen"),
                                         (False, "anyfit_varlen")])
def test_token_loss_matches_one_example_at_a_time(tiny_qwen2_dir, packed, attn):
    """Packed rows with transformers' block mask (sdpa) or anyfit's per-example attention equal separate runs."""
    register()
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32, attn_implementation=attn).eval()
    examples = _examples(model.config.vocab_size)
    with torch.no_grad():
        ref = _reference(model, examples)
        got = token_loss_sum(model, collate(examples, pad_id=0, packed=packed))
    assert torch.allclose(got, ref, rtol=1e-5), (got, ref)


def test_packing_without_boundaries_would_leak_across_examples(tiny_qwen2_dir):
    """Guard that the test above can fail: one causal row over the concatenation gives another loss."""
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()
    examples = _examples(model.config.vocab_size)
    batch = collate(examples, pad_id=0, packed=True)
    for key in ("position_ids", "packed_lengths", "cu_seq_lens"):
        del batch[key]
    with torch.no_grad():
        ref = _reference(model, examples)
        leaky = token_loss_sum(model, batch)
    assert not torch.allclose(leaky, ref, rtol=1e-3), (leaky, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_varlen_flash_attention_matches_per_example_sdpa():
    """On CUDA, anyfit_varlen runs PyTorch's varlen FlashAttention: causal, per example, GQA."""
    from anyfit.model.attention import packed_attention

    lengths = (5, 17, 9)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 8, sum(lengths), 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, 2, sum(lengths), 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    cu = torch.tensor([0, 5, 22, 31], device="cuda", dtype=torch.int32)
    module = torch.nn.Module().eval()
    got, _ = packed_attention(module, q, k, v, None, packed_lengths=lengths, cu_seq_lens=cu)
    ref = torch.cat([F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True,
                                                    enable_gqa=True) for s, e in [(0, 5), (5, 22), (22, 31)]], dim=2)
    assert torch.allclose(got.float(), ref.transpose(1, 2).float(), atol=2e-2)


@pytest.mark.parametrize("chunk", [0, 3, 1000])
def test_per_source_sums_are_each_sources_loss_and_leave_the_gradient_as_it_was(chunk):
    """data.mix: the loss of each source's rows, by torch's cross-entropy on those rows alone; their total is the
    loss, and the gradient is the one of the plain summed loss, bit for bit (each row scaled by the same number)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 40, generator=g) * 3
    targets = torch.randint(0, 40, (9,), generator=g)
    targets[4] = IGNORE_INDEX
    groups = torch.tensor([0, 2, 2, 0, 1, 0, 2, 2, 0])  # source 1's only row is ignored: its sum is 0

    def run(*by_source):
        x = logits.clone().requires_grad_(True)
        loss = cross_entropy_sum(x, targets, chunk, *by_source)
        (loss.sum() * 0.25).backward()
        return loss.detach(), x.grad

    total, plain_grad = run()
    sums, grad = run(groups, 3)
    assert sums.shape == (3,) and sums[1] == 0
    for s in range(3):
        rows = groups == s
        expected = F.cross_entropy(logits[rows], targets[rows], ignore_index=IGNORE_INDEX, reduction="sum")
        assert sums[s] == pytest.approx(expected.item(), rel=1e-6)
    assert sums.sum() == pytest.approx(total.item(), rel=1e-6)
    assert torch.equal(grad, plain_grad)


def test_the_fused_head_sums_per_source_too(tiny_llama_dir):
    """train.fused_loss: the same per-source sums as the plain head's, the gradient unchanged by the split."""
    from anyfit.model.head import fuse_head

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    examples = [{**ex, "source": s, "sources": 2} for ex, s in zip(_examples(model.config.vocab_size), (1, 0, 1))]
    mixed = collate(examples, pad_id=0)
    plain = collate([{k: e[k] for k in ("input_ids", "labels")} for e in examples], pad_id=0)
    reference = token_loss_sum(model, mixed, chunk_tokens=4).detach()
    fuse_head(model)
    sums = token_loss_sum(model, mixed, chunk_tokens=4)
    sums.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    token_loss_sum(model, plain, chunk_tokens=4).backward()
    assert sums.shape == (2,)
    torch.testing.assert_close(sums.detach(), reference, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))


def test_the_anchor_to_the_base_carries_its_gradient_once_over_the_sources(tiny_llama_dir):
    """train.base_kl_weight with data.mix: the anchored loss is one sum per source, and the anchor's gradient is the
    one the single summed loss has (not once per source)."""
    from peft import LoraConfig, get_peft_model

    from anyfit.training.forgetting import anchored_loss

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    examples = [{**ex, "source": s, "sources": 3} for ex, s in zip(_examples(model.config.vocab_size), (2, 0, 2))]
    mixed = collate(examples, pad_id=0)
    plain = collate([{k: e[k] for k in ("input_ids", "labels")} for e in examples], pad_id=0)
    loss = anchored_loss(model, weight=5.0, chunk_tokens=4)
    grads = []
    for batch in (mixed, plain):
        model.zero_grad()
        value = loss(model, batch)
        value.sum().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
        assert value.shape == ((3,) if batch is mixed else ())
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(*grads))


def test_image_inputs_reach_the_model_in_its_dtype():
    """A processor's floating-point tensors go to the model in the model's dtype, as transformers' pipeline hands
    them (Llama-4's processor gives bf16 pixels, which an fp32 tower refuses); ids, grids and masks stay as they are.
    bf16 to fp32 is exact."""
    from anyfit.training.loss import model_inputs

    pixels = torch.randn(2, 3, 4, 4).to(torch.bfloat16)
    batch = {"input_ids": torch.tensor([[1, 2]]), "attention_mask": torch.ones(1, 2, dtype=torch.long),
             "image_inputs": {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, 2, 2]]), "sizes": [(4, 4)]}}
    inputs = model_inputs(batch, torch.float32)
    assert inputs["pixel_values"].dtype == torch.float32 and torch.equal(inputs["pixel_values"].bfloat16(), pixels)
    assert inputs["image_grid_thw"].dtype == torch.long and inputs["sizes"] == [(4, 4)]
    assert inputs["input_ids"] is batch["input_ids"]
    assert model_inputs(batch)["pixel_values"] is pixels  # no dtype: as the processor gave them
