"""Greedy generation with the transformers back end: batching, padding and stopping change nothing."""

import pytest
import torch

from anyfit.evaluation.inference import GenerationParams, TransformersBackend


def greedy_generate(model, tokenizer, prompts, max_new_tokens, batch_size):
    params = GenerationParams(max_new_tokens=max_new_tokens, chat=True)
    return [c.text for c in TransformersBackend(model, tokenizer, batch_size).generate(prompts, params)]


def render_chat_prompt(tokenizer, prompt):
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)

PROMPTS = [
    "What is 59 + 63?",
    "Hi",
    "Sam has 12 apples and picks 30 more. How many apples does Sam have now? Put the final answer in \\boxed{}.",
    "Compute 7 - 2.",
    "A much longer prompt, so that the batch really needs left padding: " + "word " * 20,
]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(tiny_llama_dir)


def test_batched_equals_one_at_a_time(tiny):
    model, tok = tiny
    one = greedy_generate(model, tok, PROMPTS, max_new_tokens=12, batch_size=1)
    four = greedy_generate(model, tok, PROMPTS, max_new_tokens=12, batch_size=4)
    assert one == four
    assert all(isinstance(s, str) and s for s in one)


def test_deterministic_and_restores_training_mode(tiny):
    model, tok = tiny
    model.train()
    a = greedy_generate(model, tok, PROMPTS, max_new_tokens=8, batch_size=3)
    b = greedy_generate(model, tok, PROMPTS, max_new_tokens=8, batch_size=3)
    assert a == b
    assert model.training


def test_matches_a_plain_greedy_loop(tiny):
    """The first prompt, decoded by hand without KV cache or padding: the same tokens."""
    model, tok = tiny
    ids = tok(render_chat_prompt(tok, PROMPTS[0]), add_special_tokens=False, return_tensors="pt")["input_ids"]
    n = ids.shape[1]
    model.eval()
    with torch.no_grad():
        for _ in range(6):
            nxt = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            if nxt.item() == tok.eos_token_id:
                break
    expected = tok.decode(ids[0, n:], skip_special_tokens=True)
    assert greedy_generate(model, tok, PROMPTS, max_new_tokens=6, batch_size=5)[0] == expected


def test_stops_at_eos(tiny):
    """A model whose favourite token is EOS stops at once: empty completions."""
    model, tok = tiny
    bias = torch.zeros(model.config.vocab_size)
    bias[tok.eos_token_id] = 1e4
    hook = model.lm_head.register_forward_hook(lambda module, inputs, out: out + bias)
    try:
        assert greedy_generate(model, tok, PROMPTS[:2], max_new_tokens=5, batch_size=2) == ["", ""]
    finally:
        hook.remove()


def test_bad_batch_size(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="batch_size"):
        greedy_generate(model, tok, PROMPTS, max_new_tokens=2, batch_size=0)
