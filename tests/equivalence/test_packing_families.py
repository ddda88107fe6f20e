"""Packing trains the function the model computes one example at a time, for every family in ``tests/families.py``.

For each family (tiny random-init models from transformers' own configs, windows of 8 tokens, examples of 3-30):
- the start-up self-test (``training.packing_check.choose_packing``) decides, and with its decision a packed window
  gives the same summed loss and the same gradients as padded batches through transformers' own attention (fp32:
  the two sum the same token losses in another order and through other matmul shapes, a few ulps each, grown through
  two layers: 1e-5 relative leaves two orders of margin and is far below what a dropped window moves, 1e-2-1e-1);
- a model with a state along the row (every such family transformers ships, ``families.STATEFUL``) packs with its
  state layers run one example per row, and gives the same loss and gradients as padded batches; a state layer the
  hooks do not reach is caught by the self-test, and the run pads;
- the self-test fires when the attention is made wrong on purpose, or when a layer leaks along the row that no rule
  names (the architecture released next month).
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from families import FAMILIES, STATEFUL, Examples, tiny_model

import anyfit.model.attention as attention
from anyfit.data.batching import IGNORE_INDEX, collate, to_device
import anyfit.model.state_layers as state_layers
from anyfit.model.attention import register
from anyfit.training.loss import token_loss_sum
from anyfit.training.packing_check import choose_packing

TOLERANCE = 1e-5


def _examples(vocab: int = 512) -> Examples:
    g = torch.Generator().manual_seed(1)
    out = Examples()
    for length in (20, 5, 30, 12, 3, 17):  # most longer than the window of 8
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        prompt = length // 4
        out.append({"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]})
    return out


def _loss_and_grads(model, batches) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    total = sum(token_loss_sum(model, b) for b in batches)
    total.backward()
    return float(total.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-12))


def _decide(model, examples):
    return choose_packing(model, examples, rows=functools.partial(collate, pad_id=0), max_length=64, device="cpu",
                          compute_dtype=torch.float32,
                          autocast=contextlib.nullcontext)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in STATEFUL])
def test_packed_equals_padded(family):
    register()
    examples = _examples()
    model = tiny_model(family, "anyfit_varlen")
    verdict = _decide(model, examples)
    assert verdict.packed, verdict.line
    assert verdict.error <= verdict.tolerance
    # anyfit's per-example attention for every family it can split; chunked attention hands over to transformers
    assert verdict.attention == ("sdpa" if family == "llama4" else "anyfit_varlen"), verdict.line
    reference = tiny_model(family)  # transformers' own attention, padded batches
    _packed_equals_padded(model, reference, examples, family)


def _packed_equals_padded(model, reference, examples, family: str) -> None:
    """Three packed micro-batches of ``model`` against the same examples padded through ``reference``: the summed
    loss and every gradient within TOLERANCE."""
    micro = [examples[:2], examples[2:5], examples[5:]]
    loss, grads = _loss_and_grads(model, [collate(m, 0, packed=True) for m in micro])
    ref_loss, ref_grads = _loss_and_grads(reference, [collate(m, 0) for m in micro])
    assert abs(loss - ref_loss) <= TOLERANCE * abs(ref_loss)
    assert grads.keys() == ref_grads.keys()
    worst = max(_relative(grads[n], ref_grads[n]) for n in grads)
    assert worst <= TOLERANCE, f"{family}: gradients differ by {worst:.1e}"


def _stateful_model(family: str, attn_implementation: str | None = None):
    """The family's tiny model, skipped where this transformers does not ship it (the lower-bounds job)."""
    try:
        return tiny_model(family, attn_implementation)
    except (KeyError, ValueError) as why:
        pytest.skip(f"{family} is not in this transformers: {why}")


@pytest.mark.parametrize("family", STATEFUL)
def test_state_layers_pack_exactly(family):
    """The state layers run one example per row (transformers' CPU fallbacks ignore the kernels' boundary keywords,
    or refuse them), attention per example on the packed row: the loss and gradients of padded batches (the same
    TOLERANCE: the state layers compute the very rows padded batches give them)."""
    register()
    examples = _examples()
    model = _stateful_model(family, "anyfit_varlen")
    verdict = _decide(model, examples)
    assert verdict.packed and verdict.state == state_layers.PER_EXAMPLE, verdict.line
    assert "run one example per row" in verdict.line and "\n" not in verdict.line
    reference = _stateful_model(family)
    _packed_equals_padded(model, reference, examples, family)


def test_state_layers_under_gradient_checkpointing():
    """Checkpointing recomputes each decoder layer in the backward: its state layers see the row's boundaries again."""
    register()
    examples = _examples()
    model = tiny_model("qwen3_5", "anyfit_varlen")
    assert _decide(model, examples).packed
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    micro = [examples[:3], examples[3:]]
    loss, grads = _loss_and_grads(model, [collate(m, 0, packed=True) for m in micro])
    ref_loss, ref_grads = _loss_and_grads(tiny_model("qwen3_5").train(), [collate(m, 0) for m in micro])
    assert abs(loss - ref_loss) <= TOLERANCE * abs(ref_loss)
    assert max(_relative(grads[n], ref_grads[n]) for n in grads) <= TOLERANCE


def test_a_state_layer_the_hooks_miss_is_caught(monkeypatch):
    """A state layer no rule finds (the hooks reach none) leaks across the boundary: the self-test sees it, and the
    run pads, in one line."""
    register()
    monkeypatch.setattr(state_layers, "state_modules", lambda model: [])
    model = tiny_model("qwen3_5", "anyfit_varlen")
    verdict = _decide(model, _examples())
    assert not verdict.packed and verdict.line.startswith("packing: off, padded batches"), verdict.line
    assert "run one example per row" in verdict.line and "\n" not in verdict.line
    assert model.config._attn_implementation == verdict.attention == "sdpa"
    row = collate(_examples()[:2], 0, packed=True)  # no hook left on the model: the packed row leaks as before
    assert not any(m._forward_pre_hooks for m in model.modules())
    assert row["packed_lengths"]


def test_kernels_that_ignore_the_boundaries_are_not_trusted():
    """LFM2's short convolution leaks only two positions into the next example: on a fresh tiny model that stays
    under fp32's tolerance (1e-4), yet far above the per-example round-off, so the kernels' way is refused."""
    register()
    verdict = _decide(tiny_model("lfm2", "anyfit_varlen"), _examples())
    assert verdict.state == state_layers.PER_EXAMPLE and verdict.error < 1e-6, verdict.line


def test_packing_would_leak_the_state(family="qwen3_5"):
    """Why: packed, the second example reads the first one's state (transformers' own attention too)."""
    model = tiny_model(family).eval()
    a, b = _examples()[:2]
    with torch.no_grad():
        row = collate([a, b], 0, packed=True)
        packed = model(input_ids=row["input_ids"], position_ids=row["position_ids"], use_cache=False).logits[0]
        alone = model(input_ids=torch.tensor([b["input_ids"]]), use_cache=False).logits[0]
    assert _relative(packed[len(a["input_ids"]):], alone) > 1e-2


def test_self_test_hands_a_wrong_attention_to_transformers(monkeypatch):
    """The window dropped on purpose: the self-test sees it and hands the model to transformers' own SDPA."""
    register()
    monkeypatch.setattr(attention, "layer_window", lambda module, kwargs: None)
    examples = _examples()
    model = tiny_model("mistral", "anyfit_varlen")
    verdict = _decide(model, examples)
    assert verdict.packed and verdict.attention == "sdpa", verdict.line
    assert "anyfit_varlen differs from one example at a time" in verdict.line
    assert model.config._attn_implementation == "sdpa"


def test_self_test_falls_back_to_padding_for_a_leak_no_rule_names():
    """A layer that leaks along the row whatever the attention (a running mean over positions, as a new kind of
    state layer would): neither attention passes, the run pads."""
    register()
    model = tiny_model("llama", "anyfit_varlen")

    def leak(module, args, output):
        return output + 0.5 * output.cumsum(dim=1) / torch.arange(1, output.shape[1] + 1)[None, :, None]

    model.model.layers[0].mlp.register_forward_hook(leak)
    verdict = _decide(model, _examples())
    assert not verdict.packed and verdict.line.startswith("packing: off, padded batches"), verdict.line
    # padded rows through transformers' own attention (anyfit_varlen gains nothing there)
    assert model.config._attn_implementation == verdict.attention == "sdpa"


def test_self_test_of_a_compiled_model_compiles_nothing():
    """Under runtime.compile the self-test runs the model eagerly: through the compiled wrapper its no-grad probes and
    transformers' own attention would each compile the whole model again before the first step."""
    register()
    graphs = []

    def counting_backend(graph, example_inputs):  # torch.compile's documented custom-backend form
        graphs.append(graph)
        return graph.forward

    model = tiny_model("qwen3", "anyfit_varlen")
    verdict = _decide(torch.compile(model, backend=counting_backend, dynamic=True), _examples())
    assert verdict.packed and verdict.error is not None and graphs == []
    assert model.config._attn_implementation == "anyfit_varlen"


def test_skipping_the_self_test_says_so():
    register()
    verdict = choose_packing(tiny_model("mistral", "anyfit_varlen"), _examples(), functools.partial(collate, pad_id=0),
                             64, "cpu", torch.float32,
                             check=False)
    assert verdict.packed and "not self-tested" in verdict.line


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["qwen3", "mistral", "gemma3", "gpt_oss", "gemma2"])
def test_packed_equals_padded_on_cuda_in_bf16(family):
    """On CUDA in bf16 the packed path is varlen FlashAttention (with its window_size for sliding layers) or the
    model's own eager attention per example; the self-test passes and the summed loss matches padded batches to
    bf16's round-off (8 bits of mantissa over a sum of ~80 token losses: 1e-2 relative)."""
    register()
    examples = _examples()
    model = tiny_model(family, "anyfit_varlen").cuda()
    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    verdict = choose_packing(model, examples, functools.partial(collate, pad_id=0), 64, "cuda", torch.bfloat16,
                             autocast)
    assert verdict.packed and verdict.attention == "anyfit_varlen", verdict.line
    reference = tiny_model(family).cuda()
    micro = [examples[:2], examples[2:5], examples[5:]]
    with autocast():
        loss = sum(float(token_loss_sum(model, to_device(collate(m, 0, packed=True), "cuda"))) for m in micro)
        ref = sum(float(token_loss_sum(reference, to_device(collate(m, 0), "cuda"))) for m in micro)
    assert abs(loss - ref) <= 1e-2 * abs(ref), (loss, ref, verdict.line)
